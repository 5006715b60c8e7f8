"""ReduceOp.AVG on the CPU route (cupycoll.cpu_average): gloo cannot average integers, and
callers send AVG anyway (Lightning's ``self.log(..., sync_dist=True)`` averages an int64
count with it on any backend not named "gloo"). cupycoll sums with gloo and divides: integers
toward zero, as NCCL's ncclAvg on the CUDA route, floats as gloo's own AVG. Three ranks in
processes (tests/workers/average_worker.py), through every reduction and coalesced form.
"""

from __future__ import annotations

import json

import pytest
import torch

from cupycoll import compat
from cupycoll.cpu_average import as_sum, divide
from mp import run_ranks

pytestmark = pytest.mark.launches

WORLD = 3


def _values(rank, dtype):
    return torch.tensor([rank + 1, -(rank + 1), 7 * rank + 2, 4], dtype=dtype)


def _average(tensors):
    """NCCL's AVG: the sum, divided toward zero for integers."""
    total = sum(t.to(torch.float64) for t in tensors) if tensors[0].is_floating_point() else sum(tensors)
    if tensors[0].is_floating_point():
        return (total / WORLD).to(tensors[0].dtype)
    return torch.div(total, WORLD, rounding_mode="trunc")


def _expected(rank):
    def of(dtype):
        return _average([_values(r, dtype) for r in range(WORLD)]).tolist()

    def scattered(rank):
        return _average([_values(r, torch.int64)[:2] + rank for r in range(WORLD)]).tolist()

    uint8 = [torch.tensor([r + 1, (-(r + 1)) % 256, 7 * r + 2, 4], dtype=torch.uint8) for r in range(WORLD)]
    return {
        "all_reduce int64": [of(torch.int64)],
        "all_reduce int64 async": [of(torch.int64)],
        "all_reduce uint8": [torch.div(sum(t.to(torch.int64) for t in uint8) % 256, WORLD,
                                       rounding_mode="trunc").tolist()],
        "all_reduce float32": [of(torch.float32)],
        "all_reduce float16": [of(torch.float16)],
        "lightning": [(sum(r + 2 for r in range(WORLD))) // WORLD],
        "reduce": [of(torch.int64)] if rank == 0 else [[]],
        "reduce_scatter": [scattered(rank)],
        "reduce_scatter_tensor": [scattered(rank)],
        "all_reduce_coalesced": [of(torch.int64), of(torch.int64)[1:]],
        "coalescing manager": [of(torch.int64), of(torch.int64)[:3], scattered(rank)],
        "after": [of(torch.float32)],
    }


@pytest.fixture(scope="module")
def reports(tmp_path_factory, once_per_run):
    def launch():
        out = tmp_path_factory.mktemp("average")
        run_ranks("average_worker.py", WORLD, args=[str(out)], timeout=120)
        return {rank: json.loads((out / f"rank{rank}.json").read_text(encoding="utf-8")) for rank in range(WORLD)}
    return once_per_run("cpu-average", launch)


# torch 2.7.1's gloo has no list-form reduce_scatter at all (2.11's has; 2.8 - 2.10 are not run):
# there the call fails as on plain gloo, whatever the op.
GLOO_LACKS_REDUCE_SCATTER = compat.TORCH < (2, 11)


def _check_averages(got, rank):
    for case, expected in _expected(rank).items():
        if GLOO_LACKS_REDUCE_SCATTER and case in ("reduce_scatter", "coalescing manager") and "raised" in got[case]:
            assert "does not support reduce_scatter" in got[case]["text"], (rank, case, got[case])
            continue
        assert "raised" not in got[case], (rank, case, got[case])
        assert got[case]["values"] == expected, (rank, case, got[case], expected)


def test_every_reduction_averages_integers_toward_zero_as_nccl_does(reports):
    for rank in range(WORLD):
        _check_averages(reports[rank]["default"], rank)
        # bool has no average: gloo's own error, as NCCL refuses it too
        assert "raised" in reports[rank]["default"]["all_reduce bool"], reports[rank]


@pytest.mark.skipif(not compat.PY_BACKEND, reason=f"torch {torch.__version__} has no Backend shape (2.14 added it)")
def test_the_backend_shape_averages_where_cpu_calls_reach_cupycoll_and_not_on_torchs_gloo(reports):
    for rank in range(WORLD):
        _check_averages(reports[rank]["backend"], rank)
        # "cpu:gloo,cuda:cupycoll" in the Backend shape: torch's own gloo serves CPU tensors,
        # and fails on an integer AVG as plain gloo does (README: use "cupycoll" or the
        # ProcessGroup shape)
        gloos = reports[rank]["backend cpu:gloo"]
        assert gloos["lightning"]["raised"] and "can't be cast" in gloos["lightning"]["text"], gloos
        assert gloos["all_reduce float32"]["values"] == [_expected(rank)["all_reduce float32"][0]], gloos


def test_the_division_and_the_options_copy():
    t = torch.tensor([7, -7, 8], dtype=torch.int32)
    divide(t, 2)
    assert t.tolist() == [3, -3, 4] and t.dtype == torch.int32  # toward zero, in place
    f = torch.tensor([7.0, -7.0], dtype=torch.bfloat16)
    divide(f, 2)
    assert f.tolist() == [3.5, -3.5]
    import torch.distributed as dist

    opts = dist.ReduceOptions()
    opts.reduceOp, opts.rootRank = dist.ReduceOp.AVG, 2
    summed = as_sum(opts)
    assert summed.reduceOp == dist.ReduceOp.SUM and summed.rootRank == 2 and summed.timeout == opts.timeout
    assert opts.reduceOp == dist.ReduceOp.AVG  # the caller's options are left alone
