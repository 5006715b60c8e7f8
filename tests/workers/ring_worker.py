"""One rank of the ring-algorithm suite: dist.all_reduce / dist.reduce_scatter_tensor on CUDA
tensors through cupycoll's ring kernels, checked against local references.

Every rank can compute every rank's inputs (a function of rank and case), so each result is
checked twice, locally: bitwise against ring_simulator's numpy model (the ring
computes exactly what it computes), and against a plain torch reduction (exact for integers
and bool, loosely for floating point, where the ring's order differs from torch's).

Usage: ring_worker.py --select context|options --out DIR [--quick] [--large N]
  context: the group is made with default options; calls run under cupycoll.algorithm("ring")
  options: the group is made with pg_options=cupycoll.Options(algorithm="ring")
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import os
import sys
import traceback
import zlib
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

import cupycoll
from cupycoll.ring.kernels import supports
from ring_simulator import simulate_all_reduce, simulate_reduce_scatter
from epilogue import end_suite

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
R = dist.ReduceOp

DTYPES = {
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
    "float64": torch.float64, "int8": torch.int8, "uint8": torch.uint8, "int32": torch.int32,
    "int64": torch.int64, "bool": torch.bool,
}
OPS = {"sum": R.SUM, "avg": R.AVG, "product": R.PRODUCT, "min": R.MIN, "max": R.MAX,
       "premul_sum": R.PREMUL_SUM, "band": R.BAND, "bor": R.BOR, "bxor": R.BXOR}
# 4096: an all-gather with no remainder at 2 ranks; the others leave one for a broadcast
SIZES = (0, 1, 7, 1001, 4096, (1 << 20) + 3)
PREMUL_FACTOR = 0.375  # exact in every floating dtype, so float and tensor factors agree
# The ring's scratch limit in this process (neither group passes one in its Options): the
# simulator plans with it, so it runs the very plans the ring runs.
SCRATCH = cupycoll.config.resolve(None).ring_scratch_bytes


def inputs_of(rank: int, n: int, dtype: str, op: str, case: int) -> torch.Tensor:
    """Rank ``rank``'s input: random, but a function of (rank, n, dtype, op, case)."""
    # zlib.crc32, not hash(): str hashes differ between processes, inputs must not
    seed = (zlib.crc32(f"{dtype}/{op}".encode()) + 7919 * rank + 104729 * case + n) % (2 ** 31)
    g = torch.Generator().manual_seed(seed)
    t = DTYPES[dtype]
    if t == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if t.is_floating_point:
        x = torch.randn(n, generator=g, dtype=torch.float64)
        if op == "product":
            x = 0.5 + torch.rand(n, generator=g, dtype=torch.float64)  # keep products in range
        return x.to(t)
    lo, hi = (-100, 100) if t in (torch.int8, torch.int32, torch.int64) else (0, 200)
    if op == "product":
        lo, hi = (-3, 4) if t != torch.uint8 else (0, 4)
    return torch.randint(lo, hi, (n,), generator=g, dtype=torch.int64).to(t)


def to_numpy(t: torch.Tensor, dtype: str) -> np.ndarray:
    t = t.detach().cpu()
    if dtype == "bfloat16":
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def torch_reference(tensors, dtype: str, op: str):
    ts = [t.double() if t.is_floating_point() else t for t in tensors]
    if dtype == "bool":
        if op in ("sum", "max", "bor"):
            return functools.reduce(torch.logical_or, ts)
        if op in ("product", "min", "band"):
            return functools.reduce(torch.logical_and, ts)
        return functools.reduce(torch.logical_xor, ts)
    if op in ("sum", "avg"):
        out = functools.reduce(torch.add, ts)
        if op == "avg":
            out = out / WORLD if out.is_floating_point() else torch.div(out, WORLD, rounding_mode="trunc")
        return out
    if op == "premul_sum":
        return functools.reduce(torch.add, [t * PREMUL_FACTOR for t in ts])
    fn = {"product": torch.mul, "min": torch.minimum, "max": torch.maximum,
          "band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}[op]
    return functools.reduce(fn, ts)


def torch_op(op: str, dtype: torch.dtype, device, tensor_factor: bool):
    if op != "premul_sum":
        return OPS[op]
    factor = torch.tensor([PREMUL_FACTOR], dtype=dtype, device=device) if tensor_factor else PREMUL_FACTOR
    return dist._make_nccl_premul_sum(factor)


class Suite:
    def __init__(self):
        self.failures = []
        self.cases = 0
        self.metrics = {}

    def fail(self, name, text):
        self.failures.append(f"{name}: {text}")

    def run(self, name, fn):
        self.cases += 1
        try:
            fn(name)
        except Exception as exc:  # noqa: BLE001 - reported through the summary
            traceback.print_exc()
            self.fail(name, f"raised {type(exc).__name__}: {exc}")


def bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.shape == b.shape and a.view(np.uint8).tobytes() == b.view(np.uint8).tobytes()


def compare(s: Suite, name, got: torch.Tensor, expected_sim: np.ndarray, reference: torch.Tensor,
            dtype: str):
    got_np = to_numpy(got, dtype)
    if not bits_equal(got_np, expected_sim):
        diff = np.flatnonzero(got_np.view(np.uint8) != np.ascontiguousarray(expected_sim).view(np.uint8))
        s.fail(name, f"differs from the simulator at byte {diff[:5]} "
                     f"(got {got_np[:6]}, simulator {expected_sim[:6]})")
    ref = reference.cpu()
    got_cpu = got.cpu()
    if got_cpu.is_floating_point():
        if not torch.allclose(got_cpu.double(), ref.double(), rtol=2e-2, atol=2e-2, equal_nan=True):
            s.fail(name, f"far from torch: got {got_cpu[:6].tolist()} expected {ref[:6].tolist()}")
    elif not torch.equal(got_cpu, ref.to(got_cpu.dtype)):
        s.fail(name, f"differs from torch: got {got_cpu[:6].tolist()} expected {ref[:6].tolist()}")


def sweep(s: Suite, device, ring_scope, sizes):
    for dtype in DTYPES:
        t = DTYPES[dtype]
        for op in OPS:
            if not supports(dtype, op):
                continue
            for n in sizes:
                for factor_kind in (("float", "tensor") if op == "premul_sum" else ("",)):
                    tag = f"{dtype}/{op}{'/' + factor_kind if factor_kind else ''}/{n}"
                    tensor_factor = factor_kind == "tensor"

                    def all_reduce_case(name, dtype=dtype, op=op, n=n, t=t, tensor_factor=tensor_factor):
                        ins = [inputs_of(r, n, dtype, op, 0) for r in range(WORLD)]
                        x = ins[RANK].to(device)
                        with ring_scope():
                            dist.all_reduce(x, op=torch_op(op, t, device, tensor_factor))
                        sim = simulate_all_reduce([to_numpy(i, dtype) for i in ins], op,
                                                  scratch_bytes=SCRATCH, dtype=dtype,
                                                  premul=PREMUL_FACTOR if op == "premul_sum" else None)
                        compare(s, name, x, sim[RANK], torch_reference(ins, dtype, op), dtype)
                    s.run(f"all_reduce/{tag}", all_reduce_case)

                    def reduce_scatter_case(name, dtype=dtype, op=op, n=n, t=t, tensor_factor=tensor_factor):
                        ins = [inputs_of(r, WORLD * n, dtype, op, 1) for r in range(WORLD)]
                        out = torch.empty(n, dtype=t, device=device)
                        with ring_scope():
                            dist.reduce_scatter_tensor(out, ins[RANK].to(device),
                                                       op=torch_op(op, t, device, tensor_factor))
                        sim = simulate_reduce_scatter([to_numpy(i, dtype) for i in ins], op,
                                                      scratch_bytes=SCRATCH, dtype=dtype,
                                                      premul=PREMUL_FACTOR if op == "premul_sum" else None)
                        full = torch_reference(ins, dtype, op)
                        compare(s, name, out, sim[RANK], full[RANK * n:(RANK + 1) * n], dtype)
                    s.run(f"reduce_scatter/{tag}", reduce_scatter_case)

    def in_place_out_of_place(name):
        # all_reduce is in place in torch; reduce_scatter_tensor in place: output is a view
        # of the input's block RANK
        n = 4099
        ins = [inputs_of(r, WORLD * n, "float16", "sum", 2) for r in range(WORLD)]
        buf = ins[RANK].to(device)
        out = buf[RANK * n:(RANK + 1) * n]
        with ring_scope():
            dist.reduce_scatter_tensor(out, buf)
        sim = simulate_reduce_scatter([to_numpy(i, "float16") for i in ins], "sum", scratch_bytes=SCRATCH)
        if not bits_equal(to_numpy(out, "float16"), sim[RANK]):
            s.fail(name, "in-place reduce_scatter differs from the simulator")
    s.run("reduce_scatter/in_place", in_place_out_of_place)


def reproducibility(s: Suite, device, ring_scope, n):
    def case(name):
        for dtype in ("float32", "bfloat16", "float16"):
            x0 = inputs_of(RANK, n, dtype, "sum", 3).to(device)
            digests = set()
            for _ in range(10):
                x = x0.clone()
                with ring_scope():
                    dist.all_reduce(x)
                digests.add(hashlib.sha256(to_numpy(x, dtype).tobytes()).hexdigest())
            if len(digests) != 1:
                s.fail(name, f"{dtype}: {len(digests)} different results over 10 runs")
            everyone = [None] * WORLD
            dist.all_gather_object(everyone, digests.pop())
            if len(set(everyone)) != 1:
                s.fail(name, f"{dtype}: ranks hold different bits")
    s.run("reproducible", case)


def bf16_error_vs_nccl(s: Suite, device, n):
    def case(name):
        ins = [inputs_of(r, n, "bfloat16", "sum", 4) for r in range(WORLD)]
        exact = functools.reduce(torch.add, [i.double() for i in ins])
        errors = {}
        for algorithm in ("ring", "nccl"):
            x = ins[RANK].to(device)
            with cupycoll.algorithm(algorithm):
                dist.all_reduce(x)
            err = (x.cpu().double() - exact).abs()
            errors[algorithm] = {"max": err.max().item(), "mean": err.mean().item()}
        s.metrics["bf16_sum_error"] = errors
        print(f"rank {RANK}: bf16 SUM over {WORLD} ranks, |error| vs fp64: "
              f"ring max {errors['ring']['max']:.3g} mean {errors['ring']['mean']:.3g}; "
              f"nccl max {errors['nccl']['max']:.3g} mean {errors['nccl']['mean']:.3g}")
        if errors["ring"]["max"] > errors["nccl"]["max"] or errors["ring"]["mean"] > errors["nccl"]["mean"]:
            s.fail(name, f"ring error exceeds NCCL's: {errors}")
    s.run("bf16_error", case)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--select", choices=["context", "options"], required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="sizes 0, 1, 7, 1001, 4096 only")
    ap.add_argument("--large", type=int, default=SIZES[-1],
                    help="the large size (default 2**20 + 3); with a small ring scratch limit "
                         "(CUPYCOLL_RING_SCRATCH_BYTES) a smaller one still spans many pipelined rounds")
    args = ap.parse_args()

    local = RANK % torch.cuda.device_count()
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    kwargs = dict(backend="cupycoll", timeout=timedelta(seconds=120), device_id=device)
    if args.select == "options":
        kwargs["pg_options"] = cupycoll.Options(algorithm="ring")
        ring_scope = contextlib.nullcontext
    else:
        ring_scope = functools.partial(cupycoll.algorithm, "ring")
    dist.init_process_group(**kwargs)

    s = Suite()
    sweep(s, device, ring_scope, SIZES[:-1] if args.quick else SIZES[:-1] + (args.large,))
    reproducibility(s, device, ring_scope, args.large)
    if args.select == "context" and WORLD > 1:
        bf16_error_vs_nccl(s, device, args.large)
    torch.cuda.synchronize()

    return end_suite(args.out, RANK, {"cases": s.cases, "failures": s.failures, "metrics": s.metrics})


if __name__ == "__main__":
    sys.exit(main())
