"""cupycoll's own ring all-reduce and reduce-scatter: NCCL send/recv plus CuPy RawKernels.

NCCL's reductions add fp16/bf16 in fp16/bf16 at every hop, have no bitwise ops, and give
results that depend on the algorithm NCCL picks. The ring here accumulates fp16/bf16 in
fp32 and rounds once, offers BAND/BOR/BXOR, and is bitwise reproducible: every element is
reduced in an order fixed by the schedule (:mod:`cupycoll.ring.schedule`; the tests' numpy
model, tests/ring_simulator.py, runs the same plans on the CPU), and all-reduce copies each finished chunk from
its owner, so every rank holds the same bits.

Public API (pointers, counts, dtype/op names and the stream are plain values, as in
:mod:`cupycoll.nccl.communicator`; nothing here knows torch)::

    ring = Ring(communicator, scratch_bytes=DEFAULT_RING_SCRATCH_BYTES)
    ring.all_reduce(sendbuf, recvbuf, count, dtype, op, stream, premul=None, premul_ptr=None)
    ring.reduce_scatter(sendbuf, recvbuf, recvcount, dtype, op, stream,
                        premul=None, premul_ptr=None)
    ring.close()
    check(dtype, op)     # raises CupycollValueError naming both
    supports(dtype, op)  # bool

* ``sendbuf``, ``recvbuf``: device pointers (ints) on ``communicator.device``; equal for
  in-place. reduce_scatter reads ``size * recvcount`` elements and writes rank r's block
  r (NCCL semantics; in place means ``recvbuf == sendbuf + rank * recvcount`` elements).
* ``count`` / ``recvcount``: elements (not bytes); 0 is a no-op.
* ``dtype``: ``float16 bfloat16 float32 float64 int8 uint8 int32 int64 bool``.
* ``op``: ``sum avg product min max premul_sum band bor bxor`` (see
  :func:`cupycoll.ring.kernels.check` for the pairs; bool SUM/MAX are OR, PRODUCT/MIN AND).
* ``stream``: a ``cudaStream_t`` as an int. Everything is enqueued after the work already
  on it, and work enqueued on it afterwards sees the result. Nothing blocks the host.
* PREMUL_SUM's factor: ``premul`` a Python number (used in the accumulation type: fp32
  for fp16/bf16/fp32, fp64 for fp64), or ``premul_ptr`` a device pointer to one element
  of ``dtype`` (read on the stream, when the reduction runs).

A :class:`Ring` belongs to one communicator; it allocates its scratch memory (lanes and
slots of fp32/element partials, ``scratch_bytes`` in all) and a side stream for the
transfers once, at construction. Calls on one Ring are serialised on the GPU (they share
the scratch), whatever streams they are given.

Deliberately left out: choosing between NCCL and the ring (:mod:`cupycoll.collectives`),
torch tensors, and teardown in ``__del__`` (:meth:`Ring.close` is explicit). The ring
must not be called inside an open NCCL group (``Communicator.group()``): its kernels would be
enqueued before the group's transfers.
"""

from __future__ import annotations

import functools
from typing import List, Optional

import numpy

from .. import _cuda, compat
from ..nccl import bindings as nccl_bindings
from .kernels import ELEMENTS, OPS, check, compile_module, supports
from ..config import DEFAULT_RING_SCRATCH_BYTES
from ..errors import CommunicatorAbortedError, CupycollTypeError, CupycollValueError
from .schedule import (
    CALLER,
    LANES,
    SIDE,
    SLOTS,
    Alone,
    Exchange,
    Forward,
    Record,
    Reduce,
    Run,
    Stage,
    Wait,
    all_reduce_plan,
    issue,
    left_of,
    reduce_scatter_full_plan,
    right_of,
    slice_elems_for,
)

__all__ = ["Ring", "check", "supports", "OPS", "DTYPES", "MIN_SCRATCH_BYTES"]

DTYPES = tuple(ELEMENTS)
# Enough for one 16-element slice of fp64 partials in every lane and slot.
MIN_SCRATCH_BYTES = LANES * SLOTS * 16 * 8

THREADS_PER_BLOCK = 256
MAX_BLOCKS = 4096  # the kernels stride over the rest; more blocks only cost scheduling
_NCCL_BYTES = nccl_bindings.ncclUint8


@functools.lru_cache(maxsize=64)
def _plan(kind, rank, world, count, slice_elems, dtype, op):
    if kind == "all_reduce":
        return tuple(all_reduce_plan(rank, world, count, slice_elems, dtype, op))
    return tuple(reduce_scatter_full_plan(rank, world, count, slice_elems, dtype, op))


@functools.lru_cache(maxsize=64)
def _commands(kind, rank, world, count, slice_elems, dtype, op):
    """What :meth:`Ring._execute` issues; cached, so a repeated collective (the usual
    training step) costs no planning."""
    return tuple(issue(_plan(kind, rank, world, count, slice_elems, dtype, op)))


def _needs_kernels(commands) -> bool:
    return any(isinstance(c, Run) and (isinstance(c.action, (Stage, Reduce))
                                       or (isinstance(c.action, Alone) and c.action.transform))
               for c in commands)


def _check_int(name: str, value, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise CupycollTypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise CupycollValueError(f"{name}={value} must be >= {minimum}")
    return value


class Ring:
    """The ring algorithm on one communicator, with its scratch memory and side stream."""

    def __init__(self, communicator, scratch_bytes: int = DEFAULT_RING_SCRATCH_BYTES):
        _check_int("scratch_bytes", scratch_bytes, MIN_SCRATCH_BYTES)
        cupy = _cuda.cupy_module()
        self._comm = communicator
        self.scratch_bytes = scratch_bytes
        self._closed = False
        with cupy.cuda.Device(communicator.device):
            self._scratch = cupy.cuda.alloc(scratch_bytes)
            # Transfers run here so that they overlap the reductions on the caller's stream.
            self._side = cupy.cuda.Stream(non_blocking=True)
        # name -> cupy Event, made on first use. An event may be recorded again as soon as
        # a wait on it is enqueued (the wait keeps what it saw), so one per name serves
        # every call.
        self._events = {}
        self._last_use = None  # recorded on the caller's stream at the end of each call

    # -- public ------------------------------------------------------------------------
    def all_reduce(self, sendbuf: int, recvbuf: int, count: int, dtype: str, op: str,
                   stream: int, premul: Optional[float] = None,
                   premul_ptr: Optional[int] = None) -> None:
        """Reduce ``count`` elements at ``sendbuf`` across the ranks into ``recvbuf``."""
        self._validate(sendbuf, recvbuf, count, dtype, op, stream, premul, premul_ptr, "count")
        if count == 0:
            return
        commands = _commands("all_reduce", self._comm.rank, self._comm.size, count,
                             self._slice_elems(dtype), dtype, op)
        self._execute(commands, sendbuf, recvbuf, dtype, op, stream, premul, premul_ptr)

    def reduce_scatter(self, sendbuf: int, recvbuf: int, recvcount: int, dtype: str, op: str,
                       stream: int, premul: Optional[float] = None,
                       premul_ptr: Optional[int] = None) -> None:
        """Reduce ``size * recvcount`` elements at ``sendbuf``; this rank gets block ``rank``
        of the result (``recvcount`` elements) at ``recvbuf``."""
        self._validate(sendbuf, recvbuf, recvcount, dtype, op, stream, premul, premul_ptr,
                       "recvcount")
        if recvcount == 0:
            return
        commands = _commands("reduce_scatter", self._comm.rank, self._comm.size, recvcount,
                             self._slice_elems(dtype), dtype, op)
        self._execute(commands, sendbuf, recvbuf, dtype, op, stream, premul, premul_ptr)

    def prepare(self, kind: str, count: int, dtype: str, op: str) -> None:
        """Compile the kernels a call of ``kind`` ("all_reduce", "reduce_scatter") needs, so
        that a caller can fail before it launches anything (a compile error inside a launch
        leaves the peers waiting for a collective this rank never ran); the call itself
        then finds them in the cache."""
        if count and _needs_kernels(_commands(kind, self._comm.rank, self._comm.size, count,
                                              self._slice_elems(dtype), dtype, op)):
            compile_module(self._comm.device, dtype, op)

    def close(self) -> None:
        """Free the scratch memory once the GPU is done with it. The Ring is then unusable."""
        if self._closed:
            return
        self._closed = True
        cupy = _cuda.cupy_module()
        with cupy.cuda.Device(self._comm.device):
            # After an abort NCCL's kernels have exited, so this cannot hang on a dead peer.
            if self._last_use is not None:
                self._last_use.synchronize()
            self._side.synchronize()
        self._scratch = None

    # -- validation --------------------------------------------------------------------
    def _validate(self, sendbuf, recvbuf, count, dtype, op, stream, premul, premul_ptr, what):
        if self._closed:
            raise CommunicatorAbortedError("this ring was closed")
        if getattr(self._comm, "state", "ok") != "ok":
            raise CommunicatorAbortedError(
                f"the NCCL communicator on cuda:{self._comm.device} was {self._comm.state}")
        if not isinstance(dtype, str) or not isinstance(op, str):
            raise CupycollTypeError(f"dtype and op must be names (str), got {dtype!r}, {op!r}")
        check(dtype, op)
        _check_int(what, count)
        _check_int("sendbuf", sendbuf)
        _check_int("recvbuf", recvbuf)
        _check_int("stream", stream)
        if op == "premul_sum":
            if (premul is None) == (premul_ptr is None):
                raise CupycollValueError(
                    "premul_sum needs exactly one factor: premul (a number) or premul_ptr "
                    "(a device pointer to one element of the dtype)")
            if premul is not None and (isinstance(premul, bool)
                                       or not isinstance(premul, (int, float))):
                raise CupycollTypeError(f"premul must be a number, got {type(premul).__name__}")
            if premul_ptr is not None:
                _check_int("premul_ptr", premul_ptr, 1)
        elif premul is not None or premul_ptr is not None:
            raise CupycollValueError(f"a premul factor was given for op {op} (only premul_sum uses one)")

    def _slice_elems(self, dtype: str) -> int:
        return slice_elems_for(self.scratch_bytes, ELEMENTS[dtype].acc_itemsize)

    # -- execution ---------------------------------------------------------------------
    def _execute(self, commands, sendbuf, recvbuf, dtype, op, stream, premul, premul_ptr) -> None:
        cupy = _cuda.cupy_module()
        comm = self._comm
        element = ELEMENTS[dtype]
        itemsize, acc_itemsize = element.itemsize, element.acc_itemsize
        slice_elems = self._slice_elems(dtype)
        right, left = right_of(comm.rank, comm.size), left_of(comm.rank, comm.size)
        scratch = self._scratch.ptr

        def slot_ptr(lane: int, slot: int) -> int:
            return scratch + (lane * SLOTS + slot) * slice_elems * acc_itemsize

        # Compile (or fetch from the cache) before anything is enqueued: a compile error
        # must not leave half a collective on the stream.
        kernels = compile_module(comm.device, dtype, op) if _needs_kernels(commands) else None
        factor = numpy.dtype(element.acc).type(premul if premul is not None else 0)
        factor_ptr = numpy.uint64(premul_ptr or 0)
        divisor = numpy.int64(comm.size)

        with cupy.cuda.Device(comm.device):
            streams = {CALLER: _external_stream(cupy, stream, comm.device), SIDE: self._side}
            caller, side = streams[CALLER], streams[SIDE]

            def launch(kind: str, local: int, incoming: int, out: int, n: int) -> None:
                launch_kernel(kernels[kind], dtype, local, incoming, out, n, caller,
                              factor, factor_ptr, divisor)

            def exchange(send_ptr, send_bytes, recv_ptr, recv_bytes) -> None:
                with comm.group():
                    if send_bytes:
                        comm.send(send_ptr, send_bytes, _NCCL_BYTES, right, side.ptr)
                    if recv_bytes:
                        comm.recv(recv_ptr, recv_bytes, _NCCL_BYTES, left, side.ptr)

            if self._last_use is not None:
                caller.wait_event(self._last_use)  # the scratch is shared by every call
            for command in commands:
                if isinstance(command, Wait):
                    streams[command.stream].wait_event(self._event(command.event))
                    continue
                if isinstance(command, Record):
                    self._event(command.event).record(streams[command.stream])
                    continue
                action = command.action
                if isinstance(action, Stage):
                    launch("ring_stage", sendbuf + action.start * itemsize, 0,
                           slot_ptr(action.lane, action.slot), action.stop - action.start)
                elif isinstance(action, Reduce):
                    slot = slot_ptr(action.lane, action.slot)
                    local = sendbuf + action.start * itemsize
                    if action.final:
                        launch("ring_reduce_final", local, slot,
                               recvbuf + action.out_start * itemsize, action.stop - action.start)
                    else:
                        launch("ring_reduce", local, slot, slot, action.stop - action.start)
                elif isinstance(action, Exchange):
                    if action.send_slot is None:
                        send_ptr = sendbuf + action.send_start * itemsize
                    else:
                        send_ptr = slot_ptr(action.lane, action.send_slot)
                    exchange(send_ptr, (action.send_stop - action.send_start) * acc_itemsize,
                             slot_ptr(action.lane, action.recv_slot),
                             (action.recv_stop - action.recv_start) * acc_itemsize)
                elif isinstance(action, Forward):
                    exchange(recvbuf + action.send_start * itemsize,
                             (action.send_stop - action.send_start) * itemsize,
                             recvbuf + action.recv_start * itemsize,
                             (action.recv_stop - action.recv_start) * itemsize)
                elif isinstance(action, Alone):
                    offset = action.start * itemsize
                    if action.transform:
                        launch("ring_final", sendbuf + offset, 0, recvbuf + offset,
                               action.stop - action.start)
                    elif sendbuf != recvbuf:
                        cupy.cuda.runtime.memcpyAsync(
                            recvbuf + offset, sendbuf + offset, (action.stop - action.start) * itemsize,
                            cupy.cuda.runtime.memcpyDeviceToDevice, caller.ptr)
            self._last_use = self._event(("last use",))
            self._last_use.record(caller)

    def _event(self, name):
        event = self._events.get(name)
        if event is None:
            event = self._events[name] = _cuda.cupy_module().cuda.Event(disable_timing=True)
        return event


def launch_kernel(kernel, dtype: str, local: int, incoming: int, out: int, n: int, stream,
                  factor=None, factor_ptr=None, divisor=None) -> None:
    """Launch one ring kernel (any kind: they share one parameter list) over ``n`` elements
    on the cupy ``stream``. ``factor``/``factor_ptr``/``divisor`` default to "unused"."""
    element = ELEMENTS[dtype]
    acc = numpy.dtype(element.acc).type
    threads_needed = -(-n // (16 // element.acc_itemsize))  # one 16-byte pack per thread
    blocks = min(MAX_BLOCKS, max(1, -(-threads_needed // THREADS_PER_BLOCK)))
    kernel((blocks,), (THREADS_PER_BLOCK,),
           (numpy.uint64(local), numpy.uint64(incoming), numpy.uint64(out), numpy.uint64(n),
            numpy.uint64(0) if factor_ptr is None else factor_ptr,
            acc(0) if factor is None else factor,
            numpy.int64(1) if divisor is None else divisor),
           stream=stream)


class _StreamHandle:
    """A raw ``cudaStream_t`` speaking the CUDA stream protocol."""

    def __init__(self, ptr: int):
        self._ptr = ptr

    def __cuda_stream__(self):
        return (0, self._ptr)


def _external_stream(cupy, ptr: int, device: int):
    return compat.external_stream(cupy, _StreamHandle(ptr), ptr, device)


def plan_for(kind: str, rank: int, world: int, count: int, dtype: str, op: str,
             scratch_bytes: int = DEFAULT_RING_SCRATCH_BYTES) -> List[object]:
    """The plan :class:`Ring` runs for ``kind`` (``"all_reduce"`` or ``"reduce_scatter"``,
    whose ``count`` is the per-rank recvcount) with ``scratch_bytes``; ``issue(plan)`` gives
    its commands. For tests and debugging, without a GPU."""
    check(dtype, op)
    if kind not in ("all_reduce", "reduce_scatter"):
        raise CupycollValueError(f"plan kind {kind!r}: expected all_reduce or reduce_scatter")
    slice_elems = slice_elems_for(scratch_bytes, ELEMENTS[dtype].acc_itemsize)
    return list(_plan(kind, rank, world, count, slice_elems, dtype, op))
