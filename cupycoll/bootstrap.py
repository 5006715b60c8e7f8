"""The bootstrap of a communicator: one fresh ncclUniqueId shared through torch's store.

:class:`StoreBootstrap` is what a :class:`~cupycoll.backend.CudaBackend` uses before every
``ncclCommInitRank``: the creator rank puts a new unique id in the store, the others wait
for it, and everyone waits until all members have arrived. It needs a store and nothing of
a process group, so it is tested on its own.

Three things make it more than a set/get:

* **incarnations**: the store may outlive the group (``destroy_process_group`` then init
  again on torchrun's store, same group name), so each creation counts itself in and gets
  a key of its own;
* **the arrival check**: blocking NCCL init cannot be interrupted, so a rank that never
  joins must fail here, after the timeout, not inside NCCL;
* **abortable waits**: the store is polled in short slices, and before each one the owner's
  ``check`` callback runs, so ``abort()`` from another thread ends the wait.

Deliberately left out: NCCL itself (creating the communicator is the backend's), retries
(a creation that failed leaves the arrival count between two incarnations: see
:meth:`cupycoll.backend.CudaBackend.comm_for`), and any store other than torch's.
"""

from __future__ import annotations

import time
from typing import Callable

from .communicator import new_unique_id
from .errors import CollectiveTimeoutError

# Store waits poll in slices of at most this length, so that abort() can end them.
STORE_POLL_S = 0.05


def _nothing() -> None:
    return None


class StoreBootstrap:
    """Shares unique ids among the ranks of one group through ``store``."""

    def __init__(self, store, rank: int, timeout_s: float, name: Callable[[], str] = lambda: "",
                 check: Callable[[], None] = _nothing):
        self._store = store
        self._rank = rank
        self._timeout_s = float(timeout_s)
        self._name = name  # the group's current name, for messages
        self._check = check  # raises when the owner was aborted: ends a wait

    def unique_id(self, key: str, creator: bool, members: int) -> bytes:
        """The ncclUniqueId of communicator ``key`` among ``members`` ranks (``creator``
        makes it), once all of them have arrived.

        Every member counts itself in, and ``(count - 1) // members`` numbers the
        incarnation the same on all of them, since the previous incarnation's members had
        all joined before this one starts."""
        store = self._store
        joined_key = f"cupycoll/{key}/joined"
        joined = store.add(joined_key, 1)
        incarnation = (joined - 1) // members
        uid_key = f"cupycoll/{key}/{incarnation}/uid"
        deadline = time.monotonic() + self._timeout_s
        if creator:
            store.set(uid_key, new_unique_id())
        else:
            self._wait(lambda: store.check([uid_key]), deadline,
                       f"the ncclUniqueId of {key!r} from its creator rank")
        everyone = (incarnation + 1) * members
        self._wait(lambda: store.add(joined_key, 0) >= everyone, deadline,
                   f"all {members} ranks to join communicator {key!r}",
                   lambda: f"{store.add(joined_key, 0) - incarnation * members} arrived")
        return store.get(uid_key)

    def _wait(self, ready: Callable[[], bool], deadline: float, what: str,
              progress: Callable[[], str] = lambda: "") -> None:
        """Poll ``ready`` until it holds, the deadline passes or the owner is aborted."""
        pause = 0.001
        while not ready():
            self._check()
            if time.monotonic() > deadline:
                detail = progress()
                raise CollectiveTimeoutError(
                    f"process group {self._name()!r} rank {self._rank}: timed out after "
                    f"{self._timeout_s:g} s waiting for {what}" + (f" ({detail})" if detail else ""))
            time.sleep(pause)
            pause = min(pause * 2, STORE_POLL_S)
