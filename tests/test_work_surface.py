"""The Works of cupycoll's CPU route against gloo's own, method by method, on the torch that
runs the suite (every CI leg) in its default shape: wait, wait(timeout), is_completed,
is_success, exception, result, get_future and source_rank, for collectives, barrier, send
and recv (a fixed source and any source), and a recv not finished yet. Two ranks in
processes, one launch per backend (tests/workers/work_surface_worker.py); the CUDA route's
Work is tests/test_work.py's and, under the watchdog, tests/test_faults.py's and
tests/test_watchdog.py's.

In the Backend shape the caller holds torch's wrapper of cupycoll's Work, which passes on
``wait()`` and ``get_future()`` alone and answers the rest itself (:data:`HOLDER_ANSWERS`;
docs/usage.md, "Two shapes").
"""

from __future__ import annotations

import json
import re

import pytest

from mp import start_ranks, wait_all
from shapes import backend_shape
from workers.work_surface_worker import QUIET_DONE

@pytest.fixture(scope="module")
def surfaces(tmp_path_factory):
    """backend -> (rank -> case -> method -> outcome, rank -> stderr)."""
    jobs, outs = [], {}
    for backend in ("gloo", "cupycoll"):
        out = tmp_path_factory.mktemp(f"work-surface-{backend}")
        outs[backend] = out
        jobs.append(start_ranks("work_surface_worker.py", 2, args=[backend, str(out)], timeout=120))
    results = dict(zip(outs, wait_all(jobs)))
    return {backend: ({rank: json.loads((out / f"rank{rank}.json").read_text(encoding="utf-8")) for rank in range(2)},
                      {r.rank: r.stderr for r in results[backend]})
            for backend, out in outs.items()} | {"closed": _closed(outs["cupycoll"])}


def _closed(out):
    path = out / "rank0.closed.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None


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


def _as_gloo(method: str, gloos):
    """What our Work answers for ``method`` where gloo's answers ``gloos``."""
    if backend_shape() and method in HOLDER_ANSWERS:
        return HOLDER_ANSWERS[method]
    return gloos


def _unusable(outcome) -> bool:
    # torch 2.11 cannot hand Work.exception()'s std::exception_ptr to Python (TypeError)
    return outcome.get("raised") == "TypeError"


def test_every_work_method_answers_as_gloo_does(surfaces):
    gloo, _ = surfaces["gloo"]
    ours, _ = surfaces["cupycoll"]
    for rank in range(2):
        assert set(ours[rank]) == set(gloo[rank])
        for case, methods in gloo[rank].items():
            for method, expected in methods.items():
                got = ours[rank][case][method]
                if method == "exception" and _unusable(expected) and not _gloos_own(case):
                    assert got == {"value": None}, (rank, case, got)  # usable where gloo's is not
                else:
                    assert got == _as_gloo(method, expected), (rank, case, method, got, expected)


def test_a_finished_work_says_completed_and_successful_without_raising(surfaces):
    if backend_shape():
        pytest.skip("in the Backend shape torch's holder answers is_completed itself "
                    "(HOLDER_ANSWERS, pinned by test_every_work_method_answers_as_gloo_does)")
    ours, _ = surfaces["cupycoll"]
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


def test_no_deprecation_warning_that_gloo_itself_would_not_print(surfaces):
    def deprecated(stderr):
        # torch's "Work::is_success API is being deprecated, please ping ..." -> "is_success"
        return set(re.findall(r"Work::(\w+) API is being deprecated", stderr))

    _, gloo_err = surfaces["gloo"]
    _, ours_err = surfaces["cupycoll"]
    for rank in range(2):
        assert deprecated(ours_err[rank]) <= deprecated(gloo_err[rank]), (rank, ours_err[rank])
        # wait(), is_completed() and get_future() alone print nothing, as with gloo
        for stderr in (gloo_err[rank], ours_err[rank]):
            assert QUIET_DONE in stderr, stderr
            assert not deprecated(stderr.split(QUIET_DONE)[0]), (rank, stderr)


def test_a_collective_unfinished_when_its_group_closes_fails_at_once(surfaces):
    closed = surfaces["closed"]
    for how in ("aborted", "shut down"):
        got = closed[how]
        assert got["wait"]["raised"] == "CommunicatorAbortedError", got
        assert re.fullmatch(rf"process group '\d+' was {how} before all_reduce #1 \(float32\[2\]\) finished "
                            r"on rank 0; gloo may still write its output until its own timeout",
                            got["wait"]["text"]), got
        assert got["wait_s"] < 1  # not gloo's 3 s timeout
        if not backend_shape():  # torch's holder answers these itself (HOLDER_ANSWERS)
            assert got["is_completed"] == {"value": True} and got["is_success"] == {"value": False}
