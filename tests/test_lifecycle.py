"""A CUDA group's lifetime (cupycoll.faults.lifecycle), on CPU with stand-ins: which issued Works
the watchdog watches (none issued while a CUDA graph is captured, a coalescing block's
covering Work included; a watchdog whose thread died is started again by the next tracked
call), and how the group ends while a fault is being diagnosed (a shutdown then aborts it at
once, and a group torch drops meanwhile is held until its abort has run). The abort order,
the bounded shutdown and the abort at process exit are in tests/test_watchdog.py; races
between aborts in tests/test_abort_races.py."""

from __future__ import annotations

import datetime
import gc
import logging
import weakref

import torch
from torch._C import _distributed_c10d as c10d

from cupycoll.faults import lifecycle
from cupycoll.call_queue import Issue
from cupycoll.errors import CollectiveTimeoutError
from cupycoll.faults.watchdog import Watchdog
from cupycoll.work import CudaWork
from standins import CUDA, FakeStream, capture
from test_abort_races import IssuingGroup
from test_faults import FakeComm, eventually, issued_work, make_group


def issues_of(*ops, peer=None):
    return [Issue(CudaWork(op, CUDA, [torch.ones(2)], seq=i), None, None, torch.ones(2), True, peer)
            for i, op in enumerate(ops, 1)]


# -- Works issued during a CUDA graph capture are not watched -----------------------------


def test_calls_issued_while_capturing_are_not_handed_to_the_watchdog(monkeypatch, cuda_standins):
    group = make_group()
    cuda = group._cuda
    capture(monkeypatch, True)
    captured = issues_of("all_reduce", "broadcast")
    cuda._track(captured, FakeStream(), True)
    assert not cuda._watch.inflight and not cuda.life._watched
    assert all(i.work._event is not None and not i.tracked for i in captured)  # issued all the same
    capture(monkeypatch, False)
    later = issues_of("all_reduce")
    cuda._track(later, FakeStream(), True)
    assert cuda._watch.works() == [later[0].work] and later[0].tracked
    assert later[0].work.watch_handle.work is later[0].work  # the Work holds its handle
    group.abort()


def test_a_coalescing_blocks_work_closed_while_capturing_is_not_watched(monkeypatch):
    group = IssuingGroup(None, 0, 2, datetime.timedelta(seconds=5))
    capture(monkeypatch, True)
    group._start_coalescing(CUDA)
    group.allreduce([torch.ones(4)], c10d.AllreduceOptions())
    group._cuda._watch.inflight.clear()  # the stand-in's _enqueue tracked the inner Work itself
    covering = group._end_coalescing(CUDA)
    assert covering not in group._cuda._watch.works()


# -- the watchdog thread is started again after it died -----------------------------------


def test_a_dead_watchdog_thread_is_restarted_by_the_next_tracked_call(monkeypatch, cuda_standins):
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
        cuda._track(issues_of("all_reduce"), FakeStream(), True)
        assert eventually(lambda: failing and not watchdog.running)  # the thread died
        del watchdog._poll_once  # the next thread works
        cuda._track(issues_of("all_reduce"), FakeStream(), True)
        assert watchdog.running and watchdog._thread is not None and watchdog._thread.is_alive()
    finally:
        logging.getLogger("cupycoll").disabled = False
        cuda.life.stop_watching()
        watchdog.stop()
    assert eventually(lambda: not watchdog.running)


# -- ending while a fault is being diagnosed ----------------------------------------------


def test_shutdown_during_a_fault_diagnosis_aborts_the_group():
    group = make_group()
    comm = group._cuda.comm = FakeComm()
    work, _ = issued_work(seq=3)
    group._cuda._watch.track(work)
    fault = CollectiveTimeoutError("all_reduce #3 timed out")
    assert group._cuda._watch.claim(fault)  # the watchdog claimed it; diagnosis under way
    assert group._cuda.state == "aborting"
    group.shutdown()  # destroy_process_group
    assert comm.aborted.is_set() and group._cuda.state == "aborted"
    assert work.exception() is fault and work._keepalive is None
    # the fault thread's own abort, later, is a second aborter: it returns at once
    group._cuda._watch.handle(fault, work, claimed=True)
    assert work.exception() is fault


def test_a_group_dropped_during_a_fault_diagnosis_is_still_aborted():
    group = make_group()
    comm = group._cuda.comm = FakeComm()
    watch = group._cuda._watch
    fault = CollectiveTimeoutError("all_reduce #3 timed out")
    assert watch.claim(fault)
    backend = weakref.ref(group._cuda)
    del group  # torch dropped it (destroy_process_group on a torch that does not shut us down)
    gc.collect()
    assert backend() is not None  # held until its abort ran
    watch.handle(fault, None, claimed=True)  # the fault thread, after the diagnosis
    assert comm.aborted.is_set()
    gc.collect()
    assert backend() is None and all(life._backend() is not None for life in lifecycle._ABORTING)


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
        group._cuda.event.fired.set()  # the abort ended the kernel
        assert work.exception() is not None and work.get_future() is not None
        del group, work
        assert gone() is None  # freed at once, not by a collection
    finally:
        gc.enable()
