"""One rank of the gloo pair behind tests/test_compat.py's gloo tests: runs every case of
CASES, each in a fresh two-rank gloo group, and saves what each returned (or the error it
raised) to ``<out_dir>/rank<R>.pt``.

The two ranks are processes, as in real use. They once were two threads of the test
process sharing a HashStore; on torch 2.11 that crashed the whole suite now and then
(SIGSEGV inside gloo's _reduce_scatter_base, never reproduced alone). A worker process that
crashes fails its tests with its stderr, and the suite goes on.

usage: gloo_compat_worker.py OUT_DIR   (RANK, WORLD_SIZE=2, MASTER_ADDR/PORT from tests/mp.py)
"""

from __future__ import annotations

import datetime
import os
import sys
from typing import Callable, Dict, Tuple

import torch
import torch.distributed as dist

from cupycoll import compat

OPS = ("SUM", "MAX", "MIN", "PRODUCT")


def rank_input(rank: int) -> torch.Tensor:
    """The reduce-scatter input of ``rank``: six values, so each rank keeps three."""
    return torch.tensor([[1.0, 5.0, 2.0], [3.0, 2.0, 4.0]])[rank].repeat_interleave(2)


def exchange(uneven: bool) -> Callable:
    def run(group, rank):
        # rank r sends r*10 + p to peer p, shaped (p + 1, 2) when uneven, else (2, 2)
        inputs = [torch.full((p + 1 if uneven else 2, 2), float(rank * 10 + p)) for p in range(2)]
        outputs = [torch.zeros(rank + 1 if uneven else 2, 2) for _ in range(2)]
        work = compat.gloo_alltoall(group, outputs, inputs, dist.AllToAllOptions())
        assert work.wait()
        return outputs
    return run


def plain_alltoall(group, rank):
    """gloo's own list alltoall: None where it works, else its error text."""
    try:
        group.alltoall([torch.zeros(1), torch.zeros(1)], [torch.ones(1), torch.ones(1)],
                       dist.AllToAllOptions()).wait()
    except RuntimeError as exc:
        return str(exc)
    return None


def reduce_scatter(op: str, raw: bool = False) -> Callable:
    def run(group, rank):
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = getattr(dist.ReduceOp, op)
        out = torch.zeros(3)
        if raw:
            group._reduce_scatter_base(out, rank_input(rank), opts).wait()
        else:
            compat.gloo_reduce_scatter_tensor(group, out, rank_input(rank), opts).wait()
        return out
    return run


def average(dtype: torch.dtype) -> Callable:
    """gloo's own all_reduce with ReduceOp.AVG: the tensor, or gloo's error."""
    def run(group, rank):
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.AVG
        t = torch.tensor([1 + rank, 4 + 3 * rank], dtype=dtype)
        group.allreduce([t], opts).wait()
        return t
    return run


# name -> (compat flags set for the case, what each rank runs)
CASES: Dict[str, Tuple[Dict[str, bool], Callable]] = {
    "alltoall": ({}, exchange(uneven=False)),
    "alltoall_fallback_even": ({"GLOO_HAS_ALLTOALL": False}, exchange(uneven=False)),
    "alltoall_fallback_uneven": ({"GLOO_HAS_ALLTOALL": False}, exchange(uneven=True)),
    "plain_alltoall": ({}, plain_alltoall),
    "reduce_scatter_base_MAX": ({}, reduce_scatter("MAX", raw=True)),
    "reduce_scatter_fallback_AVG": ({"GLOO_REDUCE_SCATTER_HONOURS_OP": False}, reduce_scatter("AVG")),
    "average_float32": ({}, average(torch.float32)),
    "average_int64": ({}, average(torch.int64)),
}
for _op in OPS:
    CASES[f"reduce_scatter_{_op}"] = ({}, reduce_scatter(_op))
    CASES[f"reduce_scatter_fallback_{_op}"] = ({"GLOO_REDUCE_SCATTER_HONOURS_OP": False}, reduce_scatter(_op))


def main() -> int:
    out_dir = sys.argv[1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    results = {}
    for name, (flags, run) in CASES.items():
        saved = {flag: getattr(compat, flag) for flag in flags}
        group = dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, world,
                                      datetime.timedelta(seconds=30))
        try:
            for flag, value in flags.items():
                setattr(compat, flag, value)
            results[name] = {"value": run(group, rank)}
        except Exception as exc:  # noqa: BLE001 - the test reports it for this case alone
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            for flag, value in saved.items():
                setattr(compat, flag, value)
            compat.shutdown(group)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    print(f"rank {rank}: {len(results)} cases, "
          f"{sum('error' in r for r in results.values())} raised")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
