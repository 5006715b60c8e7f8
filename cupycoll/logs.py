"""What cupycoll's loggers show and the line each group logs: the level of the ``cupycoll``
logger and its children (:func:`set_level`, which gives it one stderr handler where no
logging is configured), and :func:`log_group`, the INFO line that says how a group just
created runs.

Deliberately left out: which level the job asks for (``CUPYCOLL_LOG_LEVEL``, read by
:mod:`cupycoll.config` with every other variable, as are the warnings of settings cupycoll
does not read), and what each module logs on its own logger.
"""

from __future__ import annotations

import logging

# The logger every cupycoll logger is a child of: "cupycoll", the backend's name.
_PACKAGE = __name__.partition(".")[0]

#: The levels ``CUPYCOLL_LOG_LEVEL`` takes, as logging names them in lower case.
LEVELS = ("debug", "info", "warning", "error", "critical")

# The stderr handler set_level added to the "cupycoll" logger (at most one per process).
_HANDLER: list = []


def set_level(level: str) -> None:
    """Set the ``cupycoll`` logger's level (one of :data:`LEVELS`); where no logging is
    configured (no handler on the root logger), also give it one stderr handler, so that
    INFO lines show (Python's last-resort output prints WARNING and above only)."""
    package = logging.getLogger(_PACKAGE)
    package.setLevel(level.upper())
    if not _HANDLER and not logging.getLogger().handlers and not package.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        package.addHandler(handler)
        _HANDLER.append(handler)


def log_group(group: str, rank: int, size: int, shape: str, settings) -> str:
    """Log (INFO, on the ``cupycoll`` logger) and return the line that says how a group just
    created runs with ``settings`` (its :class:`~cupycoll.config.Settings`): its shape,
    timeout, routes and fault policy."""
    communicators = "nonblocking" if settings.nonblocking else "blocking"
    message = (f"process group {group!r}: rank {rank} of {size}, {shape} shape, timeout "
               f"{settings.timeout.total_seconds():g} s; CUDA tensors to NCCL ({communicators} "
               f"communicators, algorithm {settings.algorithm}), CPU tensors to gloo; a timeout or "
               f"NCCL error aborts the group and "
               f"{'ends the process' if settings.on_timeout == 'terminate' else 'raises'}"
               + (", collectives checked across ranks" if settings.check_collectives else ""))
    logging.getLogger(_PACKAGE).info(message)
    return message
