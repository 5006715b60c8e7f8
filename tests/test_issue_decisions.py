"""The issuer's decisions (cupycoll.issue.Issuer.issue) on CPU stand-ins, seen by a spy on
its ``_later`` (the queue's way: queued, or issued after what is queued as one NCCL group) and
``_enqueue`` (a batch issued): which calls launch at once, in one frame, and which go through
``_later``; and that a call launched in one frame does what ``_later`` does with the same call
(the same NCCL call and arguments, flight-recorder entry, watch state and Work answers).

In one frame, once the group's communicator is made: a synchronous or asynchronous
all_reduce, broadcast, all_gather_into_tensor or reduce_scatter_tensor (DDP's and FSDP's
calls), and an all_to_all, gather or scatter (NCCL calls alone, in one NCCL group); on
blocking and nonblocking communicators alike, with the mismatch check or blocking wait on; a
reduction of a dtype or op not seen before (its plan is made in the call). An asynchronous one
runs on the communicator's stream after the caller's. Through ``_later``: the first call (it
makes the communicator), a call of several steps (an algorithm such as the ring, a
PREMUL_SUM, a reduce_scatter of a list of inputs), a point-to-point call, a call behind
queued ones or inside an open coalescing block, one captured into a CUDA graph, one from a
caller whose current device is not the group's. A tensor of another accelerator, bad input,
an ended group and another group's open block get a typed error, before anything is issued.

The parts of an ``allreduce_coalesced`` are one call of their NCCL calls, in one NCCL group,
with one flight-recorder entry per part and one Work: in one frame outside a block, and, as
a coalescing block of that one call, issued through ``issue()`` at the block's end; the parts
go one by one in a block where one needs a call of its own.

On the CPU route, a real group of one rank: an all_reduce of one CPU tensor goes to the gloo
half in one frame (GroupShell._all_reduce_on_cpu), recorded and traced as the general path
does, unless the general path has something to do first; a synchronous one is waited on in
the call, hands back gloo's finished Work, and raises a failure there, explained."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

import cupycoll
from cupycoll import collectives, compat, config
from cupycoll.errors import CommunicatorAbortedError
from cupycoll.nccl.communicator import Communicator
from cupycoll.trace.group import TracedWork
from faulty import Unchecked
from standins import CUDA, CpuAsCudaBackend, CpuAsCudaGroup, capture

DTYPE_BYTE, DTYPE_FLOAT, DTYPE_DOUBLE = 1, 7, 8  # ncclUint8 (what moving calls move), ncclFloat32, ncclFloat64
OP_SUM, OP_MAX = 0, 2  # ncclSum, ncclMax
HANDLE = 1  # every communicator's here: an NCCL call's argument after the call's own
INTERNAL = 0x1_5000  # the internal stream of every communicator made here (the caller's is 0)


class RecordingLibrary:
    """The NCCL library of a real Communicator on CPU: each call is recorded, none fails."""

    def __init__(self):
        self.calls = []

    @property
    def unchecked(self):
        return Unchecked(self)

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
    """No store gate, no GPU: each communicator is a real one around a recording library."""

    def _connect(self, key, creator, size, rank, device):
        comm = Communicator(device, rank, size, handle=HANDLE, timeout=60.0, nonblocking=self.settings.nonblocking)
        comm._lib = RecordingLibrary()
        comm.stream = INTERNAL  # one number for every group's: the calls of two groups compare equal
        return comm


class Group(CpuAsCudaGroup):
    backend_class = Backend


def spy(group):
    """Record on ``group`` what goes through its issuer's ``_later`` (each call's op, in
    ``group.later``) and ``_enqueue`` (each batch's ops, in ``group.batches``), each then
    called through."""
    issuer = group._issuer
    later, enqueue = issuer._later, issuer._enqueue
    group.later, group.batches = [], []
    issuer._later = lambda call: group.later.append(call.op) or later(call)
    issuer._enqueue = lambda batch: group.batches.append([call.op for call in batch]) or enqueue(batch)
    return group


@pytest.fixture
def make(cuda_standins):
    made = []

    def group(**options):
        g = spy(Group(dist.HashStore(), 0, 2, datetime.timedelta(seconds=60), config.Options(**options)))
        made.append(g)
        return g
    yield group
    for g in made:
        g.abort()


def through_later(group):
    """``group`` with every call its shell hands the issuer sent through ``Issuer._later``:
    the same calls, the queue's way."""
    group._issuer.issue = group._issuer._later
    return group


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


def launched(group) -> list:
    """The NCCL calls launched on the group's communicator: not those on the communicator
    itself (the watchdog's async-error polls, the abort)."""
    comm = group._cuda.comm
    return [] if comm is None else [call for call in comm._lib.calls if not call[0].startswith("ncclComm")]


def sealed(group):
    """``group`` with every open slot of its watch sealed (a synchronous call's event,
    recorded): the next synchronous call opens a slot of its own, whenever it comes."""
    watch = group._cuda.watch
    for queue in list(watch._streams.values()):
        for slot in list(queue):
            watch.seal(slot)
    return group


def warmed(group):
    """The group after its first all_reduce: the communicator made."""
    group.allreduce([torch.ones(4)], all_reduce_opts()).wait()
    return sealed(group)


def routed(group, call):
    """(the Work ``call()`` returned, the ops it sent through ``Issuer._later``, the batches
    ``Issuer._enqueue`` issued): the last two empty when it launched in one frame."""
    forget(group)
    work = call()
    return work, list(group.later), list(group.batches)


def forget(group) -> int:
    """Clear what the spy saw of ``group``; how many NCCL calls it has launched so far."""
    group.later.clear()
    group.batches.clear()
    return len(launched(group))


def one_frame(group, call=None) -> bool:
    """Did ``call()`` (by default a synchronous all_reduce of four ones) launch its NCCL call
    in one frame: nothing through ``Issuer._later`` or ``_enqueue``, and its Work issued?"""
    before = len(launched(group))
    if call is None:
        call = lambda: group.allreduce([torch.ones(4)], all_reduce_opts())  # noqa: E731
    work, later, batches = routed(group, call)
    return not later and not batches and len(launched(group)) > before and work._flush is None


def held(keepalive) -> set:
    """The ids of the tensors a slot's keepalive holds, however nested."""
    if isinstance(keepalive, torch.Tensor):
        return {id(keepalive)}
    if isinstance(keepalive, (list, tuple)):
        return set().union(*(held(part) for part in keepalive)) if keepalive else set()
    return set()


# -- the calls of DDP and FSDP ---------------------------------------------------------------

KINDS = ["all_reduce", "broadcast", "all_gather", "reduce_scatter"]
OPS = {"all_reduce": "all_reduce", "broadcast": "broadcast", "all_gather": "all_gather_into_tensor",
       "reduce_scatter": "reduce_scatter_tensor"}


def tensors_of(kind, dtype=torch.float32) -> tuple:
    """The tensors of a two-rank call of ``kind``: (its tensor,), or (output, input), the
    whole one shard per rank."""
    if kind in ("all_reduce", "broadcast"):
        return (torch.ones(2, 3, dtype=dtype),)
    shard, whole = torch.ones(3, dtype=dtype), torch.ones(6, dtype=dtype)
    return (whole, shard) if kind == "all_gather" else (shard, whole)


def opts_of(kind, async_op=False, op=dist.ReduceOp.SUM, root=1):
    if kind == "all_reduce":
        return all_reduce_opts(op, async_op)
    if kind == "broadcast":
        opts = c10d.BroadcastOptions()
        opts.rootRank = root
        return asking(opts, async_op)
    opts = c10d.AllgatherOptions() if kind == "all_gather" else c10d.ReduceScatterOptions()
    if kind == "reduce_scatter":
        opts.reduceOp = op
    return asking(opts, async_op)


def call_of(group, kind, tensors=None, opts=None):
    """The group's call of ``kind``, as torch makes it."""
    tensors = tensors_of(kind) if tensors is None else tensors
    opts = opts_of(kind) if opts is None else opts
    if kind == "all_reduce":
        return group.allreduce([tensors[0]], opts)
    if kind == "broadcast":
        return group.broadcast([tensors[0]], opts)
    if kind == "all_gather":
        return group._allgather_base(*tensors, opts)
    return group._reduce_scatter_base(*tensors, opts)


def nccl_call_of(kind, tensors) -> tuple:
    """(the NCCL function, its arguments before the communicator and stream) of the call."""
    if kind in ("all_reduce", "broadcast"):
        ptr = tensors[0].data_ptr()
        if kind == "all_reduce":
            return "ncclAllReduce", (ptr, ptr, 6, DTYPE_FLOAT, OP_SUM)
        return "ncclBroadcast", (ptr, ptr, 24, DTYPE_BYTE, 1)  # 24 bytes, from rank 1
    output, input = tensors
    if kind == "all_gather":
        return "ncclAllGather", (input.data_ptr(), output.data_ptr(), 12, DTYPE_BYTE)  # one shard's bytes
    return "ncclReduceScatter", (input.data_ptr(), output.data_ptr(), 3, DTYPE_FLOAT, OP_SUM)


@pytest.mark.parametrize("kind", KINDS)
def test_the_first_call_makes_the_communicator_through_later_and_the_next_take_one_frame(make, kind):
    group = make()
    assert group._cuda.comm is None
    work, later, batches = routed(group, lambda: call_of(group, kind))
    assert later == [OPS[kind]] and batches == [[OPS[kind]]]  # the queue's way: the communicator made there
    assert group._cuda.comm is not None and work.wait()
    assert [name for name, _ in launched(group)] == [nccl_call_of(kind, tensors_of(kind))[0]]
    assert one_frame(group, lambda: call_of(group, kind))
    assert one_frame(group, lambda: call_of(group, kind, opts=opts_of(kind, async_op=True)))


@pytest.mark.parametrize("async_op", [False, True], ids=["synchronous", "asynchronous"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_call_in_one_frame_does_what_the_later_route_does(make, kind, async_op):
    framed, queued = warmed(make()), through_later(warmed(make()))
    tensors, opts = tensors_of(kind), opts_of(kind, async_op)
    asynchronous = compat.async_requested(opts)
    stream = INTERNAL if asynchronous else 0  # the communicator's, or the caller's
    works, routes = [], []
    for group in (framed, queued):
        work, later, batches = routed(group, lambda: call_of(group, kind, tensors, opts))
        works.append(work)
        routes.append((later, batches))
    assert routes == [([], []), ([OPS[kind]], [[OPS[kind]]])]
    calls = [launched(group)[-1] for group in (framed, queued)]
    function, args = nccl_call_of(kind, tensors)
    assert calls[0] == calls[1] == (function, args + (HANDLE, stream))
    entries = [group._trace.recorder.entries[-1] for group in (framed, queued)]
    assert entries[0][2:8] == entries[1][2:8]  # op, shapes, dtypes, root, route, state
    assert entries[0][2] == OPS[kind] and entries[0][7] == "issued"
    if kind in ("all_gather", "reduce_scatter"):
        assert entries[0][3] == (tensors[0].shape, tensors[1].shape)
    for work, group, entry in zip(works, (framed, queued), entries):
        assert group._trace.recorder.last_issued == 2
        slot = work._in_flight()
        assert slot is not None and group._cuda.watch.in_flight() == 2  # the warm-up's and this one's
        assert slot.records is entry and slot.stream == stream
        if asynchronous:  # what the GPU reads or writes, held until it is done
            assert held(slot.keepalive) == {id(t) for t in tensors}
        else:
            assert slot.keepalive is None
    assert [(w.op_name, w.seq, w._async, w._stream, w._blocking_wait) for w in works] == \
        [(OPS[kind], 2, asynchronous, stream, False)] * 2
    for work in works:
        assert work.result() == [tensors[0]] and work.exception() is None
        assert not work.is_completed()  # the GPU has not passed its event
        work._in_flight().event.fired.set()
        assert work.is_completed() and work.is_success() and work.wait()


def test_a_reduction_of_a_dtype_or_op_not_seen_before_makes_its_plan_in_the_call_and_takes_one_frame(make):
    group = warmed(make())
    double = torch.ones(4, dtype=torch.float64)
    assert one_frame(group, lambda: group.allreduce([double], all_reduce_opts()))
    assert launched(group)[-1][1][2:5] == (4, DTYPE_DOUBLE, OP_SUM)
    assert one_frame(group, lambda: group.allreduce([torch.ones(4)], all_reduce_opts(dist.ReduceOp.MAX)))
    assert launched(group)[-1][1][2:5] == (4, DTYPE_FLOAT, OP_MAX)
    output, input = tensors_of("reduce_scatter", torch.float64)
    assert one_frame(group, lambda: call_of(group, "reduce_scatter", (output, input),
                                            opts_of("reduce_scatter", op=dist.ReduceOp.MAX)))
    assert launched(group)[-1][0] == "ncclReduceScatter" and launched(group)[-1][1][2:5] == (3, DTYPE_DOUBLE, OP_MAX)


def test_calls_of_several_nccl_calls_alone_take_one_frame_in_one_nccl_group(make):
    # all_to_all, gather, scatter: NCCL sends and receives, no step of their own
    group = warmed(make())
    outputs, inputs = [torch.zeros(2), torch.zeros(2)], [torch.ones(2), torch.ones(2)]
    before = len(launched(group))
    assert one_frame(group, lambda: group.alltoall(outputs, inputs, c10d.AllToAllOptions()))
    assert [name for name, _ in launched(group)[before:]] == [
        "ncclGroupStart", "ncclSend", "ncclRecv", "ncclSend", "ncclRecv", "ncclGroupEnd"]
    before = len(launched(group))
    assert one_frame(group, lambda: group.gather([outputs], [torch.ones(2)], c10d.GatherOptions()))  # the root's
    assert [name for name, _ in launched(group)[before:]] == [
        "ncclGroupStart", "ncclRecv", "ncclRecv", "ncclSend", "ncclGroupEnd"]
    before = len(launched(group))
    assert one_frame(group, lambda: group.scatter([torch.zeros(2)], [inputs], c10d.ScatterOptions()))
    assert [name for name, _ in launched(group)[before:]] == [
        "ncclGroupStart", "ncclSend", "ncclSend", "ncclRecv", "ncclGroupEnd"]


@pytest.mark.parametrize("call", ["premul_sum", "reduce_scatter_of_a_list"])
def test_a_call_of_several_steps_goes_through_later(make, call):
    # a run (and a prepare: the PREMUL_SUM op made, the inputs staged side by side) of its
    # own, not NCCL calls alone
    group = warmed(make())
    if call == "premul_sum":
        op, make_call = "all_reduce", lambda: group.allreduce(
            [torch.ones(4)], all_reduce_opts(dist._make_nccl_premul_sum(0.5)))
    else:
        op, make_call = "reduce_scatter", lambda: group.reduce_scatter(
            [torch.zeros(3)], [[torch.ones(3), torch.ones(3)]], opts_of("reduce_scatter"))
    work, later, batches = routed(group, make_call)
    assert later == [op] and batches == [[op]]
    assert work.wait() and work._flush is None  # issued, not queued


@pytest.mark.parametrize("kind", ["all_reduce", "reduce_scatter"])
def test_an_algorithm_sends_the_call_through_later(make, kind):
    group = warmed(make(algorithm="ring"))
    work, later, batches = routed(group, lambda: call_of(group, kind))
    assert later == [OPS[kind]] and batches == [[OPS[kind]]] and work.wait()
    entry = group._trace.recorder.entries[-1]
    assert entry[2] == OPS[kind] and entry[6] == "ring"  # the flight recorder names the algorithm that ran it


def test_an_algorithm_override_sends_a_reduction_through_later_and_nccl_s_takes_one_frame(make):
    group = warmed(make())
    with cupycoll.algorithm("ring"):
        for kind in ("all_reduce", "reduce_scatter"):
            work, later, batches = routed(group, lambda: call_of(group, kind))
            assert later == [OPS[kind]] and batches == [[OPS[kind]]] and work.wait()
        assert one_frame(group, lambda: call_of(group, "all_gather"))  # no algorithm gathers: NCCL's
    with cupycoll.algorithm("nccl"):  # an override naming NCCL: its plan is NCCL's own call
        assert one_frame(group)
        assert one_frame(group, lambda: call_of(group, "reduce_scatter"))
    assert one_frame(group)


def test_a_capture_sends_the_call_through_later_unwatched(make, cuda_standins):
    group = warmed(make())
    capture(cuda_standins, True)
    work, later, batches = routed(group, lambda: group.allreduce([torch.ones(4)], all_reduce_opts()))
    assert later == ["all_reduce"] and batches == [["all_reduce"]]
    assert launched(group)[-1][0] == "ncclAllReduce"  # captured into the graph
    assert work._in_flight() is None and group._cuda.captured  # it runs when the graph is replayed
    capture(cuda_standins, False)
    assert one_frame(group)


def test_a_caller_on_another_device_goes_through_later_on_the_groups(make, cuda_standins):
    group = warmed(make())
    cuda_standins.set_device(1)  # the group's is cuda:0
    work, later, batches = routed(group, lambda: group.allreduce([torch.ones(4)], all_reduce_opts()))
    assert later == ["all_reduce"] and batches == [["all_reduce"]] and work.wait()
    assert cuda_standins.current_device() == 1  # set back after the call
    cuda_standins.set_device(0)
    assert one_frame(group)


def test_queued_calls_send_the_next_call_through_later_after_them(make):
    group = warmed(make())
    send, later, batches = routed(group, lambda: group.send([torch.ones(2)], 1, 0))
    assert later == ["send"] and batches == [] and group._issuer.pending and send._flush is not None  # queued
    work, later, batches = routed(group, lambda: group.allreduce([torch.ones(4)], all_reduce_opts()))
    assert later == ["all_reduce"] and batches == [["send"], ["all_reduce"]]  # the queue goes first
    assert not group._issuer.pending and send._flush is None and work.wait()
    assert [name for name, _ in group._cuda.comms.pairs[1]._lib.calls] == ["ncclSend"]
    assert one_frame(group)


def test_an_open_coalescing_block_queues_the_call_and_a_block_of_that_one_call_ends_in_one_frame(make):
    group = warmed(make())
    before = len(launched(group))
    group._start_coalescing(CUDA)
    inner, later, batches = routed(group, lambda: group.allreduce([torch.ones(4)], all_reduce_opts()))
    assert later == ["all_reduce"] and batches == [] and inner._flush is not None  # the block's calls wait
    assert len(launched(group)) == before
    work, later, batches = routed(group, lambda: group._end_coalescing(CUDA))
    assert later == [] and batches == []  # re-issued through issue(): in one frame
    assert [name for name, _ in launched(group)[before:]] == ["ncclAllReduce"]
    assert work._in_flight() is not None and work.op_name == "all_reduce" and work.wait()
    assert one_frame(group)


def test_a_block_of_several_calls_is_one_batch_through_later(make):
    group = warmed(make())
    group._start_coalescing(CUDA)
    group.allreduce([torch.ones(4)], all_reduce_opts())
    group.broadcast([torch.ones(4)], opts_of("broadcast"))
    work, later, batches = routed(group, lambda: group._end_coalescing(CUDA))
    assert later == [] and batches == [["all_reduce", "broadcast"]]
    assert [name for name, _ in launched(group)[-4:]] == [
        "ncclGroupStart", "ncclAllReduce", "ncclBroadcast", "ncclGroupEnd"]
    assert work.wait() and len(work.result()) == 2


@pytest.mark.parametrize("kind", KINDS)
def test_another_groups_block_open_in_this_thread_makes_the_call_a_typed_error(make, kind):
    # one block coalesces one group's calls
    blocking, group = warmed(make()), warmed(make())
    before = forget(group)
    blocking._start_coalescing(CUDA)
    try:
        with pytest.raises(cupycoll.CupycollValueError, match="inside a coalescing block of group"):
            call_of(group, kind)
        assert group.later == [OPS[kind]] and group.batches == []  # _later asked, and refused it
    finally:
        blocking._end_coalescing(CUDA)
    assert len(launched(group)) == before and not group._issuer.pending
    assert one_frame(group, lambda: call_of(group, kind))


@pytest.mark.parametrize("kind", KINDS + ["allreduce_coalesced"])
def test_an_ended_group_refuses_each_call_and_says_why(make, kind):
    group = warmed(make())
    before = forget(group)
    group.abort()
    with pytest.raises(CommunicatorAbortedError, match="was aborted"):
        if kind == "allreduce_coalesced":
            group.allreduce_coalesced([torch.ones(4), torch.ones(2)], coalesced_opts())
        else:
            call_of(group, kind)
    assert group.later == [] and len(launched(group)) == before  # refused before the issuer


def test_an_ended_groups_issuer_sends_a_call_through_later_which_launches_nothing(make):
    group = warmed(make())
    before = forget(group)
    call = collectives.all_reduce(group._cuda, [torch.ones(4)], all_reduce_opts())  # described while usable
    group.abort()
    with pytest.raises(CommunicatorAbortedError, match="was aborted"):
        group._issuer.issue(call)
    assert group.later == ["all_reduce"] and len(launched(group)) == before


def test_a_nonblocking_communicator_takes_one_frame(make):
    group = warmed(make(nonblocking=True))
    assert group._cuda.comm.nonblocking
    assert one_frame(group)
    assert one_frame(group, lambda: call_of(group, "reduce_scatter", opts=opts_of("reduce_scatter", async_op=True)))


@pytest.mark.parametrize("setting", [{"check_collectives": True}, {"blocking_wait": True}])
def test_a_checked_or_blocking_wait_group_takes_one_frame(make, setting):
    group = warmed(make(**setting))
    assert one_frame(group)
    work, later, batches = routed(group, lambda: call_of(group, "all_gather"))
    blocking = bool(setting.get("blocking_wait"))
    assert later == batches == [] and work._blocking_wait is blocking
    assert work.wait() and work.is_completed() is blocking  # a blocking wait waited on the host


def test_an_asynchronous_all_reduce_runs_on_the_communicators_stream_after_the_callers(make, cuda_standins):
    # the internal stream waits for the caller's, the tensor is held until the GPU is done,
    # and wait() makes the caller's stream wait for the call
    group = warmed(make())
    comm = group._cuda.comm
    comm.stream = 0x5eed  # its own stream, apart from the caller's (the stand-ins' is 0)
    tensor = torch.ones(4)
    earlier = group._issuer._order_event  # made by an earlier asynchronous call, if any
    recorded = earlier.records if earlier is not None else 0
    work, later, batches = routed(group, lambda: group.allreduce([tensor], all_reduce_opts(async_op=True)))
    assert later == batches == [] and launched(group)[-1][1][-1] == 0x5eed  # launched on it, in one frame
    order = group._issuer._order_event
    assert order is not None and order.records == recorded + 1  # recorded on the caller's stream first
    slot = work._in_flight()
    assert slot.stream == 0x5eed and held(slot.keepalive) == {id(tensor)} and work._async
    waits = sum(1 for _, name, _ in cuda_standins.calls if name == "cudaStreamWaitEvent")
    assert work.wait() and work.result() == [tensor]
    assert sum(1 for _, name, _ in cuda_standins.calls if name == "cudaStreamWaitEvent") == waits + 1


@pytest.mark.parametrize("kind", ["broadcast", "all_gather", "reduce_scatter"])
def test_an_asynchronous_broadcast_or_fsdp_call_holds_its_tensors_on_the_communicators_stream(make, kind):
    group = warmed(make())
    comm = group._cuda.comm
    comm.stream = 0x5eed
    tensors = tensors_of(kind)
    work, later, batches = routed(group, lambda: call_of(group, kind, tensors, opts_of(kind, async_op=True)))
    assert later == batches == [] and launched(group)[-1][0] == nccl_call_of(kind, tensors)[0]
    assert launched(group)[-1][1][-1] == 0x5eed
    slot = work._in_flight()
    assert slot.stream == 0x5eed and held(slot.keepalive) == {id(t) for t in tensors} and work._async
    assert work.wait() and work.result() == [tensors[0]]


# -- bad input: a typed error, before anything is issued -------------------------------------


def nothing_issued(group, before: int) -> bool:
    return group.later == [] and group.batches == [] and len(launched(group)) == before \
        and not group._issuer.pending


def test_a_tensor_the_call_cannot_send_is_a_typed_error_before_anything_is_issued(make):
    group = warmed(make())
    before = forget(group)
    with pytest.raises(cupycoll.CupycollValueError, match="not contiguous"):
        group.allreduce([torch.ones(4, 2).t()], all_reduce_opts())
    with pytest.raises(cupycoll.CupycollValueError, match="not contiguous"):
        group.broadcast([torch.ones(4, 2).t()], opts_of("broadcast"))
    with pytest.raises(cupycoll.CupycollTypeError, match="NoneType"):
        group.allreduce([None], all_reduce_opts())
    with pytest.raises(cupycoll.CupycollTypeError, match="NoneType"):
        group.broadcast([None], opts_of("broadcast"))
    for root in (2, -1):  # no such rank in a group of 2
        with pytest.raises(cupycoll.CupycollValueError, match="root"):
            group.broadcast([torch.ones(4)], opts_of("broadcast", root=root))
    assert nothing_issued(group, before)
    assert group._trace.recorder.entries[-1][7] == "failed"  # the refused call's entry says so
    assert one_frame(group)  # the group stays usable, in one frame


def test_a_tensor_on_another_device_than_the_groups_is_a_typed_error(make, monkeypatch):
    group = warmed(make())
    before = forget(group)
    cuda = group._cuda
    monkeypatch.setattr(cuda, "_device_index", 3)  # what get_device() says of a tensor there
    monkeypatch.setattr(cuda, "_device_of", lambda tensor: torch.device("cuda", 3))
    for kind in KINDS:
        with pytest.raises(cupycoll.CupycollValueError, match="is on cuda:3 but this group's communicator is on"):
            call_of(group, kind)
    assert nothing_issued(group, before)


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter"])
def test_fsdps_calls_check_their_two_tensors_before_anything_is_issued(make, kind):
    group = warmed(make())
    before = forget(group)
    output, input = tensors_of(kind)
    for bad in ((output, torch.ones(6, 2).t()[0]), (torch.ones(6, 2).t()[0], input)):  # one not contiguous
        with pytest.raises(cupycoll.CupycollValueError, match="not contiguous"):
            call_of(group, kind, bad)
    with pytest.raises(cupycoll.CupycollValueError, match="numel|elements"):  # not one shard per rank
        call_of(group, kind, (torch.ones(output.numel() + 1), input))
    with pytest.raises(cupycoll.CupycollTypeError, match="dtype"):  # dtypes differ
        call_of(group, kind, (output, input.double()))
    with pytest.raises(cupycoll.CupycollTypeError, match="NoneType"):
        call_of(group, kind, (output, None))
    assert nothing_issued(group, before)
    assert one_frame(group, lambda: call_of(group, kind))  # the group stays usable, in one frame


class OnAnotherAccelerator(torch.Tensor):
    """A tensor of index 0 on an accelerator that is not CUDA (its get_device() says 0 too)."""

    @staticmethod
    def __new__(cls, size, device):
        return torch.Tensor._make_wrapper_subclass(cls, size, device=device, dtype=torch.float32)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(str(func))


@pytest.mark.parametrize("device", ["xpu:0", "privateuseone:0"])
def test_a_tensor_of_another_accelerator_never_takes_one_frame(make, monkeypatch, device):
    # the call names the device it does not support, and nothing reaches the issuer or NCCL
    group = warmed(make())
    cuda = group._cuda
    monkeypatch.setattr(cuda, "_tensors_are_cuda", True)  # as on cuda:0 (the stand-ins' CPU tensors stand in for none)
    monkeypatch.setattr(cuda, "_device_index", 0)
    other, whole = OnAnotherAccelerator((3,), device), OnAnotherAccelerator((6,), device)
    before = forget(group)
    calls = {"allreduce": lambda: group.allreduce([other], all_reduce_opts()),
             "broadcast": lambda: group.broadcast([other], opts_of("broadcast")),
             "allreduce_coalesced": lambda: group.allreduce_coalesced([other], coalesced_opts()),
             "all_gather": lambda: call_of(group, "all_gather", (whole, other)),
             "reduce_scatter": lambda: call_of(group, "reduce_scatter", (other, whole))}
    for name, call in calls.items():
        with pytest.raises(cupycoll.CupycollValueError, match=f"is on {device} but this group's communicator is on"):
            call()
    assert nothing_issued(group, before)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")
@pytest.mark.filterwarnings("ignore:Sparse CSC tensor support is in beta state")
@pytest.mark.parametrize("layout", ["sparse_csr", "sparse_csc"])
def test_a_compressed_sparse_tensor_is_a_typed_error_before_anything_is_issued(make, layout):
    # such a tensor has no strides: asking whether it is contiguous raises torch's own error
    group = warmed(make())
    dense = torch.eye(4)
    sparse = dense.to_sparse_csr() if layout == "sparse_csr" else dense.to_sparse_csc()
    before = forget(group)
    calls = {"allreduce": lambda: group.allreduce([sparse], all_reduce_opts()),
             "broadcast": lambda: group.broadcast([sparse], opts_of("broadcast")),
             "allreduce_coalesced": lambda: group.allreduce_coalesced([sparse], coalesced_opts()),
             "all_gather": lambda: call_of(group, "all_gather", (torch.ones(32), sparse)),
             "reduce_scatter": lambda: call_of(group, "reduce_scatter", (sparse, torch.ones(32)))}
    for name, call in calls.items():
        with pytest.raises(cupycoll.CupycollTypeError, match=f"torch.{layout} tensor"):
            call()
    assert nothing_issued(group, before)
    assert one_frame(group)  # the group stays usable, in one frame


# -- torch's allreduce_coalesced -------------------------------------------------------------


def coalesced_opts(op=dist.ReduceOp.SUM, async_op=False):
    opts = c10d.AllreduceCoalescedOptions()
    opts.reduceOp = op
    return asking(opts, async_op)


def test_coalesced_all_reduces_as_one_call_do_what_their_parts_do_one_by_one(make):
    # one frame (the block torch's manager opens ends as that one call), the queue's way, and
    # the parts one by one in a block (what the mismatch check makes of them): alike
    framed, queued, parted = warmed(make()), through_later(warmed(make())), warmed(make(check_collectives=True))
    tensors = [torch.ones(4), torch.ones(2, 3), torch.ones(5)]
    routes = []
    for group in (framed, queued, parted):
        group._cuda.comm._lib.calls.clear()
        forget(group)
        group._start_coalescing(CUDA)  # as torch's _coalescing_manager calls it
        assert group.allreduce_coalesced(tensors, coalesced_opts()) is None  # the block's Work covers it
        work = group._end_coalescing(CUDA)
        routes.append((list(group.later), list(group.batches)))
        assert work.wait() and work.exception() is None and work.result() == tensors
    assert routes == [(["all_reduce_coalesced"], []),  # queued in the block, then issued in one frame
                      (["all_reduce_coalesced"] * 2, [["all_reduce_coalesced"]]),
                      (["all_reduce"] * 3, [["all_reduce"] * 3])]
    made = [launched(group) for group in (framed, queued, parted)]
    assert made[0] == made[1] == made[2]
    assert [name for name, _ in made[0]] == ["ncclGroupStart"] + ["ncclAllReduce"] * 3 + ["ncclGroupEnd"]
    assert [args[:5] for name, args in made[0][1:4]] == [(t.data_ptr(), t.data_ptr(), t.numel(), DTYPE_FLOAT, OP_SUM)
                                                        for t in tensors]
    entries = [[e[2:8] for e in list(group._trace.recorder.entries)[-3:]] for group in (framed, queued, parted)]
    assert entries[0] == entries[1] == entries[2]
    assert [e[0] for e in entries[0]] == ["all_reduce"] * 3 and {e[5] for e in entries[0]} == {"issued"}
    for group in (framed, queued, parted):
        assert group._cuda.watch.in_flight() == 2  # the warm-up's batch and the block's: one slot each


@pytest.mark.parametrize("async_op", [False, True])
def test_the_work_a_block_of_one_call_handed_out_answers_for_that_call_once_issued(make, async_op):
    # The block's end issues its one call in one frame: the Work its caller got inside the
    # block is that call's, in flight until its event fires, failed when the group aborts.
    group = warmed(make())
    group.later.clear(), group.batches.clear()
    group._start_coalescing(CUDA)
    inner = group.allreduce([torch.ones(4)], all_reduce_opts(async_op=async_op))
    outer = group._end_coalescing(CUDA)
    assert group.later == ["all_reduce"] and group.batches == []  # queued in the block, then one frame
    assert outer is inner and inner._in_flight() is not None and not inner.is_completed()
    group.abort()
    assert inner.is_completed() and inner.exception() is not None


def test_coalesced_parts_outside_a_block_are_one_call_in_one_frame_with_one_work(make):
    group = warmed(make())
    tensors = [torch.ones(3), torch.ones(3)]
    before = len(launched(group))
    work, later, batches = routed(group, lambda: group.allreduce_coalesced(tensors, coalesced_opts()))
    assert later == batches == []
    assert work.wait() and work.result() == tensors
    assert [name for name, _ in launched(group)[before:]] == [
        "ncclGroupStart", "ncclAllReduce", "ncclAllReduce", "ncclGroupEnd"]
    entries = list(group._trace.recorder.entries)[-2:]  # one per part (recorder.record_parts)
    assert [e[2] for e in entries] == ["all_reduce"] * 2 and work._in_flight().records == tuple(entries)


def test_coalesced_parts_go_one_by_one_in_a_block_when_one_part_needs_a_call_of_its_own(make):
    group = warmed(make())

    def parts(tensors, opts=None):
        """(the ops through Issuer._later, the batches): one call, or the parts one by one."""
        work, later, batches = routed(group, lambda: group.allreduce_coalesced(
            tensors, coalesced_opts() if opts is None else opts))
        assert work.wait()
        return later, batches
    assert parts([torch.ones(4), torch.ones(2)]) == ([], [])  # one call, in one frame
    # a dtype or op not seen before: its plan made for the call, still one call
    assert parts([torch.ones(4), torch.ones(4, dtype=torch.float64)], coalesced_opts(dist.ReduceOp.MAX)) == ([], [])
    with cupycoll.algorithm("ring"):  # each part an algorithm's call: one batch of the parts
        assert parts([torch.ones(4), torch.ones(2)]) == (["all_reduce"] * 2, [["all_reduce"] * 2])
    with cupycoll.algorithm("nccl"):  # any override: part by part; a block of one part ends in one frame
        assert parts([torch.ones(4)]) == (["all_reduce"], [])
    with pytest.raises(cupycoll.CupycollValueError, match="not contiguous"):  # the part the check refuses, named
        group.allreduce_coalesced([torch.ones(4), torch.ones(4, 2).t()], coalesced_opts())
    assert group._issuer.block is None and not group._issuer.pending  # the block abandoned
    assert parts([torch.ones(4), torch.ones(2)]) == ([], [])


def test_coalesced_parts_on_an_ended_group_say_why(make):
    group = warmed(make())
    group.abort()
    with pytest.raises(CommunicatorAbortedError, match="was aborted"):
        group.allreduce_coalesced([torch.ones(4)], coalesced_opts())


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
    framed, general = cpu_group(), cpu_group()
    general._all_reduce_on_cpu = lambda tensor, tensors, opts: None  # the same call, the general way
    works = []
    for group in (framed, general):
        tensors, opts = [torch.full((3,), 2.0)], all_reduce_opts(async_op=True)
        work = group.allreduce(tensors, opts)
        works.append(work)
        assert work.wait() and torch.equal(tensors[0], torch.full((3,), 2.0))  # one rank: the sum is itself
        [(name, args)] = group._cpu.calls  # the caller's own list and options, handed on
        assert name == "allreduce" and args[0] is tensors and args[1] is opts
    assert [type(work) for work in works][0] is type(works[1]) and works[0].is_completed()
    entries = [group._trace.recorder.entries[-1] for group in (framed, general)]
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
    group._issuer.open_block()  # a CUDA block open: the general path refuses CPU tensors in it
    assert not cpu_taken(group)
    with pytest.raises(cupycoll.CupycollValueError, match="CPU tensors inside a coalescing block"):
        group.allreduce([torch.ones(4)], all_reduce_opts())
    group._issuer.close_block()
    assert cpu_taken(group)
    group._issuer.pending.append(None)  # a CUDA send queued: the general path issues it first
    assert not cpu_taken(group)
    group._issuer.pending.clear()
    integers = torch.ones(4, dtype=torch.int64)
    assert not cpu_taken(group, integers, all_reduce_opts(dist.ReduceOp.AVG))  # gloo cannot average integers
    assert cpu_taken(group, integers)


def test_a_cpu_all_reduce_takes_its_frame_and_never_reaches_the_cuda_issuer(cpu_group, monkeypatch):
    group = cpu_group()
    taken = []
    on_cpu = group._all_reduce_on_cpu
    monkeypatch.setattr(group, "_all_reduce_on_cpu", lambda *args: taken.append(args[0]) or on_cpu(*args))
    spy(group)
    tensor = torch.ones(2)
    assert group.allreduce([tensor], all_reduce_opts()).wait() and taken == [tensor]
    assert group.later == group.batches == [] and group._cpu.calls[-1][0] == "allreduce"


def test_the_mismatch_check_keeps_the_cpu_all_reduce_on_the_general_path(cpu_group):
    assert not cpu_taken(cpu_group(check_collectives=True))


def test_a_cpu_all_reduce_on_an_ended_group_says_why(cpu_group):
    group = cpu_group()
    group.abort()
    assert not cpu_taken(group)
    with pytest.raises(CommunicatorAbortedError, match="was aborted"):
        group.allreduce([torch.ones(4)], all_reduce_opts())
