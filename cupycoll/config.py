"""Configuration: ``cupycoll.Options``, the ``CUPYCOLL_*`` environment variables, defaults.

Precedence, highest first: a field set explicitly on the :class:`Options` passed as
``init_process_group(..., pg_options=cupycoll.Options(...))``; then the environment
variable; then the default. Every environment variable cupycoll reads is read here and
listed in :data:`ENVIRONMENT`, which the README reproduces.

Environment variables:

``CUPYCOLL_TIMEOUT``
    Seconds. Overrides the timeout given to ``init_process_group`` for cupycoll's own
    waits (the unique-id exchange through the store when a communicator is created).
``CUPYCOLL_COMM_SPLIT``
    ``1`` (default) creates subgroup communicators with ``ncclCommSplit`` from the
    parent's communicator when the parent was bound to a device (``device_id``) and CuPy
    offers ``commSplit``; ``0`` always exchanges a fresh unique id.
``CUPYCOLL_NCCL_LIBRARY``
    Path of the ``libnccl.so.2`` to bind with ctypes. By default cupycoll binds the library
    CuPy already loaded, so that CuPy, torch and cupycoll share one NCCL.

Deliberately left out: NCCL's own ``NCCL_*`` variables. They reach NCCL unchanged.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from typing import Mapping, Optional

from .errors import CupycollValueError

ENVIRONMENT = {
    "CUPYCOLL_TIMEOUT": "seconds; overrides init_process_group's timeout for cupycoll's waits",
    "CUPYCOLL_COMM_SPLIT": "1 (default): subgroups split the parent's communicator; 0: never",
    "CUPYCOLL_NCCL_LIBRARY": "path of libnccl.so.2 for the ctypes bindings (default: CuPy's)",
}

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


@dataclasses.dataclass
class Options:
    """Per-group options, passed as ``init_process_group(pg_options=cupycoll.Options(...))``.

    A field left at ``None`` falls back to its environment variable, then its default.

    Attributes:
        timeout: how long cupycoll waits for peers (a ``timedelta`` or seconds). ``None``:
            ``CUPYCOLL_TIMEOUT``, else the timeout given to ``init_process_group``.
        comm_split: create subgroup communicators with ``ncclCommSplit`` when possible.
    """

    timeout: Optional[datetime.timedelta | float] = None
    comm_split: Optional[bool] = None


@dataclasses.dataclass(frozen=True)
class Settings:
    """The resolved configuration a group runs with (no ``None`` left)."""

    timeout: datetime.timedelta
    comm_split: bool
    nccl_library: Optional[str]


def _parse_bool(name: str, text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise CupycollValueError(f"{name}={text!r}: expected 0 or 1")


def _as_timedelta(name: str, value) -> datetime.timedelta:
    if isinstance(value, datetime.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str):
        try:
            seconds = float(value)
        except ValueError:
            raise CupycollValueError(f"{name}={value!r}: expected a number of seconds") from None
    else:
        raise CupycollValueError(f"{name}={value!r}: expected a timedelta or seconds")
    if not seconds > 0:
        raise CupycollValueError(f"{name}={value!r}: the timeout must be positive")
    return datetime.timedelta(seconds=seconds)


def resolve(
    options: Optional[Options],
    group_timeout: Optional[datetime.timedelta] = None,
    environ: Optional[Mapping[str, str]] = None,
) -> Settings:
    """Combine explicit options, the environment and defaults into :class:`Settings`."""
    if options is not None and not isinstance(options, Options):
        raise CupycollValueError(
            f"pg_options={options!r}: cupycoll expects a cupycoll.Options instance"
        )
    env = os.environ if environ is None else environ
    options = options or Options()

    if options.timeout is not None:
        timeout = _as_timedelta("Options.timeout", options.timeout)
    elif env.get("CUPYCOLL_TIMEOUT"):
        timeout = _as_timedelta("CUPYCOLL_TIMEOUT", env["CUPYCOLL_TIMEOUT"])
    elif group_timeout is not None:
        timeout = _as_timedelta("timeout", group_timeout)
    else:
        timeout = DEFAULT_TIMEOUT

    if options.comm_split is not None:
        comm_split = bool(options.comm_split)
    elif env.get("CUPYCOLL_COMM_SPLIT"):
        comm_split = _parse_bool("CUPYCOLL_COMM_SPLIT", env["CUPYCOLL_COMM_SPLIT"])
    else:
        comm_split = True

    return Settings(
        timeout=timeout,
        comm_split=comm_split,
        nccl_library=env.get("CUPYCOLL_NCCL_LIBRARY") or None,
    )
