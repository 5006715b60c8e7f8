"""GPU tier, part "faults": faults for real. Three ranks on one GPU (NCCL_HOSTID), a 5 s group
timeout.

(a) a rank skips a collective (with the communicator made, and while the others create it);
(b) a rank is SIGKILLed mid-training; (c) abort() from another thread frees a stuck
all_reduce; (d) a rank never joins init; (e) init/abort cycles without growth of GPU memory,
threads or file descriptors; recovery three times in one process; (f) all of it with blocking
and nonblocking communicators.

Each mode is one launch of fault_worker.py's "suite" (every scenario in turn, one process
start), the two modes side by side; the tests then read what each scenario recorded.

Side by side with them (one start for all, so the part's time is the suite's), the figures
the suite lacks, from tests/workers/gpu_hang_worker.py: a peer skipping the first collective
of a cold communicator (cold_skip), SIGKILL mid-DDP with the documented recovery
(kill_mid_ddp), TIER_CYCLES init/abort cycles with GPU memory, threads, fds and store keys
(cycles; 200 with CUPYCOLL_GPU_CYCLES=200 outside the tier), the hung peer on CUDA named
by the watchdog's diagnosis (cuda_hang), and a timeout whose end aborts a pair communicator
beside the group's, with NCCL's cuMem allocator off and on (pair_abort). Each test prints its figures as ``GPU-FIGURE name: value`` lines
straight to the terminal (tools/verify_figures.py's read_pytest collects them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gpu.tier import GPU_TIER_BUDGETS_S
from gpu.tier import print_figure as figure
from mp import ROOT, WorkersFailed, gpu_count, start_ranks
from workers.fault_worker import NEVER_JOINED_WORDS, SUITE, SUITE_CYCLES, TIMEOUT_S
from workers.gpu_hang_worker import WORLDS

pytestmark = pytest.mark.gpu

MODES = ["blocking", "nonblocking"]
WORLD = 3
GRACE_S = 5.0  # the bound: an error within timeout + 5 s

BUDGET_S = GPU_TIER_BUDGETS_S["faults"]
# The cycles the tier runs. CUPYCOLL_GPU_CYCLES=200 is the figure run, outside the tier's
# budget: it starts the cycles launch alone (the other tests skip).
TIER_CYCLES = 24
CYCLES = int(os.environ.get("CUPYCOLL_GPU_CYCLES", TIER_CYCLES))
FIGURE_RUN = CYCLES != TIER_CYCLES
# One suite launch: ~10 s to start; 8 init/abort cycles (~2 s each over sockets); eight
# faults that each wait out the 5 s timeout (skip, skip_lazy, never_joins, three recoveries,
# a shrink from a faulted group, killed and shrunk) plus ~18 inits: ~95 s, both modes at once, ~100 s with the launches beside them
# (20 processes importing torch and CuPy at once).
# cold skip: start ~10 s, init ~3 s, then an error at ~5 s or the deadline (17 s): <= ~30 s.
# kill mid-DDP: start + init ~13 s, 20 steps ~2 s, timeout 5 s, destroy, re-init ~3 s: ~30 s.
# cycles: start ~10 s, then ~1-2 s a cycle (2 ranks over sockets): ~60 s for 24.
# CUDA hang: start + init ~13 s, timeout 5 s, diagnosis <= 5 s, rank 1 sleeps 16 s: ~30 s.
# pair abort: start ~10 s, three communicators made ~6 s, timeout 5 s, diagnosis <= 5 s: ~30 s.
SUBPROCESS_LIMITS_S = {"suite launch": 130, "cold skip": 75, "kill mid-DDP": 90, "cycles": 125,
                       "CUDA hang": 75, "pair abort": 75}
# pair_abort's launches run its one mode under NCCL's cuMem allocator off and on.
CUMEM = {"cumem-off": "0", "cumem-on": "1"}
LAUNCHES = [("cold_skip", mode, "cold skip") for mode in MODES] + \
    [("kill_mid_ddp", mode, "kill mid-DDP") for mode in MODES] + \
    [("cycles", "blocking", "cycles"), ("cuda_hang", "blocking", "CUDA hang")] + \
    [("pair_abort", cumem, "pair abort") for cumem in CUMEM]


def _limit(label):
    if label == "cycles" and FIGURE_RUN:
        # 0.81 s a cycle measured (2 ranks on one H200): twice that, so 200 cycles fit one
        # device command (460 s)
        return 60 + 2 * CYCLES
    return SUBPROCESS_LIMITS_S[label]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Every launch of the part, started at once; each entry (job, out dir)."""
    jobs = {}
    try:
        for mode in () if FIGURE_RUN else MODES:
            out = tmp_path_factory.mktemp(f"faults-{mode}")
            # the last rank is killed on purpose: exit codes are checked by the tests
            jobs[("suite", mode)] = (start_ranks(
                "fault_worker.py", WORLD, ["suite", mode, str(out)], timeout=SUBPROCESS_LIMITS_S["suite launch"],
                share_gpu=WORLD > gpu_count(), expect_success=False, log_dir=str(out / "logs")), out)
        for scenario, mode, label in LAUNCHES:
            if FIGURE_RUN and scenario != "cycles":
                continue
            out = tmp_path_factory.mktemp(f"{scenario}-{mode}")
            world = WORLDS[scenario]
            args = [scenario, "blocking" if mode in CUMEM else mode, str(out)] + \
                ([str(CYCLES)] if scenario == "cycles" else [])
            env = {"CUPYCOLL_TRACE_DIR": str(out / "trace")} if scenario == "cuda_hang" else None
            if mode in CUMEM:
                env = {"NCCL_CUMEM_ENABLE": CUMEM[mode]}
            jobs[(scenario, mode)] = (start_ranks(
                "gpu_hang_worker.py", world, args, timeout=_limit(label), env=env, share_gpu=world > gpu_count(),
                expect_success=False, log_dir=str(out / "logs")), out)
        yield jobs
    finally:
        for job, _out in jobs.values():
            job.kill()


def _wait(launched, key):
    if key not in launched:
        pytest.skip(f"{key[0]} ({key[1]}) not started: CUPYCOLL_GPU_CYCLES={CYCLES} runs the cycles figure alone")
    job, out = launched[key]
    try:
        return job.wait(), out
    except WorkersFailed as exc:  # a hang fails this launch's tests only
        return exc, out


@pytest.fixture(scope="module")
def suites(launched):
    return {mode: _wait(launched, ("suite", mode)) for mode in MODES}


def _results(suites, mode):
    results, _ = suites[mode]
    if isinstance(results, WorkersFailed):
        pytest.fail(str(results), pytrace=False)
    return results


def _reports(suites, mode, scenario, world=WORLD):
    """What each rank recorded for ``scenario``, and the ranks' output for messages. A launch
    that ran out of time still yields the scenarios finished before the hang."""
    results, out = suites[mode]
    reports = {}
    for rank in range(world):
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
        if scenario == "skip" and "after_sync" in report:
            # Works are failed before the abort: right after synchronize() returned, the
            # Work already says it failed
            assert report["after_sync"] == {"is_success": False, "exception": True}, report


@pytest.mark.parametrize("mode", MODES)
def test_a_killed_rank_makes_the_survivors_error_within_the_timeout_then_shrink_and_go_on(suites, mode, capsys):
    results = _results(suites, mode)
    reports, logs = _reports(suites, mode, "killed")
    assert results[WORLD - 1].returncode == -9, logs
    for rank in (0, 1):
        assert results[rank].returncode == 0, logs
        report = reports[rank]
        assert report["error"] and report["steps"] >= 20, report
        assert report["since_last_step"] < TIMEOUT_S + GRACE_S, report
        # the fault aborted the communicator, so the survivors' one is made anew
        assert report["shrunk"] == {"by": "new", "size": 2, "sum": 3.0, "gathered": [0.0, 1.0], "scattered": 2.0,
                                    "broadcast": [0.0, 0.0], "received": [0.0, 0.0, 0.0]}, report
        # the timeout (5 s), the diagnosis (at most 5 s), then a new communicator of two
        assert report["death_to_first_collective_s"] < TIMEOUT_S + GRACE_S + 15, report
    figure(capsys, f"{mode} killed rank: seconds from the kill to the shrunk group's first all_reduce",
           f"{max(reports[r]['death_to_first_collective_s'] for r in (0, 1)):.2f}")


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
        assert report["error"] and any(words in report["error"] for words in NEVER_JOINED_WORDS), report
        assert "DistBackendError" in report["error_types"], report  # cupycoll's errors, or torch wrapping one
        assert TIMEOUT_S * 0.9 < report["seconds"] < TIMEOUT_S + GRACE_S, report


@pytest.mark.parametrize("mode", MODES)
def test_init_abort_cycles_leak_nothing(suites, mode):
    reports, logs = _reports(suites, mode, "cycles")
    assert sorted(reports) == list(range(WORLD)), logs
    for rank, report in reports.items():
        assert report["count"] == SUITE_CYCLES
        early, late = report["after_warm"], report["after_all"]
        # This process's GPU memory (nvidia-smi): < 1 MiB a cycle. The device's free memory
        # moves with the other launches sharing the GPU, so it is a fallback only, where
        # nvidia-smi lists no processes, with a bound of one context's size.
        if early.get("process_gpu_mib") is not None and late.get("process_gpu_mib") is not None:
            assert late["process_gpu_mib"] - early["process_gpu_mib"] <= 16, (rank, early, late)
        else:
            assert early["gpu_free"] - late["gpu_free"] < 512 << 20, (rank, early, late)
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



# -- the figures the suite lacks (tests/workers/gpu_hang_worker.py) ---------------------------


@pytest.mark.parametrize("mode", MODES)
def test_survivors_shrink_a_healthy_group_and_a_faulted_one_and_go_on(suites, mode):
    reports, logs = _reports(suites, mode, "shrink")
    assert sorted(reports) == list(range(WORLD)), logs
    assert all(report["before"] == WORLD for report in reports.values()), reports
    for rank in (0, 1):
        healthy = reports[rank]["healthy"]
        # NCCL 2.27+ shrinks the live communicator; the default group is the survivors' now
        assert healthy["by"] == "ncclCommShrink" and healthy["size"] == 2 and healthy["is_default"], healthy
        assert healthy["sum"] == 3.0, healthy  # 1 + 2: ranks 0 and 1 alone
    report = reports[0]
    assert report["fault"], report  # rank 1 skipped: a timeout, the watchdog aborted
    faulted = report["faulted"]
    assert faulted["by"] == "new" and faulted["size"] == 1 and faulted["sum"] == 5.0, faulted


def _launch(launched, scenario, mode):
    """(results or WorkersFailed, each rank's report, the ranks' output) of one launch."""
    run = _wait(launched, (scenario, mode))
    reports, logs = _reports({mode: run}, mode, scenario, WORLDS[scenario])
    return run[0], reports, logs


def _ended_by_the_timeout(results, rank):
    """``rank``'s output if the group's timeout ended its process (exit 70: a blocking call
    stuck inside NCCL, which no abort may end), else None; whether the launch's other ranks
    then ended in time (a list of results) or not (WorkersFailed)."""
    if isinstance(results, WorkersFailed):
        text = str(results)
        return text if f"--- rank {rank}: exit 70 ---" in text else None
    mine = [r for r in results if r.rank == rank]
    return mine[0].stderr if mine and mine[0].returncode == 70 else None


@pytest.mark.parametrize("mode", MODES)
def test_a_peer_skipping_the_first_collective_of_a_cold_communicator(launched, mode, capsys):
    """Eager init (device_id), then the last rank skips the very first all_reduce, so
    NCCL's lazy connection setup runs inside the others' call.

    nonblocking: every NCCL call returns and is polled under the timeout, so rank 0 must get
    an error within timeout + 5 s, the Work saying failed right after synchronize() (Works
    are failed before the abort). blocking: NCCL may block the host inside ncclAllReduce
    while it connects, before any event exists; the watchdog times out the call inside NCCL,
    the group ends (Works failed), and since no ncclCommAbort may run beside the call, the
    process ends with the timeout's message, exit 70 (docs/design.md, "Decision: blocking
    communicators by default, for now"): that passes, as does an error in time. A hang is
    recorded (where it was stuck: the worker's deadline thread after HANG_DEADLINE_S, or this
    launch's own limit when the thread could not run) and fails."""
    results, reports, logs = _launch(launched, "cold_skip", mode)
    report = reports.get(0)
    ended = _ended_by_the_timeout(results, rank=0)
    if report is None and mode == "blocking" and ended is not None:
        assert "no abort can end it safely" in ended and "has been inside NCCL" in ended, logs
        assert not isinstance(results, WorkersFailed), \
            f"rank 0 ended with the timeout (exit 70), but the skipping rank outlived the launch's limit\n{logs}"
        assert reports.get(1) in ({"skipped": True}, {"skipped": True, "store_host_ended": True}), logs
        figure(capsys, f"cold skip {mode}", "the process ended (exit 70) with the timeout: a blocking call "
               "stuck in NCCL's connect")
        return
    if report is None and isinstance(results, WorkersFailed) and mode == "blocking":
        figure(capsys, f"cold skip {mode}", f"hang past the launch limit of {SUBPROCESS_LIMITS_S['cold skip']} s "
               "(the deadline thread never ran: the GIL was held)")
        pytest.fail(f"blocking mode hung on a cold communicator, not even the deadline thread ran\n{logs}",
                    pytrace=False)
    assert report is not None, logs
    if report["outcome"] == "hang":
        figure(capsys, f"cold skip {mode}", f"hang: {report['seconds']:.1f} s, stuck in {report['stuck_in']}")
        pytest.fail(f"{mode} mode hung ({report['stuck_in']}) for {report['seconds']:.0f} s:\n"
                    f"{report['stacks']}\n{logs}", pytrace=False)
    figure(capsys, f"cold skip {mode}", f"error after {report['seconds']:.2f} s (timeout {TIMEOUT_S:g} s)")
    assert report["outcome"] == "error", report
    assert report["seconds"] < TIMEOUT_S + GRACE_S, report
    assert "Timeout" in report["error"] or "timed out" in report["error"], report["error"]
    if "after_sync" in report:  # synchronize() returned: the Work must already say failed
        assert report["after_sync"]["is_success"] is False, report
        assert report["after_sync"]["exception"] not in (None, False), report
    assert report["later_error"] and "Aborted" in report["later_error"], report
    assert report["later_seconds"] < 0.5, report
    assert reports.get(1) == {"skipped": True}, logs


@pytest.mark.parametrize("mode", MODES)
def test_sigkill_mid_ddp_then_the_survivors_restore_and_train_on(launched, mode, capsys):
    # Latency, exit codes, destroy time, whether the parameters agree without a restore (a
    # figure: an aborted last bucket may already be applied), the documented recovery
    # (checkpoint, new group), threads and fds after it
    results, reports, logs = _launch(launched, "kill_mid_ddp", mode)
    if isinstance(results, WorkersFailed):
        pytest.fail(str(results), pytrace=False)
    assert results[-1].returncode == -9, logs
    for rank in (0, 1):
        assert results[rank].returncode == 0, logs
        report = reports[rank]
        assert report["error"] and report["steps"] >= 20, report
        assert report["error_after_last_step_s"] < TIMEOUT_S + GRACE_S, report
        assert report["destroy_s"] < 15, report  # lifecycle.SHUTDOWN_GRACE (10 s) at most, then abort
        assert report["params_equal"] and report["params_finite"], report
        assert report["after"]["threads"] <= report["before"]["threads"] + 2, report
        assert report["after"]["fds"] <= report["before"]["fds"] + 4, report
    r = reports[0]
    figure(capsys, f"kill mid-DDP {mode}",
           f"error {r['error_after_last_step_s']:.2f} s after the last step, destroy {r['destroy_s']:.2f} s, "
           f"recovery {r['recovery_s']:.2f} s, equal without restore {r['equal_without_restore']}, "
           f"threads {r['after']['threads'] - r['before']['threads']:+d}, fds {r['after']['fds'] - r['before']['fds']:+d}")


def cycle_deltas(report):
    """The figures of one rank's cycles report: growth from the warm sample to the last,
    and store keys added per cycle in each half."""
    warm, middle, last = report["after_warm"], report["middle"], report["after_all"]
    mib = 1 << 20

    def per_cycle(a, b):
        return (b["store_keys"] - a["store_keys"]) / max(1, b["cycle"] - a["cycle"])

    deltas = {"count": report["count"], "seconds_per_cycle": round(report["seconds_per_cycle"], 3),
              "device_free_mib": round((warm["gpu_free"] - last["gpu_free"]) / mib, 1),
              "reserved_mib": round((last["reserved"] - warm["reserved"]) / mib, 1),
              "threads": last["threads"] - warm["threads"], "fds": last["fds"] - warm["fds"],
              "keys_per_cycle_first_half": per_cycle(warm, middle),
              "keys_per_cycle_second_half": per_cycle(middle, last)}
    if warm.get("process_gpu_mib") is not None and last.get("process_gpu_mib") is not None:
        deltas["process_gpu_mib"] = last["process_gpu_mib"] - warm["process_gpu_mib"]
    return deltas


def check_cycle_deltas(d):
    """Flat within a small tolerance (< 1 MiB a cycle; threads +2, fds +4 in all)."""
    cycles = d["count"]
    assert d.get("process_gpu_mib", 0) <= max(16, cycles), d  # < 1 MiB a cycle (nvidia-smi, this process)
    # the device's free memory moves with the other launches beside this one: a loose bound
    assert d["device_free_mib"] < 256 + cycles, d
    assert d["reserved_mib"] <= 2, d
    assert d["threads"] <= 2 and d["fds"] <= 4, d
    # A cycle adds a fixed set of keys, and one more when it outlives the diagnosis responder's
    # poll interval (its first poll creates the group's request counter): up to 1 a cycle
    # apart by chance. A leak grows with the cycles, past that.
    assert d["keys_per_cycle_second_half"] <= d["keys_per_cycle_first_half"] + 1, d


def test_init_abort_cycles_keep_gpu_memory_threads_fds_and_store_keys_flat(launched, capsys):
    results, reports, logs = _launch(launched, "cycles", "blocking")
    if isinstance(results, WorkersFailed):
        pytest.fail(str(results), pytrace=False)
    assert sorted(reports) == [0, 1], logs
    for rank, report in reports.items():
        deltas = cycle_deltas(report)
        assert deltas["count"] == CYCLES
        if rank == 0:
            figure(capsys, f"init/abort cycles ({CYCLES})", ", ".join(f"{k} {v}" for k, v in deltas.items()))
        check_cycle_deltas(deltas)


def test_a_hung_peer_on_cuda_is_named_by_the_watchdog(launched, capsys):
    # The CUDA route of tests/trace/test_hang_diagnosis.py, through the watchdog
    results, reports, logs = _launch(launched, "cuda_hang", "blocking")
    if isinstance(results, WorkersFailed):
        pytest.fail(str(results), pytrace=False)
    assert [r.returncode for r in results] == [0, 0], logs
    report = reports[0]
    assert report["group"] == "ProcessGroupCupycoll", report
    figure(capsys, "CUDA hang error", f"after {report['elapsed_s']:.2f} s (timeout {TIMEOUT_S:g} s)")
    assert report["timeout"], report
    assert report["elapsed_s"] < TIMEOUT_S + 10, report  # the timeout, then at most 5 s of diagnosis
    error = report["error"]
    assert f"all_reduce #5 (float32[1024]) timed out after {TIMEOUT_S:g} s on rank 0;" in error, error
    assert "rank 1 is behind: its last collective was #4 (broadcast)" in error, error
    assert "never reached #5" in error, error
    if "after_sync" in report:  # failed before the abort on this path too
        assert report["after_sync"]["is_success"] is False, report
    trace = launched[("cuda_hang", "blocking")][1] / "trace"
    dumps = sorted(os.listdir(trace)) if trace.is_dir() else []
    assert dumps == ["cupycoll_trace_rank0.json", "cupycoll_trace_rank1.json"], (dumps, logs)
    analysis = subprocess.run([sys.executable, "-m", "cupycoll.trace", str(trace)], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
    assert analysis.returncode == 1, analysis.stdout + analysis.stderr
    assert "all_reduce #5" in analysis.stdout and "rank 1 never reached it" in analysis.stdout, analysis.stdout


@pytest.mark.parametrize("cumem", list(CUMEM))
def test_a_timeout_ending_a_pair_communicator_beside_the_groups_ends_in_its_bound(launched, cumem, capsys):
    # With NCCL_CUMEM_ENABLE=0 an abort's free synchronises the device: a pair communicator
    # aborted before the group's would wait behind the group's stuck kernel.
    results, reports, logs = _launch(launched, "pair_abort", cumem)
    if isinstance(results, WorkersFailed):
        pytest.fail(str(results), pytrace=False)
    assert [r.returncode for r in results] == [0, 0], logs
    report = reports[0]
    assert report["cumem"] == CUMEM[cumem] and report["communicators"] == 2, report  # the group's and a pair
    figure(capsys, f"pair abort ({cumem})", f"error after {report['seconds']:.2f} s, group ended after "
           f"{report['ended_s']:.2f} s (timeout {TIMEOUT_S:g} s)")
    assert report["error"] and "CollectiveTimeoutError" in report["error"], report
    assert report["seconds"] < TIMEOUT_S + GRACE_S, report
    assert report["ended"] and report["ended_s"] < TIMEOUT_S + GRACE_S + 5, report
    assert report["in_flight"] == 0 and report["state"] == "aborted", report  # the tensors released
