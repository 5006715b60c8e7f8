"""GPU tier, compile part: ``torch.compile`` of a DDP model on the CUDA route trains as it
does on torch's nccl (examples/train_ddp.py --compile --compare nccl, two ranks under
torchrun; several ranks share one GPU through NCCL_HOSTID). The CPU route's compiled DDP,
FSDP2 and functional collectives are tests/test_compile.py's."""

from __future__ import annotations

import pytest

from gpu.tier import GPU_TIER_BUDGETS_S
from mp import ddp_parity_with_torch_nccl

pytestmark = pytest.mark.gpu

BUDGET_S = GPU_TIER_BUDGETS_S["compile"]
# torchrun and two ranks start (~15 s), aot_eager compiles the model twice per run (~10 s),
# 20 steps on each backend: ~45 s.
SUBPROCESS_LIMITS_S = {"compiled ddp parity": 90}


def test_compiled_ddp_parity_with_torch_nccl():
    diff = ddp_parity_with_torch_nccl(SUBPROCESS_LIMITS_S["compiled ddp parity"], "--compile", "aot_eager",
                                      "--steps", "20")
    assert diff <= 1e-5
