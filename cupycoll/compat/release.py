"""The installed torch's release, as every gate of :mod:`cupycoll.compat` compares it:
``TORCH``, ``(major, minor)``.

Left out: the gates themselves (each in the submodule of its subject), CuPy's version (asked
of the CuPy module the callers hand in: :mod:`cupycoll.compat.cupy_calls`).
"""

from __future__ import annotations

import re

import torch


def _release(version: str) -> tuple:
    """``"2.15.0+cu132"`` -> ``(2, 15)``."""
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


TORCH = _release(torch.__version__)
