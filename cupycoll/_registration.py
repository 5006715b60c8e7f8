"""Registration of the "cupycoll" backend name with torch.distributed.

Two ways in: ``import cupycoll`` calls :func:`register`, and torch's ``torch.backends``
entry point calls :func:`autoload` while ``import torch`` runs, so that
``init_process_group("cuda:cupycoll")`` works with no explicit import. The entry point must
be cheap and must never raise (an exception there breaks ``import torch``): it imports
neither CuPy nor the process-group module (``cupycoll/__init__.py`` imports that lazily,
and the creator below on first use).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)  # a child of "cupycoll"


def group_shape() -> str:
    """The shape a group made now takes (``CUPYCOLL_SHAPE``, :func:`cupycoll.config.shape`):
    ``"process_group"`` by default, ``"backend"`` on request, refused before torch 2.14."""
    import torch

    from . import compat, config
    from .errors import CupycollValueError

    shape = config.shape(compat.BACKEND_SHAPE_BY_DEFAULT)
    if shape == "backend" and not compat.PY_BACKEND:
        raise CupycollValueError(
            f"CUPYCOLL_SHAPE=backend needs torch 2.14 or later (its PyBackend trampoline); "
            f"this is torch {torch.__version__}")
    return shape


def _create(dist_backend_opts, pg_options):
    """torch's creator call. The group's shape (:func:`group_shape`): by default the whole
    ProcessGroup (:mod:`cupycoll.process_group`), on torch 2.14+ on request a c10d Backend
    in the ProcessGroup torch builds (:mod:`cupycoll.py_backend`). Decided here, not at
    registration, which runs inside ``import torch`` and must not import cupycoll.compat."""
    from .shrink import SurvivorsWorld

    if isinstance(pg_options, SurvivorsWorld):  # a shrink of the default group built it already
        return pg_options.take(dist_backend_opts.group_rank, dist_backend_opts.group_size)
    if group_shape() == "backend":
        from .py_backend import create

        return create(dist_backend_opts, pg_options)
    from .process_group import ProcessGroupCupycoll
    from .shell import group_arguments

    args, kwargs = group_arguments(dist_backend_opts, pg_options)
    return ProcessGroupCupycoll(*args, **kwargs)


def register() -> None:
    """Register "cupycoll" for device type "cuda" (extended API); idempotent."""
    from torch.distributed import Backend

    # Imported here, not above: ``import cupycoll`` before torch imports torch from inside
    # cupycoll.config, and torch then runs this entry point while that import is under way.
    from .config import BACKEND_NAME

    if BACKEND_NAME.upper() in Backend._plugins:
        return
    Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cuda"])


def autoload() -> None:
    """The ``torch.backends`` entry point. Never raises."""
    try:
        register()
    except Exception:  # noqa: BLE001 - must not break ``import torch``
        logger.debug("registration from the torch.backends entry point failed", exc_info=True)
