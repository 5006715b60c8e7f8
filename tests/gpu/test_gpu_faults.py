"""GPU tier: faults for real. Several ranks on one GPU (NCCL_HOSTID), a 5 s group timeout,
each test under its own hard timeout so that a regression fails instead of hanging.

(a) a rank skips a collective; (b) a rank is SIGKILLed mid-training; (c) abort() from
another thread frees a stuck all_reduce; (d) a rank never joins init; (e) 50 init/abort
cycles without growth of GPU memory, threads or file descriptors; recovery three times in
one process; (f) all of it with blocking and nonblocking communicators.
"""

from __future__ import annotations

import json

import pytest

from mp import gpu_count, run_ranks
from workers.fault_worker import TIMEOUT_S

pytestmark = pytest.mark.gpu

MODES = ["blocking", "nonblocking"]
GRACE_S = 5.0  # the bound: an error within timeout + 5 s


def _run(tmp_path, scenario, mode, world, timeout=120, expect_success=True):
    out = tmp_path / f"{scenario}-{mode}-{world}"
    out.mkdir()
    results = run_ranks("fault_worker.py", world, [scenario, mode, str(out)], timeout=timeout,
                        share_gpu=world > gpu_count(), expect_success=expect_success)
    reports = {}
    for rank in range(world):
        path = out / f"rank{rank}.json"
        if path.exists():
            reports[rank] = json.loads(path.read_text())
    return results, reports


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scenario", ["skip", "skip_lazy"])
def test_a_skipped_collective_errors_on_the_others_within_the_timeout(tmp_path, mode, scenario):
    _, reports = _run(tmp_path, scenario, mode, world=3)
    for rank in (0, 1):
        report = reports[rank]
        assert report["error"], f"rank {rank} saw no error"
        assert report["seconds"] < TIMEOUT_S + GRACE_S, report
        assert "Timeout" in report["error"] or "timed out" in report["error"], report["error"]
        assert report["later_error"] and "Aborted" in report["later_error"], report
        assert report["later_seconds"] < 0.5, report


@pytest.mark.parametrize("mode", MODES)
def test_a_killed_rank_makes_the_survivors_error_within_the_timeout(tmp_path, mode):
    results, reports = _run(tmp_path, "killed", mode, world=3, expect_success=False)
    assert results[2].returncode == -9, results[2].stderr[-2000:]
    for rank in (0, 1):
        assert results[rank].returncode == 0, results[rank].stderr[-4000:]
        report = reports[rank]
        assert report["error"] and report["steps"] >= 20, report
        assert report["since_last_step"] < TIMEOUT_S + GRACE_S, report


@pytest.mark.parametrize("mode", MODES)
def test_abort_from_another_thread_frees_a_stuck_all_reduce(tmp_path, mode):
    _, reports = _run(tmp_path, "abort_thread", mode, world=2)
    report = reports[0]
    assert report["release_after_abort_s"] < 2.0, report
    assert report["abort_call_s"] < 2.0, report
    assert "Aborted" in report["later_error"], report


@pytest.mark.parametrize("mode", MODES)
def test_a_rank_that_never_joins_makes_init_fail_after_the_timeout(tmp_path, mode):
    _, reports = _run(tmp_path, "never_joins", mode, world=3)
    for rank in (0, 1):
        report = reports[rank]
        assert report["error"] and "join" in report["error"], report
        assert TIMEOUT_S * 0.9 < report["seconds"] < TIMEOUT_S + GRACE_S, report


@pytest.mark.parametrize("mode", MODES)
def test_fifty_init_abort_cycles_leak_nothing(tmp_path, mode):
    _, reports = _run(tmp_path, "cycles", mode, world=2, timeout=540)
    for rank, report in reports.items():
        early, late = report["after_5"], report["after_all"]
        # Both ranks share the GPU: free memory is the device's, a leak would show 45x.
        assert early["gpu_free"] - late["gpu_free"] < 256 << 20, (rank, early, late)
        assert late["threads"] <= early["threads"] + 2, (rank, early, late)
        assert late["fds"] <= early["fds"] + 4, (rank, early, late)


@pytest.mark.parametrize("mode", MODES)
def test_three_abort_and_recover_cycles_keep_training(tmp_path, mode):
    _, reports = _run(tmp_path, "recover", mode, world=2, timeout=300)
    assert reports[0]["faults"] and all(reports[0]["faults"]), reports[0]
    for report in reports.values():
        assert report["steps_after_recovery"] == [5, 5, 5]
        assert report["params_equal"]
