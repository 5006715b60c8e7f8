"""The frameworks users train with, on cupycoll's CPU route under torchrun (2 processes), each
told of cupycoll the one way docs/usage.md gives: the same training on gloo ends with the
same parameters (tests/workers/frameworks_worker.py). Each test skips where its framework is
not installed (none is a dependency; CI installs none of them); torchtitan's way in, torch's
default backend map, is checked without torchtitan, which needs CUDA."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mp import WORKERS, run_python
from shapes import cupycoll_group_type

pytestmark = pytest.mark.launches


def _installed(package: str):
    return pytest.mark.skipif(importlib.util.find_spec(package) is None, reason=f"{package} is not installed")


def _train(framework: str, backend: str, out: Path) -> list:
    proc = run_python("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                      str(WORKERS / "frameworks_worker.py"), framework, backend, str(out), timeout=240)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return [json.loads((out / f"rank{r}.json").read_text(encoding="utf-8")) for r in range(2)]


@pytest.mark.parametrize("framework", [
    pytest.param("accelerate", marks=_installed("accelerate")),
    pytest.param("deepspeed", marks=_installed("deepspeed")),
    pytest.param("lightning", marks=_installed("pytorch_lightning")),
])
def test_a_framework_trains_on_cupycoll_as_on_gloo(tmp_path, framework):
    ours, theirs = _train(framework, "cupycoll", tmp_path / "cupycoll"), _train(framework, "gloo", tmp_path / "gloo")
    for mine, reference in zip(ours, theirs):
        assert (mine["group_type"], mine["backend"]) == (cupycoll_group_type(), "cupycoll"), mine
        assert reference["backend"] == "gloo"
        assert mine.pop("params") == reference.pop("params")
        mine.pop("group_type"), reference.pop("group_type"), mine.pop("backend"), reference.pop("backend")
        assert mine == reference  # what the framework reports: its collectives, stage, steps, loss


def test_torchtitans_way_in_is_torchs_default_backend_map_which_registration_leaves_alone(monkeypatch):
    # torchtitan (0.3.0) passes Backend.default_device_backend_map[its device type] to
    # init_process_group and has no setting of its own. Registering "cupycoll" for CUDA leaves
    # the map's CUDA entry as it was (torch keeps an entry it has), so a job points it at
    # cupycoll itself, before torchtitan starts: the line docs/usage.md gives.
    import cupycoll  # noqa: F401 - registered

    assert dist.Backend.default_device_backend_map["cuda"] == "nccl"
    monkeypatch.setitem(dist.Backend.default_device_backend_map, "cuda", "cupycoll")
    backend = dist.Backend.default_device_backend_map.get("cuda")  # what torchtitan reads
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert type(dist.group.WORLD).__name__ == cupycoll_group_type() and dist.get_backend() == "cupycoll"
        t = torch.ones(3)
        dist.all_reduce(t)
        assert torch.equal(t, torch.ones(3))
    finally:
        dist.destroy_process_group()
