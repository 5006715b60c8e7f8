"""Every torch.distributed API on CPU tensors through the cupycoll group, in real processes.

torch makes a Python group the whole group, so these prove that ProcessGroupCupycoll routes
CPU work to gloo faithfully: each case is checked against a locally computed reference and
the outputs must equal a plain gloo run exactly. Covers every registration form.
"""

from __future__ import annotations

import json

import pytest
import torch

from mp import run_ranks


def _run(tmp_path, backend, world, *extra):
    out = tmp_path / backend.replace(":", "_").replace(",", "+")
    run_ranks("api_worker.py", world, ["--backend", backend, "--out", str(out), *extra], timeout=180)
    summaries = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    outputs = [torch.load(out / f"rank{r}.pt") for r in range(world)]
    return summaries, outputs


def _assert_same(a, b):
    assert set(a) == set(b)
    for name in a:
        x, y = a[name], b[name]
        xs, ys = (x, y) if isinstance(x, list) else ([x], [y])
        assert len(xs) == len(ys), name
        for u, v in zip(xs, ys):
            assert u.dtype == v.dtype and torch.equal(u, v), name


@pytest.mark.parametrize("world", [2, 3])
def test_all_apis_match_gloo(tmp_path, world):
    ours, our_out = _run(tmp_path, "cupycoll", world)
    theirs, their_out = _run(tmp_path, "gloo", world)
    for rank in range(world):
        assert ours[rank]["failures"] == []
        assert ours[rank]["group_type"] == "ProcessGroupCupycoll"
        assert ours[rank]["cases"] == theirs[rank]["cases"] > 100
        # the same forms are rejected (gloo has no _start_coalescing) and the rest agree
        assert ours[rank]["errors"] == theirs[rank]["errors"]
        assert any(name.startswith("coalesced/") for name in our_out[rank])
        _assert_same(our_out[rank], their_out[rank])


@pytest.mark.parametrize("backend", ["cuda:cupycoll", "cpu:gloo,cuda:cupycoll"])
def test_registration_forms(tmp_path, backend):
    summaries, _ = _run(tmp_path, backend, 2)
    for summary in summaries:
        assert summary["failures"] == []
        assert summary["group_type"] == "ProcessGroupCupycoll"


def test_entry_point_registers_without_import(tmp_path):
    from importlib.metadata import entry_points

    if not any(ep.name == "cupycoll" for ep in entry_points(group="torch.backends")):
        pytest.skip("cupycoll is not pip-installed here, so its torch.backends entry point is absent")
    summaries, _ = _run(tmp_path, "cupycoll", 2, "--no-import")
    assert all(s["failures"] == [] and s["group_type"] == "ProcessGroupCupycoll" for s in summaries)
