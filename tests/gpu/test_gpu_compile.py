"""GPU tier, compile part: ``torch.compile`` of a DDP model on the CUDA route trains as it
does on torch's nccl (examples/train_ddp.py --compile --compare nccl, two ranks under
torchrun; several ranks share one GPU through NCCL_HOSTID). The CPU route's compiled DDP,
FSDP2 and functional collectives are tests/test_compile.py's."""

from __future__ import annotations

import re
import sys

import pytest

from gpu.tier import GPU_TIER_BUDGETS_S
from mp import ROOT, gpu_count, run_python, shared_gpu_env

pytestmark = pytest.mark.gpu

BUDGET_S = GPU_TIER_BUDGETS_S["compile"]
# torchrun and two ranks start (~15 s), aot_eager compiles the model twice per run (~10 s),
# 20 steps on each backend: ~45 s.
SUBPROCESS_LIMITS_S = {"compiled ddp parity": 90}


def test_compiled_ddp_parity_with_torch_nccl():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "examples" / "train_ddp.py"), "--compile", "aot_eager", "--steps", "20",
           "--compare", "nccl"]
    if gpu_count() < 2:
        cmd.append("--share-gpu")
    env = {k: v for k, v in shared_gpu_env(0).items() if k != "NCCL_HOSTID"}
    result = run_python(*cmd[1:], timeout=SUBPROCESS_LIMITS_S["compiled ddp parity"], env=env)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    diff = float(re.search(r"max \|param difference\| cupycoll vs nccl: ([0-9.eE+-]+)", result.stdout).group(1))
    assert diff <= 1e-5
