"""cupycoll under torchft: a process group that torchft's Manager reconfigures at each quorum.

torchft (PyTorch's per-step fault tolerance) keeps training while replicas die and rejoin.
Its ``Manager`` holds one process group across the replicas and, whenever the quorum of live
replicas changes, calls ``configure(store_addr, replica_id, rank, world_size, ...)`` with a
store prefix of its own for that quorum: the group aborts the group it had and builds a new
one on that store. Before committing a step the Manager asks ``errored()``: a group that
failed meanwhile makes the step be discarded and the quorum be formed again.

:class:`ProcessGroupCupycoll` here is torchft's ``ProcessGroupWrapper`` (every collective
torchft calls, its functional-collective registration, ``set_timeout``) whose groups are
cupycoll's, in the shape ``CUPYCOLL_SHAPE`` selects (docs/usage.md, "Two shapes"):

* ``configure`` aborts the last quorum's group (cupycoll's abort: bounded, never waiting on a
  peer that is gone) and builds the new one, with the wrapper's timeout;
* ``errored()`` is what ended the current group, asked of the group each time, as its next
  call would raise it: a CommunicatorAbortedError saying it was aborted (what torchft's own
  groups say), whose cause is the group's fault (:func:`cupycoll.group_fault`: a timeout,
  an NCCL error, a peer's death) when one ended it; after ``abort()`` it stays the aborted
  group's until the next ``configure``. A CPU collective that failed between the ranks (a
  timeout, a dead peer) raises from its Work, where torchft's Manager reports it, and ends
  the group as a CUDA fault does (its peers are told: docs/faults.md); one this rank's own
  argument failed leaves it healthy, as gloo's does;
* ``shutdown()`` shuts the group down (torchft's own wrapper only drops it).

Usage::

    from cupycoll.torchft import ProcessGroupCupycoll
    manager = torchft.Manager(pg=ProcessGroupCupycoll(timeout=timedelta(seconds=10)), ...)

Imported only where torchft is installed: it is not a dependency of cupycoll (``import
cupycoll`` never imports this module). Checked against torchft 0.2.0 (docs/usage.md).

Deliberately left out: torchft's own fault tolerance (quorums, healing, checkpoints: its
Manager's), its "baby" groups that run collectives in a subprocess, and a timeout change for
a group already made (``set_timeout`` applies from the next ``configure``, as torchft's
gloo group does).
"""

from __future__ import annotations

import datetime
from typing import List, Optional

from . import config
from .errors import CommunicatorAbortedError, MissingDependencyError

try:
    from torchft import process_group as _torchft
except ImportError as exc:
    raise MissingDependencyError("cupycoll.torchft needs torchft, which is not installed "
                                 "(pip install torchft; checked with 0.2.0)") from exc
from ._registration import group_shape
from .config import BACKEND_NAME
from .shell import group_fault, shell_of


class ProcessGroupCupycoll(_torchft.ProcessGroupWrapper):
    """A torchft process group whose quorums' groups are cupycoll groups.

    ``timeout``: of each group (its collectives, its creation), and of the store client;
    ``options``: the cupycoll :class:`~cupycoll.Options` of each group."""

    def __init__(self, timeout: datetime.timedelta = datetime.timedelta(seconds=60),
                 options: Optional[config.Options] = None) -> None:
        super().__init__(timeout=timeout)
        self._options = options
        self._aborted = None  # the group abort() ended, asked by errored() until configure

    def getBackendName(self) -> str:
        return f"torchft-{BACKEND_NAME}"

    def _create_pg(self, store, rank: int, world_size: int):
        self._aborted = None
        quorum = "" if self._quorum_id is None else f"_quorum_{self._quorum_id}"
        name = f"torchft{quorum}_rank_{self._group_rank or 0}"  # torchft's own groups' name
        ranks: Optional[List[int]] = self._global_ranks
        ranks = list(ranks) if ranks and len(ranks) == world_size else None
        if group_shape() == "backend":
            from .py_backend import standalone

            return standalone(store, rank, world_size, self._timeout, self._options, ranks, name)
        from .process_group import ProcessGroupCupycoll as Group

        return Group(store, rank, world_size, self._timeout, self._options, global_ranks=ranks, group_id=name)

    def abort(self, errored: bool = True) -> None:
        pg = self._pg
        super().abort(errored=errored)  # aborts the group and drops it
        if pg is not None:
            self._aborted = pg

    def errored(self) -> Optional[Exception]:
        pg = self._pg if self._pg is not None else self._aborted
        fault = group_fault(pg) if pg is not None else None
        if fault is None or isinstance(fault, CommunicatorAbortedError):
            return fault
        # A fault ended the group: said as its next call says it (torchft's groups say
        # "aborted" for one to reconfigure), the fault itself its cause.
        ended = CommunicatorAbortedError(f"process group {shell_of(pg).getGroupName()!r} was aborted: {fault}")
        ended.__cause__ = fault
        return ended

    def shutdown(self) -> None:
        pg, self._pg = self._pg, None
        if pg is not None:
            pg.shutdown()
