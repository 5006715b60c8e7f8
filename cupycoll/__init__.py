"""cupycoll: a torch.distributed backend that runs NCCL through CuPy.

``import cupycoll`` registers the backend name ``"cupycoll"`` for CUDA devices, so that
``torch.distributed.init_process_group("cuda:cupycoll")`` (or ``"cupycoll"``, or
``"cpu:gloo,cuda:cupycoll"``) builds a :class:`ProcessGroupCupycoll`. Importing the package
does not import CuPy: that happens at the first CUDA collective.
"""

from __future__ import annotations

from ._registration import register
from ._version import __version__
from .config import ENVIRONMENT, Options, algorithm
from .errors import (
    CollectiveTimeoutError,
    CommunicatorAbortedError,
    CupycollError,
    CupycollTypeError,
    CupycollValueError,
    MissingDependencyError,
    NcclError,
    NoCudaDeviceError,
)
from .process_group import BACKEND_NAME, ProcessGroupCupycoll, abort_all
from .work import CudaWork

__all__ = [
    "BACKEND_NAME",
    "CollectiveTimeoutError",
    "CommunicatorAbortedError",
    "CudaWork",
    "CupycollError",
    "CupycollTypeError",
    "CupycollValueError",
    "ENVIRONMENT",
    "MissingDependencyError",
    "NcclError",
    "NoCudaDeviceError",
    "Options",
    "ProcessGroupCupycoll",
    "abort_all",
    "algorithm",
    "register",
]

register()
