"""The CUDA path review (2026-11-23), findings 8-10, on CPU: the PREMUL_SUM op after an
abort, the PREMUL_SUM factor tensor's lifetime, and the error type of a Work that was never
issued. (Findings 1-3, the watchdog's, are in test_watchdog.py.) Stand-ins replace the NCCL
communicator and the backend's issue step; the GPU tier runs the same paths for real."""

from __future__ import annotations

import dataclasses
import datetime

import pytest
import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from cupycoll import _args, collectives
from cupycoll.errors import CommunicatorAbortedError, CupycollError, NcclError
from cupycoll.work import CudaWork
from standins import CUDA
from test_collectives import LogicGroup, RecordingBackend, RecordingRing, ar_opts

# -- finding 8: destroying the PREMUL_SUM op after an abort hid the abort's error ----------


class PremulComm:
    """A communicator whose all_reduce meets ``error``; ``abort`` says whether an abort
    happened first (then its comm_ptr is 0 and ncclRedOpDestroy fails)."""

    def __init__(self, error, abort):
        self.state, self.error, self.abort, self.destroyed = "ok", error, abort, []

    def create_premul_sum(self, scalar, dtype, on_device):
        return 7

    def all_reduce(self, *args):
        if self.abort:
            self.state = "aborted"
        raise self.error

    def destroy_op(self, op):
        if self.state != "ok":
            raise NcclError(4, "ncclRedOpDestroy", "invalid argument (NULL communicator)")
        self.destroyed.append(op)


def _premul_launch():
    red = _args.reduction_plan(torch.ones(4), dist._make_nccl_premul_sum(0.5), "nccl", 2)
    return collectives._reduce_launch(red, torch.float32,
                                      lambda comm, op, s: comm.all_reduce(1, 1, 4, red.dtype, op, s))


def test_premul_sum_on_an_aborted_communicator_raises_the_abort():
    launch, prepare = _premul_launch()
    comm = PremulComm(CommunicatorAbortedError("the NCCL communicator on cuda:0 was aborted"), abort=True)
    prepare(comm)
    with pytest.raises(CommunicatorAbortedError, match="was aborted"):
        launch(comm, 0)
    assert comm.destroyed == []  # it went with the communicator


def test_premul_sum_failing_on_a_healthy_communicator_still_destroys_its_op():
    launch, prepare = _premul_launch()
    comm = PremulComm(NcclError(5, "ncclAllReduce", "invalid usage"), abort=False)
    prepare(comm)
    with pytest.raises(NcclError, match="ncclAllReduce"):
        launch(comm, 0)
    assert comm.destroyed == [7]


# -- finding 9: the PREMUL_SUM factor tensor is kept alive with the call -----------------


class KeepaliveBackend(RecordingBackend):
    def submit(self, op_name, device, outputs, launch, finish=None, keepalive=(), **kwargs):
        self.keepalives.append(keepalive)
        return super().submit(op_name, device, outputs, launch, finish, keepalive, **kwargs)


class KeepaliveGroup(LogicGroup):
    backend_class = KeepaliveBackend


def _tensors(kept):
    if isinstance(kept, torch.Tensor):
        return [kept]
    if isinstance(kept, (list, tuple)):
        return [t for item in kept for t in _tensors(item)]
    return []


@pytest.fixture(params=["nccl", "ring"])
def keep_group(request):
    group = KeepaliveGroup(None, 0, 2, datetime.timedelta(seconds=5))
    group.submitted = group._cuda.submitted = []
    group._cuda.prepared, group._cuda.keepalives, group.ring_calls = [], [], []
    group._cuda.ring = lambda comm: RecordingRing(group.ring_calls, [], group._cuda)
    group._cuda.settings = dataclasses.replace(group._cuda.settings, algorithm=request.param)
    return group


def _premul(factor, options):
    options.reduceOp = dist._make_nccl_premul_sum(factor)
    return options


CALLS = {
    "all_reduce": lambda g, f: g.allreduce([torch.ones(4)], _premul(f, dist.AllreduceOptions())),
    "reduce": lambda g, f: g.reduce([torch.ones(4)], _premul(f, dist.ReduceOptions())),
    "reduce_scatter": lambda g, f: g.reduce_scatter([torch.ones(2)], [[torch.ones(2), torch.ones(2)]],
                                                    _premul(f, dist.ReduceScatterOptions())),
    "reduce_scatter_tensor": lambda g, f: g._reduce_scatter_base(torch.ones(2), torch.ones(4),
                                                                 _premul(f, c10d.ReduceScatterOptions())),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_the_premul_sum_factor_tensor_is_in_the_calls_keepalive(keep_group, call):
    if call == "reduce" and keep_group._cuda.settings.algorithm == "ring":
        pytest.skip("the ring has no reduce: it runs on NCCL")
    factor = torch.tensor([0.5])
    CALLS[call](keep_group, factor)
    kept = _tensors(keep_group._cuda.keepalives[-1])
    assert any(t.data_ptr() == factor.data_ptr() for t in kept)  # not just the data


def test_a_number_premul_factor_keeps_nothing_extra():
    plan = _args.reduction_plan(torch.ones(2), ar_opts(dist._make_nccl_premul_sum(0.5)).reduceOp, "ring", 2)
    assert _args.factor_tensor(plan) is None and plan.premul == 0.5


# -- finding 10: a Work that was never issued keeps its error's type ----------------------


def _never_issued(error):
    work = CudaWork("send", CUDA, [torch.ones(2)], flush=lambda: None)
    work._failed(error)
    return work


def test_a_never_issued_work_keeps_the_nccl_error_with_its_status():
    cause = NcclError(1, "ncclGroupEnd", "unhandled cuda error", "cudaErrorLaunchFailure")
    work = _never_issued(cause)
    error = work.exception()
    assert isinstance(error, NcclError) and isinstance(error, dist.DistBackendError)
    assert (error.status, error.status_name, error.function) == (1, "ncclUnhandledCudaError", "ncclGroupEnd")
    assert error.last_error == "cudaErrorLaunchFailure" and error.__cause__ is cause
    assert str(error).startswith("send was never issued: ncclGroupEnd failed")
    with pytest.raises(dist.DistBackendError, match="send was never issued"):
        work.wait()
    assert work._keepalive is None and work.is_completed() and not work.is_success()


def test_each_never_issued_work_gets_its_own_error_of_the_same_class():
    cause = CommunicatorAbortedError("the NCCL communicator on cuda:0 was aborted")
    first, second = _never_issued(cause).exception(), _never_issued(cause).exception()
    assert type(first) is type(second) is CommunicatorAbortedError and first is not second
    assert "send was never issued: the NCCL communicator" in str(first) and str(cause).startswith("the NCCL")


def test_a_never_issued_works_foreign_error_is_wrapped_in_a_cupycoll_error():
    cause = torch.OutOfMemoryError("staging")
    error = _never_issued(cause).exception()
    assert type(error) is CupycollError and "send was never issued: staging" in str(error)
    assert error.__cause__ is cause
