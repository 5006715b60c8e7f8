"""CPU tier: examples/train_fsdp.py on cupycoll's CPU route trains as on plain gloo.

What the GPU tier's fsdp part runs on CUDA against torch's nccl (tests/gpu/test_gpu_fsdp.py),
here on CPU tensors: FSDP2 at 2 ranks in fp32 and with bf16 parameters and fp32 reduction,
DCP save and load of the model and optimizer, and TP inside FSDP2 on a 2x2 mesh at 4 ranks.
The script trains on cupycoll, then on gloo in the same processes (``--compare gloo``: half
the process starts of a launch per backend), and saves both; the two launches run side by
side. FSDP2, DTensor and DCP change from one torch release to the next, so every CI leg runs
these. On CPU every collective reaches gloo either way, so the runs must agree bit for bit.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from cupycoll import compat
from mp import FSDP_EXAMPLE, largest_difference, start_train_fsdp, wait_train_fsdp

pytestmark = pytest.mark.launches

# Fewer steps than the GPU tier's 10: the runs are compared bit for bit, and a step costs
# 0.1-0.3 s a rank here, where process starts cost the most.
STEPS = "5"
LIMIT_S = 150  # measured 7 s (2 ranks) and 16 s (4 ranks) alone, on a loaded 2-core machine


def load_example():
    """examples/train_fsdp.py as a module (it imports train_ddp.py from its own folder)."""
    sys.path.insert(0, str(FSDP_EXAMPLE.parent))
    try:
        spec = importlib.util.spec_from_file_location("train_fsdp_example", FSDP_EXAMPLE)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(FSDP_EXAMPLE.parent))
    return module


HSDP = load_example().HSDP_ON_CPU  # the example trains HSDP on CPU on this torch


@pytest.fixture(scope="module")
def launches(tmp_path_factory, once_per_run):
    """"fsdp2": 2 ranks, fp32 then bf16, the first checkpointed; "tp": 4 ranks, a 2x2 mesh of TP
    inside FSDP2, then HSDP on a 2x2 mesh."""
    def launch():
        tmp = tmp_path_factory.mktemp("fsdp")
        common = ("--device", "cpu", "--backend", "cupycoll", "--compare", "gloo", "--steps", STEPS)
        # one intra-op thread a rank: six ranks share two cores
        env = {"OMP_NUM_THREADS": "1"}
        started = {
            "fsdp2": start_train_fsdp(2, tmp / "fsdp2", *common, "--precision", "fp32", "bf16",
                                      "--checkpoint", str(tmp / "checkpoint"), timeout=LIMIT_S, env=env),
            "tp": start_train_fsdp(4, tmp / "tp", *common, "--mesh", "2x2", *(["hsdp:2x2"] if HSDP else []),
                                   timeout=LIMIT_S, env=env),
        }
        try:
            return {name: wait_train_fsdp(started_launch) for name, started_launch in started.items()}
        finally:
            for started_launch in started.values():
                started_launch.job.kill()
    return once_per_run("fsdp-example", launch)


def _results(launch):
    assert launch.failure is None and launch.results is not None, launch.explain()
    return launch.results["backends"]


def _same_training(results, run):
    ours, gloo = results["cupycoll"]["runs"][run], results["gloo"]["runs"][run]
    assert list(ours["params"]) == list(gloo["params"])
    assert largest_difference(list(ours["params"].values()), list(gloo["params"].values())) == 0, run
    assert ours["losses"] == gloo["losses"], run
    assert len(ours["losses"]) == int(STEPS) and ours["losses"][-1] < ours["losses"][0], run  # it learned


def test_fsdp2_on_cupycoll_trains_as_on_gloo_in_fp32_and_with_bf16_parameters(launches):
    results = _results(launches["fsdp2"])
    for run in ("2 fp32", "2 bf16"):
        _same_training(results, run)
    # the bf16 run computed in bf16: its parameters are not the fp32 run's
    fp32, bf16 = (results["cupycoll"]["runs"][run]["params"] for run in ("2 fp32", "2 bf16"))
    assert largest_difference(list(fp32.values()), list(bf16.values())) > 1e-5
    assert "max |param difference| cupycoll vs gloo [2 bf16]: 0.000e+00" in launches["fsdp2"].ranks[0].stdout


def test_dcp_loads_the_fsdp2_model_and_optimizer_it_saved(launches):
    for backend, result in _results(launches["fsdp2"]).items():
        checkpoint = result["checkpoints"]["2"]
        # model and momentum tensors of both ranks; those that an empty shard leaves equal
        # before the load do not count as having differed
        assert checkpoint["tensors"] > 100 and checkpoint["differed_before_load"] > 100, (backend, checkpoint)
        assert checkpoint["mismatches"] == 0, (backend, checkpoint)


def test_tensor_parallel_inside_fsdp2_on_a_2x2_mesh_trains_as_on_gloo(launches):
    results = _results(launches["tp"])
    _same_training(results, "2x2 fp32")
    layouts = results["cupycoll"]["runs"]["2x2 fp32"]["layouts"]
    # the projections are sharded over both dimensions, the rest over DP alone
    assert layouts["blocks.0.attn.q.weight"].startswith("('dp', 'tp') ("), layouts
    assert layouts["blocks.1.down.weight"].startswith("('dp', 'tp') ("), layouts
    assert layouts["blocks.0.attn_norm.weight"].startswith("('dp',) ("), layouts
    assert "[cupycoll fp32] 5 steps on mesh (2, 2) (cpu)" in launches["tp"].ranks[0].stdout


@pytest.mark.skipif(not HSDP, reason=f"torch {torch.__version__}'s FSDP2 runs HSDP on CUDA only (2.11 runs it on CPU)")
def test_hsdp_on_a_2x2_mesh_trains_as_on_gloo(launches):
    results = _results(launches["tp"])
    _same_training(results, "hsdp:2x2 fp32")
    layouts = results["cupycoll"]["runs"]["hsdp:2x2 fp32"]["layouts"]
    # every parameter replicated over one dimension, sharded over the other
    assert all(layout.startswith("('replicate', 'shard') (Replicate(), Shard(") for layout in layouts.values()), layouts


def test_the_gloo_reference_takes_the_learning_rate_that_undoes_its_sum_where_gloo_sums(launches):
    # Before torch 2.11 gloo sums where FSDP2 asks for the mean (cupycoll's CPU route
    # averages): the example divides gloo's learning rate by DP there, and only there.
    example = load_example()
    assert example.GLOO_SUMS_FSDP_MEANS == (not compat.GLOO_REDUCE_SCATTER_HONOURS_OP)
    out = launches["fsdp2"].ranks[0].stdout
    assert ("lr 0.05 / 2 DP ranks (this gloo sums FSDP2's means)" in out) == example.GLOO_SUMS_FSDP_MEANS, out
    assert "[cupycoll fp32]" in out and "cupycoll fp32] 5 steps on mesh (2,) (cpu) in" in out


@pytest.mark.parametrize("mesh, world, words", [
    ("3", 4, "3 x 1 = 3 ranks, but there are 4"),
    ("2x3", 6, "4 heads and 256 hidden features must split over 3 TP ranks"),
    ("2by2", 4, "give DP, DPxTP or hsdp:RxS"),
    ("0x4", 4, "give DP, DPxTP or hsdp:RxS"),
    ("hsdp:4", 4, "give DP, DPxTP or hsdp:RxS"),
    ("hsdp:3x2", 4, "3 x 2 = 6 ranks, but there are 4"),
])
def test_a_mesh_that_does_not_fit_the_ranks_or_the_model_is_refused_by_name(mesh, world, words, capsys):
    example = load_example()
    with pytest.raises(SystemExit) as exit_:
        example.mesh_shape(mesh, world)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"train_fsdp.py: error: --mesh {mesh}") and words in err, err
    assert example.mesh_shape("2x2", 4) == (2, 2, False) and example.mesh_shape("4", 4) == (4, 1, False)
    assert example.mesh_shape("hsdp:2x2", 4) == (2, 2, True)
