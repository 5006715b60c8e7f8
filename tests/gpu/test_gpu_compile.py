"""GPU tier, compile part: ``torch.compile`` of a DDP model on the CUDA route trains as it
does on torch's nccl (examples/train_ddp.py --compile, two ranks under torchrun; several
ranks share one GPU through NCCL_HOSTID). Two tests: the parity, each backend in processes
of its own (nothing one leaves behind can reach the other), and both in one process,
cupycoll first (nothing cupycoll leaves behind breaks torch's nccl after it). The CPU
route's compiled DDP, FSDP2 and functional collectives are tests/multiproc/test_compile.py's."""

from __future__ import annotations

import pytest

from gpu.tier import GPU_TIER_BUDGETS_S, print_figure
from mp import ddp_parity_with_torch_nccl, gpu_count, largest_difference, train_ddp_side_by_side

pytestmark = pytest.mark.gpu

BUDGET_S = GPU_TIER_BUDGETS_S["compile"]
# torchrun and two ranks start (~10 s), aot_eager compiles the model (~5 s a run), 20 steps
# (~3 s): ~25 s for the launches side by side, ~30 s for one process training on both (the
# run on the H200 had trained cupycoll's half and crashed in torch's 32 s into the test).
SUBPROCESS_LIMITS_S = {"side by side": 50, "one process": 50}
TRAIN_ARGS = ("--compile", "aot_eager", "--steps", "20")
# What the first test found of torch's nccl alone: the crash signal's name, if it crashed.
TORCH_ALONE = {}


def test_compiled_ddp_trains_as_on_torchs_nccl_each_in_processes_of_its_own(tmp_path, capsys):
    runs = train_ddp_side_by_side(SUBPROCESS_LIMITS_S["side by side"], ("cupycoll", "nccl"), tmp_path, *TRAIN_ARGS,
                                  share_gpu=gpu_count() < 2)
    ours, torchs = runs["cupycoll"], runs["nccl"]
    assert ours.proc.returncode == 0 and ours.params is not None, ours.explain()
    TORCH_ALONE["crashed"] = torchs.crashed()
    if TORCH_ALONE["crashed"]:
        # torch's own compiled DDP crashed in processes cupycoll never ran a collective in:
        # the comparison cannot be made, and the fault is not cupycoll's to fix.
        pytest.xfail(f"torch's nccl, compiled, alone in its processes, died of {TORCH_ALONE['crashed']}: "
                     f"parity not judged\n{torchs.explain()}")
    assert torchs.proc.returncode == 0 and torchs.params is not None, torchs.explain()
    diff = largest_difference(ours.params, torchs.params)
    print_figure(capsys, "compiled DDP, processes of its own",
                 f"largest parameter difference vs torch's nccl {diff:.3e}")
    assert diff <= 1e-5


def test_torchs_nccl_trains_compiled_ddp_after_cupycoll_in_one_process(capsys):
    if TORCH_ALONE.get("crashed"):
        pytest.xfail(f"torch's nccl, compiled, crashed alone ({TORCH_ALONE['crashed']}) in the test before: "
                     "its half of this one cannot be judged")
    diff = ddp_parity_with_torch_nccl(SUBPROCESS_LIMITS_S["one process"], *TRAIN_ARGS)
    print_figure(capsys, "compiled DDP, one process", f"largest parameter difference vs torch's nccl {diff:.3e}")
    assert diff <= 1e-5
