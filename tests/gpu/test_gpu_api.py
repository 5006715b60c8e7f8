"""GPU tier, part "api": the whole API suite on CUDA tensors through NCCL.

Each case is checked against a reference computed with torch on the CPU (api_worker.py), and
at 2 ranks every exact output must equal torch's own nccl backend's on the same case (torch's
nccl skips what it cannot run; tests/workers/api_plan.py says which, and why). One rank,
eager init with subgroups split at 3 ranks, and nonblocking communicators at 2 ranks (also
compared with torch's nccl) run the suite once more each; all five runs start together.

Ranks beyond the number of GPUs share one with a distinct NCCL_HOSTID each (NCCL's socket
transport). Every run has a hard limit below the part's budget (tests/gpu/tier.py).
"""

from __future__ import annotations

import json

import pytest
import torch

from gpu.tier import GPU_TIER_BUDGETS_S
from mp import WorkersFailed, gpu_count, start_ranks
from workers.api_plan import compare_runs, failed_case_names

pytestmark = pytest.mark.gpu

BUDGET_S = GPU_TIER_BUDGETS_S["api"]
# All runs at once: ~10 s to start the ranks, 1-3 s of NCCL init over sockets, ~1,100 cases
# of a few milliseconds each (10 processes time-slicing one GPU), and the large (1M-element)
# cases' CPU references.
SUBPROCESS_LIMITS_S = {"suite runs": 100}


def _start(tmp_path, backend, world, *extra, env=None):
    name = f"{backend.replace(':', '_').replace(',', '+')}-{world}-{'-'.join(extra) or 'lazy'}"
    out = tmp_path / (name + "".join(f"-{k}={v}" for k, v in (env or {}).items()))
    # A rank with failed cases exits 1: the tests report its summary, which says more than
    # its exit code. A rank that crashes still ends the run early (fail_fast).
    job = start_ranks("api_worker.py", world, ["--backend", backend, "--device", "cuda", "--suite", "full",
                                               "--out", str(out), *extra],
                      timeout=SUBPROCESS_LIMITS_S["suite runs"], share_gpu=world > gpu_count(), env=env,
                      expect_success=False, fail_fast=True, log_dir=str(out) + "-logs")
    return job, out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run of the part, started together (10 processes on 16 cores and one GPU): the
    wall time of the slowest, not the sum of five process starts and suites."""
    tmp = tmp_path_factory.mktemp("api")
    started = {
        "ours": _start(tmp, "cupycoll", 2),
        # torch's nccl is the reference, not under test: a case it gets wrong is left out of
        # the comparison (and printed), not a failure
        "reference": _start(tmp, "nccl", 2),
        "one_rank": _start(tmp, "cupycoll", 1),
        # device_id: the communicator is made at init, subgroups with ncclCommSplit; an odd
        # world size gives uneven reduce-scatter and all-to-all splits
        "eager_split": _start(tmp, "cpu:gloo,cuda:cupycoll", 3, "--device-id"),
        # every call may return ncclInProgress and is polled; made at init, so it is there
        "nonblocking": _start(tmp, "cupycoll", 2, "--device-id", env={"CUPYCOLL_NONBLOCKING": "1"}),
    }
    runs = {}
    try:
        for name, (job, out) in started.items():
            try:
                runs[name] = (job.wait(), out)
            except WorkersFailed as exc:  # a hang or crash fails the tests of this run only
                runs[name] = (exc, out)
    finally:
        for job, _ in started.values():
            job.kill()
    return runs


def _summaries(run):
    results, out = run
    if isinstance(results, WorkersFailed):
        pytest.fail(str(results), pytrace=False)
    missing = [r.rank for r in results if not (out / f"rank{r.rank}.json").exists()]
    assert not missing, f"ranks {missing} did not finish the suite (logs: {out}-logs)\n" + "\n".join(
        f"--- rank {r.rank}: exit {r.returncode}\n{r.stderr[-4000:]}" for r in results)
    return [json.loads((out / f"rank{r.rank}.json").read_text()) for r in results]


def _assert_clean(summary, rank):
    assert summary["failures"] == [], (rank, summary["failures"][:20])
    assert summary["errors"] == {}, (rank, summary["errors"])  # every coalescing form works on CUDA
    assert summary["skipped"] == {}, (rank, summary["skipped"])
    assert summary["cases"] > 500, (rank, summary["cases"])


def test_api_suite_at_two_ranks(runs):
    for rank, summary in enumerate(_summaries(runs["ours"])):
        _assert_clean(summary, rank)
        # lazy init: the communicator is made by the first collective, blocking by default
        assert summary["communicator"] == "blocking", (rank, summary["communicator"])


def test_api_suite_matches_torch_nccl(runs):
    _matches_torch_nccl(runs, "ours")


def _matches_torch_nccl(runs, name):
    _, ours_out = runs[name]
    _, ref_out = runs["reference"]
    ref = _summaries(runs["reference"])
    for rank in range(2):
        assert ref[rank]["skipped"], "the reference skipped nothing: api_plan.reference_lacks not applied"
        if ref[rank]["failures"]:
            print(f"reference (torch nccl) rank {rank} failed {len(ref[rank]['failures'])} cases, "
                  f"left out of the comparison:", *ref[rank]["failures"][:20], sep="\n  ")
        compared, mismatches = compare_runs(torch.load(ours_out / f"rank{rank}.pt", weights_only=True),
                                            torch.load(ref_out / f"rank{rank}.pt", weights_only=True),
                                            exclude=failed_case_names(ref[rank]["failures"]))
        assert mismatches == [], (rank, mismatches[:20])
        assert compared > 400, (rank, compared)


def test_api_suite_on_one_rank(runs):
    # NCCL's one-rank paths (fp8 AVG among them: issued as SUM)
    _assert_clean(_summaries(runs["one_rank"])[0], 0)


def test_api_suite_eager_init_and_split(runs):
    for rank, summary in enumerate(_summaries(runs["eager_split"])):
        _assert_clean(summary, rank)


def test_api_suite_with_nonblocking_communicators_matches_torch_nccl(runs):
    for rank, summary in enumerate(_summaries(runs["nonblocking"])):
        assert summary["communicator"] == "nonblocking", (rank, summary["communicator"])
        _assert_clean(summary, rank)
    _matches_torch_nccl(runs, "nonblocking")
