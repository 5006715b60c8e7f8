"""The watchdog (cupycoll.faults.watchdog, watchdog_cuda, heartbeat), abort and teardown under
hostile stand-ins: events that raise or are slow, aborts that raise, hang or end the kernel
before returning, config values the watchdog could not run with, process exit and fork,
completed Works releasing their tensors, and event queries on the group's device and next
to a CUDA graph capture. Each test is named after the rule it pins."""

from __future__ import annotations

import gc
import os
import sys
import textwrap
import threading
import time
import weakref

import pytest
import torch
import torch.distributed as dist

import cupycoll
from cupycoll import _cuda, bounds, config
from cupycoll.faults import watchdog_cuda
from cupycoll.errors import CollectiveTimeoutError, CommunicatorAbortedError, CupycollValueError
from cupycoll.faults.last_words import TERMINATE_EXIT_CODE
from cupycoll.faults.watchdog_thread import Watchdog
from faulty import (CountedEvent, FakeComm, HangingComm, Polled, RaisingComm, RaisingEvent, eventually, fault_group,
                    issued_work, make_group, make_watch, poll, run_script, stuck_work, undiagnosed)
from shapes import shell_of
from standins import FakeEvent


# The scripts' group: rank 0 of 2 on CPU stand-ins, its policy and timeout as given.
_GROUP = """
    import datetime, threading, time
    import standins
    from cupycoll import _cuda, bounds, config
    from faulty import FakeComm, issued_work
    def group_with(timeout, policy="raise", comm=None):
        group = standins.CpuAsCudaGroup(None, 0, 2, datetime.timedelta(seconds=timeout),
                                        config.Options(on_timeout=policy, watchdog_interval=0.01))
        group._cuda.comm = comm if comm is not None else FakeComm()
        group._cuda.life.watching()
        return group
"""


# -- Works are failed before ncclCommAbort, released after --------------------------------


class KernelEndingComm(FakeComm):
    """ncclCommAbort sets the abort flag first (the stuck kernel ends, its event fires), then
    spends a while reclaiming: what a woken caller sees meanwhile is recorded."""

    def __init__(self, work, event):
        super().__init__()
        self.work, self.event, self.seen = work, event, None

    def abort(self, on_behalf_of=None):
        self.event.fired.set()
        self.seen = (self.work.exception(), self.work.is_success(), self.work._slot.keepalive is not None)
        time.sleep(0.05)
        super().abort()


@pytest.mark.parametrize("how", ["watchdog", "user abort"])
def test_works_are_failed_before_the_abort_and_released_after(how):
    group = make_group()
    work, event = issued_work(group._cuda.watch, seq=5)
    comm = group._cuda.comm = KernelEndingComm(work, event)
    if how == "watchdog":
        fault_group(group, CollectiveTimeoutError("all_reduce #5 did not complete"))
    else:
        group.abort()
    error, success, kept = comm.seen
    assert error is not None and not success  # the kernel ended, the Work already failed
    assert kept  # ...but its tensors outlived the abort
    assert work._slot.keepalive is None and group._cuda.state == "aborted"


# -- an event query that raises is the group's fault --------------------------------------


def test_a_raising_event_query_is_the_groups_fault_not_a_silent_loop():
    watch = make_watch(timeout=60)
    work, _ = issued_work(watch, event=RaisingEvent())
    fault = poll(watch)
    assert isinstance(fault, CommunicatorAbortedError)
    assert "illegal memory access" in str(fault) and isinstance(fault.__cause__, RuntimeError)
    assert work.exception() is fault


def test_shutdown_with_a_sticky_cuda_error_aborts_and_never_raises():
    group = make_group()
    comm = group._cuda.comm = FakeComm()
    work, _ = issued_work(group._cuda.watch, event=RaisingEvent())
    group.shutdown()  # must not raise
    assert group._cuda.state == "aborted" and comm.aborted.is_set()
    assert work.exception() is not None


def test_terminate_exits_on_a_sticky_cuda_error():
    result = run_script(prelude=_GROUP, body="""
        from faulty import RaisingEvent
        group = group_with(60, "terminate")
        issued_work(group._cuda.watch, event=RaisingEvent())
        time.sleep(20); print("still alive")
    """)
    assert result.returncode == TERMINATE_EXIT_CODE, result.stderr
    assert "illegal memory access" in result.stderr and "still alive" not in result.stdout


# -- fault handling runs off the watchdog thread, bounded ---------------------------------


def test_a_hung_abort_in_one_group_does_not_blind_the_others():
    hang = threading.Event()
    a, b = make_group(timeout=0.05), make_group(timeout=0.5)
    a._cuda.comm, b._cuda.comm = HangingComm(hang), FakeComm()
    undiagnosed(a, b)
    try:
        issued_work(a._cuda.watch)
        a._cuda.life.watching()
        assert eventually(lambda: a._cuda.comm.aborted.is_set())  # a's abort now hangs
        issued_work(b._cuda.watch)
        b._cuda.life.watching()
        assert b._cuda.life.ended.wait(5)  # found and ended all the same
        assert isinstance(b._cuda.fault, CollectiveTimeoutError) and not a._cuda.life.ended.is_set()
    finally:
        hang.set()


def test_terminate_exits_even_when_the_abort_hangs():
    result = run_script(prelude=_GROUP, body="""
        from faulty import HangingComm
        bounds.FAULT_DEADLINE = 0.5
        group = group_with(0.05, "terminate", HangingComm(threading.Event()))
        issued_work(group._cuda.watch, seq=9)
        time.sleep(20); print("still alive")
    """)
    assert result.returncode == TERMINATE_EXIT_CODE, result.stderr
    assert "all_reduce #9" in result.stderr and "still alive" not in result.stdout


def test_a_stuck_watchdog_is_detected_by_its_heartbeat_and_terminate_exits():
    result = run_script(prelude=_GROUP, body="""
        from faulty import BlockingQueryComm
        bounds.HEARTBEAT_TIMEOUT = 0.3
        group = group_with(60, "terminate", BlockingQueryComm())
        time.sleep(20); print("still alive")
    """)
    assert result.returncode == TERMINATE_EXIT_CODE, result.stderr
    assert "no heartbeat" in result.stderr and "in stuck_call" in result.stderr


# -- an abort that raises skips nothing ---------------------------------------------------


def test_a_raising_abort_still_aborts_the_other_comms_and_fails_the_works():
    group = make_group()
    first, second = RaisingComm(), FakeComm()
    group._cuda.comms.pairs[1] = first
    group._cuda.comm = second
    work = stuck_work(group._cuda.watch)
    shut = []
    group._cuda.life._close_cpu = lambda: shut.append(True)
    with pytest.warns(RuntimeWarning, match="cudaErrorIllegalAddress"):
        group.abort()
    assert second.aborted.is_set() and shut == [True]
    assert isinstance(work.exception(), CommunicatorAbortedError) and work._slot.keepalive is None


def test_terminate_exits_when_the_abort_raises():
    result = run_script(prelude=_GROUP, body="""
        from faulty import RaisingComm
        group = group_with(0.05, "terminate", RaisingComm())
        issued_work(group._cuda.watch)
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
    first = Polled(make_watch(timeout=60))
    watchdog.watch(first)
    assert eventually(lambda: watchdog._thread is None)
    second = Polled(make_watch(timeout=0.05))
    issued_work(second.watch)
    watchdog.watch(second)
    assert second.found.wait(5)
    watchdog.stop()


# -- one popper ---------------------------------------------------------------------------


class SlowDoneEvent(FakeEvent):
    def query(self):
        time.sleep(0.01)  # widens the window between the check and the pop
        return True


def test_drain_and_the_watchdog_never_drop_an_unfinished_work():
    for _ in range(10):
        watch = make_watch(timeout=60)
        done, _ = issued_work(watch, seq=1, event=SlowDoneEvent())
        unfinished, _ = issued_work(watch, seq=2)
        drained = []
        thread = threading.Thread(target=lambda: drained.append(watch.drain(0.2)))
        thread.start()
        poll(watch)
        thread.join()
        assert watch.in_flight() == 1 and unfinished._in_flight() is not None and drained == [False]
        assert done._in_flight() is None


# -- shutdown -----------------------------------------------------------------------------


def test_shutdown_waits_a_short_grace_not_the_timeout(monkeypatch):
    monkeypatch.setattr(bounds, "SHUTDOWN_GRACE", 0.2)
    group = make_group(timeout=30)
    comm = group._cuda.comm = FakeComm()
    work = stuck_work(group._cuda.watch)
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

_EXIT_SCRIPT = textwrap.dedent(_GROUP) + textwrap.dedent("""
    from cupycoll.faults import lifecycle
    bounds.EXIT_DEADLINE = 1.0 if {hang} else 10.0  # a quick abort must not race 1 s
    class Comm(FakeComm):
        def abort(self, on_behalf_of=None):
            print("comm aborted", flush=True)
            if {hang}: threading.Event().wait()
            super().abort()
    group = group_with(60, comm=Comm())
    issued_work(group._cuda.watch)
    print("exiting without destroy_process_group at", time.time(), flush=True)
""")


_EXIT_WHILE_DIAGNOSING_SCRIPT = textwrap.dedent(_GROUP) + textwrap.dedent("""
    from cupycoll.errors import CollectiveTimeoutError
    from cupycoll.faults.watchdog import Finding
    class Comm(FakeComm):
        def abort(self, on_behalf_of=None):
            print("comm aborted", flush=True)
            super().abort()
    group = group_with(60, comm=Comm())
    work, _ = issued_work(group._cuda.watch, seq=3)
    # the watchdog claimed a fault; its thread is still diagnosing when the process exits
    group._cuda.life._explain = lambda entry, timeout_s: time.sleep(30)
    group._cuda.life.claim(Finding(CollectiveTimeoutError("all_reduce #3 timed out"), work._slot))
    del group
    print("exiting while the fault is diagnosed", flush=True)
""")


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
    # interpreter's own teardown, up to 16 s seen on a 2-core machine running 8 test
    # processes; a deadline that did not hold would leave the hung abort running until the
    # 60 s timeout
    exiting = float(result.stdout.split("exiting without destroy_process_group at")[1].split()[0])
    assert ended - exiting < (1.0 if hang else 10.0) + 20
    if hang and no_threads_at_exit:
        assert "Timeout (0:00:01)!" in result.stderr and "abort" in result.stderr, result.stderr
    elif hang:
        assert "did not finish within 1 s" in result.stderr


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_gets_a_fresh_watchdog():
    result = run_script(prelude=_GROUP, body="""
        import os
        from cupycoll.faults.watchdog_thread import WATCHDOG
        parent = group_with(60)
        issued_work(parent._cuda.watch)
        pid = os.fork()
        if pid == 0:
            ok = not WATCHDOG.running
            child = group_with(0.05)
            issued_work(child._cuda.watch)
            os._exit(0 if ok and child._cuda.life.ended.wait(5) else 1)
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status))
    """)
    assert "child 0" in result.stdout, result.stderr


# -- the flight recorder: completion, and the timeout's message ----------------------------


def test_a_retired_batch_is_marked_completed_in_the_flight_recorder():
    group = make_group()
    recorder = group._cuda.trace.recorder
    entries = [recorder.record("all_reduce", (torch.Size([4]),), (torch.float32,)) for _ in range(3)]
    events = []
    for entry in entries:
        event = FakeEvent()
        events.append(event)
        issued_work(group._cuda.watch, event=event)
        group._cuda.watch._streams[0][-1].records = entry
    for event in events:
        event.fired.set()
    assert group._cuda.watch.check() is None
    assert [entry[7] for entry in entries] == ["completed"] * 3 and recorder.last_completed == 3


def test_explain_timeout_becomes_the_timeout_message():
    asked = []

    def explain(entry, timeout):
        asked.append((entry[0], timeout))
        return "rank 1 never reached all_reduce #3 (it is at #2)"

    group = make_group(timeout=0.01)
    group._cuda.comm = FakeComm()
    group._cuda.life._explain = explain
    work = stuck_work(group._cuda.watch, seq=3)
    time.sleep(0.02)
    finding = group._cuda.watch.check()
    fault_group(group, finding.fault, finding.batch)
    fault = group._cuda.fault
    assert asked == [(3, 0.01)] and str(fault) == "rank 1 never reached all_reduce #3 (it is at #2)"
    assert isinstance(fault, CollectiveTimeoutError) and work.exception() is fault


# -- completed Works, and what a Work keeps ------------------------------------------------


def _released_when_done(how):
    watch = make_watch(timeout=60)
    staging = torch.ones(8)  # held by nothing but the call's keepalive
    gone = weakref.ref(staging)
    work, event = issued_work(watch, keepalive=(torch.ones(4), staging))
    del staging
    event.fired.set()
    assert poll(watch) is None if how == "watchdog" else watch.drain(1.0)
    return watch, work, gone


@pytest.mark.parametrize("how", ["watchdog", "drain"])
def test_a_completed_work_still_held_releases_its_tensors(how):
    # A caller may hold a completed Work for long: it must not pin its inputs and staging
    # buffers until the caller happens to ask is_completed().
    watch, work, gone = _released_when_done(how)
    assert not watch.in_flight() and gone() is None
    assert work.is_success() and work.result()  # the outputs are the caller's, kept


def test_a_synchronous_work_the_caller_drops_leaves_nothing_of_it_behind():
    # The watch holds plain data of a batch in flight (its event, its flight-recorder entry),
    # never the Work: a synchronous caller's Work dies with its reference, so no object of a
    # call outlives it for the garbage collector to chase.
    watch = make_watch(timeout=60)
    work, _ = issued_work(watch, keepalive=())
    gone = weakref.ref(work)
    del work
    assert gone() is None and watch.in_flight() == 1
    gc.collect()
    assert not any(type(obj).__name__ == "CudaWork" and obj._watch is watch for obj in gc.get_objects())


def test_a_fault_leaves_a_work_that_showed_its_completion_a_success():
    # An async Work stuck on one stream, then a Work on another stream that ended before it:
    # the caller saw the second complete, and the first one's timeout must not fail it.
    watch = make_watch(timeout=0.05)
    stuck, _ = issued_work(watch, stream=1)
    finished, _ = issued_work(watch, event=CountedEvent(done=True), stream=2)
    assert finished.is_completed()
    fault = poll(watch, now=stuck._slot.issued_at + 10)
    assert isinstance(fault, CollectiveTimeoutError) and isinstance(stuck.exception(), CollectiveTimeoutError)
    assert finished.exception() is None and finished.is_success()


def test_a_work_looked_at_while_its_groups_fault_is_explained_never_reads_as_a_success():
    # A timeout was claimed and its diagnosis waits for a silent peer; meanwhile another
    # communicator of the group aborts itself (a nonblocking poll's deadline), which ends
    # every kernel. A caller looking at an earlier Work then must see the fault, for good.
    group = make_group(timeout=0.05)
    cuda = group._cuda
    first, second = FakeComm(), FakeComm()
    cuda.comm, cuda.comms.pairs[1] = first, second
    explaining, release = threading.Event(), threading.Event()

    def explain(entry, timeout_s):
        explaining.set()
        release.wait(10)
        return "all_reduce #1 timed out; rank 1 is behind"

    cuda.life._explain = explain
    work, event = issued_work(cuda.watch, seq=1)
    try:
        finding = cuda.watch.check(now=work._slot.issued_at + 1)
        assert cuda.life.claim(finding)
        assert explaining.wait(5) and cuda.state == "aborting"
        cuda.life.fault_once(CollectiveTimeoutError("ncclAllReduce did not complete within 0.05 s"))
        second.abort()  # the communicator's own abort: the kernels end
        event.fired.set()
        assert work.is_completed() and not work.is_success()
        assert isinstance(work.exception(), CollectiveTimeoutError)
        with pytest.raises(CollectiveTimeoutError):
            work.wait()
    finally:
        release.set()
    assert cuda.life.ended.wait(5)
    assert not work.is_success() and "rank 1 is behind" in str(work.exception())


def test_a_work_done_only_because_it_failed_late_keeps_its_tensors_for_the_abort():
    watch = make_watch(timeout=60)
    watch.close(CommunicatorAbortedError("the group is being aborted"))
    work, event = issued_work(watch)  # a late batch: failed, its kernel may run until the abort returns
    event.fired.set()
    watch.retire()  # a popper that started before the close
    assert work.exception() is not None and work._slot.keepalive is not None
    watch.release()
    assert work._slot.keepalive is None


class DeviceSeeingEvent(FakeEvent):
    """Records which device was current on the querying thread at each query (the device
    ledger's, tests/standins.py)."""

    def __init__(self, ledger, done=False):
        super().__init__()
        self.seen, self.done, self._seen_by = [], done, ledger

    def query(self):
        self.seen.append((threading.current_thread().name, self._seen_by.device_in_thread()))
        return self.done


def test_the_watchdog_thread_queries_events_on_the_groups_device(cuda_standins):
    # Else cudaEventQuery on a thread that never chose a device creates a context on cuda:0.
    watchdog = Watchdog()
    watch = make_watch(timeout=60)
    watch.device = 3  # what the backend sets once its first call picked the device
    event = DeviceSeeingEvent(cuda_standins)
    issued_work(watch, event=event)
    polled = Polled(watch)  # the watchdog holds what it polls weakly
    watchdog.watch(polled)
    try:
        assert eventually(lambda: ("cupycoll-watchdog", 3) in event.seen)
        assert all(device == 3 for _, device in event.seen)
        assert cuda_standins.contexts == {3}
    finally:
        watchdog.stop()


def test_a_pooled_event_is_made_on_the_groups_device_whatever_the_caller_has_current(cuda_standins):
    watch = make_watch(timeout=60)
    watch.device = 2
    cuda_standins.set_device(0)  # the caller's current device
    watch.issued(0, None)
    assert cuda_standins.made == [("event", 2)] and cuda_standins.current_device() == 0


def test_drain_queries_on_the_groups_device_and_restores_the_callers(cuda_standins):
    watch = make_watch(timeout=60)
    watch.device = 1
    cuda_standins.set_device(5)
    event = DeviceSeeingEvent(cuda_standins, done=True)
    issued_work(watch, event=event)
    assert watch.drain(1.0)
    assert event.seen == [(threading.current_thread().name, 1)]
    assert cuda_standins.current_device() == 5  # the caller's, back


def test_a_watch_with_no_device_yet_queries_without_switching_device(cuda_standins):
    watch = make_watch(timeout=60)
    event = DeviceSeeingEvent(cuda_standins, done=True)
    issued_work(watch, event=event)
    assert poll(watch) is None and event.seen == [(threading.current_thread().name, 0)]
    assert cuda_standins.contexts == set()  # nothing was asked of CUDA but the event


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
    watch = make_watch(timeout=60)
    stuck_work(watch)
    polled = Polled(watch)  # the watchdog holds what it polls weakly
    watchdog.watch(polled)
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
    polled = Polled(make_watch(timeout=0.05))
    stuck_work(polled.watch)
    watchdog.watch(polled)
    assert polled.found.wait(5)
    watchdog.stop()


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


class CaptureRefusedEvent(FakeEvent):
    """cudaEventQuery while another thread captures a CUDA graph in global mode."""

    def __init__(self, error):
        super().__init__()
        self.error, self.capturing = error, True

    def query(self):
        if self.capturing:
            raise self.error
        return True


@pytest.mark.parametrize("error", _capture_errors(), ids=repr)
def test_a_query_refused_during_a_capture_is_not_done_yet_not_a_fault(error):
    watch = make_watch(timeout=60)
    event = CaptureRefusedEvent(error)
    work, _ = issued_work(watch, event=event)
    assert poll(watch) is None and watch.in_flight() == 1 and work.exception() is None
    event.capturing = False  # the capture ended
    assert poll(watch) is None and not watch.in_flight() and work.is_success()


def test_a_capture_refusing_queries_past_the_timeout_is_a_timeout():
    watch = make_watch(timeout=0.01)
    issued_work(watch, seq=4, event=CaptureRefusedEvent(_capture_errors()[0]))
    time.sleep(0.02)
    fault = poll(watch)
    assert isinstance(fault, CollectiveTimeoutError) and "all_reduce #4" in str(fault)


def test_query_errors_other_than_a_capture_stay_faults():
    illegal = RuntimeError("CUDA error: an illegal memory access was encountered")
    assert not watchdog_cuda.is_capture_error(illegal)
    assert not watchdog_cuda.is_capture_error(AcceleratorErrorLike("CUDA error: unspecified launch failure", 719))
