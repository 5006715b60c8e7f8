"""GPU tier, one process: stream and Work semantics, bad input on real CUDA tensors, DDP."""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import cupycoll
from cupycoll.errors import CupycollTypeError, CupycollValueError
from mp import ROOT, gpu_count

pytestmark = pytest.mark.gpu


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
        # on the caller's stream; the event is only for the watchdog to query
        assert work._stream == side and work._event is not None
    side.synchronize()
    assert torch.equal(x.cpu(), torch.ones(8))


def test_async_uses_internal_stream_and_wait_does_not_block_cpu(group):
    x = torch.ones(1 << 20, device="cuda")
    torch.cuda._sleep(int(2e9))  # ~1 s of GPU time on the current stream
    start = time.monotonic()
    work = dist.all_reduce(x, async_op=True)
    assert work._stream != torch.cuda.current_stream()
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
    with pytest.raises(CupycollValueError, match="BXOR"):
        dist.all_reduce(torch.ones(3, dtype=torch.int32, device="cuda"), op=dist.ReduceOp.BXOR)
    with pytest.raises(CupycollValueError, match="root 3 is out of range"):
        group.broadcast([x], _bopts(3))
    if gpu_count() > 1:
        with pytest.raises(CupycollValueError, match="cuda:1 but this group's communicator is on cuda:0"):
            dist.all_reduce(torch.ones(2, device="cuda:1"))
    dist.all_reduce(x)
    assert torch.equal(x.cpu(), torch.ones(4, 4))


def test_ddp_comm_hook_gets_cuda_future(group):
    model = torch.nn.Linear(8, 4).cuda()
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0])
    seen = []

    def hook(state, bucket):
        fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
        seen.append(bucket.index())
        return fut.then(lambda f: f.value()[0])

    ddp.register_comm_hook(None, hook)
    ddp(torch.randn(16, 8, device="cuda")).sum().backward()
    assert seen and all(p.grad is not None for p in model.parameters())


def test_ddp_parity_with_torch_nccl():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "examples" / "train_ddp.py"), "--compare", "nccl"]
    if gpu_count() < 2:
        cmd.append("--share-gpu")
    # make test-gpu runs from a checkout that need not be pip-installed
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    diff = float(re.search(r"max \|param difference\| cupycoll vs nccl: ([0-9.eE+-]+)", result.stdout).group(1))
    assert diff <= 1e-5


def _opts(async_op):
    o = torch._C._distributed_c10d.AllreduceOptions()
    o.asyncOp = async_op
    return o


def _bopts(root):
    o = torch._C._distributed_c10d.BroadcastOptions()
    o.rootRank = root
    return o
