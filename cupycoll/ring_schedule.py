"""The ring algorithm's schedule, as plain data, and a numpy simulator that runs it.

:mod:`cupycoll.ring` executes the plans built here on the GPU, action by action, in list
order; the simulator executes the very same plans with numpy, one array per rank, so the
CPU tests of this module test the schedule the GPU runs.

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

Deliberately left out: CuPy, torch, streams and pointers (see :mod:`cupycoll.ring`). The
simulator models values only, not timing.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np

from ._kernels import ELEMENTS, check, op_struct, stages_first_contribution
from .errors import CupycollValueError

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


# ------------------------------------------------------------------------------ simulator

class ScheduleError(RuntimeError):
    """The ranks' plans disagree (a sender and its receiver name different slices)."""


def numpy_dtype_name(array: np.ndarray) -> str:
    """The dtype name of a numpy array, as this module names dtypes (bf16 has no numpy
    type: pass ``dtype="bfloat16"`` with uint16 bit patterns)."""
    name = "bool" if array.dtype == np.bool_ else array.dtype.name
    if name not in ELEMENTS or name == "bfloat16":
        raise CupycollValueError(f"numpy dtype {array.dtype} has no ring element")
    return name


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) widened exactly to float32."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """float32 rounded to bf16 bit patterns, nearest-even, NaN kept quiet (as the kernel)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    with np.errstate(over="ignore"):
        rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16
    quiet = (bits >> 16) | 0x0040
    return np.where(nan, quiet, rounded).astype(np.uint16)


class _Arithmetic:
    """The kernels' element arithmetic (ring_common.cuh / ring_reduce.cu) in numpy."""

    def __init__(self, dtype: str, op: str, premul: Optional[float], divisor: int):
        check(dtype, op)
        self.dtype = dtype
        self.element = ELEMENTS[dtype]
        self.op = op_struct(dtype, op)
        self.acc = np.dtype(self.element.acc)
        self.premul = op == "premul_sum"
        if self.premul and premul is None:
            raise CupycollValueError("premul_sum needs a factor")
        self.factor = self.acc.type(premul) if self.premul else None
        self.average = self.op == "OpAvg"
        self.divisor = divisor

    def own(self, local: np.ndarray) -> np.ndarray:
        if self.dtype == "bfloat16":
            value = bf16_to_f32(local)
        else:
            value = np.asarray(local).astype(self.acc)
        if self.premul:
            value = value * self.factor
        return value

    def combine(self, own: np.ndarray, incoming: np.ndarray) -> np.ndarray:
        a, b = own, incoming
        with np.errstate(over="ignore", invalid="ignore"):
            if self.op in ("OpSum", "OpAvg", "OpPremulSum"):
                return (a + b).astype(self.acc)
            if self.op == "OpProd":
                return (a * b).astype(self.acc)
            if self.op == "OpMin":
                return np.where((b < a) | (b != b), b, a)
            if self.op == "OpMax":
                return np.where((b > a) | (b != b), b, a)
        if self.op == "OpBand":
            return a & b
        if self.op == "OpBor":
            return a | b
        if self.op == "OpBxor":
            return a ^ b
        raise CupycollValueError(f"no numpy model of {self.op}")

    def finish(self, acc: np.ndarray) -> np.ndarray:
        if self.average:
            if self.element.family == "float":
                acc = (acc / self.acc.type(self.divisor)).astype(self.acc)
            else:  # C division truncates toward zero; numpy's // floors
                wide = acc.astype(np.int64)
                quotient = wide // self.divisor
                quotient += ((wide % self.divisor) != 0) & (wide < 0)
                acc = quotient.astype(self.acc)
        if self.dtype == "bfloat16":
            return f32_to_bf16(acc)
        return acc.astype(self.element.storage)


def _as_inputs(inputs: Sequence[np.ndarray], dtype: Optional[str]):
    arrays = [np.ascontiguousarray(x).reshape(-1) for x in inputs]
    if not arrays:
        raise CupycollValueError("the simulator needs at least one rank")
    name = dtype or numpy_dtype_name(arrays[0])
    storage = np.dtype(ELEMENTS[name].storage) if name in ELEMENTS else None
    for x in arrays:
        if storage is None or x.dtype.itemsize != storage.itemsize or len(x) != len(arrays[0]):
            raise CupycollValueError("every rank's input must have the same length and dtype")
    # Copies: an in-place simulation writes into them.
    return name, [x.view(storage).copy() for x in arrays]


def _run(plans: List[List[Action]], locals_: List[np.ndarray], outputs: List[np.ndarray],
         arithmetic: _Arithmetic, slice_elems: int) -> None:
    world = len(plans)
    if len({len(plan) for plan in plans}) != 1:
        raise ScheduleError("ranks have plans of different lengths")
    scratch = [{(lane, slot): np.zeros(slice_elems, arithmetic.acc)
                for lane in range(LANES) for slot in range(SLOTS)} for _ in range(world)]
    for index in range(len(plans[0])):
        actions = [plan[index] for plan in plans]
        kinds = {type(a) for a in actions}
        if len(kinds) != 1:
            raise ScheduleError(f"action {index}: ranks disagree on its kind ({kinds})")
        if isinstance(actions[0], (Exchange, Forward)):
            _deliver(index, actions, locals_, outputs, scratch)
            continue
        for rank, action in enumerate(actions):
            local, out, mine = locals_[rank], outputs[rank], scratch[rank]
            if isinstance(action, Stage):
                n = action.stop - action.start
                mine[action.lane, action.slot][:n] = arithmetic.own(local[action.start:action.stop])
            elif isinstance(action, Reduce):
                n = action.stop - action.start
                slot = mine[action.lane, action.slot]
                value = arithmetic.combine(arithmetic.own(local[action.start:action.stop]), slot[:n])
                if action.final:
                    out[action.out_start:action.out_start + n] = arithmetic.finish(value)
                else:
                    slot[:n] = value
            elif isinstance(action, Alone):
                if action.transform:
                    out[action.start:action.stop] = arithmetic.finish(
                        arithmetic.own(local[action.start:action.stop]))
                else:
                    out[action.start:action.stop] = local[action.start:action.stop]


def _deliver(index, actions, locals_, outputs, scratch) -> None:
    """Every rank sends, then every rank receives what its left neighbour sent."""
    world = len(actions)
    messages = []
    for rank, action in enumerate(actions):
        if isinstance(action, Exchange):
            if action.send_slot is None:
                data = locals_[rank][action.send_start:action.send_stop]
            else:
                n = action.send_stop - action.send_start
                data = scratch[rank][action.lane, action.send_slot][:n]
        else:
            data = outputs[rank][action.send_start:action.send_stop]
        messages.append(((action.send_chunk, action.send_start, action.send_stop), data.copy()))
    for rank, action in enumerate(actions):
        (chunk, start, stop), data = messages[left_of(rank, world)]
        if (chunk, start, stop) != (action.recv_chunk, action.recv_start, action.recv_stop):
            raise ScheduleError(
                f"action {index}: rank {rank} expects chunk {action.recv_chunk} "
                f"[{action.recv_start}, {action.recv_stop}) but its left neighbour sends "
                f"chunk {chunk} [{start}, {stop})")
        if isinstance(action, Exchange):
            scratch[rank][action.lane, action.recv_slot][:stop - start] = data
        else:
            outputs[rank][start:stop] = data


def _restore(name: str, outputs: List[np.ndarray]) -> List[np.ndarray]:
    return [out.view(np.bool_) if name == "bool" else out for out in outputs]


def simulate_all_reduce(inputs: Sequence[np.ndarray], op: str, slice_elems: int = 1 << 16,
                        dtype: Optional[str] = None, premul: Optional[float] = None,
                        in_place: bool = False) -> List[np.ndarray]:
    """Run the all-reduce schedule with numpy: ``inputs[r]`` is rank r's flat input;
    returns each rank's output. ``dtype`` defaults to the arrays' (pass ``"bfloat16"``
    with uint16 bit patterns); ``premul`` is PREMUL_SUM's factor (in the accumulation
    type, as a Python float reaches the kernels). ``in_place``: the output is the input
    buffer, so a schedule that overwrote data it still needs would show it."""
    name, locals_ = _as_inputs(inputs, dtype)
    world, count = len(locals_), len(locals_[0])
    arithmetic = _Arithmetic(name, op, premul, world)
    plans = [all_reduce_plan(r, world, count, slice_elems, name, op) for r in range(world)]
    if in_place:
        outputs = locals_
    else:
        # Filled with a byte pattern, not zeros, so an element never written shows.
        dtype_ = locals_[0].dtype
        outputs = [np.full(count * dtype_.itemsize, 0x5A, np.uint8).view(dtype_)
                   for _ in range(world)]
    _run(plans, locals_, outputs, arithmetic, slice_elems)
    return _restore(name, outputs)


def simulate_reduce_scatter(inputs: Sequence[np.ndarray], op: str, slice_elems: int = 1 << 16,
                            dtype: Optional[str] = None, premul: Optional[float] = None,
                            in_place: bool = False) -> List[np.ndarray]:
    """Run the reduce-scatter schedule with numpy: ``inputs[r]`` holds ``world`` blocks;
    rank r's output is the reduction of block r. ``in_place``: the output is block r of
    the input itself (NCCL's in-place reduce-scatter)."""
    name, locals_ = _as_inputs(inputs, dtype)
    world, count = len(locals_), len(locals_[0])
    if count % world:
        raise CupycollValueError(f"reduce-scatter input of {count} elements is not {world} blocks")
    recvcount = count // world
    arithmetic = _Arithmetic(name, op, premul, world)
    plans = [reduce_scatter_full_plan(r, world, recvcount, slice_elems, name, op)
             for r in range(world)]
    if in_place:
        outputs = [local[r * recvcount:(r + 1) * recvcount] for r, local in enumerate(locals_)]
    else:
        dtype_ = locals_[0].dtype
        outputs = [np.full(recvcount * dtype_.itemsize, 0x5A, np.uint8).view(dtype_)
                   for _ in range(world)]
    _run(plans, locals_, outputs, arithmetic, slice_elems)
    return _restore(name, [out.copy() for out in outputs])
