"""One NCCL communicator on one CUDA device, spoken to in Python verbs.

A :class:`Communicator` owns one ``ncclComm_t``, the device it lives on and an internal
stream for asynchronous work. Its verbs take raw device pointers, element counts, NCCL
datatype/op codes and a stream handle (plain ints), so this layer knows nothing of torch;
the process-group adapter translates tensors into those.

Every communicator is made the same way, through the ctypes bindings
(:mod:`cupycoll.nccl.bindings`) with ``ncclCommInitRankConfig``, and so is every child of one
(``ncclCommSplit``, ``ncclCommShrink``: :mod:`cupycoll.nccl.children`): one kind of object,
whose every NCCL status is read, ``ncclCommAbort``'s and ``ncclCommDestroy``'s included. Two
modes, the config's ``blocking`` field, invisible to the caller:

* **blocking** (default): each call returns when NCCL has enqueued it (creation: when every
  peer has joined);
* **nonblocking**: every call may return ``ncclInProgress`` and is then polled with
  ``ncclCommGetAsyncError`` until it settles, bounded by the communicator's timeout and
  ended at once by :meth:`Communicator.abort` from any thread. That includes creation
  itself: :meth:`Communicator.begin` returns before the peers have connected and
  :meth:`Communicator.wait_ready` polls.

NCCL groups: :meth:`Communicator.group` is ncclGroupStart/End of the library the
communicator already holds; the per-thread bookkeeping (which communicators a group used,
polled or aborted at its end) is :mod:`cupycoll.nccl.group`.

Deliberately left out: a group's set of communicators (:mod:`cupycoll.nccl.communicators`),
validation of user input (done once, above, with names the user knows), scheduling policy
(which stream, when to group), the watchdog (it lives above and only calls
:meth:`async_error` and :meth:`abort`) and any teardown in ``__del__``: ``shutdown()`` and
``abort()`` are explicit.
"""

from __future__ import annotations

import ctypes
import os
import time
from typing import Callable, Optional

from .. import _cuda
from . import bindings as nccl_bindings, group as nccl_group, header as nccl_header
from .call_guard import GuardedCalls
from .children import ChildMaking
from ..errors import CollectiveTimeoutError, CommunicatorAbortedError, CupycollValueError, NcclError


# This thread's NCCL groups (cupycoll.nccl.group): a call inside one joins it.
_OPEN_GROUPS = nccl_group.per_thread
_IN_PROGRESS = nccl_header.ncclInProgress


def _library(path: Optional[str] = None) -> nccl_bindings.NcclLibrary:
    # CuPy's NCCL first, so that the ctypes bindings find and share the library it mapped.
    _cuda.nccl_module()
    return nccl_bindings.load(path)


def new_unique_id() -> bytes:
    """A fresh ncclUniqueId as 128 bytes."""
    return _library().unique_id()


# -- the communicator ----------------------------------------------------------------------


class Communicator(GuardedCalls, ChildMaking):
    """An NCCL communicator bound to one device, with the verbs the backend needs."""

    on_abort: Optional[Callable[[BaseException], None]] = None

    def __init__(self, device: int, rank: int, size: int, nccl_library: Optional[str] = None, *,
                 handle: int, timeout: float, nonblocking: bool = False,
                 on_abort: Optional[Callable[[BaseException], None]] = None,
                 runtime: Optional[_cuda.Runtime] = None):
        # The CUDA runtime its device guard and stream come from (cupycoll._cuda): every call
        # of this communicator's into CUDA or NCCL runs with its device current.
        self.runtime = runtime if runtime is not None else _cuda.current()
        self._handle = handle  # the raw ncclComm_t; None once destroyed or aborted
        self.nonblocking = nonblocking
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
        # under way (cupycoll.nccl.call_guard).
        self._init_guard()
        with self.runtime.on_device(device):
            # Non-blocking w.r.t. the legacy default stream, like ProcessGroupNCCL's.
            self._stream = self.runtime.new_stream(device)
        self.stream = self._stream.ptr

    @property
    def comm_ptr(self) -> int:
        """The raw ``ncclComm_t`` (0 once destroyed or aborted)."""
        return self._handle or 0

    def __repr__(self) -> str:
        mode = "nonblocking" if self.nonblocking else "blocking"
        return f"Communicator(rank={self.rank}, size={self.size}, cuda:{self.device}, {mode}, {self.state})"

    # -- creation --------------------------------------------------------------------
    @staticmethod
    def preflight(device: int, nccl_library=None, nonblocking: bool = False,
                  runtime: Optional[_cuda.Runtime] = None) -> None:
        """The checks of :meth:`begin` that depend on this process alone, for before the store
        gate: a rank failing after it leaves its peers in blocking ncclCommInitRank for good."""
        (runtime if runtime is not None else _cuda.current()).require_device(device)
        _library(nccl_library)  # a library that cannot load fails here, in both modes
        if not nonblocking and os.environ.get("NCCL_COMM_BLOCKING", "") == "0":
            raise CupycollValueError(
                "NCCL_COMM_BLOCKING=0 makes every NCCL call return ncclInProgress, which a "
                "blocking communicator does not poll; unset it or use nonblocking=True")

    @classmethod
    def begin(cls, unique_id: bytes, rank: int, size: int, device: int, nccl_library=None,
              nonblocking: bool = False, *, timeout: float,
              on_abort: Optional[Callable[[BaseException], None]] = None,
              runtime: Optional[_cuda.Runtime] = None) -> "Communicator":
        """Start joining the communicator named by ``unique_id`` as ``rank`` of ``size``.

        Blocking mode returns when every peer has joined. Nonblocking mode returns at once,
        in state ``"initializing"``: call :meth:`wait_ready` (which :meth:`abort` can end)."""
        runtime = runtime if runtime is not None else _cuda.current()
        cls.preflight(device, nccl_library, nonblocking, runtime)  # cheap; callers ran it before the gate
        lib = _library(nccl_library)
        handle = nccl_header.ncclComm_t()
        config = nccl_header.make_config(blocking=not nonblocking)
        with runtime.on_device(device):
            lib.ncclCommInitRankConfig(ctypes.byref(handle), size, lib.unique_id_from_bytes(unique_id),
                                       rank, ctypes.byref(config))
            return cls(device, rank, size, nccl_library, handle=handle.value, nonblocking=nonblocking,
                       timeout=timeout, on_abort=on_abort, runtime=runtime)

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

    # -- collectives (pointers, counts and codes are plain ints) --------------------
    def launch(self, calls, stream) -> None:
        """The NCCL calls ``calls`` on ``stream``: each ``(C function, its arguments before the
        communicator and the stream)``, e.g. ``("ncclAllReduce", (send, recv, count, dtype,
        op))``, in this order under one guard (:mod:`cupycoll.nccl.call_guard`), settled or left
        to the NCCL group open on this thread (several calls that must launch together are
        issued inside :meth:`group`). Every NCCL call of a collective comes here, each C
        function looked up once per launch and its status checked here (a coalesced block's
        parts are one loop, with no Python frame around each)."""
        function = calls[0][0]
        functions = self._lib.unchecked
        call = functions[function]
        handle, note = self._enter(function)
        status = 0
        try:
            for name, args in calls:
                if name != function:
                    function, call = name, functions[name]
                status = call(*args, handle, stream)
                if status and status != _IN_PROGRESS:
                    raise self._lib.failure(function, status)
        except Exception as exc:
            if self.ended:
                raise self.cut_short(function) from exc
            raise
        finally:
            self._leave(note)
        if self.nonblocking or _OPEN_GROUPS.__dict__.get("depth"):
            # Outside the guard: a poll that fails or times out aborts this communicator from
            # this very thread, which must not wait for itself. (A blocking call outside an
            # NCCL group has nothing to settle.)
            self._settle(function, status)

    def _call(self, c_name: str, *args) -> None:
        """One NCCL call (its stream last) through :meth:`launch`."""
        self.launch(((c_name, args[:-1]),), args[-1])

    def all_reduce(self, sendbuf, recvbuf, count, dtype, op, stream):
        self._call("ncclAllReduce", sendbuf, recvbuf, count, dtype, op, stream)

    def broadcast(self, sendbuf, recvbuf, count, dtype, root, stream):
        self._call("ncclBroadcast", sendbuf, recvbuf, count, dtype, root, stream)

    def reduce(self, sendbuf, recvbuf, count, dtype, op, root, stream):
        self._call("ncclReduce", sendbuf, recvbuf, count, dtype, op, root, stream)

    def all_gather(self, sendbuf, recvbuf, count, dtype, stream):
        self._call("ncclAllGather", sendbuf, recvbuf, count, dtype, stream)

    def reduce_scatter(self, sendbuf, recvbuf, recvcount, dtype, op, stream):
        self._call("ncclReduceScatter", sendbuf, recvbuf, recvcount, dtype, op, stream)

    def send(self, buf, count, dtype, peer, stream):
        self._call("ncclSend", buf, count, dtype, peer, stream)

    def recv(self, buf, count, dtype, peer, stream):
        self._call("ncclRecv", buf, count, dtype, peer, stream)

    # -- PREMUL_SUM ----------------------------------------------------------------
    def create_premul_sum(self, scalar, dtype: int, on_device: bool) -> int:
        """ncclRedOpCreatePreMulSum. ``scalar``: the factor's bytes in ``dtype`` (host), or a
        device pointer to one element of ``dtype`` when ``on_device``."""
        if not self._lib.has("ncclRedOpCreatePreMulSum"):
            raise CupycollValueError("PREMUL_SUM needs NCCL >= 2.11 (ncclRedOpCreatePreMulSum)")
        op = ctypes.c_int()
        if on_device:
            scalar_ptr = ctypes.c_void_p(scalar)
            residence = nccl_header.ncclScalarDevice
        else:
            host = ctypes.create_string_buffer(bytes(scalar), len(scalar))
            scalar_ptr = ctypes.cast(host, ctypes.c_void_p)
            residence = nccl_header.ncclScalarHostImmediate
        # Guarded: an aborted communicator has no comm_ptr (NCCL: ncclInvalidArgument).
        status = self._guarded("ncclRedOpCreatePreMulSum", lambda handle: self._lib.ncclRedOpCreatePreMulSum(
            ctypes.byref(op), scalar_ptr, dtype, residence, handle))
        self._settle("ncclRedOpCreatePreMulSum", status)
        return op.value

    def destroy_op(self, op: int) -> None:
        # NCCL allows this as soon as the last call using ``op`` has returned. Guarded: an
        # abort in between frees the op with the communicator, and this must not touch it.
        try:
            self._guarded("ncclRedOpDestroy", lambda handle: self._lib.ncclRedOpDestroy(op, handle))
        except CommunicatorAbortedError:
            pass

    # -- nonblocking progress ---------------------------------------------------------
    def _settle(self, function: str, status: int) -> None:
        # Inside a group NCCL settles everything at ncclGroupEnd (poll then; a group that
        # raises aborts what it joined).
        if nccl_group.join(self):
            return
        if status == nccl_header.ncclInProgress:
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
                if self.ended:  # the call was still settling
                    raise self.cut_short(function)
                self._lib.ncclCommGetAsyncError(self._handle, ctypes.byref(status))
            if status.value == nccl_header.ncclSuccess:
                return
            if status.value != nccl_header.ncclInProgress:
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
        """ncclCommGetAsyncError as an exception (None while healthy or still working, or
        while another call on this communicator is under way: the watchdog asks again at
        its next pass). Safe from any thread; the watchdog calls it."""
        status = ctypes.c_int()
        with self._lock:
            if self.state != "ok" or self.busy():
                return None
            ptr = self.comm_ptr
            if not ptr:
                return None
            try:
                self._lib.ncclCommGetAsyncError(ctypes.c_void_p(ptr), ctypes.byref(status))
            except NcclError as exc:
                return exc
        if status.value in (nccl_header.ncclSuccess, nccl_header.ncclInProgress):
            return None
        return NcclError(status.value, "ncclCommGetAsyncError", self._lib.error_string(status.value),
                         self._lib.last_error())

    # -- lifetime -------------------------------------------------------------------
    def tell_owner(self, error: BaseException) -> None:
        """Tell the owner (its group) that ``error`` ends this communicator: the group fails
        its Works then, before anything ends their kernels."""
        if self.on_abort is not None:
            self.on_abort(error)

    def _abort_for(self, error: BaseException) -> None:
        """Abort because of ``error`` found here. The owner is told first: its group fails
        its Works and then aborts its communicators, this one among them, so no Work whose
        kernel the abort ends can read as a success in between. Aborted here as well
        whatever the owner did (idempotent)."""
        try:
            self.tell_owner(error)
        finally:
            self.abort()

    def _check_usable(self):
        if self.state not in ("ok", "initializing"):
            raise CommunicatorAbortedError(f"the NCCL communicator on cuda:{self.device} was {self.state}")

    def shutdown(self, timeout: Optional[float] = None) -> None:
        """ncclCommFinalize then ncclCommDestroy: the communicator's queued work completes
        first (peers must be alive). A nonblocking finalize that fails or outlives
        ``timeout`` aborts the communicator instead, and the error is raised. A call another
        thread still has inside NCCL then gets an abort on its way out, not a destroy."""
        if self.state not in ("ok", "initializing"):
            return
        with self.runtime.on_device(self.device):
            if self.nonblocking:
                if self.state == "initializing":
                    self.abort()
                    return
                self._guarded("ncclCommFinalize", self._lib.ncclCommFinalize)
                self._poll("ncclCommFinalize", timeout)  # aborts on error or timeout
            else:
                self._stream.synchronize()
                self._guarded("ncclCommFinalize", self._lib.ncclCommFinalize)
            with self._lock:
                if self.state != "ok":
                    return
                handle = self._end("shut down")
            if handle:
                self._lib.ncclCommDestroy(handle)
                self.abort_done.set()

    def abort(self, on_behalf_of: Optional[int] = None) -> Optional[int]:
        """ncclCommAbort: frees the communicator without waiting for peers or queued work,
        ending any kernel of it stuck on the GPU. Callable from any thread; idempotent.
        Returns NCCL's status for the abort (None when there was nothing to abort now; a
        failing status raises NcclError). With another thread inside a call on it, NCCL may
        not be entered beside that call: the communicator is marked aborted at once (no call
        enters any more) and the call runs ncclCommAbort on its way out
        (:mod:`cupycoll.nccl.call_guard`, rule 2; ``abort_done`` is set once it ran).
        ``on_behalf_of``: the thread that asked for the abort when another runs it (abort_all
        from a signal handler: that thread is not inside NCCL while the handler runs)."""
        # The state changes under the lock, ncclCommAbort runs outside it: an abort that
        # hangs (NCCL has known hangs there) must not stall the watchdog's async_error() on the
        # lock. Every holder of the lock re-checks the state, so none touches the comm after.
        with self._lock:
            if self.ended:
                return None
            handle = self._end("aborted", on_behalf_of)
        if not handle:
            return None
        return self._abort_now(handle)

    def _abort_now(self, handle: int) -> int:
        try:
            # NCCL sets back the device current when it was called (a thread that never
            # chose one: cuda:0, which that would give a context): the communicator's.
            with self.runtime.on_device(self.device):
                return self._lib.ncclCommAbort(handle)
        finally:
            self.abort_done.set()
