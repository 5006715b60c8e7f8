"""Recovery in place: :func:`shrink_group` makes a cupycoll group of a group's survivors.

After a rank dies (or is to be left out), the ranks that remain call
``cupycoll.shrink_group([dead_rank], group)`` and get a working group of their own size and
ranks, with its recorder, diagnosis, watchdog and Options; there is no new
``init_process_group`` on a new store. It takes torch's ``dist.shrink_group`` signature and
rules (torch >= 2.11 has that function; this one runs on every torch cupycoll supports):

* bad input raises before anything changes, with torch's exception classes: a
  ``ranks_to_exclude`` that is not a list (TypeError), empty, out of range, repeated or
  naming every rank (ValueError), an unknown ``shrink_flags`` (ValueError), a call from an
  excluded rank (RuntimeError), a group that is not cupycoll's (TypeError) or was destroyed
  (ValueError);
* the survivors first gather (:func:`survivors_arrive`): one that does not come within
  :func:`cupycoll.bounds.shrink_gathering` (the timeout, a watchdog interval, the
  diagnosis's wait and a margin: survivors learn of a death at different times) is named in
  a CollectiveTimeoutError, an abort of the group (``abort_all()``) ends
  the wait, and either way the group is left as it was, so the shrink can be called again
  (without the missing rank); a failed shrink leaves no store key of its own;
* torch knows the new group as it knows any group: a shrunk default group is destroyed with
  every other group (torch's rule: global ranks change) and the survivors' group, built
  before that (so that what can fail on a peer fails while the world still stands), becomes
  the default through ``init_process_group`` on the group's store under a new prefix;
  another group becomes a ``new_group`` of the survivors made among them alone
  (``use_local_synchronization``);
* the survivors' group takes its NCCL communicator from the parent's (see
  :func:`cupycoll.shell.shrinking` and ``CudaBackend.shrink_from``): ``ncclCommShrink`` when
  every survivor's communicator is healthy and NCCL has it (2.27+), with
  ``NCCL_SHRINK_ABORT`` for ``SHRINK_ABORT`` or work in flight; otherwise (a fault already
  aborted the communicators, an older NCCL, no communicator yet) a new one among the
  survivors. The parent's Works in flight fail first, with a reason that says it was shrunk;
  its CPU half is replaced by a gloo group of the survivors.

In the c10d Backend shape (torch 2.14+, ``CUPYCOLL_SHAPE=backend``) torch's
``dist.shrink_group`` is the one to call and this function hands over to it.

Deliberately left out: growing a group back (NCCL 2.29's grow), revoking a communicator,
ending the survivors' wait by ``abort_all()`` when a fault had aborted the group before the
shrink began (the wait is then bounded by the timeout alone), and a store that died with an
excluded rank (the store must outlive every rank it serves:
torchrun's agent store does, a TCPStore hosted by the excluded rank 0 does not).
"""

from __future__ import annotations

import logging
import uuid
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore

from . import bounds, compat, config
from .errors import CollectiveTimeoutError, CommunicatorAbortedError
from .faults.lifecycle import GroupState
from .nccl.bootstrap import StoreBootstrap, delete_keys
from .shell import GroupShell, shrinking
from .trace.diagnosis import ranks_text

logger = logging.getLogger(__name__)  # a child of "cupycoll"

# torch's values of shrink_flags (torch 2.11+ names them dist.SHRINK_DEFAULT / SHRINK_ABORT).
SHRINK_DEFAULT = 0
SHRINK_ABORT = 1  # abort the parent's work in flight before shrinking

# The keys under a shrunk default group's store through which its survivors agree on the
# store prefix of their new default group.
_PREFIX_KEY = "cupycoll-shrink/prefix"
_PREFIX_READ_KEY = "cupycoll-shrink/prefix-read"


def _check_arguments(ranks_to_exclude, shrink_flags) -> None:
    if not isinstance(ranks_to_exclude, list):
        raise TypeError(f"ranks_to_exclude must be a list of group ranks, got "
                        f"{type(ranks_to_exclude).__name__}: {ranks_to_exclude!r}")
    if not ranks_to_exclude:
        raise ValueError("ranks_to_exclude is empty: name at least one rank to leave out")
    if isinstance(shrink_flags, bool) or shrink_flags not in (SHRINK_DEFAULT, SHRINK_ABORT):
        raise ValueError(f"shrink_flags={shrink_flags!r}: must be SHRINK_DEFAULT ({SHRINK_DEFAULT}) "
                         f"or SHRINK_ABORT ({SHRINK_ABORT})")


def _check_ranks(ranks_to_exclude: List[int], size: int, rank: int, name: str) -> List[int]:
    seen = set()
    for index, excluded in enumerate(ranks_to_exclude):
        if isinstance(excluded, bool) or not isinstance(excluded, int):
            raise TypeError(f"ranks_to_exclude[{index}] is {type(excluded).__name__} {excluded!r}, "
                            "not a group rank")
        if not 0 <= excluded < size:
            raise ValueError(f"ranks_to_exclude[{index}] = {excluded} is not a rank of process group "
                             f"{name!r} (ranks 0 to {size - 1})")
        if excluded in seen:
            raise ValueError(f"ranks_to_exclude names rank {excluded} twice")
        seen.add(excluded)
    if len(seen) >= size:
        raise ValueError(f"ranks_to_exclude leaves none of the {size} ranks of process group {name!r}")
    if rank in seen:
        raise RuntimeError(f"rank {rank} is in ranks_to_exclude of process group {name!r}: only the "
                           "ranks that stay call shrink_group (an excluded rank should exit)")
    return sorted(seen)


def survivors_prefix(store, survivors: int) -> str:
    """The store prefix of the survivors' new default group, the same on each of them and
    fresh: the first survivor to ask draws it, and the last to read it deletes it, so a
    later group on the same store draws anew. Needs no wait: ``compare_set`` is atomic."""
    token = store.compare_set(_PREFIX_KEY, "", uuid.uuid4().hex)
    if store.add(_PREFIX_READ_KEY, 1) == survivors:
        delete_keys(store, (_PREFIX_KEY, _PREFIX_READ_KEY))
    return f"cupycoll-shrink/{token.decode() if isinstance(token, bytes) else token}/"


def survivors_arrive(parent: "GroupShell", exclude: Sequence[int], store, rank: int, size: int,
                     timeout_s: float) -> None:
    """Return once every survivor of ``parent``'s shrink (``exclude`` left out; each survivor
    calls this, as ``rank`` of the ``size`` survivors, on the new group's ``store``) has come.
    It runs before any rendezvous of the new group: gloo's waits out the whole timeout for a
    missing rank, names it only by a store key, and nothing can interrupt it. Here a survivor
    missing after the timeout is named (CollectiveTimeoutError), and an abort of the parent
    while it waits (``cupycoll.abort_all()``) ends the wait at once; the parent is left as it
    was either way, so the shrink can be called again. The wait is
    :func:`cupycoll.bounds.shrink_gathering`, not the timeout: a survivor that learnt of the
    fault first must wait for one that learns of it at its own timeout and diagnosis."""
    name = parent.getGroupName()
    survivors = [r for r in range(parent._size) if r not in exclude]
    life = parent._cuda.life
    watched = life.usable  # a parent a fault aborted already has no abort left to end this

    def check() -> None:
        # an abort asked for (abort_all), not a fault of the parent: a shrink is what a fault
        # calls for, so the watchdog failing the parent meanwhile does not end it
        if watched and not life.usable and life.fault is None:
            raise CommunicatorAbortedError(
                f"shrinking process group {name!r} ended: the group was aborted while its "
                "survivors gathered")

    missing: List[int] = []

    def describe(absent) -> str:
        missing[:] = [parent._global_ranks[survivors[r]] for r in absent]
        return f"missing: {ranks_text(missing)}"

    # The survivors learn of the fault at different times (a dead peer's neighbour at once,
    # the others at their timeout and its diagnosis when the fault's publication does not
    # reach them): the gathering waits until the last of them has learnt of it.
    gathering = bounds.shrink_gathering(timeout_s, parent.settings.watchdog_interval)
    try:
        StoreBootstrap(store, rank, timeout_s, lambda: name, check).all_arrive("shrink-arrival", size, describe,
                                                                                 gathering)
    except CollectiveTimeoutError as exc:
        them = "it" if len(missing) == 1 else "them"
        raise CollectiveTimeoutError(
            f"shrinking process group {name!r} (leaving out its ranks {sorted(exclude)}) failed: "
            f"{ranks_text(missing)} of the survivors did not join it within {gathering:g} s (dead, "
            f"or not calling shrink_group); the group is as it was: shrink it again without "
            f"{them}") from exc


class SurvivorsWorld:
    """What a shrink of the default group hands ``init_process_group`` as ``pg_options``
    (the one argument torch passes to a backend's creator unchanged): the survivors' group,
    built already, which the creator returns (:mod:`cupycoll._registration`)."""

    def __init__(self, group: GroupShell):
        self.group = group

    def take(self, rank: int, size: int) -> GroupShell:
        group = self.group
        if (group._rank, group._size) != (rank, size):
            raise ValueError(f"the survivors' group is rank {group._rank} of {group._size}; torch "
                             f"asked for rank {rank} of {size}")
        return group


def check_options(pg_options) -> None:
    if pg_options is not None and not isinstance(pg_options, config.Options):
        raise TypeError(f"pg_options must be cupycoll.Options, got {type(pg_options).__name__}")


def _cupycoll_group(group) -> GroupShell:
    """The group's cupycoll shell: the adapter itself, or the c10d Backend torch dispatches its
    CUDA calls to; a TypeError naming what the group is otherwise."""
    if isinstance(group, GroupShell):
        return group
    try:
        backend = group._get_backend(torch.device("cuda"))
    except RuntimeError:  # no CUDA backend in it
        backend = None
    if isinstance(backend, GroupShell):
        return backend
    raise TypeError(f"process group {compat.group_name(group)!r} is not a cupycoll group "
                    f"(its backend is {dist.get_backend(group)!r}): cupycoll.shrink_group shrinks "
                    "cupycoll groups; use torch.distributed.shrink_group for torch's own")


def shrink_group(ranks_to_exclude: List[int], group=None, shrink_flags: int = SHRINK_DEFAULT,
                 pg_options: Optional[config.Options] = None):
    """The group of ``group``'s ranks but ``ranks_to_exclude`` (group ranks), made by the
    ranks that stay, each calling this; the default group when ``group`` is None (then the
    new group is the default one, and every other group is destroyed). ``pg_options``:
    the new group's :class:`cupycoll.Options` (default: the parent's). See the module."""
    _check_arguments(ranks_to_exclude, shrink_flags)
    if group is None:
        group = compat.default_group()  # raises ValueError when none was initialized
    if not compat.is_registered(group):
        raise ValueError(f"process group {compat.group_name(group)!r} was destroyed; nothing to shrink")
    shell = _cupycoll_group(group)
    name = compat.group_name(group)
    exclude = _check_ranks(ranks_to_exclude, group.size(), group.rank(), name)
    check_options(pg_options)
    if shell._cuda.state is GroupState.SHUT_DOWN:
        raise ValueError(f"process group {name!r} was shut down; nothing to shrink")
    if shell is not group:  # the c10d Backend shape: torch's own shrink reaches its backend
        return shell.register_shrunk(dist.shrink_group(ranks_to_exclude, group, shrink_flags, pg_options))

    survivors = [r for r in range(group.size()) if r not in exclude]
    new_rank = survivors.index(group.rank())
    options = pg_options if pg_options is not None else shell.pg_options
    backend = dist.get_backend_config(group)
    bound = shell.bound_device
    abort_first = shrink_flags == SHRINK_ABORT
    logger.info("shrinking process group %r to %d of its %d ranks (leaving out %s)",
                name, len(survivors), group.size(), exclude)
    if group is not compat.default_group():
        # gathered on the parent's store first: see survivors_arrive
        survivors_arrive(shell, exclude, PrefixStore(f"cupycoll-shrink/{','.join(map(str, survivors))}/", shell._store),
                         new_rank, len(survivors), shell.settings.timeout.total_seconds())
        with shrinking(shell, exclude, abort_first):
            child = dist.new_group(ranks=[shell._global_ranks[r] for r in survivors], backend=backend,
                                   timeout=shell.settings.timeout, pg_options=options,
                                   use_local_synchronization=True)
        dist.destroy_process_group(group)
        return child

    # The default group. The survivors' group is built first, while torch's world still
    # stands: what can fail on a peer (the survivors' gathering, gloo's rendezvous, the
    # communicator's shrink) fails with the world whole, so the shrink can be called again.
    # Then torch's world goes (every other group with it: their ranks were global ranks that
    # change), and init_process_group makes the built group the survivors' world.
    store = compat.default_store()
    prefix = survivors_prefix(store, len(survivors))
    survivors_store = PrefixStore(prefix, store)
    timeout = shell.settings.timeout
    try:
        survivors_arrive(shell, exclude, survivors_store, new_rank, len(survivors), timeout.total_seconds())
        with shrinking(shell, exclude, abort_first):
            world = type(shell)(survivors_store, new_rank, len(survivors), timeout, options,
                                global_ranks=list(range(len(survivors))), group_id=shell._group_id)
    except BaseException:
        delete_keys(store, (_PREFIX_KEY, _PREFIX_READ_KEY))  # a failed shrink leaves no key behind
        raise
    for other in compat.registered_groups():
        if other is not group and isinstance(other, GroupShell):
            other.abort()  # an excluded rank may never take part in their shutdown
    try:
        dist.destroy_process_group()
        kwargs = {"device_id": bound} if bound is not None else {}
        dist.init_process_group(backend, store=survivors_store, rank=new_rank, world_size=len(survivors),
                                timeout=timeout, pg_options=SurvivorsWorld(world), **kwargs)
    except BaseException:
        world.abort()  # outside torch's world: nothing else would end it
        raise
    return compat.default_group()
