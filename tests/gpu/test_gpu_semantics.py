"""GPU tier, part "semantics" (runs first: quick, one process): stream and Work semantics, bad
input on real CUDA tensors, one-rank paths, DDP (and DDP parity with torch's nccl, 2 ranks)."""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

import cupycoll
from cupycoll.errors import CupycollTypeError, CupycollValueError
from gpu.tier import GPU_TIER_BUDGETS_S
from mp import ddp_parity_with_torch_nccl, gpu_count, run_python

pytestmark = pytest.mark.gpu

BUDGET_S = GPU_TIER_BUDGETS_S["semantics"]
# torchrun with 2 ranks: ~10 s to start them, NCCL init for cupycoll and torch's nccl, a few
# training steps each.
SUBPROCESS_LIMITS_S = {"ddp parity": 50, "no context on cuda:0": 25}


@pytest.fixture
def group():
    torch.cuda.set_device(0)
    dist.init_process_group("cupycoll", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60), device_id=torch.device("cuda", 0))
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_sync_issues_on_current_stream(group):
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = torch.ones(8, device="cuda")
        work = group.allreduce([x], _opts(async_op=False))
        # on the caller's stream; the pooled event is only for the watchdog to query
        assert work._stream == side.cuda_stream and work._slot is not None
    side.synchronize()
    assert torch.equal(x.cpu(), torch.ones(8))


def test_async_uses_internal_stream_and_wait_does_not_block_cpu(group):
    x = torch.ones(1 << 20, device="cuda")
    torch.cuda._sleep(int(2e9))  # ~1 s of GPU time on the current stream
    start = time.monotonic()
    work = dist.all_reduce(x, async_op=True)
    assert work._stream != torch.cuda.current_stream().cuda_stream
    work.wait()
    assert time.monotonic() - start < 0.5, "wait() must not block the CPU"
    assert not work.is_completed()
    torch.cuda.synchronize()
    assert work.is_completed()
    fut = work.get_future()
    assert torch.equal(fut.wait()[0].cpu(), torch.ones(1 << 20))


def test_future_orders_consumer_stream(group):
    x = torch.full((1 << 20,), 2.0, device="cuda")
    torch.cuda._sleep(int(5e8))
    fut = dist.all_reduce(x, async_op=True).get_future()
    doubled = fut.then(lambda f: f.value()[0] * 2)
    assert torch.equal(doubled.wait().cpu(), torch.full((1 << 20,), 4.0))


def test_bad_input_on_cuda_keeps_group_usable(group):
    x = torch.ones(4, 4, device="cuda")
    with pytest.raises(CupycollValueError, match="not contiguous"):
        dist.all_reduce(x.t())
    with pytest.raises(CupycollValueError, match="different device types"):
        dist.all_gather_into_tensor(torch.zeros(4), torch.ones(4, device="cuda"))
    with pytest.raises(CupycollValueError, match="expected 4"):
        dist.all_gather_into_tensor(torch.zeros(5, device="cuda"), torch.ones(4, device="cuda"))
    with pytest.raises(CupycollTypeError, match="int16"):
        dist.all_reduce(torch.ones(3, dtype=torch.int16, device="cuda"))
    # NCCL has no bitwise ops: an error when NCCL is chosen; "auto" sends them to the ring
    with cupycoll.algorithm("nccl"):
        with pytest.raises(CupycollValueError, match="BXOR"):
            dist.all_reduce(torch.ones(3, dtype=torch.int32, device="cuda"), op=dist.ReduceOp.BXOR)
    with pytest.raises(CupycollValueError, match="cannot reduce dtype float32 with op bxor"):
        dist.all_reduce(torch.ones(3, device="cuda"), op=dist.ReduceOp.BXOR)  # nor can the ring
    with pytest.raises(CupycollValueError, match="root 3 is out of range"):
        group.broadcast([x], _bopts(3))
    if gpu_count() > 1:
        with pytest.raises(CupycollValueError, match="cuda:1 but this group's communicator is on cuda:0"):
            dist.all_reduce(torch.ones(2, device="cuda:1"))
    dist.all_reduce(x)
    assert torch.equal(x.cpu(), torch.ones(4, 4))


def test_bitwise_ops_run_on_the_ring_by_default(group):
    x = torch.tensor([0b1010, 0b0110, 7], dtype=torch.int32, device="cuda")
    dist.all_reduce(x, op=dist.ReduceOp.BXOR)  # one rank: the XOR over ranks is the input
    assert x.cpu().tolist() == [0b1010, 0b0110, 7]


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_fp8_avg_on_one_rank(group, dtype):
    # NCCL's one-rank path rejects fp8 AVG (no host-side fp8 pre-multiply); cupycoll issues SUM
    from cupycoll import _cuda
    from cupycoll.nccl import header as nccl_header

    if not nccl_header.fp8_supported(_cuda.nccl_module().get_version()):
        pytest.skip("fp8 needs NCCL >= 2.24")
    values = torch.tensor([1.0, 2.0, 3.5, -4.0, 0.25], device="cuda").to(dtype)
    for op in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
        x = values.clone()
        dist.all_reduce(x, op=op)
        assert torch.equal(x.view(torch.uint8).cpu(), values.view(torch.uint8).cpu()), op
    out = torch.empty(5, device="cuda").to(dtype)
    dist.reduce_scatter_tensor(out, values.clone(), op=dist.ReduceOp.AVG)
    assert torch.equal(out.view(torch.uint8).cpu(), values.view(torch.uint8).cpu())


def test_ddp_comm_hook_gets_cuda_future(group):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).cuda()
    twin = torch.nn.Linear(8, 4).cuda()
    twin.load_state_dict(model.state_dict())
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0])
    seen = []

    def hook(state, bucket):
        fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
        seen.append(bucket.index())
        return fut.then(lambda f: f.value()[0])

    ddp.register_comm_hook(None, hook)
    data = torch.randn(16, 8, device="cuda")
    ddp(data).sum().backward()
    twin(data).sum().backward()
    assert seen
    # one rank: the all-reduced gradients are the local ones, as the hook's future delivered them
    for p, q in zip(model.parameters(), twin.parameters()):
        assert p.grad is not None and torch.allclose(p.grad, q.grad, rtol=1e-6, atol=1e-6)


def test_ddp_parity_with_torch_nccl():
    assert ddp_parity_with_torch_nccl(SUBPROCESS_LIMITS_S["ddp parity"]) <= 1e-5


def _opts(async_op):
    o = torch._C._distributed_c10d.AllreduceOptions()
    o.asyncOp = async_op
    return o


def _bopts(root):
    o = torch._C._distributed_c10d.BroadcastOptions()
    o.rootRank = root
    return o


# -- the watchdog next to CUDA graph capture and other devices -----------------------------


def test_the_watchdog_thread_can_take_thread_local_capture_mode():
    import threading

    from cupycoll.faults import watchdog_cuda
    torch.cuda.init()
    got = []
    thread = threading.Thread(target=lambda: got.append(watchdog_cuda.use_thread_local_capture_mode()))
    thread.start()
    thread.join(10)
    assert got == [True], "the driver refused cuThreadExchangeStreamCaptureMode"


def test_a_graph_captures_while_the_watchdog_polls_a_collective_in_flight():
    # The watchdog queries the in-flight all_reduce's event every millisecond while this
    # thread captures in torch's default (global) mode: in global mode on the watchdog's
    # thread too, the query would be refused and the capture invalidated.
    torch.cuda.set_device(0)
    dist.init_process_group("cupycoll", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60), device_id=torch.device("cuda", 0),
                            pg_options=cupycoll.Options(watchdog_interval=0.001))
    try:
        x = torch.ones(1 << 20, device="cuda")
        dist.all_reduce(x)  # the watchdog now watches this group
        torch.cuda._sleep(int(2e9))  # ~1 s: the next all_reduce stays in flight meanwhile
        work = dist.all_reduce(x, async_op=True)
        assert not work.is_completed()
        static = torch.full((1024,), 3.0, device="cuda")
        graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        with torch.cuda.stream(side):  # no dependency on the sleeping stream
            graph.capture_begin()
            out = static * 2
            time.sleep(0.05)  # about 50 watchdog passes inside the capture
            graph.capture_end()
        static.fill_(5.0)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), torch.full((1024,), 10.0))
        work.wait()
        dist.all_reduce(x)  # the group was not faulted
        torch.cuda.synchronize()
        assert torch.equal(x.cpu(), torch.ones(1 << 20))
    finally:
        dist.destroy_process_group()


def test_an_async_all_reduce_captured_in_a_graph_joins_back_and_replays_as_eager(group):
    # The internal stream forks off the capturing one; wait() joins it back inside the capture
    # (else cudaStreamEndCapture fails: cudaErrorStreamCaptureUnjoined).
    static = torch.full((4096,), 2.0, device="cuda")
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):  # torch's recipe: warm up on a side stream before capturing
        dist.all_reduce(static, async_op=True).wait()
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        work = dist.all_reduce(static, async_op=True)
        work.wait()
        out = static * 3
    for value in (5.0, 7.0):
        static.fill_(value)
        graph.replay()
        torch.cuda.synchronize()
        eager = torch.full((4096,), value, device="cuda")
        dist.all_reduce(eager, async_op=True).wait()
        assert torch.equal(out, eager * 3), (value, out[:4])


@pytest.mark.skipif(gpu_count() < 2, reason="needs 2 GPUs: a rank on cuda:1, none on cuda:0")
def test_the_watchdog_creates_no_context_on_cuda0_for_a_rank_on_cuda1():
    # device_id without set_device (legal: torch never sets it), the watchdog's queries, an
    # asynchronous call waited on from another thread, and an abort, whose end runs on a
    # thread of its own: none may make a context on cuda:0.
    script = """
import ctypes, datetime, threading, time, torch, torch.distributed as dist, cupycoll
dist.init_process_group("cupycoll", store=dist.HashStore(), rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=60), device_id=torch.device("cuda", 1),
                        pg_options=cupycoll.Options(watchdog_interval=0.001))
x = torch.ones(1 << 20, device="cuda:1")
with torch.cuda.device(1):
    torch.cuda._sleep(int(1e9))
work = dist.all_reduce(x, async_op=True)
time.sleep(0.2)  # the watchdog queries the event in flight
waiter = threading.Thread(target=lambda: (work.is_completed(), work.wait(), work.get_future()))
waiter.start()
waiter.join(30)
torch.cuda.synchronize(1)
dist.group.WORLD.abort()
cuda = ctypes.CDLL("libcuda.so.1")
device, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
assert cuda.cuDeviceGet(ctypes.byref(device), 0) == 0
assert cuda.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(active)) == 0
print("cuda0 context active:", active.value)
dist.destroy_process_group()
"""
    proc = run_python("-c", script, timeout=SUBPROCESS_LIMITS_S["no context on cuda:0"])
    assert proc.returncode == 0, proc.stderr
    assert "cuda0 context active: 0" in proc.stdout
