"""The ring algorithm's schedule, as plain data: chunks, slices and each rank's plan.

:mod:`cupycoll.ring.algorithm` executes the plans built here on the GPU, command by command
(:mod:`cupycoll.ring.stream_order` puts them on its streams), in list order; the tests' numpy
model (tests/ring_simulator.py) executes the very same plans, one array per rank, so the CPU
tests of the schedule test what the GPU runs.

The schedule
------------
The buffer is cut into one *chunk* per rank. All-reduce: chunk ``c < world - 1`` is
``[c * q, (c + 1) * q)`` with ``q`` the per-rank share rounded down to 16 elements, and the
last chunk also holds the remainder (fewer than ``16 * world`` elements). Reduce-scatter:
block ``r`` of the input is chunk ``r``. Rank ``r`` owns chunk ``r``: it finishes that
chunk's reduction. Each chunk is cut into ``rounds`` equal *slices* (:class:`Geometry`);
round ``k`` of the reduce-scatter phase moves slice ``k`` of every chunk around the ring:

* at step ``s`` (``0 <= s < world - 1``) rank ``r`` sends the partial of chunk
  ``(r - s - 1) % world`` to its right neighbour ``r + 1`` and receives the partial of
  chunk ``(r - s - 2) % world`` from its left neighbour ``r - 1`` (one NCCL group);
* it then combines its own contribution with what it received (``reduce``); at the last
  step the received chunk is its own, and the combination is final: it is divided for
  AVG, rounded to the element type once, and written to the output.

So chunk ``c`` is always reduced in the order ``c+1, c+2, ..., c`` (ranks, modulo world):
every element's reduction order is fixed, whatever the timing or the slicing. All-reduce then
gathers the finished chunks with one NCCL all-gather of the ``q``-element chunks plus, in the
same NCCL group, a broadcast of the remainder from the last rank: byte copies, so every rank
ends with the owner's bits.

Slices and rounds
-----------------
The number of rounds does not grow with the message: a chunk whose partials fill at least
``LANES * PIPELINE_MIN_SLICE_BYTES`` runs ``LANES`` rounds (one per lane, so that one
lane's transfer overlaps the other's reduction), a smaller one a single round. The scratch
memory (``LANES`` lanes of ``SLOTS`` slots of one slice of accumulators, only what a plan
uses) therefore grows with the message, up to ``scratch_bytes``, the most the user allows;
a message whose slices would not fit runs more rounds of the largest slices that do. Every
rank derives the same geometry from the same (kind, count, world, dtype, op, scratch_bytes).

Partials travel in the accumulation type (fp32 for fp16/bf16). Rounds alternate between
lanes; within a lane step ``s`` receives into slot ``s % 2`` while sending from slot
``(s + 1) % 2``. A plan with one round has nothing to overlap and runs on the caller's
stream alone; one with more runs its transfers on a second stream
(:func:`cupycoll.ring.stream_order.issue`).

Deliberately left out: arithmetic on values (the numpy model of the kernels is
tests/ring_simulator.py; this module imports no numpy), CuPy, torch, pointers, streams and
what a command costs to launch (the order of the actions on the ring's two streams, and its
count of launches: :mod:`cupycoll.ring.stream_order`).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple, Union

from .kernels import ELEMENTS, check, stages_first_contribution
from ..errors import CupycollValueError

LANES = 2
SLOTS = 2
ALIGN_ELEMS = 16  # chunk and slice starts stay 16-byte aligned for the widest accesses
# Splitting a chunk into one slice per lane hides one slice's reduction behind the other's
# transfer, at the price of one more NCCL transfer's fixed cost (tens of microseconds over
# NVLink or InfiniBand, milliseconds over sockets). It pays for slices whose reduction
# clearly outlasts that: a 64 MiB slice of fp32 partials moves 192 MiB through the kernel,
# about 50 µs at 4 TB/s.
PIPELINE_MIN_SLICE_BYTES = 64 << 20
KINDS = ("all_reduce", "reduce_scatter")

Bounds = Tuple[int, int]


# ------------------------------------------------------------------------------ geometry

def all_reduce_chunks(count: int, world: int) -> List[Bounds]:
    """Chunk ``c`` of an all-reduce of ``count`` elements is ``[start, stop)``: equal,
    16-element-aligned shares, the last one also holding the remainder."""
    share = (count // world) // ALIGN_ELEMS * ALIGN_ELEMS if world else 0
    return [(c * share, (c + 1) * share if c < world - 1 else count) for c in range(world)]


def reduce_scatter_chunks(recvcount: int, world: int) -> List[Bounds]:
    """Chunk ``c`` of a reduce-scatter is block ``c`` of the input (NCCL's semantics)."""
    return [(c * recvcount, (c + 1) * recvcount) for c in range(world)]


@dataclasses.dataclass(frozen=True)
class Geometry:
    """How a plan cuts its chunks and lays out its scratch memory: ``rounds`` slices of at
    most ``slice_elems`` elements per chunk; ``lanes`` x ``slots`` scratch buffers of one
    slice of ``acc_itemsize``-byte accumulators each."""

    rounds: int
    slice_elems: int
    lanes: int
    slots: int
    acc_itemsize: int

    @property
    def scratch_bytes(self) -> int:
        return self.lanes * self.slots * self.slice_elems * self.acc_itemsize

    def slot_offset(self, lane: int, slot: int) -> int:
        """Byte offset of scratch buffer ``(lane, slot)``."""
        return (lane * self.slots + slot) * self.slice_elems * self.acc_itemsize


def _align_up(n: int) -> int:
    return -(-n // ALIGN_ELEMS) * ALIGN_ELEMS


def _cut(longest: int, rounds: int, slots: int, acc_itemsize: int) -> Geometry:
    slice_elems = _align_up(-(-longest // rounds))
    rounds = -(-longest // slice_elems)  # aligning up may leave a round empty
    return Geometry(rounds, slice_elems, min(LANES, rounds), slots, acc_itemsize)


def geometry(chunks: Sequence[Bounds], world: int, acc_itemsize: int, stage_first: bool,
             scratch_bytes: int) -> Geometry:
    """The slicing of ``chunks``: ``LANES`` rounds when the longest chunk's partials fill
    ``LANES * PIPELINE_MIN_SLICE_BYTES``, else one; more only where the slices of those would
    not fit ``scratch_bytes``."""
    longest = max((stop - start for start, stop in chunks), default=0)
    # The send slot is needed once a slot is sent from: a staged first send, or any step past
    # the first (three or more ranks). Two ranks sending unstaged data receive only.
    slots = SLOTS if stage_first or world > 2 else 1
    if world <= 1 or longest == 0:
        return Geometry(0, 0, 0, slots, acc_itemsize)
    pipelined = longest * acc_itemsize >= LANES * PIPELINE_MIN_SLICE_BYTES
    cut = _cut(longest, LANES if pipelined else 1, slots, acc_itemsize)
    if cut.scratch_bytes <= scratch_bytes:
        return cut
    most = scratch_bytes // (LANES * slots * acc_itemsize) // ALIGN_ELEMS * ALIGN_ELEMS
    if most <= 0:
        raise CupycollValueError(
            f"ring scratch of {scratch_bytes} bytes is too small: it needs at least "
            f"{LANES * slots * ALIGN_ELEMS * acc_itemsize} bytes for {acc_itemsize}-byte accumulators")
    return _cut(longest, -(-longest // most), slots, acc_itemsize)


def round_count(chunks: Sequence[Bounds], slice_elems: int) -> int:
    longest = max((stop - start for start, stop in chunks), default=0)
    return -(-longest // slice_elems)


def slice_bounds(chunk: Bounds, round_index: int, slice_elems: int) -> Bounds:
    """Slice ``round_index`` of ``chunk``; empty (start == stop) past the chunk's end."""
    start, stop = chunk
    begin = min(start + round_index * slice_elems, stop)
    return begin, min(begin + slice_elems, stop)


def describe_scratch(scratch_bytes: int) -> str:
    """The slicing and scratch policy under the limit ``scratch_bytes``, in one line (for
    reports such as the benchmark's header)."""
    return (f"grown to each call's plan, at most {scratch_bytes} bytes ({scratch_bytes / (1 << 20):g} MiB) "
            f"per communicator; {LANES} rounds per ring step from "
            f"{LANES * PIPELINE_MIN_SLICE_BYTES >> 20} MiB of partials per chunk, 1 below, more "
            f"where the limit binds")


# ------------------------------------------------------------------------------ step order

def right_of(rank: int, world: int) -> int:
    return (rank + 1) % world


def left_of(rank: int, world: int) -> int:
    return (rank - 1) % world


def reduce_scatter_send_chunk(rank: int, step: int, world: int) -> int:
    return (rank - step - 1) % world


def reduce_scatter_recv_chunk(rank: int, step: int, world: int) -> int:
    return (rank - step - 2) % world


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
class Gather:
    """All-reduce's last phase, the same on every rank: an all-gather of the finished
    ``[c * share, (c + 1) * share)`` of every rank ``c`` into the output, and a broadcast of
    the output's ``[tail_start, tail_stop)`` from rank ``root`` (bytes, no arithmetic)."""

    share: int
    tail_start: int
    tail_stop: int
    root: int


@dataclasses.dataclass(frozen=True)
class Alone:
    """World size 1: the output is this rank's input (``transform``: finished through the
    kernels, for PREMUL_SUM's scaling; otherwise a plain copy)."""

    start: int
    stop: int
    transform: bool


Action = Union[Stage, Exchange, Reduce, Gather, Alone]


def reduce_scatter_plan(rank: int, world: int, chunks: Sequence[Bounds], cut: Geometry,
                        stage_first: bool, scatter: bool) -> List[Action]:
    """Rank ``rank``'s reduce-scatter phase, in issue order.

    ``stage_first``: convert the first contribution into scratch before sending it.
    ``scatter``: the output holds only the owned chunk (reduce-scatter), so the final
    results go to ``start - chunks[rank][0]``; otherwise to ``start`` (all-reduce).

    Rounds run in waves of ``cut.lanes``; within a wave each step is issued lane after lane,
    so the GPU can move one lane's data while it reduces the other's.
    """
    if world == 1 or cut.rounds == 0:
        return []
    own_base = chunks[rank][0] if scatter else 0
    plan: List[Action] = []
    for wave in range(0, cut.rounds, cut.lanes):
        wave_rounds = [(k, k - wave) for k in range(wave, min(wave + cut.lanes, cut.rounds))]
        if stage_first:
            for k, lane in wave_rounds:
                chunk = reduce_scatter_send_chunk(rank, 0, world)
                start, stop = slice_bounds(chunks[chunk], k, cut.slice_elems)
                plan.append(Stage(k, lane, _send_slot(0), chunk, start, stop))
        for step in range(world - 1):
            for k, lane in wave_rounds:
                send_chunk = reduce_scatter_send_chunk(rank, step, world)
                recv_chunk = reduce_scatter_recv_chunk(rank, step, world)
                send = slice_bounds(chunks[send_chunk], k, cut.slice_elems)
                recv = slice_bounds(chunks[recv_chunk], k, cut.slice_elems)
                from_scratch = stage_first or step > 0
                plan.append(Exchange(k, step, lane, send_chunk, *send,
                                     _send_slot(step) if from_scratch else None,
                                     recv_chunk, *recv, _recv_slot(step)))
                final = step == world - 2
                plan.append(Reduce(k, step, lane, _recv_slot(step), recv_chunk, *recv, final,
                                   recv[0] - own_base if final else None))
    return plan


def gather_plan(world: int, chunks: Sequence[Bounds]) -> List[Action]:
    """All-reduce's gather phase: one :class:`Gather` (none for a single rank)."""
    if world == 1:
        return []
    share = chunks[0][1] - chunks[0][0]
    return [Gather(share, world * share, chunks[-1][1], world - 1)]


def _recv_slot(step: int) -> int:
    return step % SLOTS


def _send_slot(step: int) -> int:
    # What step s sends is what step s - 1 received and reduced in place; step 0 sends
    # what Stage put in the slot step 0 does not receive into.
    return (step + 1) % SLOTS


@dataclasses.dataclass(frozen=True)
class Plan:
    """One rank's whole call: its geometry and its actions in issue order."""

    kind: str
    rank: int
    world: int
    count: int  # all-reduce: elements; reduce-scatter: elements per rank (recvcount)
    dtype: str
    op: str
    geometry: Geometry
    actions: Tuple[Action, ...]

    @property
    def scratch_bytes(self) -> int:
        return self.geometry.scratch_bytes


def build_plan(kind: str, rank: int, world: int, count: int, dtype: str, op: str,
               scratch_bytes: int) -> Plan:
    """Rank ``rank``'s plan for ``kind`` (``"all_reduce"``, or ``"reduce_scatter"`` whose
    ``count`` is the per-rank recvcount), with at most ``scratch_bytes`` of scratch."""
    check(dtype, op)
    if kind not in KINDS:
        raise CupycollValueError(f"plan kind {kind!r}: expected all_reduce or reduce_scatter")
    acc_itemsize = ELEMENTS[dtype].acc_itemsize
    stage_first = stages_first_contribution(dtype, op)
    if world == 1:
        return Plan(kind, rank, world, count, dtype, op, Geometry(0, 0, 0, 0, acc_itemsize),
                    (Alone(0, count, op == "premul_sum"),))
    scatter = kind == "reduce_scatter"
    chunks = reduce_scatter_chunks(count, world) if scatter else all_reduce_chunks(count, world)
    cut = geometry(chunks, world, acc_itemsize, stage_first, scratch_bytes)
    actions = reduce_scatter_plan(rank, world, chunks, cut, stage_first, scatter)
    if not scatter:
        actions += gather_plan(world, chunks)
    return Plan(kind, rank, world, count, dtype, op, cut, tuple(actions))
