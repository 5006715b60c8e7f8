"""GPU tier, fsdp part: FSDP2 on the CUDA route trains as on torch's nccl.

examples/train_fsdp.py, each backend in processes of its own (nothing one leaves behind can
reach the other), all four launches side by side, ranks sharing the GPU through distinct
NCCL_HOSTIDs where there are fewer GPUs than ranks:

- FSDP2 (``fully_shard``) at 2 ranks, 10 steps of a small transformer-like model, fp32 and
  then with ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``, on
  ``"cuda:cupycoll"`` and on ``"nccl"`` (communicators made at init, ``device_id``); after
  the fp32 run, DCP saves the model and optimizer and loads them into others;
- TP inside FSDP2 on a 2x2 mesh, then HSDP (replicate x shard) on a 2x2 mesh, 4 ranks, fp32,
  on both, after ``init_process_group(device_id=...)``: with a bound default group torch's
  ``init_device_mesh`` makes the mesh's subgroups with ``split_group``, one ``ncclCommSplit``
  of the default group's communicator per mesh dimension (the 8-GPU recipe).

The CPU route runs the same script against gloo on every CI leg
(tests/multiproc/test_fsdp_example.py).
"""

from __future__ import annotations

import pytest

from gpu.tier import GPU_TIER_BUDGETS_S, print_figure
from mp import gpu_count, largest_difference, start_train_fsdp, wait_train_fsdp

pytestmark = pytest.mark.gpu

BUDGET_S = GPU_TIER_BUDGETS_S["fsdp"]
# The four launches side by side (12 processes): a process importing torch and CuPy starts in
# 5-10 s (warm page cache: the part runs after others), NCCL init over sockets 1-3 s a
# communicator (the 2x2 mesh makes three), 20 runs of 10 steps of ~9 FSDP2 collectives of a
# few milliseconds, DCP's save and load (small files, a few object collectives), the final
# gathers. About 30 s expected: what one torchrun launch of train_ddp.py took in the demo
# (29 s, two backends of 50 steps) and the compile part (32 s), and 2-4x the same launches on
# a loaded 2-core CPU (7 s at 2 ranks, 16 s at 4, both backends each). 90 s is 3x that.
SUBPROCESS_LIMITS_S = {"launches": 90}
BACKENDS = ("cuda:cupycoll", "nccl")
OURS, TORCHS = BACKENDS
DEVICE = "cuda"
STEPS = "10"
ENV = {
    # cuBLAS picks the same kernels in both processes (no workspace-dependent choice)
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
}
FP32_TOLERANCE = 1e-6
# bf16 parameters, fp32 gradient reduction. At 2 ranks each reduced element is one fp32
# addition, the same in any order and algorithm, and the mean's factor 1/2 is exact; both
# backends' processes run the same kernels on the same GPU: equal parameters are expected,
# as in fp32. The tolerance covers what a correct run may still change: a different choice
# of bf16 GEMM kernel, whose roundings differ. On CPU two correct blockings of the same bf16
# GEMMs (1 and 2 threads) end 10 steps 1.5e-3 apart (fp32: 1.2e-7); bf16 instead of fp32
# moves the parameters by 2.4e-3. What a wrong result in this run does is far larger: the
# reduction is the fp32 one checked to 1e-6 above; a bf16 shard lost or misplaced in a
# parameter all-gather changes weights of size 1/16-1/8; a sum where FSDP2 asks for the mean
# makes them NaN within 10 steps (measured).
BF16_TOLERANCE = 5e-3


def _launch(tmp, backend, world, *args):
    name = f"{backend.replace(':', '-')}-{world}"
    return start_train_fsdp(world, tmp / name, "--backend", backend, "--device", DEVICE, "--steps", STEPS,
                            "--timeout", "60", *args, timeout=SUBPROCESS_LIMITS_S["launches"],
                            share_gpu=gpu_count() < world, env=ENV)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(backend, "fsdp2" or "tp") -> FsdpLaunch, every launch started at once."""
    tmp = tmp_path_factory.mktemp("fsdp")
    started = {}
    for backend in BACKENDS:
        started[backend, "fsdp2"] = _launch(tmp, backend, 2, "--precision", "fp32", "bf16",
                                            "--checkpoint", str(tmp / f"checkpoint-{backend.replace(':', '-')}"))
        started[backend, "tp"] = _launch(tmp, backend, 4, "--mesh", "2x2", "hsdp:2x2")
    try:
        return {key: wait_train_fsdp(launch) for key, launch in started.items()}
    finally:
        for launch in started.values():
            launch.job.kill()


def _runs(launch, backend):
    assert launch.failure is None and launch.results is not None, launch.explain()
    return launch.results["backends"][backend]["runs"]


def _compare(trained, kind, run, tolerance, capsys):
    """The largest parameter difference of ``run`` between cupycoll and torch's nccl."""
    ours = _runs(trained[OURS, kind], OURS)
    torchs = trained[TORCHS, kind]
    crashed = torchs.crashed()
    if crashed:
        # torch's nccl died of a crash signal in processes cupycoll never ran in: the
        # comparison cannot be made, and the fault is not cupycoll's to fix
        pytest.xfail(f"torch's nccl crashed alone in its processes ({crashed}): {run} not judged\n{torchs.explain()}")
    reference = _runs(torchs, TORCHS)
    assert list(ours[run]["params"]) == list(reference[run]["params"])
    diff = largest_difference(list(ours[run]["params"].values()), list(reference[run]["params"].values()))
    print_figure(capsys, f"fsdp {run}", f"largest parameter difference vs torch's nccl {diff:.3e} "
                 f"(tolerance {tolerance:g})")
    assert diff <= tolerance, f"{run}: {diff:.3e} > {tolerance:g}; losses {ours[run]['losses']} vs " \
                              f"{reference[run]['losses']}"
    return ours, reference


def test_fsdp2_in_fp32_ends_with_torch_nccls_parameters(trained, capsys):
    _compare(trained, "fsdp2", "2 fp32", FP32_TOLERANCE, capsys)


def test_fsdp2_with_bf16_parameters_and_fp32_reduction_ends_with_torch_nccls_parameters(trained, capsys):
    ours, reference = _compare(trained, "fsdp2", "2 bf16", BF16_TOLERANCE, capsys)
    for runs in (ours, reference):  # the run computed in bf16: its parameters are not the fp32 run's
        fp32, bf16 = (list(runs[run]["params"].values()) for run in ("2 fp32", "2 bf16"))
        assert largest_difference(fp32, bf16) > 1e-5


def test_tp_inside_fsdp2_on_a_2x2_mesh_ends_with_torch_nccls_parameters(trained, capsys):
    ours, _reference = _compare(trained, "tp", "2x2 fp32", FP32_TOLERANCE, capsys)
    layouts = ours["2x2 fp32"]["layouts"]
    assert layouts["blocks.0.attn.q.weight"].startswith("('dp', 'tp') ("), layouts


def test_hsdp_on_a_2x2_mesh_after_device_id_ends_with_torch_nccls_parameters(trained, capsys):
    ours, _reference = _compare(trained, "tp", "hsdp:2x2 fp32", FP32_TOLERANCE, capsys)
    layouts = ours["hsdp:2x2 fp32"]["layouts"]
    assert layouts["blocks.0.attn.q.weight"].startswith("('replicate', 'shard') (Replicate(), Shard("), layouts


def test_dcp_loads_the_fsdp2_model_and_optimizer_it_saved_on_cuda(trained, capsys):
    launch = trained[OURS, "fsdp2"]
    assert launch.failure is None and launch.results is not None, launch.explain()
    checkpoint = launch.results["backends"][OURS]["checkpoints"]["2"]
    print_figure(capsys, "fsdp DCP round trip", f"{checkpoint['tensors']} tensors, {checkpoint['mismatches']} "
                 f"differ after the load")
    # model and momentum tensors of both ranks, nearly all of which differed before the load
    assert checkpoint["tensors"] > 100 and checkpoint["differed_before_load"] > 100, checkpoint
    assert checkpoint["mismatches"] == 0, checkpoint
