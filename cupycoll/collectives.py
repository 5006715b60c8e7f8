"""Each collective's CUDA body: check the arguments, choose NCCL or one of cupycoll's
algorithms (:mod:`cupycoll.algorithms`, the choice made once, in the plan), and describe the
call as an :class:`~cupycoll.issue.Call`: its NCCL calls (C function and arguments) where it
is only that, else the ``run(comm, stream)`` that makes them (and the ``prepare(comm)`` that
does the fallible Python steps before the NCCL group opens, the ``finish()`` after it).

Every function takes the group's :class:`~cupycoll.backend.CudaBackend` and the torch
arguments as the ProcessGroup method got them (already routed to CUDA), and returns the
call's description for the group's :class:`~cupycoll.issue.Issuer`. Calls take raw pointers
captured here, so a queued call launches later exactly what was checked now, and the call's
``keep`` holds every tensor they point into (a PREMUL_SUM factor tensor too); collectives that
only move data move bytes (``ncclUint8``). A reduction's plan is looked up once per dtype and
op in the backend's cache (the group's algorithm fixed, no override in force).

Deliberately left out: routing CPU tensors to gloo and torch's coalescing protocol (the
group's), when and on which stream a call is issued (the issuer's), and the dtype/op tables
(:mod:`cupycoll._args`).
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from . import _args, algorithms, compat
from ._args import NCCL_BYTE, AlgorithmReduction, nbytes
from .errors import CupycollValueError
from .issue import Call
from .trace.recorder import E_ROUTE

_async_requested = compat.async_requested
_STRIDED = torch.strided
_PREMUL_SUM = torch.distributed.ReduceOp.RedOpType.PREMUL_SUM
# The algorithm override in force (cupycoll.algorithm(), process-wide): while one is, a
# reduction's plan is made anew (the backend's cache holds the group's own choice).
_OVERRIDES = algorithms.OVERRIDES


def _on_device(backend, tensor: torch.Tensor, what: str, other: Optional[torch.Tensor] = None,
               other_what: str = "") -> torch.device:
    """``tensor``'s device, checked (and ``other``'s, when given): dense, contiguous tensors
    on the group's device (the common case in a few attribute reads), else
    :meth:`CudaBackend.check_device`, which names what is wrong (or, before the group has a
    device, gives the tensor's)."""
    device = backend.device
    if device is not None:
        cuda, index = backend._tensors_are_cuda, backend._device_index
        for t in (tensor,) if other is None else (tensor, other):
            if not (t.is_cuda is cuda and t.layout is _STRIDED and t.get_device() == index and t.is_contiguous()):
                break
        else:
            return device
    device = backend.check_device(tensor, what)
    if other is not None:
        backend.check_device(other, other_what)
    return device


def _reduction(backend, tensor: torch.Tensor, reduce_op):
    """The plan of reducing ``tensor`` with ``reduce_op``, made now, and kept in the backend's
    cache when it holds for every such call (no PREMUL factor, no override in force). Each
    reduction looks in that cache itself first (``None if _OVERRIDES else
    backend.plans.get((dtype, opts.reduceOp))``): the hot calls do so without a call. The key
    is torch's ReduceOp itself, which hashes and compares by its kind (a PREMUL_SUM is never kept)."""
    plan = _plan(backend, tensor, reduce_op)
    kind = _args.op_type(reduce_op)
    if not _OVERRIDES and kind != _PREMUL_SUM:  # a factor is per call
        backend.plans[tensor.dtype, reduce_op] = plan
    return plan


def _plan(backend, tensor: torch.Tensor, reduce_op):
    """NCCL or an algorithm for this reduction (the per-call override beats the group's option)."""
    algorithm = algorithms.override() or backend.settings.algorithm
    return _args.reduction_plan(tensor, reduce_op, algorithm, backend.size)


def _algorithm_launch(backend, plan: AlgorithmReduction, method: str, send_ptr, recv_ptr, count,
                      staged=None) -> Callable:
    """The run(comm, stream) of an algorithm's call; ``staged``: a one-item list whose
    tensor is the send buffer, made by the call's prepare (then ``send_ptr`` is unused)."""
    def launch(comm, stream):
        send = staged[0].data_ptr() if staged is not None else send_ptr
        getattr(backend.runner(plan.algorithm, comm), method)(
            send, recv_ptr, count, plan.dtype, plan.op, stream, premul=plan.premul, premul_ptr=plan.premul_ptr)
    return launch


def _algorithm_prepare(backend, plan: AlgorithmReduction, method: str, count) -> Callable:
    """The prepare(comm) of an algorithm's call: its scratch and kernels, before any launch
    (once a launch has begun, a failure faults the group)."""
    return lambda comm: backend.runner(plan.algorithm, comm).prepare(method, count, plan.dtype, plan.op)


def _premul_launch(red: _args.Reduction, dtype: torch.dtype,
                   call: Callable) -> Tuple[Callable, Callable]:
    """``(run, prepare)`` of a PREMUL_SUM: the prepare(comm) that creates the op before the
    NCCL group opens (it can fail: NCCL < 2.11, a bad factor), and a run(comm, stream) that
    runs ``call(comm, nccl_op, stream)`` with it, then destroys it. An op whose batch fails in
    a later prepare is never launched, and freed with its communicator."""
    factor, made = red.premul_factor, []

    def prepare(comm):
        if isinstance(factor, torch.Tensor):
            made.append(comm.create_premul_sum(factor.data_ptr(), red.dtype, on_device=True))
        else:
            made.append(comm.create_premul_sum(_args.premul_scalar_bytes(factor, dtype), red.dtype,
                                               on_device=False))

    def launch(comm, stream):
        op = made.pop()
        try:
            call(comm, op, stream)
        finally:
            # An aborted communicator took its ops with it (its comm_ptr is 0): destroying
            # would fail with ncclInvalidArgument and hide the real error, the abort's.
            if comm.state == "ok":
                comm.destroy_op(op)
    return launch, prepare


def _both(first: Optional[Callable], second: Optional[Callable]) -> Callable:
    """One prepare(comm) running ``first`` then ``second`` (either may be None)."""
    if first is None or second is None:
        return first or second

    def prepare(comm):
        first(comm)
        second(comm)
    return prepare


def _check_many(backend, tensors, reference: torch.Tensor, what: str) -> None:
    """A list with one tensor per rank, each like ``reference`` (device, numel, dtype)."""
    for index, tensor in enumerate(tensors):
        backend.check_device(tensor, f"{what}[{index}]")
        _args.check_numel(tensor, reference.numel(), f"{what}[{index}]")
    _args.check_same_dtype(tensors, reference, what)


def _reduction_call(backend, op: str, device, outputs, keep, opts, entry, plan, reduced: torch.Tensor,
                    function: str, buffers: tuple, count: int, method: str, staged=None, stage=None) -> Call:
    """The call of a reduction of ``count`` elements of ``reduced`` by ``plan``: NCCL's
    ``function`` on ``buffers`` (send, receive), one of cupycoll's algorithms (its ``method``),
    or NCCL with a PREMUL_SUM op made first. ``stage``: a prepare that makes the send buffer
    (into ``staged``), before the plan's own."""
    described = dict(op=op, device=device, outputs=outputs, async_op=_async_requested(opts), entry=entry)
    if isinstance(plan, AlgorithmReduction):
        if entry is not None:
            entry[E_ROUTE] = plan.algorithm  # the flight recorder names the algorithm that ran it
        return Call(**described, keep=(keep, _args.factor_tensor(plan)), algorithm=plan.algorithm,
                    run=_algorithm_launch(backend, plan, method, *buffers, count, staged=staged),
                    prepare=_both(stage, _algorithm_prepare(backend, plan, method, count)))
    scaled = count * plan.count_scale
    if plan.premul_factor is None and stage is None:
        return Call(**described, keep=keep, calls=((function, (*buffers, scaled, plan.dtype, plan.op)),))
    send, recv = buffers

    def call(comm, nccl_op, stream):
        source = staged[0].data_ptr() if staged is not None else send
        comm.launch(((function, (source, recv, scaled, plan.dtype, nccl_op)),), stream)
    if plan.premul_factor is None:
        return Call(**described, keep=keep, run=lambda comm, stream: call(comm, plan.op, stream), prepare=stage)
    run, premul = _premul_launch(plan, reduced.dtype, call)
    return Call(**described, keep=(keep, _args.factor_tensor(plan)), run=run, prepare=_both(stage, premul))


def all_reduce(backend, tensors, opts, entry=None) -> Call:
    tensor = tensors[0] if type(tensors) is list and len(tensors) == 1 else _args.single(tensors, "all_reduce")
    device = _on_device(backend, tensor, "all_reduce tensor")
    plan = None if _OVERRIDES else backend.plans.get((tensor.dtype, opts.reduceOp))
    if plan is None:
        plan = _reduction(backend, tensor, opts.reduceOp)
    ptr = tensor.data_ptr()
    if type(plan) is _args.Reduction and plan.premul_factor is None:  # the common call, in a few lines
        return Call(op="all_reduce", device=device, outputs=[tensor], keep=tensor, async_op=_async_requested(opts),
                    entry=entry, calls=(("ncclAllReduce", (ptr, ptr, tensor.numel() * plan.count_scale, plan.dtype,
                                                           plan.op)),))
    return _reduction_call(backend, "all_reduce", device, [tensor], tensor, opts, entry, plan, tensor,
                           "ncclAllReduce", (ptr, ptr), tensor.numel(), "all_reduce")


def all_reduce_coalesced(backend, tensors, opts) -> Optional[Call]:
    """The all_reduces of one ``allreduce_coalesced`` as one call of one NCCL call each,
    launched in one NCCL group; None when a part needs a call of its own (an algorithm, a
    PREMUL_SUM op, a tensor the check refuses): the group then issues them one by one in a
    block, which names what is wrong."""
    index, cuda, plans, kind = backend._device_index, backend._tensors_are_cuda, backend.plans, opts.reduceOp
    if backend.device is None or _OVERRIDES or not tensors:
        return None
    calls = []
    for tensor in tensors:
        if not (tensor.is_cuda is cuda and tensor.layout is _STRIDED and tensor.get_device() == index
                and tensor.is_contiguous()):
            return None
        plan = plans.get((tensor.dtype, kind))
        if plan is None:
            plan = _reduction(backend, tensor, opts.reduceOp)
            if type(plan) is not _args.Reduction or plan.premul_factor is not None:
                return None
        ptr = tensor.data_ptr()
        calls.append(("ncclAllReduce", (ptr, ptr, tensor.numel() * plan.count_scale, plan.dtype, plan.op)))
    return Call(op="all_reduce_coalesced", device=backend.device, outputs=list(tensors), keep=tuple(tensors),
                async_op=_async_requested(opts), entry=None, calls=calls)


def broadcast(backend, tensors, opts, entry=None) -> Call:
    tensor = tensors[0] if type(tensors) is list and len(tensors) == 1 else _args.single(tensors, "broadcast")
    device = _on_device(backend, tensor, "broadcast tensor")
    root = opts.rootRank
    if type(root) is not int or not 0 <= root < backend.size:
        root = _args.check_root(root, backend.size)
    ptr = tensor.data_ptr()
    return Call(op="broadcast", device=device, outputs=[tensor], keep=tensor, async_op=_async_requested(opts),
                entry=entry,
                calls=(("ncclBroadcast", (ptr, ptr, tensor.numel() * tensor.element_size(), NCCL_BYTE, root)),))


def reduce(backend, tensors, opts, entry=None) -> Call:
    tensor = _args.single(tensors, "reduce")
    device = backend.check_device(tensor, "reduce tensor")
    root = _args.check_root(opts.rootRank, backend.size)
    red = _args.reduction_plan(tensor, opts.reduceOp, "nccl", backend.size)  # no algorithm has a reduce
    ptr, count = tensor.data_ptr(), tensor.numel() * red.count_scale
    if red.premul_factor is None:
        return Call(op="reduce", device=device, outputs=[tensor], keep=tensor, async_op=_async_requested(opts),
                    entry=entry, calls=(("ncclReduce", (ptr, ptr, count, red.dtype, red.op, root)),))
    run, prepare = _premul_launch(red, tensor.dtype, lambda comm, op, s: comm.launch(
        (("ncclReduce", (ptr, ptr, count, red.dtype, op, root)),), s))
    return Call(op="reduce", device=device, outputs=[tensor], keep=(tensor, _args.factor_tensor(red)),
                async_op=_async_requested(opts), entry=entry, run=run, prepare=prepare)


def all_gather(backend, output_tensors, input_tensors, opts, entry=None, op_name: str = "all_gather") -> Call:
    tensor = _args.single(input_tensors, f"{op_name} input")
    outputs = _args.check_list(_args.single_list(output_tensors, f"{op_name} output"), f"{op_name} output",
                               backend.size)
    device = backend.check_device(tensor, f"{op_name} input")
    _check_many(backend, outputs, tensor, f"{op_name} output")
    size, numel = nbytes(tensor), tensor.numel()
    if all(t.data_ptr() == outputs[0].data_ptr() + i * size for i, t in enumerate(outputs)):
        # the outputs are consecutive slices of one buffer: gather straight into it
        return Call(op=op_name, device=device, outputs=outputs, keep=(tensor, outputs),
                    async_op=_async_requested(opts), entry=entry,
                    calls=(("ncclAllGather", (tensor.data_ptr(), outputs[0].data_ptr(), size, NCCL_BYTE)),))
    staging = []

    def prepare(comm):  # before the NCCL group: an OOM here launches nothing
        staging.append(torch.empty(backend.size * numel, dtype=tensor.dtype, device=device))

    def run(comm, s):
        comm.launch((("ncclAllGather", (tensor.data_ptr(), staging[-1].data_ptr(), size, NCCL_BYTE)),), s)

    def finish():
        flat = staging.pop()
        for index, out in enumerate(outputs):
            out.copy_(flat[index * numel:(index + 1) * numel].view_as(out))
    return Call(op=op_name, device=device, outputs=outputs, keep=(tensor, outputs), async_op=_async_requested(opts),
                entry=entry, run=run, prepare=prepare, finish=finish)


def _check_flat_pair(backend, shard, shard_what: str, whole, whole_what: str):
    """The one-tensor gather/scatter forms: both tensors on the group's device (the shard's is
    returned), ``whole`` one ``shard`` per rank, in the shard's dtype. ``*_what``: each
    tensor's name in an error (constants: nothing is formatted for a call that is right)."""
    device = _on_device(backend, shard, shard_what, whole, whole_what)
    if whole.numel() != shard.numel() * backend.size:
        _args.check_numel(whole, shard.numel() * backend.size, whole_what)
    if whole.dtype != shard.dtype:
        _args.check_same_dtype([whole], shard, whole_what)
    return device


def all_gather_into_tensor(backend, output, input, opts, entry=None) -> Call:
    what = "all_gather_into_tensor"
    device = _check_flat_pair(backend, input, "all_gather_into_tensor input", output, "all_gather_into_tensor output")
    size = input.numel() * input.element_size()
    return Call(op=what, device=device, outputs=[output], keep=(input, output), async_op=_async_requested(opts),
                entry=entry, calls=(("ncclAllGather", (input.data_ptr(), output.data_ptr(), size, NCCL_BYTE)),))


def reduce_scatter(backend, output_tensors, input_tensors, opts, entry=None) -> Call:
    output = _args.single(output_tensors, "reduce_scatter output")
    inputs = _args.check_list(_args.single_list(input_tensors, "reduce_scatter input"),
                              "reduce_scatter input", backend.size)
    device = backend.check_device(output, "reduce_scatter output")
    _check_many(backend, inputs, output, "reduce_scatter input")
    plan = None if _OVERRIDES else backend.plans.get((output.dtype, opts.reduceOp))
    if plan is None:
        plan = _reduction(backend, output, opts.reduceOp)
    staged = [None]  # the inputs side by side, made when the call is issued

    def stage(comm):  # a prepare: before the NCCL group, an OOM here launches nothing
        staged[0] = torch.cat([t.reshape(-1) for t in inputs])

    return _reduction_call(backend, "reduce_scatter", device, [output], (output, inputs, staged), opts, entry,
                           plan, output, "ncclReduceScatter", (None, output.data_ptr()), output.numel(),
                           "reduce_scatter", staged=staged, stage=stage)


def reduce_scatter_tensor(backend, output, input, opts, entry=None) -> Call:
    what = "reduce_scatter_tensor"
    device = _check_flat_pair(backend, output, "reduce_scatter_tensor output", input, "reduce_scatter_tensor input")
    plan = None if _OVERRIDES else backend.plans.get((output.dtype, opts.reduceOp))
    if plan is None:
        plan = _reduction(backend, output, opts.reduceOp)
    buffers = (input.data_ptr(), output.data_ptr())
    if type(plan) is _args.Reduction and plan.premul_factor is None:  # FSDP's call, in a few lines
        count = output.numel() * plan.count_scale
        return Call(op=what, device=device, outputs=[output], keep=(input, output), async_op=_async_requested(opts),
                    entry=entry, calls=(("ncclReduceScatter", (*buffers, count, plan.dtype, plan.op)),))
    return _reduction_call(backend, what, device, [output], (input, output), opts, entry, plan, output,
                           "ncclReduceScatter", buffers, output.numel(), "reduce_scatter")


def all_to_all(backend, output_tensors, input_tensors, opts, entry=None) -> Call:
    outputs = _args.check_list(output_tensors, "all_to_all output", backend.size)
    inputs = _args.check_list(input_tensors, "all_to_all input", backend.size)
    device = backend.check_device(inputs[0], "all_to_all input[0]")
    for name, tensors in (("output", outputs), ("input", inputs)):
        for index, tensor in enumerate(tensors):
            backend.check_device(tensor, f"all_to_all {name}[{index}]")
    _args.check_same_dtype(outputs + inputs, inputs[0], "all_to_all")
    send = [(i.data_ptr(), nbytes(i)) for i in inputs]
    recv = [(o.data_ptr(), nbytes(o)) for o in outputs]
    return Call(op="all_to_all", device=device, outputs=outputs, keep=(inputs, outputs),
                async_op=_async_requested(opts), entry=entry, calls=_exchange_with_all(send, recv))


def all_to_all_single(backend, output, input, output_split_sizes, input_split_sizes, opts, entry=None) -> Call:
    device = backend.check_device(input, "all_to_all_single input")
    backend.check_device(output, "all_to_all_single output")
    _args.check_same_dtype([output], input, "all_to_all_single output")
    in_ptr, out_ptr = input.data_ptr(), output.data_ptr()
    send = [(in_ptr + offset, size)
            for offset, size in _args.split_bytes(input, input_split_sizes, backend.size, "input")]
    recv = [(out_ptr + offset, size)
            for offset, size in _args.split_bytes(output, output_split_sizes, backend.size, "output")]
    return Call(op="all_to_all_single", device=device, outputs=[output], keep=(input, output),
                async_op=_async_requested(opts), entry=entry, calls=_exchange_with_all(send, recv))


def _exchange_with_all(send, recv) -> list:
    """The NCCL calls sending ``send[peer]`` to and receiving ``recv[peer]`` from every peer
    ((ptr, bytes) each), which launch in one NCCL group."""
    calls = []
    for peer, ((send_ptr, send_bytes), (recv_ptr, recv_bytes)) in enumerate(zip(send, recv)):
        calls.append(("ncclSend", (send_ptr, send_bytes, NCCL_BYTE, peer)))
        calls.append(("ncclRecv", (recv_ptr, recv_bytes, NCCL_BYTE, peer)))
    return calls


def gather(backend, output_tensors, input_tensors, opts, entry=None) -> Call:
    return _rooted(backend, "gather", input_tensors, output_tensors, opts, to_root=True, entry=entry)


def scatter(backend, output_tensors, input_tensors, opts, entry=None) -> Call:
    return _rooted(backend, "scatter", output_tensors, input_tensors, opts, to_root=False, entry=entry)


def _rooted(backend, op_name: str, own_tensors, root_lists, opts, to_root: bool, entry=None) -> Call:
    """gather (``to_root``: every rank sends its tensor to the root, which receives one per
    rank) or scatter (the root sends one per rank, every rank receives its tensor)."""
    own, many = ("input", "output") if to_root else ("output", "input")
    root = _args.check_root(opts.rootRank, backend.size)
    tensor = _args.single(own_tensors, f"{op_name} {own}")
    device = backend.check_device(tensor, f"{op_name} {own}")
    if backend.rank == root:
        tensors = _args.check_list(_args.single_list(root_lists, f"{op_name} {many}"), f"{op_name} {many}",
                                   backend.size)
        _check_many(backend, tensors, tensor, f"{op_name} {many}")
        chunks = [(t.data_ptr(), nbytes(t)) for t in tensors]
    else:
        if root_lists and any(len(lst) for lst in root_lists):
            raise CupycollValueError(
                f"{op_name}: rank {backend.rank} is not the root ({root}) and must pass no {many}s")
        tensors, chunks = [], []
    many_way, own_way = ("ncclRecv", "ncclSend") if to_root else ("ncclSend", "ncclRecv")
    calls = [(many_way, (chunk_ptr, chunk_bytes, NCCL_BYTE, peer)) for peer, (chunk_ptr, chunk_bytes) in
             enumerate(chunks)]
    calls.append((own_way, (tensor.data_ptr(), nbytes(tensor), NCCL_BYTE, root)))
    outputs = tensors if to_root else [tensor]
    return Call(op=op_name, device=device, outputs=outputs, keep=(tensor, tensors), async_op=_async_requested(opts),
                entry=entry, calls=calls)


def point_to_point(backend, op_name: str, tensors, peer: int, batched: bool = False, entry=None) -> Call:
    """send or recv: queued until the batch is issued (see cupycoll.issue); ``batched``: one
    of a batch torch made (``batch_isend_irecv``), run on the group's communicator."""
    tensor = _args.single(tensors, op_name)
    device = backend.check_device(tensor, f"{op_name} tensor")
    peer = _args.check_peer(peer, backend.rank, backend.size)
    ptr, size = tensor.data_ptr(), nbytes(tensor)
    function = "ncclSend" if op_name == "send" else "ncclRecv"

    def run(comm, s, comm_peer):
        comm.launch(((function, (ptr, size, NCCL_BYTE, comm_peer)),), s)
    return Call(op=op_name, device=device, outputs=[tensor], keep=tensor, async_op=True, entry=entry, run=run,
                peer=peer, on_group=batched)


def barrier(backend, device: torch.device, entry=None) -> Call:
    """Like ProcessGroupNCCL: a one-byte all-reduce whose wait() blocks the CPU."""
    backend.check_usable()  # the group's routing checks are skipped for barrier(device_ids)
    device = backend.device or device
    token = torch.zeros(1, dtype=torch.uint8, device=device)
    ptr = token.data_ptr()
    return Call(op="barrier", device=device, outputs=[token], keep=token, async_op=True, entry=entry,
                calls=(("ncclAllReduce", (ptr, ptr, 1, NCCL_BYTE, 0)),), blocking_wait=True)
