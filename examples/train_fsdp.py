"""Train a small transformer-like model with FSDP2 on the cupycoll backend: fully sharded
data parallel alone, or tensor parallel inside it on a 2-D device mesh, then save and load
it with torch.distributed.checkpoint (DCP).

Run it with torchrun, one process per rank:

    torchrun --standalone --nproc-per-node 2 examples/train_fsdp.py                  # 2 GPUs
    torchrun --standalone --nproc-per-node 2 examples/train_fsdp.py --share-gpu      # 1 GPU
    torchrun --standalone --nproc-per-node 2 examples/train_fsdp.py --device cpu     # no GPU
    torchrun --standalone --nproc-per-node 4 examples/train_fsdp.py --mesh 2x2       # TP + FSDP2
    torchrun --standalone --nproc-per-node 4 examples/train_fsdp.py --mesh hsdp:2x2  # HSDP

``--precision fp32 bf16`` trains once per precision, one run after the other on the same
group, each from the same initial weights on the same data; ``bf16`` is FSDP2's
``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``. ``--mesh DPxTP``
shards the attention and MLP projections over TP ranks (column-wise in, row-wise out) and
the whole model over DP ranks; ``--mesh hsdp:RxS`` is HSDP on a replicate x shard mesh (FSDP2
on the 2-D mesh: sharded over S ranks, replicated over R); several meshes train one after
another. ``--checkpoint DIR``
saves the first run of each mesh (model and optimizer) with DCP, loads it into a model and
optimizer initialised differently, and checks that the loaded state equals the saved one.
``--compare BACKEND`` (nccl, gloo) then does it all again on that backend, in the same
processes, and checks that every run ends with the same parameters (``--tolerance``).
``--params-out FILE`` saves every run's final full parameters and losses (rank 0,
``torch.save``), to compare runs made in separate processes. Exit status 1 when a
comparison or a checkpoint check fails.

Needs torch >= 2.6 (``fully_shard`` and ``MixedPrecisionPolicy`` public in
``torch.distributed.fsdp``); an older torch gets a message and exit status 2.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import time
from typing import Dict, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

import cupycoll  # registers the "cupycoll" backend with torch.distributed
from train_ddp import pick_device, share_gpu_env  # the same device choice and GPU sharing

try:  # torch >= 2.6
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
except ImportError:
    MixedPrecisionPolicy = fully_shard = None

IN_FEATURES, DIM, HEADS, HIDDEN, LAYERS, SEQ = 16, 64, 4, 256, 2, 16
HEAD_DIM = DIM // HEADS
PRECISIONS = {"fp32": None, "bf16": (torch.bfloat16, torch.float32)}  # (param dtype, reduce dtype)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="cupycoll",
                   help='any init_process_group backend string, e.g. "cuda:cupycoll", "nccl", "gloo" '
                        "(default: cupycoll)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--mesh", nargs="+", default=None, metavar="DP[xTP]",
                   help="data-parallel ranks, DPxTP for tensor parallel inside FSDP2, or hsdp:RxS for HSDP "
                        "(replicated over R, sharded over S); several: the runs of each in turn (default: every "
                        "rank data parallel)")
    p.add_argument("--precision", nargs="+", choices=sorted(PRECISIONS), default=["fp32"],
                   help="one training run per precision (and mesh), in this order (default: fp32)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per data-parallel rank and step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0, help="the group's timeout in seconds")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="save the first run of each mesh (model and optimizer) with DCP under DIR, load it into "
                        "a model and optimizer initialised differently, and check the loaded state")
    p.add_argument("--compare", metavar="BACKEND",
                   help="train again with this backend (nccl, gloo) and compare the parameters of every run")
    p.add_argument("--tolerance", type=float, default=1e-6,
                   help="largest parameter difference --compare accepts (default: 1e-6)")
    p.add_argument("--params-out", metavar="FILE",
                   help="save every run's final full parameters and losses to FILE (rank 0, torch.save)")
    p.add_argument("--share-gpu", action="store_true",
                   help="let several ranks share one GPU (each rank gets its own NCCL_HOSTID)")
    p.add_argument("--lazy-init", action="store_true",
                   help="do not pass device_id: communicators are created at the first collective")
    return p.parse_args(argv)


def fail(message: str, status: int = 2) -> None:
    print(f"train_fsdp.py: error: {message}", file=sys.stderr)
    sys.exit(status)


HSDP = "hsdp:"


def mesh_shape(text: str, world: int) -> Tuple[int, int, bool]:
    """(first dimension, second dimension, HSDP) from one of ``--mesh`` ("2", "2x2": DP x TP;
    "hsdp:2x2": replicate x shard)."""
    hsdp = text.lower().startswith(HSDP)
    try:
        dims = [int(d) for d in text.lower()[len(HSDP) if hsdp else 0:].split("x")]
    except ValueError:
        dims = []
    if len(dims) not in ((2,) if hsdp else (1, 2)) or min(dims) < 1:
        fail(f"--mesh {text}: give DP, DPxTP or hsdp:RxS, positive numbers (e.g. 2x2)")
    dp, tp = (dims + [1])[:2]
    if dp * tp != world:
        fail(f"--mesh {text}: {dp} x {tp} = {dp * tp} ranks, but there are {world}")
    if not hsdp and (HEADS % tp or HIDDEN % tp):
        fail(f"--mesh {text}: the model's {HEADS} heads and {HIDDEN} hidden features must split over {tp} TP ranks")
    return dp, tp, hsdp


class Attention(torch.nn.Module):
    """Causal self-attention written out in matmuls (deterministic on every device, unlike
    the fused kernels' backward). Under TP each rank holds HEADS / TP heads: q, k and v are
    column-wise shards, so their local width decides the head count."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(DIM, DIM) for _ in range(3))
        self.out = torch.nn.Linear(DIM, DIM)

    def forward(self, x):
        batch, seq, _ = x.shape
        q, k, v = (proj(x).view(batch, seq, -1, HEAD_DIM).transpose(1, 2) for proj in (self.q, self.k, self.v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(HEAD_DIM)
        future = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
        weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        return self.out((weights @ v).transpose(1, 2).reshape(batch, seq, -1))


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_norm, self.attn = torch.nn.LayerNorm(DIM), Attention()
        self.mlp_norm = torch.nn.LayerNorm(DIM)
        self.up, self.down = torch.nn.Linear(DIM, HIDDEN), torch.nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(IN_FEATURES, DIM)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.head = torch.nn.LayerNorm(DIM), torch.nn.Linear(DIM, 1)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_data(seed: int, dp_rank: int, samples: int):
    """Synthetic sequence regression: a fixed random teacher, a different shard per
    data-parallel rank (the TP ranks of one DP rank see the same data, as TP needs)."""
    teacher = torch.randn(IN_FEATURES, 1, generator=torch.Generator().manual_seed(seed)) / IN_FEATURES**0.5
    shard = torch.Generator().manual_seed(seed + 1 + dp_rank)
    x = torch.randn(samples, SEQ, IN_FEATURES, generator=shard)
    y = torch.sin(x @ teacher).cumsum(dim=1) / SEQ + 0.1 * torch.randn(samples, SEQ, 1, generator=shard)
    return x, y


def make_mesh(device: torch.device, dp: int, tp: int, hsdp: bool = False):
    from torch.distributed.device_mesh import init_device_mesh

    if hsdp:
        return init_device_mesh(device.type, (dp, tp), mesh_dim_names=("replicate", "shard"))
    if tp == 1:
        return init_device_mesh(device.type, (dp,), mesh_dim_names=("dp",))
    return init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp"))


def build(mesh, device: torch.device, seed: int, precision: str):
    """The model from ``seed``'s weights, tensor parallel over the mesh's "tp" dimension if it
    has one, fully sharded over its "dp" dimension (each block, then the whole); on an HSDP
    mesh (replicate x shard) FSDP2 over the whole mesh."""
    torch.manual_seed(seed)
    model = Model().to(device)  # initialised on the CPU: the same weights on every device
    if "tp" in (mesh.mesh_dim_names or ()):
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
                "attn.out": RowwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], plan)
    dtypes = PRECISIONS[precision]
    policy = MixedPrecisionPolicy() if dtypes is None else MixedPrecisionPolicy(param_dtype=dtypes[0],
                                                                                reduce_dtype=dtypes[1])
    dp_mesh = mesh["dp"] if "dp" in (mesh.mesh_dim_names or ()) and mesh.ndim > 1 else mesh
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    return model


def make_optimizer(model, lr: float):
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def full_parameters(model) -> Dict[str, torch.Tensor]:
    """Every parameter whole, on the CPU (a collective over the mesh: every rank calls it)."""
    return {name: p.full_tensor().detach().float().cpu() for name, p in model.named_parameters()}


def layouts(model) -> Dict[str, str]:
    """How each parameter is laid out over the mesh: its DTensor's mesh dimensions and
    placements (a projection under TP inside FSDP2 is sharded over both)."""
    return {name: f"{tuple(p.device_mesh.mesh_dim_names or ())} {tuple(p.placements)}"
            for name, p in model.named_parameters()}


# Before torch 2.11 gloo's reduce_scatter sums whatever op it is given, where FSDP2 asks for
# the mean over the DP ranks: the gradients are DP times too large. SGD's step (momentum
# included) is linear in the gradient, so the learning rate divided by DP gives the steps of
# a gloo that averages; bit for bit where DP is 2 (the mean of two is their sum halved,
# exactly). tests/multiproc/test_fsdp_example.py checks it against cupycoll's CPU route, which
# averages on every torch.
GLOO_SUMS_FSDP_MEANS = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 11)

# torch 2.7.1's FSDP2 runs HSDP's all-reduce only on an accelerator (its post-backward asserts a
# CUDA event on CPU tensors, any backend); 2.11 runs it on CPU too. 2.8 - 2.10 are not run.
HSDP_ON_CPU = not GLOO_SUMS_FSDP_MEANS


def learning_rate(args, backend: str, device: torch.device, dp: int) -> float:
    """--lr, or --lr / DP where the run's CPU tensors go to a gloo that sums FSDP2's means."""
    parts = backend.replace(" ", "").lower().split(",")
    on_gloo = device.type == "cpu" and ("gloo" in parts or "cpu:gloo" in parts)
    return args.lr / dp if on_gloo and GLOO_SUMS_FSDP_MEANS else args.lr


def train(args, backend: str, mesh, device, dp_rank: int, precision: str):
    """One training run; (model, optimizer, the mean loss of each step)."""
    model = build(mesh, device, args.seed, precision)
    dp = mesh["dp"].size() if "tp" in (mesh.mesh_dim_names or ()) else mesh.size()
    lr = learning_rate(args, backend, device, dp)
    optimizer = make_optimizer(model, lr)
    x, y = (t.to(device) for t in make_data(args.seed, dp_rank, args.batch_size * args.steps))
    losses = []
    start = time.perf_counter()
    for step in range(args.steps):
        batch = slice(step * args.batch_size, (step + 1) * args.batch_size)
        optimizer.zero_grad()
        loss = F.mse_loss(model(x[batch]).float(), y[batch])
        loss.backward()  # FSDP2 reduce-scatters the gradients over the DP ranks
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.get_rank() == 0:
        note = f", lr {args.lr:g} / {dp} DP ranks (this gloo sums FSDP2's means)" if lr != args.lr else ""
        print(f"[{backend} {precision}] {args.steps} steps on mesh {tuple(mesh.shape)} ({device.type}) in "
              f"{time.perf_counter() - start:.2f} s, loss {losses[0]:.6f} -> {losses[-1]:.6f}{note}", flush=True)
    return model, optimizer, losses


def _flatten(value, prefix: str, out: Dict[str, object]) -> Dict[str, object]:
    """A state dict as path -> this rank's value: tensors (a DTensor's local shard) cloned to
    the CPU, everything else as it is."""
    if isinstance(value, dict):
        for key, item in value.items():
            _flatten(item, f"{prefix}/{key}", out)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _flatten(item, f"{prefix}/{index}", out)
    elif isinstance(value, torch.Tensor):
        local = value.to_local() if hasattr(value, "to_local") else value
        out[prefix] = local.detach().cpu().clone()
    else:
        out[prefix] = value
    return out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    return a == b


def checkpoint_round_trip(args, backend: str, mesh, device, precision: str, model, optimizer,
                          directory: str) -> Dict[str, object]:
    """Save ``model`` and ``optimizer`` with DCP, load them into a model and optimizer built
    from another seed, and compare this rank's state with what it saved. A check that could
    not fail (the second model already equal to the first) is reported as such."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    saved = _flatten({"model": model_state, "optim": optim_state}, "", {})
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=directory)

    other = build(mesh, device, args.seed + 1, precision)
    other_optimizer = make_optimizer(other, args.lr)
    model_state, optim_state = get_state_dict(other, other_optimizer)  # the optimizer's state made here
    before = _flatten({"model": model_state, "optim": optim_state}, "", {})
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(other, other_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    after = _flatten(dict(zip(("model", "optim"), get_state_dict(other, other_optimizer))), "", {})

    tensors = [k for k, v in saved.items() if isinstance(v, torch.Tensor)]
    mismatches = sorted(k for k in set(saved) | set(after) if not _same(saved.get(k), after.get(k)))
    differed = sum(not _same(saved[k], before.get(k)) for k in tensors)
    # every rank's verdict, so that every rank fails together
    counts = torch.tensor([len(mismatches), differed, len(tensors)], device=device, dtype=torch.int64)
    dist.all_reduce(counts)
    result = {"tensors": int(counts[2]), "mismatches": int(counts[0]), "differed_before_load": int(counts[1]),
              "rank0_mismatched_keys": mismatches[:20]}
    if dist.get_rank() == 0:
        print(f"[{backend}] DCP: {result['tensors']} tensors saved (all ranks), {result['differed_before_load']} "
              f"differed in the other model before the load, {result['mismatches']} differ after it", flush=True)
    return result


def mesh_name(dp: int, tp: int, hsdp: bool = False) -> str:
    return f"{HSDP}{dp}x{tp}" if hsdp else f"{dp}x{tp}" if tp > 1 else str(dp)


def train_on(args, backend: str, store, device, shapes) -> Dict[str, object]:
    """Every run of every mesh on a fresh process group of ``backend``: {"runs": {"MESH
    PRECISION": {"params", "losses", "layouts"}}, "checkpoints": {"MESH": the round trip's
    counts}}."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout),
                            device_id=device if device.type == "cuda" and not args.lazy_init else None)
    runs, checkpoints = {}, {}
    for dp, tp, hsdp in shapes:
        mesh = make_mesh(device, dp, tp, hsdp)
        # the rank's data shard: among the DP ranks (TP ranks share one), every rank's under HSDP
        dp_rank = dist.get_rank() if hsdp else mesh["dp"].get_local_rank() if tp > 1 else mesh.get_local_rank()
        for index, precision in enumerate(args.precision):
            model, optimizer, losses = train(args, backend, mesh, device, dp_rank, precision)
            runs[f"{mesh_name(dp, tp, hsdp)} {precision}"] = {"params": full_parameters(model), "losses": losses,
                                                        "layouts": layouts(model)}
            if index == 0 and args.checkpoint:
                directory = os.path.join(args.checkpoint, backend.replace(":", "-").replace(",", "_"),
                                         mesh_name(dp, tp, hsdp).replace(":", "-"))
                checkpoints[mesh_name(dp, tp, hsdp)] = checkpoint_round_trip(args, backend, mesh, device, precision,
                                                                       model, optimizer, directory)
            del model, optimizer
    dist.barrier()
    dist.destroy_process_group()
    return {"runs": runs, "checkpoints": checkpoints}


def largest_difference(params: Dict[str, torch.Tensor], reference: Dict[str, torch.Tensor]) -> float:
    assert params.keys() == reference.keys(), (sorted(params), sorted(reference))
    return max((params[name] - reference[name]).abs().max().item() for name in params)


def main(argv=None) -> int:
    args = parse_args(argv)
    if fully_shard is None:
        fail(f"FSDP2 needs torch >= 2.6 (fully_shard and MixedPrecisionPolicy in torch.distributed.fsdp); "
             f"this is torch {torch.__version__}")
    if args.share_gpu:
        os.environ.update(share_gpu_env(os.environ.get("RANK", 0)))
    for name, default in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                          ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        os.environ.setdefault(name, default)  # without torchrun: one rank
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    shapes = [mesh_shape(text, world) for text in args.mesh or [str(world)]]
    if args.device == "cpu" and not HSDP_ON_CPU and any(hsdp for _, _, hsdp in shapes):
        fail(f"--mesh hsdp:...: torch {torch.__version__}'s FSDP2 runs HSDP on CUDA only (2.11 runs it on CPU)")
    if args.compare == args.backend:
        fail(f"--compare {args.compare}: the backend trained first; compare with another")
    device = pick_device(args)
    # One store for every backend, each under its own prefix: a second process group must
    # not read the keys the first one left behind.
    store, _, _ = next(dist.rendezvous("env://"))

    results: Dict[str, object] = {}
    try:
        for backend in filter(None, (args.backend, args.compare)):
            results[backend] = train_on(args, backend, dist.PrefixStore(f"{backend}/", store), device, shapes)
    except (cupycoll.MissingDependencyError, cupycoll.NoCudaDeviceError) as exc:
        fail(str(exc))
    if args.params_out and rank == 0:
        torch.save({"device": device.type, "backends": results}, args.params_out)

    problems = [f"{backend}: the state loaded from the DCP checkpoint of mesh {mesh} is not the state saved: {c}"
                for backend, result in results.items() for mesh, c in result["checkpoints"].items()
                if c["mismatches"] or not c["differed_before_load"]]
    if args.compare:
        ours, reference = results[args.backend]["runs"], results[args.compare]["runs"]
        for run in ours:
            diff = largest_difference(ours[run]["params"], reference[run]["params"])
            ok = diff <= args.tolerance
            if rank == 0:
                print(f"max |param difference| {args.backend} vs {args.compare} [{run}]: {diff:.3e} "
                      f"(tolerance {args.tolerance:g}): {'OK' if ok else 'FAILED'}", flush=True)
            if not ok:
                problems.append(f"{run}: parameters differ by {diff:.3e} (tolerance {args.tolerance:g})")
    if problems:
        fail("; ".join(problems), status=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
