"""GPU tier: cupycoll's ring algorithm end to end, world sizes 1-4 (ranks share a GPU when
there are fewer GPUs than ranks, each with its own NCCL_HOSTID).

tests/workers/ring_worker.py drives ``dist.all_reduce`` and ``dist.reduce_scatter_tensor``
for every supported dtype x op x size (0, 1, 7, 1001, 2**20 + 3) and checks each result
bitwise against cupycoll.ring_schedule's numpy simulator and loosely against torch; it
checks bitwise reproducibility over 10 runs and across ranks, and (selected through
``cupycoll.algorithm``) that the ring's bf16 SUM error is no larger than NCCL's.
"""

from __future__ import annotations

import json

import pytest

from mp import gpu_count, run_ranks

pytestmark = pytest.mark.gpu


def _run(tmp_path, world, select, *extra):
    out = tmp_path / f"ring-{select}-{world}"
    results = run_ranks("ring_worker.py", world, ["--select", select, "--out", str(out), *extra],
                        timeout=1500, share_gpu=world > gpu_count())
    for r in results:
        print(r.stdout)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ring_under_algorithm_context(tmp_path, world):
    summaries = _run(tmp_path, world, "context")
    for summary in summaries:
        assert summary["failures"] == [], summary["failures"][:20]
        assert summary["cases"] > 500
    if world == 4:
        errors = summaries[0]["metrics"]["bf16_sum_error"]
        print("bf16 SUM |error| vs fp64, 4 ranks:", errors)
        assert errors["ring"]["max"] <= errors["nccl"]["max"]
        assert errors["ring"]["mean"] <= errors["nccl"]["mean"]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ring_selected_by_options(tmp_path, world):
    for summary in _run(tmp_path, world, "options", "--quick"):
        assert summary["failures"] == [], summary["failures"][:20]
