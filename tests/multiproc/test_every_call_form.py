"""Every form torch binds for a ProcessGroup method, on 2 CPU ranks: cupycoll's group answers
each as torch's gloo group does (tests/workers/call_forms_worker.py), in both shapes where this
torch has the Backend shape."""

from __future__ import annotations

import json

import pytest
import torch

from cupycoll import call_forms, compat
from mp import run_ranks
from shapes import cupycoll_group_type
from torch_forms import forms, overloads

pytestmark = pytest.mark.launches


def _run(tmp_path, env=None):
    out = tmp_path / "forms"
    run_ranks("call_forms_worker.py", 2, ["--out", str(out)], timeout=240, env=env)
    return [json.loads((out / f"rank{r}.json").read_text(encoding="utf-8")) for r in range(2)]


def _assert_every_form_answers_as_gloo(tmp_path, env=None):
    expected = [str(form) for method in sorted(call_forms.FORMS) for form in forms(method)]
    # every form pybind lists for each method this release binds (tests/test_call_forms.py pins
    # which those are, and that they are cupycoll's, release by release)
    assert len(expected) == sum(overloads(method) for method in call_forms.FORMS)
    assert len(expected) > len([method for method in call_forms.FORMS if overloads(method)]) > 0
    for summary in _run(tmp_path, env):
        assert summary["differences"] == []
        assert summary["forms"] == expected
        # four ways to call most forms, and bad forms
        assert summary["cases"] > 3 * len(expected)
        assert summary["group_type"] == cupycoll_group_type(env)


def test_every_form_of_torchs_process_group_answers_as_gloo_does(tmp_path):
    _assert_every_form_answers_as_gloo(tmp_path)


@pytest.mark.skipif(not compat.PY_BACKEND, reason=f"torch {torch.__version__} has no PyBackend trampoline (2.14 added it)")
def test_every_form_answers_as_gloo_does_in_the_backend_shape(tmp_path):
    _assert_every_form_answers_as_gloo(tmp_path, {"CUPYCOLL_SHAPE": "backend"})
