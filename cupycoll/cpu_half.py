"""A cupycoll group's CPU half: the gloo group its shell routes CPU calls to, built on the
group's store under a prefix of its own.

:func:`build_gloo_half` makes it: torch's own gloo, whose pairs connect at creation, or on
first use where the job asks torch for it (``TORCH_GLOO_LAZY_INIT``, torch 2.8+); a lazy one
waits for no peer, so then every rank counts itself in (:func:`_all_made`). When the creation
times out, :func:`never_joined` is the error naming the ranks whose gloo never came.

Deliberately left out: routing calls to it and tracing them (:mod:`cupycoll.shell`), gloo's
version differences and fallbacks (:mod:`cupycoll.compat.gloo`), and where a shape registers
it (each shape's ``_build_cpu_group``).
"""

from __future__ import annotations

import datetime
from typing import Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, ProcessGroup

from . import compat, config
from .errors import CollectiveTimeoutError
from .nccl.bootstrap import delete_keys, is_store_timeout
from .trace.diagnosis import ranks_text

_GLOO = ProcessGroup.BackendType.GLOO
_CPU = torch.device("cpu")

# The prefix of a group's gloo half in the group's store.
_CPU_PREFIX = "cupycoll-cpu/"


def build_gloo_half(store, rank: int, size: int, timeout) -> Tuple[ProcessGroup, ProcessGroup]:
    """A group's gloo half on ``store`` (its own prefix): the plain ProcessGroup the shell
    routes CPU calls to, and the gloo backend registered in it. torch's own gloo: its pairs
    connect at creation, or on first use where the job asks torch for it
    (``TORCH_GLOO_LAZY_INIT``, torch 2.8+: :data:`cupycoll.compat.GLOO_LAZY_INIT`). A lazy
    gloo waits for no peer at creation, so then every rank counts itself in
    (:func:`_all_made`): the creation still fails, as an eager gloo's rendezvous does, when a
    rank never makes the group."""
    cpu_store = PrefixStore(_CPU_PREFIX, store)
    lazy = compat.GLOO_LAZY_INIT and config.gloo_lazy_init()
    gloo = compat.new_gloo(cpu_store, rank, size, timeout)
    if lazy:
        _all_made(cpu_store, size, timeout)
    inner = ProcessGroup(cpu_store, rank, size)
    compat.set_default_backend(inner, _GLOO)
    inner._register_backend(_CPU, _GLOO, gloo)
    return inner, gloo


# The CPU half's arrival keys in its store (beside gloo's own address keys, "0/<rank>").
_MADE, _MADE_ALL, _MADE_LEFT = "cupycoll-made/count", "cupycoll-made/all", "cupycoll-made/left"


def _all_made(cpu_store, size: int, timeout) -> None:
    """Return once all ``size`` ranks have made their lazy gloo on ``cpu_store``: each adds
    itself to one count, the one that completes it publishes that all are there, the others
    wait for that in the store (one call, served by it, for at most ``timeout``); then each
    counts itself out, the last deleting the three keys. 3 store calls a rank whatever the
    world size (an eager gloo's rendezvous reads every peer's address). A store wait that
    times out raises torch's DistStoreError, as an eager gloo's rendezvous does: the shell
    names the ranks whose gloo address is not in the store (:func:`never_joined`). A count a
    failed creation left under the same name lets the next one through early (its ranks are
    then found missing at their first CPU call): never a wait for nobody."""
    if size <= 1:
        return
    if cpu_store.add(_MADE, 1) >= size:
        cpu_store.set(_MADE_ALL, b"1")
    else:
        try:
            cpu_store.wait([_MADE_ALL], timeout)
        except dist.DistStoreError:
            raise
        except RuntimeError as exc:  # a FileStore says "timeout" in a plain RuntimeError
            if not is_store_timeout(exc):
                raise
            raise dist.DistStoreError(str(exc)) from exc
    if cpu_store.add(_MADE_LEFT, 1) == size:  # every rank is past the wait: nobody reads them again
        delete_keys(cpu_store, [_MADE, _MADE_ALL, _MADE_LEFT])


def never_joined(store, rank: int, size: int, global_ranks: Sequence[int], group_name: str,
                 timeout: datetime.timedelta) -> CollectiveTimeoutError:
    """gloo's rendezvous on the group's ``store`` timed out on group rank ``rank`` of ``size``
    (gloo's error names a store key, never a rank): the error naming the ranks, as
    ``global_ranks`` numbers them, that never joined it."""
    absent = compat.gloo_ranks_absent(PrefixStore(_CPU_PREFIX, store), rank, size)
    who = (f"{ranks_text([global_ranks[r] for r in absent])} never joined it"
           if absent else "not every rank joined it")
    return CollectiveTimeoutError(
        f"process group {group_name!r}: creating its CPU half (gloo) timed out after "
        f"{timeout.total_seconds():g} s on rank {global_ranks[rank]}: "
        f"{who} (dead, or not creating this group)")
