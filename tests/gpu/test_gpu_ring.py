"""GPU tier, part "ring": cupycoll's ring algorithm end to end (ranks share a GPU when there
are fewer GPUs than ranks, each with its own NCCL_HOSTID).

tests/workers/ring_worker.py drives ``dist.all_reduce`` and ``dist.reduce_scatter_tensor``
for every supported dtype x op x size and checks each result bitwise against
tests/ring_simulator.py's numpy model and loosely against torch; it checks bitwise
reproducibility over 10 runs and across ranks, and (selected through ``cupycoll.algorithm``)
that the ring's bf16 SUM error is no larger than NCCL's.

Three runs side by side: 3 ranks with a 64 KiB scratch limit, so a 65,539-element case
spans many pipelined rounds per chunk on two streams; 2 ranks with the default limit and a
2**20 + 3 element case (one round, the caller's stream alone: the default slicing below
128 MiB of partials per chunk); 1 rank, sizes up to 4096.
"""

from __future__ import annotations

import json

import pytest

from gpu.tier import GPU_TIER_BUDGETS_S
from mp import gpu_count, start_ranks, wait_all

pytestmark = pytest.mark.gpu

BUDGET_S = GPU_TIER_BUDGETS_S["ring"]
# ~10 s to start, NVRTC compiles (cached per process after the first: ~5 s for all pairs),
# ~670 cases; the 1M-element cases' simulator runs dominate (~0.1 s each on the CPU).
SUBPROCESS_LIMITS_S = {"ring run": 75}


def _start(tmp_path, world, select, *extra, env=None):
    out = tmp_path / f"ring-{select}-{world}"
    job = start_ranks("ring_worker.py", world, ["--select", select, "--out", str(out), *extra],
                      timeout=SUBPROCESS_LIMITS_S["ring run"], share_gpu=world > gpu_count(), env=env,
                      log_dir=str(out) + "-logs")
    return job, out


def _summaries(out, world):
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def test_ring_under_algorithm_context_and_options(tmp_path):
    pipelined = _start(tmp_path, 3, "context", "--large", str((1 << 16) + 3),
                       env={"CUPYCOLL_RING_SCRATCH_BYTES": str(64 << 10)})
    default = _start(tmp_path, 2, "options")
    alone = _start(tmp_path, 1, "options", "--quick")
    wait_all([pipelined[0], default[0], alone[0]])
    for (_, out), world in ((pipelined, 3), (default, 2), (alone, 1)):
        for rank, summary in enumerate(_summaries(out, world)):
            assert summary["failures"] == [], (out.name, rank, summary["failures"][:20])
            assert summary["cases"] > 500, (out.name, rank, summary["cases"])
    errors = _summaries(pipelined[1], 3)[0]["metrics"]["bf16_sum_error"]
    print("bf16 SUM |error| vs fp64, 3 ranks:", errors)
    assert errors["ring"]["max"] <= errors["nccl"]["max"]
    assert errors["ring"]["mean"] <= errors["nccl"]["mean"]
