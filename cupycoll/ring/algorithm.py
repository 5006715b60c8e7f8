"""cupycoll's own ring all-reduce and reduce-scatter: NCCL calls plus CuPy RawKernels.

NCCL's reductions add fp16/bf16 in fp16/bf16 at every hop, have no bitwise ops, and give
results that depend on the algorithm NCCL picks. The ring here accumulates fp16/bf16 in
fp32 and rounds once, offers BAND/BOR/BXOR, and is bitwise reproducible: every element is
reduced in an order fixed by the schedule (:mod:`cupycoll.ring.schedule`; the tests' numpy
model, tests/ring_simulator.py, runs the same plans on the CPU), and all-reduce copies each
finished chunk from its owner, so every rank holds the same bits.

Public API (pointers, counts, dtype/op names and the stream are plain values, as in
:mod:`cupycoll.nccl.communicator`; nothing here knows torch)::

    ring = Ring(communicator, scratch_bytes=DEFAULT_RING_SCRATCH_BYTES)
    ring.prepare(kind, count, dtype, op)  # optional: scratch and kernels, before launching
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
  on it, and work enqueued on it afterwards sees the result. Nothing blocks the host, but
  growing the scratch (below).
* PREMUL_SUM's factor: ``premul`` a Python number (used in the accumulation type: fp32
  for fp16/bf16/fp32, fp64 for fp64), or ``premul_ptr`` a device pointer to one element
  of ``dtype`` (read on the stream, when the reduction runs).

A :class:`Ring` belongs to one communicator. It makes a side stream for the transfers of
pipelined plans at construction, and keeps one scratch buffer that it grows on demand to
what a call's plan needs, never beyond ``scratch_bytes`` (the schedule then cuts more,
smaller slices): growing waits for the ring's previous call to end on the GPU, frees the
old buffer and allocates the new one, all before the call enqueues anything; an allocation
that fails raises :class:`~cupycoll.errors.CupycollError` and leaves the ring usable. Calls
on one Ring are serialised on the GPU (they share the scratch), whatever streams they are
given. Every rank must use the same ``scratch_bytes``: it decides the slicing, which the
ranks must agree on.

Host cost: each (kind, count, dtype, op) is planned once per process (rank and world are
the communicator's) into a flat program of prepared launches with relative addresses
(:mod:`cupycoll.ring.programs`); a call adds its buffers' addresses and launches them in
order, O(rounds x world) of them, rounds bounded independently of the message
(:mod:`cupycoll.ring.schedule`).

Deliberately left out: choosing between NCCL and the ring (:mod:`cupycoll.collectives`),
torch tensors, replaying plans as CUDA graphs, and teardown in ``__del__``
(:meth:`Ring.close` is explicit). The ring must not be called inside an open NCCL group
(``Communicator.group()``): its kernels would be enqueued before the group's transfers.
"""

from __future__ import annotations

from typing import List, Optional

import numpy

from ..nccl import header as nccl_header
from .kernels import ELEMENTS, OPS, check, compile_module, supports
from ..config import DEFAULT_RING_SCRATCH_BYTES
from ..errors import CommunicatorAbortedError, CupycollError, CupycollTypeError, CupycollValueError
from .programs import BLOCK, COPY, EXCHANGE, GATHER, KERNEL, RECORD, SCRATCH, WAIT, Program, program
from .schedule import KINDS, LANES, SLOTS, Plan, left_of, right_of

__all__ = ["Ring", "check", "supports", "plan_for", "OPS", "DTYPES", "MIN_SCRATCH_BYTES"]

DTYPES = tuple(ELEMENTS)
# Enough for one 16-element slice of fp64 partials in every lane and slot.
MIN_SCRATCH_BYTES = LANES * SLOTS * 16 * 8
# The scratch grows in whole MiB (at most to scratch_bytes), so that nearby sizes share one.
SCRATCH_GRANULE = 1 << 20

_NCCL_BYTES = nccl_header.ncclUint8  # NCCL moves partials as bytes: their type is the kernels' business
_ACC_TYPES = {dtype: numpy.dtype(element.acc).type for dtype, element in ELEMENTS.items()}


def plan_for(kind: str, rank: int, world: int, count: int, dtype: str, op: str,
             scratch_bytes: int = DEFAULT_RING_SCRATCH_BYTES) -> Plan:
    """The plan :class:`Ring` runs for ``kind`` (``"all_reduce"`` or ``"reduce_scatter"``,
    whose ``count`` is the per-rank recvcount) with at most ``scratch_bytes`` of scratch;
    ``cupycoll.ring.stream_order.issue(plan)`` gives its commands. For tests and debugging,
    without a GPU."""
    return program(kind, rank, world, count, dtype, op, scratch_bytes).plan


def _check_int(name: str, value, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise CupycollTypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise CupycollValueError(f"{name}={value} must be >= {minimum}")
    return value


def _amount(nbytes: int) -> str:
    return f"{nbytes} bytes ({nbytes / (1 << 20):.1f} MiB)"


# ------------------------------------------------------------------------------ the ring

class Ring:
    """The ring algorithm on one communicator, with its scratch memory and side stream."""

    def __init__(self, communicator, scratch_bytes: int = DEFAULT_RING_SCRATCH_BYTES):
        _check_int("scratch_bytes", scratch_bytes, MIN_SCRATCH_BYTES)
        self._comm = communicator
        # The communicator's CUDA runtime (cupycoll._cuda): every call here runs with its
        # device current.
        self._runtime = runtime = communicator.runtime
        self.scratch_bytes = scratch_bytes  # the most the scratch may grow to
        self._closed = False
        with runtime.on_device(communicator.device):
            # A pipelined plan's transfers run here, to overlap the reductions on the caller's stream.
            self._side = runtime.new_stream(communicator.device)
        # The scratch: a buffer of torch's caching allocator (torch.cuda.memory_allocated and
        # empty_cache see it, and torch can free its cache for it when the device is full).
        self._scratch = None
        self._scratch_ptr = 0
        self.scratch_held = 0  # bytes of the current scratch buffer
        # Events by index (a program numbers those it uses from 0), made on first use. An
        # event may be recorded again as soon as a wait on it is enqueued (the wait keeps
        # what it saw), so one list serves every call.
        self._events: List = []
        self._last_use = None  # recorded on the caller's stream at the end of each call
        self._last_stream = None  # the cudaStream_t it was recorded on

    # -- public ------------------------------------------------------------------------
    def all_reduce(self, sendbuf: int, recvbuf: int, count: int, dtype: str, op: str,
                   stream: int, premul: Optional[float] = None,
                   premul_ptr: Optional[int] = None) -> None:
        """Reduce ``count`` elements at ``sendbuf`` across the ranks into ``recvbuf``."""
        self._validate(sendbuf, recvbuf, count, dtype, op, stream, premul, premul_ptr, "count")
        if count == 0:
            return
        self._execute(self._ready("all_reduce", count, dtype, op), sendbuf, recvbuf, dtype, op,
                      stream, premul, premul_ptr)

    def reduce_scatter(self, sendbuf: int, recvbuf: int, recvcount: int, dtype: str, op: str,
                       stream: int, premul: Optional[float] = None,
                       premul_ptr: Optional[int] = None) -> None:
        """Reduce ``size * recvcount`` elements at ``sendbuf``; this rank gets block ``rank``
        of the result (``recvcount`` elements) at ``recvbuf``."""
        self._validate(sendbuf, recvbuf, recvcount, dtype, op, stream, premul, premul_ptr,
                       "recvcount")
        if recvcount == 0:
            return
        self._execute(self._ready("reduce_scatter", recvcount, dtype, op), sendbuf, recvbuf,
                      dtype, op, stream, premul, premul_ptr)

    def prepare(self, kind: str, count: int, dtype: str, op: str) -> None:
        """Plan a call of ``kind`` ("all_reduce", "reduce_scatter"), grow the scratch to what
        it needs and compile its kernels, so that a caller can fail before it launches
        anything (a failure inside a launch leaves the peers waiting for a collective this
        rank never ran); the call itself then finds everything ready."""
        if kind not in KINDS:
            raise CupycollValueError(f"ring call kind {kind!r}: expected all_reduce or reduce_scatter")
        if count:
            self._ready(kind, count, dtype, op)

    def close(self) -> None:
        """Free the scratch memory once the GPU is done with it. The Ring is then unusable."""
        if self._closed:
            return
        self._closed = True
        with self._runtime.on_device(self._comm.device):
            # After an abort NCCL's kernels have exited, so this cannot hang on a dead peer.
            self._release_scratch()
            for event in self._events + ([self._last_use] if self._last_use is not None else []):
                event.destroy()
            self._events, self._last_use = [], None

    # -- validation --------------------------------------------------------------------
    def _validate(self, sendbuf, recvbuf, count, dtype, op, stream, premul, premul_ptr, what):
        self._check_open()
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

    def _check_open(self) -> None:
        if self._closed:
            raise CommunicatorAbortedError("this ring was closed")
        if getattr(self._comm, "state", "ok") != "ok":
            raise CommunicatorAbortedError(
                f"the NCCL communicator on cuda:{self._comm.device} was {self._comm.state}")

    # -- what a call needs before it launches ------------------------------------------
    def _ready(self, kind: str, count: int, dtype: str, op: str) -> Program:
        """The call's program, with the scratch it needs held and its kernels compiled (or
        fetched from the cache): everything fallible before anything is enqueued."""
        self._check_open()
        found = program(kind, self._comm.rank, self._comm.size, count, dtype, op, self.scratch_bytes)
        if found.scratch_bytes > self.scratch_held:
            self._grow(found, count)
        if found.needs_kernels:
            with self._runtime.on_device(self._comm.device):
                compile_module(self._runtime, self._comm.device, dtype, op)
        return found

    def _grow(self, found: Program, count: int) -> None:
        runtime = self._runtime
        size = min(self.scratch_bytes, -(-found.scratch_bytes // SCRATCH_GRANULE) * SCRATCH_GRANULE)
        with runtime.on_device(self._comm.device):
            self._release_scratch()
            try:
                self._scratch = runtime.scratch(size, self._comm.device)
            except runtime.out_of_memory as exc:
                plan = found.plan
                raise CupycollError(
                    f"the ring algorithm could not allocate {_amount(size)} of scratch memory on "
                    f"cuda:{self._comm.device} for a {plan.kind} of {count} {plan.dtype} elements "
                    f"({plan.geometry.rounds} rounds of {plan.geometry.slice_elems}-element slices); "
                    f"nothing was launched. A smaller ring scratch limit (cupycoll.Options("
                    f"ring_scratch_bytes=...) or CUPYCOLL_RING_SCRATCH_BYTES, now "
                    f"{self.scratch_bytes} bytes, the same on every rank) runs more, smaller "
                    f"rounds in less memory") from exc
        self._scratch_ptr = self._scratch.data_ptr()
        self.scratch_held = size

    def _release_scratch(self) -> None:
        """Drop the scratch buffer once the GPU is done with it, back to torch's cache (the
        ring's device current)."""
        if self._scratch is not None:
            # Waits for the ring's previous call, whose kernels and transfers may still use it
            # (on streams other than the one the buffer was allocated on).
            if self._last_use is not None:
                self._last_use.synchronize()
            self._side.synchronize()
        self._scratch, self._scratch_ptr, self.scratch_held = None, 0, 0

    # -- execution ---------------------------------------------------------------------
    def _execute(self, found: Program, sendbuf, recvbuf, dtype, op, stream, premul, premul_ptr) -> None:
        runtime = self._runtime
        comm = self._comm
        factor = _ACC_TYPES[dtype](premul if premul is not None else 0)
        factor_ptr = numpy.uint64(premul_ptr or 0)
        divisor = numpy.int64(comm.size)
        right, left = right_of(comm.rank, comm.size), left_of(comm.rank, comm.size)
        bases = (sendbuf, recvbuf, self._scratch_ptr, 0)
        u64 = numpy.uint64
        launch = runtime.launch

        with runtime.on_device(comm.device):
            kernels = compile_module(runtime, comm.device, dtype, op) if found.needs_kernels else None
            streams = (stream, self._side.ptr)
            events = self._events_for(found.events)
            if self._last_use is not None and self._last_stream != stream:
                self._last_use.wait_on(stream)  # the scratch is shared by every call
            for step in found.steps:
                code = step[0]
                if code == KERNEL:
                    _, name, local, in_base, in_off, out_base, out_off, n, grid = step
                    launch(kernels[name], grid, BLOCK,
                           (u64(sendbuf + local), u64(bases[in_base] + in_off),
                            u64(bases[out_base] + out_off), n, factor_ptr, factor, divisor), stream)
                elif code == EXCHANGE:
                    _, s, send_base, send_off, send_bytes, recv_off, recv_bytes = step
                    ptr = streams[s]
                    send_ptr, recv_ptr = bases[send_base] + send_off, bases[SCRATCH] + recv_off
                    if send_bytes and recv_bytes:
                        with comm.group():
                            comm.send(send_ptr, send_bytes, _NCCL_BYTES, right, ptr)
                            comm.recv(recv_ptr, recv_bytes, _NCCL_BYTES, left, ptr)
                    elif send_bytes:
                        comm.send(send_ptr, send_bytes, _NCCL_BYTES, right, ptr)
                    else:
                        comm.recv(recv_ptr, recv_bytes, _NCCL_BYTES, left, ptr)
                elif code == RECORD:
                    events[step[1]].record(streams[step[2]])
                elif code == WAIT:
                    events[step[1]].wait_on(streams[step[2]])
                elif code == GATHER:
                    _, s, own_off, share_bytes, tail_off, tail_bytes, root = step
                    ptr, tail = streams[s], recvbuf + tail_off
                    if share_bytes and tail_bytes:
                        with comm.group():
                            comm.all_gather(recvbuf + own_off, recvbuf, share_bytes, _NCCL_BYTES, ptr)
                            comm.broadcast(tail, tail, tail_bytes, _NCCL_BYTES, root, ptr)
                    elif share_bytes:
                        comm.all_gather(recvbuf + own_off, recvbuf, share_bytes, _NCCL_BYTES, ptr)
                    else:
                        comm.broadcast(tail, tail, tail_bytes, _NCCL_BYTES, root, ptr)
                elif code == COPY and sendbuf != recvbuf:
                    _, offset, nbytes = step
                    runtime.copy(recvbuf + offset, sendbuf + offset, nbytes, stream)
            if self._last_use is None:
                self._last_use = runtime.new_event()
            self._last_use.record(stream)
            self._last_stream = stream

    def _events_for(self, count: int) -> List:
        """The first ``count`` of the ring's events (the ring's device current)."""
        while len(self._events) < count:
            self._events.append(self._runtime.new_event())
        return self._events
