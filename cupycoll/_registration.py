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


def _create_process_group(dist_backend_opts, pg_options):
    from .process_group import ProcessGroupCupycoll

    return ProcessGroupCupycoll(
        dist_backend_opts.store,
        dist_backend_opts.group_rank,
        dist_backend_opts.group_size,
        dist_backend_opts.timeout,
        pg_options,
        global_ranks=list(dist_backend_opts.global_ranks_in_group),
        group_id=str(dist_backend_opts.group_id),
    )


def register() -> None:
    """Register "cupycoll" for device type "cuda" (extended API); idempotent."""
    from torch.distributed import Backend

    # Imported here, not above: ``import cupycoll`` before torch imports torch from inside
    # cupycoll.config, and torch then runs this entry point while that import is under way.
    from .config import BACKEND_NAME

    if BACKEND_NAME.upper() in Backend._plugins:
        return
    Backend.register_backend(BACKEND_NAME, _create_process_group, extended_api=True, devices=["cuda"])


def autoload() -> None:
    """The ``torch.backends`` entry point. Never raises."""
    try:
        register()
    except Exception:  # noqa: BLE001 - must not break ``import torch``
        logger.debug("registration from the torch.backends entry point failed", exc_info=True)
