"""A numpy model of the ring kernels running the schedule: the tests' oracle (test-only
code, not shipped: tests import it as ``ring_simulator``).

:func:`simulate_all_reduce` and :func:`simulate_reduce_scatter` build every rank's plan
with :func:`cupycoll.ring.schedule.build_plan` (what :mod:`cupycoll.ring.algorithm` runs, for the
same ``scratch_bytes``) and run the plans in lock step, one numpy array per rank, with the
scratch buffers the plan's geometry lays out: ``Stage``/``Reduce``/``Alone`` apply the
kernels' element arithmetic (``_Arithmetic``: widen to the accumulation type, PREMUL
scaling, the op, AVG's division, one rounding at the end, bf16 as uint16 bit patterns),
``Exchange`` delivers what each rank's left neighbour sent, checking that sender and
receiver name the same slice, and ``Gather`` copies every owner's finished chunk to every
rank, checking that all ranks name the same one (:class:`ScheduleError` otherwise). The GPU
tests compare the ring's results with these bit for bit.

Deliberately left out: timing and streams (all ranks run action ``i`` before any runs
``i + 1``; the stream order is :func:`cupycoll.ring.stream_order.issue`, tested on its own),
pointers and CuPy. It reads the package's tables (:mod:`cupycoll.ring.kernels`,
:mod:`cupycoll.ring.schedule`); the package never imports it.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

from cupycoll.config import DEFAULT_RING_SCRATCH_BYTES
from cupycoll.ring.kernels import ELEMENTS, check, op_struct
from cupycoll.errors import CupycollValueError
from cupycoll.ring.schedule import (
    Alone,
    Exchange,
    Gather,
    Plan,
    Reduce,
    Stage,
    build_plan,
    left_of,
)


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


def _run(plans: List[Plan], locals_: List[np.ndarray], outputs: List[np.ndarray],
         arithmetic: _Arithmetic) -> None:
    world = len(plans)
    if len({len(plan.actions) for plan in plans}) != 1 or len({plan.geometry for plan in plans}) != 1:
        raise ScheduleError("ranks have plans of different lengths or geometries")
    cut = plans[0].geometry
    scratch = [{(lane, slot): np.zeros(cut.slice_elems, arithmetic.acc)
                for lane in range(cut.lanes) for slot in range(cut.slots)} for _ in range(world)]
    for index in range(len(plans[0].actions)):
        actions = [plan.actions[index] for plan in plans]
        kinds = {type(a) for a in actions}
        if len(kinds) != 1:
            raise ScheduleError(f"action {index}: ranks disagree on its kind ({kinds})")
        if isinstance(actions[0], Exchange):
            _deliver(index, actions, locals_, scratch)
            continue
        if isinstance(actions[0], Gather):
            _gather(index, actions, outputs)
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


def _deliver(index, actions, locals_, scratch) -> None:
    """Every rank sends, then every rank receives what its left neighbour sent."""
    world = len(actions)
    messages = []
    for rank, action in enumerate(actions):
        if action.send_slot is None:
            data = locals_[rank][action.send_start:action.send_stop]
        else:
            n = action.send_stop - action.send_start
            data = scratch[rank][action.lane, action.send_slot][:n]
        messages.append(((action.send_chunk, action.send_start, action.send_stop), data.copy()))
    for rank, action in enumerate(actions):
        (chunk, start, stop), data = messages[left_of(rank, world)]
        if (chunk, start, stop) != (action.recv_chunk, action.recv_start, action.recv_stop):
            raise ScheduleError(
                f"action {index}: rank {rank} expects chunk {action.recv_chunk} "
                f"[{action.recv_start}, {action.recv_stop}) but its left neighbour sends "
                f"chunk {chunk} [{start}, {stop})")
        scratch[rank][action.lane, action.recv_slot][:stop - start] = data


def _gather(index, actions, outputs) -> None:
    """Rank ``c``'s ``[c * share, (c + 1) * share)`` and the root's tail, to every rank."""
    if len(set(actions)) != 1:
        raise ScheduleError(f"action {index}: ranks gather differently: {set(actions)}")
    gather = actions[0]
    share, world = gather.share, len(outputs)
    finished = [out.copy() for out in outputs]
    for out in outputs:
        for owner in range(world):
            out[owner * share:(owner + 1) * share] = finished[owner][owner * share:(owner + 1) * share]
        out[gather.tail_start:gather.tail_stop] = finished[gather.root][gather.tail_start:gather.tail_stop]


def _restore(name: str, outputs: List[np.ndarray]) -> List[np.ndarray]:
    return [out.view(np.bool_) if name == "bool" else out for out in outputs]


def simulate_all_reduce(inputs: Sequence[np.ndarray], op: str,
                        scratch_bytes: int = DEFAULT_RING_SCRATCH_BYTES,
                        dtype: Optional[str] = None, premul: Optional[float] = None,
                        in_place: bool = False) -> List[np.ndarray]:
    """Run the all-reduce schedule with numpy: ``inputs[r]`` is rank r's flat input;
    returns each rank's output. ``scratch_bytes``: the ring's scratch limit, which decides
    the slicing (a small one gives many rounds). ``dtype`` defaults to the arrays' (pass
    ``"bfloat16"`` with uint16 bit patterns); ``premul`` is PREMUL_SUM's factor (in the
    accumulation type, as a Python float reaches the kernels). ``in_place``: the output is
    the input buffer, so a schedule that overwrote data it still needs would show it."""
    name, locals_ = _as_inputs(inputs, dtype)
    world, count = len(locals_), len(locals_[0])
    arithmetic = _Arithmetic(name, op, premul, world)
    plans = [build_plan("all_reduce", r, world, count, name, op, scratch_bytes) for r in range(world)]
    if in_place:
        outputs = locals_
    else:
        # Filled with a byte pattern, not zeros, so an element never written shows.
        dtype_ = locals_[0].dtype
        outputs = [np.full(count * dtype_.itemsize, 0x5A, np.uint8).view(dtype_)
                   for _ in range(world)]
    _run(plans, locals_, outputs, arithmetic)
    return _restore(name, outputs)


def simulate_reduce_scatter(inputs: Sequence[np.ndarray], op: str,
                            scratch_bytes: int = DEFAULT_RING_SCRATCH_BYTES,
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
    plans = [build_plan("reduce_scatter", r, world, recvcount, name, op, scratch_bytes)
             for r in range(world)]
    if in_place:
        outputs = [local[r * recvcount:(r + 1) * recvcount] for r, local in enumerate(locals_)]
    else:
        dtype_ = locals_[0].dtype
        outputs = [np.full(recvcount * dtype_.itemsize, 0x5A, np.uint8).view(dtype_)
                   for _ in range(world)]
    _run(plans, locals_, outputs, arithmetic)
    return _restore(name, [out.copy() for out in outputs])
