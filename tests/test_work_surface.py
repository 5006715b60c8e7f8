"""The Works of cupycoll's CPU route against gloo's own, method by method, on the torch that
runs the suite (every CI leg), in each shape it has: wait, wait(timeout), is_completed,
is_success, exception, result, get_future and source_rank, for collectives, barrier, send
and recv (a fixed source and any source), and a recv not finished yet; then cupycoll's own
rules for a collective that timed out and one its group closed under. Two ranks in
processes, one launch per backend and shape (tests/workers/work_surface_worker.py); the
CUDA route's Works are tests/test_work_answers.py's and, under the watchdog,
tests/faults/test_faults.py's and tests/faults/test_watchdog.py's.

In the Backend shape (torch 2.14+, ``CUPYCOLL_SHAPE=backend``) the caller holds torch's
wrapper of cupycoll's Work, which passes on ``wait()`` and ``get_future()`` alone and answers
the rest itself (:data:`HOLDER_ANSWERS`; docs/usage.md, "Two shapes").
"""

from __future__ import annotations

import json
import re

import pytest

from cupycoll import compat
from mp import start_ranks, wait_all
from shapes import backend_shape
from workers.work_surface_worker import QUIET_DONE

pytestmark = pytest.mark.launches

# cupycoll in the default shape, and where torch has it the other one.
VARIANTS = {"cupycoll": {}}
if compat.PY_BACKEND:
    VARIANTS["cupycoll " + ("process_group" if backend_shape() else "backend")] = {
        "CUPYCOLL_SHAPE": "process_group" if backend_shape() else "backend"}


@pytest.fixture(scope="module")
def surfaces(tmp_path_factory, once_per_run):
    """variant -> (rank -> case -> method -> outcome, rank -> stderr, rank 0's closed cases)."""
    def launch():
        jobs, outs = [], {}
        for variant, env in {"gloo": {}, **VARIANTS}.items():
            out = tmp_path_factory.mktemp(f"work-surface-{variant.replace(' ', '-')}")
            outs[variant] = out
            jobs.append(start_ranks("work_surface_worker.py", 2, args=[variant.split()[0], str(out)], timeout=120,
                                    env=env))
        results = dict(zip(outs, wait_all(jobs)))
        return {variant: ({rank: json.loads((out / f"rank{rank}.json").read_text(encoding="utf-8"))
                           for rank in range(2)},
                          {r.rank: r.stderr for r in results[variant]}, _closed(out))
                for variant, out in outs.items()}
    return once_per_run("work-surface", launch)


def _closed(out):
    path = out / "rank0.closed.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None


def _holder(variant: str) -> bool:
    """Does the caller of this variant hold torch's holder (the Backend shape)?"""
    return backend_shape(VARIANTS[variant])


# CPU send and recv return gloo's own Work unchanged: the same object, so the same answers.
GLOOS_OWN = {"send", "recv", "recv any source", "unfinished recv"}


def _gloos_own(case: str) -> bool:
    return case in GLOOS_OWN


# What torch's holder of a Python Backend's Work answers itself, whatever the Work behind it
# would (torch 2.14.1 and 2.15: it passes on wait() and get_future() alone).
HOLDER_ANSWERS = {"is_completed": {"value": False}, "is_completed after": {"value": False},
                  "result": {"raised": "RuntimeError", "text": "result() not implemented."},
                  "source_rank": {"raised": "RuntimeError", "text": "sourceRank() may only be called "
                                  "on work objects that correspond to a recv or recv-from-any call."}}


def _as_gloo(variant: str, method: str, gloos):
    """What our Work answers for ``method`` where gloo's answers ``gloos``."""
    if _holder(variant) and method in HOLDER_ANSWERS:
        return HOLDER_ANSWERS[method]
    return gloos


def _unusable(outcome) -> bool:
    # torch 2.11 cannot hand Work.exception()'s std::exception_ptr to Python (TypeError)
    return outcome.get("raised") == "TypeError"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_work_method_answers_as_gloo_does(surfaces, variant):
    gloo = surfaces["gloo"][0]
    ours = surfaces[variant][0]
    for rank in range(2):
        assert set(ours[rank]) == set(gloo[rank])
        for case, methods in gloo[rank].items():
            for method, expected in methods.items():
                got = ours[rank][case][method]
                if method == "exception" and _unusable(expected) and not _gloos_own(case):
                    assert got == {"value": None}, (rank, case, got)  # usable where gloo's is not
                else:
                    assert got == _as_gloo(variant, method, expected), (rank, case, method, got, expected)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_finished_work_says_completed_and_successful_without_raising(surfaces, variant):
    if _holder(variant):
        pytest.skip("in the Backend shape torch's holder answers is_completed itself "
                    "(HOLDER_ANSWERS, pinned by test_every_work_method_answers_as_gloo_does)")
    ours = surfaces[variant][0]
    for rank in range(2):
        for case, methods in ours[rank].items():
            if case == "quiet":
                assert methods["is_completed"] == {"value": True}
                continue
            if case == "unfinished recv":
                assert methods["is_completed"] == {"value": False}
                assert methods["is_completed after"] == {"value": True}
                continue
            assert methods["is_completed"] == methods["is_success"] == {"value": True}, (rank, case)
            if not _gloos_own(case):  # gloo's own: as gloo answers (test above)
                assert methods["exception"] == {"value": None}, (rank, case)
    assert ours[1]["recv"]["source_rank"] == {"value": 0}
    assert ours[1]["recv any source"]["source_rank"] == {"value": 0}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_no_deprecation_warning_that_gloo_itself_would_not_print(surfaces, variant):
    def deprecated(stderr):
        # torch's "Work::is_success API is being deprecated, please ping ..." -> "is_success"
        return set(re.findall(r"Work::(\w+) API is being deprecated", stderr))

    gloo_err = surfaces["gloo"][1]
    ours_err = surfaces[variant][1]
    for rank in range(2):
        assert deprecated(ours_err[rank]) <= deprecated(gloo_err[rank]), (rank, ours_err[rank])
        # wait(), is_completed() and get_future() alone print nothing, as with gloo
        for stderr in (gloo_err[rank], ours_err[rank]):
            assert QUIET_DONE in stderr, stderr
            assert not deprecated(stderr.split(QUIET_DONE)[0]), (rank, stderr)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_collective_unfinished_when_its_group_closes_fails_at_once(surfaces, variant):
    closed = surfaces[variant][2]
    for how in ("aborted", "shut down"):
        got = closed[how]
        assert got["wait"]["raised"] == "CommunicatorAbortedError", got
        assert re.fullmatch(rf"process group '\d+' was {how} before all_reduce #1 \(float32\[2\]\) finished "
                            r"on rank 0; gloo may still write its output until its own timeout",
                            got["wait"]["text"]), got
        assert got["wait_s"] < 1  # not gloo's 3 s timeout
        if not _holder(variant):  # torch's holder answers these itself (HOLDER_ANSWERS)
            assert got["is_completed"] == {"value": True} and got["is_success"] == {"value": False}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_timed_out_collective_gives_the_explained_error_to_exception_and_wait_alike(surfaces, variant):
    got = surfaces[variant][2]["timed out"]
    assert got["wait"]["raised"] == "CollectiveTimeoutError", got
    assert "all_reduce #1 (float32[2]) timed out after 2 s on rank 0; rank 1 is behind" in got["wait"]["text"], got
    if _holder(variant):  # torch's holder answers exception() and the rest itself
        assert got["exception"] == {"value": None} and got["is_completed"] == {"value": False}, got
        return
    # asked before wait(), exception() already names the rank behind: the same error
    assert got["exception"] == {"value": "CollectiveTimeoutError"} and got["same error"], got
    assert got["is_completed"] == {"value": True} and got["is_success"] == {"value": False}, got
