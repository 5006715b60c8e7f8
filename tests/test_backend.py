"""The CUDA backend (cupycoll.backend) on CPU with stand-ins: a batch that fails once part
of it may run on the GPU faults the group (its Works keep their tensors until the abort),
one that fails before its first launch makes no NCCL call; which communicator a
point-to-point call uses, the same on every rank; and the device the watchdog queries on.
Issuing itself, queued and coalesced, is tests/test_issue.py's; faults and aborts
through the backend are tests/faults/test_faults.py's."""

from __future__ import annotations

import datetime

import pytest
import torch
from torch._C import _distributed_c10d as c10d

from cupycoll import config
from cupycoll.errors import CommunicatorAbortedError, CupycollError
from faulty import FakeComm, GroupComm, make_group, submit
from standins import CUDA, CpuAsCudaBackend, QueueGroup

# -- a batch that fails once part of it may run, or before its first launch ---------------


def p2p_backend():
    group = make_group()
    cuda = group._cuda
    cuda._adopt_device(CUDA)
    comm = cuda.comms.pairs[1] = GroupComm()
    return group, cuda, comm


def test_a_batch_failing_after_its_nccl_group_launched_is_tracked_and_faults(cuda_standins):
    group, cuda, comm = p2p_backend()

    def boom():
        raise RuntimeError("the copy after the group failed")

    def launch(c, stream, peer):
        c.launched.append("send")

    send = submit(group, "send", launch, keep=torch.ones(2), peer=1)
    recv = submit(group, "recv", launch, finish=boom, keep=torch.ones(2), peer=1)
    comm.works = [send, recv]
    with pytest.raises(RuntimeError, match="the copy after the group failed"):
        recv.wait()
    assert comm.launched == ["send", "send", "ncclGroupEnd"]
    assert cuda.life.ended.wait(5)
    assert cuda.state == "aborted" and isinstance(cuda.fault, RuntimeError)  # the peers drift otherwise
    for work in (send, recv):  # it ran: failed by the fault, not "never issued"
        assert work.exception() is cuda.fault and work._slot.keepalive is None
    assert comm.kept_at_abort == [True, True]  # released only after ncclCommAbort


def test_a_single_ring_call_failing_mid_way_faults_the_group(cuda_standins):
    group = make_group()
    cuda = group._cuda
    cuda.comm = GroupComm()
    cuda._adopt_device(CUDA)

    def ring(c, stream):
        raise RuntimeError("NVRTC: compile failed at step 3")

    with pytest.raises(RuntimeError, match="step 3"):
        submit(group, "all_reduce", ring, keep=torch.ones(2), algorithm="ring",
                    async_op=False)
    assert cuda.life.ended.wait(5)
    assert cuda.state == "aborted" and cuda.comm.aborted.is_set()


def test_a_batch_failing_before_its_first_launch_is_never_issued_and_faults_nothing(cuda_standins):
    group, cuda, comm = p2p_backend()

    def oom(c):
        raise torch.OutOfMemoryError("staging")

    def launch(c, stream, peer):
        c.launched.append("send")

    send = submit(group, "send", launch, peer=1, async_op=False)
    recv = submit(group, "recv", launch, peer=1, async_op=False, prepare=oom)
    with pytest.raises(torch.OutOfMemoryError):
        recv.wait()
    assert comm.launched == [] and cuda.state == "ok" and not cuda.watch.in_flight()
    for work in (send, recv):
        assert isinstance(work.exception(), CupycollError) and "never issued" in str(work.exception())
    group.abort()


def test_an_interrupt_after_launch_faults_the_group_with_a_typed_error(cuda_standins):
    group, cuda, comm = p2p_backend()

    def interrupt():
        raise KeyboardInterrupt

    def launch(c, stream, peer):
        c.launched.append("send")

    send = submit(group, "send", launch, keep=torch.ones(2), peer=1)
    recv = submit(group, "recv", launch, finish=interrupt, keep=torch.ones(2), peer=1)
    with pytest.raises(KeyboardInterrupt):
        recv.wait()
    assert cuda.life.ended.wait(5)
    assert cuda.state == "aborted" and isinstance(cuda.fault, CommunicatorAbortedError)
    assert isinstance(cuda.fault.__cause__, KeyboardInterrupt) and "interrupted" in str(cuda.fault)
    for work in (send, recv):
        assert work.exception() is cuda.fault and work._slot.keepalive is None
    with pytest.raises(CommunicatorAbortedError):
        send.wait()


# -- the communicator of a point-to-point call is the same on every rank ------------------


class Connecting(CpuAsCudaBackend):
    """_connect makes a named stand-in communicator (no store, no NCCL)."""

    def _connect(self, key, creator, size, rank, device):
        comm = FakeComm()
        comm.key, comm.rank = key, rank
        return comm


def connecting(rank, size=2):
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
    assert backend.p2p_comm(3) is backend.comm and backend.comms.pairs == {}

    class Parent:
        device = CUDA
        comm = FakeComm()

    Parent.comm.split = lambda color, key, on_abort=None, child=None, timeout=None: FakeComm()
    child = connecting(1, size=2)
    child.split_from(Parent())  # a subgroup of a bound default group: split at construction
    assert child.p2p_comm(0) is child.comm


# -- the watch knows the group's device ---------------------------------------------------


def test_the_watch_gets_the_device_the_first_call_picks():
    group = QueueGroup(None, 0, 2, datetime.timedelta(seconds=5))
    assert group._cuda.watch.device is None
    group.allreduce([torch.ones(2)], c10d.AllreduceOptions())
    assert group._cuda.watch.device == CUDA.index  # its events are queried with it current
