"""CPU tier: cupycoll.ring.algorithm's executor, run against a fake CuPy and fake communicators.

Each rank runs in a thread with its own fake device memory (a numpy byte array behind
made-up addresses). Fake kernels compute with the simulator's arithmetic; fake NCCL
send/recv move bytes through per-pair queues. Work runs when it is issued, which is a
legal order (every wait follows its record), so this checks what the GPU cannot be asked
here: the executor's pointer arithmetic, byte counts, kernel arguments, peers, in-place
handling and validation. Stream ordering itself is checked in test_ring_schedule.py.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import types

import numpy as np
import pytest

import cupycoll._cuda
import ring_simulator as sim
from cupycoll.nccl import bindings as nccl_bindings
from cupycoll.ring import algorithm as ring
from cupycoll.ring import schedule as rs
from cupycoll.ring.kernels import ELEMENTS, KINDS, all_pairs
from cupycoll.errors import CommunicatorAbortedError, CupycollTypeError, CupycollValueError

_local = threading.local()


class Heap:
    """One rank's device memory: addresses from ``base`` upwards, 256-byte aligned."""

    def __init__(self, rank: int, size: int = 8 << 20):
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
    def __init__(self, ptr=None, non_blocking=False):
        self.ptr = ptr if ptr is not None else id(self)

    @classmethod
    def from_external(cls, handle):
        version, ptr = handle.__cuda_stream__()
        return cls(ptr)

    def wait_event(self, event):
        if not isinstance(event, FakeEvent):
            raise TypeError(event)

    def synchronize(self):
        pass


class FakeEvent:
    def __init__(self, disable_timing=False):
        self.recorded = False

    def record(self, stream=None):
        if not isinstance(stream, FakeStream):
            raise TypeError(stream)
        self.recorded = True

    def synchronize(self):
        pass


class FakeAllocation:
    def __init__(self, nbytes):
        self.ptr = _local.heap.alloc(nbytes)
        self.nbytes = nbytes


def _memcpy(dst, src, size, kind, stream):
    if kind != 3:
        raise ValueError(kind)
    _local.heap.view(dst, size)[:] = _local.heap.view(src, size).copy()


def fake_cupy():
    cuda = types.SimpleNamespace(
        Device=lambda index: contextlib.nullcontext(),
        alloc=FakeAllocation,
        Stream=FakeStream,
        ExternalStream=lambda ptr, device=-1: FakeStream(ptr),
        Event=FakeEvent,
        runtime=types.SimpleNamespace(memcpyAsync=_memcpy, memcpyDeviceToDevice=3),
    )
    return types.SimpleNamespace(cuda=cuda, __version__="14.0.0")


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
        assert isinstance(stream, FakeStream) and grid[0] >= 1 and block[0] >= 1
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


class FakeComm:
    def __init__(self, rank, size, channels, log):
        self.rank, self.size, self.device, self.state = rank, size, 0, "ok"
        self.channels, self.log = channels, log

    def send(self, buf, count, dtype, peer, stream):
        assert dtype == nccl_bindings.ncclUint8 and count > 0 and peer == (self.rank + 1) % self.size
        self.log.append(("send", count))
        self.channels[self.rank, peer].put(_local.heap.view(buf, count).copy())

    def recv(self, buf, count, dtype, peer, stream):
        assert dtype == nccl_bindings.ncclUint8 and count > 0 and peer == (self.rank - 1) % self.size
        self.log.append(("recv", count))
        data = self.channels[peer, self.rank].get(timeout=20)
        assert len(data) == count, f"rank {self.rank} expects {count} bytes, got {len(data)}"
        _local.heap.view(buf, count)[:] = data


@pytest.fixture
def fake_gpu(monkeypatch):
    launches = []
    monkeypatch.setattr(cupycoll._cuda, "cupy_module", fake_cupy)
    monkeypatch.setattr(FakeComm, "group", lambda self: contextlib.nullcontext(), raising=False)
    monkeypatch.setattr(ring, "compile_module",
                        lambda device, dtype, op: {k: FakeKernel(k, dtype, op, launches) for k in KINDS})
    return launches


def _storage(dtype, x):
    return np.ascontiguousarray(x).view(ELEMENTS[dtype].storage) if dtype != "bool" else x.view(np.uint8)


def run_world(kind, inputs, dtype, op, scratch_bytes, in_place=False, premul=None,
              premul_on_device=False, misalign=0):
    """Run ``kind`` on ``len(inputs)`` fake ranks; returns outputs and per-rank NCCL logs."""
    world = len(inputs)
    channels = {(a, b): queue.Queue() for a in range(world) for b in range(world)}
    results, logs, errors = [None] * world, [[] for _ in range(world)], []
    storage = np.dtype(ELEMENTS[dtype].storage)

    def rank_main(rank):
        try:
            _local.heap = heap = Heap(rank)
            comm = FakeComm(rank, world, channels, logs[rank])
            the_ring = ring.Ring(comm, scratch_bytes=scratch_bytes)
            data = _storage(dtype, inputs[rank])
            send = heap.alloc(data.nbytes, misalign)
            heap.view(send, data.nbytes)[:] = data.view(np.uint8)
            out_count = len(data) if kind == "all_reduce" else len(data) // world
            if in_place:
                recv = send + (rank * out_count * storage.itemsize if kind == "reduce_scatter" else 0)
            else:
                recv = heap.alloc(out_count * storage.itemsize, misalign)
            kwargs = {}
            if premul is not None:
                if premul_on_device:
                    ptr = heap.alloc(storage.itemsize)
                    factor = np.array([premul], np.float32)
                    factor = sim.f32_to_bf16(factor) if dtype == "bfloat16" else factor.astype(storage)
                    heap.view(ptr, storage.itemsize)[:] = factor.view(np.uint8)
                    kwargs["premul_ptr"] = ptr
                else:
                    kwargs["premul"] = premul
            call = the_ring.all_reduce if kind == "all_reduce" else the_ring.reduce_scatter
            call(send, recv, out_count, dtype, op, 12345, **kwargs)
            out = heap.view(recv, out_count * storage.itemsize).view(storage).copy()
            results[rank] = out.view(np.bool_) if dtype == "bool" else out
            the_ring.close()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append((rank, exc))
            for q in channels.values():  # unblock the others
                q.put(np.zeros(0, np.uint8))

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0][1]
    return results, logs


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
    sent = sum(n for what, n in logs[0] if what == "send")
    chunk = count // world
    # reduce-scatter: 3 chunks of fp32 partials; all-gather: 3 chunks of fp16 results
    assert sent == (world - 1) * chunk * 4 + (world - 1) * chunk * 2


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
