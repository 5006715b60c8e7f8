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
``CUPYCOLL_NONBLOCKING``
    ``1`` creates communicators nonblocking (``ncclCommInitRankConfig`` with
    ``blocking = 0``, through the ctypes bindings): every NCCL call returns at once and
    cupycoll polls ``ncclInProgress``, bounded by the timeout, so that even communicator
    creation can be aborted. ``0`` (default): CuPy's blocking communicator.
``CUPYCOLL_ON_TIMEOUT``
    What the watchdog does when a collective outlives the timeout or NCCL reports an
    asynchronous error. ``raise`` (default): abort the group's communicators and fail the
    affected Works, so ``wait()`` raises in the caller. ``terminate``: the same, then end the
    process (like ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``), for jobs that would rather restart.
``CUPYCOLL_WATCHDOG_INTERVAL``
    Seconds between the watchdog's polls of in-flight work (default 0.1).
``CUPYCOLL_ALGORITHM``
    ``auto`` (default): NCCL, and cupycoll's ring kernels only where NCCL cannot serve
    (bitwise ops). ``nccl``: NCCL only. ``ring``: the ring kernels for every all-reduce and
    reduce-scatter they support (fp32 accumulation for fp16/bf16, bitwise reproducible).
``CUPYCOLL_RING_SCRATCH_BYTES``
    Scratch memory the ring algorithm allocates once per communicator (default 4 MiB).

Deliberately left out: NCCL's own ``NCCL_*`` variables. They reach NCCL unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
from typing import Mapping, Optional, Union

from .errors import CupycollValueError

ENVIRONMENT = {
    "CUPYCOLL_TIMEOUT": "seconds; overrides init_process_group's timeout for cupycoll's waits",
    "CUPYCOLL_COMM_SPLIT": "1 (default): subgroups split the parent's communicator; 0: never",
    "CUPYCOLL_NCCL_LIBRARY": "path of libnccl.so.2 for the ctypes bindings (default: CuPy's)",
    "CUPYCOLL_NONBLOCKING": "1: nonblocking communicators (abortable even in init); 0 (default)",
    "CUPYCOLL_ON_TIMEOUT": "raise (default): abort and fail the Works; terminate: also exit",
    "CUPYCOLL_WATCHDOG_INTERVAL": "seconds between watchdog polls (default 0.1)",
    "CUPYCOLL_ALGORITHM": "auto (default): NCCL, ring only for bitwise ops; nccl; ring",
    "CUPYCOLL_RING_SCRATCH_BYTES": "ring scratch memory per communicator (default 4 MiB)",
}

ALGORITHMS = ("auto", "nccl", "ring")
TIMEOUT_POLICIES = ("raise", "terminate")
DEFAULT_RING_SCRATCH_BYTES = 4 << 20
DEFAULT_WATCHDOG_INTERVAL = 0.1

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


@dataclasses.dataclass
class Options:
    """Per-group options, passed as ``init_process_group(pg_options=cupycoll.Options(...))``.

    A field left at ``None`` falls back to its environment variable, then its default.

    Attributes:
        timeout: how long cupycoll waits for peers (a ``timedelta`` or seconds). ``None``:
            ``CUPYCOLL_TIMEOUT``, else the timeout given to ``init_process_group``.
        comm_split: create subgroup communicators with ``ncclCommSplit`` when possible.
        nonblocking: create nonblocking communicators (``CUPYCOLL_NONBLOCKING``).
        on_timeout: ``"raise"`` or ``"terminate"`` (``CUPYCOLL_ON_TIMEOUT``).
        watchdog_interval: seconds between watchdog polls (``CUPYCOLL_WATCHDOG_INTERVAL``).
        algorithm: ``"auto"``, ``"nccl"`` or ``"ring"`` (``CUPYCOLL_ALGORITHM``).
        ring_scratch_bytes: the ring's scratch memory per communicator.
    """

    timeout: Optional[Union[datetime.timedelta, float]] = None
    comm_split: Optional[bool] = None
    nonblocking: Optional[bool] = None
    on_timeout: Optional[str] = None
    watchdog_interval: Optional[float] = None
    algorithm: Optional[str] = None
    ring_scratch_bytes: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class Settings:
    """The resolved configuration a group runs with (no ``None`` left)."""

    timeout: datetime.timedelta
    comm_split: bool
    nccl_library: Optional[str]
    nonblocking: bool = False
    on_timeout: str = "raise"
    watchdog_interval: float = DEFAULT_WATCHDOG_INTERVAL
    algorithm: str = "auto"
    ring_scratch_bytes: int = DEFAULT_RING_SCRATCH_BYTES


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


def _choice(name: str, value, choices) -> str:
    text = str(value).strip().lower()
    if text not in choices:
        raise CupycollValueError(f"{name}={value!r}: expected one of {', '.join(choices)}")
    return text


def _positive_number(name: str, value, kind=float):
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise CupycollValueError(f"{name}={value!r}: expected a positive number") from None
    if isinstance(value, bool) or not number > 0:
        raise CupycollValueError(f"{name}={value!r}: expected a positive number")
    return number


def _pick(options: "Options", field: str, env: Mapping[str, str], variable: str, parse, default):
    explicit = getattr(options, field)
    if explicit is not None:
        return parse(f"Options.{field}", explicit)
    if env.get(variable):
        return parse(variable, env[variable])
    return default


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

    def as_bool(name, value):
        return value if isinstance(value, bool) else _parse_bool(name, str(value))

    return Settings(
        timeout=timeout,
        comm_split=comm_split,
        nccl_library=env.get("CUPYCOLL_NCCL_LIBRARY") or None,
        nonblocking=_pick(options, "nonblocking", env, "CUPYCOLL_NONBLOCKING", as_bool, False),
        on_timeout=_pick(
            options, "on_timeout", env, "CUPYCOLL_ON_TIMEOUT",
            lambda n, v: _choice(n, v, TIMEOUT_POLICIES), "raise",
        ),
        watchdog_interval=_pick(
            options, "watchdog_interval", env, "CUPYCOLL_WATCHDOG_INTERVAL",
            _positive_number, DEFAULT_WATCHDOG_INTERVAL,
        ),
        algorithm=_pick(
            options, "algorithm", env, "CUPYCOLL_ALGORITHM",
            lambda n, v: _choice(n, v, ALGORITHMS), "auto",
        ),
        ring_scratch_bytes=_pick(
            options, "ring_scratch_bytes", env, "CUPYCOLL_RING_SCRATCH_BYTES",
            lambda n, v: _positive_number(n, v, int), DEFAULT_RING_SCRATCH_BYTES,
        ),
    )


# -- per-call algorithm override ---------------------------------------------------------

# Process-wide on purpose, not per thread: DDP issues its all-reduces from autograd's
# threads, which a thread-local override around the training step would never reach.
_algorithm_override: list = []


@contextlib.contextmanager
def algorithm(name: str):
    """Run the CUDA all-reduces and reduce-scatters issued in the body with ``name``
    (``"nccl"``, ``"ring"`` or ``"auto"``), whatever the groups' ``Options.algorithm``.
    Nests; applies to every thread of the process while the body runs."""
    choice = _choice("algorithm", name, ALGORITHMS)
    _algorithm_override.append(choice)
    try:
        yield
    finally:
        _algorithm_override.pop()


def algorithm_override() -> Optional[str]:
    """The innermost :func:`algorithm` in force, or None."""
    return _algorithm_override[-1] if _algorithm_override else None
