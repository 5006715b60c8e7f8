"""One NCCL communicator on one CUDA device, spoken to in Python verbs.

A :class:`Communicator` owns one ``ncclComm_t``, the device it lives on and an internal
stream for asynchronous work. Its verbs take raw device pointers, element counts, NCCL
datatype/op codes and a stream handle (plain ints), so this layer knows nothing of torch;
the process-group adapter translates tensors into those.

Two modes, invisible to the caller:

* **blocking** (default): the communicator is CuPy's ``NcclCommunicator`` and the verbs
  call its methods;
* **nonblocking**: the communicator is created through the ctypes bindings with
  ``ncclCommInitRankConfig`` and ``blocking = 0``; every call may return ``ncclInProgress``
  and is then polled with ``ncclCommGetAsyncError`` until it settles, bounded by the
  communicator's timeout and ended at once by :meth:`Communicator.abort` from any thread.
  That includes creation itself: :meth:`Communicator.begin` returns before the peers have
  connected and :meth:`Communicator.wait_ready` polls.

NCCL groups: :meth:`Communicator.group` is ncclGroupStart/End of the library the
communicator already holds; the per-thread bookkeeping (which communicators a group used,
polled or aborted at its end) is :mod:`cupycoll.nccl_group`.

Left as it is: the status of ncclCommAbort/ncclCommDestroy on a blocking communicator.
CuPy declares both ``void`` (``NcclCommunicator.abort``/``destroy``), so a failure there is
invisible. Calling them through the ctypes bindings on ``comm_ptr`` would see it, but CuPy's
handle (``cdef ncclComm_t _comm``, not writable from Python) would stay set, and its
``__dealloc__`` would destroy the freed communicator again; only CuPy's own methods clear it.

Deliberately left out: validation of user input (done once, above, with names the user
knows), scheduling policy (which stream, when to group), the watchdog (it lives above and
only calls :meth:`async_error` and :meth:`abort`) and any teardown in ``__del__``:
``shutdown()`` and ``abort()`` are explicit.
"""

from __future__ import annotations

import ctypes
import os
import time
from typing import Callable, Optional

from . import _cuda, compat, nccl_bindings, nccl_group
from .call_guard import GuardedCalls
from .errors import CollectiveTimeoutError, CommunicatorAbortedError, CupycollValueError, NcclError

DEFAULT_TIMEOUT_S = 600.0



def _translate(exc: Exception, function: str) -> NcclError:
    status = getattr(exc, "status", 3)
    return NcclError(status, function, str(exc))


def _library(path: Optional[str] = None) -> nccl_bindings.NcclLibrary:
    # CuPy's NCCL first, so that the ctypes bindings find and share the library it mapped.
    _cuda.nccl_module()
    return nccl_bindings.load(path)


def new_unique_id() -> bytes:
    """A fresh ncclUniqueId as 128 bytes."""
    return compat.unique_id_to_bytes(_cuda.nccl_module().get_unique_id())


def _unique_id_for_cupy(unique_id: bytes):
    return compat.unique_id_for_cupy(_cuda.cupy_module(), unique_id)


# -- the communicator ----------------------------------------------------------------------


class Communicator(GuardedCalls):
    """An NCCL communicator bound to one device, with the verbs the backend needs."""

    on_abort: Optional[Callable[[BaseException], None]] = None

    def __init__(self, device: int, rank: int, size: int, nccl_library: Optional[str] = None, *,
                 cupy_comm=None, handle: Optional[int] = None, timeout: float = DEFAULT_TIMEOUT_S,
                 on_abort: Optional[Callable[[BaseException], None]] = None):
        cupy = _cuda.cupy_module()
        self._cupy_comm = cupy_comm  # blocking mode
        self._handle = handle  # nonblocking mode: the raw ncclComm_t
        self.nonblocking = cupy_comm is None
        self._nccl_library = nccl_library
        self._lib = _library(nccl_library)
        self.device = device
        self.rank = rank
        self.size = size
        self.timeout = float(timeout)
        # Told when it aborts itself (poll error/timeout, a Python error inside an NCCL group)
        # so its owner faults too; never for abort() called from outside.
        self.on_abort = on_abort
        # "initializing" | "ok" | "shut down" | "aborted"
        self.state = "initializing" if self.nonblocking else "ok"
        # Serialises the end of the communicator's life against the watchdog's queries, so
        # that ncclCommGetAsyncError never reads a freed communicator, and against the calls
        # under way (cupycoll.call_guard).
        self._init_guard()
        with cupy.cuda.Device(device):
            # Non-blocking w.r.t. the legacy default stream, like ProcessGroupNCCL's.
            self._stream = cupy.cuda.Stream(non_blocking=True)
        self.stream = self._stream.ptr
        self._nccl_error = _cuda.nccl_module().NcclError

    @property
    def comm_ptr(self) -> int:
        """The raw ``ncclComm_t`` (0 once destroyed or aborted)."""
        if self._cupy_comm is not None:
            return self._cupy_comm.comm
        return self._handle or 0

    def __repr__(self) -> str:
        mode = "nonblocking" if self.nonblocking else "blocking"
        return f"Communicator(rank={self.rank}, size={self.size}, cuda:{self.device}, {mode}, {self.state})"

    # -- creation --------------------------------------------------------------------
    @staticmethod
    def preflight(device: int, nccl_library=None, nonblocking: bool = False) -> None:
        """The checks of :meth:`begin` that depend on this process alone, for before the store
        gate: a rank failing after it leaves its peers in blocking ncclCommInitRank for good."""
        _cuda.require_device(device)
        library = _library(nccl_library)  # a library that cannot load fails here, in both modes
        if not nonblocking:
            if os.environ.get("NCCL_COMM_BLOCKING", "") == "0":
                raise CupycollValueError(
                    "NCCL_COMM_BLOCKING=0 makes NCCL calls return ncclInProgress, which CuPy's "
                    "blocking communicator cannot handle; unset it or use nonblocking=True"
                )
        elif not library.has("ncclCommInitRankConfig"):
            raise CupycollValueError("nonblocking communicators need NCCL >= 2.14 (ncclCommInitRankConfig)")

    @classmethod
    def begin(cls, unique_id: bytes, rank: int, size: int, device: int, nccl_library=None,
              nonblocking: bool = False, timeout: float = DEFAULT_TIMEOUT_S,
              on_abort: Optional[Callable[[BaseException], None]] = None) -> "Communicator":
        """Start joining the communicator named by ``unique_id`` as ``rank`` of ``size``.

        Blocking mode returns when every peer has joined. Nonblocking mode returns at once,
        in state ``"initializing"``: call :meth:`wait_ready` (which :meth:`abort` can end)."""
        cls.preflight(device, nccl_library, nonblocking)  # cheap; callers ran it before the gate
        cupy = _cuda.cupy_module()
        if not nonblocking:
            nccl = _cuda.nccl_module()
            with cupy.cuda.Device(device):
                try:
                    comm = nccl.NcclCommunicator(size, _unique_id_for_cupy(unique_id), rank)
                except nccl.NcclError as exc:
                    raise _translate(exc, "ncclCommInitRank") from exc
            return cls(device, rank, size, nccl_library, cupy_comm=comm, timeout=timeout, on_abort=on_abort)

        lib = _library(nccl_library)
        handle = nccl_bindings.ncclComm_t()
        config = nccl_bindings.make_config(blocking=False)
        with cupy.cuda.Device(device):
            lib.ncclCommInitRankConfig(ctypes.byref(handle), size, lib.unique_id_from_bytes(unique_id),
                                       rank, ctypes.byref(config))
        return cls(device, rank, size, nccl_library, handle=handle.value, timeout=timeout, on_abort=on_abort)

    def wait_ready(self, timeout: Optional[float] = None) -> None:
        """Poll a nonblocking communicator until its creation settles (no-op when blocking).
        On timeout the communicator is aborted and CollectiveTimeoutError raised."""
        if self.state == "initializing":
            self._poll("ncclCommInitRankConfig", timeout)
            self.state = "ok"

    def group(self):
        """An NCCL group (ncclGroupStart/End) on this communicator's library: NCCL calls in
        the body, on this or any other communicator, are launched together at the end."""
        return nccl_group.nccl_group(self._lib)

    @staticmethod
    def can_split() -> bool:
        return compat.cupy_has_comm_split(_cuda.nccl_module())

    def split(self, color: int, key: int,
              on_abort: Optional[Callable[[BaseException], None]] = None) -> Optional["Communicator"]:
        """ncclCommSplit: collective over this communicator. ``color < 0`` takes no part.
        ``on_abort``: the child's (a timed-out split aborts, and tells, this parent)."""
        cupy = _cuda.cupy_module()
        color = color if color >= 0 else nccl_bindings.NCCL_SPLIT_NOCOLOR
        with cupy.cuda.Device(self.device):
            if not self.nonblocking:
                try:
                    child = self._guarded("ncclCommSplit", lambda _: self._cupy_comm.commSplit(color, key))
                except self._nccl_error as exc:
                    raise _translate(exc, "ncclCommSplit") from exc
                if child is None:
                    return None
                return Communicator(self.device, child.rank_id(), child.size(), self._nccl_library,
                                    cupy_comm=child, timeout=self.timeout, on_abort=on_abort)
            handle = nccl_bindings.ncclComm_t()
            config = nccl_bindings.make_config(blocking=False)
            self._guarded("ncclCommSplit", lambda parent: self._lib.ncclCommSplit(
                parent, color, key, ctypes.byref(handle), ctypes.byref(config)))
            self._poll("ncclCommSplit")
        if not handle.value:
            return None
        child = Communicator(self.device, 0, 0, self._nccl_library, handle=handle.value, timeout=self.timeout,
                             on_abort=on_abort)
        child.wait_ready()
        count, rank = ctypes.c_int(), ctypes.c_int()
        self._lib.ncclCommCount(handle, ctypes.byref(count))
        self._lib.ncclCommUserRank(handle, ctypes.byref(rank))
        child.size, child.rank = count.value, rank.value
        return child

    # -- collectives (pointers, counts and codes are plain ints) --------------------
    def _call(self, c_name: str, cupy_name: str, *args) -> None:
        """Run one NCCL call: CuPy's method (blocking), or the C function with this
        communicator inserted before the stream, settled or left to the open group."""
        if self._cupy_comm is not None:
            self._guarded(c_name, lambda handle: self._cupy_call(c_name, cupy_name, args))
            return
        function = getattr(self._lib, c_name)
        status = self._guarded(c_name, lambda handle: function(*args[:-1], handle, args[-1]))
        # Outside the guard: a poll that fails or times out aborts this communicator from
        # this very thread, which must not wait for itself.
        self._settle(c_name, status)

    def _cupy_call(self, c_name: str, cupy_name: str, args) -> None:
        nccl_group.join(self)  # inside a group: aborted at its end if it raises
        try:
            getattr(self._cupy_comm, cupy_name)(*args)
        except self._nccl_error as exc:
            raise _translate(exc, c_name) from exc

    def all_reduce(self, sendbuf, recvbuf, count, dtype, op, stream):
        self._call("ncclAllReduce", "allReduce", sendbuf, recvbuf, count, dtype, op, stream)

    def broadcast(self, sendbuf, recvbuf, count, dtype, root, stream):
        self._call("ncclBroadcast", "broadcast", sendbuf, recvbuf, count, dtype, root, stream)

    def reduce(self, sendbuf, recvbuf, count, dtype, op, root, stream):
        self._call("ncclReduce", "reduce", sendbuf, recvbuf, count, dtype, op, root, stream)

    def all_gather(self, sendbuf, recvbuf, count, dtype, stream):
        self._call("ncclAllGather", "allGather", sendbuf, recvbuf, count, dtype, stream)

    def reduce_scatter(self, sendbuf, recvbuf, recvcount, dtype, op, stream):
        self._call("ncclReduceScatter", "reduceScatter", sendbuf, recvbuf, recvcount, dtype, op, stream)

    def send(self, buf, count, dtype, peer, stream):
        self._call("ncclSend", "send", buf, count, dtype, peer, stream)

    def recv(self, buf, count, dtype, peer, stream):
        self._call("ncclRecv", "recv", buf, count, dtype, peer, stream)

    # -- PREMUL_SUM ----------------------------------------------------------------
    def create_premul_sum(self, scalar, dtype: int, on_device: bool) -> int:
        """ncclRedOpCreatePreMulSum. ``scalar``: the factor's bytes in ``dtype`` (host), or a
        device pointer to one element of ``dtype`` when ``on_device``."""
        if not self._lib.has("ncclRedOpCreatePreMulSum"):
            raise CupycollValueError("PREMUL_SUM needs NCCL >= 2.11 (ncclRedOpCreatePreMulSum)")
        op = ctypes.c_int()
        if on_device:
            scalar_ptr = ctypes.c_void_p(scalar)
            residence = nccl_bindings.ncclScalarDevice
        else:
            host = ctypes.create_string_buffer(bytes(scalar), len(scalar))
            scalar_ptr = ctypes.cast(host, ctypes.c_void_p)
            residence = nccl_bindings.ncclScalarHostImmediate
        # Guarded: an aborted communicator has no comm_ptr (NCCL: ncclInvalidArgument).
        status = self._guarded("ncclRedOpCreatePreMulSum", lambda handle: self._lib.ncclRedOpCreatePreMulSum(
            ctypes.byref(op), scalar_ptr, dtype, residence, ctypes.c_void_p(self.comm_ptr)))
        if self.nonblocking:
            self._settle("ncclRedOpCreatePreMulSum", status)
        return op.value

    def destroy_op(self, op: int) -> None:
        # NCCL allows this as soon as the last call using ``op`` has returned. Guarded: an
        # abort in between frees the op with the communicator, and this must not touch it.
        try:
            self._guarded("ncclRedOpDestroy", lambda handle: self._lib.ncclRedOpDestroy(
                op, ctypes.c_void_p(self.comm_ptr)))
        except CommunicatorAbortedError:
            pass

    # -- nonblocking progress ---------------------------------------------------------
    def _settle(self, function: str, status: int) -> None:
        # Inside a group NCCL settles everything at ncclGroupEnd; poll then.
        if nccl_group.join(self):
            return
        if status == nccl_bindings.ncclInProgress:
            self._poll(function)

    def _poll(self, function: str, timeout: Optional[float] = None) -> None:
        """Wait until NCCL reports this communicator idle, an error, the timeout or an abort."""
        if not self.nonblocking:
            return
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        status = ctypes.c_int()
        spins = 0
        while True:
            with self._lock:
                if self.state in ("aborted", "shut down"):
                    raise CommunicatorAbortedError(
                        f"{function}: the NCCL communicator on cuda:{self.device} was {self.state}")
                self._lib.ncclCommGetAsyncError(self._handle, ctypes.byref(status))
            if status.value == nccl_bindings.ncclSuccess:
                return
            if status.value != nccl_bindings.ncclInProgress:
                error = NcclError(status.value, function, self._lib.error_string(status.value),
                                  self._lib.last_error())
                self._abort_for(error)
                raise error
            if time.monotonic() > deadline:
                error = CollectiveTimeoutError(
                    f"{function} on cuda:{self.device} did not complete within "
                    f"{self.timeout if timeout is None else timeout:g} s; the communicator was aborted")
                self._abort_for(error)
                raise error
            spins += 1
            # Spin briefly (most calls settle in microseconds), then stop burning the GIL.
            time.sleep(0 if spins < 64 else 0.0005)

    def async_error(self) -> Optional[NcclError]:
        """ncclCommGetAsyncError as an exception (None while healthy or still working).
        Safe from any thread; the watchdog calls it."""
        status = ctypes.c_int()
        with self._lock:
            if self.state != "ok":
                return None
            ptr = self.comm_ptr
            if not ptr:
                return None
            try:
                self._lib.ncclCommGetAsyncError(ctypes.c_void_p(ptr), ctypes.byref(status))
            except NcclError as exc:
                return exc
        if status.value in (nccl_bindings.ncclSuccess, nccl_bindings.ncclInProgress):
            return None
        return NcclError(status.value, "ncclCommGetAsyncError", self._lib.error_string(status.value),
                         self._lib.last_error())

    # -- lifetime -------------------------------------------------------------------
    def _abort_for(self, error: BaseException) -> None:
        """Abort because of ``error`` found here. The owner is told first: its group fails
        its Works and then aborts its communicators, this one among them, so no Work whose
        kernel the abort ends can read as a success in between. Aborted here as well
        whatever the owner did (idempotent)."""
        try:
            if self.on_abort is not None:
                self.on_abort(error)
        finally:
            self.abort()

    def _check_usable(self):
        if self.state not in ("ok", "initializing"):
            raise CommunicatorAbortedError(f"the NCCL communicator on cuda:{self.device} was {self.state}")

    def shutdown(self, timeout: Optional[float] = None) -> None:
        """ncclCommFinalize then ncclCommDestroy: the communicator's queued work completes
        first (peers must be alive). A nonblocking finalize that fails or outlives
        ``timeout`` aborts the communicator instead, and the error is raised."""
        if self.state not in ("ok", "initializing"):
            return
        cupy = _cuda.cupy_module()
        with cupy.cuda.Device(self.device):
            if self.nonblocking:
                if self.state == "initializing":
                    self.abort()
                    return
                self._lib.ncclCommFinalize(self._handle)
                self._poll("ncclCommFinalize", timeout)  # aborts on error or timeout
            else:
                self._stream.synchronize()
                if self._lib.has("ncclCommFinalize"):
                    self._lib.ncclCommFinalize(ctypes.c_void_p(self.comm_ptr))
            with self._lock:
                if self.state != "ok":
                    return
                self.state = "shut down"
                self._wait_for_callers()
                if self.nonblocking:
                    handle, self._handle = self._handle, None
                    self._lib.ncclCommDestroy(handle)
                else:
                    self._cupy_comm.destroy()  # its status is lost (see the module's docstring)

    def abort(self, on_behalf_of: Optional[int] = None) -> Optional[int]:
        """ncclCommAbort: frees the communicator without waiting for peers or queued work,
        ending any kernel of it stuck on the GPU. Callable from any thread; idempotent.
        Returns NCCL's status for the abort (None when there was nothing to abort); always
        ncclSuccess for a blocking one, whose status CuPy discards. ``on_behalf_of``: the
        thread that asked for the abort when another runs it (its call under way, if any, is
        not waited for, as the caller's own would not be)."""
        # The state changes under the lock, ncclCommAbort runs outside it: an abort that
        # hangs (NCCL has known hangs there) must not stall the watchdog's async_error() on the
        # lock. Every holder of the lock re-checks the state, so none touches the comm after.
        with self._lock:
            if self.state in ("aborted", "shut down"):
                return None
            self.state = "aborted"  # from now on _guarded refuses new calls
            handle, self._handle = self._handle, None
            self._wait_for_callers(on_behalf_of)
        with _cuda.cupy_module().cuda.Device(self.device):
            if self.nonblocking:
                return self._lib.ncclCommAbort(handle) if handle else None
            self._cupy_comm.abort()  # its status is lost (see the module's docstring)
            return nccl_bindings.ncclSuccess
