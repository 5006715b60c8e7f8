"""NCCL calls counted while they run (cupycoll.nccl.call_guard), on CPU with a scripted NCCL
library: an abort from another thread waits for a call, or an open NCCL group, under way on
the communicator (at most ``call_guard.ENTER_WAIT_S``) before it frees it; a call it freed
the communicator under says so; an abort on the calling thread itself, also inside the
communicator's lock, never waits for that thread; and the watchdog's ncclCommGetAsyncError
never runs beside a call or an open group on the communicator."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from cupycoll.nccl import call_guard
from cupycoll.nccl import bindings as nb
from cupycoll.errors import CommunicatorAbortedError, NcclError
from test_faults import ScriptedLibrary, grouping_comm, no_device, polling_comm  # noqa: F401 - no_device: a fixture


class SlowCallLibrary(ScriptedLibrary):
    """ncclAllReduce blocks until released; the order of events is recorded."""

    def __init__(self):
        super().__init__([nb.ncclSuccess])
        self.inside, self.release, self.events = threading.Event(), threading.Event(), []
        self.fail_with = None

    def ncclAllReduce(self, *args):
        self.events.append(("call", args[-2]))  # the communicator handle NCCL got
        self.inside.set()
        self.release.wait(10)
        self.events.append("call returned")
        if self.fail_with is not None:
            raise self.fail_with
        return nb.ncclSuccess

    def ncclCommAbort(self, comm):
        self.events.append("ncclCommAbort")
        return 0


def send_in_a_group(comm) -> None:
    """One send in an NCCL group on ``comm``: the group's ncclGroupEnd is its library's."""
    with comm.group():
        comm._settle("ncclSend", nb.ncclSuccess)


def comm_with_a_slow_group_end():
    """A communicator whose ncclGroupEnd waits until released: (communicator, its recorded
    events, set once inside ncclGroupEnd, the release)."""
    inside_end, release = threading.Event(), threading.Event()

    def slow_group_end():
        inside_end.set()
        release.wait(10)
    comm, events = grouping_comm(slow_group_end)
    return comm, events, inside_end, release


@contextlib.contextmanager
def all_reduce_under_way(comm, lib):
    """``comm.all_reduce`` on another thread, inside ``lib``'s ncclAllReduce (a
    SlowCallLibrary) for the body; released and joined after it."""
    caller = threading.Thread(target=comm.all_reduce, args=(1, 1, 4, 7, 0, 0))
    caller.start()
    try:
        assert lib.inside.wait(5)
        yield caller
    finally:
        lib.release.set()
        caller.join(5)


def test_abort_waits_for_an_nccl_call_under_way(no_device, monkeypatch):
    monkeypatch.setattr(call_guard, "ENTER_WAIT_S", 30)  # a late main thread must not outwait it
    comm = polling_comm([nb.ncclSuccess])
    lib = comm._lib = SlowCallLibrary()
    caller = threading.Thread(target=comm.all_reduce, args=(1, 1, 4, 7, 0, 0))
    caller.start()
    assert lib.inside.wait(5)
    aborter = threading.Thread(target=comm.abort)
    aborter.start()
    aborter.join(0.2)
    assert aborter.is_alive() and "ncclCommAbort" not in lib.events  # not under the call
    lib.release.set()
    caller.join(5)
    aborter.join(5)
    assert lib.events == [("call", 1234), "call returned", "ncclCommAbort"]
    with pytest.raises(CommunicatorAbortedError, match="was aborted"):  # never a NULL handle
        comm.all_reduce(1, 1, 4, 7, 0, 0)


def test_a_call_an_abort_freed_its_communicator_under_says_aborted(no_device, monkeypatch):
    monkeypatch.setattr(call_guard, "ENTER_WAIT_S", 0.05)  # a call blocked in NCCL
    comm = polling_comm([nb.ncclSuccess])
    lib = comm._lib = SlowCallLibrary()
    lib.fail_with = NcclError(4, "ncclAllReduce", "invalid argument")
    errors = []

    def call():
        try:
            comm.all_reduce(1, 1, 4, 7, 0, 0)
        except Exception as exc:  # noqa: BLE001 - checked below
            errors.append(exc)
    caller = threading.Thread(target=call)
    caller.start()
    assert lib.inside.wait(5)
    comm.abort()  # gives up waiting after ENTER_WAIT_S: only the abort ends a blocked call
    assert "ncclCommAbort" in lib.events and "call returned" not in lib.events
    lib.release.set()
    caller.join(5)
    assert isinstance(errors[0], CommunicatorAbortedError) and isinstance(errors[0].__cause__, NcclError)


def test_an_abort_on_the_calling_thread_itself_does_not_wait(no_device):
    comm = polling_comm([nb.ncclSuccess])
    started = []

    class Reentrant(ScriptedLibrary):
        def ncclAllReduce(self, *args):
            start = time.monotonic()
            comm.abort()  # abort_all from a signal handler, on this thread
            started.append(time.monotonic() - start)
            return nb.ncclSuccess

    comm._lib = Reentrant([nb.ncclSuccess])
    comm.all_reduce(1, 1, 4, 7, 0, 0)
    assert started[0] < 0.5 and comm.state == "aborted"


def test_an_abort_on_a_thread_holding_the_communicator_lock_does_not_hang(no_device):
    # A signal handler (abort_all) runs between bytecodes, also inside one of the lock's
    # blocks on the issuing thread: the abort must get through on that same thread.
    comm = polling_comm([nb.ncclSuccess])
    done = threading.Event()

    def interrupted_inside_the_lock():
        with comm._lock:
            comm.abort()
        done.set()
    threading.Thread(target=interrupted_inside_the_lock, daemon=True).start()
    assert done.wait(3) and comm.state == "aborted"


def test_an_abort_waits_for_an_open_nccl_group_to_end(no_device, monkeypatch):
    # The calls of a group really launch (and connect) in ncclGroupEnd: an abort on another
    # thread must not free the communicator under it.
    monkeypatch.setattr(call_guard, "ENTER_WAIT_S", 30)  # a late main thread must not outwait it
    inside_end, release = threading.Event(), threading.Event()

    def slow_group_end():
        inside_end.set()
        release.wait(10)

    comm, events = grouping_comm(slow_group_end)

    raised = []

    def grouped_send():
        try:
            with comm.group():
                comm._settle("ncclSend", nb.ncclSuccess)
        except CommunicatorAbortedError as exc:  # polled after the end: aborted meanwhile
            raised.append(exc)
    caller = threading.Thread(target=grouped_send)
    caller.start()
    assert inside_end.wait(5)
    aborter = threading.Thread(target=comm.abort)
    aborter.start()
    aborter.join(0.2)
    assert aborter.is_alive() and events == ["start"]
    release.set()
    caller.join(5)
    aborter.join(5)
    assert events == ["start", "end", "abort"] and comm._callers == []
    assert len(raised) == 1


REMOTE_ERROR = 6  # ncclRemoteError: a peer's process or network failed


class RecordedQueryLibrary(SlowCallLibrary):
    """SlowCallLibrary whose ncclCommGetAsyncError is recorded, and held while ``hold_query``
    is set until ``release_query`` is."""

    def __init__(self):
        super().__init__()
        self.hold_query, self.in_query, self.release_query = False, threading.Event(), threading.Event()

    def ncclCommGetAsyncError(self, comm, status_ref):
        self.events.append("query")
        if self.hold_query:
            self.in_query.set()
            self.release_query.wait(10)
        return super().ncclCommGetAsyncError(comm, status_ref)


def test_the_async_error_query_skips_a_communicator_with_a_call_under_way(no_device, monkeypatch):
    monkeypatch.setattr(call_guard, "ENTER_WAIT_S", 30)  # the call is an enqueue, not blocked
    comm = polling_comm([nb.ncclSuccess])
    lib = comm._lib = RecordedQueryLibrary()
    with all_reduce_under_way(comm, lib):
        assert comm.async_error() is None and "query" not in lib.events  # asked again next pass
    assert comm.async_error() is None and lib.events[-1] == "query"


def test_a_call_blocked_inside_nccl_does_not_hide_the_async_error(no_device, monkeypatch):
    # past ENTER_WAIT_S a call is blocked (a connect, a full launch queue): NCCL's error may
    # be the only news of the fault behind it, so the watchdog asks beside it
    monkeypatch.setattr(call_guard, "ENTER_WAIT_S", 0.05)
    comm = polling_comm([nb.ncclSuccess])
    lib = comm._lib = RecordedQueryLibrary()
    lib.states = [REMOTE_ERROR]
    with all_reduce_under_way(comm, lib):
        time.sleep(0.1)
        error = comm.async_error()
        assert isinstance(error, NcclError) and error.status == REMOTE_ERROR and "query" in lib.events


def test_the_async_error_query_skips_a_communicator_in_an_open_group(no_device, monkeypatch):
    monkeypatch.setattr(call_guard, "ENTER_WAIT_S", 30)
    comm, events, inside_end, release = comm_with_a_slow_group_end()
    queries = []
    comm._lib.ncclCommGetAsyncError = lambda handle, status: queries.append(handle) or 0

    caller = threading.Thread(target=send_in_a_group, args=(comm,))
    caller.start()
    assert inside_end.wait(5)
    assert comm.async_error() is None and queries == []
    release.set()
    caller.join(5)
    assert comm._callers == [] and queries  # the group's own poll after its end


def test_a_group_does_not_end_beside_an_async_error_query_under_way(no_device):
    # The query holds the lock; a group joining the communicator waits for it, so the
    # group's ncclGroupEnd (where its calls launch) cannot run beside the query.
    comm, events = grouping_comm()
    lib = RecordedQueryLibrary()
    lib.hold_query = True
    comm._lib.ncclCommGetAsyncError = lib.ncclCommGetAsyncError
    querier = threading.Thread(target=comm.async_error)
    querier.start()
    assert lib.in_query.wait(5)
    caller = threading.Thread(target=send_in_a_group, args=(comm,))
    caller.start()
    deadline = time.monotonic() + 5
    while "start" not in events and time.monotonic() < deadline:
        time.sleep(0.01)
    caller.join(0.2)
    assert caller.is_alive() and events == ["start"]  # waiting to join, before the end
    lib.hold_query = False
    lib.release_query.set()
    querier.join(5)
    caller.join(5)
    assert not caller.is_alive() and events == ["start", "end"]


def test_a_call_inside_nccl_longer_than_asked_is_named_with_its_seconds(no_device):
    comm = polling_comm([nb.ncclSuccess])
    lib = comm._lib = SlowCallLibrary()
    assert comm.stuck_call(0.0) is None  # nothing under way
    with all_reduce_under_way(comm, lib):
        time.sleep(0.1)
        function, seconds = comm.stuck_call(0.05)
        assert function == "ncclAllReduce" and seconds >= 0.1
        assert comm.stuck_call(30) is None  # not yet that long
    assert comm.stuck_call(0.0) is None


def test_an_aborted_communicator_reports_no_stuck_call(no_device, monkeypatch):
    monkeypatch.setattr(call_guard, "ENTER_WAIT_S", 0.05)
    comm = polling_comm([nb.ncclSuccess])
    lib = comm._lib = SlowCallLibrary()
    with all_reduce_under_way(comm, lib):
        comm.abort()  # past ENTER_WAIT_S it goes ahead beside the call
        assert comm.stuck_call(0.0) is None  # the abort is ending it: not a new fault


def test_a_group_whose_launch_an_abort_ended_says_so(no_device, monkeypatch):
    monkeypatch.setattr(call_guard, "ENTER_WAIT_S", 0.05)
    inside_end, aborted = threading.Event(), threading.Event()

    def end_stuck_until_aborted():
        inside_end.set()
        aborted.wait(10)
        raise NcclError(3, "ncclGroupEnd", "internal error", "the connection was aborted")
    comm, events = grouping_comm(end_stuck_until_aborted)
    original_abort = comm._lib.ncclCommAbort

    def abort(handle):
        aborted.set()
        return original_abort(handle)
    comm._lib.ncclCommAbort = abort
    raised = []

    def grouped_send():
        try:
            send_in_a_group(comm)
        except CommunicatorAbortedError as exc:
            raised.append(exc)
    caller = threading.Thread(target=grouped_send)
    caller.start()
    assert inside_end.wait(5)
    comm.abort()
    caller.join(5)
    assert len(raised) == 1 and raised[0].during_call and "ncclGroupEnd" in str(raised[0])
    assert isinstance(raised[0].__cause__, NcclError) and comm._callers == []


def test_an_open_group_is_named_by_the_call_that_launches_it(no_device):
    comm, events, inside_end, release = comm_with_a_slow_group_end()
    caller = threading.Thread(target=send_in_a_group, args=(comm,))
    caller.start()
    try:
        assert inside_end.wait(5)
        assert comm.stuck_call(0.0)[0] == "ncclGroupEnd"
    finally:
        release.set()
        caller.join(5)
