"""Each collective's CUDA body: check the arguments, choose NCCL or one of cupycoll's
algorithms (:mod:`cupycoll.algorithms`, the choice made once, in the plan), build the
``launch(comm, stream)`` that makes the NCCL calls (and the ``prepare(comm)`` that does the
fallible Python steps before the NCCL group opens), and submit it to the backend.

Every function takes the group's :class:`~cupycoll.backend.CudaBackend` and the torch
arguments as the ProcessGroup method got them (already routed to CUDA), and returns the
call's :class:`~cupycoll.work.CudaWork`. Launches take raw pointers captured here, so a
queued call launches later exactly what was checked now, and the call's keepalive holds every
tensor they point into (a PREMUL_SUM factor tensor too); collectives that only move data
move bytes (``ncclUint8``).

Deliberately left out: routing CPU tensors to gloo and torch's coalescing protocol (the
group's), when and on which stream a launch runs (the backend's), and the dtype/op tables
(:mod:`cupycoll._args`).
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from . import _args, compat, config
from ._args import NCCL_BYTE, AlgorithmReduction, nbytes
from .errors import CupycollValueError
from .work import CudaWork

_async_requested = compat.async_requested


def _plan(backend, tensor: torch.Tensor, reduce_op):
    """NCCL or an algorithm for this reduction (the per-call override beats the group's option)."""
    algorithm = config.algorithm_override() or backend.settings.algorithm
    return _args.reduction_plan(tensor, reduce_op, algorithm, backend.size)


def _algorithm_launch(backend, plan: AlgorithmReduction, method: str, send_ptr, recv_ptr, count,
                      staged=None) -> Callable:
    """The launch(comm, stream) of an algorithm's call; ``staged``: a one-item list whose
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


def _reduce_launch(red: _args.Reduction, dtype: torch.dtype,
                   call: Callable) -> Tuple[Callable, Optional[Callable]]:
    """``(launch, prepare)``: a launch(comm, stream) that runs ``call(comm, nccl_op, stream)``
    with the NCCL op, and for PREMUL_SUM the prepare(comm) that creates the op before the
    NCCL group opens (it can fail: NCCL < 2.11, a bad factor); launch destroys it. An op
    whose batch fails in a later prepare is never launched, and freed with its communicator."""
    if red.premul_factor is None:
        return (lambda comm, stream: call(comm, red.op, stream)), None
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


def _grouped(launch: Callable) -> Callable:
    """Several NCCL calls that must run as one NCCL group even when issued alone."""
    def grouped(comm, stream):
        with comm.group():
            launch(comm, stream)
    return grouped


def _check_many(backend, tensors, reference: torch.Tensor, what: str) -> None:
    """A list with one tensor per rank, each like ``reference`` (device, numel, dtype)."""
    for index, tensor in enumerate(tensors):
        backend.check_device(tensor, f"{what}[{index}]")
        _args.check_numel(tensor, reference.numel(), f"{what}[{index}]")
    _args.check_same_dtype(tensors, reference, what)


def all_reduce(backend, tensors, opts, entry=None) -> CudaWork:
    tensor = _args.single(tensors, "all_reduce")
    device = backend.check_device(tensor, "all_reduce tensor")
    plan = _plan(backend, tensor, opts.reduceOp)
    ptr = tensor.data_ptr()
    if isinstance(plan, AlgorithmReduction):
        return backend.submit("all_reduce", device, [tensor],
                           _algorithm_launch(backend, plan, "all_reduce", ptr, ptr, tensor.numel()),
                           keepalive=(tensor, _args.factor_tensor(plan)), async_op=_async_requested(opts),
                           algorithm=plan.algorithm,
                           prepare=_algorithm_prepare(backend, plan, "all_reduce", tensor.numel()), entry=entry)
    count = tensor.numel() * plan.count_scale
    if plan.premul_factor is None:  # one NCCL call, no op to make first
        if config.algorithm_override() is None:  # the group's own choice: the fast path may reuse it
            backend.learn_plan(tensor.dtype, _args.op_type(opts.reduceOp), plan)
        dtype, op = plan.dtype, plan.op
        return backend.submit("all_reduce", device, [tensor],
                              lambda comm, s: comm.all_reduce(ptr, ptr, count, dtype, op, s),
                              keepalive=tensor, async_op=_async_requested(opts), entry=entry)
    launch, prepare = _reduce_launch(plan, tensor.dtype,
                                     lambda comm, op, s: comm.all_reduce(ptr, ptr, count, plan.dtype, op, s))
    return backend.submit("all_reduce", device, [tensor], launch, keepalive=(tensor, _args.factor_tensor(plan)),
                       async_op=_async_requested(opts), prepare=prepare, entry=entry)


def broadcast(backend, tensors, opts, entry=None) -> CudaWork:
    tensor = _args.single(tensors, "broadcast")
    device = backend.check_device(tensor, "broadcast tensor")
    root = _args.check_root(opts.rootRank, backend.size)
    ptr, size = tensor.data_ptr(), nbytes(tensor)
    return backend.submit("broadcast", device, [tensor],
                       lambda comm, s: comm.broadcast(ptr, ptr, size, NCCL_BYTE, root, s),
                       keepalive=tensor, async_op=_async_requested(opts), entry=entry)


def reduce(backend, tensors, opts, entry=None) -> CudaWork:
    tensor = _args.single(tensors, "reduce")
    device = backend.check_device(tensor, "reduce tensor")
    root = _args.check_root(opts.rootRank, backend.size)
    red = _args.reduction_plan(tensor, opts.reduceOp, "nccl", backend.size)  # no algorithm has a reduce
    ptr, count = tensor.data_ptr(), tensor.numel() * red.count_scale
    launch, prepare = _reduce_launch(red, tensor.dtype,
                                     lambda comm, op, s: comm.reduce(ptr, ptr, count, red.dtype, op, root, s))
    return backend.submit("reduce", device, [tensor], launch, keepalive=(tensor, _args.factor_tensor(red)),
                       async_op=_async_requested(opts), prepare=prepare, entry=entry)


def all_gather(backend, output_tensors, input_tensors, opts, entry=None, op_name: str = "all_gather") -> CudaWork:
    tensor = _args.single(input_tensors, f"{op_name} input")
    outputs = _args.check_list(_args.single_list(output_tensors, f"{op_name} output"), f"{op_name} output",
                               backend.size)
    device = backend.check_device(tensor, f"{op_name} input")
    _check_many(backend, outputs, tensor, f"{op_name} output")
    size, numel = nbytes(tensor), tensor.numel()
    if all(t.data_ptr() == outputs[0].data_ptr() + i * size for i, t in enumerate(outputs)):
        # the outputs are consecutive slices of one buffer: gather straight into it
        in_ptr, out_ptr = tensor.data_ptr(), outputs[0].data_ptr()
        return backend.submit(op_name, device, outputs,
                           lambda comm, s: comm.all_gather(in_ptr, out_ptr, size, NCCL_BYTE, s),
                           keepalive=(tensor, outputs), async_op=_async_requested(opts), entry=entry)
    staging = []

    def prepare(comm):  # before the NCCL group: an OOM here launches nothing
        staging.append(torch.empty(backend.size * numel, dtype=tensor.dtype, device=device))

    def launch(comm, s):
        comm.all_gather(tensor.data_ptr(), staging[-1].data_ptr(), size, NCCL_BYTE, s)

    def finish():
        flat = staging.pop()
        for index, out in enumerate(outputs):
            out.copy_(flat[index * numel:(index + 1) * numel].view_as(out))
    return backend.submit(op_name, device, outputs, launch, finish, keepalive=(tensor, outputs),
                       async_op=_async_requested(opts), prepare=prepare, entry=entry)


def _check_flat_pair(backend, what: str, shard, shard_name: str, whole, whole_name: str):
    """The one-tensor gather/scatter forms: both tensors on the group's device (the shard's is
    returned), ``whole`` one ``shard`` per rank, in the shard's dtype."""
    device = backend.check_device(shard, f"{what} {shard_name}")
    backend.check_device(whole, f"{what} {whole_name}")
    _args.check_numel(whole, shard.numel() * backend.size, f"{what} {whole_name}")
    _args.check_same_dtype([whole], shard, f"{what} {whole_name}")
    return device


def all_gather_into_tensor(backend, output, input, opts, entry=None) -> CudaWork:
    what = "all_gather_into_tensor"
    device = _check_flat_pair(backend, what, input, "input", output, "output")
    size, in_ptr, out_ptr = nbytes(input), input.data_ptr(), output.data_ptr()
    return backend.submit(what, device, [output],
                       lambda comm, s: comm.all_gather(in_ptr, out_ptr, size, NCCL_BYTE, s),
                       keepalive=(input, output), async_op=_async_requested(opts), entry=entry)


def reduce_scatter(backend, output_tensors, input_tensors, opts, entry=None) -> CudaWork:
    output = _args.single(output_tensors, "reduce_scatter output")
    inputs = _args.check_list(_args.single_list(input_tensors, "reduce_scatter input"),
                              "reduce_scatter input", backend.size)
    device = backend.check_device(output, "reduce_scatter output")
    _check_many(backend, inputs, output, "reduce_scatter input")
    plan = _plan(backend, output, opts.reduceOp)
    staged = [None]  # the inputs side by side, made when the call is issued

    def stage(comm):  # a prepare: before the NCCL group, an OOM here launches nothing
        staged[0] = torch.cat([t.reshape(-1) for t in inputs])

    out_ptr, keep = output.data_ptr(), (output, inputs, staged, _args.factor_tensor(plan))
    if isinstance(plan, AlgorithmReduction):
        return backend.submit("reduce_scatter", device, [output],
                           _algorithm_launch(backend, plan, "reduce_scatter", None, out_ptr, output.numel(),
                                             staged=staged),
                           keepalive=keep, async_op=_async_requested(opts), algorithm=plan.algorithm,
                           prepare=_both(stage, _algorithm_prepare(backend, plan, "reduce_scatter",
                                                                   output.numel())), entry=entry)
    count = output.numel() * plan.count_scale
    launch, premul = _reduce_launch(plan, output.dtype, lambda comm, op, s: comm.reduce_scatter(
        staged[0].data_ptr(), out_ptr, count, plan.dtype, op, s))
    return backend.submit("reduce_scatter", device, [output], launch, keepalive=keep,
                       async_op=_async_requested(opts), prepare=_both(stage, premul), entry=entry)


def reduce_scatter_tensor(backend, output, input, opts, entry=None) -> CudaWork:
    what = "reduce_scatter_tensor"
    device = _check_flat_pair(backend, what, output, "output", input, "input")
    plan = _plan(backend, output, opts.reduceOp)
    in_ptr, out_ptr = input.data_ptr(), output.data_ptr()
    keep = (input, output, _args.factor_tensor(plan))
    if isinstance(plan, AlgorithmReduction):
        return backend.submit(what, device, [output],
                           _algorithm_launch(backend, plan, "reduce_scatter", in_ptr, out_ptr, output.numel()),
                           keepalive=keep, async_op=_async_requested(opts), algorithm=plan.algorithm,
                           prepare=_algorithm_prepare(backend, plan, "reduce_scatter", output.numel()), entry=entry)
    count = output.numel() * plan.count_scale
    if plan.premul_factor is None and config.algorithm_override() is None:
        backend.learn_plan(output.dtype, _args.op_type(opts.reduceOp), plan)  # the fast path's too
    launch, prepare = _reduce_launch(plan, output.dtype, lambda comm, op, s: comm.reduce_scatter(
        in_ptr, out_ptr, count, plan.dtype, op, s))
    return backend.submit(what, device, [output], launch, keepalive=keep,
                       async_op=_async_requested(opts), prepare=prepare, entry=entry)


def all_to_all(backend, output_tensors, input_tensors, opts, entry=None) -> CudaWork:
    outputs = _args.check_list(output_tensors, "all_to_all output", backend.size)
    inputs = _args.check_list(input_tensors, "all_to_all input", backend.size)
    device = backend.check_device(inputs[0], "all_to_all input[0]")
    for name, tensors in (("output", outputs), ("input", inputs)):
        for index, tensor in enumerate(tensors):
            backend.check_device(tensor, f"all_to_all {name}[{index}]")
    _args.check_same_dtype(outputs + inputs, inputs[0], "all_to_all")
    send = [(i.data_ptr(), nbytes(i)) for i in inputs]
    recv = [(o.data_ptr(), nbytes(o)) for o in outputs]
    return backend.submit("all_to_all", device, outputs, _exchange_with_all(send, recv),
                       keepalive=(inputs, outputs), async_op=_async_requested(opts), entry=entry)


def all_to_all_single(backend, output, input, output_split_sizes, input_split_sizes, opts, entry=None) -> CudaWork:
    device = backend.check_device(input, "all_to_all_single input")
    backend.check_device(output, "all_to_all_single output")
    _args.check_same_dtype([output], input, "all_to_all_single output")
    in_ptr, out_ptr = input.data_ptr(), output.data_ptr()
    send = [(in_ptr + offset, size)
            for offset, size in _args.split_bytes(input, input_split_sizes, backend.size, "input")]
    recv = [(out_ptr + offset, size)
            for offset, size in _args.split_bytes(output, output_split_sizes, backend.size, "output")]
    return backend.submit("all_to_all_single", device, [output], _exchange_with_all(send, recv),
                       keepalive=(input, output), async_op=_async_requested(opts), entry=entry)


def _exchange_with_all(send, recv) -> Callable:
    """Send ``send[peer]`` to and receive ``recv[peer]`` from every peer: (ptr, bytes) each."""
    def launch(comm, s):
        for peer, ((send_ptr, send_bytes), (recv_ptr, recv_bytes)) in enumerate(zip(send, recv)):
            comm.send(send_ptr, send_bytes, NCCL_BYTE, peer, s)
            comm.recv(recv_ptr, recv_bytes, NCCL_BYTE, peer, s)
    return _grouped(launch)


def gather(backend, output_tensors, input_tensors, opts, entry=None) -> CudaWork:
    return _rooted(backend, "gather", input_tensors, output_tensors, opts, to_root=True, entry=entry)


def scatter(backend, output_tensors, input_tensors, opts, entry=None) -> CudaWork:
    return _rooted(backend, "scatter", output_tensors, input_tensors, opts, to_root=False, entry=entry)


def _rooted(backend, op_name: str, own_tensors, root_lists, opts, to_root: bool, entry=None) -> CudaWork:
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
    ptr, size = tensor.data_ptr(), nbytes(tensor)

    def launch(comm, s):
        for peer, (chunk_ptr, chunk_bytes) in enumerate(chunks):
            (comm.recv if to_root else comm.send)(chunk_ptr, chunk_bytes, NCCL_BYTE, peer, s)
        (comm.send if to_root else comm.recv)(ptr, size, NCCL_BYTE, root, s)
    outputs = tensors if to_root else [tensor]
    return backend.submit(op_name, device, outputs, _grouped(launch), keepalive=(tensor, tensors),
                       async_op=_async_requested(opts), entry=entry)


def point_to_point(backend, op_name: str, tensors, peer: int, batched: bool = False, entry=None) -> CudaWork:
    """send or recv: queued until the batch is issued (see cupycoll.call_queue); ``batched``:
    one of a batch torch made (``batch_isend_irecv``), run on the group's communicator."""
    tensor = _args.single(tensors, op_name)
    device = backend.check_device(tensor, f"{op_name} tensor")
    peer = _args.check_peer(peer, backend.rank, backend.size)
    ptr, size = tensor.data_ptr(), nbytes(tensor)
    if op_name == "send":
        launch = lambda comm, s, comm_peer: comm.send(ptr, size, NCCL_BYTE, comm_peer, s)
    else:
        launch = lambda comm, s, comm_peer: comm.recv(ptr, size, NCCL_BYTE, comm_peer, s)
    return backend.submit(op_name, device, [tensor], launch, keepalive=tensor, peer=peer, async_op=True, entry=entry,
                          batched=batched)


def barrier(backend, device: torch.device, entry=None) -> CudaWork:
    """Like ProcessGroupNCCL: a one-byte all-reduce whose wait() blocks the CPU."""
    backend.check_usable()  # the group's routing checks are skipped for barrier(device_ids)
    device = backend.device or device
    token = torch.zeros(1, dtype=torch.uint8, device=device)
    ptr = token.data_ptr()
    return backend.submit("barrier", device, [token],
                       lambda comm, s: comm.all_reduce(ptr, ptr, 1, NCCL_BYTE, 0, s),
                       keepalive=token, async_op=True, blocking_wait=True, entry=entry)
