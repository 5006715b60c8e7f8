"""NCCL calls counted while they run (cupycoll.nccl.call_guard), on CPU with a scripted NCCL
library: an abort from another thread never runs ncclCommAbort beside a call, or an open NCCL
group, under way on the communicator, and never waits for one either: the call runs it on
its way out; a call that fails once its communicator was aborted says so; an abort on the
calling thread itself, also inside the communicator's lock, goes ahead at once; and the
watchdog's ncclCommGetAsyncError never runs beside a call or an open group on the
communicator that entered less than ``bounds.CALL_BLOCKED_S`` ago."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from cupycoll import bounds
from cupycoll.nccl import header as nh
from cupycoll.nccl.communicators import Communicators
from cupycoll.errors import CommunicatorAbortedError, NcclError
from faulty import ScriptedLibrary, grouping_comm, polling_comm


class SlowCallLibrary(ScriptedLibrary):
    """ncclAllReduce blocks until released; the order of events is recorded."""

    def __init__(self):
        super().__init__([nh.ncclSuccess])
        self.inside, self.release, self.events = threading.Event(), threading.Event(), []
        self.fail_with = None

    def ncclAllReduce(self, *args):
        self.events.append(("call", args[-2]))  # the communicator handle NCCL got
        self.inside.set()
        self.release.wait(10)
        self.events.append("call returned")
        if self.fail_with is not None:
            raise self.fail_with
        return nh.ncclSuccess

    def ncclCommAbort(self, comm):
        self.events.append("ncclCommAbort")
        return 0


def send_in_a_group(comm) -> None:
    """One send in an NCCL group on ``comm``: the group's ncclGroupEnd is its library's."""
    with comm.group():
        comm._settle("ncclSend", nh.ncclSuccess)


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


def test_an_abort_beside_a_call_never_enters_nccl_and_the_call_runs_it_on_its_way_out(no_device):
    # NCCL forbids a call on a communicator while another thread is inside one on it.
    comm = polling_comm([nh.ncclSuccess])
    lib = comm._lib = SlowCallLibrary()
    caller = threading.Thread(target=comm.all_reduce, args=(1, 1, 4, 7, 0, 0))
    caller.start()
    assert lib.inside.wait(5)
    start = time.monotonic()
    assert comm.abort() is None  # nothing ended now: the call is inside
    assert time.monotonic() - start < 0.5  # and nothing waited for it
    assert comm.state == "aborted" and comm.abort_deferred() and "ncclCommAbort" not in lib.events
    with pytest.raises(CommunicatorAbortedError, match="was aborted"):  # no new call enters
        comm.all_reduce(1, 1, 4, 7, 0, 0)
    lib.release.set()
    caller.join(5)
    assert lib.events == [("call", 1234), "call returned", "ncclCommAbort"]
    assert comm.abort_done.is_set() and not comm.abort_deferred()


def test_a_call_that_fails_once_its_communicator_was_aborted_says_aborted(no_device):
    comm = polling_comm([nh.ncclSuccess])
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
    comm.abort()
    lib.release.set()
    caller.join(5)
    assert isinstance(errors[0], CommunicatorAbortedError) and errors[0].during_call
    assert isinstance(errors[0].__cause__, NcclError)
    assert lib.events[-2:] == ["call returned", "ncclCommAbort"]


def test_an_abort_on_the_calling_thread_itself_does_not_wait(no_device):
    comm = polling_comm([nh.ncclSuccess])
    started = []

    class Reentrant(ScriptedLibrary):
        def ncclAllReduce(self, *args):
            start = time.monotonic()
            comm.abort()  # abort_all from a signal handler, on this thread
            started.append(time.monotonic() - start)
            return nh.ncclSuccess

    comm._lib = Reentrant([nh.ncclSuccess])
    comm.all_reduce(1, 1, 4, 7, 0, 0)
    assert started[0] < 0.5 and comm.state == "aborted"


def test_an_abort_on_a_thread_holding_the_communicator_lock_does_not_hang(no_device):
    # A signal handler (abort_all) runs between bytecodes, also inside one of the lock's
    # blocks on the issuing thread: the abort must get through on that same thread.
    comm = polling_comm([nh.ncclSuccess])
    done = threading.Event()

    def interrupted_inside_the_lock():
        with comm._lock:
            comm.abort()
        done.set()
    threading.Thread(target=interrupted_inside_the_lock, daemon=True).start()
    assert done.wait(3) and comm.state == "aborted"


def test_an_abort_of_a_communicator_in_an_open_nccl_group_runs_when_the_group_has_ended(no_device):
    # The calls of a group really launch (and connect) in ncclGroupEnd: an abort on another
    # thread must not free the communicator under it, nor wait for it.
    comm, events, inside_end, release = comm_with_a_slow_group_end()
    raised = []

    def grouped_send():
        try:
            send_in_a_group(comm)
        except CommunicatorAbortedError as exc:  # polled after the end: aborted meanwhile
            raised.append(exc)
    caller = threading.Thread(target=grouped_send)
    caller.start()
    assert inside_end.wait(5)
    comm.abort()  # returns at once
    assert events == ["start"] and comm.abort_deferred()
    release.set()
    caller.join(5)
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
    monkeypatch.setattr(bounds, "CALL_BLOCKED_S", 30)  # the call is an enqueue, not blocked
    comm = polling_comm([nh.ncclSuccess])
    lib = comm._lib = RecordedQueryLibrary()
    with all_reduce_under_way(comm, lib):
        assert comm.async_error() is None and "query" not in lib.events  # asked again next pass
    assert comm.async_error() is None and lib.events[-1] == "query"


def test_a_call_blocked_inside_nccl_does_not_hide_the_async_error(no_device, monkeypatch):
    # past CALL_BLOCKED_S a call is blocked (a connect, a full launch queue): NCCL's error
    # may be the only news of the fault behind it, so the watchdog asks beside it
    monkeypatch.setattr(bounds, "CALL_BLOCKED_S", 0.05)
    comm = polling_comm([nh.ncclSuccess])
    lib = comm._lib = RecordedQueryLibrary()
    lib.states = [REMOTE_ERROR]
    with all_reduce_under_way(comm, lib):
        time.sleep(0.1)
        error = comm.async_error()
        assert isinstance(error, NcclError) and error.status == REMOTE_ERROR and "query" in lib.events


def test_the_async_error_query_skips_a_communicator_in_an_open_group(no_device, monkeypatch):
    monkeypatch.setattr(bounds, "CALL_BLOCKED_S", 30)
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
    comm = polling_comm([nh.ncclSuccess])
    lib = comm._lib = SlowCallLibrary()
    assert comm.stuck_call(0.0) is None  # nothing under way
    with all_reduce_under_way(comm, lib):
        time.sleep(0.1)
        function, seconds = comm.stuck_call(0.05)
        assert function == "ncclAllReduce" and seconds >= 0.1
        assert comm.stuck_call(30) is None  # not yet that long
    assert comm.stuck_call(0.0) is None


def test_an_aborted_communicators_stuck_call_is_left_to_its_groups_end(no_device):
    # The group's fault aborted it: while the group is healthy a communicator's end is not a
    # new fault; once the group ended, a call the abort could not end is what ends the process.
    comm = polling_comm([nh.ncclSuccess])
    lib = comm._lib = SlowCallLibrary()
    held = Communicators()
    held.group = comm
    with all_reduce_under_way(comm, lib):
        time.sleep(0.1)
        comm.abort()
        assert comm.stuck_call(0.05)[0] == "ncclAllReduce"  # still inside: no abort ran beside it
        assert held.stuck_call(0.05) is None
        assert held.stuck_call(0.05, ended=True)[0] == "ncclAllReduce"
        assert held.blocked()


def test_a_group_whose_launch_fails_once_its_communicator_was_aborted_says_so(no_device):
    inside_end, fail = threading.Event(), threading.Event()

    def end_fails_when_told():
        inside_end.set()
        fail.wait(10)
        raise NcclError(3, "ncclGroupEnd", "internal error", "the connection was aborted")
    comm, events = grouping_comm(end_fails_when_told)
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
    fail.set()
    caller.join(5)
    assert len(raised) == 1 and raised[0].during_call and "ncclGroupEnd" in str(raised[0])
    assert isinstance(raised[0].__cause__, NcclError) and comm._callers == []
    assert events == ["start", "abort"]  # ncclCommAbort once the group had ended


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
