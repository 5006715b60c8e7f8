"""Version differences in torch's stores as cupycoll uses them: a client of its own
(``clone``), the store beneath the prefixes, several keys set in one call.

Left out: what cupycoll keeps in a store (the bootstrap's keys: :mod:`cupycoll.nccl.bootstrap`;
the CPU half's: :mod:`cupycoll.cpu_half`) and how long it waits on one (:mod:`cupycoll.bounds`).
"""

from __future__ import annotations

from typing import Sequence

import torch.distributed as dist

from .release import TORCH


# torch 2.8 gave the stores clone(): a new client of the same server, a connection of its
# own (pytorch#150966, April 2025, between 2.7's and 2.8's branch cuts; 2.7.1 has none, 2.11,
# 2.13 and 2.15 have it; 2.8 - 2.10 are not run). Where there is one, a rank's diagnosis
# listener waits for its bell on it, served by the store (a wait on the group's own client
# would hold every other call of that client back: a client serves one call at a time);
# where there is none it looks every bounds.RESPONDER_INTERVAL_S.
STORE_CLONE = TORCH >= (2, 8)


def clone_store(store):
    """A client of ``store``'s server of its own (see STORE_CLONE), or None where torch has
    none. A store that cannot be cloned raises what its ``clone`` raises."""
    if not STORE_CLONE:
        return None
    return store.clone()


def root_store(store):
    """The store beneath ``store``'s prefixes: the one every group of a job shares (every
    supported torch has ``PrefixStore.underlying_store``)."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def store_set_many(store, keys: Sequence[str], values: Sequence[bytes]) -> None:
    """Set ``keys`` to ``values`` in one call (``multi_set``: torch 2.1+, every supported
    release; one ``set`` each on a store that does not implement it, as a Python store may)."""
    try:
        store.multi_set(list(keys), list(values))
    except (AttributeError, NotImplementedError):
        for key, value in zip(keys, values):
            store.set(key, value)
