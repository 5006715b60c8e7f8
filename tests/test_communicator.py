"""One NCCL communicator's verbs (cupycoll.communicator) on CPU with a scripted NCCL
library: every verb goes through the call guard, so a call on an aborted communicator says
it was aborted instead of passing NCCL a freed handle. Nonblocking polling, NCCL groups and
the communicator's faults are tests/test_faults.py's; the guard itself is
tests/test_call_guard.py's."""

from __future__ import annotations

import pytest

from cupycoll import nccl_bindings as nb
from cupycoll.errors import CommunicatorAbortedError, NcclError
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
