"""How a CUDA group ends (cupycoll.lifecycle) while a fault is being diagnosed, on CPU with
stand-ins: a shutdown then aborts the group at once, and a group torch drops meanwhile is
held until its abort has run. The abort order, the bounded shutdown and the abort at
process exit are in tests/test_watchdog.py; races between aborts in
tests/test_abort_races.py."""

from __future__ import annotations

import gc
import weakref

from cupycoll import lifecycle
from cupycoll.errors import CollectiveTimeoutError
from test_faults import FakeComm, issued_work, make_group


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
    assert backend() is None and backend not in [weakref.ref(b) for b in lifecycle._ABORTING]
