"""The watchdog (cupycoll.faults.watchdog, watchdog_cuda, heartbeat), abort and teardown under
hostile stand-ins: events that raise or are slow, aborts that raise, hang or end the kernel
before returning, config values the watchdog could not run with, process exit and fork,
completed Works releasing their tensors, and event queries on the group's device and next
to a CUDA graph capture. Each test is named after the rule it pins."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import cupycoll
from cupycoll import config
from cupycoll.faults import lifecycle
from cupycoll.faults import watchdog as watchdog_module
from cupycoll.faults import watchdog_cuda
from cupycoll.errors import CollectiveTimeoutError, CommunicatorAbortedError, CupycollValueError
from cupycoll.faults.watchdog import TERMINATE_EXIT_CODE, Watch, Watchdog
from test_faults import FakeComm, eventually, issued_work, make_group
from shapes import shell_of

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


# -- Works are failed before ncclCommAbort, released after --------------------------------


class KernelEndingComm(FakeComm):
    """ncclCommAbort sets the abort flag first (the stuck kernel ends, its event fires), then
    spends a while reclaiming: what a woken caller sees meanwhile is recorded."""

    def __init__(self, work, event):
        super().__init__()
        self.work, self.event, self.seen = work, event, None

    def abort(self, on_behalf_of=None):
        self.event.fired.set()
        self.seen = (self.work.exception(), self.work.is_success(), self.work._keepalive is not None)
        time.sleep(0.05)
        super().abort()


@pytest.mark.parametrize("how", ["watchdog", "user abort"])
def test_works_are_failed_before_the_abort_and_released_after(how):
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


# -- an event query that raises is the group's fault --------------------------------------


def test_a_raising_event_query_is_the_groups_fault_not_a_silent_loop():
    faults = []
    watch = Watch("g", timeout=60, interval=0.01, communicators=list, on_fault=faults.append)
    work = stuck_work()
    work._event = RaisingEvent()
    watch.track(work)
    fault = watch.poll()
    assert isinstance(fault, CommunicatorAbortedError) and faults == [fault]
    assert "illegal memory access" in str(fault) and isinstance(fault.__cause__, RuntimeError)
    assert work.exception() is fault


def test_shutdown_with_a_sticky_cuda_error_aborts_and_never_raises():
    group = make_group()
    comm = group._cuda.comm = FakeComm()
    work = stuck_work()
    work._event = RaisingEvent()
    group._cuda._watch.track(work)
    group.shutdown()  # must not raise
    assert group._cuda.state == "aborted" and comm.aborted.is_set()
    assert work.exception() is not None


def test_terminate_exits_on_a_sticky_cuda_error():
    result = run_script("""
        import time
        from test_watchdog import RaisingEvent, stuck_work
        from cupycoll.faults.watchdog import Watch, Watchdog
        work = stuck_work(); work._event = RaisingEvent()
        watch = Watch("g", timeout=60, interval=0.01, communicators=list,
                      on_fault=lambda f: None, policy="terminate")
        Watchdog().watch(watch); watch.track(work)
        time.sleep(20); print("still alive")
    """)
    assert result.returncode == TERMINATE_EXIT_CODE, result.stderr
    assert "illegal memory access" in result.stderr and "still alive" not in result.stdout


# -- fault handling runs off the watchdog thread, bounded ---------------------------------


def test_a_hung_abort_in_one_group_does_not_blind_the_others():
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


def test_terminate_exits_even_when_the_abort_hangs():
    result = run_script("""
        import threading, time
        from test_watchdog import stuck_work
        from cupycoll.faults import watchdog
        watchdog.FAULT_DEADLINE = 0.5
        watch = watchdog.Watch("g", timeout=0.05, interval=0.01, communicators=list,
                               on_fault=lambda f: threading.Event().wait(), policy="terminate")
        watchdog.Watchdog().watch(watch); watch.track(stuck_work(seq=9))
        time.sleep(20); print("still alive")
    """)
    assert result.returncode == TERMINATE_EXIT_CODE, result.stderr
    assert "all_reduce #9" in result.stderr and "still alive" not in result.stdout


def test_a_stuck_watchdog_is_detected_by_its_heartbeat_and_terminate_exits():
    result = run_script("""
        import threading, time
        from test_watchdog import stuck_work
        from cupycoll.faults import heartbeat
        from cupycoll.faults import watchdog
        heartbeat.HEARTBEAT_TIMEOUT = 0.3
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


# -- an abort that raises skips nothing ---------------------------------------------------


class RaisingComm(FakeComm):
    def abort(self, on_behalf_of=None):
        super().abort()
        raise RuntimeError("cudaErrorIllegalAddress while aborting")


def test_a_raising_abort_still_aborts_the_other_comms_and_fails_the_works():
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


def test_terminate_exits_when_the_abort_raises():
    result = run_script("""
        import time
        from test_watchdog import stuck_work
        from cupycoll.faults.watchdog import Watch, Watchdog
        def on_fault(fault):
            raise RuntimeError("abort blew up")
        watch = Watch("g", timeout=0.05, interval=0.01, communicators=list,
                      on_fault=on_fault, policy="terminate")
        Watchdog().watch(watch); watch.track(stuck_work())
        time.sleep(20); print("still alive")
    """)
    assert result.returncode == TERMINATE_EXIT_CODE, result.stderr
    assert "still alive" not in result.stdout


# -- configuration ------------------------------------------------------------------------


def test_the_default_timeout_is_cupycolls_not_torchs_30_minutes(monkeypatch):
    monkeypatch.delenv("CUPYCOLL_TIMEOUT", raising=False)
    dist.init_process_group("cupycoll", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert shell_of(dist.group.WORLD).settings.timeout == config.DEFAULT_TIMEOUT
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name,value", [("watchdog_interval", float("inf")), ("watchdog_interval", 61),
                                        ("timeout", float("inf")), ("timeout", 1e12)])
def test_unusable_values_are_rejected_naming_them(name, value):
    with pytest.raises(CupycollValueError, match=f"Options.{name}="):
        cupycoll.Options(**{name: value})


def test_unusable_environment_values_are_rejected_naming_them():
    with pytest.raises(CupycollValueError, match="CUPYCOLL_TIMEOUT='inf'"):
        config.resolve(None, None, {"CUPYCOLL_TIMEOUT": "inf"})
    with pytest.raises(CupycollValueError, match="CUPYCOLL_WATCHDOG_INTERVAL='inf'"):
        config.resolve(None, None, {"CUPYCOLL_WATCHDOG_INTERVAL": "inf"})


def test_the_watchdog_restarts_after_its_thread_died(monkeypatch):
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


# -- one popper ---------------------------------------------------------------------------


class SlowDoneEvent:
    def query(self):
        time.sleep(0.01)  # widens the window between the check and the pop
        return True


def test_drain_and_the_watchdog_never_drop_an_unfinished_work():
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
        assert watch.works() == [unfinished] and drained == [False]


# -- shutdown -----------------------------------------------------------------------------


def test_shutdown_waits_a_short_grace_not_the_timeout(monkeypatch):
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


def test_a_communicator_shutdown_that_raises_falls_back_to_abort():
    group = make_group()
    comm = group._cuda.comm = FailingShutdownComm()
    with pytest.warns(RuntimeWarning, match="cudaErrorLaunchFailure"):
        group.shutdown()  # must not raise
    assert comm.aborted.is_set() and group._cuda.state == "shut down"


# -- process exit; fork -------------------------------------------------------------------

_EXIT_SCRIPT = """
    import datetime, threading, torch.distributed as dist
    from cupycoll.faults import lifecycle
    from standins import CpuAsCudaGroup
    from test_watchdog import stuck_work
    lifecycle.EXIT_DEADLINE = 1.0 if {hang} else 10.0  # a quick abort must not race 1 s
    class Comm:
        def async_error(self): return None
        def stuck_call(self, after_s): return None
        def abort(self, on_behalf_of=None):
            print("comm aborted", flush=True)
            if {hang}: threading.Event().wait()
    group = CpuAsCudaGroup(dist.HashStore(), 0, 2, datetime.timedelta(seconds=60))
    group._cuda.comm = Comm()
    group._cuda._watch.track(stuck_work())
    import time
    print("exiting without destroy_process_group at", time.time(), flush=True)
"""


_EXIT_WHILE_DIAGNOSING_SCRIPT = """
    import datetime, torch.distributed as dist
    from cupycoll.faults import lifecycle
    from cupycoll.errors import CollectiveTimeoutError
    from standins import CpuAsCudaGroup
    class Comm:
        def async_error(self): return None
        def stuck_call(self, after_s): return None
        def abort(self, on_behalf_of=None): print("comm aborted", flush=True)
    group = CpuAsCudaGroup(dist.HashStore(), 0, 2, datetime.timedelta(seconds=60))
    group._cuda.comm = Comm()
    # the watchdog claimed a fault; its thread is still diagnosing when the process exits
    group._cuda.life.refuse(CollectiveTimeoutError("all_reduce #3 timed out"))
    del group
    print("exiting while the fault is diagnosed", flush=True)
"""


def test_exit_aborts_a_group_whose_fault_is_still_being_diagnosed():
    result = run_script(_EXIT_WHILE_DIAGNOSING_SCRIPT, timeout=30)
    assert result.returncode == 0, result.stderr
    assert "comm aborted" in result.stdout, result.stdout + result.stderr
    assert "faulted (all_reduce #3 timed out) and the process exits before its abort ran" in result.stderr


@pytest.mark.parametrize("hang", [False, True])
def test_exit_aborts_undestroyed_groups_with_a_warning_and_a_deadline(hang):
    result = run_script(_EXIT_SCRIPT.format(hang=hang), timeout=60)
    ended = time.time()
    no_threads_at_exit = sys.version_info >= (3, 12)  # then faulthandler bounds the abort
    assert result.returncode == (1 if hang and no_threads_at_exit else 0), result.stderr
    assert "comm aborted" in result.stdout
    assert "has NOT been destroyed" in result.stderr
    # from the script's last line to its end: the exit deadline (1 s hung, 10 s not) and the
    # interpreter's own teardown, up to 7 s seen on a loaded 2-core machine; a deadline that
    # did not hold would leave the hung abort running until the 60 s timeout
    exiting = float(result.stdout.split("exiting without destroy_process_group at")[1].split()[0])
    assert ended - exiting < (1.0 if hang else 10.0) + 10
    if hang and no_threads_at_exit:
        assert "Timeout (0:00:01)!" in result.stderr and "abort" in result.stderr, result.stderr
    elif hang:
        assert "did not finish within 1 s" in result.stderr


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_gets_a_fresh_watchdog():
    result = run_script("""
        import os, threading, time
        from test_watchdog import stuck_work
        from cupycoll.faults.watchdog import WATCHDOG, Watch
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


# -- completed Works, and event queries on the group's device and next to a capture -------


def _released_when_done(how):
    watch = Watch("g", timeout=60, interval=0.01, communicators=list, on_fault=pytest.fail)
    work, event = issued_work()
    staging = torch.ones(8)  # held by nothing but the Work's keepalive
    gone = weakref.ref(staging)
    work._issued(None, event, keepalive=(work._outputs[0], staging))
    del staging
    watch.track(work)
    event.fired.set()
    assert watch.poll() is None if how == "watchdog" else watch.drain(1.0)
    return watch, work, gone


@pytest.mark.parametrize("how", ["watchdog", "drain"])
def test_a_completed_work_still_held_releases_its_tensors(how):
    # A caller may hold a completed Work for long: it must not pin its inputs and staging
    # buffers until the caller happens to ask is_completed().
    watch, work, gone = _released_when_done(how)
    assert not watch.inflight and work._keepalive is None and gone() is None
    assert work.is_success() and work.result()  # the outputs are the caller's, kept


class CountedEvent:
    """An event that has fired, counting its queries."""

    def __init__(self):
        self.queries = 0

    def query(self):
        self.queries += 1
        return True


class NeverDoneEvent:
    def query(self):
        return False


def _tracked_with(event, timeout=60.0):
    watch = Watch("g", timeout=timeout, interval=0.01, communicators=list, on_fault=pytest.fail)
    work, _ = issued_work()
    work._issued(None, event, keepalive=work._outputs[0])
    work.watch_handle = watch.track(work)
    return watch, work


def test_a_work_that_saw_its_completion_cancels_its_handle_and_leaves_without_a_query():
    event = CountedEvent()
    watch, work = _tracked_with(event)
    assert work.is_completed() and event.queries == 1  # the caller's query
    assert work.watch_handle.cancelled and work._keepalive is None
    assert watch.poll() is None and watch.works() == [] and event.queries == 1


def test_a_cancelled_handle_never_times_out():
    watch, work = _tracked_with(NeverDoneEvent(), timeout=0.05)
    work.watch_handle.cancel()
    assert watch.poll(now=work.watch_handle.issued_at + 10) is None
    assert watch.fault is None and watch.works() == []


def test_an_uncancelled_handle_still_times_out():
    faults = []
    watch, work = _tracked_with(NeverDoneEvent(), timeout=0.05)
    watch._on_fault = faults.append
    assert isinstance(watch.poll(now=work.watch_handle.issued_at + 10), CollectiveTimeoutError)
    assert faults and isinstance(work.exception(), CollectiveTimeoutError)


def test_a_fault_leaves_a_work_that_showed_its_completion_a_success():
    # An async Work stuck on one stream, then a Work on another stream that ended before it:
    # the caller saw the second complete, and the first one's timeout must not fail it.
    faults = []
    watch, stuck = _tracked_with(NeverDoneEvent(), timeout=0.05)
    watch._on_fault = faults.append
    finished, _ = issued_work()
    finished._issued(None, CountedEvent(), keepalive=finished._outputs[0])
    finished.watch_handle = watch.track(finished)
    assert finished.is_completed()  # cancels its handle; it stays behind the stuck head
    assert watch.works() == [stuck, finished]
    assert isinstance(watch.poll(now=stuck.watch_handle.issued_at + 10), CollectiveTimeoutError)
    assert faults and isinstance(stuck.exception(), CollectiveTimeoutError)
    assert finished.exception() is None and finished.is_success() and watch.works() == []


def test_a_work_done_only_because_it_failed_late_keeps_its_tensors_for_the_abort():
    watch = Watch("g", timeout=60, interval=0.01, communicators=list, on_fault=pytest.fail)
    watch.close(CommunicatorAbortedError("the group is being aborted"))
    work, _ = issued_work()
    watch.track(work)  # a late Work: failed, its kernel may run until the abort returns
    watch._pop_done()  # a popper that started before the close
    assert work.exception() is not None and work._keepalive is not None


class FakeDeviceGuard:
    """torch.cuda.device on CPU: records the device current on each thread."""

    current = {}

    def __init__(self, index):
        self.index = index

    def __enter__(self):
        self.previous = self.current.get(threading.get_ident())
        self.current[threading.get_ident()] = self.index

    def __exit__(self, *exc):
        self.current[threading.get_ident()] = self.previous


class DeviceSeeingEvent:
    """Records which device was current on the querying thread at each query."""

    def __init__(self, done=False):
        self.seen, self.done = [], done

    def query(self):
        device = FakeDeviceGuard.current.get(threading.get_ident())
        self.seen.append((threading.current_thread().name, device))
        return self.done


@pytest.fixture
def fake_cuda(monkeypatch):
    FakeDeviceGuard.current = {}
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device", FakeDeviceGuard)


def test_the_watchdog_thread_queries_events_on_the_groups_device(fake_cuda):
    # Else cudaEventQuery on a thread that never chose a device creates a context on cuda:0.
    watchdog = Watchdog()
    watch = Watch("g", timeout=60, interval=0.01, communicators=list, on_fault=pytest.fail)
    watch.device = 3  # what the backend sets once its first call picked the device
    work = stuck_work()
    work._event = event = DeviceSeeingEvent()
    watch.track(work)
    watchdog.watch(watch)
    try:
        assert eventually(lambda: ("cupycoll-watchdog", 3) in event.seen)
        assert all(device == 3 for _, device in event.seen)
    finally:
        watchdog.stop()


def test_drain_queries_on_the_groups_device_and_restores_the_callers(fake_cuda):
    watch = Watch("g", timeout=60, interval=0.01, communicators=list, on_fault=pytest.fail, device=1)
    work = stuck_work()
    work._event = event = DeviceSeeingEvent(done=True)
    watch.track(work)
    assert watch.drain(1.0)
    assert event.seen == [(threading.current_thread().name, 1)]
    assert FakeDeviceGuard.current[threading.get_ident()] is None  # the caller's, back


def test_a_watch_with_no_device_yet_queries_without_switching_device(fake_cuda):
    watch = Watch("g", timeout=60, interval=0.01, communicators=list, on_fault=pytest.fail)
    work = stuck_work()
    work._event = event = DeviceSeeingEvent(done=True)
    watch.track(work)
    assert watch.poll() is None and event.seen == [(threading.current_thread().name, None)]


class FakeDriver:
    def __init__(self, status=0):
        self.status, self.calls = status, []

    def cuThreadExchangeStreamCaptureMode(self, mode):
        self.calls.append((threading.current_thread().name, mode.contents.value))
        return self.status


def test_the_watchdog_thread_puts_itself_in_thread_local_capture_mode(monkeypatch):
    driver = FakeDriver()
    monkeypatch.setattr(watchdog_cuda, "_driver", lambda: driver)
    watchdog = Watchdog()
    watch = Watch("g", timeout=60, interval=0.01, communicators=list, on_fault=pytest.fail)
    watch.track(stuck_work())
    watchdog.watch(watch)
    try:
        assert eventually(lambda: driver.calls)
        assert driver.calls == [("cupycoll-watchdog", watchdog_cuda.CAPTURE_MODE_THREAD_LOCAL)]
    finally:
        watchdog.stop()


def _missing_driver():
    raise OSError("libcuda.so.1: cannot open shared object file: No such file or directory")


@pytest.mark.parametrize("driver", [_missing_driver, lambda: FakeDriver(status=3), lambda: object()])
def test_without_a_usable_driver_the_watchdog_still_watches(monkeypatch, driver):
    monkeypatch.setattr(watchdog_cuda, "_driver", driver)
    assert watchdog_cuda.use_thread_local_capture_mode() is False  # fails soft
    watchdog = Watchdog()
    faulted = threading.Event()
    watch = Watch("g", timeout=0.05, interval=0.01, communicators=list, on_fault=lambda f: faulted.set())
    watch.track(stuck_work())
    watchdog.watch(watch)
    assert faulted.wait(5)


class AcceleratorErrorLike(RuntimeError):
    """torch >= 2.8's AcceleratorError: the cudaError_t in ``error_code``."""

    def __init__(self, message, error_code):
        super().__init__(message)
        self.error_code = error_code


def _capture_errors():
    errors = [
        RuntimeError("CUDA error: operation not permitted when stream is capturing\nCUDA kernel "
                     "errors might be asynchronously reported at some other API call"),  # torch 2.4
        RuntimeError("CUDA error: operation failed due to a previous error during capture"),
        AcceleratorErrorLike("CUDA error: (text of a newer runtime)", 906),
    ]
    try:
        from cupy_backends.cuda.api.runtime import CUDARuntimeError
        errors.append(CUDARuntimeError(900))
    except ImportError:
        pass
    return errors


class CaptureRefusedEvent:
    """cudaEventQuery while another thread captures a CUDA graph in global mode."""

    def __init__(self, error):
        self.error, self.capturing = error, True

    def query(self):
        if self.capturing:
            raise self.error
        return True


@pytest.mark.parametrize("error", _capture_errors(), ids=repr)
def test_a_query_refused_during_a_capture_is_not_done_yet_not_a_fault(error):
    watch = Watch("g", timeout=60, interval=0.01, communicators=list, on_fault=pytest.fail)
    work = stuck_work()
    work._event = event = CaptureRefusedEvent(error)
    watch.track(work)
    assert watch.poll() is None and watch.works() == [work] and work.exception() is None
    event.capturing = False  # the capture ended
    assert watch.poll() is None and not watch.inflight and work.is_success()


def test_a_capture_refusing_queries_past_the_timeout_is_a_timeout():
    faults = []
    watch = Watch("g", timeout=0.01, interval=0.01, communicators=list, on_fault=faults.append)
    work = stuck_work(seq=4)
    work._event = CaptureRefusedEvent(_capture_errors()[0])
    watch.track(work)
    time.sleep(0.02)
    fault = watch.poll()
    assert isinstance(fault, CollectiveTimeoutError) and "all_reduce #4" in str(fault)


def test_query_errors_other_than_a_capture_stay_faults():
    illegal = RuntimeError("CUDA error: an illegal memory access was encountered")
    assert not watchdog_cuda.is_capture_error(illegal)
    assert not watchdog_cuda.is_capture_error(AcceleratorErrorLike("CUDA error: unspecified launch failure", 719))
