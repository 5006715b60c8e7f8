"""The cupycoll exception family.

Every error cupycoll raises on purpose derives from :class:`CupycollError`. Input
validation errors also derive from the builtin ``ValueError`` / ``TypeError`` so that
callers catching those keep working. NCCL failures carry the NCCL status, the C function
that returned it and NCCL's own last-error text.

Failures of the backend itself (NCCL errors, timeouts, an aborted communicator) also derive
from ``torch.distributed.DistBackendError``, which is what torch's own nccl backend raises,
so ``except dist.DistBackendError`` catches both backends' failures alike; timeouts keep the
builtin ``TimeoutError`` as well. A CPU (gloo) collective's ``wait()`` (a synchronous
all_reduce: the call itself) raises :class:`CollectiveTimeoutError` or
:class:`PeerFailedError` too (see ``trace.group``).

Deliberately left out: any retry or recovery policy. Errors describe; callers decide.
"""

from __future__ import annotations

# torch.distributed.DistBackendError is what ProcessGroupNCCL raises for NCCL errors,
# timeouts and aborted communicators; every supported torch has it (since 2.1), so this is
# no version switch. The fallback keeps this module, and the torch-free ctypes bindings that
# import it, importable where torch (or its distributed package) is absent.
try:
    from torch.distributed import DistBackendError
except ImportError:  # pragma: no cover - torch without distributed support
    DistBackendError = RuntimeError


class CupycollError(Exception):
    """Base class of every error raised by cupycoll."""


class CupycollValueError(CupycollError, ValueError):
    """An argument has the right type but a bad value (size, rank, device, op...)."""


class CupycollTypeError(CupycollError, TypeError):
    """An argument has the wrong type (dtype unsupported by NCCL, not a tensor...)."""


class MissingDependencyError(CupycollError, ImportError):
    """CuPy or NCCL is not installed or cannot be loaded, or the framework of an optional
    integration (``cupycoll.torchft``: torchft) is not installed.

    The message names the pip extra or package that installs what is missing.
    """


class NoCudaDeviceError(CupycollError, RuntimeError):
    """A CUDA collective was requested on a machine where no CUDA device is visible."""


class NcclError(CupycollError, DistBackendError):
    """An NCCL call returned a status other than ncclSuccess.

    Attributes:
        status: the raw ``ncclResult_t`` value.
        status_name: its C name (``ncclUnhandledCudaError``...).
        function: the NCCL function (or CuPy method) that failed.
        last_error: ``ncclGetLastError`` text when the library provides it, else "".
    """

    def __init__(self, status: int, function: str, message: str = "", last_error: str = ""):
        self.status = int(status)
        self.status_name = nccl_status_name(self.status)
        self.function = function
        self.last_error = last_error
        text = f"{function} failed: {self.status_name} ({self.status})"
        if message:
            text += f": {message}"
        if last_error and last_error not in text:
            text += f" [NCCL: {last_error}]"
        super().__init__(text)

    def __reduce__(self):
        return (type(self), (self.status, self.function, "", self.last_error))


class CommunicatorAbortedError(CupycollError, DistBackendError):
    """The communicator (or the whole group) was aborted or shut down; it cannot be used."""

    #: True when the abort ended an NCCL call under way, rather than refusing a new one.
    during_call = False


class CollectiveTimeoutError(CupycollError, DistBackendError, TimeoutError):
    """Peers or the GPU did not finish within the timeout: a collective (the watchdog or
    ``Work.wait(timeout)``), communicator creation, or a nonblocking NCCL call."""


class PeerFailedError(CupycollError, DistBackendError):
    """A collective failed on a peer's account before its timeout: the peer died or closed
    its connection (what gloo reports on the CPU route)."""


# ncclResult_t values, from nccl.h. Kept here (not in the bindings module) so that error
# formatting never needs the library to be loadable.
NCCL_STATUS_NAMES = {
    0: "ncclSuccess",
    1: "ncclUnhandledCudaError",
    2: "ncclSystemError",
    3: "ncclInternalError",
    4: "ncclInvalidArgument",
    5: "ncclInvalidUsage",
    6: "ncclRemoteError",
    7: "ncclInProgress",
    8: "ncclTimeout",
}


def nccl_status_name(status: int) -> str:
    return NCCL_STATUS_NAMES.get(int(status), f"ncclResult({int(status)})")
