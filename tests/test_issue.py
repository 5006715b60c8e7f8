"""The issuer (cupycoll.issue) as pure logic: when point-to-point and coalesced calls are
issued, and as which NCCL groups; and how a Work leaves the queue when another thread issues
its batch or an abort drops it. A stand-in issuer records each batch ``_enqueue`` would issue
as one NCCL group (the GPU tier issues the same batches for real)."""

from __future__ import annotations

import collections
import contextlib
import datetime
import threading
import warnings

import pytest
import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from cupycoll.nccl.bootstrap import StoreBootstrap
from cupycoll.issue import Call
from cupycoll.errors import CommunicatorAbortedError, CupycollError, CupycollValueError
from cupycoll.process_group import ProcessGroupCupycoll
from faulty import GroupComm, make_group
from standins import CUDA, QueueGroup, QueueIssuer


@pytest.fixture
def group():
    return QueueGroup(None, 0, 3, datetime.timedelta(seconds=5))


def x(n=4):
    return torch.ones(n)


def test_p2p_waits_for_a_work_to_be_touched(group):
    send = group.send([x()], 1, 0)
    recv = group.recv([x()], 2, 0)
    assert group.batches == []
    recv.wait()
    assert group.batches == [["send", "recv"]]
    send.wait()  # already issued: no second batch
    assert group.batches == [["send", "recv"]]


def test_another_call_issues_queued_p2p_first(group):
    group.send([x()], 1, 0)
    group.recv([x()], 2, 0)
    group.allreduce([x()], c10d.AllreduceOptions())
    assert group.batches == [["send", "recv"], ["all_reduce"]]


def test_coalescing_block_is_one_group_with_one_work(group):
    group._start_coalescing(CUDA)
    a, b = x(), x(2)
    group.allreduce([a], c10d.AllreduceOptions())
    pending = group.broadcast([b], c10d.BroadcastOptions())
    pending.wait()  # inside an open block: nothing is issued yet
    group.send([x()], 1, 0)
    assert group.batches == []
    work = group._end_coalescing(CUDA)
    assert group.batches == [["all_reduce", "broadcast", "send"]]
    assert work.result()[:2] == [a, b]


def test_torchs_coalesced_forms_are_one_batch_each(group):
    group.allreduce_coalesced([x(), x(2), x(3)], c10d.AllreduceCoalescedOptions())
    outs, ins = [torch.zeros(6), torch.zeros(3)], [x(2), x(1)]
    group.all_gather_single_coalesced(outs, ins, c10d.AllgatherOptions())
    group.reduce_scatter_single_coalesced([torch.zeros(1)], [x(3)], c10d.ReduceScatterOptions())
    assert group.batches == [["all_reduce"] * 3, ["all_gather_into_tensor"] * 2, ["reduce_scatter_tensor"]]


def test_torchs_coalesced_call_inside_an_open_block_joins_it(group):
    # torch >= 2.13 with device=: _start_coalescing, then the captured ops as one
    # allreduce_coalesced call, then _end_coalescing.
    group._start_coalescing(CUDA)
    assert group.allreduce_coalesced([x(), x()], c10d.AllreduceCoalescedOptions()) is None
    group._end_coalescing(CUDA)
    assert group.batches == [["all_reduce", "all_reduce"]]


def test_bad_input_inside_coalesced_call_issues_nothing(group):
    bad = torch.ones(4, 4).t()
    with pytest.raises(CupycollValueError, match="not contiguous"):
        group.allreduce_coalesced([x(), bad], c10d.AllreduceCoalescedOptions())
    assert group.batches == [] and group._issuer.pending == [] and group._issuer.block is None
    group.allreduce([x()], c10d.AllreduceOptions())
    assert group.batches == [["all_reduce"]]


def test_block_left_open_by_an_exception_is_discarded(group):
    group._start_coalescing(CUDA)
    group.allreduce([x()], c10d.AllreduceOptions())
    # the body raised: torch never calls _end_coalescing; the next block starts clean
    with pytest.warns(RuntimeWarning, match="left open"):
        group._start_coalescing(CUDA)
    group.broadcast([x()], c10d.BroadcastOptions())
    group._end_coalescing(CUDA)
    assert group.batches == [["broadcast"]]


def test_end_without_start_is_an_error(group):
    with pytest.raises(CupycollValueError, match="without _start_coalescing"):
        group._end_coalescing(CUDA)


def test_abort_drops_the_queue_and_refuses_work(group):
    send = group.send([x()], 1, 0)
    group.abort()
    assert isinstance(send.exception(), CommunicatorAbortedError)  # failed before it was ever issued
    group._issuer.flush()  # the queue lets go of what it held
    assert group._issuer.pending == []
    with pytest.raises(Exception, match="aborted"):
        group.allreduce([x()], c10d.AllreduceOptions())


def test_unique_id_exchange_is_fresh_per_incarnation():
    """Two ranks (threads) on one store; the store outlives a destroy and re-init."""
    import threading
    import time

    pytest.importorskip("cupy.cuda.nccl")
    store = torch.distributed.HashStore()
    seen = {}

    def rank(r, incarnation, delay):
        time.sleep(delay)
        bootstrap = StoreBootstrap(store, r, timeout_s=10)  # no process group needed
        seen[(incarnation, r)] = bootstrap.unique_id("comm", r == 0, 2)

    for incarnation in range(2):
        # the non-creator asks first: it must wait for this incarnation's id, not take the last
        threads = [threading.Thread(target=rank, args=(1, incarnation, 0.0)),
                   threading.Thread(target=rank, args=(0, incarnation, 0.3))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
    assert seen[(0, 0)] == seen[(0, 1)] and len(seen[(0, 0)]) == 128
    assert seen[(1, 0)] == seen[(1, 1)]
    assert seen[(1, 0)] != seen[(0, 0)]


def test_works_of_a_batch_that_failed_to_issue_raise(group):
    send = group.send([x()], 1, 0)
    recv = group.recv([x()], 2, 0)

    def broken(batch):
        raise RuntimeError("ncclGroupEnd failed")

    group._issuer._enqueue = broken
    with pytest.raises(RuntimeError, match="ncclGroupEnd failed"):
        recv.wait()
    with pytest.raises(Exception, match="send was never issued: ncclGroupEnd failed"):
        send.wait()
    error = send.exception()
    assert isinstance(error, CupycollError) and isinstance(error.__cause__, RuntimeError)
    assert send.is_completed() and not send.is_success() and group._issuer.pending == []
    # the future fails as C++ callers (DDP's reducer) can see it: a RuntimeError with its text
    with pytest.raises(RuntimeError, match="CupycollError: send was never issued"):
        send.get_future().wait()


def test_exception_in_the_managers_body_leaves_the_group_usable(group):
    # torch never calls _end_coalescing when the body raises; the next call must not join
    # (and wait forever in) the block that exception left open.
    with pytest.warns(RuntimeWarning, match="body raised"):
        with pytest.raises(KeyError):
            with dist._coalescing_manager(group=group, device=CUDA):
                queued = group.broadcast([x()], c10d.BroadcastOptions())
                raise KeyError("user error inside the manager")
        assert group.batches == []
        work = group.allreduce([x()], c10d.AllreduceOptions())
    with pytest.raises(CupycollError, match="abandoned"):
        queued.wait()
    assert group.batches == [["all_reduce"]]  # issued alone, at once
    assert group._issuer.block is None
    work.wait()
    # and the next manager works normally
    with dist._coalescing_manager(group=group, device=CUDA):
        group.allreduce([x()], c10d.AllreduceOptions())
        group.broadcast([x()], c10d.BroadcastOptions())
    assert group.batches[-1] == ["all_reduce", "broadcast"]


def test_a_call_on_another_group_inside_a_manager_is_an_error(group):
    other = QueueGroup(None, 0, 3, datetime.timedelta(seconds=5))
    other.setGroupName("other")
    group.setGroupName("first")
    with dist._coalescing_manager(group=group, device=CUDA):
        group.allreduce([x()], c10d.AllreduceOptions())
        with pytest.raises(CupycollValueError, match="all_reduce on group 'other' inside a coalescing "
                                                     "block of group 'first'"):
            other.allreduce([x()], c10d.AllreduceOptions())
    assert group.batches == [["all_reduce"]] and other.batches == []
    other.allreduce([x()], c10d.AllreduceOptions())  # outside the manager: fine
    assert other.batches == [["all_reduce"]]


def test_cpu_tensors_inside_a_cuda_block_are_an_error(group):
    class Routing(QueueGroup):
        _tensors_are_cuda = True  # a CPU tensor is one: the real routing

        def _classify(self, tensors, op_name):
            return ProcessGroupCupycoll._classify(self, tensors, op_name)

    routing = Routing(None, 0, 3, datetime.timedelta(seconds=5))
    routing._start_coalescing(CUDA)
    with pytest.raises(CupycollValueError, match="CPU tensors inside a coalescing block of CUDA calls"):
        routing.allreduce([x()], c10d.AllreduceOptions())
    routing._end_coalescing(CUDA)


def test_ring_calls_run_after_the_nccl_group_of_their_batch(group):
    # The ring issues NCCL groups of its own and kernels: never inside another group.
    order = []

    class GroupComm:
        @contextlib.contextmanager
        def group(self):  # the NCCL group is the communicator's
            order.append("start")
            yield
            order.append("end")

    group._cuda.comm = GroupComm()
    batch = [Call(op=name, device=CUDA, outputs=[], keep=None, async_op=False, entry=None,
                  run=lambda comm, s, name=name: order.append(name),
                  algorithm="ring" if name.startswith("ring") else None)
             for name in ("send", "ring-1", "all_reduce", "ring-2")]
    group._issuer._launch_all(batch, None, 0)
    assert order == ["start", "send", "all_reduce", "end", "ring-1", "ring-2"]


def test_after_a_raising_manager_torchs_fast_path_works_again(group):
    # torch 2.13 leaves the group in its own pg_coalesce_state when the body raises, so its
    # next dist.all_reduce would be captured into that dead manager and never reach us.
    group.setGroupName("g")
    state = dist.distributed_c10d._world.pg_coalesce_state
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        try:
            with dist._coalescing_manager(group=group, device=CUDA):
                group.broadcast([x()], c10d.BroadcastOptions())
                raise KeyError("user error")
        except KeyError:
            pass
    assert group not in state and group._issuer.block is None
    assert group.batches == []


def test_abort_fails_queued_and_coalesced_works(group):
    # A Work dropped from the queue is failed: touched later, it must not report success.
    recv = group.recv([x()], 2, 0)
    group._issuer.drop(CommunicatorAbortedError("dropped"))  # the queue alone
    assert recv.exception() is not None and group.batches == []
    group = QueueGroup(None, 0, 3, datetime.timedelta(seconds=5))
    group._start_coalescing(CUDA)
    send = group.send([x()], 1, 0)
    inside = group.allreduce([x()], c10d.AllreduceOptions())
    group.abort()
    for work in (send, inside):
        assert work.is_completed() and not work.is_success()
        with pytest.raises(CommunicatorAbortedError, match="was aborted"):
            work.wait()
    with pytest.raises(CommunicatorAbortedError, match="was aborted"):
        group._end_coalescing(CUDA)
    assert group.batches == [] and group._issuer.block is None


def test_drop_fails_the_works_with_the_given_reason(group):
    recv = group.recv([x()], 2, 0)
    reason = CommunicatorAbortedError("all_reduce #7 timed out")
    group._issuer.drop(reason)
    assert recv.exception() is reason and group._issuer.pending == []


def test_two_issuing_threads_never_enqueue_at_once():
    # Two threads issuing on one group (DDP's autograd threads) must not make concurrent
    # NCCL calls on one communicator, which NCCL forbids: the queue's lock serialises them.
    import threading
    import time

    class Overlap(QueueIssuer):
        active = peak = 0

        def _enqueue(self, batch):
            Overlap.active += 1
            Overlap.peak = max(Overlap.peak, Overlap.active)
            time.sleep(0.001)  # the NCCL calls: long enough for the other thread to arrive
            Overlap.active -= 1
            super()._enqueue(batch)

    class OverlapGroup(QueueGroup):
        issuer_class = Overlap

    group = OverlapGroup(None, 0, 3, datetime.timedelta(seconds=5))
    errors = []

    def issue(peer):
        try:
            for _ in range(30):
                group.allreduce([x()], c10d.AllreduceOptions())
                group.send([x()], peer, 0).wait()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
    threads = [threading.Thread(target=issue, args=(peer,)) for peer in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    # A send queued by one thread may leave in the other thread's batch (both sit in the
    # group's one queue): count calls, not batches. Each of the 120 is issued once.
    issued = collections.Counter(op for batch in group.batches for op in batch)
    assert not errors and Overlap.peak == 1
    assert issued == {"all_reduce": 60, "send": 60}


# -- a Work whose batch another thread issues, or an abort drops --------------------------


def test_a_flush_with_nothing_queued_does_not_wait_behind_another_threads_issue():
    group = make_group()
    calls = group._issuer
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
    group = QueueGroup(None, 0, 3, datetime.timedelta(seconds=5))
    calls = group._issuer
    inside, release = threading.Event(), threading.Event()
    enqueue = calls._enqueue

    def slow_enqueue(batch):  # the batch has left ``pending`` and is not issued yet
        inside.set()
        release.wait(10)
        enqueue(batch)

    calls._enqueue = slow_enqueue
    send = group.send([torch.ones(2)], 1, 0)
    recv = group.recv([torch.ones(2)], 2, 0)
    issuer = threading.Thread(target=recv.wait)
    issuer.start()
    assert inside.wait(5) and calls.pending == []
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
    # A flush that finds the queue empty returns without the lock: a Work dropped from it
    # must already answer failed then, never "done" because nothing is left to issue.
    group = QueueGroup(None, 0, 3, datetime.timedelta(seconds=5))
    calls = group._issuer
    recv = group.recv([torch.ones(2)], 2, 0)
    seen = []
    pending = calls.pending

    class Watching(list):
        def __init__(self):
            super().__init__(pending)

        def __iter__(self):
            seen.append(recv.exception())
            return super().__iter__()

    calls.pending = Watching()
    calls.drop(CommunicatorAbortedError("aborted"))
    assert seen and all(error is not None for error in seen[1:])
    assert calls.pending == [] and recv.exception() is not None


def test_a_launch_the_watch_cannot_take_faults_the_group(cuda_standins, monkeypatch):
    # The call reached NCCL (the peers wait for it); when putting it in flight raises, the
    # group's lifetime ends the group rather than leave a launched call neither watched nor
    # handed back.
    group = make_group()
    cuda = group._cuda
    cuda.comm = GroupComm()
    cuda._adopt_device(CUDA)

    def no_event(*args, **kwargs):
        raise RuntimeError("cudaEventCreateWithFlags failed: out of memory")
    monkeypatch.setattr(cuda.watch, "issued", no_event)
    opts = c10d.AllreduceOptions()
    if hasattr(opts, "asyncOp"):  # (before torch 2.11 every all_reduce is asynchronous)
        opts.asyncOp = True
    with pytest.raises(RuntimeError, match="out of memory"):
        group.allreduce([torch.ones(4)], opts)
    assert cuda.comm.launched == ["ncclAllReduce"]  # launched in one frame
    assert cuda.life.ended.wait(5) and cuda.state == "aborted"
    assert "out of memory" in str(cuda.fault)
