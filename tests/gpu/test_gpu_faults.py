"""GPU tier, part "faults": faults for real. Three ranks on one GPU (NCCL_HOSTID), a 5 s group
timeout.

(a) a rank skips a collective (with the communicator made, and while the others create it);
(b) a rank is SIGKILLed mid-training; (c) abort() from another thread frees a stuck
all_reduce; (d) a rank never joins init; (e) init/abort cycles without growth of GPU memory,
threads or file descriptors; recovery three times in one process; (f) all of it with blocking
and nonblocking communicators.

Each mode is one launch of fault_worker.py's "suite" (every scenario in turn, one process
start), the two modes side by side; the tests then read what each scenario recorded.
"""

from __future__ import annotations

import json

import pytest

from gpu.tier import GPU_TIER_BUDGETS_S
from mp import WorkersFailed, gpu_count, start_ranks
from workers.fault_worker import SUITE, SUITE_CYCLES, TIMEOUT_S

pytestmark = pytest.mark.gpu

MODES = ["blocking", "nonblocking"]
WORLD = 3
GRACE_S = 5.0  # the bound: an error within timeout + 5 s

BUDGET_S = GPU_TIER_BUDGETS_S["faults"]
# One suite launch: ~10 s to start; 8 init/abort cycles (~2 s each over sockets); seven
# faults that each wait out the 5 s timeout (skip, skip_lazy, never_joins, three recoveries,
# killed) plus ~15 inits: ~80 s, both modes at once.
SUBPROCESS_LIMITS_S = {"suite launch": 105}


@pytest.fixture(scope="module")
def suites(tmp_path_factory):
    jobs, outs = {}, {}
    for mode in MODES:
        out = tmp_path_factory.mktemp(f"faults-{mode}")
        outs[mode] = out
        # the last rank is killed on purpose: exit codes are checked by the tests
        jobs[mode] = start_ranks("fault_worker.py", WORLD, ["suite", mode, str(out)],
                                 timeout=SUBPROCESS_LIMITS_S["suite launch"], share_gpu=WORLD > gpu_count(),
                                 expect_success=False, log_dir=str(out / "logs"))
    runs = {}
    try:
        for mode in MODES:
            try:
                runs[mode] = (jobs[mode].wait(), outs[mode])
            except WorkersFailed as exc:  # a hang fails this mode's tests only
                runs[mode] = (exc, outs[mode])
    finally:
        for job in jobs.values():
            job.kill()
    return runs


def _results(suites, mode):
    results, _ = suites[mode]
    if isinstance(results, WorkersFailed):
        pytest.fail(str(results), pytrace=False)
    return results


def _reports(suites, mode, scenario):
    """What each rank recorded for ``scenario``, and the ranks' output for messages. A launch
    that ran out of time still yields the scenarios finished before the hang."""
    results, out = suites[mode]
    reports = {}
    for rank in range(WORLD):
        path = out / f"{scenario}-rank{rank}.json"
        if path.exists():
            reports[rank] = json.loads(path.read_text())
    if isinstance(results, WorkersFailed):
        logs = str(results)
    else:
        logs = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) stderr:\n{r.stderr[-3000:]}" for r in results)
    for rank, report in reports.items():
        assert "crashed" not in report, f"{scenario} rank {rank}:\n{report['crashed']}"
    return reports, logs


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scenario", ["skip", "skip_lazy"])
def test_a_skipped_collective_errors_on_the_others_within_the_timeout(suites, mode, scenario):
    # skip_lazy: the others' first collective creates the communicator, and that creation
    # times out; it must fault the group like a timed-out collective (no retry)
    reports, logs = _reports(suites, mode, scenario)
    for rank in (0, 1):
        assert rank in reports, logs
        report = reports[rank]
        assert report["error"], f"rank {rank} saw no error"
        assert report["seconds"] < TIMEOUT_S + GRACE_S, report
        assert "Timeout" in report["error"] or "timed out" in report["error"], report["error"]
        assert report["later_error"] and "Aborted" in report["later_error"], report
        assert report["later_seconds"] < 0.5, report


@pytest.mark.parametrize("mode", MODES)
def test_a_killed_rank_makes_the_survivors_error_within_the_timeout(suites, mode):
    results = _results(suites, mode)
    reports, logs = _reports(suites, mode, "killed")
    assert results[WORLD - 1].returncode == -9, logs
    for rank in (0, 1):
        assert results[rank].returncode == 0, logs
        report = reports[rank]
        assert report["error"] and report["steps"] >= 20, report
        assert report["since_last_step"] < TIMEOUT_S + GRACE_S, report


@pytest.mark.parametrize("mode", MODES)
def test_abort_from_another_thread_frees_a_stuck_all_reduce(suites, mode):
    reports, logs = _reports(suites, mode, "abort_thread")
    assert 0 in reports, logs
    report = reports[0]
    assert report["release_after_abort_s"] < 2.0, report
    assert report["abort_call_s"] < 2.0, report
    assert "Aborted" in report["later_error"], report


@pytest.mark.parametrize("mode", MODES)
def test_a_rank_that_never_joins_makes_init_fail_after_the_timeout(suites, mode):
    reports, logs = _reports(suites, mode, "never_joins")
    for rank in (0, 1):
        assert rank in reports, logs
        report = reports[rank]
        assert report["error"] and "join" in report["error"], report
        assert TIMEOUT_S * 0.9 < report["seconds"] < TIMEOUT_S + GRACE_S, report


@pytest.mark.parametrize("mode", MODES)
def test_init_abort_cycles_leak_nothing(suites, mode):
    reports, logs = _reports(suites, mode, "cycles")
    assert sorted(reports) == list(range(WORLD)), logs
    for rank, report in reports.items():
        assert report["count"] == SUITE_CYCLES
        early, late = report["after_warm"], report["after_all"]
        # The ranks share the GPU: free memory is the device's, a leak would show per cycle.
        assert early["gpu_free"] - late["gpu_free"] < 256 << 20, (rank, early, late)
        assert late["threads"] <= early["threads"] + 2, (rank, early, late)
        assert late["fds"] <= early["fds"] + 4, (rank, early, late)


@pytest.mark.parametrize("mode", MODES)
def test_three_abort_and_recover_cycles_keep_training(suites, mode):
    reports, logs = _reports(suites, mode, "recover")
    assert sorted(reports) == list(range(WORLD)), logs
    assert reports[0]["faults"] and all(reports[0]["faults"]), reports[0]
    for report in reports.values():
        assert report["steps_after_recovery"] == [5, 5, 5]
        assert report["params_equal"]

