"""CPU tier: the ring schedule (cupycoll.ring.schedule), run by its numpy simulator
(tests/ring_simulator.py).

The GPU executes the same plans (:func:`cupycoll.ring.algorithm.plan_for` builds them through the
same functions) and the same stream commands (:func:`issue`), so what is proven here about
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

@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("count", SIZES + (4099,))
def test_all_reduce_chunks_cover_every_element_once(world, count):
    chunks = rs.all_reduce_chunks(count, world)
    assert len(chunks) == world
    assert chunks[0][0] == 0 and chunks[-1][1] == count
    for (a0, a1), (b0, b1) in zip(chunks, chunks[1:]):
        assert a1 == b0 and a0 <= a1
    for start, _ in chunks:
        assert start % rs.ALIGN_ELEMS == 0 or start == count


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


def test_slice_elems_fits_the_scratch():
    for acc in (1, 4, 8):
        elems = rs.slice_elems_for(4 << 20, acc)
        assert elems % rs.ALIGN_ELEMS == 0
        assert rs.LANES * rs.SLOTS * elems * acc <= 4 << 20
    with pytest.raises(CupycollValueError, match="too small"):
        rs.slice_elems_for(100, 8)


def test_the_schedule_is_plain_data():
    """ring_schedule imports the standard library and cupycoll only: numpy is the
    simulator's (ring_simulator), not the schedule's."""
    import ast
    import pathlib

    tree = ast.parse(pathlib.Path(rs.__file__).read_text(encoding="utf-8"))
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.level == 0}
    assert imported <= {"__future__", "dataclasses", "typing"}, imported


# ----------------------------------------------------------------------------- step order

@pytest.mark.parametrize("world", range(2, 10))
@pytest.mark.parametrize("stage_first", (False, True))
@pytest.mark.parametrize("scatter", (False, True))
def test_plans_are_consistent_across_ranks(world, stage_first, scatter):
    count = 37 if scatter else 1001
    chunks = rs.reduce_scatter_chunks(count, world) if scatter else rs.all_reduce_chunks(count, world)
    plans = [rs.reduce_scatter_plan(r, world, chunks, 16, stage_first, scatter) for r in range(world)]
    if not scatter:
        plans = [p + rs.all_gather_plan(r, world, chunks) for r, p in enumerate(plans)]
    assert len({len(p) for p in plans}) == 1
    for index in range(len(plans[0])):
        actions = [p[index] for p in plans]
        assert len({type(a) for a in actions}) == 1
        for rank, action in enumerate(actions):
            if isinstance(action, (rs.Exchange, rs.Forward)):
                left = actions[(rank - 1) % world]
                # each rank receives at step s exactly what its left neighbour sends at step s
                assert (action.recv_chunk, action.recv_start, action.recv_stop) == \
                       (left.send_chunk, left.send_start, left.send_stop)
                assert action.step == left.step


@pytest.mark.parametrize("world", range(2, 10))
def test_every_local_element_is_used_once_and_owner_finishes_its_chunk(world):
    count = 1001
    chunks = rs.all_reduce_chunks(count, world)
    for stage_first in (False, True):
        for rank in range(world):
            plan = rs.reduce_scatter_plan(rank, world, chunks, 16, stage_first, False)
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
    chunks = rs.all_reduce_chunks(80, world)
    order = {c: [] for c in range(world)}
    plans = [rs.reduce_scatter_plan(r, world, chunks, 16, True, False) for r in range(world)]
    for index in range(len(plans[0])):
        for rank in range(world):
            a = plans[rank][index]
            if isinstance(a, rs.Stage):
                order[a.chunk].append(rank)
            if isinstance(a, rs.Reduce):
                order[a.chunk].append(rank)
    for c in range(world):
        assert order[c] == [(c + 1 + i) % world for i in range(world)]


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
                outs = sim.simulate_all_reduce(inputs, op, slice_elems=16, dtype=dtype,
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
                outs = sim.simulate_reduce_scatter(inputs, op, slice_elems=16, dtype=dtype,
                                                  premul=premul, in_place=in_place)
                for rank, out in enumerate(outs):
                    block = expected[rank * recvcount:(rank + 1) * recvcount].astype(out.dtype)
                    _assert_same_bits(out, block, f"{dtype} {op} world {world} rank {rank}")


@pytest.mark.parametrize("world", (2, 3, 7))
def test_many_slices_and_waves(world):
    rng = np.random.default_rng(world)
    count = 5000
    inputs = [rng.integers(-1000, 1000, count).astype(np.int64) for _ in range(world)]
    outs = sim.simulate_all_reduce(inputs, "sum", slice_elems=16)  # ~100 rounds, 50 waves
    for out in outs:
        _assert_same_bits(out, np.sum(inputs, axis=0), f"world {world}")
    per = count // world
    xs = [x[:per * world].astype(np.int32) for x in inputs]
    outs = sim.simulate_reduce_scatter(xs, "bxor", slice_elems=32)
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
    for out in sim.simulate_all_reduce(xs, "sum", slice_elems=64):
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
        outs = sim.simulate_all_reduce(xs, "sum", slice_elems=32)
        for out in outs[1:]:
            _assert_same_bits(out, outs[0], dtype)
        np.testing.assert_allclose(outs[0].astype(np.float64),
                                   np.sum([x.astype(np.float64) for x in xs], axis=0),
                                   rtol=1e-2 if dtype == "float16" else 1e-5, atol=1e-2)


def test_result_does_not_depend_on_the_slice_size():
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(3001).astype(np.float32) for _ in range(4)]
    base = sim.simulate_all_reduce(xs, "sum", slice_elems=16)[0]
    for slice_elems in (32, 48, 1024, 1 << 16):
        _assert_same_bits(sim.simulate_all_reduce(xs, "sum", slice_elems=slice_elems)[0], base, str(slice_elems))


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
    elif isinstance(action, rs.Forward):
        if action.send_stop > action.send_start:
            out.append((recv(action.send_start, action.send_stop), False))
        if action.recv_stop > action.recv_start:
            out.append((recv(action.recv_start, action.recv_stop), True))
    elif isinstance(action, rs.Alone):
        out += [(("send", action.start, action.stop), False), (recv(action.start, action.stop), True)]
    return [(buf, lo, hi, w) for (buf, lo, hi), w in out]


def _check_stream_order(commands, accesses_of):
    """Every two accesses to overlapping memory, one a write, from different streams, must
    be ordered by the records and waits (vector clocks). A pseudo-op on the caller's stream
    touching everything stands for the caller's work before and after."""
    streams = (rs.CALLER, rs.SIDE)
    everything = [(("send",), 0, 1 << 30, True), (("recv",), 0, 1 << 30, True), (("slot",), 0, 1 << 30, True)]
    clock = {s: [0, 0] for s in streams}
    events = {}
    ops = []
    sequence = [("run", rs.CALLER, None)] + [("cmd", c) for c in commands] + [("run", rs.CALLER, None)]
    for item in sequence:
        if item[0] == "run" or isinstance(item[1], rs.Run):
            stream, action = (item[1], None) if item[0] == "run" else (item[1].stream, item[1].action)
            i = streams.index(stream)
            clock[stream][i] += 1
            acc = everything if action is None else accesses_of(action)
            ops.append((i, clock[stream][i], tuple(clock[stream]), acc))
        elif isinstance(item[1], rs.Record):
            events[item[1].event] = tuple(clock[item[1].stream])
        elif isinstance(item[1], rs.Wait):
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
    scratch = rs.LANES * rs.SLOTS * 16 * 4  # 16-element slices: many rounds and waves
    for count in (1, 7, 100, 2 ** 9 + 3):
        plan = ring.plan_for(kind, world - 1, world, count, dtype, "sum", scratch_bytes=scratch)
        commands = rs.issue(plan)
        _check_stream_order(commands, lambda a: _accesses(a, world - 1, count, in_place, kind))
        if world > 1 and count > 1:
            assert any(isinstance(c, rs.Run) and c.stream == rs.SIDE for c in commands)


def test_the_stream_checker_catches_a_missing_wait():
    plan = ring.plan_for("all_reduce", 0, 3, 200, "float16", "sum", scratch_bytes=rs.LANES * rs.SLOTS * 16 * 4)
    commands = [c for c in rs.issue(plan) if not (isinstance(c, rs.Wait) and c.event[0] == "received")]
    with pytest.raises(AssertionError, match="unordered"):
        _check_stream_order(commands, lambda a: _accesses(a, 0, 200, False, "all_reduce"))


def test_stages_must_wait_for_the_lanes_last_transfer():
    # The round before a Stage can end with a send and no receive (the owner's slice is
    # empty while its right neighbour's is not), so no Reduce waited for that transfer.
    caught = 0
    for world in (2, 3, 4, 5):
        for count in (7, 100, 515):
            plan = ring.plan_for("all_reduce", world - 1, world, count, "float16", "sum",
                                 scratch_bytes=rs.LANES * rs.SLOTS * 16 * 4)
            commands = rs.issue(plan)
            without = [c for i, c in enumerate(commands)
                       if not (isinstance(c, rs.Wait) and i + 1 < len(commands)
                               and isinstance(commands[i + 1], rs.Run)
                               and isinstance(commands[i + 1].action, rs.Stage))]
            try:
                _check_stream_order(without, lambda a: _accesses(a, world - 1, count, False, "all_reduce"))
            except AssertionError:
                caught += 1
    assert caught


def test_plan_for_rejects_bad_input():
    with pytest.raises(CupycollValueError):
        ring.plan_for("all_gather", 0, 2, 10, "float32", "sum")
    with pytest.raises(CupycollValueError, match="bxor"):
        ring.plan_for("all_reduce", 0, 2, 10, "float32", "bxor")
    assert set(ELEMENTS) == set(ring.DTYPES)
