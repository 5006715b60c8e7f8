"""One NCCL communicator on one CUDA device, spoken to in Python verbs.

A :class:`Communicator` owns a ``cupy.cuda.nccl.NcclCommunicator``, the device it lives
on and an internal stream for asynchronous work. Its verbs take raw device pointers,
element counts, NCCL datatype/op codes and a stream handle (plain ints), so this layer
knows nothing of torch; the process-group adapter translates tensors into those.

Deliberately left out: validation of user input (done once, above, with names the user
knows), scheduling policy (which stream, when to group) and any teardown in ``__del__``:
``shutdown()`` and ``abort()`` are explicit.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from typing import Optional

from . import _cuda, nccl_bindings
from .errors import CommunicatorAbortedError, CupycollValueError, NcclError


def _translate(exc: Exception, function: str) -> NcclError:
    status = getattr(exc, "status", 3)
    return NcclError(status, function, str(exc))


def new_unique_id() -> bytes:
    """A fresh ncclUniqueId as 128 bytes (CuPy 13 gives ints, CuPy 14 bytes)."""
    raw = _cuda.nccl_module().get_unique_id()
    if isinstance(raw, (bytes, bytearray)):
        return bytes(raw)
    return bytes(value & 0xFF for value in raw)


def _unique_id_for_cupy(unique_id: bytes):
    # CuPy 13 takes a tuple of 128 signed chars, CuPy 14 the bytes themselves. (Not probed
    # with get_unique_id(): each call starts an NCCL bootstrap listener.)
    if int(_cuda.cupy_module().__version__.split(".")[0]) >= 14:
        return unique_id
    return tuple(b - 256 if b > 127 else b for b in unique_id)


@contextlib.contextmanager
def nccl_group():
    """ncclGroupStart/End around the body; End runs even when the body raises."""
    nccl = _cuda.nccl_module()
    try:
        nccl.groupStart()
    except nccl.NcclError as exc:
        raise _translate(exc, "ncclGroupStart") from exc
    try:
        yield
    finally:
        try:
            nccl.groupEnd()
        except nccl.NcclError as exc:
            raise _translate(exc, "ncclGroupEnd") from exc


class Communicator:
    """An NCCL communicator bound to one device, with the verbs the backend needs."""

    def __init__(self, comm, device: int, rank: int, size: int, nccl_library: Optional[str] = None):
        cupy = _cuda.cupy_module()
        self._comm = comm
        self._nccl_library = nccl_library
        self.device = device
        self.rank = rank
        self.size = size
        self.state = "ok"  # "ok" | "shut down" | "aborted"
        with cupy.cuda.Device(device):
            # Non-blocking w.r.t. the legacy default stream, like ProcessGroupNCCL's.
            self._stream = cupy.cuda.Stream(non_blocking=True)
        self.stream = self._stream.ptr
        self._nccl_error = _cuda.nccl_module().NcclError

    # -- creation --------------------------------------------------------------------
    @classmethod
    def create(cls, unique_id: bytes, rank: int, size: int, device: int, nccl_library=None):
        """Join the communicator named by ``unique_id`` as ``rank`` of ``size`` on ``device``."""
        if os.environ.get("NCCL_COMM_BLOCKING", "") == "0":
            raise CupycollValueError(
                "NCCL_COMM_BLOCKING=0 makes NCCL calls return ncclInProgress, which CuPy's "
                "blocking communicator cannot handle; unset it"
            )
        _cuda.require_device(device)
        nccl = _cuda.nccl_module()
        cupy = _cuda.cupy_module()
        with cupy.cuda.Device(device):
            try:
                comm = nccl.NcclCommunicator(size, _unique_id_for_cupy(unique_id), rank)
            except nccl.NcclError as exc:
                raise _translate(exc, "ncclCommInitRank") from exc
        return cls(comm, device, rank, size, nccl_library)

    @staticmethod
    def can_split() -> bool:
        return hasattr(_cuda.nccl_module().NcclCommunicator, "commSplit")

    def split(self, color: int, key: int) -> Optional["Communicator"]:
        """ncclCommSplit: collective over this communicator. ``color < 0`` takes no part."""
        self._check_usable()
        cupy = _cuda.cupy_module()
        with cupy.cuda.Device(self.device):
            try:
                child = self._comm.commSplit(color if color >= 0 else -1, key)
            except self._nccl_error as exc:
                raise _translate(exc, "ncclCommSplit") from exc
        if child is None:
            return None
        return Communicator(child, self.device, child.rank_id(), child.size(), self._nccl_library)

    # -- collectives (pointers, counts and codes are plain ints) --------------------
    def all_reduce(self, sendbuf, recvbuf, count, dtype, op, stream):
        try:
            self._comm.allReduce(sendbuf, recvbuf, count, dtype, op, stream)
        except self._nccl_error as exc:
            raise _translate(exc, "ncclAllReduce") from exc

    def broadcast(self, sendbuf, recvbuf, count, dtype, root, stream):
        try:
            self._comm.broadcast(sendbuf, recvbuf, count, dtype, root, stream)
        except self._nccl_error as exc:
            raise _translate(exc, "ncclBroadcast") from exc

    def reduce(self, sendbuf, recvbuf, count, dtype, op, root, stream):
        try:
            self._comm.reduce(sendbuf, recvbuf, count, dtype, op, root, stream)
        except self._nccl_error as exc:
            raise _translate(exc, "ncclReduce") from exc

    def all_gather(self, sendbuf, recvbuf, count, dtype, stream):
        try:
            self._comm.allGather(sendbuf, recvbuf, count, dtype, stream)
        except self._nccl_error as exc:
            raise _translate(exc, "ncclAllGather") from exc

    def reduce_scatter(self, sendbuf, recvbuf, recvcount, dtype, op, stream):
        try:
            self._comm.reduceScatter(sendbuf, recvbuf, recvcount, dtype, op, stream)
        except self._nccl_error as exc:
            raise _translate(exc, "ncclReduceScatter") from exc

    def send(self, buf, count, dtype, peer, stream):
        try:
            self._comm.send(buf, count, dtype, peer, stream)
        except self._nccl_error as exc:
            raise _translate(exc, "ncclSend") from exc

    def recv(self, buf, count, dtype, peer, stream):
        try:
            self._comm.recv(buf, count, dtype, peer, stream)
        except self._nccl_error as exc:
            raise _translate(exc, "ncclRecv") from exc

    # -- PREMUL_SUM ----------------------------------------------------------------
    def create_premul_sum(self, scalar, dtype: int, on_device: bool) -> int:
        """ncclRedOpCreatePreMulSum. ``scalar``: the factor's bytes in ``dtype`` (host), or a
        device pointer to one element of ``dtype`` when ``on_device``."""
        lib = nccl_bindings.load(self._nccl_library)
        if not lib.has("ncclRedOpCreatePreMulSum"):
            raise CupycollValueError("PREMUL_SUM needs NCCL >= 2.11 (ncclRedOpCreatePreMulSum)")
        op = ctypes.c_int()
        if on_device:
            scalar_ptr = ctypes.c_void_p(scalar)
            residence = nccl_bindings.ncclScalarDevice
        else:
            host = ctypes.create_string_buffer(bytes(scalar), len(scalar))
            scalar_ptr = ctypes.cast(host, ctypes.c_void_p)
            residence = nccl_bindings.ncclScalarHostImmediate
        lib.ncclRedOpCreatePreMulSum(
            ctypes.byref(op), scalar_ptr, dtype, residence, ctypes.c_void_p(self._comm.comm)
        )
        return op.value

    def destroy_op(self, op: int) -> None:
        # NCCL allows this as soon as the last call using ``op`` has returned.
        nccl_bindings.load(self._nccl_library).ncclRedOpDestroy(op, ctypes.c_void_p(self._comm.comm))

    # -- lifetime -------------------------------------------------------------------
    def _check_usable(self):
        if self.state != "ok":
            raise CommunicatorAbortedError(f"the NCCL communicator on cuda:{self.device} was {self.state}")

    def shutdown(self) -> None:
        """Destroy the communicator after its queued work; blocking (peers must be alive)."""
        if self.state != "ok":
            return
        self.state = "shut down"
        cupy = _cuda.cupy_module()
        with cupy.cuda.Device(self.device):
            self._stream.synchronize()
            try:
                self._comm.destroy()
            except self._nccl_error as exc:
                raise _translate(exc, "ncclCommDestroy") from exc

    def abort(self) -> None:
        """ncclCommAbort: frees the communicator without waiting for peers or queued work."""
        if self.state == "aborted":
            return
        was_destroyed = self.state == "shut down"
        self.state = "aborted"
        if not was_destroyed:
            with _cuda.cupy_module().cuda.Device(self.device):
                self._comm.abort()
