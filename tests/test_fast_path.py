"""The synchronous all_reduce's fast path (CudaBackend.all_reduce_fast) on CPU stand-ins: it
runs only when the general path would do the same thing, and then does what the general path
does (the same NCCL call, flight-recorder entry, watch and Work answers). Each input that
sends a call to the general path has a test that shows it does: the fast flag's (what changes
rarely: a blocking communicator made, settings) and the per-call ones (the tensor, a plan
learnt, an algorithm override, a capture, the group's state, queued calls, an open coalescing
block). An asynchronous call takes it too, on the communicator's stream after the caller's."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

import cupycoll
from cupycoll import config
from cupycoll.errors import CommunicatorAbortedError
from cupycoll.nccl.communicator import Communicator
from standins import CUDA, CpuAsCudaBackend, CpuAsCudaGroup, capture

DTYPE_FLOAT, OP_SUM = 7, 0  # ncclFloat32, ncclSum


class RecordingLibrary:
    """The NCCL library of a real Communicator on CPU: each call is recorded, none fails."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        if not name.startswith("nccl"):
            raise AttributeError(name)

        def call(*args):
            self.calls.append((name, args))
            return 0
        return call

    def has(self, name):
        return True


class Backend(CpuAsCudaBackend):
    """No store gate, no GPU: the communicator is the real one around a recording library."""

    nonblocking = False

    def _connect(self, key, creator, size, rank, device):
        comm = Communicator(device, rank, size, handle=1, timeout=60.0, nonblocking=self.nonblocking)
        comm._lib = RecordingLibrary()
        return comm


class Group(CpuAsCudaGroup):
    backend_class = Backend


@pytest.fixture
def make(cuda_standins, monkeypatch):
    from bench.group_cost import cupy_without_device
    from cupycoll import _cuda

    monkeypatch.setattr(_cuda, "cupy_module", cupy_without_device)
    made = []

    def group(**options):
        g = Group(dist.HashStore(), 0, 2, datetime.timedelta(seconds=60), config.Options(**options))
        made.append(g)
        return g
    yield group
    for g in made:
        g.abort()


def sync_opts(op=dist.ReduceOp.SUM):
    opts = c10d.AllreduceOptions()
    opts.reduceOp = op
    if not hasattr(opts, "asyncOp"):
        pytest.skip("this torch's AllreduceOptions has no asyncOp: every call is asynchronous there")
    opts.asyncOp = False
    return opts


def fast_taken(group, tensor=None, opts=None):
    """Did an all_reduce of ``tensor`` take the fast path? (It returns None otherwise.)"""
    tensor = torch.ones(4) if tensor is None else tensor
    return group._cuda.all_reduce_fast(tensor, sync_opts() if opts is None else opts) is not None


def warmed(group):
    """The group after its first all_reduce: the communicator made, the plan learnt."""
    group.allreduce([torch.ones(4)], sync_opts()).wait()
    return group


def test_a_synchronous_all_reduce_takes_the_fast_path_once_the_plan_is_learnt(make):
    group = make()
    assert not group._cuda.fast  # no communicator yet
    assert not fast_taken(group)
    warmed(group)
    assert group._cuda.fast and fast_taken(group)


def test_the_fast_path_does_what_the_general_path_does(make):
    fast, general = warmed(make()), warmed(make())
    tensor = torch.ones(4)
    fast_work = fast._cuda.all_reduce_fast(tensor, sync_opts())
    general._cuda.fast = False  # the same call, the general way
    general_work = general.allreduce([tensor], sync_opts())
    calls = [group._cuda.comm._lib.calls[-1] for group in (fast, general)]
    assert calls[0] == calls[1] and calls[0][0] == "ncclAllReduce"
    assert calls[0][1][:5] == (tensor.data_ptr(), tensor.data_ptr(), 4, DTYPE_FLOAT, OP_SUM)
    entries = [group._trace.recorder.entries[-1] for group in (fast, general)]
    assert [e[2:8] for e in entries][0] == [e[2:8] for e in entries][1]  # op, shapes, dtypes, root, route, state
    assert entries[0][7] == "issued" and fast._trace.recorder.last_issued == 2
    for work, group in ((fast_work, fast), (general_work, general)):
        assert work._in_flight() is not None and group._cuda.watch.in_flight() == 2
        assert work.result() == [tensor] and work.exception() is None


def test_the_fast_path_refuses_what_it_cannot_call(make):
    group = warmed(make())
    assert not fast_taken(group, torch.ones(4, 2).t())  # not contiguous
    assert not fast_taken(group, torch.ones(4, dtype=torch.float64))  # no plan learnt for float64
    assert not fast_taken(group, opts=sync_opts(dist.ReduceOp.MAX))  # nor for MAX
    group._cuda._device_index = 3  # the tensor is on another device than the group's
    assert not fast_taken(group)


def test_an_algorithm_override_sends_the_call_to_the_general_path(make):
    group = warmed(make())
    with cupycoll.algorithm("nccl"):
        assert not fast_taken(group)
    assert fast_taken(group)


def test_a_capture_sends_the_call_to_the_general_path(make, monkeypatch):
    group = warmed(make())
    capture(monkeypatch, True)
    assert not fast_taken(group)
    capture(monkeypatch, False)
    assert fast_taken(group)


def test_queued_calls_and_an_open_block_send_the_call_to_the_general_path(make):
    group = warmed(make())
    send = group.send([torch.ones(2)], 1)
    assert group._cuda.calls.pending and not fast_taken(group)  # the queue must go first
    send.wait()
    assert fast_taken(group)
    group._start_coalescing(CUDA)
    assert not fast_taken(group)  # the block's calls wait for its end
    group._end_coalescing(CUDA)
    assert fast_taken(group)


def test_an_ended_group_refuses_the_fast_path_and_the_general_path_says_why(make):
    group = warmed(make())
    group.abort()
    assert not fast_taken(group)
    with pytest.raises(CommunicatorAbortedError, match="was aborted"):
        group.allreduce([torch.ones(4)], sync_opts())


@pytest.mark.parametrize("setting", [{"check_collectives": True}, {"blocking_wait": True}, {"algorithm": "ring"}])
def test_settings_that_need_the_general_path_keep_the_fast_flag_off(make, setting):
    group = make(**setting)
    group._cuda.comm_for(CUDA)
    assert not group._cuda.fast and not fast_taken(group)


def test_a_nonblocking_communicator_keeps_the_fast_flag_off(make):
    group = make()
    group._cuda.nonblocking = True  # its calls are polled: the general path's
    group._cuda.comm_for(CUDA)
    assert not group._cuda.fast


def test_an_asynchronous_all_reduce_runs_on_the_communicators_stream_after_the_callers(make):
    # as the general path: the internal stream waits for the caller's, the tensor is held
    # until the GPU is done, and wait() makes the caller's stream wait for the call
    group = warmed(make())
    comm = group._cuda.comm
    comm.stream = 0x5eed  # its own stream, apart from the caller's (the stand-ins' is 0)
    opts = sync_opts()
    opts.asyncOp = True
    tensor = torch.ones(4)
    work = group._cuda.all_reduce_fast(tensor, opts)
    assert work is not None and comm._lib.calls[-1][1][-1] == 0x5eed  # launched on it
    order = group._cuda._order_event
    assert order is not None and order.records == 1  # recorded on the caller's stream first
    slot = work._in_flight()
    assert slot.stream == 0x5eed and slot.keepalive is tensor and work._async
    assert work.wait() and work.result() == [tensor]
