"""CPU tier: the benchmark's #wrong check against an independent simulation of each collective.

For every collective, placement, op and a few types and world sizes: fill each simulated
rank's buffers as the benchmark does, compute the collective's result here with plain torch
on the stacked inputs, store it where the collective would, and expect 0 wrong elements;
then damage one output element and expect exactly 1.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import calls, catalog, checks, metrics  # noqa: E402

pytestmark = pytest.mark.any_stack  # its subject is the same on every stack: one CI leg runs it

ROOT_RANK = 1


def _reduce(stacked: torch.Tensor, op: str, dtype: torch.dtype) -> torch.Tensor:
    """What NCCL would produce, computed another way (on the dtype's values)."""
    if op in ("band", "bor", "bxor"):
        fn = {"band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}[op]
        return functools.reduce(fn, stacked.to(torch.int64).unbind(0)).to(dtype)
    wide = stacked.to(torch.float64)
    if op == "sum":
        out = wide.sum(0)
    elif op == "mulsum":  # PreMulSum: each rank's input times the factor, then the sum
        out = (wide * catalog.MULSUM_FACTOR).sum(0)
    elif op == "prod":
        out = wide.prod(0)
    elif op == "max":
        out = wide.amax(0)
    elif op == "min":
        out = wide.amin(0)
    elif op == "avg":
        out = wide.mean(0)
    else:
        raise AssertionError(op)
    if not dtype.is_floating_point:
        out = out.to(torch.int64)  # integer wrap-around happens in the cast below
    return out.to(dtype)


def _simulate(collective, op, world, bufs, dtype, root):
    sends = [b.send.clone() for b in bufs]
    c = bufs[0].count
    if collective == "all_reduce":
        result = _reduce(torch.stack(sends), op, dtype)
        for b in bufs:
            b.recv.copy_(result)
    elif collective == "reduce":
        bufs[root].recv.copy_(_reduce(torch.stack(sends), op, dtype))
    elif collective == "broadcast":
        for b in bufs:
            b.recv.copy_(sends[root])
    elif collective == "reduce_scatter":
        full = _reduce(torch.stack(sends), op, dtype)
        for r, b in enumerate(bufs):
            b.recv.copy_(full[r * c:(r + 1) * c])
    elif collective == "all_gather":
        for b in bufs:
            b.recv.copy_(torch.cat(sends))
    elif collective == "all_to_all":
        for r, b in enumerate(bufs):
            b.recv.copy_(torch.cat([sends[s][r * c:(r + 1) * c] for s in range(world)]))
    elif collective == "sendrecv":
        for r, b in enumerate(bufs):
            b.recv.copy_(sends[(r - 1) % world])


CASES = []
for _collective in catalog.COLLECTIVES:
    for _placement in calls.PLACEMENTS[_collective]:
        _ops = (["sum", "prod", "max", "min", "avg", "mulsum", "band", "bxor"]
                if _collective in catalog.REDUCING else ["none"])
        for _op in _ops:
            for _dtype in ("float", "int8", "bfloat16", "uint8", "half", "f8e4m3", "f8e5m2"):
                if _op in catalog.BITWISE_OPS and catalog.DTYPES[_dtype][2] == "float":
                    continue
                if _op == "mulsum" and catalog.DTYPES[_dtype][2] != "float":
                    continue
                CASES.append((_collective, _placement, _op, _dtype))


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("collective,placement,op,dtype_name", CASES)
def test_check_agrees_with_simulation(collective, placement, op, dtype_name, world):
    dtype = calls.torch_dtype(dtype_name)
    typesize = catalog.DTYPES[dtype_name][1]
    lay = metrics.layout(collective, 96 * world * typesize, typesize, world)
    root = ROOT_RANK
    bufs = [calls.make_buffers(collective, lay, dtype, torch.device("cpu"), placement, r) for r in range(world)]
    for r, b in enumerate(bufs):
        checks.prepare(collective, op, r, world, root, b)
    # before the collective, every rank with a defined output sees wrong elements
    assert sum(checks.count_wrong(collective, op, r, world, root, b) for r, b in enumerate(bufs)) > 0
    _simulate(collective, op, world, bufs, dtype, root)
    for r, b in enumerate(bufs):
        assert checks.count_wrong(collective, op, r, world, root, b) == 0, (r, b.recv)
    victim = root if collective == "reduce" else world - 1
    last = bufs[victim].recv.view(-1)[-1:]
    if typesize == 1 and dtype.is_floating_point:  # float8: no arithmetic on CPU, coarse steps
        last.copy_(-(last.to(torch.float32) + 5))  # inputs are never negative
    else:
        last += 5  # out of every input's range
    assert checks.count_wrong(collective, op, victim, world, root, bufs[victim]) == 1


def test_check_catches_a_misplaced_chunk():
    """Chunk contents depend on the rank and offset: a reduce_scatter handing every rank
    block 0 is caught, even though each block is a correct reduction of something."""
    world, dtype = 4, torch.float32
    lay = metrics.layout("reduce_scatter", 4096, 4, world)
    bufs = [calls.make_buffers("reduce_scatter", lay, dtype, torch.device("cpu"), "out-of-place", r)
            for r in range(world)]
    for r, b in enumerate(bufs):
        checks.prepare("reduce_scatter", "sum", r, world, 0, b)
    full = torch.stack([b.send for b in bufs]).sum(0)
    for b in bufs:
        b.recv.copy_(full[:lay.count])
    assert checks.count_wrong("reduce_scatter", "sum", 0, world, 0, bufs[0]) == 0
    assert checks.count_wrong("reduce_scatter", "sum", 2, world, 0, bufs[2]) > lay.count // 2


def test_check_works_in_slices(monkeypatch):
    monkeypatch.setattr(checks, "CHUNK", 7)
    world, dtype = 2, torch.float16
    lay = metrics.layout("all_reduce", 200, 2, world)
    bufs = [calls.make_buffers("all_reduce", lay, dtype, torch.device("cpu"), "in-place", r) for r in range(world)]
    for r, b in enumerate(bufs):
        checks.prepare("all_reduce", "sum", r, world, 0, b)
    total = bufs[0].send + bufs[1].send
    for b in bufs:
        b.recv.copy_(total)
    assert checks.count_wrong("all_reduce", "sum", 0, world, 0, bufs[0]) == 0
