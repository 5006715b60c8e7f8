"""Faults as pure logic on CPU, driven by real threads: the watch and Work state machine
(cupycoll.faults.watchdog), a group's fault and abort (from another thread, during init,
from a signal handler; cupycoll.faults.lifecycle), a communicator's fault reaching its group,
and calls stuck inside NCCL. Stand-ins (tests/faulty.py) replace CUDA events and NCCL
communicators; the GPU tier (tests/gpu/test_gpu_faults.py) proves the same behaviour with
real ones. The communicator's own polling loop and NCCL groups are
tests/nccl/test_communicator.py's; the store bootstrap's timeouts,
tests/nccl/test_bootstrap.py's."""

from __future__ import annotations

import datetime
import threading
import time
import weakref

import pytest
import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

import cupycoll
from cupycoll import bounds, config
from cupycoll.nccl import header as nh
from cupycoll.backend import CudaBackend
from cupycoll.nccl.communicator import Communicator
from cupycoll.errors import CollectiveTimeoutError, CommunicatorAbortedError, CupycollError, NcclError
from cupycoll.faults.last_words import TERMINATE_EXIT_CODE
from cupycoll.faults.watchdog import entries
from cupycoll.faults.watchdog_thread import Watchdog
from cupycoll.trace.recorder import E_STATE
from cupycoll.work import CudaWork
from faulty import (CountedEvent, FakeComm, Polled, ScriptedLibrary, eventually, fault_group, grouping_comm,
                    holding, issued_work, make_group, make_watch, poll, polling_comm, queued_call, recorder_entry,
                    run_script, undiagnosed)
from standins import CUDA, CpuAsCudaGroup


# -- the watch: one group's calls in flight ---------------------------------------------


def test_completed_works_leave_the_watch_and_release_their_tensors():
    watch = make_watch()
    works = [issued_work(watch, seq=i) for i in range(3)]
    works[0][1].fired.set()
    works[1][1].fired.set()
    assert poll(watch) is None
    assert watch.in_flight() == 1 and works[2][0]._in_flight() is not None
    tensor = weakref.ref(works[0][0]._outputs[0])
    del works[0]
    assert tensor() is None  # only the user's Work held it, and that is gone
    works[-1][1].fired.set()
    poll(watch)
    assert not watch.in_flight()


def test_a_stream_is_retired_by_its_newest_event_and_a_search_not_one_query_per_call():
    # Calls on one stream finish in order: a pass asks the newest event first, and only when
    # it has not fired searches for the last one that has (a few queries, not one per call).
    watch = make_watch()
    events = [CountedEvent(done=i < 50) for i in range(64)]
    for i, event in enumerate(events):
        issued_work(watch, seq=i, event=event)
    assert poll(watch) is None and watch.in_flight() == 14
    assert sum(e.queries for e in events) <= 8  # newest, then a binary search of 64
    for event in events:
        event.done = True
    poll(watch)
    assert watch.in_flight() == 0 and sum(e.queries for e in events) <= 9


def test_a_work_older_than_the_timeout_is_a_fault_naming_the_collective():
    watch = make_watch("trainers", timeout=0.05)
    done, done_event = issued_work(watch, seq=1)
    stuck, _ = issued_work(watch, seq=7, shape=(2, 3), op="reduce_scatter_tensor", stream=1)
    done_event.fired.set()
    issued_at = stuck._slot.issued_at
    # the clock is passed in: a stall of this thread must not age the Works early
    assert watch.check(now=issued_at + 0.04) is None  # not old yet
    finding = watch.check(now=issued_at + 0.06)
    fault = finding.fault
    assert isinstance(fault, CollectiveTimeoutError) and finding.batch is stuck._slot
    message = str(fault)
    assert "'trainers'" in message and "reduce_scatter_tensor #7" in message and "float32[2, 3]" in message
    watch.close(fault)
    # the stuck Work is failed: every way of looking at it shows the fault
    with pytest.raises(CollectiveTimeoutError, match="reduce_scatter_tensor #7"):
        stuck.wait()
    assert stuck.exception() is fault and stuck.is_completed() and not stuck.is_success()
    # the future fails as C++ callers (DDP's reducer) can see it: a RuntimeError with its text
    with pytest.raises(RuntimeError, match="CollectiveTimeoutError: .*reduce_scatter_tensor #7"):
        stuck.get_future().wait()
    with pytest.raises(CollectiveTimeoutError):
        stuck.result()
    assert done.is_success()  # done before the fault: a success
    watch.release()  # the abort returned: the tensors go
    assert stuck._slot.keepalive is None and not watch.in_flight()
    assert watch.check() is None  # a fault is reported once


def test_a_synchronous_call_without_an_event_of_its_own_still_times_out_within_its_bound():
    # Synchronous calls close together on one stream share one event (bounds.SEAL_S). With
    # no later call to record it, the watchdog's pass does, and judges it at the next pass:
    # a hang after the last call is still a timeout within timeout + one pass.
    watch = make_watch("trainers", timeout=0.05)
    first = watch.issued(0, recorder_entry(seq=1), None, sparse=True)
    second = watch.issued(0, recorder_entry(seq=2), None, sparse=True)
    assert second is first and not first.sealed and first.event.records == 0  # one slot, no event yet
    issued_at = first.issued_at
    assert watch.check(now=issued_at + 0.01) is None  # older than SEAL_S: the pass records its event
    assert first.sealed and first.event.records == 1
    finding = watch.check(now=issued_at + 0.06)
    assert finding.is_timeout and finding.batch is first
    assert "all_reduce #1" in str(finding.fault) and "1 more" in str(finding.fault)
    # A slot sealed by a pass already past the timeout is judged by the next pass, never
    # against its own fresh record.
    late = make_watch(timeout=0.05)
    slot = late.issued(0, recorder_entry(seq=1), None, sparse=True)
    assert late.check(now=slot.issued_at + 0.06) is None and slot.sealed
    assert late.check(now=slot.issued_at + 0.07).batch is slot


def test_a_burst_of_synchronous_calls_keeps_every_entry_in_order_and_completes_them_all():
    watch = make_watch()
    recorder = watch.recorder
    made = [recorder.record("all_reduce", ((4,),), (torch.float32,), None, "nccl", "issued") for _ in range(3)]
    parts = tuple(recorder.record("all_reduce", ((2,),), (torch.float32,), None, "nccl", "issued") for _ in range(2))
    slot = watch.issued(0, made[0], None, sparse=True)
    for records in (made[1], parts, made[2]):  # a coalesced call's tuple joins as its entries
        assert watch.issued(0, records, None, sparse=True) is slot
    assert list(entries(slot.records)) == [made[0], made[1], *parts, made[2]]
    watch.seal(slot)
    slot.event.fired.set()
    watch.retire()
    assert [entry[E_STATE] for entry in (*made, *parts)] == ["completed"] * 5


def test_a_synchronous_call_records_an_event_once_its_streams_open_one_is_older_than_the_interval():
    watch = make_watch()
    first = watch.issued(0, recorder_entry(seq=1), None, sparse=True)
    time.sleep(bounds.SEAL_S * 2)
    later = watch.issued(0, recorder_entry(seq=2), None, sparse=True)
    assert later is not first and first.sealed and first.event.records == 1 and not later.sealed
    other_stream = watch.issued(1, recorder_entry(seq=3), None, sparse=True)  # one open slot per stream
    assert other_stream is not later and not later.sealed
    kept = torch.ones(2)
    asynchronous = watch.issued(0, recorder_entry(seq=4), kept)  # keeps its tensors: an event of its own
    assert later.sealed and asynchronous.sealed and asynchronous.event.records == 1
    # A Work of an open slot asked whether it is done records the slot's event first.
    open_slot = watch.issued(2, recorder_entry(seq=5), None, sparse=True)
    work = CudaWork("all_reduce", CUDA, [], watch, slot=open_slot, stream=2, async_op=False)
    assert not work.is_completed() and open_slot.sealed
    open_slot.event.fired.set()
    assert work.is_completed()


def test_an_async_nccl_error_is_a_fault():
    comm = FakeComm()
    watch = make_watch(timeout=60, comms=holding(comm))
    work, _ = issued_work(watch)
    assert poll(watch) is None
    comm.error = NcclError(6, "ncclCommGetAsyncError", "", "peer closed the connection")
    fault = poll(watch)
    assert isinstance(fault, NcclError) and fault.status_name == "ncclRemoteError"
    assert "peer closed the connection" in str(fault)
    with pytest.raises(NcclError):
        work.wait()


def test_a_call_inside_nccl_past_the_timeout_is_a_timeout_fault_naming_the_call():
    comm = FakeComm()
    group = make_group()
    cuda = group._cuda
    cuda.comm = comm
    explained = []
    cuda.life._explain = lambda entry, timeout_s: explained.append(entry) or "all_reduce #3 timed out; rank 1 is behind"
    comm.stuck = ("ncclAllReduce", 4.0)  # not yet past the timeout (5 s)
    assert cuda.watch.check() is None
    comm.stuck = ("ncclAllReduce", 7.2)
    finding = cuda.watch.check()
    assert isinstance(finding.fault, CollectiveTimeoutError) and finding.batch is None
    cuda.life.claim(finding)
    assert cuda.life.ended.wait(5)
    assert explained == [None]  # no batch exists yet: the diagnosis explains the call being issued
    assert str(cuda.fault) == ("all_reduce #3 timed out; rank 1 is behind (ncclAllReduce has been inside NCCL for 7.2 s: "
                               "a peer has not made this call (a blocking communicator connects inside it, and a split "
                               "waits there for every rank), or the GPU's launch queue is full behind a stuck kernel)")


def test_the_watchdog_thread_finds_a_stuck_work_and_then_exits():
    watchdog = Watchdog()
    watch = make_watch(timeout=0.1)
    polled = Polled(watch)
    start = time.monotonic()  # before the issue: the watchdog ages the batch from there
    work, _ = issued_work(watch)
    watchdog.watch(polled)
    assert polled.found.wait(5)
    assert 0.1 <= time.monotonic() - start < 2
    watchdog.unwatch(polled)
    assert eventually(lambda: not watchdog.running)  # nothing left to watch
    assert isinstance(work.exception(), CollectiveTimeoutError)


def test_watchdog_threads_do_not_accumulate():
    watchdog = Watchdog()
    before = threading.active_count()
    for _ in range(50):
        polled = Polled(make_watch(timeout=60), interval=0.001)
        watchdog.watch(polled)
        watchdog.unwatch(polled)
        del polled
    assert eventually(lambda: not watchdog.running)
    # the monitor lets go of its thread just before that thread returns
    assert eventually(lambda: threading.active_count() <= before)


def test_terminate_policy_ends_the_process():
    result = run_script("""
        import datetime, time
        import standins
        from faulty import FakeComm, issued_work
        from cupycoll import config
        group = standins.CpuAsCudaGroup(None, 0, 2, datetime.timedelta(seconds=0.05),
                                        config.Options(on_timeout="terminate", watchdog_interval=0.01))
        group._cuda.comm = FakeComm()
        issued_work(group._cuda.watch, seq=3)
        group._cuda.life.watching()
        time.sleep(10)
        print("still alive")
    """)
    assert result.returncode == TERMINATE_EXIT_CODE, result.stderr
    assert "terminating the process" in result.stderr and "all_reduce #3" in result.stderr
    assert "still alive" not in result.stdout


# -- the group: fault, abort, abort during init ---------------------------------------


def make_backend(rank=0, size=2, timeout=5.0, store=None):
    """A CUDA backend on its own: the bootstrap needs no ProcessGroup."""
    settings = config.resolve(None, datetime.timedelta(seconds=timeout))
    return CudaBackend(store if store is not None else dist.HashStore(), rank, size, settings,
                       name=lambda: "bootstrap")


def test_a_fault_aborts_the_communicators_and_every_later_call_raises():
    group = make_group()
    comm = FakeComm()
    group._cuda.comm = comm
    work, _ = issued_work(group._cuda.watch, seq=4)
    fault = CollectiveTimeoutError("all_reduce #4 did not complete")
    fault_group(group, fault)
    assert comm.aborted.is_set() and group._cuda.state == "aborted"
    assert work.exception() is fault
    with pytest.raises(CommunicatorAbortedError, match="was aborted: all_reduce #4 did not complete"):
        group.allreduce([torch.ones(2)], c10d.AllreduceOptions())
    with pytest.raises(CommunicatorAbortedError):
        group.barrier(c10d.BarrierOptions())


def test_abort_from_another_thread_fails_the_works_in_flight():
    group = make_group()
    comm = FakeComm()
    group._cuda.comm = comm
    work, _ = issued_work(group._cuda.watch)
    thread = threading.Thread(target=group.abort)
    thread.start()
    thread.join(5)
    assert comm.aborted.is_set()
    with pytest.raises(CommunicatorAbortedError, match="was aborted"):
        work.wait()


def test_abort_all_reaches_every_live_group():
    groups = [make_group(), make_group()]
    comms = [FakeComm(), FakeComm()]
    for group, comm in zip(groups, comms):
        group._cuda.comm = comm
    assert cupycoll.abort_all() >= 2
    assert all(c.aborted.is_set() for c in comms)
    assert all(g._cuda.state == "aborted" for g in groups)


def test_abort_ends_a_wait_for_peers_during_init():
    backend = make_backend(rank=1, timeout=60)
    errors = []

    def create():
        try:
            backend._bootstrap.unique_id("comm", creator=False, members=2)
        except CupycollError as exc:
            errors.append(exc)

    thread = threading.Thread(target=create)
    thread.start()
    time.sleep(0.2)
    start = time.monotonic()
    backend.abort()
    thread.join(5)
    assert not thread.is_alive() and time.monotonic() - start < 2
    assert isinstance(errors[0], CommunicatorAbortedError)


def test_abort_reaches_a_communicator_still_connecting(monkeypatch):
    class Connecting(FakeComm):
        def wait_ready(self):
            if not self.aborted.wait(30):
                raise AssertionError("never aborted")
            raise CommunicatorAbortedError("aborted while connecting")

    pending = Connecting()
    monkeypatch.setattr(Communicator, "begin", classmethod(lambda cls, *a, **k: pending))
    group = make_group()
    errors = []

    def create():
        try:
            group._cuda._create_comm(b"\0" * 128, 0, 2, 0)
        except CupycollError as exc:
            errors.append(exc)

    thread = threading.Thread(target=create)
    thread.start()
    assert eventually(lambda: group._cuda.comms.pending == [pending])
    group.abort()
    thread.join(5)
    assert pending.aborted.is_set() and isinstance(errors[0], CommunicatorAbortedError)
    assert group._cuda.comms.pending == []


# -- communicator faults reach the group ---------------------------------------------


def test_a_communicator_that_aborts_itself_faults_its_group(monkeypatch, no_device):
    # A nonblocking poll that times out aborts the communicator, and the group with it:
    # else the Works in flight would later "succeed" and the on_timeout policy never run.
    made = []

    def begin(cls, unique_id, rank, size, device, library, nonblocking, timeout, on_abort, runtime=None):
        comm = polling_comm([nh.ncclInProgress], timeout=0.05)
        comm.on_abort = on_abort
        made.append(comm)
        return comm
    monkeypatch.setattr(Communicator, "begin", classmethod(begin))
    group = make_group()
    group._cuda.comm = group._cuda._create_comm(b"\0" * 128, 0, 2, 0)
    work, _ = issued_work(group._cuda.watch, seq=3)
    with pytest.raises(CollectiveTimeoutError) as info:
        made[0]._poll("ncclAllReduce")
    assert work.exception() is info.value  # failed when the poll's error reached the group
    assert group._cuda.life.ended.wait(5)
    assert group._cuda.state == "aborted" and group._cuda.fault is info.value
    assert work.exception() is info.value and made[0]._lib.aborts == 1
    with pytest.raises(CommunicatorAbortedError, match="did not complete within 0.05 s"):
        group.allreduce([torch.ones(2)], c10d.AllreduceOptions())


@pytest.mark.parametrize("where", ["poll", "nccl group"])
def test_a_communicator_that_aborts_itself_fails_the_works_before_ncclcommabort(monkeypatch, no_device, where):
    # The kernels end at ncclCommAbort: a Work still "in flight" then would read as a success.
    seen_at_abort = []
    group = make_group()
    work, _ = issued_work(group._cuda.watch, seq=3)

    class Recording(ScriptedLibrary):
        def ncclCommAbort(self, comm):
            seen_at_abort.append((work.is_completed(), work.exception()))
            return super().ncclCommAbort(comm)

        def ncclGroupStart(self):
            return 0

        def ncclGroupEnd(self):
            return 0

    comm = polling_comm([nh.ncclInProgress], timeout=0.05)
    comm._lib = Recording([nh.ncclInProgress])
    comm.on_abort = group._cuda.life.fault_once
    group._cuda.comm = comm
    with pytest.raises((CollectiveTimeoutError, MemoryError)):
        if where == "poll":
            comm._poll("ncclAllReduce")
        else:
            with comm.group():
                comm._settle("ncclSend", nh.ncclSuccess)
                raise MemoryError("staging")
    assert group._cuda.life.ended.wait(5)
    assert len(seen_at_abort) == 1, seen_at_abort  # aborted once, by the group
    completed, error = seen_at_abort[0]
    assert completed and error is group._cuda.fault is not None
    assert comm.state == "aborted" and group._cuda.state == "aborted"
    assert not work.is_success()


def test_a_batch_that_raises_mid_group_faults_the_group(monkeypatch, no_device):
    group = make_group()
    comm = polling_comm([nh.ncclSuccess])
    comm._lib = type("Lib", (ScriptedLibrary,), {"ncclGroupStart": lambda self: 0,
                                                  "ncclGroupEnd": lambda self: 0})([nh.ncclSuccess])
    comm.on_abort = group._cuda.life.fault_once
    group._cuda.comm = comm
    group._cuda.device = CUDA

    def first(c, stream, peer):
        c._settle("ncclSend", nh.ncclSuccess)

    def second(c, stream, peer):
        raise torch.OutOfMemoryError("staging")
    watch = group._cuda.watch
    batch = [queued_call(watch, "send", 1, run=first), queued_call(watch, "recv", 1, run=second)]
    with pytest.raises(torch.OutOfMemoryError):
        group._issuer._launch_all(batch, {1: comm}, 0)
    assert group._cuda.life.ended.wait(5)
    assert comm.state == "aborted" and group._cuda.state == "aborted"
    assert isinstance(group._cuda.fault, torch.OutOfMemoryError)


def test_a_batch_whose_prepare_raises_makes_no_nccl_call(no_device):
    # Fallible Python steps (staging, PREMUL_SUM ops) run as prepares before the NCCL
    # group opens; one that raises leaves NCCL untouched, fails the batch, faults nothing.
    group = make_group()
    cuda, issuer = group._cuda, group._issuer
    comm, events = grouping_comm()
    comm.on_abort = cuda.life.fault_once
    cuda.comm, cuda.device = comm, CUDA
    issuer._enqueue = lambda batch: issuer._launch_all(batch, {1: comm}, 0)

    def send(c, stream, peer):
        events.append(("send", c))

    def oom(c):
        raise torch.OutOfMemoryError("staging")

    def batch(second_prepare):
        return [queued_call(cuda.watch, "send", 1, run=send, prepare=lambda c: events.append(("prepare", c))),
                queued_call(cuda.watch, "recv", 1, run=send, prepare=second_prepare)]

    failed = batch(oom)
    issuer.pending = list(failed)
    with pytest.raises(torch.OutOfMemoryError):
        issuer.flush()
    assert events == [("prepare", comm)]  # the first prepare ran; no group, no NCCL call
    for issue in failed:  # both Works, never issued, with the error as the cause
        error = issue.work.exception()
        assert "never issued" in str(error) and isinstance(error.__cause__, torch.OutOfMemoryError)
    assert comm.state == "ok" and cuda.state == "ok" and issuer.pending == []
    events.clear()
    issuer.pending = batch(None)
    issuer.flush()  # the group is still usable
    assert events == [("prepare", comm), "start", ("send", comm), ("send", comm), "end"]
    group.abort()  # while CuPy is still the stand-in


class StuckConnectLibrary(ScriptedLibrary):
    """ncclAllReduce (or an NCCL group's end) blocks, as a blocking communicator's connect to
    a peer that never makes the call does, until the test releases it; ncclCommAbort is
    recorded with what was inside NCCL then."""

    def __init__(self):
        super().__init__([nh.ncclSuccess])
        self.inside, self.release = threading.Event(), threading.Event()
        self.aborted_while_inside = []
        self.in_call = 0

    def _block(self):
        self.in_call += 1
        self.inside.set()
        try:
            assert self.release.wait(30), "never released"
        finally:
            self.in_call -= 1
        return nh.ncclSuccess

    def ncclAllReduce(self, *args):
        return self._block()

    def ncclCommAbort(self, comm):
        self.aborted_while_inside.append(self.in_call)
        return super().ncclCommAbort(comm)


@pytest.fixture
def terminations(monkeypatch):
    """The process's end, recorded instead (lifecycle's terminate): [(group, error)]."""
    from cupycoll.faults import lifecycle

    ended = []
    monkeypatch.setattr(lifecycle, "terminate", lambda group, error: ended.append((group, error)))
    return ended


def test_a_blocking_call_stuck_inside_nccl_is_timed_out_never_aborted_beside_and_ends_the_process(
        cuda_standins, no_device, terminations):
    # NCCL forbids a call on a communicator while another thread is inside one on it, and a
    # blocking call stuck in NCCL's connect returns only when the peer comes: its group's
    # timeout is found, explained and ended (Works failed), and since nothing can end the
    # call safely, the process ends with the timeout; ncclCommAbort never runs beside it.
    group = make_group(timeout=0.3)
    cuda = group._cuda
    comm = polling_comm([nh.ncclSuccess])
    comm.nonblocking, comm.stream = False, 0
    lib = comm._lib = StuckConnectLibrary()
    cuda.comm = comm
    # The diagnosis of a call being issued reads the flight recorder's stuck entry (no batch yet).
    cuda.life._explain = lambda entry, timeout_s: (
        f"{cuda.trace.recorder.stuck()[2]} #{cuda.trace.recorder.stuck()[0]} timed out; rank 1 is behind")
    caller = threading.Thread(target=lambda: group.allreduce([torch.ones(4)]), daemon=True)
    start = time.monotonic()
    caller.start()
    try:
        assert lib.inside.wait(5)
        assert eventually(lambda: terminations, timeout=10)
        assert time.monotonic() - start < 0.3 + 5.0  # the timeout + the watchdog's pass + the end
        life, error = terminations[0]  # terminate (recorded here, not exiting) may be asked again
        assert life is cuda.life and isinstance(error, CollectiveTimeoutError)
        assert "all_reduce #1 timed out; rank 1 is behind" in str(error)  # the call being issued
        assert "ncclAllReduce has been inside NCCL" in str(error) and "no abort can end it safely" in str(error)
        assert cuda.state == "aborted" and lib.aborts == 0  # never aborted beside the call
    finally:
        lib.release.set()
        caller.join(5)
    assert lib.aborted_while_inside == [0]  # the call ran ncclCommAbort on its way out


def test_a_stuck_nccl_group_over_two_communicators_frees_neither_while_its_thread_is_inside(
        cuda_standins, no_device, terminations):
    # A batch over two pair communicators stuck in ncclGroupEnd: each communicator has the
    # thread inside it until ncclGroupEnd returns; freeing one first would let NCCL write it
    # on the way out. Neither is aborted until the thread has left; the process ends.
    group = make_group(size=3, timeout=0.3)
    undiagnosed(group)
    cuda = group._cuda
    cuda.device = CUDA
    cuda._adopt_device(CUDA)
    libs = []

    class StuckGroupLibrary(StuckConnectLibrary):
        def ncclGroupStart(self):
            return 0

        def ncclGroupEnd(self):
            return self._block()

        def ncclSend(self, *args):
            return 0

        def ncclRecv(self, *args):
            return 0

    shared = StuckGroupLibrary()
    for peer in (1, 2):
        comm = polling_comm([nh.ncclSuccess])
        comm.nonblocking, comm.stream = False, 0
        comm._lib = shared
        comm.on_abort = cuda.life.fault_once
        cuda.comms.pairs[peer] = comm
        libs.append(comm)
    sends = [group.send([torch.ones(2)], 1), group.recv([torch.ones(2)], 2)]
    flusher = threading.Thread(target=lambda: sends[0].wait(), daemon=True)
    flusher.start()
    try:
        assert shared.inside.wait(5)
        assert eventually(lambda: terminations, timeout=10)
        life, error = terminations[0]  # terminate (recorded here, not exiting) may be asked again
        assert "ncclGroupEnd has been inside NCCL" in str(error)
        assert shared.aborted_while_inside == []  # no member freed under the thread
        assert all(comm.state == "aborted" for comm in libs)  # refused to any new call
        assert all(comm.abort_deferred() for comm in libs)
    finally:
        shared.release.set()
        flusher.join(5)
    assert shared.aborted_while_inside == [0, 0]  # both aborted once the group had ended


def test_only_a_call_the_abort_ended_inside_nccl_takes_the_groups_timeout():
    group = make_group()
    life = group._cuda.life
    ended = CommunicatorAbortedError("ncclAllReduce: the NCCL communicator on cuda:0 was aborted during the call")
    ended.during_call = True
    assert life.timeout_that_cut(ended) is None  # no fault: a user's abort keeps its own words
    life.fault = CollectiveTimeoutError("all_reduce #3 timed out; rank 1 is behind")
    timed_out = life.timeout_that_cut(ended)
    assert isinstance(timed_out, CollectiveTimeoutError) and str(timed_out) == str(life.fault)
    assert timed_out is not life.fault  # each caller raises its own
    refused = CommunicatorAbortedError("process group '' was aborted")  # never entered NCCL
    assert life.timeout_that_cut(refused) is None
    assert life.timeout_that_cut(RuntimeError("a launch's own error")) is None
    life.fault = None


# -- every call that waits for a peer ends -------------------------------------------------


def test_a_blocking_creation_stuck_after_the_store_gate_is_timed_out_and_ends_the_process(
        monkeypatch, terminations):
    # A peer passed the store gate but never joins NCCL's bootstrap: ncclCommInitRankConfig
    # waits inside NCCL before any communicator exists. The watchdog sees the creation, and
    # as nothing can end it, the process ends with the group's timeout.
    release = threading.Event()
    monkeypatch.setattr(Communicator, "preflight", staticmethod(lambda *args: None))

    def begin(cls, *args, **kwargs):
        release.wait(30)
        return FakeComm()
    monkeypatch.setattr(Communicator, "begin", classmethod(begin))
    group = CpuAsCudaGroup(dist.HashStore(), 0, 2, datetime.timedelta(seconds=0.3),
                           config.Options(watchdog_interval=0.01))
    undiagnosed(group)
    cuda = group._cuda
    cuda._bootstrap.unique_id = lambda key, creator, members: b"\0" * 128  # past the gate
    creator = threading.Thread(target=lambda: pytest.raises(CommunicatorAbortedError, cuda.comm_for, CUDA),
                               daemon=True)
    creator.start()
    try:
        assert eventually(lambda: terminations, timeout=10)
        life, error = terminations[0]  # terminate (recorded here, not exiting) may be asked again
        assert life is cuda.life and "ncclCommInitRankConfig has been inside NCCL" in str(error)
        assert cuda.state == "aborted"
    finally:
        release.set()
        creator.join(5)
    assert not creator.is_alive()


def test_abort_all_reentered_from_a_signal_handler_returns_at_once(monkeypatch):
    # Signals arriving while abort_all blocks run the handler again on the same thread:
    # each must return, not nest another abort_all until the stack overflows.
    from cupycoll.faults import all_groups

    group = make_group()
    nested = []

    class HandlerComm(FakeComm):
        def abort(self, on_behalf_of=None):
            start = time.monotonic()
            # a signal's handler, on the thread inside abort_all (its joining thread here)
            nested.append((all_groups.abort_all(timeout=5), time.monotonic() - start))
            super().abort()

    group._cuda.comm = HandlerComm()
    monkeypatch.setattr(all_groups.threading, "Thread", _InlineThread)
    assert cupycoll.abort_all(timeout=5) >= 1
    assert len(nested) == 1 and nested[0][1] < 1.0
    assert group._cuda.state == "aborted"


class _InlineThread:
    """threading.Thread that runs its target on the caller's thread when started."""

    def __init__(self, target=None, args=(), name=None, daemon=None):
        self.target, self.args = target, args

    def start(self):
        self.target(*self.args)

    def join(self, timeout=None):
        pass

    def is_alive(self):
        return False


def test_abort_all_leaves_a_shut_down_group_alone():
    group = make_group()
    comm = group._cuda.comm = FakeComm()
    group.shutdown()
    assert group._cuda.state == "shut down" and comm.state == "shut down"
    assert cupycoll.abort_all() == 0 or group._cuda.state == "shut down"
    assert group._cuda.state == "shut down" and not comm.aborted.is_set()


def test_a_group_aborted_while_half_built_ends_what_exists_without_errors(monkeypatch):
    # abort_all from a signal handler may catch a group during its construction.
    import warnings
    from cupycoll.faults import all_groups

    seen = []
    real_init = CpuAsCudaGroup._build

    def build_then_abort(self, *args, **kwargs):
        self._trace = None  # not yet: the group is half-built
        del self._trace
        all_groups.abort_all()  # the signal
        seen.append("aborted before the group was built")
        return real_init(self, *args, **kwargs)

    monkeypatch.setattr(CpuAsCudaGroup, "_build", build_then_abort)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a step failing (AttributeError) would warn
        group = make_group()
    assert seen
    group.abort()
    assert group._cuda.state == "aborted"


def test_a_group_made_with_watch_calls_off_puts_no_call_in_flight(cuda_standins):
    group = CpuAsCudaGroup(dist.HashStore(), 0, 2, datetime.timedelta(seconds=5),
                           config.Options(watch_calls=False))
    cuda = group._cuda
    cuda.comm = FakeComm()
    group._issuer._launch_all = lambda batch, comms, stream, launched=None: None
    work = group.allreduce([torch.ones(2)], c10d.AllreduceOptions())
    assert cuda.watch.in_flight() == 0 and work._slot is None and work.is_completed()
    group.abort()


def test_a_failed_group_end_over_two_communicators_fails_earlier_work_before_it_can_read_as_done(no_device):
    # A failing ncclGroupEnd over several communicators sets every member's abort flag, and a
    # kernel issued earlier on one of them may end early: its event fires before the error
    # has even reached the group. The members stay fenced (nothing is retired) until the
    # group claimed the fault, so that kernel's Work reads as failed, never as a success.
    group = make_group(size=3)
    cuda = group._cuda
    earlier, event = issued_work(cuda.watch, seq=1)
    seen_in_group_end = []

    class FailingEnd(ScriptedLibrary):
        def ncclGroupStart(self):
            return 0

        def ncclGroupEnd(self):
            event.fired.set()  # NCCL's abort flags ended the earlier kernel
            seen_in_group_end.append(cuda.watch.check())  # a watchdog pass meanwhile
            raise NcclError(6, "ncclGroupEnd", "remote process exited")

    comms = []
    for peer in (1, 2):
        comm = polling_comm([nh.ncclSuccess])
        comm.nonblocking, comm._lib = False, FailingEnd([nh.ncclSuccess])
        comm.on_abort = cuda.life.fault_once
        cuda.comms.pairs[peer] = comm
        comms.append(comm)
    with pytest.raises(NcclError):
        with comms[0].group():
            for comm in comms:
                comm._settle("ncclSend", nh.ncclSuccess)
    assert seen_in_group_end == [None]  # the pass found nothing, and retired nothing while fenced
    assert not earlier.is_success() and isinstance(earlier.exception(), NcclError)
    assert cuda.life.ended.wait(5) and all(comm.state == "aborted" for comm in comms)
