"""The 8-GPU recipes' subgroups on CPU, 4 ranks: a default group bound to a device (as
``init_process_group(device_id=...)`` binds it), then ``dist.split_group`` and
``init_device_mesh("cuda", (2, 2))`` (FSDP2 + TP, HSDP), in every shape this torch has.
torch takes ``split_group`` for a bound default group; every subgroup it makes must be a
cupycoll group, of the right ranks, on every rank (tests/workers/mesh_worker.py). The GPU tier
runs the same recipes with real communicators (tests/gpu/test_gpu_fsdp.py).
"""

from __future__ import annotations

import json

import pytest
import torch

from cupycoll import compat
from mp import run_ranks

pytestmark = pytest.mark.launches

SHAPES = ["process_group"] + (["backend"] if compat.PY_BACKEND else [])


def _results(backend: str, shape: str):
    ranks = run_ranks("mesh_worker.py", 4, [backend], timeout=180, env={"CUPYCOLL_SHAPE": shape})
    found = [json.loads(line[len("RESULT "):]) for r in ranks for line in r.stdout.splitlines()
             if line.startswith("RESULT ")]
    assert [r["rank"] for r in found] == [0, 1, 2, 3], [r.stdout + r.stderr for r in ranks]
    return found


@pytest.mark.parametrize("shape", SHAPES)
def test_split_group_and_a_device_mesh_after_device_id_give_cupycoll_groups_of_the_right_ranks(shape):
    shell = "ProcessGroupCupycoll" if shape == "process_group" else "CupycollBackend"
    for rank, result in enumerate(_results("cpu:gloo,cuda:cupycoll", shape)):
        dp, tp = [rank % 2, rank % 2 + 2], [rank - rank % 2, rank - rank % 2 + 1]
        assert result["dp"] == {"cuda": shell, "ranks": dp, "sum": float(sum(dp))}
        assert result["tp"] == {"cuda": shell, "ranks": tp, "sum": float(sum(tp))}
        if not compat.SPLIT_GROUP_REACHES_PYTHON_GROUPS:
            # torch's split_group takes ProcessGroupNCCL alone: the mesh was made with new_group
            assert "split" not in result
            continue
        halves = [0, 1] if rank < 2 else [2, 3]
        assert result["split"] == {"cuda": shell, "ranks": halves, "sum": float(sum(halves)),
                                   "backend": "cpu:gloo,cuda:cupycoll", "name": result["split"]["name"],
                                   "bound": f"cuda:{rank}"}  # torch binds the split to the parent's device
        if rank < 3:
            assert result["lonely"] == [0, 1, 2]
        elif shape == "process_group":
            assert result["lonely"] is None  # in none of the sub-lists: no group
        else:  # torch's trampoline cannot take "no group" back from a Python Backend
            assert result["lonely"].startswith("refused: split_group: rank 3") and not compat.PY_BACKEND_SPLIT_CAN_DECLINE
