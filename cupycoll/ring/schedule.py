"""The ring algorithm's schedule, as plain data: chunks, slices, per-rank plans, stream order.

:mod:`cupycoll.ring.algorithm` executes the plans built here on the GPU, action by action, in list
order; the tests' numpy model (tests/ring_simulator.py) executes the very same plans, one
array per rank, so the CPU tests of the schedule test what the GPU runs.

The schedule
------------
The buffer is cut into one *chunk* per rank (all-reduce: equal, 16-element-aligned pieces,
trailing ones possibly empty; reduce-scatter: block ``r`` of the input is chunk ``r``).
Rank ``r`` owns chunk ``r``: it finishes that chunk's reduction. Chunks are cut into
*slices* of at most ``slice_elems`` elements, bounded by the scratch memory; round ``k`` of
the reduce-scatter phase moves slice ``k`` of every chunk around the ring:

* at step ``s`` (``0 <= s < world - 1``) rank ``r`` sends the partial of chunk
  ``(r - s - 1) % world`` to its right neighbour ``r + 1`` and receives the partial of
  chunk ``(r - s - 2) % world`` from its left neighbour ``r - 1`` (one NCCL group);
* it then combines its own contribution with what it received (``reduce``); at the last
  step the received chunk is its own, and the combination is final: it is divided for
  AVG, rounded to the element type once, and written to the output.

So chunk ``c`` is always reduced in the order ``c+1, c+2, ..., c`` (ranks, modulo world):
every element's reduction order is fixed, whatever the timing. All-reduce then forwards
the finished chunks around the ring for ``world - 1`` steps (rank ``r`` sends chunk
``(r - s) % world``, receives chunk ``(r - s - 1) % world``), copying bytes: every rank
ends with the owner's bits.

Partials travel in the accumulation type (fp32 for fp16/bf16). Scratch holds ``LANES``
lanes of ``SLOTS`` slots of ``slice_elems`` accumulators: rounds alternate between lanes
so that one lane's transfer overlaps the other's reduction, and within a lane step ``s``
receives into slot ``s % 2`` while sending from slot ``(s + 1) % 2``.

Deliberately left out: arithmetic on values (the numpy model of the kernels is
tests/ring_simulator.py; this module imports no numpy), CuPy, torch, real streams
and pointers (see :mod:`cupycoll.ring.algorithm`). Streams appear only as the two names that
:func:`issue` orders commands on.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple, Union

from .kernels import check, stages_first_contribution
from ..errors import CupycollValueError

LANES = 2
SLOTS = 2
ALIGN_ELEMS = 16  # chunk and slice starts stay 16-byte aligned for the widest accesses

Bounds = Tuple[int, int]


# ------------------------------------------------------------------------------ geometry

def all_reduce_chunks(count: int, world: int) -> List[Bounds]:
    """Chunk ``c`` of an all-reduce of ``count`` elements is ``[start, stop)``."""
    per_rank = -(-count // world) if world else 0
    per_rank = -(-per_rank // ALIGN_ELEMS) * ALIGN_ELEMS
    return [(min(c * per_rank, count), min((c + 1) * per_rank, count)) for c in range(world)]


def reduce_scatter_chunks(recvcount: int, world: int) -> List[Bounds]:
    """Chunk ``c`` of a reduce-scatter is block ``c`` of the input (NCCL's semantics)."""
    return [(c * recvcount, (c + 1) * recvcount) for c in range(world)]


def slice_elems_for(scratch_bytes: int, acc_itemsize: int) -> int:
    """The longest slice the scratch memory holds in every lane and slot."""
    elems = scratch_bytes // (LANES * SLOTS * acc_itemsize)
    elems -= elems % ALIGN_ELEMS
    if elems <= 0:
        raise CupycollValueError(
            f"ring scratch of {scratch_bytes} bytes is too small: it needs at least "
            f"{LANES * SLOTS * ALIGN_ELEMS * acc_itemsize} bytes for {acc_itemsize}-byte "
            "accumulators")
    return elems


def round_count(chunks: Sequence[Bounds], slice_elems: int) -> int:
    longest = max((stop - start for start, stop in chunks), default=0)
    return -(-longest // slice_elems)


def slice_bounds(chunk: Bounds, round_index: int, slice_elems: int) -> Bounds:
    """Slice ``round_index`` of ``chunk``; empty (start == stop) past the chunk's end."""
    start, stop = chunk
    begin = min(start + round_index * slice_elems, stop)
    return begin, min(begin + slice_elems, stop)


# ------------------------------------------------------------------------------ step order

def right_of(rank: int, world: int) -> int:
    return (rank + 1) % world


def left_of(rank: int, world: int) -> int:
    return (rank - 1) % world


def reduce_scatter_send_chunk(rank: int, step: int, world: int) -> int:
    return (rank - step - 1) % world


def reduce_scatter_recv_chunk(rank: int, step: int, world: int) -> int:
    return (rank - step - 2) % world


def all_gather_send_chunk(rank: int, step: int, world: int) -> int:
    return (rank - step) % world


def all_gather_recv_chunk(rank: int, step: int, world: int) -> int:
    return (rank - step - 1) % world


# ------------------------------------------------------------------------------ actions

@dataclasses.dataclass(frozen=True)
class Stage:
    """Convert this rank's slice of ``chunk`` into scratch ``(lane, slot)`` before the
    first send of a round (fp16/bf16 widen to fp32; PREMUL_SUM scales)."""

    round: int
    lane: int
    slot: int
    chunk: int
    start: int
    stop: int


@dataclasses.dataclass(frozen=True)
class Exchange:
    """Send a partial to the right neighbour and receive one from the left, in one NCCL
    group. ``send_slot`` None: send this rank's input elements as they are."""

    round: int
    step: int
    lane: int
    send_chunk: int
    send_start: int
    send_stop: int
    send_slot: Optional[int]
    recv_chunk: int
    recv_start: int
    recv_stop: int
    recv_slot: int


@dataclasses.dataclass(frozen=True)
class Reduce:
    """Combine this rank's slice of ``chunk`` with the partial in ``(lane, slot)``. Not
    final: the result stays in the slot, to be sent. Final: it is finished and written to
    the output at ``out_start``."""

    round: int
    step: int
    lane: int
    slot: int
    chunk: int
    start: int
    stop: int
    final: bool
    out_start: Optional[int]


@dataclasses.dataclass(frozen=True)
class Forward:
    """All-gather step: send a finished chunk of the output right, receive one from the
    left into the output (bytes, no arithmetic)."""

    step: int
    send_chunk: int
    send_start: int
    send_stop: int
    recv_chunk: int
    recv_start: int
    recv_stop: int


@dataclasses.dataclass(frozen=True)
class Alone:
    """World size 1: the output is this rank's input (``transform``: finished through the
    kernels, for PREMUL_SUM's scaling; otherwise a plain copy)."""

    start: int
    stop: int
    transform: bool


Action = Union[Stage, Exchange, Reduce, Forward, Alone]


def reduce_scatter_plan(rank: int, world: int, chunks: Sequence[Bounds], slice_elems: int,
                        stage_first: bool, scatter: bool) -> List[Action]:
    """Rank ``rank``'s reduce-scatter phase, in issue order.

    ``stage_first``: convert the first contribution into scratch before sending it.
    ``scatter``: the output holds only the owned chunk (reduce-scatter), so the final
    results go to ``start - chunks[rank][0]``; otherwise to ``start`` (all-reduce).

    Rounds run in waves of ``LANES``; within a wave each step is issued lane after lane,
    so the GPU can move one lane's data while it reduces the other's.
    """
    if world == 1:
        return []
    rounds = round_count(chunks, slice_elems)
    own_base = chunks[rank][0] if scatter else 0
    plan: List[Action] = []
    for wave in range(0, rounds, LANES):
        wave_rounds = [(k, k - wave) for k in range(wave, min(wave + LANES, rounds))]
        if stage_first:
            for k, lane in wave_rounds:
                chunk = reduce_scatter_send_chunk(rank, 0, world)
                start, stop = slice_bounds(chunks[chunk], k, slice_elems)
                plan.append(Stage(k, lane, _send_slot(0), chunk, start, stop))
        for step in range(world - 1):
            for k, lane in wave_rounds:
                send_chunk = reduce_scatter_send_chunk(rank, step, world)
                recv_chunk = reduce_scatter_recv_chunk(rank, step, world)
                send = slice_bounds(chunks[send_chunk], k, slice_elems)
                recv = slice_bounds(chunks[recv_chunk], k, slice_elems)
                from_scratch = stage_first or step > 0
                plan.append(Exchange(k, step, lane, send_chunk, *send,
                                     _send_slot(step) if from_scratch else None,
                                     recv_chunk, *recv, _recv_slot(step)))
                final = step == world - 2
                plan.append(Reduce(k, step, lane, _recv_slot(step), recv_chunk, *recv, final,
                                   recv[0] - own_base if final else None))
    return plan


def all_gather_plan(rank: int, world: int, chunks: Sequence[Bounds]) -> List[Action]:
    """Rank ``rank``'s all-gather phase (all-reduce only): whole chunks, in issue order."""
    plan: List[Action] = []
    for step in range(world - 1):
        send_chunk = all_gather_send_chunk(rank, step, world)
        recv_chunk = all_gather_recv_chunk(rank, step, world)
        plan.append(Forward(step, send_chunk, *chunks[send_chunk], recv_chunk, *chunks[recv_chunk]))
    return plan


def all_reduce_plan(rank: int, world: int, count: int, slice_elems: int, dtype: str,
                    op: str) -> List[Action]:
    check(dtype, op)
    if world == 1:
        return [Alone(0, count, op == "premul_sum")]
    chunks = all_reduce_chunks(count, world)
    return (reduce_scatter_plan(rank, world, chunks, slice_elems,
                                stages_first_contribution(dtype, op), scatter=False)
            + all_gather_plan(rank, world, chunks))


def reduce_scatter_full_plan(rank: int, world: int, recvcount: int, slice_elems: int,
                             dtype: str, op: str) -> List[Action]:
    check(dtype, op)
    if world == 1:
        return [Alone(0, recvcount, op == "premul_sum")]
    chunks = reduce_scatter_chunks(recvcount, world)
    return reduce_scatter_plan(rank, world, chunks, slice_elems,
                               stages_first_contribution(dtype, op), scatter=True)


def _recv_slot(step: int) -> int:
    return step % SLOTS


def _send_slot(step: int) -> int:
    # What step s sends is what step s - 1 received and reduced in place; step 0 sends
    # what Stage put in the slot step 0 does not receive into.
    return (step + 1) % SLOTS


# ------------------------------------------------------------------------ stream order

CALLER = "caller"  # the stream the collective was called with: kernels run there
SIDE = "side"  # the ring's own stream: NCCL transfers run there


@dataclasses.dataclass(frozen=True)
class Run:
    stream: str
    action: Action


@dataclasses.dataclass(frozen=True)
class Record:
    """Record event ``event`` on ``stream``. Events are reused: a wait sees the latest
    record issued before it (CUDA's semantics)."""

    stream: str
    event: Tuple


@dataclasses.dataclass(frozen=True)
class Wait:
    """Later work on ``stream`` waits for ``event`` (a no-op if it was never recorded)."""

    stream: str
    event: Tuple


Command = Union[Run, Record, Wait]


def issue(plan: Sequence[Action]) -> List[Command]:
    """The commands that run ``plan`` on two streams, empty actions left out.

    Kernels run on the caller's stream, transfers on the side stream. Per lane, the
    caller records ("reduced", lane) after each kernel and the side stream records
    ("received", lane) after each transfer; each waits for the other's latest before it
    touches the lane's slots. Lanes do not wait for each other, which is what lets lane
    1's transfer run during lane 0's reduction. The first records order the whole ring
    after the caller's earlier work; the last wait orders the caller's later work after
    the side stream's last transfer.
    """
    commands: List[Command] = [Record(CALLER, ("reduced", lane)) for lane in range(LANES)]
    side_used = gathering = False
    for action in plan:
        if isinstance(action, (Stage, Reduce)):
            if action.stop == action.start:
                continue
            # A Reduce consumes the transfer just received; a Stage overwrites a slot that
            # the lane's last transfer may still be sending from (the round before it could
            # end with a send and no receive, so no Reduce waited for that transfer).
            commands += [Wait(CALLER, ("received", action.lane)), Run(CALLER, action),
                         Record(CALLER, ("reduced", action.lane))]
        elif isinstance(action, Exchange):
            if action.send_stop == action.send_start and action.recv_stop == action.recv_start:
                continue
            commands += [Wait(SIDE, ("reduced", action.lane)), Run(SIDE, action),
                         Record(SIDE, ("received", action.lane))]
            side_used = True
        elif isinstance(action, Forward):
            if not gathering:
                # Every owned chunk must be final before any of them moves.
                commands += [Record(CALLER, ("gathered",)), Wait(SIDE, ("gathered",))]
                gathering = True
            if action.send_stop == action.send_start and action.recv_stop == action.recv_start:
                continue
            commands.append(Run(SIDE, action))
            side_used = True
        elif isinstance(action, Alone):
            if action.stop != action.start:
                commands.append(Run(CALLER, action))
    if side_used:
        commands += [Record(SIDE, ("side done",)), Wait(CALLER, ("side done",))]
    return commands
