"""Races in the abort/fault path (cupycoll.faults.lifecycle): a Work issued while an abort runs,
calls made while a fault is being diagnosed, two aborts at once, fork, and the bound on
every abort a user can call. The interleavings are forced with seams (a communicator whose
abort waits, a blocking step), so each test is deterministic. Each test is named after the
rule it pins."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from torch._C import _distributed_c10d as c10d

import cupycoll
from cupycoll.errors import CollectiveTimeoutError, CommunicatorAbortedError
from cupycoll import bounds
from cupycoll.faults.watchdog import Finding
from faulty import FakeComm, eventually, issued_work, make_group, run_script, stuck_work
from standins import CUDA, IssuingGroup


# -- a Work issued while an abort runs fails ----------------------------------------------


def test_a_work_tracked_after_the_abort_failed_the_works_fails_and_is_released():
    group = make_group()
    group._cuda.comm = FakeComm()
    group.abort()
    # its caller passed the checks and launched before the abort
    work, event = issued_work(group._cuda.watch, seq=7)
    event.fired.set()  # the abort ended its kernel
    assert not work.is_success()
    assert isinstance(work.exception(), CommunicatorAbortedError)
    assert work._slot.keepalive is None and not group._cuda.watch.in_flight()  # released at once


class LateTrackingComm(FakeComm):
    """Another thread's call reaches the watchdog while ncclCommAbort runs."""

    def __init__(self, watch):
        super().__init__()
        self.watch, self.work, self.seen = watch, None, None

    def abort(self, on_behalf_of=None):
        self.work, _ = issued_work(self.watch, seq=8)
        self.seen = (self.work.exception(), self.work._slot.keepalive is not None)
        super().abort()


def test_a_work_tracked_during_the_abort_fails_and_keeps_its_tensors_until_it_returned():
    group = make_group()
    comm = group._cuda.comm = LateTrackingComm(group._cuda.watch)
    group.abort()
    error, kept = comm.seen
    assert isinstance(error, CommunicatorAbortedError) and kept  # the kernel may still run
    assert comm.work._slot.keepalive is None and not group._cuda.watch.in_flight()


def test_the_covering_work_of_a_block_closed_during_an_abort_fails():
    import datetime
    group = IssuingGroup(None, 0, 2, datetime.timedelta(seconds=5))

    def abort_before_tracking():  # another thread aborts just before the block's batch is issued
        group._issuer.before_tracking = None
        aborter = threading.Thread(target=group.abort)
        aborter.start()
        aborter.join(5)

    group._start_coalescing(CUDA)
    inner = group.allreduce([torch.ones(4)], c10d.AllreduceOptions())
    group._issuer.before_tracking = abort_before_tracking
    covering = group._end_coalescing(CUDA)
    group._issuer.event.fired.set()  # the abort ended the kernel
    assert group._cuda.state == "aborted" and not inner.is_success()
    assert not covering.is_success() and isinstance(covering.exception(), CommunicatorAbortedError)
    assert not group._cuda.watch.in_flight()  # issued after the abort returned: released at once


def test_calls_are_refused_while_the_fault_is_being_diagnosed():
    group = make_group()
    comm = group._cuda.comm = FakeComm()
    life = group._cuda.life
    diagnosing, done = threading.Event(), threading.Event()

    def explain(entry, timeout):
        diagnosing.set()
        done.wait(5)
        return "rank 1 never reached all_reduce #3"

    life._explain = explain
    stuck = stuck_work(group._cuda.watch, seq=3)
    assert life.claim(Finding(CollectiveTimeoutError("all_reduce #3 timed out"), stuck._slot))
    try:
        assert diagnosing.wait(5)
        with pytest.raises(CommunicatorAbortedError, match="was aborted: all_reduce #3 timed out"):
            group.allreduce([torch.ones(2)], c10d.AllreduceOptions())
        # a call that got past the checks before the fault was claimed
        late, _ = issued_work(group._cuda.watch, seq=4)
        assert late.exception() is not None and late._slot.keepalive is not None
        assert stuck.exception() is not None  # failed at the claim, before any abort
        assert not comm.aborted.is_set()
    finally:
        done.set()
    assert life.ended.wait(5)
    assert comm.aborted.is_set() and group._cuda.state == "aborted"
    assert late._slot.keepalive is None and stuck._slot.keepalive is None
    assert str(stuck.exception()) == "rank 1 never reached all_reduce #3"


# -- a second aborter waits for the first one's ncclCommAbort ----------------------------


class WatchedComm(FakeComm):
    def __init__(self, work, release=None):
        super().__init__()
        self.work, self.release, self.kept = work, release, None
        self.entered = threading.Event()

    def abort(self, on_behalf_of=None):
        self.entered.set()
        if self.release is not None:
            self.release.wait(5)
        self.kept = self.work._slot.keepalive is not None
        super().abort()


def test_the_fault_thread_releases_nothing_while_another_abort_runs():
    group = make_group()
    backend = group._cuda
    work, _ = issued_work(backend.watch, seq=5)
    go = threading.Event()
    comm = backend.comm = WatchedComm(work, release=go)
    user = threading.Thread(target=group.abort)
    user.start()
    assert comm.entered.wait(5)  # the user's abort is inside ncclCommAbort
    # A fault found now: the group ended already, the fault thread has nothing to do.
    assert not backend.life.claim(Finding(CollectiveTimeoutError("#5")))
    try:
        assert work.exception() is not None
        assert work._slot.keepalive is not None  # held until ncclCommAbort returned
    finally:
        go.set()
        user.join(5)
    assert comm.kept and comm.aborted.is_set() and work._slot.keepalive is None


@pytest.mark.parametrize("second", ["group.abort", "abort_all"])
def test_a_second_abort_returns_only_after_the_first_ones_ncclCommAbort(second):
    group = make_group()
    go = threading.Event()
    comm = group._cuda.comm = WatchedComm(stuck_work(group._cuda.watch), release=go)
    first = threading.Thread(target=group.abort)
    first.start()
    assert comm.entered.wait(5)
    other = threading.Thread(target=group.abort if second == "group.abort" else cupycoll.abort_all)
    other.start()
    other.join(0.3)
    try:
        assert other.is_alive()  # a signal handler's abort_all must not return yet
    finally:
        go.set()
        first.join(5)
        other.join(5)
    assert comm.aborted.is_set() and not other.is_alive()


def test_a_second_abort_from_the_aborting_thread_itself_returns_at_once():
    group = make_group()
    again = []

    class ReenteringComm(FakeComm):
        def abort(self, on_behalf_of=None):
            start = time.monotonic()
            group.abort()  # e.g. abort_all from a signal handler on the aborting thread
            again.append(time.monotonic() - start)
            super().abort()

    group._cuda.comm = ReenteringComm()
    group.abort()
    assert again and again[0] < 1.0


# -- fork ---------------------------------------------------------------------------------


_FORK_SCRIPT = """
    import datetime, os, sys, threading
    import torch.distributed as dist
    from cupycoll.trace import listener
    from cupycoll.faults import lifecycle
    from cupycoll.trace import recorder
    from standins import CpuAsCudaGroup
    from faulty import FakeComm, stuck_work

    class Comm(FakeComm):
        def __init__(self, who):
            super().__init__()
            self.who = who
        def abort(self, on_behalf_of=None):
            print(f"{self.who} comm aborted in", os.getpid(), flush=True)
            super().abort()

    def make(who):
        group = CpuAsCudaGroup(dist.HashStore(), 0, 2, datetime.timedelta(seconds=60))
        group._cuda.comm = Comm(who)
        stuck_work(group._cuda.watch)
        return group

    parent = make("parent")
    listener.serve(dist.HashStore(), recorder.Recorder("g", [0, 1], 0), interval=0.01)
    held, forked = threading.Event(), threading.Event()

    def hold():  # a thread of the parent holds the module locks when it forks
        with recorder._lock, parent._cuda.life._lock, listener.RESPONDER._lock:
            held.set()
            forked.wait(5)

    threading.Thread(target=hold, daemon=True).start()
    held.wait(5)
    pid = os.fork()
    if pid == 0:
        free = [not lock.locked() for lock in
                (recorder._lock, parent._cuda.life._lock, listener.RESPONDER._lock)]
        print("child locks free", free, "responder", listener.RESPONDER.running, flush=True)
        child = make("child")
        sys.exit(0)  # a normal exit: atexit runs in the child
    forked.set()
    _, status = os.waitpid(pid, 0)
    print("child exit", os.waitstatus_to_exitcode(status), flush=True)
    parent.abort()
    os._exit(0)
"""


@pytest.mark.launches
@pytest.mark.skipif(not hasattr(os, "register_at_fork"), reason="needs fork")
def test_a_forked_child_resets_the_locks_and_leaves_its_parents_groups_alone():
    # a hang bound only: importing torch alone took 20 s on a loaded 2-core box, the whole
    # script over 60 s with two CI legs and their installs sharing it
    result = run_script(_FORK_SCRIPT, timeout=180)
    out, err = result.stdout, result.stderr
    assert "child exit 0" in out, err
    assert "child locks free [True, True, True] responder False" in out, out + err
    child_pid = out.split("child comm aborted in ")[1].split()[0] if "child comm" in out else None
    assert child_pid is not None, out + err  # the child's own group is aborted at its exit
    # ...but not the parent's, and only the child's group is reported as not destroyed
    assert f"parent comm aborted in {child_pid}" not in out, out
    assert err.count("has NOT been destroyed") == 1, err
    assert "parent comm aborted in" in out  # by the parent's own abort


# -- every abort a user can call is bounded ------------------------------------------------


class HangingAbortComm(FakeComm):
    """ncclCommAbort that does not return until ``release`` is set."""

    def __init__(self):
        super().__init__()
        self.release, self.entered = threading.Event(), threading.Event()

    def abort(self, on_behalf_of=None):
        self.entered.set()
        self.release.wait(30)
        super().abort()


def test_a_user_abort_returns_within_its_bound_when_ncclcommabort_hangs(monkeypatch):
    monkeypatch.setattr(bounds, "ABORT_DEADLINE", 0.5)
    group = make_group()
    comm = group._cuda.comm = HangingAbortComm()
    work, _ = issued_work(group._cuda.watch, seq=4)
    start = time.monotonic()
    try:
        with pytest.warns(RuntimeWarning, match="has not returned after 0.5 s"):
            group.abort()
        assert time.monotonic() - start < 3
        assert isinstance(work.exception(), CommunicatorAbortedError)  # failed before the abort
        assert work._slot.keepalive is not None  # its kernel may still run: tensors held
    finally:
        comm.release.set()
    assert eventually(lambda: work._slot.keepalive is None)  # released once the abort returned
    assert comm.aborted.is_set()


def test_abort_all_aborts_every_group_when_one_abort_hangs(monkeypatch):
    monkeypatch.setattr(bounds, "ABORT_DEADLINE", 0.5)
    hung, other = make_group(), make_group()
    hung._cuda.comm = HangingAbortComm()
    other._cuda.comm = FakeComm()
    start = time.monotonic()
    try:
        with pytest.warns(RuntimeWarning, match="has not returned after 0.5 s") as said:
            assert cupycoll.abort_all(timeout=1.0) >= 2
            assert time.monotonic() - start < 3
            assert other._cuda.comm.aborted.is_set() and other._cuda.state == "aborted"
            assert hung._cuda.state == "aborted" and hung._cuda.comm.entered.is_set()
            # the hung abort's thread says so (its deadline is shorter than abort_all's wait,
            # but a loaded machine may run it later): here, not at the end of the run
            assert eventually(lambda: len(said) > 0)
    finally:
        hung._cuda.comm.release.set()


def test_abort_all_on_a_thread_that_holds_a_cupycoll_lock_returns_and_the_aborts_follow():
    # a signal handler calling abort_all() runs on the thread it interrupted, which may hold
    # the lock every abort takes first
    from cupycoll.faults import lifecycle
    group = make_group()
    group._cuda.comm = FakeComm()
    start = time.monotonic()
    with group._cuda.life._lock:
        cupycoll.abort_all(timeout=0.5)
        assert time.monotonic() - start < 2  # no deadlock
        assert group._cuda.state == "ok"  # its abort waits for the lock
    assert eventually(lambda: group._cuda.comm.aborted.is_set() and group._cuda.state == "aborted")
