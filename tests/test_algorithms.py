"""The algorithms' seam (cupycoll.algorithms): an algorithm registered by name is chosen by
the options and the per-call override, checked before anything launches, runs its calls on
the runner it made for the communicator, and is recorded under its name; the built-in ring
is one such algorithm, which ``auto`` sends the ops NCCL lacks. Each test is named after the
rule it pins."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp as R

import cupycoll
from cupycoll import _args, algorithms, config
from cupycoll.errors import CupycollValueError
from cupycoll.trace.recorder import E_ROUTE
from faulty import GroupComm, make_group
from standins import CUDA, logic_group


class ReversingRunner:
    """A runner that records what it is asked (its algorithm would reverse the data)."""

    def __init__(self, comm, settings, log):
        self.comm, self.log = comm, log
        log.append(("made", settings.ring_scratch_bytes))

    def prepare(self, method, count, dtype, op):
        self.log.append(("prepare", method, count, dtype, op))

    def all_reduce(self, sendbuf, recvbuf, count, dtype, op, stream, premul=None, premul_ptr=None):
        self.log.append(("all_reduce", count, dtype, op, stream))

    def close(self):
        self.log.append(("closed",))


def _only_float32(dtype, op):
    if dtype != "float32":
        raise CupycollValueError(f"the reversing algorithm has no {dtype} {op}")


@pytest.fixture
def group():
    """A group whose calls launch at once on a communicator that records the NCCL calls."""
    return logic_group()


def t(*shape, dtype=torch.float32):
    return torch.ones(*shape, dtype=dtype)


def ar_opts(op):
    options = dist.AllreduceOptions()
    options.reduceOp = R(op)
    return options


@pytest.fixture
def reversing():
    log = []
    algorithms.register(algorithms.Algorithm(
        "reversing", check=_only_float32, takes_over=frozenset(),
        make_runner=lambda comm, settings: ReversingRunner(comm, settings, log)))
    try:
        yield log
    finally:
        algorithms._LOADED.pop("reversing", None)
        _args._PLANS.clear()  # plans are cached by algorithm name


def test_a_registered_algorithm_is_a_value_every_algorithm_option_takes(reversing):
    assert "reversing" in algorithms.names()
    assert config.Options(algorithm="reversing").algorithm == "reversing"
    assert config.resolve(None, None, environ={"CUPYCOLL_ALGORITHM": "Reversing"}).algorithm == "reversing"
    with cupycoll.algorithm("reversing"):
        assert algorithms.override() == "reversing"


def test_an_unknown_algorithm_is_refused_by_name_with_the_choices():
    with pytest.raises(CupycollValueError, match=r"algorithm='tree': expected one of auto, nccl, ring"):
        config.Options(algorithm="tree")


@pytest.mark.parametrize("name", ["auto", "nccl", "ring"])
def test_a_name_already_taken_cannot_be_registered(name):
    with pytest.raises(CupycollValueError, match=f"algorithm name '{name}' is taken"):
        algorithms.register(algorithms.Algorithm(name, check=_only_float32, takes_over=frozenset(),
                                                 make_runner=lambda comm, settings: None))


def test_a_call_on_a_registered_algorithm_prepares_then_runs_on_its_runner_and_is_recorded_by_name(
        group, reversing):
    with cupycoll.algorithm("reversing"):
        group.allreduce([t(3)], ar_opts(R.MAX))
    made, prepared, ran = reversing
    assert made == ("made", config.DEFAULT_RING_SCRATCH_BYTES)  # the group's settings
    assert prepared == ("prepare", "all_reduce", 3, "float32", "max")
    assert ran == ("all_reduce", 3, "float32", "max", 1234)  # on the stream the backend chose
    assert group.submitted[-1] == ("all_reduce", [])  # no NCCL reduction call


def test_a_call_on_an_algorithm_is_recorded_under_its_name(cuda_standins, reversing):
    group = make_group()
    group._cuda.comm, group._cuda.device = GroupComm(), CUDA
    with cupycoll.algorithm("reversing"):
        group.allreduce([t(3)], ar_opts(R.SUM)).wait()
    assert reversing[-1][0] == "all_reduce"
    assert group._trace.recorder.entries[-1][E_ROUTE] == "reversing"
    group.abort()


def test_a_pair_the_algorithm_cannot_run_is_refused_before_anything_is_made(group, reversing):
    with cupycoll.algorithm("reversing"), pytest.raises(CupycollValueError, match="no float16 sum"):
        group.allreduce([t(2, dtype=torch.float16)], ar_opts(R.SUM))
    assert reversing == [] and group.submitted == []
    group.allreduce([t(2)], ar_opts(R.SUM))  # the group stays usable
    assert group.submitted[-1][0] == "all_reduce"


def test_auto_sends_the_ops_nccl_lacks_to_the_builtin_algorithm_taking_them_over():
    assert algorithms.taking_over("bxor") is algorithms.get("ring")
    assert algorithms.taking_over("sum") is None


class StoringRunner(ReversingRunner):
    """A runner that writes what its ranks would agree on into the store it was handed."""

    def __init__(self, comm, settings, store, log):
        super().__init__(comm, settings, log)
        store.set("agreed", b"yes")


def test_an_algorithm_that_needs_a_store_is_handed_the_groups_under_a_prefix_of_its_own():
    store, log = dist.HashStore(), []
    group = logic_group(store)
    algorithms.register(algorithms.Algorithm(
        "storing", check=_only_float32, takes_over=frozenset(), needs_store=True,
        make_runner=lambda comm, settings, store: StoringRunner(comm, settings, store, log)))
    try:
        with cupycoll.algorithm("storing"):
            group.allreduce([t(3)], ar_opts(R.SUM))
    finally:
        algorithms._LOADED.pop("storing", None)
        _args._PLANS.clear()
    assert [entry[0] for entry in log] == ["made", "prepare", "all_reduce"]
    assert store.check(["cupycoll-algorithm/storing/agreed"])
    assert store.get("cupycoll-algorithm/storing/agreed") == b"yes"


def test_closing_the_group_closes_each_runner_it_made(group, reversing):
    with cupycoll.algorithm("reversing"):
        group.allreduce([t(3)], ar_opts(R.SUM))
    group.abort()
    assert reversing[-1] == ("closed",) and group._cuda.comms.runners == {}
