"""Which issued Works the watchdog watches (cupycoll.tracking), on CPU with stand-ins: none
issued while a CUDA graph is captured, a coalescing block's covering Work included, and a
watchdog whose thread died is started again by the next tracked call."""

from __future__ import annotations

import datetime
import logging

import torch
from torch._C import _distributed_c10d as c10d

from cupycoll import tracking
from cupycoll.call_queue import Issue
from cupycoll.watchdog import Watchdog
from cupycoll.work import CudaWork
from standins import CUDA, FakeStream, capture
from test_abort_races import IssuingGroup
from test_faults import eventually, make_group


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
    assert not cuda._watch.inflight and not cuda._watched
    assert all(i.work._event is not None and not i.tracked for i in captured)  # issued all the same
    capture(monkeypatch, False)
    later = issues_of("all_reduce")
    cuda._track(later, FakeStream(), True)
    assert list(cuda._watch.inflight) == [later[0].work] and later[0].tracked
    group.abort()


def test_a_coalescing_blocks_work_closed_while_capturing_is_not_watched(monkeypatch):
    group = IssuingGroup(None, 0, 2, datetime.timedelta(seconds=5))
    capture(monkeypatch, True)
    group._start_coalescing(CUDA)
    group.allreduce([torch.ones(4)], c10d.AllreduceOptions())
    group._cuda._watch.inflight.clear()  # the stand-in's _enqueue tracked the inner Work itself
    covering = group._end_coalescing(CUDA)
    assert covering not in group._cuda._watch.inflight


# -- the watchdog thread is started again after it died -----------------------------------


def test_a_dead_watchdog_thread_is_restarted_by_the_next_tracked_call(monkeypatch, cuda_standins):
    watchdog = Watchdog()
    monkeypatch.setattr(tracking, "WATCHDOG", watchdog)
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
        cuda._stop_watching()
        watchdog.stop()
    assert eventually(lambda: not watchdog.running)
