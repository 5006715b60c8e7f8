"""The bootstrap of a communicator: one fresh ncclUniqueId shared through torch's store.

:class:`StoreBootstrap` is what a :class:`~cupycoll.backend.CudaBackend` uses before every
``ncclCommInitRank``: the creator rank puts a new unique id in the store, the others wait
for it, and everyone waits until all members have arrived. It needs a store and nothing of
a process group, so it is tested on its own.

Four things make it more than a set/get:

* **generations**: the store may outlive the group (``destroy_process_group`` then init
  again on torchrun's store, same group name), so each creation runs in a generation of
  its own. The generation is one store value every rank reads (``.../generation``), and
  only the creator moves it on, once per creation (after publishing the id, or after
  giving up): no rank derives it from counts that a failed creation leaves behind;
* **arrival first, then the id**: every member counts itself in, and the creator makes
  the unique id only once all have arrived. ``ncclGetUniqueId`` starts a bootstrap-root
  thread with a listening socket that nothing can stop, so an id made for peers that never
  come leaks both;
* **one decision per generation**: the id key is written once, with ``compare_set``. The
  creator writes the id, a rank that gives up (timeout, abort) writes ``ABANDONED``; who
  comes first decides for everyone, so a rank that gave up never leaves the others inside
  NCCL init waiting for it, and one that gives up just after the id was published joins;
* **abortable waits**: the store is polled in short slices, and before each one the owner's
  ``check`` callback runs, so ``abort()`` from another thread ends the wait.

Deliberately left out: NCCL itself (creating the communicator is the backend's), local
checks (the backend runs them before calling in, see ``Communicator.preflight``), and any
store other than torch's.
"""

from __future__ import annotations

import time
from typing import Callable

from .communicator import new_unique_id
from .errors import CollectiveTimeoutError

# Store waits poll in slices of at most this length, so that abort() can end them.
STORE_POLL_S = 0.05
# What a rank that gave up writes in place of a generation's unique id (never 128 bytes).
ABANDONED = b"abandoned"


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
        makes it), once all of them have arrived. Raises CollectiveTimeoutError when they do
        not all arrive in time or one of them gave up (everyone of the generation fails)."""
        store = self._store
        base = f"cupycoll/{key}"
        deadline = time.monotonic() + self._timeout_s
        generation = self._generation(base, creator, deadline)
        uid_key = f"{base}/{generation}/uid"
        arrived_key = f"{base}/{generation}/arrived"
        store.add(arrived_key, 1)
        try:
            if creator:
                self._wait(lambda: store.add(arrived_key, 0) >= members or store.check([uid_key]), deadline,
                           f"all {members} ranks to join communicator {key!r}",
                           lambda: f"{store.add(arrived_key, 0)} arrived")
                if store.check([uid_key]):  # a member gave up: make no id (it would leak)
                    decided = store.get(uid_key)
                else:  # only now: the id starts NCCL's bootstrap-root thread (module doc)
                    decided = store.compare_set(uid_key, "", new_unique_id())
            else:
                self._wait(lambda: store.check([uid_key]), deadline,
                           f"the ncclUniqueId of {key!r} from its creator rank")
                decided = store.get(uid_key)
        except BaseException:
            decided = store.compare_set(uid_key, "", ABANDONED)
            if decided == ABANDONED or creator:
                if creator:
                    store.set(f"{base}/generation", str(generation + 1))
                raise
            return decided  # the id was published just before we gave up: join after all
        if creator:
            store.set(f"{base}/generation", str(generation + 1))
        if decided == ABANDONED:
            raise CollectiveTimeoutError(
                f"process group {self._name()!r} rank {self._rank}: creating communicator {key!r} "
                "failed: another rank gave up waiting (timeout or abort)")
        return decided

    def _generation(self, base: str, creator: bool, deadline: float) -> int:
        """This creation's generation. A generation whose id key says ABANDONED is over: its
        creator moves the generation on (at once, or here when it died before doing so), and
        the others wait for that."""
        store = self._store
        gen_key = f"{base}/generation"

        def current() -> int:
            return int(store.get(gen_key)) if store.check([gen_key]) else 0

        def over(generation: int) -> bool:
            uid_key = f"{base}/{generation}/uid"
            return store.check([uid_key]) and store.get(uid_key) == ABANDONED

        generation = current()
        if not over(generation):
            return generation
        if creator:
            store.set(gen_key, str(generation + 1))
            return generation + 1
        self._wait(lambda: current() != generation, deadline,
                   f"the creator rank to start a new attempt at communicator {base!r}")
        return current()

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
