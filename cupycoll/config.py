"""Configuration: ``cupycoll.Options``, the environment variables cupycoll reads, defaults.

Precedence, highest first:

1. a field set on the :class:`Options` passed as
   ``init_process_group(..., pg_options=cupycoll.Options(...))``; for the timeout, also the
   ``timeout`` given to ``init_process_group`` / ``new_group`` (an explicit argument);
2. the ``CUPYCOLL_*`` environment variable;
3. the ``TORCH_NCCL_*`` variable torch's nccl backend reads for the same setting, so a job
   configured for ``"nccl"`` behaves the same on ``"cupycoll"``;
4. the default (for the timeout: :data:`DEFAULT_TIMEOUT`, 10 minutes, as torch's nccl).

torch always hands a backend a timeout, its default when the caller gave none (30 minutes,
``default_pg_timeout``, for every backend but its own nccl); cupycoll treats a timeout
equal to torch's default as "not given", so ``CUPYCOLL_TIMEOUT`` or the 10-minute default
applies then. (An explicit ``timeout=timedelta(minutes=30)`` reads as not given: use
``Options(timeout=...)`` to ask for exactly that.) Timeouts are bounded to one year and
the watchdog interval to 60 s; ``inf`` is rejected, naming the value.

Every variable that configures cupycoll is read here, only here, and listed in
:data:`ENVIRONMENT` (the table in docs/usage.md is checked against it):

``CUPYCOLL_TIMEOUT``
    Seconds cupycoll waits for peers and the GPU (watchdog, communicator creation) when
    neither ``Options(timeout=...)`` nor ``init_process_group(timeout=...)`` says.
``CUPYCOLL_COMM_SPLIT``
    ``1`` (default) creates subgroup communicators with ``ncclCommSplit`` from the
    parent's communicator when the parent was bound to a device (``device_id``); ``0``
    always exchanges a fresh unique id.
``CUPYCOLL_NCCL_LIBRARY``
    Path of the ``libnccl.so.2`` to bind with ctypes. By default cupycoll binds the library
    CuPy already loaded, so that CuPy, torch and cupycoll share one NCCL. Trusted as code:
    the library runs in the process, so it must come from whoever controls the job's
    environment.
``CUPYCOLL_SHAPE``
    How torch holds a new group: ``process_group`` (default on every release), a cupycoll
    ProcessGroup that is the whole group and routes CPU tensors to its own gloo; ``backend``
    (torch 2.14+), cupycoll's c10d Backend inside the ProcessGroup torch builds, whose Works
    reach the caller inside torch's holder (its ``is_completed``, ``is_success``,
    ``exception`` and ``result`` do not tell the truth: :data:`cupycoll.compat.BACKEND_SHAPE_BY_DEFAULT`).
    Read at each group's creation.
``CUPYCOLL_NONBLOCKING`` (``TORCH_NCCL_USE_COMM_NONBLOCKING``)
    ``1`` creates communicators nonblocking (``ncclCommInitRankConfig`` with
    ``blocking = 0``): cupycoll polls ``ncclInProgress``, bounded by the timeout, so even
    communicator creation can be aborted. ``0`` (default): ``blocking = 1``.
``CUPYCOLL_BLOCKING_WAIT`` (``TORCH_NCCL_BLOCKING_WAIT``)
    ``1``: ``Work.wait()`` blocks the CPU until the collective is done (or the watchdog
    fails it); ``0`` (default): it only makes the current stream wait.
``CUPYCOLL_ON_TIMEOUT`` (``TORCH_NCCL_ASYNC_ERROR_HANDLING``)
    What the watchdog does when a collective outlives the timeout or NCCL reports an
    asynchronous error. ``raise`` (default): abort the group's communicators and fail the
    affected Works, so ``wait()`` raises in the caller. ``terminate``: the same, then end the
    process. torch's ``1`` (tear down) and ``3`` (skip clean-up) read as ``terminate``;
    ``0`` and ``2`` (clean up only) as ``raise``.
``CUPYCOLL_WATCHDOG_INTERVAL``
    Seconds between the watchdog's polls of in-flight work (default 0.1, at most 60).
``CUPYCOLL_WATCH_CALLS``
    ``1`` (default): every issued call is watched (a pooled completion event, its timeout).
    ``0``: none is; a hung collective then hangs the job. For measuring the watchdog's
    cost (``bench/fault_bench.py``), never for training.
``CUPYCOLL_ALGORITHM``
    ``auto`` (default): NCCL, and cupycoll's ring kernels only where NCCL cannot serve
    (bitwise ops). ``nccl``: NCCL only. ``ring``: the ring kernels wherever they apply.
``CUPYCOLL_RING_SCRATCH_BYTES``
    The most scratch memory the ring algorithm holds per communicator (default 1 GiB). The
    scratch grows on demand to what a call needs, about one chunk of partials: a quarter of
    an fp32 message at 8 ranks, half of it at 2, twice a bf16 one at 2; a call that would
    need more runs more rounds of the largest slices that fit. The same on every rank.

``CUPYCOLL_TRACE_BUFFER`` (``TORCH_NCCL_TRACE_BUFFER_SIZE``)
    Entries the flight recorder keeps per group (default 2000, at most 1,000,000: about
    0.3 GB a group); ``0`` keeps none (the sequence numbers that timeout reports use are
    still counted).
``CUPYCOLL_TRACE_DIR`` (``TORCH_NCCL_DUMP_ON_TIMEOUT``)
    Folder where every rank writes its flight recorder as JSON when a collective times out
    (read them with ``python -m cupycoll.trace DIR``). Unset: no dump, unless torch's
    ``TORCH_NCCL_DUMP_ON_TIMEOUT=1`` asks for one, then into the folder of
    ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` (default ``/tmp``).
``CUPYCOLL_PUBLISH_FAULTS``
    ``1`` (default): a rank that finds a fault in a group (a timeout, a dead peer, an NCCL
    error) publishes it through the group's store once it is explained, and every other
    rank of the group fails its pending Works at once with the same error, naming the rank
    behind, instead of waiting out its own timeout (within ``bounds.PUBLISH_WAIT_S`` of the
    publication; their listeners wait for it, served by the store). ``0``: each rank finds
    its faults alone, and ignores its peers'.
``TORCH_GLOO_LAZY_INIT``
    torch's own (torch 2.8+), read by torch's gloo when each group's CPU half is made: ``1``
    (``true``, ``yes``, ``y``), its pairs connect on first use instead of all at creation.
    cupycoll then counts every rank in at the creation, so that a rank that never comes is
    still named there; a collective a peer never makes can take up to five timeouts to fail
    on the rank that listens for that pair (gloo's own connect wait). Unset (default): every
    pair connects at creation, as torch's gloo does.
``TORCHELASTIC_ERROR_FILE``
    Set by torchrun for each rank: a process that ends with exit status 70 after a fault
    writes the fault there first, in torch.distributed.elastic's error-file format, so that
    torchrun's summary names it.
``CUPYCOLL_CHECK_COLLECTIVES`` (``TORCH_DISTRIBUTED_DEBUG=DETAIL``)
    ``1``: before each collective the ranks compare op, shapes, dtypes and root over the
    group's gloo half, and a mismatch raises on every rank instead of hanging. ``0``
    (default): no check (it costs a CPU round trip per call).
``CUPYCOLL_LOG_LEVEL``
    ``debug``, ``info``, ``warning``, ``error`` or ``critical``: the level of the
    ``cupycoll`` logger and its children, as ``TORCH_CPP_LOG_LEVEL`` sets torch's. Where no
    logging is configured (the root logger has no handler), one stderr handler is added to
    the ``cupycoll`` logger, so that ``info`` shows the line each group logs when it is
    created (:func:`cupycoll.logs.log_group`). Unset (default): the loggers are left as they
    are, and Python prints WARNING and above. Read at each group's creation.

Deliberately left out: the per-type parsers (:mod:`cupycoll._parsers`; an algorithm's name,
:mod:`cupycoll.algorithms`; they read nothing), the loggers' handler and a group's line
(:mod:`cupycoll.logs`), the per-call algorithm (:func:`cupycoll.algorithms.algorithm`), NCCL's
own ``NCCL_*`` variables (they reach NCCL unchanged), and torch's flight-recorder format:
``torch.distributed.flight_recorder``'s analyzer cannot read cupycoll's dumps
(``python -m cupycoll.trace`` can).
"""

from __future__ import annotations

# The name torch.distributed knows the backend by. Set before any import: importing torch
# (through .errors) runs cupycoll's torch.backends entry point, which reads it while this
# module is still being imported.
BACKEND_NAME = "cupycoll"

import dataclasses  # noqa: E402 - after BACKEND_NAME, see above
import datetime
import difflib
import logging
import os
from typing import Callable, Mapping, Optional, Union

# The bounds are re-exported: cupycoll.config.MAX_TIMEOUT_SECONDS is where users look.
from ._parsers import (MAX_TIMEOUT_SECONDS, MAX_WATCHDOG_INTERVAL, parse_bool,  # noqa: F401
                       parse_choice, parse_directory, parse_interval, parse_positive_int,
                       parse_seconds, parse_trace_buffer, torch_debug_detail, torch_error_handling)
from . import algorithms, logs
from .errors import CupycollTypeError, CupycollValueError  # noqa: F401 - re-exported

logger = logging.getLogger(__name__)  # a child of "cupycoll"

ENVIRONMENT = {
    "CUPYCOLL_TIMEOUT": "seconds; used when neither Options nor init_process_group gives a timeout",
    "CUPYCOLL_COMM_SPLIT": "1 (default): subgroups split the parent's communicator; 0: never",
    "CUPYCOLL_NCCL_LIBRARY": "path of libnccl.so.2 for the ctypes bindings (default: CuPy's)",
    "CUPYCOLL_SHAPE": "process_group (default): a cupycoll ProcessGroup; backend (torch 2.14+): "
                      "cupycoll's c10d Backend in the ProcessGroup torch builds (its Works: wait "
                      "and get_future only)",
    "CUPYCOLL_NONBLOCKING": "1: nonblocking communicators (abortable even in init); 0 (default)",
    "CUPYCOLL_BLOCKING_WAIT": "1: Work.wait() blocks the CPU until done; 0 (default): stream wait",
    "CUPYCOLL_ON_TIMEOUT": "raise (default): abort and fail the Works; terminate: also exit",
    "CUPYCOLL_WATCHDOG_INTERVAL": "seconds between watchdog polls (default 0.1; from 0.001 to 60)",
    "CUPYCOLL_WATCH_CALLS": "1 (default): every issued call is watched; 0: none is (to measure the "
                            "watchdog's cost; never for training)",
    "CUPYCOLL_ALGORITHM": "auto (default): NCCL, ring only for bitwise ops; nccl; ring",
    "CUPYCOLL_RING_SCRATCH_BYTES": "most ring scratch memory per communicator, grown on demand (default 1 GiB)",
    "CUPYCOLL_TRACE_BUFFER": "flight-recorder entries per group (default 2000, at most 1000000; 0: none)",
    "CUPYCOLL_TRACE_DIR": "folder for per-rank flight-recorder dumps on timeout (default: none)",
    "CUPYCOLL_PUBLISH_FAULTS": "1 (default): a fault one rank finds fails every rank's pending Works "
                               "at once, through the store; 0: each rank finds its own",
    "TORCH_GLOO_LAZY_INIT": "torch's (2.8+): 1, the CPU half's gloo connects each pair on first use "
                            "(the creation still counts every rank in); unset (default): all at creation",
    "TORCHELASTIC_ERROR_FILE": "set by torchrun: an exit 70 after a fault writes the fault there",
    "CUPYCOLL_CHECK_COLLECTIVES": "1: ranks compare op/shapes/dtypes/root before each call; 0 (default)",
    "CUPYCOLL_LOG_LEVEL": "debug, info, warning, error or critical: the cupycoll loggers' level "
                          "(info: one line per group created); unset (default): left as it is",
    "TORCH_NCCL_USE_COMM_NONBLOCKING": "as CUPYCOLL_NONBLOCKING, when that is not set",
    "TORCH_NCCL_BLOCKING_WAIT": "as CUPYCOLL_BLOCKING_WAIT, when that is not set",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1 or 3: CUPYCOLL_ON_TIMEOUT=terminate; 0 or 2: raise",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "as CUPYCOLL_TRACE_BUFFER, when that is not set",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1: dump as CUPYCOLL_TRACE_DIR does, into the folder of "
                                  "TORCH_NCCL_DEBUG_INFO_TEMP_FILE (default /tmp), when that is not set",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "with TORCH_NCCL_DUMP_ON_TIMEOUT=1: its folder receives the dumps",
    "TORCH_DISTRIBUTED_DEBUG": "DETAIL: as CUPYCOLL_CHECK_COLLECTIVES=1, when that is not set",
}

TIMEOUT_POLICIES = ("raise", "terminate")
DEFAULT_RING_SCRATCH_BYTES = 1 << 30
DEFAULT_WATCHDOG_INTERVAL = 0.1
DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)
DEFAULT_TRACE_BUFFER = 2000


@dataclasses.dataclass(frozen=True)
class _Field:
    parse: Callable
    default: object
    env: str
    torch_env: Optional[str] = None
    torch_parse: Optional[Callable] = None


# Everything but the timeout (whose precedence involves torch's argument), the trace folder
# (two torch variables) and the library path (environment only) is resolved by the same loop over this table.
_FIELDS = {
    "comm_split": _Field(parse_bool, True, "CUPYCOLL_COMM_SPLIT"),
    "nonblocking": _Field(parse_bool, False, "CUPYCOLL_NONBLOCKING",
                          "TORCH_NCCL_USE_COMM_NONBLOCKING", parse_bool),
    "blocking_wait": _Field(parse_bool, False, "CUPYCOLL_BLOCKING_WAIT",
                            "TORCH_NCCL_BLOCKING_WAIT", parse_bool),
    "on_timeout": _Field(parse_choice(TIMEOUT_POLICIES), "raise", "CUPYCOLL_ON_TIMEOUT",
                         "TORCH_NCCL_ASYNC_ERROR_HANDLING", torch_error_handling),
    "watchdog_interval": _Field(parse_interval, DEFAULT_WATCHDOG_INTERVAL,
                                "CUPYCOLL_WATCHDOG_INTERVAL"),
    "watch_calls": _Field(parse_bool, True, "CUPYCOLL_WATCH_CALLS"),
    "algorithm": _Field(algorithms.parse_name, "auto", "CUPYCOLL_ALGORITHM"),
    "ring_scratch_bytes": _Field(parse_positive_int, DEFAULT_RING_SCRATCH_BYTES,
                                 "CUPYCOLL_RING_SCRATCH_BYTES"),
    "trace_buffer": _Field(parse_trace_buffer, DEFAULT_TRACE_BUFFER, "CUPYCOLL_TRACE_BUFFER",
                           "TORCH_NCCL_TRACE_BUFFER_SIZE", parse_trace_buffer),
    "publish_faults": _Field(parse_bool, True, "CUPYCOLL_PUBLISH_FAULTS"),
    "check_collectives": _Field(parse_bool, False, "CUPYCOLL_CHECK_COLLECTIVES",
                                "TORCH_DISTRIBUTED_DEBUG", torch_debug_detail),
}
_TIMEOUT_ENV = "CUPYCOLL_TIMEOUT"
_LIBRARY_ENV = "CUPYCOLL_NCCL_LIBRARY"
_SHAPE_ENV = "CUPYCOLL_SHAPE"
SHAPES = ("process_group", "backend")
_TRACE_DIR_ENV, _TORCH_DUMP_ENV, _TORCH_DUMP_FILE_ENV = (
    "CUPYCOLL_TRACE_DIR", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
_LOG_LEVEL_ENV = "CUPYCOLL_LOG_LEVEL"
_ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
_GLOO_LAZY_ENV = "TORCH_GLOO_LAZY_INIT"


@dataclasses.dataclass
class Options:
    """Per-group options, passed as ``init_process_group(pg_options=cupycoll.Options(...))``.

    Every field is checked (and normalized: ``"0"`` becomes False, seconds a ``timedelta``)
    when the object is built; a bad value raises :class:`~cupycoll.CupycollValueError` or
    :class:`~cupycoll.CupycollTypeError` naming it. A field left at ``None`` falls back to
    its ``CUPYCOLL_*`` variable, then torch's ``TORCH_NCCL_*`` one, then the default.

    Attributes:
        timeout: how long cupycoll waits for peers and the GPU (a ``timedelta`` or seconds).
            ``None``: ``init_process_group``'s timeout if given, else ``CUPYCOLL_TIMEOUT``.
        comm_split: create subgroup communicators with ``ncclCommSplit`` when possible.
        nonblocking: create nonblocking communicators.
        blocking_wait: ``Work.wait()`` blocks the CPU until the collective is done.
        on_timeout: ``"raise"`` or ``"terminate"``.
        watchdog_interval: seconds between watchdog polls.
        watch_calls: put every issued call in flight in the watchdog's watch (default True).
            False: no completion event per call and no timeout of a collective (a call
            stuck inside NCCL and NCCL's asynchronous errors are still found): what the
            benchmark's fault part compares against, to measure what watching costs. Never
            for training: a hung collective then hangs the job.
        algorithm: ``"auto"``, ``"nccl"``, ``"ring"`` or a registered algorithm's name
            (:mod:`cupycoll.algorithms`).
        ring_scratch_bytes: the most scratch memory the ring holds per communicator.
        trace_buffer: flight-recorder entries kept per group (0: none).
        trace_dir: folder for the per-rank flight-recorder dumps written on a timeout.
        check_collectives: compare every collective's arguments across ranks first.
        publish_faults: a fault this rank finds reaches the group's other ranks through the
            store, and theirs reach it (default True; see CUPYCOLL_PUBLISH_FAULTS).
    """

    timeout: Optional[Union[datetime.timedelta, float]] = None
    comm_split: Optional[bool] = None
    nonblocking: Optional[bool] = None
    blocking_wait: Optional[bool] = None
    on_timeout: Optional[str] = None
    watchdog_interval: Optional[float] = None
    watch_calls: Optional[bool] = None
    algorithm: Optional[str] = None
    ring_scratch_bytes: Optional[int] = None
    trace_buffer: Optional[int] = None
    trace_dir: Optional[str] = None
    check_collectives: Optional[bool] = None
    publish_faults: Optional[bool] = None

    def __post_init__(self):
        if self.timeout is not None:
            self.timeout = parse_seconds("Options.timeout", self.timeout)
        if self.trace_dir is not None:
            self.trace_dir = parse_directory("Options.trace_dir", self.trace_dir)
        for name, field in _FIELDS.items():
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, field.parse(f"Options.{name}", value))


@dataclasses.dataclass(frozen=True)
class Settings:
    """The resolved configuration a group runs with (no ``None`` left)."""

    timeout: datetime.timedelta
    comm_split: bool
    nccl_library: Optional[str]
    nonblocking: bool = False
    blocking_wait: bool = False
    on_timeout: str = "raise"
    watchdog_interval: float = DEFAULT_WATCHDOG_INTERVAL
    watch_calls: bool = True
    algorithm: str = "auto"
    ring_scratch_bytes: int = DEFAULT_RING_SCRATCH_BYTES
    trace_buffer: int = DEFAULT_TRACE_BUFFER
    trace_dir: Optional[str] = None
    check_collectives: bool = False
    publish_faults: bool = True

    def as_options(self) -> "Options":
        """These settings as Options, every field set (the library path aside, which only the
        environment sets): what a group made from this one (a split) runs with."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(Options)}
        return Options(**fields)


def torch_default_timeouts() -> tuple:
    """The timeouts torch passes a backend when the caller gave none: default_pg_timeout
    (30 min) for every backend but torch's own nccl (torch 2.7.1 to 2.15). Not
    default_pg_nccl_timeout (10 min on CUDA builds): cupycoll never receives it, so an
    explicit 10 minutes must count as given."""
    try:
        from torch.distributed import constants
    except ImportError:  # pragma: no cover - torch without distributed support
        return ()
    return (constants.default_pg_timeout,)


def _timeout(options: Options, group_timeout, env: Mapping[str, str]) -> datetime.timedelta:
    if options.timeout is not None:
        return parse_seconds("Options.timeout", options.timeout)
    # torch hands every non-nccl backend its default_pg_timeout (30 min) when the caller
    # gave none: that counts as "not given", so the default is cupycoll's (10 min, as
    # torch's nccl). The price: an explicit timeout equal to torch's default reads as unset
    # (Options(timeout=...) or CUPYCOLL_TIMEOUT say it unambiguously).
    given = None if group_timeout is None else parse_seconds("timeout", group_timeout)
    if given is not None and given not in torch_default_timeouts():
        return given
    if env.get(_TIMEOUT_ENV):
        return parse_seconds(_TIMEOUT_ENV, env[_TIMEOUT_ENV])
    return DEFAULT_TIMEOUT


def _trace_dir(options: Options, env: Mapping[str, str]) -> Optional[str]:
    if options.trace_dir is not None:
        return options.trace_dir
    if env.get(_TRACE_DIR_ENV):
        return parse_directory(_TRACE_DIR_ENV, env[_TRACE_DIR_ENV])
    if env.get(_TORCH_DUMP_ENV) and parse_bool(_TORCH_DUMP_ENV, env[_TORCH_DUMP_ENV]):
        # torch writes <TORCH_NCCL_DEBUG_INFO_TEMP_FILE><rank>; cupycoll, one file per rank there
        return os.path.dirname(env.get(_TORCH_DUMP_FILE_ENV, "/tmp/nccl_trace_rank_")) or "."
    return None


def resolve(
    options: Optional[Options],
    group_timeout: Optional[datetime.timedelta] = None,
    environ: Optional[Mapping[str, str]] = None,
) -> Settings:
    """Combine explicit options, the environment and defaults into :class:`Settings`.

    ``group_timeout`` is the timeout torch handed the backend (``init_process_group``'s or
    ``new_group``'s, or torch's default)."""
    if options is not None and not isinstance(options, Options):
        raise CupycollValueError(
            f"pg_options={options!r}: cupycoll expects a cupycoll.Options instance"
        )
    env = os.environ if environ is None else environ
    if env.get(_LOG_LEVEL_ENV):  # first: the level applies to the warnings below too
        logs.set_level(parse_choice(logs.LEVELS)(_LOG_LEVEL_ENV, env[_LOG_LEVEL_ENV]))
    warn_unread(env)
    options = options or Options()
    values = {}
    for name, field in _FIELDS.items():
        explicit = getattr(options, name)
        if explicit is not None:
            values[name] = field.parse(f"Options.{name}", explicit)
        elif env.get(field.env):
            values[name] = field.parse(field.env, env[field.env])
        elif field.torch_env and env.get(field.torch_env):
            values[name] = field.torch_parse(field.torch_env, env[field.torch_env])
        else:
            values[name] = field.default
    return Settings(timeout=_timeout(options, group_timeout, env),
                    nccl_library=env.get(_LIBRARY_ENV) or None,
                    trace_dir=_trace_dir(options, env), **values)


def elastic_error_file(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Where torchrun wants this rank's error written (``TORCHELASTIC_ERROR_FILE``), or None.
    Read when the process ends after a fault, not at a group's creation: torchrun sets it
    before the process starts, and a test may set it later."""
    return (os.environ if env is None else env).get(_ERROR_FILE_ENV) or None


def gloo_lazy_init(env: Optional[Mapping[str, str]] = None) -> bool:
    """Does torch's gloo connect lazily (``TORCH_GLOO_LAZY_INIT`` as torch reads it: ``1``,
    ``true``, ``yes`` or ``y``, any case)? Read when each group's CPU half is made, as torch
    reads it; a value torch refuses is torch's error, raised by its gloo."""
    value = (os.environ if env is None else env).get(_GLOO_LAZY_ENV, "")
    return value.lower() in ("1", "true", "yes", "y")


_WARNED: set = set()  # the names warn_unread has already named in this process


def warn_unread(env: Mapping[str, str]) -> None:
    """Warn, once per process and name, of a setting cupycoll does not read: a ``CUPYCOLL_``
    name close to one it reads (a misspelling: ``CUPYCOLL_TIMOUT``), naming that one, and a
    ``TORCH_NCCL_`` name that only torch's own nccl backend reads. Other ``CUPYCOLL_`` names
    (the benchmark's ``CUPYCOLL_BENCH_*``, a test's) are left alone."""
    for name in env:
        if name in ENVIRONMENT or name in _WARNED:
            continue
        if name.startswith("CUPYCOLL_"):
            close = difflib.get_close_matches(name, [n for n in ENVIRONMENT if n.startswith("CUPYCOLL_")],
                                              n=1, cutoff=0.85)
            if not close:
                continue
            message = f"{name} is set, but cupycoll reads no such variable: did you mean {close[0]}?"
        elif name.startswith("TORCH_NCCL_"):
            read = ", ".join(n for n in ENVIRONMENT if n.startswith("TORCH_NCCL_"))
            message = (f"{name} is set; it applies to torch's nccl backend only, cupycoll does not read "
                       f"it (of torch's NCCL settings cupycoll reads {read})")
        else:
            continue
        _WARNED.add(name)
        logger.warning(message)


def shape(backend_by_default: bool, env: Mapping[str, str] = os.environ) -> str:
    """The shape new groups take (``CUPYCOLL_SHAPE``; process-wide, read at each group's
    creation): ``"process_group"``, a cupycoll ProcessGroup that is the whole group, or
    ``"backend"``, cupycoll's c10d Backend inside the ProcessGroup torch builds (torch
    2.14+). The default is the Backend shape only where ``backend_by_default``
    (:data:`cupycoll.compat.BACKEND_SHAPE_BY_DEFAULT`: where its Works would tell the truth,
    no release yet), else the ProcessGroup shape (docs/usage.md, "Two shapes")."""
    default = "backend" if backend_by_default else "process_group"
    return parse_choice(SHAPES)(_SHAPE_ENV, env.get(_SHAPE_ENV) or default)
