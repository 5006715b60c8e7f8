"""Lazy access to CuPy and its NCCL module, with errors that say what to install, and the
few raw CUDA calls the hot path makes through CuPy's runtime: pooled events
(:class:`Event`) and the capture test of a stream (:func:`capturing`).

Nothing here runs at ``import cupycoll``: CuPy is imported the first time a CUDA
collective (or an eager ``device_id`` init) needs it, so CPU-only users and the
``torch.backends`` entry point never pay for it. CPU tests put stand-ins in place of
:func:`new_event` and :func:`capturing` (tests/standins.py).

Deliberately left out: streams (torch's: :func:`cupycoll.compat.current_raw_stream`).
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
import warnings
from typing import Optional

from . import compat
from .errors import MissingDependencyError, NoCudaDeviceError

INSTALL_HINT = (
    "install the extra matching the CUDA major of your torch build (torch.version.cuda): "
    "pip install 'cupycoll[cuda12]' (CUDA 12) or 'cupycoll[cuda13]' (CUDA 13), or from a "
    "checkout of cupycoll: pip install -e '.[cuda12]' (or -e '.[cuda13]')"
)


def _cupy_ready_to_compile():  # not cached: its callers are
    """CuPy, with the pip package's NVRTC loaded before any compilation (the ring kernels)."""
    try:
        import cupy
    except ImportError as exc:
        raise MissingDependencyError(f"CuPy is not installed; {INSTALL_HINT}") from exc
    _warn_on_mixed_stack()
    compat.load_pip_nvrtc(cupy)
    return cupy


# The extras pyproject.toml declares, by CUDA major.
_EXTRAS = {12: "cuda12", 13: "cuda13"}


def mixed_stack_warning(torch_cuda: Optional[str], cupy_cuda_major: Optional[int]) -> Optional[str]:
    """The warning for a torch built for one CUDA major next to a CuPy built for another, or
    None: a CPU or ROCm torch build (``torch.version.cuda`` None), an unknown CuPy major, or
    majors that agree."""
    if not torch_cuda or cupy_cuda_major is None:
        return None
    torch_major = int(torch_cuda.split(".")[0])
    if torch_major == cupy_cuda_major:
        return None
    extra = _EXTRAS.get(torch_major)
    fix = f": pip install 'cupycoll[{extra}]' (from a checkout: pip install -e '.[{extra}]')" if extra else ""
    return (f"torch is a CUDA {torch_major} build (torch.version.cuda={torch_cuda}) but CuPy was built "
            f"for CUDA {cupy_cuda_major}: one process then loads two CUDA runtimes and two NCCLs, "
            f"which can fail or hang at the first collective. Uninstall that CuPy "
            f"(cupy-cuda{cupy_cuda_major}x) and install CuPy and NCCL for CUDA {torch_major}{fix}")


def cupy_cuda_major(cupy) -> Optional[int]:
    """The CUDA major ``cupy`` was built for, or None (a ROCm build, or unknown)."""
    runtime = cupy.cuda.runtime
    if getattr(runtime, "is_hip", False):  # runtimeGetVersion would be HIP's version
        return None
    try:
        # The CUDA runtime linked into CuPy, not the driver's: answers without a GPU or a
        # driver (CuPy 13.0 and 14.2 do), unlike get_local_runtime_version, which reports
        # whichever libcudart the loader finds.
        return int(runtime.runtimeGetVersion()) // 1000
    except runtime.CUDARuntimeError:
        pass
    # Else the wheel's name says it: cupy-cuda12x, cupy-cuda13x.
    for distribution in importlib.metadata.distributions():
        match = re.fullmatch(r"cupy-cuda(\d+)x", (distribution.metadata["Name"] or "").lower())
        if match:
            return int(match.group(1))
    return None


@functools.lru_cache(maxsize=None)
def _warn_on_mixed_stack() -> Optional[str]:
    """Warn once per process when torch's and CuPy's CUDA majors differ (pip cannot prevent
    it: torch's CUDA major is not in its metadata); the message, or None."""
    import cupy
    import torch

    message = mixed_stack_warning(torch.version.cuda, cupy_cuda_major(cupy))
    if message:
        warnings.warn(message, stacklevel=3)
    return message


@functools.lru_cache(maxsize=None)
def nccl_module():
    """Return ``cupy.cuda.nccl``, or raise MissingDependencyError naming the extra."""
    _cupy_ready_to_compile()
    try:
        from cupy.cuda import nccl
    except ImportError as exc:
        raise MissingDependencyError(f"CuPy cannot load its NCCL module; {INSTALL_HINT}") from exc
    if not getattr(nccl, "available", False):
        raise MissingDependencyError(
            f"CuPy found no NCCL library (libnccl.so.2); {INSTALL_HINT}, "
            "or point CUPY_CUDA_LIB_PATH at an NCCL installation"
        )
    return nccl


@functools.lru_cache(maxsize=None)
def nvrtc_module():
    """Return ``cupy.cuda.nvrtc`` (compiling needs no NCCL and no GPU), or raise
    MissingDependencyError."""
    _cupy_ready_to_compile()
    from cupy.cuda import nvrtc

    return nvrtc


def cupy_module():
    nccl_module()
    import cupy

    return cupy


def require_device(index: int) -> None:
    """Raise NoCudaDeviceError unless CUDA device ``index`` exists for CuPy."""
    cupy = cupy_module()
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        raise NoCudaDeviceError(f"no CUDA device is usable: {exc}") from exc
    if not 0 <= index < count:
        raise NoCudaDeviceError(f"CUDA device {index} does not exist ({count} visible)")


# cudaEventQuery's "not yet" (cudaErrorNotReady); 0 is done, anything else an error.
_NOT_READY = 600


class Event:
    """One CUDA event made once (timing off) and recorded again and again: the watchdog's
    pooled completion events (cupycoll.faults.watchdog). Each method is one CuPy runtime
    call; record, synchronize and the stream wait release the GIL there."""

    __slots__ = ("handle", "_runtime")

    def __init__(self):
        runtime = cupy_module().cuda.runtime
        self._runtime = runtime
        self.handle = runtime.eventCreateWithFlags(runtime.eventDisableTiming)

    def record(self, stream: int) -> None:
        self._runtime.eventRecord(self.handle, stream)

    def query(self) -> bool:
        """Has the GPU passed the last record? Raises a sticky CUDA error (CuPy's
        CUDARuntimeError, with its ``status``)."""
        status = self._runtime.eventQuery(self.handle)
        if status == 0:
            return True
        if status == _NOT_READY:
            return False
        raise self._runtime.CUDARuntimeError(status)

    def synchronize(self) -> None:
        self._runtime.eventSynchronize(self.handle)

    def wait_on(self, stream: int) -> None:
        """Make ``stream`` wait for the last record (cudaStreamWaitEvent)."""
        self._runtime.streamWaitEvent(stream, self.handle)

    def destroy(self) -> None:
        """Free the event (never on the watchdog's thread: it can wait behind a stuck kernel)."""
        handle, self.handle = self.handle, 0
        if handle:
            self._runtime.eventDestroy(handle)


def new_event() -> Event:
    return Event()


def capturing(stream: int) -> bool:
    """Is ``stream`` (a raw pointer) capturing a CUDA graph?"""
    return cupy_module().cuda.runtime.streamIsCapturing(stream)
