"""A CUDA call's Work (cupycoll.work) that was never issued: its error keeps the class
(and an NCCL error its status) of what stopped the batch, each Work gets an error of its
own, and a foreign error becomes a CupycollError. The Work's states under the watchdog are
tests/faults/test_faults.py's and tests/faults/test_watchdog.py's; the CPU route's Works,
tests/test_work_surface.py's."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cupycoll.errors import CommunicatorAbortedError, CupycollError, NcclError
from cupycoll.faults.watchdog import Watch
from cupycoll.work import CudaWork
from standins import CUDA


def _never_issued(error):
    work = CudaWork("send", CUDA, [torch.ones(2)], Watch("g", 60), flush=lambda: None)
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
    assert work.is_completed() and not work.is_success()


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


def test_a_failed_future_leaves_its_error_as_it_was_and_holds_no_caller_alive():
    # The group holds the error its Works failed with; if making the failed future left a
    # traceback on it, that traceback would hold the Work's frames and the group with them
    # (and the group's gloo threads) until a full garbage collection.
    import gc
    import weakref

    from cupycoll.errors import CollectiveTimeoutError
    from cupycoll.work import failed_future

    class Owner:
        pass

    def made_by(owner, error):
        return failed_future(error)

    error = CollectiveTimeoutError("all_reduce #3 timed out")
    owner = Owner()
    gone = weakref.ref(owner)
    gc.disable()
    try:
        future = made_by(owner, error)
        del owner
        assert error.__traceback__ is None
        assert gone() is None  # freed at once, not by a collection
    finally:
        gc.enable()
    with pytest.raises(RuntimeError, match="CollectiveTimeoutError: all_reduce #3 timed out"):
        future.wait()
