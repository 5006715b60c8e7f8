"""One NCCL communicator's verbs (cupycoll.nccl.communicator) on CPU with a scripted NCCL
library: every communicator, and every child of one (split, shrink), is made through the
bindings in its mode; every verb goes through the call guard, so a call on an aborted
communicator says it was aborted instead of passing NCCL a freed handle. Nonblocking polling, NCCL groups and
the communicator's faults are tests/test_faults.py's; the guard itself is
tests/test_call_guard.py's."""

from __future__ import annotations

import ctypes

import pytest

from cupycoll.nccl import bindings as nb
from cupycoll.nccl.communicator import Communicator
from cupycoll.errors import CommunicatorAbortedError, CupycollValueError, NcclError
from test_faults import ScriptedLibrary, no_device, polling_comm  # noqa: F401 - no_device: a fixture


def test_create_premul_sum_on_an_aborted_communicator_says_aborted(no_device):
    class PremulLibrary(ScriptedLibrary):
        def has(self, name):
            return True

        def ncclRedOpCreatePreMulSum(self, op, scalar, dtype, residence, comm):
            raise NcclError(4, "ncclRedOpCreatePreMulSum", "invalid argument")  # a NULL comm

    comm = polling_comm([nb.ncclSuccess])
    comm._lib = PremulLibrary([nb.ncclSuccess])
    comm.abort()
    with pytest.raises(CommunicatorAbortedError, match="was aborted"):
        comm.create_premul_sum(b"\0\0\0\0", 7, on_device=False)


# -- one kind of communicator, made and ended through the bindings in both modes ----------


class RecordingLibrary(ScriptedLibrary):
    """An NCCL whose communicator calls are recorded: creation and children hand out new
    handles; ncclCommCount/UserRank answer ``child_size``/``child_rank``."""

    def __init__(self, shrink=True, abort_status=0, child_size=2, child_rank=1):
        super().__init__([nb.ncclSuccess])
        self.calls = []
        self.configs = []
        self.abort_status = abort_status
        self.child_size, self.child_rank = child_size, child_rank
        if not shrink:
            self.ncclCommShrink = None

    def _new_comm(self, ref):  # handles 0x5000, 0x5001, ... in the order made
        self.made = getattr(self, "made", 0x4fff) + 1
        ctypes.cast(ref, ctypes.POINTER(ctypes.c_void_p)).contents.value = self.made

    def _config(self, ref):
        self.configs.append(ctypes.cast(ref, ctypes.POINTER(nb.ncclConfig_t)).contents.blocking)

    unique_id_from_bytes = staticmethod(nb.NcclLibrary.unique_id_from_bytes)

    def has(self, name):
        return getattr(self, name, None) is not None

    def version(self):
        return 22609

    def ncclCommInitRankConfig(self, comm_ref, size, unique_id, rank, config_ref):
        self.calls.append(("ncclCommInitRankConfig", size, rank))
        self._new_comm(comm_ref)
        self._config(config_ref)
        return 0

    def ncclCommShrink(self, comm, excluded, count, new_ref, config_ref, flags):
        self.calls.append(("ncclCommShrink", comm, [excluded[i] for i in range(count)], flags))
        self._new_comm(new_ref)
        self._config(config_ref)
        return 0

    def ncclCommSplit(self, comm, color, key, new_ref, config_ref):
        self.calls.append(("ncclCommSplit", comm, color, key))
        self._new_comm(new_ref)
        self._config(config_ref)
        return 0

    def ncclCommCount(self, comm, ref):
        ctypes.cast(ref, ctypes.POINTER(ctypes.c_int)).contents.value = self.child_size
        return 0

    def ncclCommUserRank(self, comm, ref):
        ctypes.cast(ref, ctypes.POINTER(ctypes.c_int)).contents.value = self.child_rank
        return 0

    def ncclCommAbort(self, comm):
        self.calls.append(("ncclCommAbort", comm))
        if self.abort_status:
            raise NcclError(self.abort_status, "ncclCommAbort", "unhandled system error")
        return 0

    def ncclCommFinalize(self, comm):
        self.calls.append(("ncclCommFinalize", comm))
        return 0

    def ncclCommDestroy(self, comm):
        self.calls.append(("ncclCommDestroy", comm))
        return 0


@pytest.fixture
def made(monkeypatch, no_device):
    """Communicator.begin with a RecordingLibrary and no device: ``made(nonblocking, **lib)``."""
    from cupycoll.nccl import communicator as communicator_module

    class Stream:
        ptr = 0

        def __init__(self, non_blocking=False):
            pass

        def synchronize(self):
            pass

    communicator_module._cuda.cupy_module().cuda.Stream = Stream
    monkeypatch.setattr(Communicator, "preflight", staticmethod(lambda *args: None))

    def make(nonblocking=False, **kwargs):
        library = RecordingLibrary(**kwargs)
        monkeypatch.setattr(communicator_module, "_library", lambda path=None: library)
        comm = Communicator.begin(b"\1" * 128, 0, 3, 0, nonblocking=nonblocking, timeout=60.0)
        comm.wait_ready()  # a nonblocking one's creation settles (the library answers ncclSuccess)
        return comm
    return make


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
    flag = nb.NCCL_SHRINK_ABORT if abort_first else nb.NCCL_SHRINK_DEFAULT
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
