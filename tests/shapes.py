"""The two shapes of a cupycoll group (cupycoll.config.shape), as tests see them: what type
torch's handle has, and where cupycoll's own object (the routing shell: settings, recorder,
CUDA core) sits behind it."""

from __future__ import annotations

import os
from typing import Dict, Optional

import torch

from cupycoll import compat, config


def backend_shape(env: Optional[Dict[str, str]] = None) -> bool:
    """Does a process with this environment plus ``env`` build groups in the Backend shape?"""
    return config.shape(compat.BACKEND_SHAPE_BY_DEFAULT, {**os.environ, **(env or {})}) == "backend"


def cupycoll_group_type(env: Optional[Dict[str, str]] = None) -> str:
    """The type name of torch's handle of a cupycoll group: cupycoll's ProcessGroup, or in the
    Backend shape torch's own."""
    return "ProcessGroup" if backend_shape(env) else "ProcessGroupCupycoll"


# What a worker reports instead of the answer to a CPU call that torch's own gloo, not
# cupycoll, serves (the Backend shape with "cpu:gloo" named).
TORCHS_GLOO = "torch's gloo"


def shell_of(group):
    """cupycoll's object behind ``group``: the group itself (ProcessGroup shape), or its CUDA
    backend (Backend shape)."""
    return group if hasattr(group, "_trace") else group._get_backend(torch.device("cuda"))
