"""The watchdog, abort and teardown under hostile stand-ins (issue 14, part A; the review's
5.2 items): events that raise or are slow, aborts that raise, hang or end the kernel
before returning, config values that used to kill the watchdog, and process exit/fork.
Each test names the review finding it pins down."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import cupycoll
from cupycoll import config, lifecycle
from cupycoll import watchdog as watchdog_module
from cupycoll.errors import CollectiveTimeoutError, CommunicatorAbortedError, CupycollValueError
from cupycoll.watchdog import TERMINATE_EXIT_CODE, Watch, Watchdog
from test_faults import FakeComm, FakeEvent, eventually, issued_work, make_group

TESTS = str(Path(__file__).resolve().parent)


def run_script(body: str, timeout: float = 60) -> subprocess.CompletedProcess:
    script = f"import sys; sys.path.insert(0, {TESTS!r})\n" + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout)


class RaisingEvent:
    """cudaEventQuery after a sticky CUDA error (an illegal address, an Xid)."""

    def query(self):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def stuck_work(seq=1):
    work, event = issued_work(seq=seq)
    return work


# -- D1: Works are failed before ncclCommAbort, released after -------------------------


class KernelEndingComm(FakeComm):
    """ncclCommAbort sets the abort flag first (the stuck kernel ends, its event fires), then
    spends a while reclaiming: what a woken caller sees meanwhile is recorded."""

    def __init__(self, work, event):
        super().__init__()
        self.work, self.event, self.seen = work, event, None

    def abort(self):
        self.event.fired.set()
        self.seen = (self.work.exception(), self.work.is_success(), self.work._keepalive is not None)
        time.sleep(0.05)
        super().abort()


@pytest.mark.parametrize("how", ["watchdog", "user abort"])
def test_d1_works_are_failed_before_the_abort_and_released_after(how):
    group = make_group()
    work, event = issued_work(seq=5)
    comm = group._cuda.comm = KernelEndingComm(work, event)
    group._cuda._watch.track(work)
    if how == "watchdog":
        group._cuda._watch.handle(CollectiveTimeoutError("all_reduce #5 did not complete"))
    else:
        group.abort()
    error, success, kept = comm.seen
    assert error is not None and not success  # the kernel ended, the Work already failed
    assert kept  # ...but its tensors outlived the abort
    assert work._keepalive is None and group._cuda.state == "aborted"


# -- D2: an event query that raises is the group's fault ------------------------------


def test_d2_a_raising_event_query_is_the_groups_fault_not_a_silent_loop():
    faults = []
    watch = Watch("g", timeout=60, interval=0.01, communicators=list, on_fault=faults.append)
    work = stuck_work()
    work._event = RaisingEvent()
    watch.track(work)
    fault = watch.poll()
    assert isinstance(fault, CommunicatorAbortedError) and faults == [fault]
    assert "illegal memory access" in str(fault) and isinstance(fault.__cause__, RuntimeError)
    assert work.exception() is fault


def test_d2_d14_shutdown_with_a_sticky_cuda_error_aborts_and_never_raises():
    group = make_group()
    comm = group._cuda.comm = FakeComm()
    work = stuck_work()
    work._event = RaisingEvent()
    group._cuda._watch.track(work)
    group.shutdown()  # must not raise
    assert group._cuda.state == "aborted" and comm.aborted.is_set()
    assert work.exception() is not None


def test_d2_terminate_exits_on_a_sticky_cuda_error():
    result = run_script("""
        import time
        from test_watchdog import RaisingEvent, stuck_work
        from cupycoll.watchdog import Watch, Watchdog
        work = stuck_work(); work._event = RaisingEvent()
        watch = Watch("g", timeout=60, interval=0.01, communicators=list,
                      on_fault=lambda f: None, policy="terminate")
        Watchdog().watch(watch); watch.track(work)
        time.sleep(20); print("still alive")
    """)
    assert result.returncode == TERMINATE_EXIT_CODE, result.stderr
    assert "illegal memory access" in result.stderr and "still alive" not in result.stdout


# -- D3: fault handling runs off the watchdog thread, bounded -------------------------


def test_d3_a_hung_abort_in_one_group_does_not_blind_the_others():
    watchdog = Watchdog()
    hang, b_faulted = threading.Event(), threading.Event()
    a = Watch("a", timeout=0.05, interval=0.01, communicators=list, on_fault=lambda f: hang.wait(30))
    b = Watch("b", timeout=0.5, interval=0.01, communicators=list, on_fault=lambda f: b_faulted.set())
    try:
        watchdog.watch(a)
        a.track(stuck_work())
        watchdog.watch(b)
        b.track(stuck_work())
        assert b_faulted.wait(5)  # a's abort still hangs
        assert a.fault is not None and isinstance(b.fault, CollectiveTimeoutError)
    finally:
        hang.set()


def test_d3_terminate_exits_even_when_the_abort_hangs():
    result = run_script("""
        import threading, time
        from test_watchdog import stuck_work
        from cupycoll import watchdog
        watchdog.FAULT_DEADLINE = 0.5
        watch = watchdog.Watch("g", timeout=0.05, interval=0.01, communicators=list,
                               on_fault=lambda f: threading.Event().wait(), policy="terminate")
        watchdog.Watchdog().watch(watch); watch.track(stuck_work(seq=9))
        time.sleep(20); print("still alive")
    """)
    assert result.returncode == TERMINATE_EXIT_CODE, result.stderr
    assert "all_reduce #9" in result.stderr and "still alive" not in result.stdout


def test_d3_a_stuck_watchdog_is_detected_by_its_heartbeat_and_terminate_exits():
    result = run_script("""
        import threading, time
        from test_watchdog import stuck_work
        from cupycoll import watchdog
        watchdog.HEARTBEAT_TIMEOUT = 0.3
        stuck = threading.Event()
        def communicators():
            stuck.wait()  # e.g. a communicator lock held by a hung ncclCommAbort
            return []
        watch = watchdog.Watch("g", timeout=60, interval=0.01, communicators=communicators,
                               on_fault=lambda f: None, policy="terminate")
        watchdog.Watchdog().watch(watch); watch.track(stuck_work())
        time.sleep(20); print("still alive")
    """)
    assert result.returncode == TERMINATE_EXIT_CODE, result.stderr
    assert "no heartbeat" in result.stderr and "in communicators" in result.stderr


# -- D4: an abort that raises skips nothing ---------------------------------------------


class RaisingComm(FakeComm):
    def abort(self):
        super().abort()
        raise RuntimeError("cudaErrorIllegalAddress while aborting")


def test_d4_a_raising_abort_still_aborts_the_other_comms_and_fails_the_works():
    group = make_group()
    first, second = RaisingComm(), FakeComm()
    group._cuda._p2p_comms[1] = first
    group._cuda.comm = second
    work = stuck_work()
    group._cuda._watch.track(work)
    shut = []
    group._cuda._on_abort = lambda: shut.append(True)
    with pytest.warns(RuntimeWarning, match="cudaErrorIllegalAddress"):
        group.abort()
    assert second.aborted.is_set() and shut == [True]
    assert isinstance(work.exception(), CommunicatorAbortedError) and work._keepalive is None


def test_d4_terminate_exits_when_the_abort_raises():
    result = run_script("""
        import time
        from test_watchdog import stuck_work
        from cupycoll.watchdog import Watch, Watchdog
        def on_fault(fault):
            raise RuntimeError("abort blew up")
        watch = Watch("g", timeout=0.05, interval=0.01, communicators=list,
                      on_fault=on_fault, policy="terminate")
        Watchdog().watch(watch); watch.track(stuck_work())
        time.sleep(20); print("still alive")
    """)
    assert result.returncode == TERMINATE_EXIT_CODE, result.stderr
    assert "still alive" not in result.stdout


# -- D10, D13: configuration ----------------------------------------------------------


def test_d10_the_default_timeout_is_cupycolls_not_torchs_30_minutes(monkeypatch):
    monkeypatch.delenv("CUPYCOLL_TIMEOUT", raising=False)
    dist.init_process_group("cupycoll", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert dist.group.WORLD.settings.timeout == config.DEFAULT_TIMEOUT
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name,value", [("watchdog_interval", float("inf")), ("watchdog_interval", 61),
                                        ("timeout", float("inf")), ("timeout", 1e12)])
def test_d13_unusable_values_are_rejected_naming_them(name, value):
    with pytest.raises(CupycollValueError, match=f"Options.{name}="):
        cupycoll.Options(**{name: value})


def test_d13_unusable_environment_values_are_rejected_naming_them():
    with pytest.raises(CupycollValueError, match="CUPYCOLL_TIMEOUT='inf'"):
        config.resolve(None, None, {"CUPYCOLL_TIMEOUT": "inf"})
    with pytest.raises(CupycollValueError, match="CUPYCOLL_WATCHDOG_INTERVAL='inf'"):
        config.resolve(None, None, {"CUPYCOLL_WATCHDOG_INTERVAL": "inf"})


def test_d13_the_watchdog_restarts_after_its_thread_died(monkeypatch):
    watchdog = Watchdog()
    real = watchdog._poll_once
    calls = []

    def dies_once():
        calls.append(1)
        if len(calls) == 1:
            raise OverflowError("timeout value is too large")
        return real()

    monkeypatch.setattr(watchdog, "_poll_once", dies_once)
    faulted = threading.Event()
    first = Watch("g", timeout=60, interval=0.01, communicators=list, on_fault=pytest.fail)
    watchdog.watch(first)
    assert eventually(lambda: watchdog._thread is None)
    watch = Watch("h", timeout=0.05, interval=0.01, communicators=list, on_fault=lambda f: faulted.set())
    watch.track(stuck_work())
    watchdog.watch(watch)
    assert faulted.wait(5)


# -- D11: one popper ----------------------------------------------------------------


class SlowDoneEvent:
    def query(self):
        time.sleep(0.01)  # widens the window between the check and the pop
        return True


def test_d11_drain_and_the_watchdog_never_drop_an_unfinished_work():
    for _ in range(10):
        watch = Watch("g", timeout=60, interval=0.01, communicators=list, on_fault=pytest.fail)
        done, unfinished = stuck_work(seq=1), stuck_work(seq=2)
        done._event = SlowDoneEvent()
        watch.track(done)
        watch.track(unfinished)
        drained = []
        thread = threading.Thread(target=lambda: drained.append(watch.drain(0.2)))
        thread.start()
        watch.poll()
        thread.join()
        assert list(watch.inflight) == [unfinished] and drained == [False]


# -- R5, D14: shutdown ------------------------------------------------------------------


def test_r5_shutdown_waits_a_short_grace_not_the_timeout(monkeypatch):
    monkeypatch.setattr(lifecycle, "SHUTDOWN_GRACE", 0.2)
    group = make_group(timeout=30)
    comm = group._cuda.comm = FakeComm()
    work = stuck_work()
    group._cuda._watch.track(work)
    start = time.monotonic()
    group.shutdown()
    assert time.monotonic() - start < 5
    assert group._cuda.state == "aborted" and comm.aborted.is_set()
    assert "was shut down with work that did not finish" in str(work.exception())


class FailingShutdownComm(FakeComm):
    def shutdown(self, timeout=None):
        raise RuntimeError("cudaErrorLaunchFailure in ncclCommFinalize")


def test_d14_a_communicator_shutdown_that_raises_falls_back_to_abort():
    group = make_group()
    comm = group._cuda.comm = FailingShutdownComm()
    with pytest.warns(RuntimeWarning, match="cudaErrorLaunchFailure"):
        group.shutdown()  # must not raise
    assert comm.aborted.is_set() and group._cuda.state == "shut down"


# -- D15: process exit; R14: fork --------------------------------------------------------

_EXIT_SCRIPT = """
    import datetime, threading, torch.distributed as dist
    from cupycoll import lifecycle
    from standins import CpuAsCudaGroup
    from test_watchdog import stuck_work
    lifecycle.EXIT_DEADLINE = 1.0
    class Comm:
        def async_error(self): return None
        def abort(self):
            print("comm aborted", flush=True)
            if {hang}: threading.Event().wait()
    group = CpuAsCudaGroup(dist.HashStore(), 0, 2, datetime.timedelta(seconds=60))
    group._cuda.comm = Comm()
    group._cuda._watch.track(stuck_work())
    print("exiting without destroy_process_group", flush=True)
"""


@pytest.mark.parametrize("hang", [False, True])
def test_d15_exit_aborts_undestroyed_groups_with_a_warning_and_a_deadline(hang):
    start = time.monotonic()
    result = run_script(_EXIT_SCRIPT.format(hang=hang), timeout=30)
    no_threads_at_exit = sys.version_info >= (3, 12)  # then faulthandler bounds the abort
    assert result.returncode == (1 if hang and no_threads_at_exit else 0), result.stderr
    assert "comm aborted" in result.stdout
    assert "has NOT been destroyed" in result.stderr
    assert time.monotonic() - start < 20
    if hang and no_threads_at_exit:
        assert "Timeout (0:00:01)!" in result.stderr and "abort" in result.stderr, result.stderr
    elif hang:
        assert "did not finish within 1 s" in result.stderr


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_r14_a_forked_child_gets_a_fresh_watchdog():
    result = run_script("""
        import os, threading, time
        from test_watchdog import stuck_work
        from cupycoll.watchdog import WATCHDOG, Watch
        parent = Watch("p", timeout=60, interval=0.01, communicators=list, on_fault=lambda f: None)
        WATCHDOG.watch(parent); parent.track(stuck_work())
        pid = os.fork()
        if pid == 0:
            ok = not WATCHDOG.running
            faulted = threading.Event()
            child = Watch("c", timeout=0.05, interval=0.01, communicators=list,
                          on_fault=lambda f: faulted.set())
            WATCHDOG.watch(child); child.track(stuck_work())
            os._exit(0 if ok and faulted.wait(5) else 1)
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status))
    """)
    assert "child 0" in result.stdout, result.stderr


# -- hooks for the flight recorder --------------------------------------------------------


def test_on_done_sees_every_completed_work():
    seen = []
    watch = Watch("g", timeout=60, interval=0.01, communicators=list, on_fault=pytest.fail,
                  on_done=seen.append)
    works = [issued_work(seq=i) for i in range(3)]
    for work, event in works:
        watch.track(work)
        event.fired.set()
    watch.poll()
    assert [w.seq for w in seen] == [0, 1, 2]


def test_explain_timeout_becomes_the_timeout_message():
    asked = []

    def explain(work, timeout):
        asked.append((work.seq, timeout))
        return "rank 1 never reached all_reduce #3 (it is at #2)"

    faults = []
    watch = Watch("g", timeout=0.01, interval=0.01, communicators=list, on_fault=faults.append,
                  explain_timeout=explain)
    work = stuck_work(seq=3)
    watch.track(work)
    time.sleep(0.02)
    fault = watch.poll()
    assert asked == [(3, 0.01)] and str(fault) == "rank 1 never reached all_reduce #3 (it is at #2)"
    assert isinstance(fault, CollectiveTimeoutError) and faults == [fault] and work.exception() is fault
