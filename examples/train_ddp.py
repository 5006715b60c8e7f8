"""Train a small MLP with DistributedDataParallel on the cupycoll backend.

Run it with torchrun, one process per rank:

    torchrun --standalone --nproc-per-node 2 examples/train_ddp.py                  # 2 GPUs
    torchrun --standalone --nproc-per-node 2 examples/train_ddp.py --share-gpu      # 1 GPU
    torchrun --standalone --nproc-per-node 2 examples/train_ddp.py --device cpu     # no GPU

``--compare nccl`` (or ``--compare gloo`` on CPU) then trains the same model again, from the
same initial weights on the same data, with that backend, and checks that both runs end with
the same parameters. ``--compile [BACKEND]`` runs both under ``torch.compile``.
``--params-out FILE`` saves the first run's final parameters (rank 0, ``torch.save``), to
compare runs made in separate processes.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from typing import Dict, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import cupycoll  # registers the "cupycoll" backend with torch.distributed

FEATURES, HIDDEN, SAMPLES_PER_RANK = 16, 64, 512


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="cupycoll",
                   help='any init_process_group backend string, e.g. "cpu:gloo,cuda:cupycoll" (default: cupycoll)')
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare", metavar="BACKEND",
                   help="train again with this backend (nccl, gloo) and compare the parameters")
    p.add_argument("--tolerance", type=float, default=1e-5,
                   help="largest parameter difference --compare accepts (default: 1e-5, fp32)")
    p.add_argument("--share-gpu", action="store_true",
                   help="let several ranks share one GPU (each rank gets its own NCCL_HOSTID)")
    p.add_argument("--compile", metavar="BACKEND", nargs="?", const="inductor", default=None,
                   help="torch.compile the DDP model with this torch.compile backend (inductor "
                        "when none is named; aot_eager compiles fast), in both runs of --compare")
    p.add_argument("--params-out", metavar="FILE",
                   help="save the first run's final parameters and loss to FILE (rank 0, torch.save)")
    p.add_argument("--lazy-init", action="store_true",
                   help="do not pass device_id: communicators are created at the first collective")
    return p.parse_args()


def fail(message: str) -> None:
    print(f"{os.path.basename(sys.argv[0])}: error: {message}", file=sys.stderr)
    sys.exit(2)


def pick_device(args) -> torch.device:
    if args.device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            fail(f"--device cuda, but this torch ({torch.__version__}) was built without CUDA; "
                 "install a CUDA-enabled torch, or pass --device cpu")
        fail("--device cuda, but no CUDA GPU is visible (check the driver and CUDA_VISIBLE_DEVICES), "
             "or pass --device cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.share_gpu:
        index = local_rank % torch.cuda.device_count()
    elif local_rank < torch.cuda.device_count():
        index = local_rank
    else:
        fail(f"local rank {local_rank} has no GPU of its own ({torch.cuda.device_count()} visible); "
             "start fewer ranks per node or pass --share-gpu")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, 1),
    )


def make_data(seed: int, rank: int):
    """Synthetic regression data: a fixed random teacher, a different shard per rank."""
    teacher = torch.randn(FEATURES, 1, generator=torch.Generator().manual_seed(seed)) / FEATURES**0.5
    shard = torch.Generator().manual_seed(seed + 1 + rank)
    x = torch.randn(SAMPLES_PER_RANK, FEATURES, generator=shard)
    y = torch.sin(x @ teacher) + 0.1 * torch.randn(SAMPLES_PER_RANK, 1, generator=shard)
    return x, y


def train(args, backend: str, store, device, initial_state, data):
    """One training run on a fresh process group; returns (final parameters, final loss)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world,
        device_id=device if device.type == "cuda" and not args.lazy_init else None,
    )
    model = make_model().to(device)
    model.load_state_dict(initial_state)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    forward = torch.compile(ddp, backend=args.compile) if args.compile else ddp
    if args.optimizer == "sgd":
        optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    else:
        optimizer = torch.optim.Adam(ddp.parameters(), lr=args.lr)
    x, y = (t.to(device) for t in data)
    batches = len(x) // args.batch_size

    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        i = (step - 1) % batches * args.batch_size
        optimizer.zero_grad()
        loss = F.mse_loss(forward(x[i:i + args.batch_size]), y[i:i + args.batch_size])
        loss.backward()  # DDP all-reduces the gradients through the process group
        optimizer.step()
        if step % args.log_every == 0 or step == args.steps:
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            mean_loss = mean_loss.item() / world
            if rank == 0:
                print(f"[{backend}] step {step:4d}  loss {mean_loss:.6f}", flush=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if rank == 0:
        print(f"[{backend}] {args.steps} steps on {world} ranks ({device.type}) "
              f"in {time.perf_counter() - start:.2f} s, final loss {mean_loss:.6f}", flush=True)
    params = [p.detach().cpu().clone() for p in model.parameters()]
    # Free DDP before its group: DDP's reducer holds the group, and DDP sits in a reference
    # cycle, so only the garbage collector frees it. The loss's autograd graph refers to DDP
    # too.
    del ddp, forward, optimizer, loss
    if args.compile:
        torch._dynamo.reset()  # the compiled code refers to this run's DDP and group
    gc.collect()
    dist.destroy_process_group()
    return params, mean_loss


def share_gpu_env(rank, environ=None, nodename: Optional[str] = None) -> Dict[str, str]:
    """What --share-gpu sets for ``rank`` before NCCL starts.

    NCCL refuses two ranks on one GPU unless they look like different hosts, so each rank
    gets a host id of its own, always (one inherited from the environment would be the same
    on every rank). NCCL then talks to the other "hosts" over the network: it prefers
    InfiniBand/RoCE to the loopback socket whenever the machine has an HCA, and it skips the
    loopback interface unless told to use it; the gloo group (cupycoll's side group, and the
    gloo half of "cpu:gloo,cuda:cupycoll") stays on loopback too, so a hostname that resolves
    to a dead interface cannot stall the rendezvous. Those three keep a value the user set.
    """
    environ = os.environ if environ is None else environ
    env = {"NCCL_HOSTID": f"{nodename or os.uname().nodename}-rank{rank}"}
    for name, default in (("NCCL_SOCKET_IFNAME", "lo"), ("NCCL_IB_DISABLE", "1"), ("GLOO_SOCKET_IFNAME", "lo")):
        env[name] = environ.get(name, default)
    return env


def main() -> int:
    args = parse_args()
    if args.share_gpu:
        os.environ.update(share_gpu_env(os.environ.get("RANK", 0)))
    for name, default in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                          ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        os.environ.setdefault(name, default)  # without torchrun: one rank
    device = pick_device(args)

    torch.manual_seed(args.seed)
    initial_state = make_model().state_dict()
    data = make_data(args.seed, int(os.environ["RANK"]))
    # One store for both runs, each run under its own prefix: the second process group must
    # not read the keys the first one left behind.
    store, _, _ = next(dist.rendezvous("env://"))

    try:
        params, loss = train(args, args.backend, dist.PrefixStore("run1/", store),
                             device, initial_state, data)
        if args.params_out and int(os.environ["RANK"]) == 0:
            torch.save({"backend": args.backend, "params": params, "loss": loss}, args.params_out)
        if not args.compare:
            return 0
        ref_params, ref_loss = train(args, args.compare, dist.PrefixStore("run2/", store),
                                     device, initial_state, data)
    except (cupycoll.MissingDependencyError, cupycoll.NoCudaDeviceError) as exc:
        fail(str(exc))

    diff = max((a - b).abs().max().item() for a, b in zip(params, ref_params))
    ok = diff <= args.tolerance
    if int(os.environ["RANK"]) == 0:
        print(f"final loss: {args.backend} {loss:.6f}, {args.compare} {ref_loss:.6f}")
        print(f"max |param difference| {args.backend} vs {args.compare}: {diff:.3e} "
              f"(tolerance {args.tolerance:g}): {'OK' if ok else 'FAILED'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
