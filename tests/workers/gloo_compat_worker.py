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


def reduce_scatter_list(op: str, scalar: bool = False) -> Callable:
    """The list form through compat.gloo_reduce_scatter: rank_input's halves as the rank's two
    inputs, each (1, 3) (or, ``scalar``, its first two values as 0-d tensors)."""
    def run(group, rank):
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = getattr(dist.ReduceOp, op)
        if scalar:
            inputs, out = list(rank_input(rank)[:2].unbind()), torch.zeros(())
        else:
            inputs, out = list(rank_input(rank).view(2, 1, 3).unbind()), torch.zeros(1, 3)
        compat.gloo_reduce_scatter(group, [out], [inputs], opts).wait()
        return out
    return run


def plain_reduce_scatter(group, rank):
    """gloo's own list reduce_scatter: None where it works, else its error text."""
    try:
        group.reduce_scatter([torch.zeros(1)], [[torch.ones(1), torch.ones(1)]],
                             dist.ReduceScatterOptions()).wait()
    except RuntimeError as exc:
        return str(exc)
    return None


def refused(form: str, output: Callable, inputs: Callable, op: str = "MAX") -> Callable:
    """A fallback's call (``form``: "list" or "tensor") with tensors gloo refuses; the value
    "sent" where it did not raise."""
    def run(group, rank):
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = getattr(dist.ReduceOp, op)
        call = compat.gloo_reduce_scatter if form == "list" else compat.gloo_reduce_scatter_tensor
        call(group, output(), inputs(), opts)
        return "sent"
    return run


_INT = torch.int64
# list form, two ranks: (outputs, input lists, what the error names)
LIST_REFUSED = {
    "two outputs": (lambda: [torch.zeros(3), torch.zeros(3)], lambda: [[torch.ones(3)] * 2] * 2,
                    "2 outputs and input lists of [2, 2] tensors in a group of 2"),
    "one input": (lambda: [torch.zeros(3)], lambda: [[torch.ones(3)]], "input lists of [1] tensors in a group of 2"),
    "a longer input": (lambda: [torch.zeros(3)], lambda: [[torch.ones(3), torch.ones(4)]],
                       "input 1 is float32(4,), the output float32(3,)"),
    "an integer input": (lambda: [torch.zeros(3)], lambda: [[torch.ones(3, dtype=_INT), torch.ones(3)]],
                         "input 0 is int64(3,), the output float32(3,)"),
}
LIST_REFUSED_NAMED = {name: named for name, (_, _, named) in LIST_REFUSED.items()}
# tensor form, two ranks: (output, input)
TENSOR_REFUSED = {
    "too few elements": (lambda: torch.zeros(3), lambda: torch.ones(5)),
    "another dtype": (lambda: torch.zeros(3), lambda: torch.ones(6, dtype=_INT)),
    "the chunks along another dimension": (lambda: torch.zeros(1, 3), lambda: torch.ones(1, 6)),
    "one dimension more": (lambda: torch.zeros(3), lambda: torch.ones(2, 3)),
    "0-d tensors": (lambda: torch.zeros(()), lambda: torch.ones(())),
    "a 0-d input": (lambda: torch.zeros(3), lambda: torch.ones(())),
}


def average(dtype: torch.dtype) -> Callable:
    """gloo's own all_reduce with ReduceOp.AVG: the tensor, or gloo's error."""
    def run(group, rank):
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.AVG
        t = torch.tensor([1 + rank, 4 + 3 * rank], dtype=dtype)
        group.allreduce([t], opts).wait()
        return t
    return run


# name -> (the gates of compat.gloo, where its fallbacks read them, set for the case; what each rank runs)
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
# the list form as torch 2.7.1 runs it: neither gloo's list form nor its op in reduce_scatter_tensor
_LIST_FALLBACK = {"GLOO_HAS_REDUCE_SCATTER": False, "GLOO_REDUCE_SCATTER_HONOURS_OP": False}
for _name, (_outputs, _inputs, _) in LIST_REFUSED.items():
    CASES[f"refused_list_{_name}"] = (_LIST_FALLBACK, refused("list", _outputs, _inputs))
for _name, (_output, _input) in TENSOR_REFUSED.items():
    for _op in ("SUM", "MAX"):
        CASES[f"refused_tensor_{_name}_{_op}"] = ({"GLOO_REDUCE_SCATTER_HONOURS_OP": False},
                                                  refused("tensor", _output, _input, _op))
CASES["plain_reduce_scatter"] = ({}, plain_reduce_scatter)
CASES["reduce_scatter_list_fallback_scalar_SUM"] = (_LIST_FALLBACK, reduce_scatter_list("SUM", scalar=True))
for _op in OPS:
    CASES[f"reduce_scatter_{_op}"] = ({}, reduce_scatter(_op))
    CASES[f"reduce_scatter_fallback_{_op}"] = ({"GLOO_REDUCE_SCATTER_HONOURS_OP": False}, reduce_scatter(_op))
    CASES[f"reduce_scatter_list_{_op}"] = ({}, reduce_scatter_list(_op))
    CASES[f"reduce_scatter_list_fallback_{_op}"] = (_LIST_FALLBACK, reduce_scatter_list(_op))


def main() -> int:
    out_dir = sys.argv[1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    results = {}
    for name, (flags, run) in CASES.items():
        saved = {flag: getattr(compat.gloo, flag) for flag in flags}
        group = dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, world,
                                      datetime.timedelta(seconds=30))
        try:
            for flag, value in flags.items():
                setattr(compat.gloo, flag, value)
            results[name] = {"value": run(group, rank)}
        except Exception as exc:  # noqa: BLE001 - the test reports it for this case alone
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            for flag, value in saved.items():
                setattr(compat.gloo, flag, value)
            compat.shutdown(group)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    print(f"rank {rank}: {len(results)} cases, "
          f"{sum('error' in r for r in results.values())} raised")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
