"""The fast path (CudaBackend.all_reduce_fast, broadcast_fast, all_gather_fast,
reduce_scatter_fast) on CPU stand-ins: it runs only when the general path would do the same
thing, and then does what the general path does (the same NCCL call, flight-recorder entry,
watch and Work answers). Each input that sends a call to the general path has a test that
shows it does: the fast flag's (what changes rarely: a blocking communicator made, settings)
and the per-call ones (the tensors, a plan learnt, an algorithm override, a capture, the
group's state, queued calls, an open coalescing block). An asynchronous call takes it too, on
the communicator's stream after the caller's. Bad input is never the fast path's: the general
path raises its typed error.

On the CPU route, a real group of one rank: an all_reduce of one CPU tensor goes to the gloo
half in one frame (GroupShell._all_reduce_on_cpu), recorded and traced as the general path
does, unless the general path has something to do first; a synchronous one is waited on in
the call, hands back gloo's finished Work, and raises a failure there, explained.

The parts of an ``allreduce_coalesced`` (what torch's coalescing manager makes of a block of
all_reduces) take one launch of their own (CudaBackend.all_reduce_parts) under the same
rules: the same NCCL calls in one NCCL group, the same flight-recorder entries, one Work."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

import cupycoll
from cupycoll import config
from cupycoll.errors import CommunicatorAbortedError
from cupycoll.nccl.communicator import Communicator
from cupycoll.trace.group import TracedWork
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


# The internal stream of every communicator made here.
INTERNAL = 0x1_5000


class Backend(CpuAsCudaBackend):
    """No store gate, no GPU: the communicator is the real one around a recording library."""

    nonblocking = False

    def _connect(self, key, creator, size, rank, device):
        comm = Communicator(device, rank, size, handle=1, timeout=60.0, nonblocking=self.nonblocking)
        comm._lib = RecordingLibrary()
        comm.stream = INTERNAL  # one number for every group's: the calls of two groups compare equal
        return comm


class Group(CpuAsCudaGroup):
    backend_class = Backend


@pytest.fixture
def make(cuda_standins):
    made = []

    def group(**options):
        g = Group(dist.HashStore(), 0, 2, datetime.timedelta(seconds=60), config.Options(**options))
        made.append(g)
        return g
    yield group
    for g in made:
        g.abort()


def asking(opts, async_op: bool):
    """``opts`` with ``asyncOp`` set where this torch's options have it (where not, every
    call is asynchronous: the rules these tests pin hold for it alike)."""
    if hasattr(opts, "asyncOp"):
        opts.asyncOp = async_op
    return opts


def all_reduce_opts(op=dist.ReduceOp.SUM, async_op=False):
    """Options of an all_reduce, synchronous unless ``async_op``."""
    opts = c10d.AllreduceOptions()
    opts.reduceOp = op
    return asking(opts, async_op)


def fast_taken(group, tensor=None, opts=None):
    """Did an all_reduce of ``tensor`` take the fast path? (It returns None otherwise.)"""
    tensor = torch.ones(4) if tensor is None else tensor
    return group._cuda.all_reduce_fast(tensor, all_reduce_opts() if opts is None else opts) is not None


def warmed(group):
    """The group after its first all_reduce: the communicator made, the plan learnt."""
    group.allreduce([torch.ones(4)], all_reduce_opts()).wait()
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
    fast_work = fast._cuda.all_reduce_fast(tensor, all_reduce_opts())
    general._cuda.fast = False  # the same call, the general way
    general_work = general.allreduce([tensor], all_reduce_opts())
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
    assert not fast_taken(group, opts=all_reduce_opts(dist.ReduceOp.MAX))  # nor for MAX
    group._cuda._device_index = 3  # the tensor is on another device than the group's
    assert not fast_taken(group)


def test_an_algorithm_override_sends_the_call_to_the_general_path(make):
    group = warmed(make())
    with cupycoll.algorithm("nccl"):
        assert not fast_taken(group)
    assert fast_taken(group)


def test_a_capture_sends_the_call_to_the_general_path(make, cuda_standins):
    group = warmed(make())
    capture(cuda_standins, True)
    assert not fast_taken(group)
    capture(cuda_standins, False)
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


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "reduce_scatter"])
def test_another_groups_block_open_in_this_thread_sends_the_call_to_the_general_path(make, kind):
    # which refuses it: one block coalesces one group's calls
    blocking, group = warmed(make()), make()
    if kind == "all_reduce":
        warmed(group)
        call = lambda: group.allreduce([torch.ones(4)], all_reduce_opts())  # noqa: E731
    else:
        flat_warmed(group, kind)
        call = lambda: flat_call(group, kind, *flat_tensors(kind))  # noqa: E731
    blocking._start_coalescing(CUDA)
    try:
        with pytest.raises(cupycoll.CupycollValueError, match="inside a coalescing block of group"):
            call()
    finally:
        blocking._end_coalescing(CUDA)
    assert call().wait()


def test_an_ended_group_refuses_the_fast_path_and_the_general_path_says_why(make):
    group = warmed(make())
    group.abort()
    assert not fast_taken(group)
    with pytest.raises(CommunicatorAbortedError, match="was aborted"):
        group.allreduce([torch.ones(4)], all_reduce_opts())


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
    opts = all_reduce_opts(async_op=True)
    tensor = torch.ones(4)
    earlier = group._cuda._order_event  # made by the warm-up where it was asynchronous too
    recorded = earlier.records if earlier is not None else 0
    work = group._cuda.all_reduce_fast(tensor, opts)
    assert work is not None and comm._lib.calls[-1][1][-1] == 0x5eed  # launched on it
    order = group._cuda._order_event
    assert order is not None and order.records == recorded + 1  # recorded on the caller's stream first
    slot = work._in_flight()
    assert slot.stream == 0x5eed and slot.keepalive is tensor and work._async
    assert work.wait() and work.result() == [tensor]


def coalesced_opts(op=dist.ReduceOp.SUM, async_op=False):
    opts = c10d.AllreduceCoalescedOptions()
    opts.reduceOp = op
    return asking(opts, async_op)


def parts_taken(group, tensors, opts=None):
    """Did the parts of an allreduce_coalesced of ``tensors`` take their own launch?"""
    work = group._cuda.all_reduce_parts(tensors, coalesced_opts() if opts is None else opts)
    if work is not None:
        work.wait()
    return work is not None


def test_coalesced_all_reduces_make_the_calls_and_entries_the_general_path_makes(make):
    fast, general = warmed(make()), warmed(make())
    general._cuda.fast = False  # the same calls, the general way (one all_reduce per part)
    tensors = [torch.ones(4), torch.ones(2, 3), torch.ones(5)]
    for group in (fast, general):
        library, recorder = group._cuda.comm._lib, group._trace.recorder
        library.calls.clear()
        group._start_coalescing(CUDA)  # as torch's _coalescing_manager calls it
        group.allreduce_coalesced(tensors, coalesced_opts())
        work = group._end_coalescing(CUDA)
        assert work.wait() and work.exception() is None
    made = [[call for call in group._cuda.comm._lib.calls if call[0] != "ncclCommGetAsyncError"]
            for group in (fast, general)]
    assert made[0] == made[1]
    assert [name for name, _ in made[0]] == ["ncclGroupStart"] + ["ncclAllReduce"] * 3 + ["ncclGroupEnd"]
    assert [args[:5] for name, args in made[0][1:4]] == [(t.data_ptr(), t.data_ptr(), t.numel(), DTYPE_FLOAT, OP_SUM)
                                                        for t in tensors]
    entries = [[e[2:8] for e in list(group._trace.recorder.entries)[-3:]] for group in (fast, general)]
    assert entries[0] == entries[1]
    assert [e[0] for e in entries[0]] == ["all_reduce"] * 3 and {e[5] for e in entries[0]} == {"issued"}
    assert fast._cuda.watch.in_flight() == 2  # the warm-up's batch and the block's: one slot each


def test_coalesced_parts_outside_a_block_are_one_call_with_one_work(make):
    group = warmed(make())
    tensors = [torch.ones(3), torch.ones(3)]
    work = group.allreduce_coalesced(tensors, coalesced_opts())
    assert work.wait() and work.result() == tensors
    assert [name for name, _ in group._cuda.comm._lib.calls[-4:]] == [
        "ncclGroupStart", "ncclAllReduce", "ncclAllReduce", "ncclGroupEnd"]


def test_coalesced_parts_go_the_general_way_when_one_part_needs_it(make):
    group = warmed(make())
    assert parts_taken(group, [torch.ones(4), torch.ones(2)])
    assert not parts_taken(group, [torch.ones(4), torch.ones(4, 2).t()])  # one not contiguous
    assert not parts_taken(group, [torch.ones(4), torch.ones(4, dtype=torch.float64)])  # no plan learnt
    assert not parts_taken(group, [torch.ones(4)], coalesced_opts(dist.ReduceOp.MAX))
    with cupycoll.algorithm("nccl"):
        assert not parts_taken(group, [torch.ones(4)])
    # what the general path did is learnt: the float64 parts then take their own launch too
    group.allreduce_coalesced([torch.ones(4), torch.ones(4, dtype=torch.float64)], coalesced_opts()).wait()
    assert parts_taken(group, [torch.ones(4), torch.ones(4, dtype=torch.float64)])


def test_coalesced_parts_on_an_ended_group_say_why(make):
    group = warmed(make())
    group.abort()
    with pytest.raises(CommunicatorAbortedError, match="was aborted"):
        group.allreduce_coalesced([torch.ones(4)], coalesced_opts())


# -- FSDP's two calls: all_gather_into_tensor and reduce_scatter_tensor ---------------------

DTYPE_BYTE = 1  # ncclUint8: all_gather moves bytes


def flat_opts(kind, op=dist.ReduceOp.SUM, async_op=False):
    opts = c10d.AllgatherOptions() if kind == "all_gather" else c10d.ReduceScatterOptions()
    if kind == "reduce_scatter":
        opts.reduceOp = op
    return asking(opts, async_op)


def flat_call(group, kind, output, input, opts=None):
    """The group's all_gather_into_tensor or reduce_scatter_tensor, as torch calls it."""
    opts = flat_opts(kind) if opts is None else opts
    if kind == "all_gather":
        return group._allgather_base(output, input, opts)
    return group._reduce_scatter_base(output, input, opts)


def flat_tensors(kind, shard=3, dtype=torch.float32):
    """(output, input) of a two-rank call: the whole is one shard per rank."""
    part, whole = torch.ones(shard, dtype=dtype), torch.ones(2 * shard, dtype=dtype)
    return (whole, part) if kind == "all_gather" else (part, whole)


def flat_taken(group, kind, output=None, input=None, opts=None):
    """Did the call take the fast path? (The group checks the fast flag first; the method
    returns None when the call needs the general path.)"""
    if output is None:
        output, input = flat_tensors(kind)
    method = group._cuda.all_gather_fast if kind == "all_gather" else group._cuda.reduce_scatter_fast
    return group._cuda.fast and method(output, input, flat_opts(kind) if opts is None else opts) is not None


def flat_warmed(group, kind):
    """The group after a first call of ``kind`` (the general path: the communicator made,
    a reduce_scatter's plan learnt)."""
    flat_call(group, kind, *flat_tensors(kind)).wait()
    return group


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter"])
def test_fsdps_calls_take_the_fast_path_after_their_first_call(make, kind):
    group = make()
    assert not flat_taken(group, kind)  # no communicator yet
    flat_warmed(group, kind)
    assert flat_taken(group, kind)


@pytest.mark.parametrize("kind, function, dtype", [("all_gather", "ncclAllGather", DTYPE_BYTE),
                                                   ("reduce_scatter", "ncclReduceScatter", DTYPE_FLOAT)])
def test_fsdps_calls_on_the_fast_path_do_what_the_general_path_does(make, kind, function, dtype):
    fast, general = flat_warmed(make(), kind), flat_warmed(make(), kind)
    general._cuda.fast = False  # the same call, the general way
    output, input = flat_tensors(kind)
    works = [flat_call(group, kind, output, input) for group in (fast, general)]
    calls = [group._cuda.comm._lib.calls[-1] for group in (fast, general)]
    assert calls[0] == calls[1] and calls[0][0] == function
    count = input.numel() * input.element_size() if kind == "all_gather" else output.numel()
    expected = (input.data_ptr(), output.data_ptr(), count, dtype) + ((OP_SUM,) if kind == "reduce_scatter" else ())
    assert calls[0][1][:len(expected)] == expected
    entries = [group._trace.recorder.entries[-1] for group in (fast, general)]
    assert entries[0][2:8] == entries[1][2:8]  # op, shapes, dtypes, root, route, state
    assert entries[0][3] == (output.shape, input.shape) and entries[0][7] == "issued"
    for work, group in zip(works, (fast, general)):
        assert work._in_flight() is not None and group._cuda.watch.in_flight() == 2
        assert work.result() == [output] and work.exception() is None and work.wait()


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter"])
def test_fsdps_calls_leave_to_the_general_path_what_it_must_check(make, kind):
    group = flat_warmed(make(), kind)
    output, input = flat_tensors(kind)
    assert not flat_taken(group, kind, output, torch.ones(6, 2).t()[0])  # input not contiguous
    assert not flat_taken(group, kind, torch.ones(6, 2).t()[0], input)  # output not contiguous
    assert not flat_taken(group, kind, output, input.double())  # dtypes differ
    assert not flat_taken(group, kind, torch.ones(output.numel() + 1), input)  # not one shard per rank
    group._cuda._device_index = 3  # the tensors are on another device than the group's
    assert not flat_taken(group, kind, output, input)


def test_a_reduce_scatter_needs_a_plan_learnt_for_its_dtype_and_op(make):
    group = flat_warmed(make(), "reduce_scatter")
    assert not flat_taken(group, "reduce_scatter", *flat_tensors("reduce_scatter", dtype=torch.float64))
    assert not flat_taken(group, "reduce_scatter", opts=flat_opts("reduce_scatter", dist.ReduceOp.MAX))
    with cupycoll.algorithm("nccl"):
        assert not flat_taken(group, "reduce_scatter")
    # an all_gather needs none, and no override concerns it
    flat_warmed(group, "all_gather")
    with cupycoll.algorithm("nccl"):
        assert flat_taken(group, "all_gather")


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter"])
def test_fsdps_calls_on_an_ended_group_say_why(make, kind):
    group = flat_warmed(make(), kind)
    group.abort()
    assert not flat_taken(group, kind)
    with pytest.raises(CommunicatorAbortedError, match="was aborted"):
        flat_call(group, kind, *flat_tensors(kind))


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter"])
def test_bad_input_to_a_fast_group_gets_the_general_paths_typed_error(make, kind):
    group = flat_warmed(make(), kind)
    output, input = flat_tensors(kind)
    with pytest.raises(cupycoll.CupycollValueError, match="numel|elements"):
        flat_call(group, kind, torch.ones(output.numel() + 1), input)
    with pytest.raises(cupycoll.CupycollTypeError, match="NoneType"):
        flat_call(group, kind, output, None)
    with pytest.raises(cupycoll.CupycollTypeError, match="NoneType"):
        group.allreduce([None], all_reduce_opts())
    assert flat_taken(group, kind)  # the group stays usable, and fast


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter"])
def test_an_asynchronous_fsdp_call_holds_both_tensors_on_the_communicators_stream(make, kind):
    group = flat_warmed(make(), kind)
    comm = group._cuda.comm
    comm.stream = 0x5eed
    output, input = flat_tensors(kind)
    work = flat_call(group, kind, output, input, flat_opts(kind, async_op=True))
    assert comm._lib.calls[-1][1][-1] == 0x5eed
    slot = work._in_flight()
    assert slot.stream == 0x5eed and slot.keepalive == (input, output) and work._async
    assert work.wait() and work.result() == [output]


# -- DDP's buffer broadcast ------------------------------------------------------------------


def broadcast_opts(root=0, async_op=False):
    opts = c10d.BroadcastOptions()
    opts.rootRank = root
    return asking(opts, async_op)


def test_a_broadcast_on_the_fast_path_does_what_the_general_path_does(make):
    fast, general = warmed(make()), warmed(make())
    general._cuda.fast = False  # the same call, the general way
    tensor = torch.ones(2, 3)
    assert fast._cuda.broadcast_fast(tensor, broadcast_opts(1)) is not None  # the fast path, indeed
    works = [group.broadcast([tensor], broadcast_opts(1)) for group in (fast, general)]
    calls = [group._cuda.comm._lib.calls[-1] for group in (fast, general)]
    assert calls[0] == calls[1] and calls[0][0] == "ncclBroadcast"
    assert calls[0][1][:5] == (tensor.data_ptr(), tensor.data_ptr(), 24, DTYPE_BYTE, 1)  # bytes, from rank 1
    entries = [group._trace.recorder.entries[-1] for group in (fast, general)]
    assert entries[0][2:8] == entries[1][2:8] and entries[0][5] == 1  # op, shapes, dtypes, root, route, state
    for work in works:
        assert work.wait() and work.result() == [tensor] and work.exception() is None


def test_a_broadcast_leaves_to_the_general_path_what_it_must_check(make):
    group = warmed(make())
    assert group._cuda.broadcast_fast(torch.ones(4), broadcast_opts(1)) is not None
    assert group._cuda.broadcast_fast(torch.ones(4, 2).t(), broadcast_opts()) is None  # not contiguous
    assert group._cuda.broadcast_fast(torch.ones(4), broadcast_opts(2)) is None  # no rank 2 in a group of 2
    assert group._cuda.broadcast_fast(torch.ones(4), broadcast_opts(-1)) is None
    with pytest.raises(cupycoll.CupycollValueError, match="root"):
        group.broadcast([torch.ones(4)], broadcast_opts(2))
    with pytest.raises(cupycoll.CupycollTypeError, match="NoneType"):
        group.broadcast([None], broadcast_opts())
    group._cuda._device_index = 3  # the tensor is on another device than the group's
    assert group._cuda.broadcast_fast(torch.ones(4), broadcast_opts()) is None


def test_an_asynchronous_broadcast_holds_its_tensor_on_the_communicators_stream(make):
    group = warmed(make())
    comm = group._cuda.comm
    comm.stream = 0x5eed
    tensor = torch.ones(4)
    work = group.broadcast([tensor], broadcast_opts(async_op=True))
    assert comm._lib.calls[-1][0] == "ncclBroadcast" and comm._lib.calls[-1][1][-1] == 0x5eed
    slot = work._in_flight()
    assert slot.stream == 0x5eed and slot.keepalive is tensor and work._async
    assert work.wait() and work.result() == [tensor]


class OnAnotherAccelerator(torch.Tensor):
    """A tensor of index 0 on an accelerator that is not CUDA (its get_device() says 0 too)."""

    @staticmethod
    def __new__(cls, size, device):
        return torch.Tensor._make_wrapper_subclass(cls, size, device=device, dtype=torch.float32)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(str(func))


@pytest.mark.parametrize("device", ["xpu:0", "privateuseone:0"])
def test_a_tensor_of_another_accelerator_never_takes_the_fast_path(make, device):
    # the general path names the device it does not support, and makes no NCCL call
    group = warmed(make())
    flat_warmed(group, "reduce_scatter")
    cuda = group._cuda
    cuda._fast_is_cuda, cuda._device_index = True, 0  # as on cuda:0 (the stand-ins' CPU tensors stand in for none)
    other = OnAnotherAccelerator((4,), device)
    whole = OnAnotherAccelerator((8,), device)
    assert cuda.all_reduce_fast(other, all_reduce_opts()) is None
    assert cuda.broadcast_fast(other, broadcast_opts()) is None
    assert cuda.all_gather_fast(whole, other, flat_opts("all_gather")) is None
    assert cuda.reduce_scatter_fast(other, whole, flat_opts("reduce_scatter")) is None
    assert cuda.all_reduce_parts([other], coalesced_opts()) is None
    made = len(cuda.comm._lib.calls)
    for call in (lambda: group.allreduce([other], all_reduce_opts()), lambda: group.broadcast([other], broadcast_opts())):
        with pytest.raises(cupycoll.CupycollValueError, match="not supported"):
            call()
    assert len(cuda.comm._lib.calls) == made


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")
@pytest.mark.parametrize("layout", ["sparse_csr", "sparse_csc"])
def test_a_compressed_sparse_tensor_on_a_fast_group_gets_the_general_paths_typed_error(make, layout):
    # such a tensor has no strides: asking whether it is contiguous raises torch's own error
    group = warmed(make())
    flat_warmed(group, "reduce_scatter")
    dense = torch.eye(4)
    sparse = dense.to_sparse_csr() if layout == "sparse_csr" else dense.to_sparse_csc()
    cuda = group._cuda
    made = len(cuda.comm._lib.calls)
    calls = {"allreduce": lambda: group.allreduce([sparse], all_reduce_opts()),
             "broadcast": lambda: group.broadcast([sparse], broadcast_opts()),
             "allreduce_coalesced": lambda: group.allreduce_coalesced([sparse], coalesced_opts()),
             "all_gather": lambda: flat_call(group, "all_gather", torch.ones(32), sparse),
             "reduce_scatter": lambda: flat_call(group, "reduce_scatter", sparse, torch.ones(32))}
    for name, call in calls.items():
        with pytest.raises(cupycoll.CupycollTypeError, match=f"torch.{layout} tensor"):
            call()
    assert len(cuda.comm._lib.calls) == made  # nothing reached NCCL
    assert fast_taken(group)  # the group stays usable, and fast


# -- the CPU route's all_reduce ----------------------------------------------------------


class RecordingHalf:
    """The group's gloo half, each call recorded on its way through."""

    def __init__(self, gloo):
        self.gloo = gloo
        self.calls = []

    def __getattr__(self, name):
        method = getattr(self.gloo, name)

        def call(*args):
            self.calls.append((name, args))
            return method(*args)
        return call


@pytest.fixture
def cpu_group(monkeypatch):
    from cupycoll.process_group import ProcessGroupCupycoll

    made = []

    def group(**options):
        g = ProcessGroupCupycoll(dist.HashStore(), 0, 1, datetime.timedelta(seconds=30), config.Options(**options))
        made.append(g)
        monkeypatch.setattr(g, "_cpu", RecordingHalf(g._cpu))
        return g
    yield group
    for g in made:
        g.shutdown()


def cpu_taken(group, tensor=None, opts=None):
    """Did the CPU all_reduce take its one frame? (It returns None otherwise.)"""
    tensor = torch.ones(4) if tensor is None else tensor
    return group._all_reduce_on_cpu(tensor, [tensor], all_reduce_opts() if opts is None else opts) is not None


synchronous_calls_exist = pytest.mark.skipif(
    not hasattr(c10d.AllreduceOptions(), "asyncOp"),
    reason="this torch's all_reduce options do not say whether the caller waits at once")


def test_a_cpu_all_reduce_goes_to_gloo_in_one_frame_as_the_general_path_would(cpu_group):
    fast, general = cpu_group(), cpu_group()
    general._all_reduce_on_cpu = lambda tensor, tensors, opts: None  # the same call, the general way
    works = []
    for group in (fast, general):
        tensors, opts = [torch.full((3,), 2.0)], all_reduce_opts(async_op=True)
        work = group.allreduce(tensors, opts)
        works.append(work)
        assert work.wait() and torch.equal(tensors[0], torch.full((3,), 2.0))  # one rank: the sum is itself
        [(name, args)] = group._cpu.calls  # the caller's own list and options, handed on
        assert name == "allreduce" and args[0] is tensors and args[1] is opts
    assert [type(work) for work in works][0] is type(works[1]) and works[0].is_completed()
    entries = [group._trace.recorder.entries[-1] for group in (fast, general)]
    assert entries[0][2:8] == entries[1][2:8] == ["all_reduce", (torch.Size([3]),), (torch.float32,), None,
                                                  "gloo", "completed"]


@synchronous_calls_exist
def test_a_synchronous_cpu_all_reduce_is_waited_on_in_the_call_and_hands_back_gloos_finished_work(cpu_group):
    group = cpu_group()
    tensors = [torch.full((3,), 2.0)]
    work = group.allreduce(tensors, all_reduce_opts())
    [(name, _)] = group._cpu.calls
    assert name == "allreduce"
    assert not isinstance(work, TracedWork) and type(work).__module__.startswith("torch")  # gloo's own
    entry = group._trace.recorder.entries[-1]
    assert entry[2] == "all_reduce" and entry[7] == "completed"  # before anybody waited on the Work
    assert work.is_completed() and work.wait() and torch.equal(tensors[0], torch.full((3,), 2.0))
    assert group._trace._open == {}  # nothing left for the group's end to fail


class FailingWaitHalf:
    """A group's gloo half whose all_reduce Works fail at ``wait()`` with ``error``, as gloo
    reports a timeout or a refused argument: only when waited on."""

    def __init__(self, gloo, error):
        self.gloo, self.error = gloo, error

    def __getattr__(self, name):
        return getattr(self.gloo, name)

    def allreduce(self, tensors, opts):
        error = self.error

        class Failing:
            def wait(self, timeout=None):
                raise error
        return Failing()


@synchronous_calls_exist
def test_a_synchronous_cpu_all_reduce_raises_gloos_failure_from_the_call_explained(cpu_group, monkeypatch):
    group = cpu_group()
    explained = []
    monkeypatch.setattr(group._trace, "explain_timeout",
                        lambda entry, timeout_s, *args, **kwargs: explained.append(entry) or "rank 1 is behind")
    timeout = RuntimeError("[../gloo/transport/tcp/pair.cc:534] Timed out waiting 5000ms for recv operation")
    gloo = group._cpu
    monkeypatch.setattr(group, "_cpu", FailingWaitHalf(gloo, timeout))
    with pytest.raises(cupycoll.CollectiveTimeoutError, match="rank 1 is behind") as raised:
        group.allreduce([torch.ones(4)], all_reduce_opts())
    assert raised.value.__cause__ is timeout
    entry = group._trace.recorder.entries[-1]
    assert explained == [entry] and entry[7] == "failed"
    # (the timeout was the group's fault: it ended; this rank's own argument, on a group of its own)
    group = cpu_group()
    monkeypatch.setattr(group._trace, "explain_timeout",
                        lambda entry, timeout_s, *args, **kwargs: explained.append(entry) or "rank 1 is behind")
    refused = RuntimeError("Invalid scalar type")  # this rank's own argument: gloo's error as it is
    monkeypatch.setattr(group, "_cpu", FailingWaitHalf(group._cpu, refused))
    with pytest.raises(RuntimeError) as raised:
        group.allreduce([torch.ones(4)], all_reduce_opts())
    assert raised.value is refused and explained == [entry]
    assert group._trace.recorder.entries[-1][7] == "failed" and group._cuda.state == "ok"


class BlockingWaitHalf(FailingWaitHalf):
    """A gloo half whose all_reduce Works block in ``wait()`` until ``release`` is set, then
    fail with ``error``: gloo's timeout coming after the group's close."""

    def __init__(self, gloo, error):
        super().__init__(gloo, error)
        self.waiting, self.release = threading.Event(), threading.Event()

    def allreduce(self, tensors, opts):
        half = self

        class Blocking:
            def wait(self, timeout=None):
                half.waiting.set()
                half.release.wait(30)
                raise half.error
        return Blocking()


@synchronous_calls_exist
def test_a_synchronous_cpu_all_reduce_the_groups_close_caught_fails_as_closed_asking_nobody(cpu_group, monkeypatch):
    group = cpu_group()
    explained = []
    monkeypatch.setattr(group._trace, "explain_timeout", lambda *args, **kwargs: explained.append(args) or "asked")
    half = BlockingWaitHalf(group._cpu, RuntimeError("[gloo] Timed out waiting 5000ms for recv operation"))
    monkeypatch.setattr(group, "_cpu", half)
    raised = []

    def call():
        try:
            group.allreduce([torch.ones(4)], all_reduce_opts())
        except BaseException as exc:  # noqa: BLE001 - what the caller saw
            raised.append(exc)
    caller = threading.Thread(target=call)
    caller.start()
    assert half.waiting.wait(30)
    group._trace.close("aborted")  # what the group's abort does to its CPU half's calls
    half.release.set()
    caller.join(30)
    [error] = raised
    assert isinstance(error, CommunicatorAbortedError) and "was aborted before all_reduce #" in str(error)
    assert error.__cause__ is half.error and explained == []  # the other ranks are not asked
    assert group._trace.recorder.entries[-1][7] in ("failed", "aborted")


def test_a_cpu_all_reduce_leaves_to_the_general_path_what_it_must_do_first(cpu_group):
    group = cpu_group()
    assert cpu_taken(group)
    group._cuda.calls.open_block()  # a CUDA block open: the general path refuses CPU tensors in it
    assert not cpu_taken(group)
    with pytest.raises(cupycoll.CupycollValueError, match="CPU tensors inside a coalescing block"):
        group.allreduce([torch.ones(4)], all_reduce_opts())
    group._cuda.calls.close_block()
    assert cpu_taken(group)
    group._cuda.calls.pending.append(None)  # a CUDA send queued: the general path issues it first
    assert not cpu_taken(group)
    group._cuda.calls.pending.clear()
    integers = torch.ones(4, dtype=torch.int64)
    assert not cpu_taken(group, integers, all_reduce_opts(dist.ReduceOp.AVG))  # gloo cannot average integers
    assert cpu_taken(group, integers)


def test_a_cpu_all_reduce_takes_its_frame_on_a_group_whose_cuda_calls_take_theirs(cpu_group, monkeypatch):
    group = cpu_group()
    monkeypatch.setattr(group._cuda, "fast", True)  # as once its communicator is made
    taken = []
    on_cpu = group._all_reduce_on_cpu
    monkeypatch.setattr(group, "_all_reduce_on_cpu", lambda *args: taken.append(args[0]) or on_cpu(*args))
    tensor = torch.ones(2)
    assert group.allreduce([tensor], all_reduce_opts()).wait() and taken == [tensor]


def test_the_mismatch_check_keeps_the_cpu_all_reduce_on_the_general_path(cpu_group):
    assert not cpu_taken(cpu_group(check_collectives=True))


def test_a_cpu_all_reduce_on_an_ended_group_says_why(cpu_group):
    group = cpu_group()
    group.abort()
    assert not cpu_taken(group)
    with pytest.raises(CommunicatorAbortedError, match="was aborted"):
        group.allreduce([torch.ones(4)], all_reduce_opts())
