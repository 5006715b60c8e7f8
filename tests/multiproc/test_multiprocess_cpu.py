"""Every torch.distributed API on CPU tensors through the cupycoll group, in real processes.

torch makes a Python group the whole group, so these prove that ProcessGroupCupycoll routes
CPU work to gloo faithfully: each case is checked against a locally computed reference and
the outputs must equal a plain gloo run exactly. Covers every registration form.
"""

from __future__ import annotations

import json

import pytest
import torch

from cupycoll import compat
from installed import cupycoll_entry_points
from mp import run_ranks
from shapes import cupycoll_group_type

pytestmark = pytest.mark.launches


def _run(tmp_path, backend, world, *extra, expect_success=True, env=None):
    out = tmp_path / backend.replace(":", "_").replace(",", "+")
    run_ranks("api_worker.py", world, ["--backend", backend, "--out", str(out), *extra], timeout=180,
              expect_success=expect_success, env=env)
    summaries = [json.loads((out / f"rank{r}.json").read_text(encoding="utf-8")) for r in range(world)]
    outputs = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(world)]
    return summaries, outputs


def _assert_same(a, b):
    assert set(a) == set(b)
    for name in a:
        x, y = a[name], b[name]
        xs, ys = (x, y) if isinstance(x, list) else ([x], [y])
        assert len(xs) == len(ys), name
        for u, v in zip(xs, ys):
            assert u.dtype == v.dtype and torch.equal(u, v), name


def _gloo_gap(failure: str) -> bool:
    """Is this failure of the plain gloo run one of this torch's known gloo gaps, which
    cupycoll's CPU route fills (cupycoll.compat)?"""
    name = failure.split(":")[0]
    if not compat.GLOO_HAS_ALLTOALL and name.startswith("all_to_all/"):
        return "does not support alltoall" in failure  # before 2.12
    if not compat.GLOO_REDUCE_SCATTER_HONOURS_OP and name.startswith("reduce_scatter_tensor/"):
        return "RedOpType.SUM" not in name and " got " in failure  # 2.7 sums for every op
    return False


# Each run also proves a registration form: world 2 the per-device string, world 3 the bare
# name (the third form has test_registration_forms; one run each keeps the tier's CPU down).
@pytest.mark.parametrize("world, backend", [(2, "cuda:cupycoll"), (3, "cupycoll")])
def test_all_apis_match_gloo(tmp_path, world, backend):
    _assert_every_api_matches_gloo(tmp_path, world, backend)


@pytest.mark.skipif(not compat.PY_BACKEND, reason=f"torch {torch.__version__} has no PyBackend trampoline (2.14 added it)")
def test_the_backend_shape_runs_every_api_as_gloo_does(tmp_path):
    """torch's own ProcessGroup dispatching CPU calls to cupycoll's CpuView, then its shell."""
    _assert_every_api_matches_gloo(tmp_path, 2, "cupycoll", env={"CUPYCOLL_SHAPE": "backend"})


def _assert_every_api_matches_gloo(tmp_path, world, backend, env=None):
    ours, our_out = _run(tmp_path, backend, world, env=env)
    gaps_expected = not (compat.GLOO_HAS_ALLTOALL and compat.GLOO_REDUCE_SCATTER_HONOURS_OP)
    theirs, their_out = _run(tmp_path, "gloo", world, expect_success=not gaps_expected)
    for rank in range(world):
        assert ours[rank]["failures"] == []
        assert ours[rank]["group_type"] == cupycoll_group_type(env)
        assert all(_gloo_gap(f) for f in theirs[rank]["failures"]), theirs[rank]["failures"]
        if not compat.GLOO_HAS_ALLTOALL:
            assert any(f.startswith("all_to_all/") for f in theirs[rank]["failures"])
        # A case gloo got wrong was still checked by the worker against its local reference
        # in our run; one gloo raised on was not counted in gloo's.
        raised = {f.split(":")[0] for f in theirs[rank]["failures"] if ": raised " in f}
        wrong = {f.split(":")[0].split("[")[0] for f in theirs[rank]["failures"]} - raised
        assert ours[rank]["cases"] == theirs[rank]["cases"] + len(raised) > 100
        our_out[rank] = {k: v for k, v in our_out[rank].items() if k not in raised | wrong}
        their_out[rank] = {k: v for k, v in their_out[rank].items() if k not in wrong}
        # the same forms are rejected (gloo has no _start_coalescing) and the rest agree
        assert ours[rank]["errors"] == theirs[rank]["errors"]
        assert any(name.startswith("coalesced/") for name in our_out[rank])
        _assert_same(our_out[rank], their_out[rank])


@pytest.mark.parametrize("backend", ["cpu:gloo,cuda:cupycoll"])  # the others: test_all_apis_match_gloo
def test_registration_forms(tmp_path, backend):
    summaries, _ = _run(tmp_path, backend, 2)
    for summary in summaries:
        assert summary["failures"] == []
        assert summary["group_type"] == cupycoll_group_type()


def test_entry_point_registers_without_import(tmp_path):
    if not cupycoll_entry_points("torch.backends"):
        pytest.skip("cupycoll is not pip-installed here, so its torch.backends entry point is absent")
    summaries, _ = _run(tmp_path, "cupycoll", 2, "--no-import")
    assert all(s["failures"] == [] and s["group_type"] == cupycoll_group_type() for s in summaries)
