"""One rank of tests/test_cpu_average.py: ReduceOp.AVG on CPU tensors, integers included,
through every reduction of the CPU route, in each cupycoll group this torch can make.
Writes ``<OUT_DIR>/rank<R>.json``: group -> case -> the values, or the error raised.

usage: average_worker.py OUT_DIR   (RANK, WORLD_SIZE, MASTER_ADDR/PORT from tests/mp.py)

Groups: "default", the default group on ``"cupycoll"`` in the default shape; where torch has
the Backend shape, "backend" (a group on ``"cupycoll"`` in it: CPU calls reach cupycoll's
shell through its CpuView) and "backend cpu:gloo" (on ``"cpu:gloo,cuda:cupycoll"``, whose
CPU calls torch hands to its own gloo).
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist

from cupycoll import compat
from epilogue import write_json

AVG = dist.ReduceOp.AVG


def values(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Per rank: sums over 3 ranks that 3 does not divide, negative ones too (toward zero)."""
    return torch.tensor([rank + 1, -(rank + 1), 7 * rank + 2, 4], dtype=dtype)


def outcome(call):
    try:
        value = call()
    except Exception as exc:  # noqa: BLE001 - recorded
        return {"raised": type(exc).__name__, "text": str(exc).splitlines()[0][:200] if str(exc) else ""}
    if isinstance(value, torch.Tensor):
        value = [value]
    return {"values": [t.tolist() for t in value], "dtypes": [str(t.dtype) for t in value]}


def cases(group, rank: int, world: int) -> dict:
    def all_reduce(dtype, async_op=False):
        t = values(rank, dtype)
        work = dist.all_reduce(t, op=AVG, group=group, async_op=async_op)
        if async_op:
            work.wait()
        return t

    def lightnings():
        # Lightning's sync_dist on a backend not named "gloo": AVG on an int64 scalar
        count = torch.tensor(rank + 2, dtype=torch.long)
        dist.all_reduce(count, op=AVG, group=group, async_op=False)
        return count

    def reduce():
        t = values(rank, torch.int64)
        dist.reduce(t, dst=dist.get_global_rank(group, 0) if group is not None else 0, op=AVG, group=group)
        return t if rank == 0 else torch.zeros(0)

    def reduce_scatter_list():
        # chunk i of every rank goes to rank i: values[:2] + i
        out = torch.zeros(2, dtype=torch.int64)
        dist.reduce_scatter(out, [values(rank, torch.int64)[:2] + i for i in range(world)], op=AVG, group=group)
        return out

    def reduce_scatter_tensor():
        out = torch.zeros(2, dtype=torch.int64)
        inp = torch.cat([values(rank, torch.int64)[:2] + i for i in range(world)])
        dist.reduce_scatter_tensor(out, inp, op=AVG, group=group)
        return out

    def all_reduce_coalesced():
        ts = [values(rank, torch.int64), values(rank, torch.int64)[1:]]
        dist.all_reduce_coalesced(ts, op=AVG, group=group)
        return ts

    def coalescing_manager():
        # without a device, torch hands the captured calls over as one coalesced call each
        ts = [values(rank, torch.int64), values(rank, torch.int64)[:3]]
        with dist._coalescing_manager(group=group):
            for t in ts:
                dist.all_reduce(t, op=AVG, group=group)
        outs = [torch.zeros(2, dtype=torch.int64)]
        with dist._coalescing_manager(group=group):
            dist.reduce_scatter_tensor(outs[0], torch.cat([values(rank, torch.int64)[:2] + i
                                                           for i in range(world)]), op=AVG, group=group)
        return ts + outs

    return {
        "all_reduce int64": outcome(lambda: all_reduce(torch.int64)),
        "all_reduce int64 async": outcome(lambda: all_reduce(torch.int64, async_op=True)),
        "all_reduce uint8": outcome(lambda: all_reduce(torch.uint8)),
        "all_reduce float32": outcome(lambda: all_reduce(torch.float32)),
        "all_reduce float16": outcome(lambda: all_reduce(torch.float16)),
        "lightning": outcome(lightnings),
        "reduce": outcome(reduce),
        "reduce_scatter": outcome(reduce_scatter_list),
        "reduce_scatter_tensor": outcome(reduce_scatter_tensor),
        "all_reduce_coalesced": outcome(all_reduce_coalesced),
        "coalescing manager": outcome(coalescing_manager),
        "all_reduce bool": outcome(lambda: all_reduce(torch.bool)),
        "after": outcome(lambda: all_reduce(torch.float32)),  # the group still works
    }


def main() -> int:
    out_dir = sys.argv[1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("cupycoll", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
    report = {"default": cases(None, rank, world)}
    if compat.PY_BACKEND:
        os.environ["CUPYCOLL_SHAPE"] = "backend"  # read at each group's creation
        for name, backend in (("backend", "cupycoll"), ("backend cpu:gloo", "cpu:gloo,cuda:cupycoll")):
            group = dist.new_group(list(range(world)), backend=backend)
            report[name] = cases(group, rank, world)
            report[name]["type"] = type(group).__name__
    report["default type"] = type(dist.group.WORLD).__name__
    write_json(out_dir, f"rank{rank}.json", report)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
