"""The ring's calls compiled into programs: each plan turned, once per process, into a flat
list of prepared launches with relative addresses, which :class:`cupycoll.ring.algorithm.Ring`
runs by adding its buffers' addresses.

A :class:`Program` is a plan's commands (:func:`cupycoll.ring.stream_order.issue`) as steps,
tuples whose first item says what the step launches:

* ``(KERNEL, kind, local offset, in base, in offset, out base, out offset, n, grid)``: one
  ring kernel over ``n`` elements on the caller's stream (``local``: this rank's elements in
  the send buffer);
* ``(EXCHANGE, stream, send base, send offset, send bytes, recv offset, recv bytes)``: a send
  to the right neighbour and a receive from the left into the scratch;
* ``(GATHER, stream, own offset, share bytes, tail offset, tail bytes, root)``: all-reduce's
  all-gather of the finished shares and broadcast of the tail, in the receive buffer;
* ``(COPY, offset, bytes)``: a single rank's copy from the send to the receive buffer;
* ``(RECORD, event, stream)``, ``(WAIT, event, stream)``: event ``event`` (numbered from 0
  per program) recorded on, or waited for by, a stream.

A base is one of :data:`SENDBUF`, :data:`RECVBUF`, :data:`SCRATCH` or :data:`NOWHERE` (an
input the kernel does not read); a stream is 0 (the caller's) or 1 (the ring's side stream).
It also holds the launch geometry of the ring kernels (:func:`grid_for`, :data:`BLOCK`) and
:func:`launch_kernel`, one kernel launched on its own (the kernels' benchmark).

Deliberately left out: the buffers, streams and events themselves, the scratch memory and
every NCCL call (the ring's, :mod:`cupycoll.ring.algorithm`), and the schedule
(:mod:`cupycoll.ring.schedule`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Tuple

import numpy

from .kernels import ELEMENTS
from .schedule import Alone, Exchange, Gather, Plan, Reduce, Stage, build_plan
from .stream_order import CALLER, SIDE, Record, Run, issue

THREADS_PER_BLOCK = 256
MAX_BLOCKS = 4096  # the kernels stride over the rest; more blocks only cost scheduling
BLOCK = (THREADS_PER_BLOCK,)  # every ring kernel's block


def grid_for(dtype: str, n: int) -> Tuple[int]:
    """The grid of a ring kernel over ``n`` elements: one 16-byte pack of accumulators per
    thread, at most MAX_BLOCKS blocks."""
    threads_needed = -(-n // (16 // ELEMENTS[dtype].acc_itemsize))
    return (min(MAX_BLOCKS, max(1, -(-threads_needed // THREADS_PER_BLOCK))),)


def launch_kernel(runtime, kernel, dtype: str, local: int, incoming: int, out: int, n: int, stream: int,
                  factor=None, factor_ptr=None, divisor=None) -> None:
    """Launch one ring kernel (any kind: they share one parameter list) over ``n`` elements
    on ``stream`` (a raw pointer; its device current) through ``runtime``.
    ``factor``/``factor_ptr``/``divisor`` default to "unused"."""
    acc = numpy.dtype(ELEMENTS[dtype].acc).type
    runtime.launch(kernel, grid_for(dtype, n), BLOCK,
                   (numpy.uint64(local), numpy.uint64(incoming), numpy.uint64(out), numpy.uint64(n),
                    numpy.uint64(0) if factor_ptr is None else factor_ptr,
                    acc(0) if factor is None else factor,
                    numpy.int64(1) if divisor is None else divisor), stream)


# ------------------------------------------------------------------------------ programs

# A program step is a tuple whose first item says what it launches (the module's docstring
# lists each one's items). Addresses are a base (one of the call's buffers, or the scratch)
# plus a byte offset known when planning; streams are indices into (caller's, side).
KERNEL, EXCHANGE, GATHER, COPY, RECORD, WAIT = range(6)
SENDBUF, RECVBUF, SCRATCH, NOWHERE = range(4)
_STREAM_INDEX = {CALLER: 0, SIDE: 1}


@dataclasses.dataclass(frozen=True)
class Program:
    """A plan turned into launches: ``steps`` in issue order, the number of distinct events
    they record and wait on, and what the call needs before it starts."""

    plan: Plan
    commands: Tuple
    steps: Tuple[tuple, ...]
    events: int
    needs_kernels: bool
    scratch_bytes: int


@functools.lru_cache(maxsize=256)
def program(kind: str, rank: int, world: int, count: int, dtype: str, op: str,
            scratch_bytes: int) -> Program:
    """The :class:`Program` of one call; cached, so a repeated collective (the usual
    training step) costs no planning."""
    plan = build_plan(kind, rank, world, count, dtype, op, scratch_bytes)
    commands = tuple(issue(plan))
    element = ELEMENTS[dtype]
    itemsize, acc_itemsize = element.itemsize, element.acc_itemsize
    cut = plan.geometry
    events: dict = {}
    steps = []

    def kernel(name, local, in_base, in_off, out_base, out_off, n):
        steps.append((KERNEL, name, local * itemsize, in_base, in_off, out_base, out_off,
                      numpy.uint64(n), grid_for(dtype, n)))

    for command in commands:
        if not isinstance(command, Run):
            event = events.setdefault(command.event, len(events))
            steps.append((RECORD if isinstance(command, Record) else WAIT, event,
                          _STREAM_INDEX[command.stream]))
            continue
        action, stream = command.action, _STREAM_INDEX[command.stream]
        if isinstance(action, Stage):
            kernel("ring_stage", action.start, NOWHERE, 0, SCRATCH,
                   cut.slot_offset(action.lane, action.slot), action.stop - action.start)
        elif isinstance(action, Reduce):
            slot = cut.slot_offset(action.lane, action.slot)
            if action.final:
                kernel("ring_reduce_final", action.start, SCRATCH, slot, RECVBUF,
                       action.out_start * itemsize, action.stop - action.start)
            else:
                kernel("ring_reduce", action.start, SCRATCH, slot, SCRATCH, slot,
                       action.stop - action.start)
        elif isinstance(action, Exchange):
            if action.send_slot is None:  # unstaged: the input elements are the partials
                send = (SENDBUF, action.send_start * itemsize)
            else:
                send = (SCRATCH, cut.slot_offset(action.lane, action.send_slot))
            steps.append((EXCHANGE, stream, *send, (action.send_stop - action.send_start) * acc_itemsize,
                          cut.slot_offset(action.lane, action.recv_slot),
                          (action.recv_stop - action.recv_start) * acc_itemsize))
        elif isinstance(action, Gather):
            steps.append((GATHER, stream, rank * action.share * itemsize, action.share * itemsize,
                          action.tail_start * itemsize, (action.tail_stop - action.tail_start) * itemsize,
                          action.root))
        elif isinstance(action, Alone):
            if action.transform:
                kernel("ring_final", action.start, NOWHERE, 0, RECVBUF, action.start * itemsize,
                       action.stop - action.start)
            else:
                steps.append((COPY, action.start * itemsize, (action.stop - action.start) * itemsize))
    return Program(plan, commands, tuple(steps), len(events),
                   any(step[0] == KERNEL for step in steps), plan.scratch_bytes)
