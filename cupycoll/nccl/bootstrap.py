"""The bootstrap of a communicator: one fresh ncclUniqueId shared through torch's store.

:class:`StoreBootstrap` is what a :class:`~cupycoll.backend.CudaBackend` uses before every
``ncclCommInitRank``: the creator rank puts a new unique id in the store, the others wait
for it, and everyone waits until all members have arrived. It needs a store and nothing of
a process group, so it is tested on its own.

Four things make it more than a set/get:

* **generations**: the store may outlive the group (``destroy_process_group`` then init
  again on torchrun's store, same group name), so each creation runs in a generation of
  its own. The generation is one store value every rank reads (``.../generation``). It
  moves on by ``compare_set`` from its current value, so anyone may move it (the creator
  after deciding, a rank after giving up, a reader finding the generation already
  decided): a creator dying before the move leaves nobody reusing an old id;
* **arrival first, then the id**: every member counts itself in, and the creator makes
  the unique id only once all have arrived. ``ncclGetUniqueId`` starts a bootstrap-root
  thread with a listening socket that nothing can stop, so an id made for peers that never
  come leaks both;
* **one decision per generation**: the id key is written once, with ``compare_set``. The
  creator first claims it (``PENDING``) and only then makes the id, so losing the race to a
  rank that gave up makes no id; a rank that gives up writes ``ABANDONED``. Who comes first
  decides for everyone, so a rank that gave up never leaves the others inside NCCL init
  waiting for it. One that *timed out* just after the id was published joins; an abort or
  a ``KeyboardInterrupt`` never does (it abandons an undecided generation and re-raises);
* **no keys left**: the last member to read a generation's id deletes that generation's keys
  and the generation itself (the next creation under the name starts again at 0), and a
  creator that succeeds in generation g deletes g-1's (one that was abandoned). Deleting the
  generation is safe because no rank can start the next creation under the same name before
  every member has finished this one: that next creation belongs to a new incarnation of the
  group, whose making (its gloo half's rendezvous) needs every member, each past this call.
  A creation that failed leaves its keys, for the next one to read;
* **abortable waits**: the store is polled in short slices, and before each one the owner's
  ``check`` callback runs, so ``abort()`` from another thread ends the wait.

Known limit: the store alone cannot tell a rank arriving late for a generation that was
abandoned without it from an early rank of the next group incarnation (both read the next
generation and count in it), so such a late rank can still be counted in, and join, the
next incarnation's creation. Telling them apart needs an identity of the group incarnation
agreed by its ranks when the group is made, which the backend does not have yet.

It also holds the survivors' arrival at a shrink (:meth:`StoreBootstrap.all_arrive`), which
names the ones missing, and their agreement on how to shrink (:meth:`StoreBootstrap.all_agree`).

Deliberately left out: NCCL itself (creating the communicator is the backend's), local
checks (the backend runs them before calling in, see ``Communicator.preflight``), and any
store other than torch's.
"""

from __future__ import annotations

import time
from typing import Callable, List

from .communicator import new_unique_id
from ..errors import CollectiveTimeoutError

# Store waits poll in slices of at most this length, so that abort() can end them.
STORE_POLL_S = 0.05
# What a rank that gave up writes in place of a generation's unique id (never 128 bytes).
ABANDONED = b"abandoned"
# What the creator writes first (its claim on the decision) while it makes the id.
PENDING = b"pending"
# How long a rank that gave up waits for a creator between PENDING and the id.
PENDING_GRACE_S = 5.0


def _nothing() -> None:
    return None


def delete_keys(store, keys) -> None:
    """Delete ``keys`` from ``store``; a store without ``delete_key`` keeps them, and
    nothing else is lost."""
    for key in keys:
        try:
            store.delete_key(key)
        except Exception:  # noqa: BLE001 - see the docstring
            pass


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
        generation = self._generation(base, deadline)
        uid_key = f"{base}/{generation}/uid"
        arrived_key = f"{base}/{generation}/arrived"
        store.add(arrived_key, 1)
        try:
            if creator:
                self._wait(lambda: store.add(arrived_key, 0) >= members or store.check([uid_key]), deadline,
                           f"all {members} ranks to join communicator {key!r}",
                           lambda: f"{store.add(arrived_key, 0)} arrived")
                decided = self._publish(uid_key)
            else:
                self._wait(lambda: self._decided(uid_key) is not None, deadline,
                           f"the ncclUniqueId of {key!r} from its creator rank")
                decided = self._decided(uid_key)
        except CollectiveTimeoutError:
            # Only a timeout may still join: the id may have been published just before.
            decided = self._give_up(uid_key, deadline)
            self._advance(base, generation)
            if decided == ABANDONED or creator:
                raise
            self._read(base, generation, members)
            return decided
        except BaseException:  # abort, KeyboardInterrupt, ...: never join, fail the others
            self._give_up(uid_key, deadline)
            self._advance(base, generation)
            raise
        self._advance(base, generation)
        if decided == ABANDONED:
            raise CollectiveTimeoutError(
                f"process group {self._name()!r} rank {self._rank}: creating communicator {key!r} "
                "failed: another rank gave up waiting (timeout or abort)")
        if creator:
            self._forget(base, generation - 1)
        self._read(base, generation, members)
        return decided

    def _read(self, base: str, generation: int, members: int) -> None:
        """This member has the id of ``generation`` (and moved the generation on): the last
        of ``members`` to read it deletes the generation's keys and the generation (everyone
        has read and moved them by then; see the module)."""
        read_key = f"{base}/{generation}/read"
        if self._store.add(read_key, 1) >= members:
            self._delete([f"{base}/{generation}/uid", f"{base}/{generation}/arrived", read_key,
                          f"{base}/generation"])

    def all_arrive(self, key: str, members: int, describe: Callable[[List[int]], str]) -> None:
        """Return once every one of ``members`` ranks (each calls this, with its own rank)
        has arrived at ``key`` (one gathering on this store, asked once). Raises
        CollectiveTimeoutError naming the ranks that did not arrive in time (``describe``
        turns their ranks into words), or what the owner's ``check`` raises (an abort).
        The last of the ranks that arrived to leave, in time or not, deletes the keys, so a
        later gathering under ``key`` starts from nothing."""
        store = self._store
        base = f"cupycoll/{key}"
        keys = [f"{base}/{rank}" for rank in range(members)]
        store.set(keys[self._rank], b"1")
        try:
            self._wait(lambda: store.check(keys), time.monotonic() + self._timeout_s,
                       f"all {members} ranks at {key!r}",
                       lambda: describe([rank for rank, k in enumerate(keys) if not store.check([k])]))
        except BaseException:
            self._leave(base, keys, None)
            raise
        self._leave(base, keys, members)

    def _leave(self, base: str, keys: List[str], arrived) -> None:
        """Count this rank out of a gathering; the last of the ``arrived`` ranks (None: count
        them) deletes its keys. A store error leaves them (the gathering's own error, if
        any, is what the caller raises)."""
        store = self._store
        try:
            if arrived is None:
                arrived = sum(store.check([k]) for k in keys)
            if store.add(f"{base}/left", 1) >= arrived:
                self._delete(keys + [f"{base}/left"])
        except Exception:  # noqa: BLE001 - see the docstring
            pass

    def all_agree(self, key: str, mine: bool, members: int) -> bool:
        """Whether ``mine`` holds on every one of ``members`` ranks, once all have told
        (``key`` names one question on this store, asked once). Raises
        CollectiveTimeoutError when they do not all tell in time. The last rank to read the
        answer deletes the question's keys: every rank has read them by then."""
        store = self._store
        base = f"cupycoll/{key}"
        store.add(f"{base}/yes", int(bool(mine)))
        store.add(f"{base}/told", 1)
        self._wait(lambda: store.add(f"{base}/told", 0) >= members, time.monotonic() + self._timeout_s,
                   f"all {members} ranks to answer {key!r}", lambda: f"{store.add(f'{base}/told', 0)} answered")
        agreed = store.add(f"{base}/yes", 0) >= members
        if store.add(f"{base}/read", 1) == members:
            self._delete(f"{base}/{name}" for name in ("yes", "told", "read"))
        return agreed

    def _publish(self, uid_key: str) -> bytes:
        """The creator decides: PENDING first, so that the id (and NCCL's bootstrap-root
        thread) is made only when no rank gave up, then the id in its place."""
        store = self._store
        claimed = store.compare_set(uid_key, "", PENDING)
        if claimed != PENDING:
            return claimed  # a member gave up first: make no id (it would leak)
        try:
            uid = new_unique_id()
        except BaseException:
            store.compare_set(uid_key, PENDING, ABANDONED)
            raise
        return store.compare_set(uid_key, PENDING, uid)

    def _decided(self, uid_key: str):
        """The generation's decision (an id or ABANDONED), or None while there is none yet."""
        store = self._store
        if not store.check([uid_key]):
            return None
        value = store.get(uid_key)
        return None if value == PENDING else value

    def _give_up(self, uid_key: str, deadline: float) -> bytes:
        """Write ABANDONED unless the generation is decided; return the decision. A creator
        between PENDING and its id is waited for (briefly: it only makes the id)."""
        decided = self._store.compare_set(uid_key, "", ABANDONED)
        if decided != PENDING:
            return decided
        grace = time.monotonic() + min(self._timeout_s, PENDING_GRACE_S)
        while time.monotonic() < grace:
            decided = self._decided(uid_key)
            if decided is not None:
                return decided
            time.sleep(STORE_POLL_S)
        # the creator died while making the id: nobody may use this generation
        decided = self._store.compare_set(uid_key, PENDING, ABANDONED)
        return ABANDONED if decided == PENDING else decided

    def _advance(self, base: str, generation: int) -> None:
        """Move the shared generation past ``generation`` (decided). Anyone may: it is a
        compare_set from that value, so a creator that died before doing it stalls nobody."""
        current = str(generation) if generation else ""  # generation 0 has no key yet
        self._store.compare_set(f"{base}/generation", current, str(generation + 1))

    def _forget(self, base: str, generation: int) -> None:
        """Delete the keys of an earlier generation (store keys would grow with every creation)."""
        if generation >= 0:
            self._delete(f"{base}/{generation}/{suffix}" for suffix in ("uid", "arrived", "read"))

    def _delete(self, keys) -> None:
        delete_keys(self._store, keys)

    def _generation(self, base: str, deadline: float) -> int:
        """This creation's generation: the shared value, moved past any generation that is
        already decided (its creator may have died before moving it on)."""
        store = self._store
        gen_key = f"{base}/generation"
        while True:
            generation = int(store.get(gen_key)) if store.check([gen_key]) else 0
            uid_key = f"{base}/{generation}/uid"
            if not store.check([uid_key]):
                return generation
            if store.get(uid_key) == PENDING:  # its creator is making the id: wait for it
                self._wait(lambda: self._decided(uid_key) is not None, deadline,
                           f"the creator rank to finish communicator {base!r}")
            self._advance(base, generation)

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
