"""cupycoll's c10d Backend shape (torch 2.14+, cupycoll.py_backend), through torch's own
dispatch: torch builds the ProcessGroup, and each call below goes from ``torch.distributed``
through torch's C++ ProcessGroup and its PyBackend trampoline into cupycoll's Backend.

A stand-in core shows what arrived and how it was grouped: CPU tensors take the CUDA route
(after the real type and mixing checks), and the call queue's batches (each one NCCL group)
are recorded instead of issued. The multi-process CPU tests run the real registration on
this shape too (CPU calls through :class:`~cupycoll.py_backend.CpuView`); the GPU tier runs
the CUDA route for real where the GPU machine's torch has the trampoline.
"""

from __future__ import annotations

import datetime
import functools

import pytest
import torch
import torch.distributed as dist

from cupycoll import compat
from cupycoll.errors import CupycollTypeError, CupycollValueError
from standins import CpuAsCudaBackend, QueueIssuer, backend_shape

pytestmark = pytest.mark.skipif(
    not compat.PY_BACKEND, reason=f"torch {torch.__version__} has no PyBackend trampoline (2.14 added it)")

if compat.PY_BACKEND:
    from cupycoll import py_backend

    class StandInBackend(backend_shape(CpuAsCudaBackend, QueueIssuer)):
        """The real Backend shell over a queue-recording core (tests/standins.py)."""

        def _start_coalescing(self, device=None):
            self._open_block()

        def _end_coalescing(self, device=None):
            return self._issuer.close_block()

NAME = "cupycoll_standin"
CPU = torch.device("cpu")
CUDA = torch.device("cuda")


@pytest.fixture
def group(cuda_standins):
    """A default group of two ranks on the stand-in; only rank 0 exists (nothing reaches a
    peer: the queue records its batches)."""
    if NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(NAME, functools.partial(py_backend.create, cls=StandInBackend),
                                      extended_api=True, devices=["cuda"])
    dist.init_process_group(f"cuda:{NAME}", store=dist.HashStore(), rank=0, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def backend_of(group):
    return group._get_backend(CUDA)


def batches(group):
    return backend_of(group)._issuer.batches


def test_torch_builds_the_process_group_and_dispatches_to_cupycolls_backend(group):
    assert type(group) is dist.ProcessGroup  # torch's own, not a cupycoll subclass
    backend = backend_of(group)
    assert isinstance(backend, StandInBackend) and backend.getBackendName() == "cupycoll"
    view = group._get_backend(CPU)  # no CPU backend was named: the group's own CPU face
    assert isinstance(view, py_backend.CpuView) and view._owner is backend
    dist.all_reduce(torch.ones(4))
    dist.all_gather_into_tensor(torch.ones(8), torch.ones(4))
    dist.reduce_scatter_tensor(torch.ones(2), torch.ones(4))
    dist.broadcast(torch.ones(3), src=0)
    assert batches(group) == [["all_reduce"], ["all_gather_into_tensor"], ["reduce_scatter_tensor"],
                              ["broadcast"]]


def test_an_async_works_wait_reaches_cupycolls_work(group):
    work = dist.all_reduce(torch.ones(4), async_op=True)
    assert type(work) is dist.Work  # torch's holder around cupycoll's Work, which it waits on
    assert work.wait()
    assert batches(group) == [["all_reduce"]]


def test_the_coalescing_manager_makes_one_nccl_group(group):
    with dist._coalescing_manager(device=CPU):
        dist.all_reduce(torch.ones(4))
        dist.all_reduce(torch.ones(2))
    assert batches(group) == [["all_reduce", "all_reduce"]]


def test_batch_isend_irecv_is_issued_as_one_nccl_group(group):
    ops = [dist.P2POp(dist.isend, torch.ones(3), 1), dist.P2POp(dist.irecv, torch.ones(3), 1)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    assert batches(group) == [["send", "recv"]]


def test_new_group_gets_a_backend_of_its_own(group):
    sub = dist.new_group([0, 1])
    backend = backend_of(sub)
    assert isinstance(backend, StandInBackend) and backend is not backend_of(group)
    dist.all_reduce(torch.ones(2), group=sub)
    assert backend._issuer.batches == [["all_reduce"]] and batches(group) == []


def test_bad_input_raises_cupycolls_typed_error_at_the_call_and_the_group_stays_usable(group):
    with pytest.raises(CupycollTypeError, match="torch.int16 cannot be reduced by NCCL"):
        dist.all_reduce(torch.ones(2, dtype=torch.int16))
    with pytest.raises(CupycollValueError, match="not contiguous"):
        dist.all_reduce(torch.ones(4, 4).t())
    assert batches(group) == []
    dist.all_reduce(torch.ones(2))
    assert batches(group) == [["all_reduce"]]


def test_abort_reaches_the_backend_and_get_error_reports_it(group):
    backend = backend_of(group)
    assert backend.get_error() == torch._C._distributed_c10d.ErrorType.SUCCESS
    group.abort()
    assert backend._cuda.state == "aborted"
    assert backend.get_error() == torch._C._distributed_c10d.ErrorType.COMM_ERROR
    with pytest.raises(Exception, match="abort"):
        dist.all_reduce(torch.ones(2))


def test_ddps_calls_reach_cupycolls_backend_through_torchs_process_group(monkeypatch):
    """DDP on the real Backend shape (CPU tensors): its parameter broadcast and its gradient
    all_reduce travel through torch's C++ ProcessGroup into cupycoll's Backend, whose flight
    recorder holds them (torch's own gloo would not)."""
    monkeypatch.setenv("CUPYCOLL_SHAPE", "backend")
    dist.init_process_group("cupycoll", store=dist.HashStore(), rank=0, world_size=1)
    try:
        backend = dist.group.WORLD._get_backend(torch.device("cuda"))
        assert isinstance(backend, py_backend.CupycollBackend)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
        model(torch.ones(3, 4)).sum().backward()
        ops = [entry["op"] for entry in backend._trace.recorder.snapshot()]
        assert "broadcast" in ops and ops[-1] == "all_reduce", ops
        assert torch.equal(model.module.weight.grad, torch.full((2, 4), 3.0))  # one rank: the sum is its own
    finally:
        dist.destroy_process_group()
