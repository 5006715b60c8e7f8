"""GPU tier, compile part: ``torch.compile`` of a DDP model on the CUDA route trains as it
does on torch's nccl (examples/train_ddp.py --compile, two ranks under torchrun; several
ranks share one GPU through NCCL_HOSTID). Two tests: the parity, each backend in processes
of its own (nothing one leaves behind can reach the other), and both in one process,
cupycoll first (nothing cupycoll leaves behind breaks torch's nccl after it). The CPU
route's compiled DDP, FSDP2 and functional collectives are tests/test_compile.py's."""

from __future__ import annotations

import signal

import pytest

from gpu.tier import GPU_TIER_BUDGETS_S
from mp import ddp_parity_with_torch_nccl, largest_difference, train_ddp_side_by_side

pytestmark = pytest.mark.gpu

BUDGET_S = GPU_TIER_BUDGETS_S["compile"]
# torchrun and two ranks start (~15 s), aot_eager compiles the model (~10 s a run), 20 steps.
# The side-by-side launches share the GPU and the CPUs: ~35 s; one process, both backends: ~45 s.
SUBPROCESS_LIMITS_S = {"side by side": 55, "one process": 50}
TRAIN_ARGS = ("--compile", "aot_eager", "--steps", "20")


def test_compiled_ddp_trains_as_on_torchs_nccl_each_in_processes_of_its_own(tmp_path):
    runs = train_ddp_side_by_side(SUBPROCESS_LIMITS_S["side by side"], ("cupycoll", "nccl"), tmp_path, *TRAIN_ARGS)
    ours, torchs = runs["cupycoll"], runs["nccl"]
    assert ours.proc.returncode == 0 and ours.params is not None, ours.explain()
    crashed = torchs.crash_signal()
    if crashed is not None:
        # torch's own compiled DDP died in processes cupycoll never ran a collective in: the
        # comparison cannot be made, and the fault is not cupycoll's to fix.
        pytest.xfail(f"torch's nccl, compiled, alone in its processes, died of {signal.Signals(crashed).name}: "
                     f"parity not judged\n{torchs.explain()}")
    assert torchs.proc.returncode == 0 and torchs.params is not None, torchs.explain()
    assert largest_difference(ours.params, torchs.params) <= 1e-5


def test_torchs_nccl_trains_compiled_ddp_after_cupycoll_in_one_process():
    diff = ddp_parity_with_torch_nccl(SUBPROCESS_LIMITS_S["one process"], *TRAIN_ARGS)
    assert diff <= 1e-5
