"""Version differences in CuPy (13 from 13.0, 14 from 14.2): its major version, where it
finds NVRTC, how it wraps a CUDA stream it does not own.

Left out: importing CuPy (never at import time: the callers hand in the module they loaded,
:mod:`cupycoll._cuda`), and NCCL's version facts (:mod:`cupycoll.nccl.header`).
"""

from __future__ import annotations

import os
import re
import sys
from typing import Optional


def cupy_major(cupy) -> int:
    return int(cupy.__version__.split(".")[0])


def load_pip_nvrtc(cupy) -> Optional[str]:
    """Make the NVRTC of the ``nvidia-cuda-nvrtc`` pip package (the cuda12/cuda13 extras
    install it) the one CuPy compiles with; the path loaded, or None."""
    # CuPy 14 finds pip-installed CUDA libraries itself (through cuda-pathfinder). CuPy 13
    # asks the dynamic loader for libnvrtc.so.<major>, whose search path does not include
    # site-packages, so the ring kernels could not compile. A library loaded first by path
    # is matched by its soname when CuPy asks.
    if cupy_major(cupy) >= 14:
        return None
    import ctypes
    import glob

    for entry in sys.path:
        found = sorted(glob.glob(os.path.join(entry, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so.*")))
        for path in found:
            if re.fullmatch(r"libnvrtc\.so\.\d+", os.path.basename(path)):
                try:
                    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                except OSError:
                    continue
                return path
    return None


def external_stream(cupy, handle, ptr: int, device: int):
    """A CuPy stream object for the CUDA stream ``ptr`` on ``device``, not owned by CuPy.
    ``handle`` is an object with ``__cuda_stream__`` for ``ptr``."""
    # CuPy 14 added Stream.from_external (any __cuda_stream__ object) and deprecates
    # ExternalStream; CuPy 13 has only ExternalStream.
    if cupy_major(cupy) >= 14:
        return cupy.cuda.Stream.from_external(handle)
    return cupy.cuda.ExternalStream(ptr, device)
