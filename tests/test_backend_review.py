"""The CUDA-path review of 2026-11-23 (/tmp/review_findings.md), on CPU with stand-ins: the
Works kept for C++ callers before torch 2.7, CUDA graph capture, shutdown during a fault's
diagnosis, a batch failing after its NCCL group launched, NCCL calls racing an abort, the
queue's lock-free flush, a dead watchdog thread, the diagnosis responder, and the choice of
communicator for point-to-point calls. Each test names the finding it pins down."""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import logging
import threading
import time
import weakref

import pytest
import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from cupycoll import call_guard
from cupycoll import compat, diagnosis, lifecycle, tracking
from cupycoll import nccl_bindings as nb
from cupycoll import recorder as rec_mod
from cupycoll.call_queue import Issue
from cupycoll.errors import CollectiveTimeoutError, CommunicatorAbortedError, CupycollError, NcclError
from cupycoll.watchdog import Watchdog
from cupycoll.work import CudaWork
from standins import CUDA, CpuAsCudaBackend, CpuAsCudaGroup
from test_faults import (FakeComm, FakeEvent, ScriptedLibrary, eventually, grouping_comm, issued_work,
                         make_group, no_device, polling_comm)  # noqa: F401 - no_device: a fixture


class FakeStream:
    device_index = 0
    cuda_stream = 0

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass


class RecordedEvent(FakeEvent):
    """torch.cuda.Event's stand-in for the backend's _track: record() does nothing."""

    def record(self, stream=None):
        pass


@pytest.fixture
def cuda_standins(monkeypatch):
    """The few torch.cuda calls of the issue path, answered on CPU."""
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "Event", RecordedEvent)
    monkeypatch.setattr(torch.cuda, "ExternalStream", lambda ptr, device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())


def capture(monkeypatch, on: bool) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: on)


# -- finding 1: the Works kept for C++ callers (torch < 2.7) ---------------------------------


class FiringBackend(CpuAsCudaBackend):
    """Issues each batch on a stand-in event the test fires (the GPU is done)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.events = []

    def _enqueue(self, issues):
        event = FakeEvent()
        self.events.append(event)
        for issue in issues:
            issue.work._issued(None, event, issue.keepalive)


class FiringGroup(CpuAsCudaGroup):
    backend_class = FiringBackend


@pytest.fixture
def kept_group(monkeypatch):
    """A group as on torch < 2.7, whatever torch runs here."""
    monkeypatch.setattr(compat, "PYTHON_WORK_SURVIVES_CPP", False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    return FiringGroup(dist.HashStore(), 0, 2, datetime.timedelta(seconds=5))


def test_a_kept_work_is_let_go_once_done_and_waited_on(kept_group):
    cuda = kept_group._cuda
    outputs, works = [], []
    for _ in range(40):
        tensor = torch.ones(4)
        works.append(kept_group.allreduce([tensor], c10d.AllreduceOptions()))
        outputs.append(weakref.ref(tensor))
        del tensor
    for event in cuda.events:
        event.fired.set()  # the GPU finished all of them
    for work in works[:20]:
        work.wait()  # what _verify_params_across_processes does from C++
    del works, work
    for _ in range(100):  # later calls (their outputs stay referenced here)
        kept_group.allreduce([torch.ones(1)], c10d.AllreduceOptions())
    gc.collect()
    assert all(ref() is None for ref in outputs[:20])  # done and waited: let go
    # done but never touched: a C++ caller may still wait on them (DDP does, later)
    assert all(ref() is not None for ref in outputs[20:])


def test_a_work_still_running_is_kept_even_once_waited_on(kept_group):
    tensor = torch.ones(4)
    work = kept_group.allreduce([tensor], c10d.AllreduceOptions())
    work.wait()  # a stream wait: the GPU is not done
    ref = weakref.ref(work)
    del work
    for _ in range(100):
        kept_group.allreduce([torch.ones(1)], c10d.AllreduceOptions())
    assert ref() is not None


def test_get_future_claims_a_kept_work(kept_group, monkeypatch):
    monkeypatch.setattr(CudaWork, "get_future", lambda self: "the future")  # no CUDA future on CPU
    work = kept_group.allreduce([torch.ones(4)], c10d.AllreduceOptions())
    assert not work._claimed
    assert work.get_future() == "the future" and work._claimed  # DDP's reducer: getFuture()


def test_calls_inside_a_coalescing_block_are_not_kept_its_covering_work_is(kept_group):
    calls = kept_group._cuda.calls
    kept_group._start_coalescing(CUDA)
    inner = kept_group.allreduce([torch.ones(4)], c10d.AllreduceOptions())
    covering = kept_group._end_coalescing(CUDA)
    kept = list(calls.kept.works)
    assert covering in kept and all(w is not inner for w in kept)


def test_kept_works_are_not_queried_while_a_cuda_graph_is_captured(kept_group, monkeypatch):
    class Unqueryable:
        def query(self):
            raise AssertionError("cudaEventQuery during a capture invalidates it")

    calls = kept_group._cuda.calls
    for _ in range(100):
        kept_group.allreduce([torch.ones(1)], c10d.AllreduceOptions())
    for work in calls.kept.works:
        work._event, work._claimed = Unqueryable(), True
    capture(monkeypatch, True)
    for _ in range(200):
        kept_group.allreduce([torch.ones(1)], c10d.AllreduceOptions())  # no prune, no query


# -- finding 3: Works issued during a CUDA graph capture are not watched ---------------------


def issues_of(*ops, peer=None):
    return [Issue(CudaWork(op, CUDA, [torch.ones(2)], seq=i), None, None, torch.ones(2), True, peer)
            for i, op in enumerate(ops, 1)]


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
    from test_abort_races import IssuingGroup
    group = IssuingGroup(None, 0, 2, datetime.timedelta(seconds=5))
    capture(monkeypatch, True)
    group._start_coalescing(CUDA)
    group.allreduce([torch.ones(4)], c10d.AllreduceOptions())
    group._cuda._watch.inflight.clear()  # the stand-in's _enqueue tracked the inner Work itself
    covering = group._end_coalescing(CUDA)
    assert covering not in group._cuda._watch.inflight


# -- finding 4: shutdown while a fault is being diagnosed ------------------------------------


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


# -- finding 5: a batch that fails after its NCCL group launched -----------------------------


class GroupComm(FakeComm):
    """A communicator stand-in whose NCCL group records its launches; the backend's abort
    sees whether the Works still held their tensors (the kernels may run until then)."""

    rank = stream = 0

    def __init__(self, works=()):
        super().__init__()
        self.launched, self.works, self.kept_at_abort = [], list(works), None

    @contextlib.contextmanager
    def group(self):
        yield
        self.launched.append("ncclGroupEnd")

    def abort(self, on_behalf_of=None):
        self.kept_at_abort = [w._keepalive is not None for w in self.works]
        super().abort()


def p2p_backend():
    group = make_group()
    cuda = group._cuda
    cuda.device = CUDA
    comm = cuda._p2p_comms[1] = GroupComm()
    return group, cuda, comm


def test_a_batch_failing_after_its_nccl_group_launched_is_tracked_and_faults(cuda_standins):
    group, cuda, comm = p2p_backend()

    def boom():
        raise RuntimeError("the copy after the group failed")

    def launch(c, stream, peer):
        c.launched.append("send")

    send = cuda.submit("send", CUDA, [torch.ones(2)], launch, keepalive=torch.ones(2), peer=1)
    recv = cuda.submit("recv", CUDA, [torch.ones(2)], launch, finish=boom, keepalive=torch.ones(2), peer=1)
    comm.works = [send, recv]
    with pytest.raises(RuntimeError, match="the copy after the group failed"):
        recv.wait()
    assert comm.launched == ["send", "send", "ncclGroupEnd"]
    assert cuda.state == "aborted" and isinstance(cuda.fault, RuntimeError)  # the peers drift otherwise
    for work in (send, recv):  # it ran: failed by the fault, not "never issued"
        assert work.exception() is cuda.fault and work._keepalive is None
    assert comm.kept_at_abort == [True, True]  # released only after ncclCommAbort


def test_a_single_ring_call_failing_mid_way_faults_the_group(cuda_standins):
    group = make_group()
    cuda = group._cuda
    cuda.comm, cuda.device = GroupComm(), CUDA

    def ring(c, stream):
        raise RuntimeError("NVRTC: compile failed at step 3")

    with pytest.raises(RuntimeError, match="step 3"):
        cuda.submit("all_reduce", CUDA, [torch.ones(2)], ring, keepalive=torch.ones(2), own_group=True,
                    async_op=False)
    assert cuda.state == "aborted" and cuda.comm.aborted.is_set()


def test_a_batch_failing_before_its_first_launch_is_never_issued_and_faults_nothing(cuda_standins):
    group, cuda, comm = p2p_backend()

    def oom(c):
        raise torch.OutOfMemoryError("staging")

    def launch(c, stream, peer):
        c.launched.append("send")

    send = cuda.submit("send", CUDA, [torch.ones(2)], launch, peer=1, async_op=False)
    recv = cuda.submit("recv", CUDA, [torch.ones(2)], launch, peer=1, async_op=False, prepare=oom)
    with pytest.raises(torch.OutOfMemoryError):
        recv.wait()
    assert comm.launched == [] and cuda.state == "ok" and not cuda._watch.inflight
    for work in (send, recv):
        assert isinstance(work.exception(), CupycollError) and "never issued" in str(work.exception())
    group.abort()


# -- finding 6: NCCL calls racing an abort ----------------------------------------------------


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


def test_create_premul_sum_on_an_aborted_communicator_says_aborted(no_device):
    class PremulLibrary(ScriptedLibrary):
        def has(self, name):
            return True

        def ncclRedOpCreatePreMulSum(self, op, scalar, dtype, residence, comm):
            raise NcclError(4, "ncclRedOpCreatePreMulSum", "invalid argument")  # a NULL comm

    comm = polling_comm([nb.ncclSuccess])
    comm._lib = PremulLibrary([nb.ncclSuccess])
    comm.abort()
    with pytest.raises(CommunicatorAbortedError, match="was aborted"):
        comm.create_premul_sum(b"\0\0\0\0", 7, on_device=False)


# -- finding 7: a flush with nothing to issue takes no lock ----------------------------------


def test_a_flush_with_nothing_queued_does_not_wait_behind_another_threads_issue():
    group = make_group()
    calls = group._cuda.calls
    holding, done = threading.Event(), threading.Event()

    def issuer():  # e.g. inside ncclCommInitRank or a blocking NCCL call
        with calls.lock:
            holding.set()
            done.wait(10)
    thread = threading.Thread(target=issuer)
    thread.start()
    try:
        assert holding.wait(5)
        flusher = threading.Thread(target=calls.flush)  # a gloo call's flush
        flusher.start()
        flusher.join(1)
        assert not flusher.is_alive()
    finally:
        done.set()
        thread.join(5)
    group.abort()


def test_touching_a_work_whose_batch_another_thread_issues_waits_for_it():
    from test_call_queue import QueueGroup
    group = QueueGroup(None, 0, 3, datetime.timedelta(seconds=5))
    cuda = group._cuda
    inside, release = threading.Event(), threading.Event()
    enqueue = cuda._enqueue

    def slow_enqueue(issues):  # the batch has left ``pending`` and is not issued yet
        inside.set()
        release.wait(10)
        enqueue(issues)

    cuda._enqueue = slow_enqueue
    send = group.send([torch.ones(2)], 1, 0)
    recv = group.recv([torch.ones(2)], 2, 0)
    issuer = threading.Thread(target=recv.wait)
    issuer.start()
    assert inside.wait(5) and cuda.calls.pending == []
    toucher = threading.Thread(target=send.wait)
    toucher.start()
    toucher.join(0.3)
    try:
        assert toucher.is_alive()  # it must not report a Work done that is not even issued
    finally:
        release.set()
        issuer.join(5)
        toucher.join(5)
    assert group.batches == [["send", "recv"]] and send._flush is None


def test_a_work_dropped_by_an_abort_is_failed_before_it_leaves_the_queue():
    from test_call_queue import QueueGroup
    group = QueueGroup(None, 0, 3, datetime.timedelta(seconds=5))
    calls = group._cuda.calls
    recv = group.recv([torch.ones(2)], 2, 0)
    seen = []
    real_fail = recv._fail

    def fail(reason, cause=None):
        seen.append(list(calls.pending))
        real_fail(reason, cause)
    recv._fail = fail
    calls.drop(CommunicatorAbortedError("aborted"))
    assert seen and seen[0] and calls.pending == [] and recv.exception() is not None


# -- finding 11a: the watchdog thread is restarted after it died -----------------------------


def test_a_dead_watchdog_thread_is_restarted_by_the_next_tracked_call(monkeypatch, cuda_standins):
    watchdog = Watchdog()
    monkeypatch.setattr(tracking, "WATCHDOG", watchdog)
    monkeypatch.setattr("cupycoll.backend.WATCHDOG", watchdog, raising=False)  # before the move
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


# -- finding 11b: the diagnosis responder -----------------------------------------------------


def timed_out_in_the_first_collective(group):
    # a group name of its own per test: the store keys (and the process' claims) are per
    # group, incarnation and collective, and these recorders are all incarnation 0
    recorder = rec_mod.Recorder(group, [0, 1], 1)
    entry = recorder.record("all_reduce", ((4,),), (torch.float32,))
    mine = diagnosis.progress(recorder)  # it timed out in #1 and publishes that
    recorder.mark(entry, "failed")  # the gloo route then marks the entry failed
    return recorder, mine, diagnosis.key_prefix(group, recorder.incarnation)


def publish_own_record(store, recorder, mine):
    # the rank's own diagnosis (rank 0 stays silent: it returns after its short wait)
    return diagnosis.diagnose(store, recorder.group, 1, 2, mine, 30, wait_s=0.3,
                              incarnation=recorder.incarnation)


def test_the_responder_keeps_its_ranks_own_record():
    store = dist.HashStore()
    recorder, mine, prefix = timed_out_in_the_first_collective("own record kept")
    publish_own_record(store, recorder, mine)  # with its own request, #1 of the group
    diagnosis._Served(store, recorder, None, 0.01).poll()
    assert json.loads(store.get(f"{prefix}/1/1")) == mine
    assert store.add(f"{prefix}/1/count", 0) == 1


def test_the_own_record_outlasts_an_answer_being_written_at_that_moment():
    # Ranks 0 and 1 time out together: rank 0's request wakes rank 1's responder while rank 1
    # publishes its own record. The responder's answer must not land on top of it.
    store = dist.HashStore()
    recorder, mine, prefix = timed_out_in_the_first_collective("own record outlasts")
    store.add(f"{prefix}/requests", 1)
    store.set(f"{prefix}/request/1", "1")  # rank 0's request for #1
    writing, release = threading.Event(), threading.Event()

    class PausedAnswers:  # the responder's store: its write waits for the test
        def __getattr__(self, name):
            return getattr(store, name)

        def set(self, key, value):
            writing.set()
            release.wait(5)
            store.set(key, value)
    responder = threading.Thread(target=diagnosis._Served(PausedAnswers(), recorder, None, 0.01).poll)
    responder.start()
    assert writing.wait(5)  # the responder decided to answer and is writing
    own = threading.Thread(target=publish_own_record, args=(store, recorder, mine))
    own.start()
    deadline = time.monotonic() + 0.5  # the own record waits for the answer (or, unfixed, lands)
    while not store.check([f"{prefix}/1/1"]) and time.monotonic() < deadline:
        time.sleep(0.01)
    release.set()
    responder.join(5)
    own.join(5)
    # (the publishing thread may outlive the short diagnosis: wait for its write)
    assert eventually(lambda: json.loads(store.get(f"{prefix}/1/1")) == mine)


def test_a_peers_request_is_still_answered():
    store = dist.HashStore()
    recorder = rec_mod.Recorder("g", [0, 1], 1)
    recorder.record("broadcast", ((4,),), (torch.float32,))
    prefix = diagnosis.key_prefix("g", recorder.incarnation)
    store.add(f"{prefix}/requests", 1)
    store.set(f"{prefix}/request/1", "2")  # rank 0 timed out in #2
    diagnosis._Served(store, recorder, None, 0.01).poll()
    assert json.loads(store.get(f"{prefix}/2/1"))["last_issued"] == 1
    assert store.add(f"{prefix}/2/count", 0) == 1


def test_a_store_error_that_ends_serving_a_group_is_a_warning(caplog):
    from test_diagnosis import RaisingStore, recorders
    responder = diagnosis.Responder()
    with caplog.at_level(logging.WARNING, logger="cupycoll"):
        responder.serve(RaisingStore(), recorders(2)[1], interval=0.01)
        assert eventually(lambda: not responder.running)
    assert any(r.levelno == logging.WARNING and "no longer answering" in r.getMessage()
               for r in caplog.records)


# -- finding 11c: the communicator of a point-to-point call is the same on every rank ----------


class Connecting(CpuAsCudaBackend):
    """_connect makes a named stand-in communicator (no store, no NCCL)."""

    def _connect(self, key, creator, size, rank, device):
        comm = FakeComm()
        comm.key, comm.rank = key, rank
        return comm


def connecting(rank, size=2):
    from cupycoll import config
    settings = config.resolve(None, datetime.timedelta(seconds=5))
    backend = Connecting(None, rank, size, settings)
    backend.device = CUDA
    return backend


def test_p2p_stays_on_the_pair_communicator_after_a_lazy_group_communicator():
    # rank 0: send #1, all_reduce, send #2; rank 1: recv #1, recv #2, all_reduce
    rank0, rank1 = connecting(0), connecting(1)
    used0 = [rank0.p2p_comm(1).key]
    rank0.comm_for(CUDA)
    used0.append(rank0.p2p_comm(1).key)
    used1 = [rank1.p2p_comm(0).key, rank1.p2p_comm(0).key]
    rank1.comm_for(CUDA)
    assert used0 == used1 == ["p2p/0-1", "p2p/0-1"]


def test_p2p_uses_a_group_communicator_made_at_init():
    backend = connecting(0, size=4)
    backend.eager_connect_single_device(CUDA)  # init_process_group(device_id=...)
    assert backend.p2p_comm(3) is backend.comm and backend._p2p_comms == {}

    class Parent:
        device = CUDA
        comm = FakeComm()

    Parent.comm.split = lambda color, key, on_abort=None: FakeComm()
    child = connecting(1, size=2)
    child.split_from(Parent())  # a subgroup of a bound default group: split at construction
    assert child.p2p_comm(0) is child.comm


# -- finding 2 (the backend's part): the watch knows the group's device ----------------------


def test_the_watch_gets_the_device_the_first_call_picks(kept_group):
    assert kept_group._cuda._watch.device is None
    kept_group.allreduce([torch.ones(2)], c10d.AllreduceOptions())
    assert kept_group._cuda._watch.device == CUDA  # its events are queried with it current


# -- the second review: re-entrant lock, NCCL groups guarded, interrupts --------------------


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


def test_an_interrupt_after_launch_faults_the_group_with_a_typed_error(cuda_standins):
    group, cuda, comm = p2p_backend()

    def interrupt():
        raise KeyboardInterrupt

    def launch(c, stream, peer):
        c.launched.append("send")

    send = cuda.submit("send", CUDA, [torch.ones(2)], launch, keepalive=torch.ones(2), peer=1)
    recv = cuda.submit("recv", CUDA, [torch.ones(2)], launch, finish=interrupt, keepalive=torch.ones(2), peer=1)
    with pytest.raises(KeyboardInterrupt):
        recv.wait()
    assert cuda.state == "aborted" and isinstance(cuda.fault, CommunicatorAbortedError)
    assert isinstance(cuda.fault.__cause__, KeyboardInterrupt) and "interrupted" in str(cuda.fault)
    for work in (send, recv):
        assert work.exception() is cuda.fault and work._keepalive is None
    with pytest.raises(CommunicatorAbortedError):
        send.wait()
