"""The multi-process harness (tests/mp.py): what it does with a launch that failed. Each test
is named after the rule it pins."""

from __future__ import annotations

import pytest

import mp


class _Launch:
    def __init__(self, outcome):
        self.outcome = outcome

    def wait(self):
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome


def _launches(monkeypatch, *outcomes):
    started = []
    pending = list(outcomes)

    def start(script, world, *args, **kwargs):
        started.append((script, world))
        return _Launch(pending.pop(0))
    monkeypatch.setattr(mp, "start_ranks", start)
    return started


def test_a_launch_whose_port_was_taken_runs_once_more(monkeypatch):
    taken = mp.WorkersFailed("--- rank 0: exit 1 ---\\nDistNetworkError: ... code: -98, name: EADDRINUSE, ...")
    started = _launches(monkeypatch, taken, ["the ranks' results"])
    assert mp.run_ranks("api_worker.py", 2) == ["the ranks' results"]
    assert started == [("api_worker.py", 2)] * 2


def test_any_other_failure_is_raised_at_once(monkeypatch):
    started = _launches(monkeypatch, mp.WorkersFailed("--- rank 1: exit 1 ---\\nAssertionError"))
    with pytest.raises(mp.WorkersFailed, match="AssertionError"):
        mp.run_ranks("api_worker.py", 2)
    assert len(started) == 1


def test_a_port_taken_twice_is_a_failure(monkeypatch):
    taken = mp.WorkersFailed("EADDRINUSE")
    started = _launches(monkeypatch, taken, taken)
    with pytest.raises(mp.WorkersFailed, match="EADDRINUSE"):
        mp.run_ranks("api_worker.py", 2)
    assert len(started) == 2


def _trained(returncode, stderr):
    return mp.TrainedRun("nccl", mp.subprocess.CompletedProcess([], returncode, "", stderr), None)


def test_a_rank_that_crashed_is_read_from_torchruns_report():
    report = "Failures:\n  [1]:\n    rank      : 1 (local_rank: 1)\n    exitcode  : -11 (pid: 542)\n"
    assert _trained(1, report).crashed() == "SIGSEGV"
    assert _trained(1, report.replace("-11", "-7")).crashed() == "SIGBUS"
    assert _trained(0, report).crashed() is None  # the launch succeeded


@pytest.mark.parametrize("exitcode", ["1", "-9", "-6", "-15"])
def test_an_error_a_kill_or_an_abort_is_not_a_crash(exitcode):
    # an error exit; SIGKILL (a timeout, the OOM killer); SIGABRT (a watchdog); SIGTERM
    assert _trained(1, f"exitcode  : {exitcode} (pid: 542)").crashed() is None


def _fsdp_launch(*returncodes):
    return mp.FsdpLaunch([mp.RankResult(rank, code, "", "") for rank, code in enumerate(returncodes)], None, None)


def test_a_train_fsdp_rank_that_crashed_is_named_and_other_ends_are_not_crashes():
    assert _fsdp_launch(0, -11).crashed() == "SIGSEGV"
    assert _fsdp_launch(-7, 0).crashed() == "SIGBUS"
    # an error exit; SIGKILL (a timeout, the OOM killer); SIGABRT (the harness's stack dump)
    assert _fsdp_launch(1, -9, -6, 0).crashed() is None
    assert _fsdp_launch().crashed() is None  # a launch that never started a rank


class _Job:
    """A launch's stand-in for wait_train_fsdp: ``wait`` raises ``outcome``, an error, or returns."""

    def __init__(self, outcome):
        self.outcome, self.results = outcome, None

    def wait(self):
        self.results = [mp.RankResult(0, 1 if isinstance(self.outcome, Exception) else 0, "", "")]
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.results


def test_a_train_fsdp_launch_whose_port_was_taken_runs_once_more_and_other_failures_are_returned(tmp_path):
    taken = mp.WorkersFailed("--- rank 0: exit 1 ---\nDistNetworkError: ... name: EADDRINUSE")
    again = []
    launch = mp.wait_train_fsdp(mp.FsdpStart(_Job(taken), tmp_path / "results.pt",
                                             lambda: again.append(1) or _Job(None)))
    assert again == [1] and launch.failure is None and launch.results is None  # no results file was written
    failed = mp.wait_train_fsdp(mp.FsdpStart(_Job(mp.WorkersFailed("AssertionError")), tmp_path / "r.pt",
                                             lambda: again.append(2) or _Job(None)))
    assert again == [1] and "AssertionError" in str(failed.failure) and failed.ranks[0].returncode == 1


def test_runs_differ_by_their_largest_parameter_difference():
    import torch

    a = [torch.zeros(2, 2), torch.ones(3)]
    b = [torch.zeros(2, 2), torch.tensor([1.0, 1.25, 0.5])]
    assert mp.largest_difference(a, b) == 0.5
    assert mp.largest_difference(a, a) == 0
    with pytest.raises(AssertionError):
        mp.largest_difference(a, a[:1])


def test_a_run_that_diverged_to_nan_is_never_within_a_tolerance():
    import math

    import torch

    good = [torch.zeros(2), torch.ones(2)]
    diverged = [torch.zeros(2), torch.tensor([1.0, float("nan")])]
    # wherever the NaN is: a maximum taken in Python keeps whichever comes first
    assert math.isnan(mp.largest_difference(good, diverged))
    assert math.isnan(mp.largest_difference(diverged[::-1], good[::-1]))


@pytest.mark.launches
def test_a_rank_still_running_at_the_limit_shows_where_it_was(tmp_path):
    script = tmp_path / "stuck_worker.py"
    script.write_text("import time\n\ndef stuck_in_a_call():\n    time.sleep(120)\n\nstuck_in_a_call()\n")
    job = mp.start_ranks(str(script), 1, timeout=3)
    with pytest.raises(mp.WorkersFailed) as failed:
        job.wait()
    assert "did not finish within 3 s" in str(failed.value)
    assert "stuck_in_a_call" in str(failed.value)  # its Python stack, from its stderr


@pytest.mark.launches
def test_a_rank_killed_for_its_stacks_writes_no_core_file(tmp_path):
    # SIGABRT ends a rank the fault handler printed: with core dumps allowed, a rank with a
    # CUDA context would write about a GB. Allowed here (the hard limit permitting) in the
    # test process, whose limits the ranks inherit, so that only the harness can forbid them.
    import resource

    script = tmp_path / "stuck_worker.py"
    script.write_text(f"import os, resource, time\nos.chdir({str(tmp_path)!r})\n"
                      "print('RLIMIT_CORE', resource.getrlimit(resource.RLIMIT_CORE)[0], flush=True)\n"
                      "time.sleep(120)\n")
    soft, hard = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (hard, hard))
    try:
        job = mp.start_ranks(str(script), 1, timeout=3)
    finally:
        resource.setrlimit(resource.RLIMIT_CORE, (soft, hard))
    with pytest.raises(mp.WorkersFailed) as failed:
        job.wait()
    assert "RLIMIT_CORE 0" in str(failed.value)
    assert "exit -6" in str(failed.value)  # it was aborted, as a rank still running at its limit is
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("core")]
