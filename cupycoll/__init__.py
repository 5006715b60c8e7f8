"""cupycoll: a torch.distributed backend that runs NCCL through CuPy.

``import cupycoll`` registers the backend name ``"cupycoll"`` for CUDA devices, so that
``torch.distributed.init_process_group("cuda:cupycoll")`` (or ``"cupycoll"``, or
``"cpu:gloo,cuda:cupycoll"``) builds a cupycoll group: from torch 2.14 torch's own ProcessGroup
holding cupycoll's c10d Backend (:mod:`cupycoll.py_backend`), before it a
:class:`ProcessGroupCupycoll` (docs/usage.md, "Two shapes"). Importing the package
does not import CuPy (that happens at the first CUDA collective), nor the process-group
module: ``ProcessGroupCupycoll``, ``abort_all``, ``shrink_group`` and ``group_fault`` load it
on first access (PEP 562), so the ``torch.backends`` entry point, which runs during
``import torch``, stays cheap.
"""

from __future__ import annotations

import importlib

from ._registration import register
from ._version import __version__
from .algorithms import algorithm
from .config import BACKEND_NAME, ENVIRONMENT, Options
from .errors import (
    CollectiveTimeoutError,
    CommunicatorAbortedError,
    CupycollError,
    CupycollTypeError,
    CupycollValueError,
    MissingDependencyError,
    NcclError,
    NoCudaDeviceError,
    PeerFailedError,
)
from .trace.dumps import dump_trace
from .work import CudaWork

_LAZY = {"ProcessGroupCupycoll": "process_group", "abort_all": "process_group",
         "shrink_group": "shrink", "SHRINK_DEFAULT": "shrink", "SHRINK_ABORT": "shrink", "group_fault": "shell"}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups do not come back here
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))

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
    "PeerFailedError",
    "ProcessGroupCupycoll",
    "SHRINK_ABORT",
    "SHRINK_DEFAULT",
    "abort_all",
    "algorithm",
    "dump_trace",
    "group_fault",
    "register",
    "shrink_group",
]

register()
