"""The CUDA runtime as cupycoll uses it, in one object, and lazy access to CuPy and its NCCL
module with errors that say what to install.

Every CUDA call cupycoll makes goes through a :class:`Runtime` (torch's device guard and
streams, CuPy's runtime for events, streams, copies and kernels, torch's allocator for
scratch memory), so that the rules a multi-GPU node needs hold in one place:

* **the device**: every call runs with the group's device current (:meth:`Runtime.on_device`,
  torch's guard, whose exit sets back a device only where that device has a context: a
  thread that never chose a device, and CuPy's ``Device.__exit__`` would, makes the runtime
  create a context on cuda:0, several hundred MiB in every rank of an 8-GPU node);
* **the stream**: a synchronous call runs on the caller's current stream, an asynchronous
  one on its communicator's (:meth:`Runtime.use_stream`);
* **capture**: whether a stream is capturing a CUDA graph (:meth:`Runtime.capturing`).

:data:`CUDA` is the process's runtime. A group's backend takes the runtime in force when it
is built (:func:`current`) and hands it to what it makes (its watch, communicators, algorithm
runners), so a test gives a group another one (tests/standins.py's device ledger: a current
device per thread, the contexts made, the device of every object) by :func:`install`.

Nothing here runs at ``import cupycoll``: CuPy is imported the first time a CUDA collective
(or an eager ``device_id`` init) needs it, so CPU-only users and the ``torch.backends`` entry
point never pay for it.

Deliberately left out: NCCL itself (:mod:`cupycoll.nccl`, which sets the communicator's
device inside its calls and restores the caller's after them), and torch's own tensor
operations, which guard their devices themselves.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import re
import warnings
from typing import Dict, Optional, Tuple

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
        """Free the event (never on the watchdog's thread: it can wait behind a stuck kernel;
        its device current)."""
        handle, self.handle = self.handle, 0
        if handle:
            self._runtime.eventDestroy(handle)


class Runtime:
    """The CUDA calls cupycoll makes, on torch and CuPy (see the module). Each method says
    which device must be current: the caller guards with :meth:`on_device`."""

    def __init__(self):
        import torch

        # The hot path's two questions, each one C call where torch has it (the public calls
        # add a lazy-init check, and current_stream() builds a Python Stream): the device torch
        # reports current on this thread, and the current stream of a device as a raw
        # pointer. A build without CUDA has only the public calls.
        self.current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
        self.current_stream = compat.current_raw_stream
        self._torch_streams: Dict[int, object] = {}  # raw stream -> torch's view of it
        self._cupy_streams: Dict[int, object] = {}  # raw stream -> CuPy's view of it
        self._kernels: Dict[tuple, Dict[str, object]] = {}

    # -- the device ----------------------------------------------------------------------
    # current_device() -> int and current_stream(index) -> int: attributes set in __init__.

    def on_device(self, index: Optional[int]):
        """A context with device ``index`` current: nothing when it is already (or ``index``
        is None: no device chosen yet), else torch's guard, which on its way out sets the
        previous device back only where that device has a context."""
        if index is None or index < 0 or self.current_device() == index:
            return _NOTHING
        import torch

        return torch.cuda.device(index)

    def require_device(self, index: int) -> None:
        """Raise NoCudaDeviceError unless CUDA device ``index`` exists for CuPy."""
        cupy = cupy_module()
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except cupy.cuda.runtime.CUDARuntimeError as exc:
            raise NoCudaDeviceError(f"no CUDA device is usable: {exc}") from exc
        if not 0 <= index < count:
            raise NoCudaDeviceError(f"CUDA device {index} does not exist ({count} visible)")

    # -- streams -------------------------------------------------------------------------
    def capturing(self, stream: int) -> bool:
        """Is ``stream`` (a raw pointer) capturing a CUDA graph? (Its device current.)"""
        return cupy_module().cuda.runtime.streamIsCapturing(stream)

    def new_stream(self, index: int):
        """A stream of device ``index`` (current) that does not wait for the legacy default
        stream, as ProcessGroupNCCL's: an object with ``ptr`` and ``synchronize()``."""
        return cupy_module().cuda.Stream(non_blocking=True)

    def use_stream(self, stream: int, index: int):
        """A context in which ``stream`` (a raw pointer on device ``index``, current) is
        torch's current stream, for what torch allocates and launches in the body."""
        import torch

        view = self._torch_streams.get(stream)
        if view is None:
            if len(self._torch_streams) >= 64:  # streams come and go with communicators
                self._torch_streams.clear()
            view = self._torch_streams[stream] = torch.cuda.ExternalStream(stream, device=torch.device("cuda", index))
        return torch.cuda.stream(view)

    def future(self, outputs, index: int, after: Optional[Event]):
        """A CUDA-aware ``torch.futures.Future`` holding ``outputs``, its value ready on a
        stream ordered after ``after`` (an event; None: after nothing). Device ``index``
        current."""
        import torch

        future = torch.futures.Future(devices=[torch.device("cuda", index)])
        # set_result records an event on the current stream: make that stream one that is
        # ordered right after the event and nothing later.
        stream = torch.cuda.Stream(torch.device("cuda", index))
        if after is not None:
            after.wait_on(stream.cuda_stream)
        with torch.cuda.stream(stream):
            future.set_result(outputs)
        return future

    # -- events --------------------------------------------------------------------------
    def new_event(self) -> Event:
        """A pooled event (timing off) of the current device."""
        return Event()

    # -- memory, copies and kernels (the algorithms') --------------------------------------
    @property
    def out_of_memory(self) -> type:
        """What :meth:`scratch` raises when the device is out of memory."""
        import torch

        return torch.cuda.OutOfMemoryError

    def scratch(self, nbytes: int, index: int):
        """``nbytes`` of device memory on device ``index`` from torch's caching allocator (a
        uint8 tensor: ``torch.cuda.memory_allocated`` and ``empty_cache`` see it), in the
        current stream's order."""
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", index))

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """An asynchronous device-to-device copy on ``stream`` (its device current)."""
        runtime = cupy_module().cuda.runtime
        runtime.memcpyAsync(dst, src, nbytes, runtime.memcpyDeviceToDevice, stream)

    def compile(self, index: int, source: str, options: Tuple[str, ...], names: Dict[str, str]) -> Dict[str, object]:
        """The kernels ``names`` (kind -> C++ name expression) of ``source``, compiled once per
        process and device (CuPy's on-disk cache serves later processes). Device ``index``
        current."""
        key = (index, source, options, tuple(sorted(names.items())))
        found = self._kernels.get(key)
        if found is None:
            cupy = cupy_module()
            module = cupy.RawModule(code=source, options=options, name_expressions=tuple(names.values()))
            # Fetching the functions compiles now, so that the first collective does not.
            found = self._kernels[key] = {kind: module.get_function(name) for kind, name in names.items()}
        return found

    def launch(self, kernel, grid: tuple, block: tuple, args: tuple, stream: int) -> None:
        """Launch ``kernel`` (one of :meth:`compile`'s) on ``stream`` (its device current)."""
        view = self._cupy_streams.get(stream)
        if view is None:
            cupy = cupy_module()
            if len(self._cupy_streams) >= 64:
                self._cupy_streams.clear()
            view = self._cupy_streams[stream] = compat.external_stream(cupy, _StreamHandle(stream), stream,
                                                                       cupy.cuda.runtime.getDevice())
        kernel(grid, block, args, stream=view)


class _StreamHandle:
    """A raw ``cudaStream_t`` speaking the CUDA stream protocol."""

    def __init__(self, ptr: int):
        self._ptr = ptr

    def __cuda_stream__(self):
        return (0, self._ptr)


_NOTHING = contextlib.nullcontext()

#: The process's runtime.
CUDA = Runtime()
_installed = [CUDA]


def current() -> Runtime:
    """The runtime a group built now uses (the process's, unless a test installed another)."""
    return _installed[-1]


@contextlib.contextmanager
def install(runtime: Runtime):
    """Groups built in the body use ``runtime`` (a test's stand-in of the CUDA runtime)."""
    _installed.append(runtime)
    try:
        yield runtime
    finally:
        _installed.remove(runtime)
