"""The reduction algorithms besides NCCL's own, behind one seam.

Each is an :class:`Algorithm`: which (dtype, op) pairs it runs, which ops it takes over under
``auto`` (ops NCCL lacks), and the runner it makes for a communicator (with the group's store,
under a prefix of the algorithm's own, where it asks for one: ``needs_store``). A runner's
``prepare(method, count, dtype, op)`` does the fallible Python steps (scratch memory,
kernels) before any NCCL group opens; its ``all_reduce`` and ``reduce_scatter(sendbuf,
recvbuf, count, dtype, op, stream, premul=None, premul_ptr=None)`` launch on ``stream``
with NCCL groups of their own (so never inside another NCCL group); ``close()`` frees what it
holds once the communicator's kernels ended. dtypes and ops go by name: ``"bfloat16"``,
``"band"``.

The choice is made once per call, in :func:`cupycoll._args.reduction_plan`: by name
(``Options.algorithm``, ``CUPYCOLL_ALGORITHM``, each checked by :func:`parse_name`, or
:func:`algorithm`, the per-call override that beats them, process-wide), by ``auto`` for an op
NCCL lacks, or ``nccl``. The backend keeps one runner per algorithm and communicator.

Adding an algorithm: a module that defines ``ALGORITHM = Algorithm(...)`` and its entry in
:data:`BUILT_IN` (cupycoll's own, loaded on first use), or :func:`register` (anyone's, before
a group is built with its name). An algorithm with CUDA kernels of its own compiles them as
the ring does, through :mod:`cupycoll.kernels`.

Deliberately left out: algorithms for other collectives, choosing by message size (NCCL
tunes its own), and where the option comes from (:mod:`cupycoll.config`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from typing import Callable, Dict, FrozenSet, Optional, Tuple

from ._parsers import parse_choice
from .errors import CupycollValueError

# The names that are not an Algorithm: NCCL's own, and NCCL with the algorithms taking over
# the ops it lacks.
NCCL, AUTO = "nccl", "auto"

# cupycoll's own algorithms: name -> the module that defines ALGORITHM (imported on first use;
# the ring's imports CuPy only when a runner is made).
BUILT_IN: Dict[str, str] = {"ring": "cupycoll.ring"}


@dataclasses.dataclass(frozen=True)
class Algorithm:
    name: str
    # check(dtype, op): raises CupycollValueError naming a pair it cannot run
    check: Callable[[str, str], None]
    # the ops ``auto`` sends here (NCCL has none of them)
    takes_over: FrozenSet[str]
    # make_runner(communicator, settings): the object that runs its calls on that communicator;
    # make_runner(communicator, settings, store) where needs_store is set
    make_runner: Callable[..., object]
    # Whether its runner is handed a store (torch's Store API) shared by the communicator's
    # ranks, for what they agree on beside NCCL: the group's store, its keys under the prefix
    # "cupycoll-algorithm/<name>", so that they meet no key of the group's own.
    needs_store: bool = False


_LOADED: Dict[str, Algorithm] = {}


def names() -> Tuple[str, ...]:
    """Every value an algorithm option takes."""
    return (AUTO, NCCL) + tuple(dict.fromkeys([*BUILT_IN, *_LOADED]))


def register(algorithm: Algorithm) -> None:
    """Make ``algorithm`` choosable by its name (a built-in one's name is taken)."""
    if algorithm.name in (AUTO, NCCL) or algorithm.name in BUILT_IN:
        raise CupycollValueError(f"algorithm name {algorithm.name!r} is taken")
    _LOADED[algorithm.name] = algorithm


def get(name: str) -> Algorithm:
    """The algorithm called ``name`` (one of :func:`names` but ``auto`` and ``nccl``)."""
    algorithm = _LOADED.get(name)
    if algorithm is None:
        if name not in BUILT_IN:
            raise CupycollValueError(f"no algorithm {name!r}; expected one of {', '.join(names())}")
        algorithm = _LOADED[name] = importlib.import_module(BUILT_IN[name]).ALGORITHM
    return algorithm


def taking_over(op: str) -> Optional[Algorithm]:
    """The first algorithm (built-in ones first) that ``auto`` sends ``op`` to, or None."""
    for name in names()[2:]:
        algorithm = get(name)
        if op in algorithm.takes_over:
            return algorithm
    return None


def parse_name(setting: str, value) -> str:
    """An algorithm option's value, ``setting`` naming it: one of :func:`names` at the time."""
    return parse_choice(names())(setting, value)


# -- the per-call override ---------------------------------------------------------------

# Process-wide on purpose, not per thread: DDP issues its all-reduces from autograd's
# threads, which a thread-local override around the training step would never reach.
# Innermost last; the reductions read it (collectives._OVERRIDES), only algorithm() writes it.
OVERRIDES: list = []


@contextlib.contextmanager
def algorithm(name: str):
    """Run the CUDA all-reduces and reduce-scatters issued in the body with ``name``
    (``"nccl"``, ``"ring"`` or ``"auto"``), whatever the groups' ``Options.algorithm``.
    Nests; applies to every thread of the process while the body runs."""
    choice = parse_name("algorithm", name)
    OVERRIDES.append(choice)
    try:
        yield
    finally:
        OVERRIDES.pop()


def override() -> Optional[str]:
    """The innermost :func:`algorithm` in force, or None."""
    return OVERRIDES[-1] if OVERRIDES else None
