"""A group's fault, asked in public (``group.fault``, ``cupycoll.group_fault(group)``): what
ended the group, read from its lifetime each time, in both shapes; None while it is healthy
and after a clean shutdown."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

import cupycoll
from cupycoll import compat
from cupycoll.errors import CollectiveTimeoutError, CommunicatorAbortedError, CupycollValueError, PeerFailedError
from cupycoll.faults.watchdog import Finding
from cupycoll.process_group import ProcessGroupCupycoll


@pytest.fixture
def group():
    made = ProcessGroupCupycoll(dist.HashStore(), 0, 1, datetime.timedelta(seconds=30), group_id="faulty")
    yield made
    made.shutdown()


def test_a_healthy_group_has_no_fault_and_an_aborted_one_names_the_abort(group):
    assert group.fault is None and cupycoll.group_fault(group) is None
    group.abort()
    fault = group.fault
    assert isinstance(fault, CommunicatorAbortedError) and "'faulty' was aborted" in str(fault)
    assert cupycoll.group_fault(group) is fault  # the lifetime's own record, not a copy
    with pytest.raises(CommunicatorAbortedError):
        group.allreduce([torch.ones(1)])


def test_the_fault_the_lifetime_claimed_is_the_groups(group):
    timeout = CollectiveTimeoutError("all_reduce #3 timed out: rank 1 never joined it")
    group._cuda.life.claim(Finding(timeout), here=True)
    assert group.fault is timeout
    group.abort()  # a later abort keeps the first fault
    assert group.fault is timeout


def test_a_shut_down_group_has_no_fault(group):
    group.shutdown()
    assert group.fault is None


def test_a_failed_cpu_collective_raises_from_its_work_and_leaves_the_group_healthy(group, monkeypatch):
    def failing(*args):
        raise PeerFailedError("rank 1 is gone")
    monkeypatch.setattr(group, "_cpu", type("Half", (), {"allreduce": staticmethod(failing)})())
    with pytest.raises(PeerFailedError):
        group.allreduce([torch.ones(2)], dist.ReduceOp.SUM)
    assert group.fault is None


def test_a_group_that_is_not_cupycolls_has_no_cupycoll_fault():
    gloo = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=5))
    plain = torch.distributed.ProcessGroup(dist.HashStore(), 0, 1)
    plain._register_backend(torch.device("cpu"), torch.distributed.ProcessGroup.BackendType.GLOO, gloo)
    with pytest.raises(CupycollValueError, match="is not a cupycoll group"):
        cupycoll.group_fault(plain)


@pytest.mark.skipif(not compat.PY_BACKEND, reason=f"torch {torch.__version__} has no Backend shape (2.14 added it)")
@pytest.mark.parametrize("backend", ["cupycoll", "cpu:cupycoll"])
def test_the_default_groups_fault_in_the_backend_shape(monkeypatch, backend):
    monkeypatch.setenv("CUPYCOLL_SHAPE", "backend")
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        assert type(group) is torch.distributed.ProcessGroup
        assert cupycoll.group_fault() is None
        group.abort()
        assert isinstance(cupycoll.group_fault(group), CommunicatorAbortedError)
    finally:
        dist.destroy_process_group()
