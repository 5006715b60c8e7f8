"""What a caller's Work says about a succeeded, a failed (timed out) and an aborted CUDA
collective, every method asked, in each shape this torch has: the ProcessGroup shape (every
release; the default) and the c10d Backend shape (torch 2.14+, ``CUPYCOLL_SHAPE=backend``).

The Works come from ``dist.all_reduce(..., async_op=True)`` through torch's own dispatch into
the real shell and CUDA core, whose every tensor counts as on ``cuda:0`` and whose batches
are tracked without NCCL (tests/standins.py); the GPU "finishes" a call when the test fires
its event, and the real watchdog times one out.

In the Backend shape torch wraps the Work in its holder, which passes on ``wait()`` and
``get_future()`` alone: :data:`HOLDER_ANSWERS` pins what it answers itself on each release
that has it, where ``compat.PY_BACKEND_WORKS_ANSWER_TRUE`` is False. A torch release that
passes the rest on fails this test: its gate then goes in compat, and the Backend shape may
become the default there. The CPU route's Works are tests/test_work_surface.py's.
"""

from __future__ import annotations

import functools
import time

import pytest
import torch
import torch.distributed as dist

import cupycoll
from cupycoll import compat
from cupycoll.errors import CollectiveTimeoutError, CommunicatorAbortedError
from cupycoll.faults.lifecycle import GroupState
from cupycoll.shell import group_arguments
from cupycoll.issue import Issuer
from standins import CpuAsCudaBackend, CpuAsCudaGroup, RecordedEvent, backend_shape

EVENTS = []  # every CUDA event the backend made, in order: the test fires them


class Event(RecordedEvent):
    def __init__(self):
        super().__init__()
        EVENTS.append(self)

    def synchronize(self):
        self.fired.wait(30)


class TrackingIssuer(Issuer):
    """The real issuer, but a batch is tracked (event, watch, recorder) without NCCL."""

    def _enqueue(self, batch):
        self._track(batch, None, None, True)


class ProcessGroupShape(CpuAsCudaGroup):
    issuer_class = TrackingIssuer


def _process_group_shape(dist_backend_opts, pg_options):
    args, kwargs = group_arguments(dist_backend_opts, pg_options)
    return ProcessGroupShape(*args, **kwargs)


SHAPES = {"process_group": _process_group_shape}
if compat.PY_BACKEND:
    from cupycoll import py_backend

    BackendShape = backend_shape(CpuAsCudaBackend, TrackingIssuer)
    SHAPES["backend"] = functools.partial(py_backend.create, cls=BackendShape)

# What torch's holder of a Python Backend's Work answers itself (torch 2.14.1, 2.15).
HOLDER_ANSWERS = {"is_completed": ("value", False), "is_success": ("value", True),
                  "exception": ("value", None), "result": ("raised", "RuntimeError")}


def _ask(work, method):
    """(``"value"``, what it returned) or (``"raised"``, the error's class name)."""
    try:
        value = getattr(work, method)()
    except Exception as exc:  # noqa: BLE001 - recorded
        return "raised", type(exc).__name__, str(exc)
    if method == "exception":
        return "value", None if value is None else type(value).__name__
    if method == "result":
        return "value", [t.tolist() for t in value]
    return "value", value


def _future(work):
    try:
        return "value", [t.tolist() for t in work.get_future().wait()]
    except Exception as exc:  # noqa: BLE001 - recorded
        return "raised", type(exc).__name__, str(exc)


def _answers(work):
    got = {method: _ask(work, method) for method in ("is_completed", "is_success", "exception", "result")}
    got["get_future"] = _future(work)
    got["wait"] = _ask(work, "wait")
    got["is_completed after wait"] = _ask(work, "is_completed")
    return got


def _truth(error):
    """What a Work that tells the truth answers: succeeded (``error`` None) or failed with it."""
    if error is None:
        done = ("value", [[1.0, 1.0]])  # no NCCL behind the stand-ins: the input, kept
        return {"is_completed": ("value", True), "is_success": ("value", True), "exception": ("value", None),
                "result": done, "get_future": done, "wait": ("value", True),
                "is_completed after wait": ("value", True)}
    return {"is_completed": ("value", True), "is_success": ("value", False),
            "exception": ("value", error.__name__), "result": ("raised", error.__name__),
            "wait": ("raised", error.__name__), "is_completed after wait": ("value", True)}


def _expected(shape, error):
    expected = _truth(error)
    if shape == "backend" and not compat.PY_BACKEND_WORKS_ANSWER_TRUE:
        expected.update(HOLDER_ANSWERS)
        expected["is_completed after wait"] = HOLDER_ANSWERS["is_completed"]
    return expected


def _same(got, expected):
    """``got`` matches ``expected`` on the kind and value or error class (texts aside)."""
    return {m: got[m][:2] for m in expected} == expected


@pytest.fixture
def make_group(monkeypatch, cuda_standins):
    cuda_standins.event_class = Event
    EVENTS.clear()
    made = []

    def make(shape):
        name = f"cupycoll_answers_{shape}"
        if name.upper() not in dist.Backend._plugins:
            dist.Backend.register_backend(name, SHAPES[shape], extended_api=True, devices=["cuda"])
        dist.init_process_group(f"cuda:{name}", store=dist.HashStore(), rank=0, world_size=1,
                                pg_options=cupycoll.Options(timeout=0.5, watchdog_interval=0.01))
        made.append(True)
        group = dist.group.WORLD
        shell = group if hasattr(group, "_trace") else group._get_backend(torch.device("cuda"))
        return group, shell

    yield make
    if dist.is_initialized():
        dist.destroy_process_group()


def _until(condition, seconds=15.0):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert condition()


@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_work_method_of_a_succeeded_a_failed_and_an_aborted_collective(make_group, shape):
    group, shell = make_group(shape)
    # succeeded: unfinished until the GPU is done, then every answer says so
    work = dist.all_reduce(torch.ones(2), async_op=True)
    assert _ask(work, "is_completed") == ("value", False)
    EVENTS[-1].fired.set()
    got = _answers(work)
    assert _same(got, _expected(shape, None)), got

    # failed: the watchdog times it out (0.5 s) and the group is aborted
    work = dist.all_reduce(torch.ones(2), async_op=True)
    _until(lambda: shell._cuda.state is GroupState.ABORTED)
    got = _answers(work)
    assert _same(got, _expected(shape, CollectiveTimeoutError)), got
    assert got["get_future"][0] == "raised" and "timed out" in got["get_future"][2], got
    assert "all_reduce #2 (float32[2]) timed out" in got["wait"][2], got
    dist.destroy_process_group()

    # aborted while in flight
    group, shell = make_group(shape)
    work = dist.all_reduce(torch.ones(2), async_op=True)
    group.abort()
    got = _answers(work)
    assert _same(got, _expected(shape, CommunicatorAbortedError)), got
    assert got["get_future"][0] == "raised" and "was aborted" in got["get_future"][2], got


def test_the_default_shape_gives_works_that_tell_the_truth(make_group):
    # no torch release passes a Python Backend's Work state on yet: the ProcessGroup shape is
    # the default everywhere, and a poll on is_completed() ends
    assert cupycoll.config.shape(compat.BACKEND_SHAPE_BY_DEFAULT, {}) == "process_group"
    group, _ = make_group("process_group")
    work = dist.all_reduce(torch.ones(2), async_op=True)
    EVENTS[-1].fired.set()
    deadline = time.monotonic() + 5
    while not work.is_completed():
        assert time.monotonic() < deadline, "is_completed() never became True"
    assert work.is_success() and work.exception() is None
