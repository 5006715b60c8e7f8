"""Lazy access to CuPy and its NCCL module, with errors that say what to install.

Nothing here runs at ``import cupycoll``: CuPy is imported the first time a CUDA
collective (or an eager ``device_id`` init) needs it, so CPU-only users and the
``torch.backends`` entry point never pay for it.
"""

from __future__ import annotations

import functools

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
    compat.load_pip_nvrtc(cupy)
    return cupy


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


@functools.lru_cache(maxsize=None)
def fp8_supported() -> bool:
    """Can the NCCL CuPy loaded reduce fp8 (NCCL >= 2.24)? Asked only for fp8 tensors."""
    from . import nccl_bindings

    return nccl_bindings.fp8_supported(nccl_module().get_version())


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
