"""CPU tier: cupycoll.ring.algorithm's executor, run against a fake CUDA runtime and fake communicators.

Each rank runs in a thread with its own fake device memory (a numpy byte array behind
made-up addresses). Fake kernels compute with the simulator's arithmetic; fake NCCL
send/recv, all-gather and broadcast move bytes through per-pair queues. Work runs when it
is issued, which is a legal order (every wait follows its record), so this checks what the
GPU cannot be asked here: the executor's pointer arithmetic, byte counts, kernel arguments,
peers, in-place handling, validation, the scratch it holds and what one call launches.
Stream ordering itself is checked in test_ring_schedule.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
from typing import Optional

import numpy as np
import pytest

import ring_simulator as sim
from cupycoll.nccl import header as nccl_header
from cupycoll.ring import algorithm as ring, programs
from cupycoll.ring import schedule as rs
from cupycoll.ring import stream_order as so
from cupycoll.ring.kernels import ELEMENTS, KINDS, all_pairs
from cupycoll.errors import CommunicatorAbortedError, CupycollError, CupycollTypeError, CupycollValueError

pytestmark = pytest.mark.any_stack  # its subject is the same on every stack: one CI leg runs it

_local = threading.local()  # .heap: this rank's memory; .log: what it launched


class Heap:
    """One rank's device memory: addresses from ``base`` upwards, 256-byte aligned."""

    def __init__(self, rank: int, size: int = 32 << 20):
        self.base = (rank + 1) << 40
        self.memory = np.zeros(size, np.uint8)
        self.top = 0

    def alloc(self, nbytes: int, misalign: int = 0) -> int:
        self.top = -(-self.top // 256) * 256 + misalign
        ptr = self.base + self.top
        self.top += max(nbytes, 1)
        if self.top > len(self.memory):
            raise MemoryError("fake heap exhausted")
        return ptr

    def view(self, ptr: int, nbytes: int) -> np.ndarray:
        offset = ptr - self.base
        if not (0 <= offset and offset + nbytes <= len(self.memory)):
            raise IndexError(f"address {ptr:#x}+{nbytes} is outside rank memory")
        return self.memory[offset:offset + nbytes]


class FakeStream:
    """A stream the fake runtime made: its raw pointer."""

    def __init__(self):
        self.ptr = id(self)

    def synchronize(self):
        pass


class FakeEvent:
    def __init__(self):
        self.recorded = False

    def record(self, stream):
        if not isinstance(stream, int):
            raise TypeError(stream)
        self.recorded = True
        _log(("record",))

    def wait_on(self, stream):
        if not isinstance(stream, int):
            raise TypeError(stream)
        _log(("wait",))

    def synchronize(self):
        pass

    def destroy(self):
        pass


class FakeAllocation:
    """A scratch buffer on this rank's fake heap (what torch's allocator hands the ring)."""

    def __init__(self, nbytes):
        self.ptr = _local.heap.alloc(nbytes)
        self.nbytes = nbytes

    def data_ptr(self):
        return self.ptr


class FakeOutOfMemoryError(MemoryError):
    pass


def _log(entry):
    log = getattr(_local, "log", None)
    if log is not None:
        log.append(entry)


class FakeRuntime:
    """The CUDA runtime of the ring (cupycoll._cuda.Runtime's face): streams are numbers,
    memory is the rank's fake heap, scratch above ``limit`` bytes (class-wide) fails as an
    out-of-memory allocation does, kernels compute on the heap."""

    limit = None
    out_of_memory = FakeOutOfMemoryError

    def on_device(self, index):
        return contextlib.nullcontext()

    def new_stream(self, index):
        return FakeStream()

    def new_event(self):
        return FakeEvent()

    def scratch(self, nbytes, index):
        if FakeRuntime.limit is not None and nbytes > FakeRuntime.limit:
            raise FakeOutOfMemoryError(f"Out of memory allocating {nbytes} bytes")
        _log(("malloc", nbytes))
        return FakeAllocation(nbytes)

    def copy(self, dst, src, size, stream):
        _local.heap.view(dst, size)[:] = _local.heap.view(src, size).copy()

    def launch(self, kernel, grid, block, args, stream):
        kernel(grid, block, args, stream=stream)


class FakeKernel:
    """A ring kernel computed with the simulator's arithmetic on the fake heap."""

    def __init__(self, kind, dtype, op, launches):
        self.kind, self.dtype, self.op, self.launches = kind, dtype, op, launches

    def __call__(self, grid, block, args, stream=None):
        element = ELEMENTS[self.dtype]
        local, incoming, out, n, factor_ptr, factor, divisor = args
        for value in (local, incoming, out, n, factor_ptr):
            assert isinstance(value, np.uint64)
        assert isinstance(divisor, np.int64) and isinstance(factor, np.dtype(element.acc).type)
        assert isinstance(stream, int) and grid[0] >= 1 and block[0] >= 1
        n = int(n)
        heap = _local.heap
        storage, acc = np.dtype(element.storage), np.dtype(element.acc)
        premul = None
        if self.op == "premul_sum":
            if int(factor_ptr):
                raw = heap.view(int(factor_ptr), storage.itemsize).view(storage)
                premul = sim.bf16_to_f32(raw)[0] if self.dtype == "bfloat16" else raw.astype(acc)[0]
            else:
                premul = factor
        arithmetic = sim._Arithmetic(self.dtype, self.op, premul, int(divisor))
        mine = heap.view(int(local), n * storage.itemsize).view(storage)
        value = arithmetic.own(mine)
        if self.kind in ("ring_reduce", "ring_reduce_final"):
            value = arithmetic.combine(value, heap.view(int(incoming), n * acc.itemsize).view(acc).copy())
        if self.kind in ("ring_reduce_final", "ring_final"):
            heap.view(int(out), n * storage.itemsize).view(storage)[:] = arithmetic.finish(value)
        else:
            heap.view(int(out), n * acc.itemsize).view(acc)[:] = value
        self.launches.append(self.kind)
        _log(("kernel", self.kind))


class FakeComm:
    """NCCL between threads: every message goes through the (sender, receiver) queue, tagged
    with what sent it, so a receiver that expects something else fails at once."""

    def __init__(self, rank, size, channels, log):
        self.rank, self.size, self.device, self.state = rank, size, 0, "ok"
        self.runtime = FakeRuntime()
        self.channels, self.log = channels, log

    @contextlib.contextmanager
    def group(self):
        self.log.append(("group",))
        yield

    def _put(self, peer, tag, buf, count):
        self.channels[self.rank, peer].put((tag, _local.heap.view(buf, count).copy()))

    def _get(self, peer, tag, count):
        got, data = self.channels[peer, self.rank].get(timeout=20)
        assert got == tag, f"rank {self.rank} expects a {tag} from {peer}, got a {got}"
        assert len(data) == count, f"rank {self.rank} expects {count} bytes, got {len(data)}"
        return data

    def send(self, buf, count, dtype, peer, stream):
        assert dtype == nccl_header.ncclUint8 and count > 0 and peer == (self.rank + 1) % self.size
        self.log.append(("send", count))
        self._put(peer, "send", buf, count)

    def recv(self, buf, count, dtype, peer, stream):
        assert dtype == nccl_header.ncclUint8 and count > 0 and peer == (self.rank - 1) % self.size
        self.log.append(("recv", count))
        _local.heap.view(buf, count)[:] = self._get(peer, "send", count)

    def all_gather(self, sendbuf, recvbuf, count, dtype, stream):
        assert dtype == nccl_header.ncclUint8 and count > 0
        self.log.append(("all_gather", count))
        mine = _local.heap.view(sendbuf, count).copy()
        for peer in range(self.size):
            if peer != self.rank:
                self._put(peer, "all_gather", sendbuf, count)
        out = _local.heap.view(recvbuf, count * self.size)
        out[self.rank * count:(self.rank + 1) * count] = mine
        for peer in range(self.size):
            if peer != self.rank:
                out[peer * count:(peer + 1) * count] = self._get(peer, "all_gather", count)

    def broadcast(self, sendbuf, recvbuf, count, dtype, root, stream):
        assert dtype == nccl_header.ncclUint8 and count > 0 and 0 <= root < self.size
        self.log.append(("broadcast", count))
        if self.rank == root:
            for peer in range(self.size):
                if peer != root:
                    self._put(peer, "broadcast", sendbuf, count)
            _local.heap.view(recvbuf, count)[:] = _local.heap.view(sendbuf, count).copy()
        else:
            _local.heap.view(recvbuf, count)[:] = self._get(root, "broadcast", count)


@pytest.fixture
def fake_gpu(monkeypatch):
    launches = []
    monkeypatch.setattr(FakeRuntime, "limit", None)
    monkeypatch.setattr(ring, "compile_module",
                        lambda runtime, device, dtype, op: {k: FakeKernel(k, dtype, op, launches) for k in KINDS})
    return launches


def _storage(dtype, x):
    return np.ascontiguousarray(x).view(ELEMENTS[dtype].storage) if dtype != "bool" else x.view(np.uint8)


@dataclasses.dataclass
class Call:
    """One collective every fake rank makes: ``inputs[r]`` is rank r's input."""

    kind: str
    inputs: list
    dtype: str
    op: str
    in_place: bool = False
    premul: Optional[float] = None
    premul_on_device: bool = False
    stream: int = 12345


@dataclasses.dataclass
class Ran:
    """What one rank saw of one call: its output (or the exception it raised), what it
    launched, and the scratch its ring held afterwards."""

    out: object
    log: list
    scratch_held: int


def run_calls(calls, scratch_bytes, misalign=0):
    """Make one Ring per fake rank and run ``calls`` on it in order; ``result[c][r]`` is
    rank r's :class:`Ran` of call c. A call that raises on a rank is recorded and the rank
    goes on (so a test can show the ring stays usable); any other failure is raised."""
    world = len(calls[0].inputs)
    channels = {(a, b): queue.Queue() for a in range(world) for b in range(world)}
    results = [[None] * world for _ in calls]
    errors = []

    def rank_main(rank):
        try:
            _local.heap = heap = Heap(rank)
            _local.log = log = []
            the_ring = ring.Ring(FakeComm(rank, world, channels, log), scratch_bytes=scratch_bytes)
            for index, call in enumerate(calls):
                storage = np.dtype(ELEMENTS[call.dtype].storage)
                data = _storage(call.dtype, call.inputs[rank])
                send = heap.alloc(data.nbytes, misalign)
                heap.view(send, data.nbytes)[:] = data.view(np.uint8)
                out_count = len(data) if call.kind == "all_reduce" else len(data) // world
                if call.in_place:
                    recv = send + (rank * out_count * storage.itemsize if call.kind == "reduce_scatter" else 0)
                else:
                    recv = heap.alloc(out_count * storage.itemsize, misalign)
                kwargs = {}
                if call.premul is not None:
                    if call.premul_on_device:
                        ptr = heap.alloc(storage.itemsize)
                        factor = np.array([call.premul], np.float32)
                        factor = sim.f32_to_bf16(factor) if call.dtype == "bfloat16" else factor.astype(storage)
                        heap.view(ptr, storage.itemsize)[:] = factor.view(np.uint8)
                        kwargs["premul_ptr"] = ptr
                    else:
                        kwargs["premul"] = call.premul
                method = the_ring.all_reduce if call.kind == "all_reduce" else the_ring.reduce_scatter
                first = len(log)
                try:
                    method(send, recv, out_count, call.dtype, call.op, call.stream, **kwargs)
                except CupycollError as exc:
                    out = exc
                else:
                    out = heap.view(recv, out_count * storage.itemsize).view(storage).copy()
                    out = out.view(np.bool_) if call.dtype == "bool" else out
                results[index][rank] = Ran(out, log[first:], the_ring.scratch_held)
            the_ring.close()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append((rank, exc))
            for q in channels.values():  # unblock the others
                q.put(("a failed rank's wake-up", np.zeros(0, np.uint8)))

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0][1]
    return results


def run_world(kind, inputs, dtype, op, scratch_bytes, in_place=False, premul=None,
              premul_on_device=False, misalign=0):
    """Run one ``kind`` on ``len(inputs)`` fake ranks; returns outputs and per-rank logs."""
    ran = run_calls([Call(kind, inputs, dtype, op, in_place, premul, premul_on_device)], scratch_bytes,
                    misalign)[0]
    for r in ran:
        if isinstance(r.out, BaseException):
            raise r.out
    return [r.out for r in ran], [r.log for r in ran]


def _inputs(world, count, dtype, seed=0):
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return [rng.integers(0, 2, count).astype(bool) for _ in range(world)]
    if dtype == "bfloat16":
        return [sim.f32_to_bf16(rng.standard_normal(count).astype(np.float32)) for _ in range(world)]
    if ELEMENTS[dtype].family == "float":
        return [rng.standard_normal(count).astype(dtype) for _ in range(world)]
    info = np.iinfo(dtype)
    return [rng.integers(max(info.min, -100), min(info.max, 100), count).astype(dtype) for _ in range(world)]


def _same_bits(a, b):
    return a.shape == b.shape and np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


SCRATCH = rs.LANES * rs.SLOTS * 32 * 8  # 32..256-element slices: many rounds


@pytest.mark.parametrize("world", (1, 2, 3, 4))
@pytest.mark.parametrize("in_place", (False, True))
def test_all_reduce_equals_the_simulator_bitwise(fake_gpu, world, in_place):
    for dtype, op in all_pairs():
        premul = 0.75 if op == "premul_sum" else None
        for count in (1, 7, 1001):
            inputs = _inputs(world, count, dtype, seed=count)
            outs, _ = run_world("all_reduce", inputs, dtype, op, SCRATCH, in_place, premul)
            expected = sim.simulate_all_reduce(inputs, op, dtype=dtype, premul=premul)
            for rank in range(world):
                assert _same_bits(outs[rank], expected[rank]), (dtype, op, count, rank)


@pytest.mark.parametrize("world", (1, 2, 3, 4))
@pytest.mark.parametrize("in_place", (False, True))
def test_reduce_scatter_equals_the_simulator_bitwise(fake_gpu, world, in_place):
    for dtype, op in all_pairs():
        premul = 0.75 if op == "premul_sum" else None
        for recvcount in (1, 5, 300):
            inputs = _inputs(world, recvcount * world, dtype, seed=recvcount)
            outs, _ = run_world("reduce_scatter", inputs, dtype, op, SCRATCH, in_place, premul)
            expected = sim.simulate_reduce_scatter(inputs, op, dtype=dtype, premul=premul)
            for rank in range(world):
                assert _same_bits(outs[rank], expected[rank]), (dtype, op, recvcount, rank)


@pytest.mark.parametrize("dtype", ("float16", "bfloat16", "float32", "float64"))
def test_premul_factor_from_device_memory(fake_gpu, dtype):
    inputs = _inputs(3, 100, dtype)
    outs, _ = run_world("all_reduce", inputs, dtype, "premul_sum", SCRATCH, premul=0.375, premul_on_device=True)
    expected = sim.simulate_all_reduce(inputs, "premul_sum", dtype=dtype, premul=0.375)  # exact in every dtype
    for out in outs:
        assert _same_bits(out, expected[0])


def test_fp16_partials_travel_as_fp32_and_results_as_fp16(fake_gpu):
    world, count = 4, 1024
    _, logs = run_world("all_reduce", _inputs(world, count, "float16"), "float16", "sum", 4 << 20)
    moved = [entry for entry in logs[0] if entry[0] in ("send", "all_gather", "broadcast")]
    chunk = count // world
    # reduce-scatter: 3 chunks of fp32 partials; then one all-gather of fp16 results
    assert sum(n for what, n in moved if what == "send") == (world - 1) * chunk * 4
    assert [entry for entry in moved if entry[0] != "send"] == [("all_gather", chunk * 2)]


def test_misaligned_buffers(fake_gpu):
    inputs = _inputs(3, 999, "int8")
    outs, _ = run_world("all_reduce", inputs, "int8", "bxor", SCRATCH, misalign=3)
    expected = sim.simulate_all_reduce(inputs, "bxor")
    assert all(_same_bits(o, expected[0]) for o in outs)


def test_zero_count_enqueues_nothing(fake_gpu):
    outs, logs = run_world("all_reduce", [np.zeros(0, np.float32)] * 3, "float32", "sum", SCRATCH)
    assert logs == [[], [], []] and fake_gpu == []
    outs, logs = run_world("reduce_scatter", [np.zeros(0, np.float32)] * 2, "float32", "sum", SCRATCH)
    assert logs == [[], []]


def test_world_one_copies_without_kernels_unless_premul(fake_gpu):
    x = [np.arange(10, dtype=np.float16)]
    outs, _ = run_world("all_reduce", x, "float16", "avg", SCRATCH)
    assert _same_bits(outs[0], x[0]) and fake_gpu == []
    outs, _ = run_world("all_reduce", x, "float16", "premul_sum", SCRATCH, premul=2.0)
    assert (outs[0] == x[0] * 2).all() and fake_gpu == ["ring_final"]


def _ring(world=2):
    channels = {(a, b): queue.Queue() for a in range(world) for b in range(world)}
    _local.heap = Heap(0)
    log = []
    return ring.Ring(FakeComm(0, world, channels, log), scratch_bytes=SCRATCH), log


def test_validation_raises_before_enqueueing(fake_gpu):
    the_ring, log = _ring()
    bad_calls = [
        (CupycollValueError, dict(dtype="float32", op="bxor")),
        (CupycollValueError, dict(dtype="bool", op="avg")),
        (CupycollValueError, dict(op="premul_sum")),  # no factor
        (CupycollValueError, dict(op="premul_sum", premul=1.0, premul_ptr=1 << 40)),
        (CupycollValueError, dict(op="sum", premul=2.0)),
        (CupycollTypeError, dict(op="premul_sum", premul="2")),
        (CupycollValueError, dict(count=-1)),
        (CupycollTypeError, dict(count=1.5)),
        (CupycollTypeError, dict(stream=None)),
        (CupycollTypeError, dict(dtype=np.float32)),
    ]
    for error, change in bad_calls:
        args = dict(sendbuf=1 << 40, recvbuf=1 << 40, count=8, dtype="float32", op="sum", stream=1)
        args.update(change)
        with pytest.raises(error):
            the_ring.all_reduce(**args)
    assert log == [] and fake_gpu == []
    the_ring.close()
    with pytest.raises(CommunicatorAbortedError):
        the_ring.all_reduce(1 << 40, 1 << 40, 8, "float32", "sum", 1)
    the_ring.close()  # twice is fine


def test_aborted_communicator_is_refused(fake_gpu):
    the_ring, _ = _ring()
    the_ring._comm.state = "aborted"
    with pytest.raises(CommunicatorAbortedError):
        the_ring.reduce_scatter(1 << 40, 1 << 40, 8, "float32", "sum", 1)


def test_scratch_bytes_is_validated(fake_gpu):
    _local.heap = Heap(0)
    with pytest.raises(CupycollValueError):
        ring.Ring(FakeComm(0, 2, {}, []), scratch_bytes=64)
    with pytest.raises(CupycollTypeError):
        ring.Ring(FakeComm(0, 2, {}, []), scratch_bytes=4.0)


# ------------------------------------------------------------------------- scratch memory

def _mallocs(ran):
    return [n for entry in ran.log if entry[0] == "malloc" for n in entry[1:]]


def _expected(call):
    if call.kind == "all_reduce":
        return sim.simulate_all_reduce(call.inputs, call.op, dtype=call.dtype, premul=call.premul)
    return sim.simulate_reduce_scatter(call.inputs, call.op, dtype=call.dtype, premul=call.premul)


def test_scratch_grows_on_demand_and_is_kept_by_the_ring(fake_gpu, monkeypatch):
    monkeypatch.setattr(ring, "SCRATCH_GRANULE", 1024)
    small, large = _inputs(2, 1000, "float32"), _inputs(2, 8000, "float32", seed=1)
    calls = [Call("all_reduce", small, "float32", "sum"), Call("all_reduce", small, "float32", "sum"),
             Call("all_reduce", large, "float32", "sum"), Call("all_reduce", small, "float32", "sum"),
             Call("reduce_scatter", _inputs(2, 8000, "bfloat16"), "bfloat16", "sum")]
    ran = run_calls(calls, ring.DEFAULT_RING_SCRATCH_BYTES)
    for call, per_rank in zip(calls, ran):
        for r, got in enumerate(per_rank):
            assert _same_bits(got.out, _expected(call)[r])
    for rank in range(2):
        # fp32 at two ranks: one slot of one slice, the longest chunk's partials
        # (504 and 4000 elements), in whole KiB; bf16 adds the staging slot
        assert [_mallocs(ran[c][rank]) for c in range(5)] == [[2048], [], [16384], [], [32768]]
        assert [ran[c][rank].scratch_held for c in range(5)] == [2048, 2048, 16384, 16384, 32768]


def test_scratch_stays_within_the_limit_and_more_rounds_make_up(fake_gpu):
    limit = 4096
    call = Call("all_reduce", _inputs(3, 8000, "float16"), "float16", "sum")
    ran = run_calls([call], limit)[0]
    plan = ring.plan_for("all_reduce", 0, 3, 8000, "float16", "sum", scratch_bytes=limit)
    assert plan.geometry.rounds > 10 and plan.scratch_bytes <= limit
    for r, got in enumerate(ran):
        assert _same_bits(got.out, _expected(call)[r])
        assert got.scratch_held <= limit and _mallocs(got) == [plan.scratch_bytes]


def test_scratch_that_cannot_be_had_is_a_clear_error_and_the_ring_stays_usable(fake_gpu, monkeypatch):
    monkeypatch.setattr(ring, "SCRATCH_GRANULE", 1024)
    monkeypatch.setattr(FakeRuntime, "limit", 8192)
    too_big = Call("all_reduce", _inputs(2, 8000, "float32"), "float32", "sum")  # needs 16 KiB
    fits = Call("all_reduce", _inputs(2, 1000, "float32", seed=2), "float32", "sum")
    failed, then = run_calls([too_big, fits], ring.DEFAULT_RING_SCRATCH_BYTES)
    for rank in range(2):
        error = failed[rank].out
        assert isinstance(error, CupycollError) and isinstance(error.__cause__, FakeOutOfMemoryError)
        text = str(error)
        assert "could not allocate 16384 bytes (0.0 MiB) of scratch memory on cuda:0" in text
        assert "scratch memory on cuda:0 for a all_reduce of 8000 float32 elements" in text
        assert "nothing was launched" in text and "CUPYCOLL_RING_SCRATCH_BYTES" in text
        assert failed[rank].log == [] and failed[rank].scratch_held == 0  # no NCCL call, kernel, event
        assert _same_bits(then[rank].out, _expected(fits)[rank])
        assert then[rank].scratch_held == 2048


# ------------------------------------------------------------------- what one call launches

def _counted(log):
    names = [entry[0] for entry in log]
    return so.Launches(nccl_groups=names.count("group"),
                       nccl_calls=sum(names.count(n) for n in ("send", "recv", "all_gather", "broadcast")),
                       kernels=names.count("kernel"), copies=0,
                       events=names.count("record") + names.count("wait"))


@pytest.mark.parametrize("world", (2, 3))
@pytest.mark.parametrize("dtype", ("float32", "float16"))
@pytest.mark.parametrize("kind", ("all_reduce", "reduce_scatter"))
def test_one_call_launches_what_its_schedule_counts(fake_gpu, world, dtype, kind):
    """The executor adds nothing per round to the schedule's commands: one call launches
    exactly :func:`stream_order.launches` of its commands, plus one record of its end."""
    count = 1003 if kind == "all_reduce" else 301
    n = count if kind == "all_reduce" else count * world
    for scratch in (SCRATCH, ring.DEFAULT_RING_SCRATCH_BYTES):  # many rounds; one
        ran = run_calls([Call(kind, _inputs(world, n, dtype), dtype, "sum")], scratch)[0]
        for rank, got in enumerate(ran):
            plan = ring.plan_for(kind, rank, world, count, dtype, "sum", scratch_bytes=scratch)
            expected = so.launches(so.issue(plan))
            assert _counted(got.log) == dataclasses.replace(expected, events=expected.events + 1), \
                (scratch, rank, plan.geometry)


def test_a_repeated_call_is_planned_once(fake_gpu, monkeypatch):
    programs.program.cache_clear()
    built = []
    plan = programs.build_plan
    monkeypatch.setattr(programs, "build_plan", lambda *args: built.append(args) or plan(*args))
    call = Call("all_reduce", _inputs(2, 777, "float16"), "float16", "sum")
    ran = run_calls([call, call, call], SCRATCH)
    assert sorted(args[1] for args in built) == [0, 1]  # once per rank
    assert ran[1][0].log == ran[2][0].log and _mallocs(ran[1][0]) == []


def test_a_call_on_another_stream_first_waits_for_the_last_one(fake_gpu):
    # the calls share the scratch: one on a different stream must not overtake the last
    inputs = _inputs(2, 100, "float32")
    ran = run_calls([Call("all_reduce", inputs, "float32", "sum", stream=1),
                     Call("all_reduce", inputs, "float32", "sum", stream=1),
                     Call("all_reduce", inputs, "float32", "sum", stream=2)], SCRATCH)
    first_launch = [next(e[0] for e in r.log if e[0] != "malloc") for r in (ran[0][0], ran[1][0], ran[2][0])]
    assert first_launch == ["group", "group", "wait"]  # the same stream orders the second by itself


@pytest.mark.parametrize("world, compiles", [(1, False), (2, True), (4, True)])
def test_prepare_holds_the_scratch_and_compiles_only_what_the_call_needs(fake_gpu, monkeypatch, world, compiles):
    compiled = []
    monkeypatch.setattr(ring, "compile_module", lambda runtime, *key: compiled.append(key) or {})
    the_ring, log = _ring(world)
    _local.log = log
    try:
        the_ring.prepare("all_reduce", 1000, "float16", "sum")
        the_ring.prepare("reduce_scatter", 0, "float16", "sum")  # nothing to reduce: nothing to do
        with pytest.raises(CupycollValueError, match="all_gather"):
            the_ring.prepare("all_gather", 10, "float16", "sum")
    finally:
        _local.log = None
    assert compiled == ([(0, "float16", "sum")] if compiles else [])
    assert [e[0] for e in log] == (["malloc"] if compiles else [])  # and nothing launched
    assert the_ring.scratch_held == (SCRATCH if compiles else 0)
