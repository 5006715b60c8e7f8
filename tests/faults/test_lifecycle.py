"""A CUDA group's lifetime (cupycoll.faults.lifecycle), on CPU with stand-ins: which issued Works
the watchdog watches (none issued while a CUDA graph is captured, a coalescing block's
covering Work included; a watchdog whose thread died is started again by the next tracked
call), and how the group ends while a fault is being diagnosed (a shutdown then aborts it at
once, and a group torch drops meanwhile is held until its abort has run). The abort order,
the bounded shutdown and the abort at process exit are in tests/faults/test_watchdog.py; races
between aborts in tests/faults/test_abort_races.py."""

from __future__ import annotations

import datetime
import gc
import logging
import threading
import weakref

import torch
from torch._C import _distributed_c10d as c10d

from cupycoll.faults import lifecycle
from cupycoll.errors import CollectiveTimeoutError
from cupycoll.faults.watchdog import Finding
from cupycoll.faults.watchdog_thread import Watchdog
from faulty import FakeComm, eventually, issued_work, make_group, queued_call
from standins import CUDA, IssuingGroup, capture


def issues_of(watch, *ops, peer=None):
    return [queued_call(watch, op, peer, seq=i, keep=torch.ones(2), outputs=[torch.ones(2)])
            for i, op in enumerate(ops, 1)]


# -- Works issued during a CUDA graph capture are not watched -----------------------------


def test_calls_issued_while_capturing_are_not_handed_to_the_watchdog(monkeypatch, cuda_standins):
    group = make_group()
    cuda = group._cuda
    capture(cuda_standins, True)
    captured = issues_of(cuda.watch, "all_reduce", "broadcast")
    group._issuer._track(captured, 0, 0, True)
    assert not cuda.watch.in_flight()
    assert all(i.work._slot is None and i.tracked for i in captured)  # issued all the same
    assert all(i.work.is_completed() for i in captured)  # nothing to wait for outside the graph
    capture(cuda_standins, False)
    later = issues_of(cuda.watch, "all_reduce")
    group._issuer._track(later, 0, 0, True)
    assert cuda.watch.in_flight() == 1 and later[0].tracked and later[0].work._in_flight() is not None
    group.abort()


def test_an_async_call_captured_in_a_graph_joins_back_into_the_capture_at_wait(monkeypatch, cuda_standins):
    # The internal stream was forked off the capturing one; without a join back the capture
    # cannot end (cudaErrorStreamCaptureUnjoined), nor is later captured work ordered after it.
    group = make_group()
    cuda = group._cuda
    capture(cuda_standins, True)
    captured = issues_of(cuda.watch, "all_reduce")
    group._issuer._track(captured, 0x77, 0, True)
    work = captured[0].work
    join = work._join
    assert join is not None and join is cuda.watch.join_event(0x77) and join.records == 1
    before = len(cuda_standins.calls)
    work.wait()
    assert ("cudaStreamWaitEvent" in [name for _, name, _ in cuda_standins.calls[before:]])
    capture(cuda_standins, False)  # outside the capture there is nothing to wait for
    before = len(cuda_standins.calls)
    work.wait()
    assert "cudaStreamWaitEvent" not in [name for _, name, _ in cuda_standins.calls[before:]]
    synchronous = issues_of(cuda.watch, "all_reduce")
    capture(cuda_standins, True)
    group._issuer._track(synchronous, 0x77, 0x77, False)  # on the caller's stream: ordered already
    assert synchronous[0].work._join is None
    group.abort()


def test_a_coalescing_blocks_work_closed_while_capturing_is_not_watched(monkeypatch, cuda_standins):
    group = make_group()
    cuda = group._cuda
    cuda.comm = FakeComm()
    group._issuer._launch_all = lambda batch, comms, stream, launched=None: None  # launching: nothing to do
    cuda._adopt_device(CUDA)
    capture(cuda_standins, True)
    group._start_coalescing(CUDA)
    inner = group.allreduce([torch.ones(4)], c10d.AllreduceOptions())
    covering = group._end_coalescing(CUDA)
    assert not cuda.watch.in_flight() and covering._slot is None and inner._slot is None
    group.abort()


# -- the watchdog thread is started again after it died -----------------------------------


def test_a_dead_watchdog_thread_is_restarted_by_the_next_watched_call(monkeypatch, cuda_standins):
    watchdog = Watchdog()
    monkeypatch.setattr(lifecycle, "WATCHDOG", watchdog)
    group = make_group()
    cuda = group._cuda
    failing = []

    def poll_once():
        failing.append(True)
        raise RuntimeError("a bug in a watchdog pass")

    watchdog._poll_once = poll_once
    logging.getLogger("cupycoll").disabled = True
    try:
        cuda.life.watching()
        assert eventually(lambda: failing and not watchdog.running)  # the thread died
        del watchdog._poll_once  # the next thread works
        cuda.life.watching()
        assert watchdog.running and watchdog._thread is not None and watchdog._thread.is_alive()
    finally:
        logging.getLogger("cupycoll").disabled = False
        cuda.life._unwatch()
        watchdog.stop()
    assert eventually(lambda: not watchdog.running)


# -- ending while a fault is being diagnosed ----------------------------------------------


def _claimed_while_diagnosing(group, seq=3):
    """A timeout claimed by the watchdog, its diagnosis blocked until the returned event."""
    release = threading.Event()
    group._cuda.life._explain = lambda entry, timeout_s: release.wait(10) and None
    work, _ = issued_work(group._cuda.watch, seq=seq)
    fault = CollectiveTimeoutError(f"all_reduce #{seq} timed out")
    assert group._cuda.life.claim(Finding(fault, work._slot))
    return work, fault, release


def test_shutdown_during_a_fault_diagnosis_aborts_the_group():
    group = make_group()
    comm = group._cuda.comm = FakeComm()
    work, fault, release = _claimed_while_diagnosing(group)
    try:
        assert group._cuda.state == "aborting"
        group.shutdown()  # destroy_process_group
        assert comm.aborted.is_set() and group._cuda.state == "aborted"
        assert work.exception() is fault and work._slot.keepalive is None
    finally:
        release.set()  # the fault thread's own end, later, is a second one: it does nothing more
    assert group._cuda.life.ended.wait(5) and work.exception() is fault


def test_a_group_dropped_during_a_fault_diagnosis_is_still_aborted():
    group = make_group()
    comm = group._cuda.comm = FakeComm()
    life = weakref.ref(group._cuda.life)
    work, fault, release = _claimed_while_diagnosing(group)
    del group, work  # torch dropped it (destroy_process_group on a torch that does not shut us down)
    gc.collect()
    assert life() is not None  # the fault thread holds it until its end ran
    release.set()  # the diagnosis is over: the fault thread ends the group
    assert eventually(lambda: comm.aborted.is_set())
    assert eventually(lambda: gc.collect() is not None and life() is None)


# -- an ended group is freed when its last user lets go -----------------------------------


def test_an_aborted_group_with_a_work_in_flight_is_freed_once_dropped():
    # gloo's threads and sockets end only when the group holding them is freed, so an ended
    # group must not be kept alive by the errors its Works failed with (a reference cycle
    # would keep it until a full garbage collection).
    group = IssuingGroup(None, 0, 2, datetime.timedelta(seconds=5))
    group._cuda.comm = FakeComm()
    work = group.allreduce([torch.ones(4)], c10d.AllreduceOptions())
    gone = weakref.ref(group)
    gc.disable()
    try:
        group.abort()  # the Work is still in flight: it fails with the abort's error
        group._issuer.event.fired.set()  # the abort ended the kernel
        assert work.exception() is not None and work.get_future() is not None
        del group, work
        assert gone() is None  # freed at once, not by a collection
    finally:
        gc.enable()
