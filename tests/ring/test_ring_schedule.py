"""CPU tier: the ring schedule (cupycoll.ring.schedule) and its stream order
(cupycoll.ring.stream_order), run by its numpy simulator (tests/ring_simulator.py).

The GPU executes the same plans (:func:`cupycoll.ring.algorithm.plan_for` builds them through the
same functions) and the same stream commands (:func:`cupycoll.ring.stream_order.issue`), so what is proven here about
coverage, step order, reduction order, in-place safety and stream ordering holds there.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest
import torch

import ring_simulator as sim
from cupycoll.ring import algorithm as ring
from cupycoll.ring import schedule as rs
from cupycoll.ring import stream_order as so
from cupycoll.ring.kernels import ELEMENTS, all_pairs
from cupycoll.errors import CupycollValueError

pytestmark = pytest.mark.any_stack  # its subject is the same on every stack: one CI leg runs it

WORLDS = range(1, 10)
SIZES = (0, 1, 3, 17, 100, 1001)  # 3 < most worlds; 17, 1001: uneven


def _values(rank, n, dtype, rng=None):
    """Small integers: every reduction below is exact in every dtype, so the ring's order
    cannot change the result and numpy's reduction is an exact reference."""
    base = (np.arange(n, dtype=np.int64) * 7 + rank * 3) % 5 + 1
    if rng is not None:
        base = rng.integers(1, 4, n)
    if dtype == "bool":
        return base % 2 == 0
    if dtype == "bfloat16":
        return sim.f32_to_bf16(base.astype(np.float32))
    return base.astype(dtype)


def _reference(inputs, dtype, op, premul=None):
    world = len(inputs)
    if dtype == "bfloat16":
        xs = [sim.bf16_to_f32(x).astype(np.float64) for x in inputs]
    elif dtype in ("float16", "float32", "float64"):
        xs = [x.astype(np.float64) for x in inputs]
    else:
        xs = list(inputs)
    if dtype == "bool":
        if op in ("sum", "max", "bor"):
            out = functools.reduce(np.logical_or, xs)
        elif op in ("product", "min", "band"):
            out = functools.reduce(np.logical_and, xs)
        else:
            out = functools.reduce(np.logical_xor, xs)
        return out
    red = {
        "sum": functools.partial(functools.reduce, np.add),
        "avg": functools.partial(functools.reduce, np.add),
        "premul_sum": lambda v: functools.reduce(np.add, [x * premul for x in v]),
        "product": functools.partial(functools.reduce, np.multiply),
        "min": functools.partial(functools.reduce, np.minimum),
        "max": functools.partial(functools.reduce, np.maximum),
        "band": functools.partial(functools.reduce, np.bitwise_and),
        "bor": functools.partial(functools.reduce, np.bitwise_or),
        "bxor": functools.partial(functools.reduce, np.bitwise_xor),
    }[op]
    with np.errstate(over="ignore"):
        out = red(xs)
    if op == "avg":
        if dtype in ("float16", "bfloat16", "float32", "float64"):
            out = out / world
        else:  # C's truncating division, on the wrapped sum
            out = np.trunc(out.astype(np.float64) / world).astype(out.dtype)
    if dtype == "bfloat16":
        return sim.f32_to_bf16(out.astype(np.float32))
    return out.astype(dtype)


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint8) if x.dtype == np.bool_ else x.view(f"u{x.dtype.itemsize}")


def _assert_same_bits(a, b, what):
    assert a.shape == b.shape, what
    assert np.array_equal(_bits(a), _bits(b)), f"{what}: {a[:8]} != {b[:8]}"


# ------------------------------------------------------------------------------- geometry

TINY = ring.MIN_SCRATCH_BYTES  # the smallest scratch a ring accepts: slices of 16 to 128 elements


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("count", SIZES + (4099,))
def test_all_reduce_chunks_cover_every_element_once(world, count):
    chunks = rs.all_reduce_chunks(count, world)
    assert len(chunks) == world
    assert chunks[0][0] == 0 and chunks[-1][1] == count
    for (a0, a1), (b0, b1) in zip(chunks, chunks[1:]):
        assert a1 == b0 and a0 <= a1
    for start, _ in chunks:
        assert start % rs.ALIGN_ELEMS == 0
    # equal shares but the last, which also holds a remainder of fewer than 16 per rank
    shares = {stop - start for start, stop in chunks[:-1]}
    assert len(shares) <= 1
    share = chunks[0][1] - chunks[0][0]
    assert 0 <= (chunks[-1][1] - chunks[-1][0]) - share < rs.ALIGN_ELEMS * world


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("slice_elems", (16, 32, 48))
def test_slices_cover_every_chunk_once(world, slice_elems):
    for chunks in (rs.all_reduce_chunks(1001, world), rs.reduce_scatter_chunks(37, world)):
        rounds = rs.round_count(chunks, slice_elems)
        for chunk in chunks:
            covered = []
            for k in range(rounds):
                start, stop = rs.slice_bounds(chunk, k, slice_elems)
                assert 0 <= stop - start <= slice_elems
                covered.extend(range(start, stop))
            assert covered == list(range(*chunk))


@pytest.mark.parametrize("world", (2, 3, 8))
@pytest.mark.parametrize("acc", (1, 4, 8))
@pytest.mark.parametrize("staged", (False, True))
def test_geometry_cuts_few_rounds_whatever_the_size_and_fits_the_scratch(world, acc, staged):
    unlimited = 1 << 50
    for longest in (1, 15, 1000, 1 << 20, 1 << 26, (1 << 30) + 7):
        chunks = [(0, longest)] * world
        cut = rs.geometry(chunks, world, acc, staged, unlimited)
        pipelined = longest * acc >= rs.LANES * rs.PIPELINE_MIN_SLICE_BYTES
        assert cut.rounds == (rs.LANES if pipelined else 1), (longest, cut)
        assert cut.slice_elems % rs.ALIGN_ELEMS == 0 and cut.rounds * cut.slice_elems >= longest
        assert (cut.rounds - 1) * cut.slice_elems < longest  # no empty round
        assert cut.lanes == min(rs.LANES, cut.rounds)
        assert cut.slots == (2 if staged or world > 2 else 1)
        for limit in (TINY, 1 << 20, 64 << 20):
            small = rs.geometry(chunks, world, acc, staged, limit)
            assert small.scratch_bytes <= limit
            assert small.rounds * small.slice_elems >= longest
            if cut.scratch_bytes <= limit:
                assert small == cut  # the limit only matters where it binds
            else:  # as few rounds as fit: one fewer would need wider slices than fit
                fewer = -(-longest // (small.rounds - 1)) if small.rounds > 1 else None
                assert fewer is None or rs.LANES * small.slots * fewer * acc > limit
    with pytest.raises(CupycollValueError, match="too small"):
        rs.geometry([(0, 1 << 20)] * 2, 2, 8, True, 100)


@pytest.mark.parametrize("module", [rs, so], ids=["schedule", "stream_order"])
def test_the_schedule_is_plain_data(module):
    """The schedule and its stream order import the standard library and cupycoll only:
    numpy is the simulator's (ring_simulator), not the schedule's."""
    import ast
    import pathlib

    tree = ast.parse(pathlib.Path(module.__file__).read_text(encoding="utf-8"))
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.level == 0}
    assert imported <= {"__future__", "dataclasses", "typing"}, imported


# ----------------------------------------------------------------------------- step order

def _cut(chunks, world, staged):
    return rs.geometry(chunks, world, 4, staged, TINY)  # 16- to 64-element slices: many rounds


@pytest.mark.parametrize("world", range(2, 10))
@pytest.mark.parametrize("stage_first", (False, True))
@pytest.mark.parametrize("scatter", (False, True))
def test_plans_are_consistent_across_ranks(world, stage_first, scatter):
    count = 301 if scatter else 1001
    chunks = rs.reduce_scatter_chunks(count, world) if scatter else rs.all_reduce_chunks(count, world)
    cut = _cut(chunks, world, stage_first)
    assert cut.rounds > 2
    plans = [rs.reduce_scatter_plan(r, world, chunks, cut, stage_first, scatter) for r in range(world)]
    if not scatter:
        plans = [p + rs.gather_plan(world, chunks) for p in plans]
    assert len({len(p) for p in plans}) == 1
    for index in range(len(plans[0])):
        actions = [p[index] for p in plans]
        assert len({type(a) for a in actions}) == 1
        if isinstance(actions[0], rs.Gather):
            assert len(set(actions)) == 1  # one collective, the same on every rank
        for rank, action in enumerate(actions):
            if isinstance(action, rs.Exchange):
                left = actions[(rank - 1) % world]
                # each rank receives at step s exactly what its left neighbour sends at step s
                assert (action.recv_chunk, action.recv_start, action.recv_stop) == \
                       (left.send_chunk, left.send_start, left.send_stop)
                assert action.step == left.step
            if isinstance(action, (rs.Stage, rs.Exchange, rs.Reduce)):
                assert 0 <= action.lane < cut.lanes
            for slot in ("slot", "send_slot", "recv_slot"):
                if getattr(action, slot, None) is not None:
                    assert 0 <= getattr(action, slot) < cut.slots


@pytest.mark.parametrize("world", range(2, 10))
def test_every_local_element_is_used_once_and_owner_finishes_its_chunk(world):
    count = 1001
    chunks = rs.all_reduce_chunks(count, world)
    for stage_first in (False, True):
        cut = _cut(chunks, world, stage_first)
        for rank in range(world):
            plan = rs.reduce_scatter_plan(rank, world, chunks, cut, stage_first, False)
            used = np.zeros(count, int)
            finished = np.zeros(count, int)
            for a in plan:
                if isinstance(a, (rs.Stage, rs.Reduce)):
                    used[a.start:a.stop] += 1
                if isinstance(a, rs.Exchange) and a.send_slot is None:
                    used[a.send_start:a.send_stop] += 1
                if isinstance(a, rs.Reduce) and a.final:
                    assert a.chunk == rank
                    finished[a.out_start:a.out_start + a.stop - a.start] += 1
            assert (used == 1).all()
            expected = np.zeros(count, int)
            expected[slice(*chunks[rank])] = 1
            assert (finished == expected).all()


def test_reduction_order_of_a_chunk_starts_after_its_owner():
    world = 5
    chunks = rs.all_reduce_chunks(400, world)
    cut = _cut(chunks, world, True)
    assert cut.rounds > 1
    order = {(c, k): [] for c in range(world) for k in range(cut.rounds)}
    plans = [rs.reduce_scatter_plan(r, world, chunks, cut, True, False) for r in range(world)]
    for index in range(len(plans[0])):
        for rank in range(world):
            a = plans[rank][index]
            if isinstance(a, (rs.Stage, rs.Reduce)):
                order[a.chunk, a.round].append(rank)
    for (c, _), ranks in order.items():
        assert ranks == [(c + 1 + i) % world for i in range(world)]


# ------------------------------------------------------------------------------ simulator

_OPS_FOR_SWEEP = [(d, o) for d, o in all_pairs()]


@pytest.mark.parametrize("dtype,op", _OPS_FOR_SWEEP)
def test_simulated_all_reduce_matches_reference(dtype, op):
    premul = 0.5 if op == "premul_sum" else None
    for world in WORLDS:
        for count in SIZES:
            inputs = [_values(r, count, dtype) for r in range(world)]
            expected = _reference(inputs, dtype, op, premul)
            for in_place in (False, True):
                # 64- to 512-element slices: several rounds, and waves of both lanes
                outs = sim.simulate_all_reduce(inputs, op, scratch_bytes=4 * TINY, dtype=dtype,
                                              premul=premul, in_place=in_place)
                for rank, out in enumerate(outs):
                    _assert_same_bits(out, np.asarray(expected).astype(out.dtype),
                                      f"{dtype} {op} world {world} count {count} rank {rank}")


@pytest.mark.parametrize("dtype,op", _OPS_FOR_SWEEP)
def test_simulated_reduce_scatter_matches_reference(dtype, op):
    premul = 0.5 if op == "premul_sum" else None
    for world in WORLDS:
        for recvcount in (0, 1, 5, 33):
            inputs = [_values(r, world * recvcount, dtype) for r in range(world)]
            expected = np.asarray(_reference(inputs, dtype, op, premul))
            for in_place in (False, True):
                outs = sim.simulate_reduce_scatter(inputs, op, scratch_bytes=TINY, dtype=dtype,
                                                  premul=premul, in_place=in_place)
                for rank, out in enumerate(outs):
                    block = expected[rank * recvcount:(rank + 1) * recvcount].astype(out.dtype)
                    _assert_same_bits(out, block, f"{dtype} {op} world {world} rank {rank}")


@pytest.mark.parametrize("world", (2, 3, 7))
def test_many_slices_and_waves(world):
    rng = np.random.default_rng(world)
    count = 5000
    inputs = [rng.integers(-1000, 1000, count).astype(np.int64) for _ in range(world)]
    outs = sim.simulate_all_reduce(inputs, "sum", scratch_bytes=TINY)  # ~50 rounds, 25 waves
    for out in outs:
        _assert_same_bits(out, np.sum(inputs, axis=0), f"world {world}")
    per = count // world
    xs = [x[:per * world].astype(np.int32) for x in inputs]
    outs = sim.simulate_reduce_scatter(xs, "bxor", scratch_bytes=TINY)
    full = functools.reduce(np.bitwise_xor, xs)
    for rank, out in enumerate(outs):
        _assert_same_bits(out, full[rank * per:(rank + 1) * per], f"rank {rank}")


def test_integer_avg_truncates_like_c():
    inputs = [np.array([-7, 7, -1, 5, -128], np.int64), np.zeros(5, np.int64), np.zeros(5, np.int64)]
    out = sim.simulate_all_reduce(inputs, "avg")[0]
    assert out.tolist() == [-2, 2, 0, 1, -42]
    wrapped = [np.array([100], np.int8), np.array([100], np.int8)]  # 200 wraps to -56
    assert sim.simulate_all_reduce(wrapped, "avg")[0].tolist() == [-28]


def test_float_min_max_propagate_nan():
    a = np.array([np.nan, 1.0, 2.0], np.float32)
    b = np.array([0.0, np.nan, -1.0], np.float32)
    for op in ("min", "max"):
        out = sim.simulate_all_reduce([a, b], op)[0]
        assert np.isnan(out[0]) and np.isnan(out[1])
    assert sim.simulate_all_reduce([a, b], "min")[0][2] == -1.0


@pytest.mark.parametrize("world", (2, 3, 4, 8))
def test_fp16_accumulates_in_fp32_and_rounds_once(world):
    # 2048 + 1 + 1 ... : fp16 spacing at 2048 is 2, so adding 1 per hop in fp16 never
    # moves; fp32 partials keep every 1 and round once at the end.
    inputs = [np.full(40, 2048 if r == 0 else 1, np.float16) for r in range(world)]
    out = sim.simulate_all_reduce(inputs, "sum")[0]
    assert out.dtype == np.float16
    assert (out == np.float16(2048 + world - 1)).all()

    rng = np.random.default_rng(world)
    # magnitudes in [1/16, 4): every fp32 partial of <= 9 of them is exact, so the ring's
    # result must be the exact sum rounded to fp16 once
    xs = [(rng.uniform(0.0625, 4, 1001) * rng.choice([-1, 1], 1001)).astype(np.float16)
          for _ in range(world)]
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    for out in sim.simulate_all_reduce(xs, "sum", scratch_bytes=2 * TINY):
        _assert_same_bits(out, exact.astype(np.float16), "fp16 once-rounded")


@pytest.mark.parametrize("world", (2, 4, 5))
def test_bf16_accumulates_in_fp32_and_rounds_once(world):
    rng = np.random.default_rng(world)
    xs32 = [(rng.uniform(0.0625, 4, 777) * rng.choice([-1, 1], 777)).astype(np.float32) for _ in range(world)]
    xs = [torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16) for x in xs32]
    exact = np.sum([sim.bf16_to_f32(x).astype(np.float64) for x in xs], axis=0)
    expected = torch.from_numpy(exact.astype(np.float32)).to(torch.bfloat16).view(torch.int16).numpy()
    outs = sim.simulate_all_reduce(xs, "sum", dtype="bfloat16")
    for out in outs:
        assert np.array_equal(out.view(np.int16), expected)


@pytest.mark.parametrize("world", range(2, 10))
def test_results_identical_on_every_rank_for_random_floats(world):
    rng = np.random.default_rng(world)
    for dtype in ("float16", "float32", "float64"):
        xs = [rng.standard_normal(1001).astype(dtype) for _ in range(world)]
        outs = sim.simulate_all_reduce(xs, "sum", scratch_bytes=TINY)
        for out in outs[1:]:
            _assert_same_bits(out, outs[0], dtype)
        np.testing.assert_allclose(outs[0].astype(np.float64),
                                   np.sum([x.astype(np.float64) for x in xs], axis=0),
                                   rtol=1e-2 if dtype == "float16" else 1e-5, atol=1e-2)


def test_result_does_not_depend_on_the_slice_size():
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(3001).astype(np.float32) for _ in range(4)]
    base = sim.simulate_all_reduce(xs, "sum", scratch_bytes=TINY)[0]
    for scratch in (2 * TINY, 3 * TINY, 1 << 14, 1 << 20):
        _assert_same_bits(sim.simulate_all_reduce(xs, "sum", scratch_bytes=scratch)[0], base, str(scratch))


def test_premul_factor_is_applied_per_rank_in_the_accumulator():
    xs = [np.full(20, 3, np.float16) for _ in range(3)]
    out = sim.simulate_all_reduce(xs, "premul_sum", premul=1 / 3)[0]
    # fp32: 3 * fp32(1/3) = 1.0000000298 (rounded product), times three ranks -> ~3.0
    assert (out == np.float16(3.0)).all()


# ------------------------------------------------------------------------------ conversions

def test_bf16_conversion_matches_torch():
    rng = np.random.default_rng(1)
    bits = np.concatenate([
        rng.integers(0, 2**32, 200000, dtype=np.uint64).astype(np.uint32),
        np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0x00000001, 0x807FFFFF,
                  0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7F8000], np.uint32),
    ])
    values = bits.view(np.float32)
    ours = sim.f32_to_bf16(values)
    theirs = torch.from_numpy(values.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    finite = ~np.isnan(values)
    assert np.array_equal(ours[finite], theirs[finite])
    nan_out = sim.bf16_to_f32(ours[~finite])
    assert np.isnan(nan_out).all()
    back = sim.bf16_to_f32(theirs[finite])
    assert np.array_equal(back, torch.from_numpy(theirs[finite].view(np.int16)).view(torch.bfloat16).float().numpy())


# ----------------------------------------------------------------------------- stream order

def _accesses(action, rank, recvcount, in_place, kind):
    """(buffer, lo, hi, writes) for each memory range a Run action touches."""
    def recv(lo, hi):
        if in_place:  # the output is (a block of) the input buffer
            base = rank * recvcount if kind == "reduce_scatter" else 0
            return ("send", base + lo, base + hi)
        return ("recv", lo, hi)

    out = []
    if isinstance(action, rs.Stage):
        out += [(("send", action.start, action.stop), False),
                ((("slot", action.lane, action.slot), 0, action.stop - action.start), True)]
    elif isinstance(action, rs.Exchange):
        ns, nr = action.send_stop - action.send_start, action.recv_stop - action.recv_start
        if ns:
            src = ("send", action.send_start, action.send_stop) if action.send_slot is None \
                else (("slot", action.lane, action.send_slot), 0, ns)
            out.append((src, False))
        if nr:
            out.append(((("slot", action.lane, action.recv_slot), 0, nr), True))
    elif isinstance(action, rs.Reduce):
        n = action.stop - action.start
        out += [(("send", action.start, action.stop), False),
                ((("slot", action.lane, action.slot), 0, n), not action.final)]
        if action.final:
            out.append((recv(action.out_start, action.out_start + n), True))
    elif isinstance(action, rs.Gather):
        world = action.root + 1
        own = (rank * action.share, (rank + 1) * action.share)
        if rank == action.root:
            own = (own[0], action.tail_stop)
        out.append((recv(*own), False))  # this rank's finished chunk goes out...
        out += [(recv(lo, hi), True)  # ...every other chunk comes in
                for lo, hi in ((0, own[0]), (own[1], max(world * action.share, action.tail_stop)))
                if hi > lo]
    elif isinstance(action, rs.Alone):
        out += [(("send", action.start, action.stop), False), (recv(action.start, action.stop), True)]
    return [(buf, lo, hi, w) for (buf, lo, hi), w in out]


def _check_stream_order(commands, accesses_of):
    """Every two accesses to overlapping memory, one a write, from different streams, must
    be ordered by the records and waits (vector clocks). A pseudo-op on the caller's stream
    touching everything stands for the caller's work before and after."""
    streams = (so.CALLER, so.SIDE)
    everything = [(("send",), 0, 1 << 30, True), (("recv",), 0, 1 << 30, True), (("slot",), 0, 1 << 30, True)]
    clock = {s: [0, 0] for s in streams}
    events = {}
    ops = []
    sequence = [("run", so.CALLER, None)] + [("cmd", c) for c in commands] + [("run", so.CALLER, None)]
    for item in sequence:
        if item[0] == "run" or isinstance(item[1], so.Run):
            stream, action = (item[1], None) if item[0] == "run" else (item[1].stream, item[1].action)
            i = streams.index(stream)
            clock[stream][i] += 1
            acc = everything if action is None else accesses_of(action)
            ops.append((i, clock[stream][i], tuple(clock[stream]), acc))
        elif isinstance(item[1], so.Record):
            events[item[1].event] = tuple(clock[item[1].stream])
        elif isinstance(item[1], so.Wait):
            if item[1].event in events:
                seen = events[item[1].event]
                clock[item[1].stream] = [max(a, b) for a, b in zip(clock[item[1].stream], seen)]

    def ordered(a, b):
        return b[2][a[0]] >= a[1] or a[2][b[0]] >= b[1]

    def conflict(x, y):
        for (bx, lx, hx, wx) in x:
            for (by, ly, hy, wy) in y:
                same = bx == by or bx[0] == by[0] and (len(bx) == 1 or len(by) == 1)
                if same and lx < hy and ly < hx and (wx or wy):
                    return True
        return False

    for a, b in itertools.combinations(ops, 2):
        if a[0] != b[0] and conflict(a[3], b[3]):
            assert ordered(a, b), f"unordered accesses: {a[3]} vs {b[3]}"


@pytest.mark.parametrize("world", (1, 2, 3, 4, 5))
@pytest.mark.parametrize("kind", ("all_reduce", "reduce_scatter"))
@pytest.mark.parametrize("dtype", ("float16", "float32"))  # staged and unstaged first sends
@pytest.mark.parametrize("in_place", (False, True))
def test_stream_commands_order_every_conflicting_access(world, kind, dtype, in_place):
    for scratch in (TINY, rs.LANES * 2 * 48 * 4, ring.DEFAULT_RING_SCRATCH_BYTES):
        for count in (1, 7, 100, 2 ** 9 + 3):
            plan = ring.plan_for(kind, world - 1, world, count, dtype, "sum", scratch_bytes=scratch)
            commands = so.issue(plan)
            _check_stream_order(commands, lambda a: _accesses(a, world - 1, count, in_place, kind))
            side = any(isinstance(c, (so.Run, so.Record, so.Wait)) and c.stream == so.SIDE for c in commands)
            assert side == (plan.geometry.rounds > 1), (scratch, count, plan.geometry)


def test_a_plan_of_one_round_runs_on_the_callers_stream_alone():
    # Every action depends on the one before: a second stream would only add events.
    for world in (1, 2, 3, 8):
        for kind in rs.KINDS:
            plan = ring.plan_for(kind, 0, world, 1 << 20, "bfloat16", "sum")
            assert plan.geometry.rounds <= 1
            commands = so.issue(plan)
            assert commands and all(isinstance(c, so.Run) and c.stream == so.CALLER for c in commands)


def test_pruning_drops_only_orderings_already_implied():
    record = so.Record(so.CALLER, ("a",))
    commands = [record, so.Wait(so.SIDE, ("a",)), so.Run(so.SIDE, None),
                so.Wait(so.SIDE, ("a",)),  # the side stream has seen this record already
                so.Record(so.CALLER, ("b",)),  # no wait reads it
                so.Record(so.SIDE, ("c",)), so.Wait(so.CALLER, ("c",)),
                so.Wait(so.CALLER, ("never recorded",))]
    assert so._prune(commands) == [record, so.Wait(so.SIDE, ("a",)), so.Run(so.SIDE, None),
                                   so.Record(so.SIDE, ("c",)), so.Wait(so.CALLER, ("c",))]


def test_the_stream_checker_catches_a_missing_wait():
    plan = ring.plan_for("all_reduce", 0, 3, 200, "float16", "sum", scratch_bytes=TINY)
    commands = [c for c in so.issue(plan) if not (isinstance(c, so.Wait) and c.event[0] == "received")]
    with pytest.raises(AssertionError, match="unordered"):
        _check_stream_order(commands, lambda a: _accesses(a, 0, 200, False, "all_reduce"))


def test_stages_must_wait_for_the_lanes_last_transfer():
    # The round before a Stage can end with a send and no receive (the owner's slice is
    # empty while its right neighbour's is not), so no Reduce waited for that transfer.
    caught = 0
    for world, count in ((7, 100), (9, 515)):
        for rank in range(world):
            plan = ring.plan_for("all_reduce", rank, world, count, "float16", "sum", scratch_bytes=TINY)
            commands = so.issue(plan)
            without = [c for i, c in enumerate(commands)
                       if not (isinstance(c, so.Wait) and i + 1 < len(commands)
                               and isinstance(commands[i + 1], so.Run)
                               and isinstance(commands[i + 1].action, rs.Stage))]
            try:
                _check_stream_order(without, lambda a: _accesses(a, rank, count, False, "all_reduce"))
            except AssertionError:
                caught += 1
    assert caught


def test_plan_for_rejects_bad_input():
    with pytest.raises(CupycollValueError):
        ring.plan_for("all_gather", 0, 2, 10, "float32", "sum")
    with pytest.raises(CupycollValueError, match="bxor"):
        ring.plan_for("all_reduce", 0, 2, 10, "float32", "bxor")
    assert set(ELEMENTS) == set(ring.DTYPES)


# ------------------------------------------------------------------- host launches per call

MEASURED_SIZES = tuple(1 << shift for shift in range(20, 31, 2))  # 1 MiB ... 1 GiB of input


def _launch_table(world, scratch_bytes):
    """One row per (kind, dtype, size): the plan's rounds and slice, the scratch it holds, and
    what one call of it launches from the host."""
    rows = []
    for kind in rs.KINDS:
        for dtype in ("float32", "bfloat16"):
            itemsize = ELEMENTS[dtype].itemsize
            for size in MEASURED_SIZES:
                count = size // itemsize if kind == "all_reduce" else size // itemsize // world
                plan = ring.plan_for(kind, 0, world, count, dtype, "sum", scratch_bytes=scratch_bytes)
                counted = so.launches(so.issue(plan))
                rows.append((kind, dtype, size, plan.geometry, counted))
    return rows


def _print_table(world, scratch_bytes, rows):
    limit = f"{scratch_bytes >> 20} MiB" if scratch_bytes < 1 << 40 else "none"
    print(f"\nring plans at {world} ranks, scratch limit {limit}: per call")
    print(f"{'kind':>15} {'dtype':>9} {'size':>9} {'rounds':>6} {'slice':>9} {'scratch':>9} "
          f"{'groups':>6} {'nccl':>5} {'kernels':>7} {'events':>6} {'total':>5}")
    for kind, dtype, size, cut, n in rows:
        slice_mib = cut.slice_elems * cut.acc_itemsize / (1 << 20)
        print(f"{kind:>15} {dtype:>9} {size >> 20:>5} MiB {cut.rounds:>6} {slice_mib:>5.1f} MiB "
              f"{cut.scratch_bytes / (1 << 20):>5.0f} MiB {n.nccl_groups:>6} {n.nccl_calls:>5} "
              f"{n.kernels:>7} {n.events:>6} {n.total:>5}")


@pytest.mark.parametrize("world", (2, 3, 8))
def test_rounds_and_host_launches_per_call_do_not_grow_with_the_message(world):
    """1 MiB ... 1 GiB, fp32 and bf16: the rounds per ring step, and with them the NCCL calls,
    kernels and events one call launches, are bounded by constants times the world size. The
    table is printed (pytest -s shows it)."""
    unlimited = _launch_table(world, 1 << 50)
    _print_table(world, 1 << 50, unlimited)
    for kind, dtype, size, cut, n in unlimited:
        # given the memory, the rounds do not depend on the message at all past the
        # pipelining threshold, and are one below it
        assert cut.rounds in (1, rs.LANES), (kind, dtype, size, cut)
    default = _launch_table(world, ring.DEFAULT_RING_SCRATCH_BYTES)
    _print_table(world, ring.DEFAULT_RING_SCRATCH_BYTES, default)
    for (kind, dtype, size, cut, n), (*_, free, _n) in zip(default, unlimited):
        assert cut.scratch_bytes <= ring.DEFAULT_RING_SCRATCH_BYTES
        if free.scratch_bytes <= ring.DEFAULT_RING_SCRATCH_BYTES:
            assert cut == free  # the limit binds only past it, at hundreds of MiB
        else:  # then the largest slices that fit: each transfer still moves tens of MiB
            assert cut.rounds <= 2 * rs.LANES and cut.slice_elems * cut.acc_itemsize >= 32 << 20
        steps = world - 1
        staged = dtype == "bfloat16"
        assert n.kernels == cut.rounds * (steps + staged)
        # all-reduce's gather: an all-gather, and a broadcast of the remainder in the same group
        tail = kind == "all_reduce" and (size // ELEMENTS[dtype].itemsize) % (rs.ALIGN_ELEMS * world) != 0
        gather_calls = (1 + tail) if kind == "all_reduce" else 0
        assert n.nccl_calls == 2 * cut.rounds * steps + gather_calls
        assert n.nccl_groups == cut.rounds * steps + tail
        assert n.events <= 4 * cut.rounds * (steps + staged) + 6
        assert n.total <= 12 * 2 * rs.LANES * world  # a constant times the world size
