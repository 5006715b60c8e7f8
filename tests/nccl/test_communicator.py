"""One NCCL communicator (cupycoll.nccl.communicator) on CPU with a scripted NCCL library:
every communicator, and every child of one (split, shrink), is made through the bindings in
its mode; every verb goes through the call guard, so a call on an aborted communicator says
it was aborted instead of passing NCCL a freed handle; a nonblocking communicator's calls are
polled until they settle, fail or time out, also at the end of an NCCL group; an error inside
an NCCL group aborts the communicator; an abort never holds the lock the watchdog's query
needs. How a communicator's fault reaches its group is tests/faults/test_faults.py's; the
guard itself is tests/nccl/test_call_guard.py's."""

from __future__ import annotations

import contextlib
import threading
import time
import types

import pytest
import torch
from torch._C import _distributed_c10d as c10d

from cupycoll.nccl import bindings as nb
from cupycoll.nccl import header as nh
from cupycoll.nccl import communicator as communicator_module
from cupycoll.nccl.communicator import Communicator
from cupycoll.errors import CollectiveTimeoutError, CommunicatorAbortedError, CupycollValueError, NcclError
from faulty import ScriptedLibrary, eventually, grouping_comm, make_group, polling_comm


def test_create_premul_sum_on_an_aborted_communicator_says_aborted(no_device):
    class PremulLibrary(ScriptedLibrary):
        def has(self, name):
            return True

        def ncclRedOpCreatePreMulSum(self, op, scalar, dtype, residence, comm):
            raise NcclError(4, "ncclRedOpCreatePreMulSum", "invalid argument")  # a NULL comm

    comm = polling_comm([nh.ncclSuccess])
    comm._lib = PremulLibrary([nh.ncclSuccess])
    comm.abort()
    with pytest.raises(CommunicatorAbortedError, match="was aborted"):
        comm.create_premul_sum(b"\0\0\0\0", 7, on_device=False)


# -- one kind of communicator, made and ended through the bindings in both modes ----------


@pytest.mark.parametrize("nonblocking", [False, True])
def test_every_communicator_is_made_through_the_bindings_in_its_mode(made, nonblocking):
    comm = made(nonblocking)
    assert comm._lib.calls == [("ncclCommInitRankConfig", 3, 0)]
    assert comm._lib.configs == [int(not nonblocking)]  # ncclConfig_t.blocking
    assert comm.nonblocking is nonblocking and comm.comm_ptr == 0x5000 and comm.state == "ok"


def test_a_blocking_communicators_failing_abort_is_seen(made):
    comm = made(abort_status=2)
    with pytest.raises(NcclError, match="ncclCommAbort failed"):
        comm.abort()
    assert comm.state == "aborted" and comm.comm_ptr == 0


@pytest.mark.parametrize("nonblocking", [False, True])
@pytest.mark.parametrize("abort_first", [False, True])
def test_shrink_makes_a_child_of_the_same_kind_without_the_excluded_ranks(made, nonblocking, abort_first):
    parent = made(nonblocking, child_size=2, child_rank=1)
    child = parent.shrink([1], abort_first)
    flag = nh.NCCL_SHRINK_ABORT if abort_first else nh.NCCL_SHRINK_DEFAULT
    assert parent._lib.calls[1] == ("ncclCommShrink", 0x5000, [1], flag)
    assert parent._lib.configs[1] == int(not nonblocking)
    assert (child.rank, child.size, child.nonblocking, child.state) == (1, 2, nonblocking, "ok")
    assert parent.state == "ok"  # the parent stays, for its owner to end


def test_shrink_on_an_nccl_without_it_names_the_version(made):
    parent = made(shrink=False)
    with pytest.raises(CupycollValueError, match=r"NCCL >= 2\.27 \(ncclCommShrink\); this process loaded NCCL 2\.26\.9"):
        parent.shrink([2], False)
    assert parent._lib.calls == [("ncclCommInitRankConfig", 3, 0)] and parent.state == "ok"


def test_a_blocking_communicator_splits_through_the_bindings(made):
    parent = made(False, child_size=2, child_rank=0)
    child = parent.split(7, 0)
    assert parent._lib.calls[1] == ("ncclCommSplit", 0x5000, 7, 0)
    assert parent._lib.configs[1] == 1 and (child.rank, child.size) == (0, 2)


def test_shrink_of_an_aborted_communicator_says_aborted(made):
    parent = made()
    parent.abort()
    with pytest.raises(CommunicatorAbortedError, match="ncclCommShrink: .* was aborted"):
        parent.shrink([1], True)

# -- nonblocking polling (the communicator's loop), NCCL groups, aborts --------------------


def test_in_progress_is_polled_until_success():
    comm = polling_comm([nh.ncclInProgress] * 5 + [nh.ncclSuccess])
    comm._poll("ncclAllReduce")
    assert comm._lib.states == [nh.ncclSuccess] and comm.state == "ok"


def test_an_error_while_polling_raises_with_the_function_and_aborts(no_device):
    comm = polling_comm([nh.ncclInProgress, 6])
    with pytest.raises(NcclError, match="ncclAllReduce failed: ncclRemoteError") as info:
        comm._poll("ncclAllReduce")
    assert info.value.last_error == "socket closed" and comm._lib.aborts == 1 and comm.state == "aborted"


def test_polling_past_the_timeout_aborts(no_device):
    comm = polling_comm([nh.ncclInProgress], timeout=0.1)
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match="ncclCommInitRankConfig .* within 0.1 s"):
        comm._poll("ncclCommInitRankConfig")
    assert time.monotonic() - start < 2 and comm._lib.aborts == 1 and comm.state == "aborted"


def test_abort_from_another_thread_ends_polling(no_device):
    comm = polling_comm([nh.ncclInProgress], timeout=60)
    errors = []
    thread = threading.Thread(target=lambda: errors.append(pytest.raises(
        CommunicatorAbortedError, comm._poll, "ncclCommInitRankConfig")))
    thread.start()
    time.sleep(0.1)
    start = time.monotonic()
    assert comm.abort() == 0
    thread.join(5)
    assert not thread.is_alive() and time.monotonic() - start < 2 and errors
    assert comm.abort() is None  # idempotent: nothing left to abort


def test_calls_inside_a_group_are_polled_when_the_outermost_group_ends(monkeypatch):
    events = []

    class GroupLibrary:
        def ncclGroupStart(self):
            events.append("start")
            return 0

        def ncclGroupEnd(self):
            events.append("end")
            return nh.ncclInProgress

    first, second = polling_comm([nh.ncclSuccess]), polling_comm([nh.ncclSuccess])
    for comm in (first, second):
        comm._lib = GroupLibrary()
        comm._poll = lambda function, timeout=None, comm=comm: events.append(("poll", comm, function))
    with first.group():
        first._settle("ncclSend", nh.ncclSuccess)
        with second.group():
            second._settle("ncclRecv", nh.ncclSuccess)
            first._settle("ncclRecv", nh.ncclSuccess)
        assert events == ["start", "start", "end"]  # the inner end settles nothing
    assert events == ["start", "start", "end", "end",
                      ("poll", first, "ncclGroupEnd"), ("poll", second, "ncclGroupEnd")]
    # outside a group, a call that returned ncclInProgress is polled at once
    first._settle("ncclAllReduce", nh.ncclInProgress)
    assert events[-1] == ("poll", first, "ncclAllReduce")


def test_an_nccl_group_never_looks_the_library_up_again(monkeypatch):
    # A group is ncclGroupStart/End of the library the communicator already holds: finding
    # the library again (mapped libraries, the pip package, dlopen) costs ~200 us per group.
    pytest.importorskip("cupy.cuda.nccl")

    class Stream:
        ptr = 0

        def __init__(self, non_blocking=False):
            pass

    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(Device=lambda index: contextlib.nullcontext(),
                                                            Stream=Stream))
    monkeypatch.setattr(communicator_module._cuda, "cupy_module", lambda: cupy)
    comm = Communicator(0, 0, 1, handle=0, timeout=60.0)  # no NCCL comm is touched
    lookups = []

    def find_library(path=None):
        lookups.append(path)
        raise AssertionError("the NCCL library was looked up again")

    monkeypatch.setattr(nb, "find_library", find_library)
    for _ in range(3):
        with comm.group():  # ncclGroupStart/End need no GPU
            with comm.group():
                pass
    assert lookups == []
    assert nb.load(None) is comm._lib  # a path asked for before is not resolved again


def test_a_python_error_inside_an_nccl_group_aborts_its_communicators(no_device):
    # ncclGroupEnd launches the calls enqueued before the error, a batch the peers' full
    # one no longer matches: the communicator must be aborted and its owner told.
    told = []
    comm, events = grouping_comm()
    comm.on_abort = told.append
    staging = torch.ones(4)
    with pytest.raises(MemoryError):
        with comm.group():
            comm._settle("ncclSend", nh.ncclSuccess)
            with comm.group():
                raise MemoryError("staging")
    assert events == ["start", "start", "end", "end", "abort"]
    assert comm.state == "aborted" and isinstance(told[0], MemoryError) and staging.sum() == 4
    # a healthy group afterwards polls, aborts nothing
    other, other_events = grouping_comm()
    with other.group():
        other._settle("ncclSend", nh.ncclSuccess)
    assert other.state == "ok" and other_events == ["start", "end"]


def test_calls_after_an_abort_name_the_abort(no_device):
    # The handle is gone after an abort, and NCCL would answer ncclInvalidArgument: the
    # call is refused first, naming the abort, in either mode.
    class Library(ScriptedLibrary):
        def ncclAllReduce(self, *args):
            raise AssertionError("reached NCCL")
    comm = polling_comm([nh.ncclSuccess])
    comm._lib, comm.nonblocking = Library([nh.ncclSuccess]), False
    comm.abort()
    assert comm.state == "aborted" and comm._lib.aborts == 1
    with pytest.raises(CommunicatorAbortedError, match="was aborted"):
        comm.all_reduce(1, 1, 1, 7, 0, 0)
    group = make_group()
    group.abort()
    opts = c10d.BarrierOptions()
    opts.device_ids = [0]
    with pytest.raises(CommunicatorAbortedError, match="was aborted"):
        group.barrier(opts)


def test_a_hung_abort_does_not_stall_async_error(no_device):
    # ncclCommAbort runs outside the communicator's lock: under it, a hung abort would
    # block the watchdog in async_error() on that lock, blinding every group it watches.
    release = threading.Event()

    class HangingAbort(ScriptedLibrary):
        def ncclCommAbort(self, comm):
            self.aborts += 1
            release.wait(10)
            return 0

    comm = polling_comm([nh.ncclSuccess])
    comm._lib = HangingAbort([nh.ncclSuccess])
    aborter = threading.Thread(target=comm.abort, daemon=True)
    aborter.start()
    try:
        assert eventually(lambda: comm._lib.aborts == 1)
        answers = []
        query = threading.Thread(target=lambda: answers.append(comm.async_error()), daemon=True)
        start = time.monotonic()
        query.start()
        query.join(2)
        assert not query.is_alive() and answers == [None] and time.monotonic() - start < 2
        assert comm.abort() is None and comm.state == "aborted"  # a second abort returns at once
    finally:
        release.set()
        aborter.join(5)
