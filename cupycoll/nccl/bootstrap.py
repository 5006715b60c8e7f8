"""The bootstrap of a communicator: one fresh ncclUniqueId shared through torch's store.

:class:`StoreBootstrap` is what a :class:`~cupycoll.backend.CudaBackend` uses before every
``ncclCommInitRank``: every member counts itself in, the last one to arrive makes a new
unique id and puts it in the store, and the others wait for it there. It needs a store and
nothing of a process group, so it is tested on its own.

**What it costs the store.** Every wait is served by the store (``store.wait`` on the key that
ends it, in slices of :data:`cupycoll.bounds.STORE_WAIT_S` so that an abort still ends it);
nothing polls. Per rank and communicator: one ``add`` to arrive; then either (the last to
arrive, whose ``add`` returns the member count) a ``compare_set`` to claim the decision and
one to publish the id, or a ``wait`` (one per slice), a ``get`` of the id and an ``add`` to
count itself out; the last rank out deletes the three keys. A rank that arrived in time
makes 3 or 4 calls, whatever the other ranks' skew; ProcessGroupNCCL makes about one.

Four things make it more than a set/get:

* **generations**: the store may outlive the group (``destroy_process_group`` then init
  again on torchrun's store, same group name), so each creation runs in a generation of
  its own, ``.../<g>/...``. Every rank first tries generation 0, where a creation that
  succeeded leaves nothing. A generation some earlier creation used (its keys stay when it
  failed) shows in the arrival count: an ``add`` that returns more than the member count
  (a rank that gave up adds :data:`POISON`) means that generation was decided before this
  rank came, and it moves to the shared ``.../generation`` (moved on by ``compare_set`` from
  its current value, so anyone may move it: a rank that gave up, a rank that finds its
  generation taken), so a creator dying before the move leaves nobody reusing an old id;
* **arrival first, then the id**: the id is made only once all members have arrived, by the
  last one. ``ncclGetUniqueId`` starts a bootstrap-root thread with a listening socket that
  nothing can stop, so an id made for peers that never come leaks both;
* **one decision per generation**: the last to arrive first claims the decision
  (``.../uid`` from nothing to ``PENDING``, a ``compare_set``) and only then makes the id, so
  losing the race to a rank that gave up makes no id; the id itself is published once, by
  ``compare_set``, to the key the others wait on (``.../id``). A rank that gives up adds
  :data:`POISON` to the arrivals and writes ``ABANDONED`` in the claim's place (and in the
  id's, waking the others), or, when the claim was made, waits briefly for the id. Who
  comes first decides for everyone, so a rank that gave up never leaves the others inside
  NCCL init waiting for it. One that *timed out* just after the id was published joins; an
  abort or a ``KeyboardInterrupt`` never does (it abandons an undecided generation and
  re-raises);
* **no keys left**: the ranks that waited count themselves out after reading the id (on the
  arrival counter), and the last one deletes the generation's keys, those of every earlier
  generation and the shared generation itself, so the next creation under the name starts
  again at 0. That is safe because no rank can start the next creation under the same
  name before every member has finished this one: NCCL's init returns only once every
  member has joined it, and each joins after its last store call here. A creation that
  failed leaves its keys, for the next one to step past;
* **abortable waits**: before each slice of a wait the owner's ``check`` callback runs, so
  ``abort()`` from another thread ends the wait within a slice.

Known limit: the store alone cannot tell a rank arriving late for a generation that was
abandoned without it from an early rank of the next group incarnation (both count in the
same generation), so such a late rank can still be counted in, and join, the next
incarnation's creation. Telling them apart needs an identity of the group incarnation
agreed by its ranks when the group is made, which the backend does not have yet.

It also holds the survivors' arrival at a shrink (:meth:`StoreBootstrap.all_arrive`), which
names the ones missing, and their agreement on how to shrink (:meth:`StoreBootstrap.all_agree`),
both waiting the same way: the last rank to count itself in publishes that all are there.

Deliberately left out: NCCL itself (creating the communicator is the backend's), local
checks (the backend runs them before calling in, see ``Communicator.preflight``), and any
store other than torch's. A store ``wait`` that times out is reported by torch's TCPStore
client as a warning line on stderr, once per slice a rank waits past.
"""

from __future__ import annotations

import datetime
import time
from typing import Callable, List, Optional

from .. import bounds
from .communicator import new_unique_id
from ..errors import CollectiveTimeoutError, CupycollValueError

# What a rank that gave up writes in place of a generation's unique id (never 128 bytes).
ABANDONED = b"abandoned"
# What the last rank to arrive writes first (its claim on the decision) while it makes the id.
PENDING = b"pending"
# What a rank that gave up adds to a generation's arrivals: every later arrival then counts
# more than the members, and steps past the generation (see the module).
POISON = 1 << 40


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


def store_timeout(seconds: float) -> datetime.timedelta:
    """``seconds`` as a store call's timeout, never under 1 ms: torch's stores read a timeout
    that rounds to 0 ms as none at all (a wait for good)."""
    return datetime.timedelta(milliseconds=max(1, int(seconds * 1000)))


def is_store_timeout(exc: BaseException) -> bool:
    """Did a store ``wait`` time out (rather than the store fail)? torch's stores raise a
    DistStoreError (TCPStore, HashStore) or a RuntimeError saying so (FileStore)."""
    return isinstance(exc, RuntimeError) and "timeout" in str(exc).lower()


class _Keys:
    """The keys of one generation of one communicator."""

    __slots__ = ("base", "generation", "uid", "id", "arrived")

    def __init__(self, base: str, generation: int):
        self.base, self.generation = base, generation
        prefix = f"{base}/{generation}"
        self.uid, self.id, self.arrived = f"{prefix}/uid", f"{prefix}/id", f"{prefix}/arrived"

    def all(self) -> List[str]:
        return [self.uid, self.id, self.arrived]


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
        """The ncclUniqueId of communicator ``key`` among ``members`` ranks, once all of
        them have arrived (``creator``: this rank's timeout names the ranks that did not).
        Raises CollectiveTimeoutError when they do not all arrive in time or one of them
        gave up (everyone of the generation fails)."""
        store = self._store
        base = f"cupycoll/{key}"
        deadline = time.monotonic() + self._timeout_s
        keys, ticket = _Keys(base, 0), 0
        while True:
            ticket = store.add(keys.arrived, 1)
            if ticket <= members:
                break
            keys = _Keys(base, self._step_past(base, keys.generation))  # decided before this rank came
        try:
            if ticket == members:  # the last to arrive: every member is here, make the id
                decided = self._publish(keys)
            else:
                decided = self._wait_for_id(keys, deadline, key, members, creator)
        except CollectiveTimeoutError:
            # Only a timeout may still join: the id may have been published just before.
            decided = self._give_up(keys)
            if decided == ABANDONED:
                raise
        except BaseException:  # abort, KeyboardInterrupt, ...: never join, fail the others
            self._give_up(keys)
            raise
        if decided == ABANDONED:
            self._advance(base, keys.generation)
            raise CollectiveTimeoutError(
                f"process group {self._name()!r} rank {self._rank}: creating communicator {key!r} "
                "failed: another rank gave up waiting (timeout or abort)")
        if ticket != members:
            self._read(keys, members)
        return decided

    def _wait_for_id(self, keys: _Keys, deadline: float, key: str, members: int, creator: bool) -> bytes:
        store = self._store

        def arrived() -> str:
            return f"{store.add(keys.arrived, 0) % POISON} arrived"
        if creator:
            what = f"all {members} ranks to join communicator {key!r}"
        else:
            what = f"the ncclUniqueId of {key!r}, which the last of its {members} ranks to arrive makes"
        self._wait(keys.id, deadline, what, arrived)
        return store.get(keys.id)

    def _read(self, keys: _Keys, members: int) -> None:
        """This member waited for the id and has it: it counts itself out on the arrivals
        (after every member's arrival: ``members`` + the ``members - 1`` readers), and the
        last one deletes the generation's keys, every earlier generation's and the shared
        generation (everyone has stepped past them by then; see the module)."""
        if self._store.add(keys.arrived, 1) % POISON != 2 * members - 1:
            return
        stale = [k for g in range(keys.generation) for k in _Keys(keys.base, g).all()]
        self._delete(keys.all() + stale + ([f"{keys.base}/generation"] if keys.generation else []))

    def all_arrive(self, key: str, members: int, describe: Callable[[List[int]], str],
                   timeout_s: Optional[float] = None) -> None:
        """Return once every one of ``members`` ranks (each calls this, with its own rank)
        has arrived at ``key`` (one gathering on this store, asked once), waiting at most
        ``timeout_s`` (default: the timeout). Raises CollectiveTimeoutError naming the
        ranks that did not arrive in time (``describe`` turns their ranks into words), or
        what the owner's ``check`` raises (an abort). The last of the ranks that arrived to
        leave, in time or not, deletes the keys, so a later gathering under ``key`` starts
        from nothing."""
        store = self._store
        base = f"cupycoll/{key}"
        keys = [f"{base}/{rank}" for rank in range(members)]
        store.set(keys[self._rank], b"1")  # who came, for the names of those who did not
        done = f"{base}/all"
        if store.add(f"{base}/count", 1) == members:
            store.set(done, b"1")
        limit = self._timeout_s if timeout_s is None else float(timeout_s)
        try:
            self._wait(done, time.monotonic() + limit, f"all {members} ranks at {key!r}",
                       lambda: describe([rank for rank, k in enumerate(keys) if not store.check([k])]),
                       limit)
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
                self._delete(keys + [f"{base}/{name}" for name in ("left", "count", "all")])
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
        if store.add(f"{base}/told", 1) == members:
            store.set(f"{base}/all", b"1")
        self._wait(f"{base}/all", time.monotonic() + self._timeout_s, f"all {members} ranks to answer {key!r}",
                   lambda: f"{store.add(f'{base}/told', 0)} answered")
        agreed = store.add(f"{base}/yes", 0) >= members
        if store.add(f"{base}/read", 1) == members:
            self._delete(f"{base}/{name}" for name in ("yes", "told", "read", "all"))
        return agreed

    def _publish(self, keys: _Keys) -> bytes:
        """The last to arrive decides: the claim (PENDING) first, so that the id (and NCCL's
        bootstrap-root thread) is made only when no rank gave up, then the id, once, where
        the others wait for it."""
        store = self._store
        claimed = store.compare_set(keys.uid, "", PENDING)
        if claimed != PENDING:
            if claimed == ABANDONED:  # a member gave up first: make no id (it would leak)
                store.compare_set(keys.id, "", ABANDONED)
            return claimed
        try:
            uid = new_unique_id()
        except BaseException:
            store.compare_set(keys.id, "", ABANDONED)
            raise
        return store.compare_set(keys.id, "", uid)

    def _give_up(self, keys: _Keys) -> bytes:
        """Write ABANDONED unless the generation is decided; return the decision. A last
        arrival between its claim and its id is waited for (briefly: it only makes the id)."""
        store = self._store
        store.add(keys.arrived, POISON)  # later arrivals step past this generation
        decided = store.compare_set(keys.uid, "", ABANDONED)
        if decided == ABANDONED:
            store.compare_set(keys.id, "", ABANDONED)  # wakes the members waiting for the id
        if decided != PENDING:
            if decided == ABANDONED:
                self._advance(keys.base, keys.generation)
            return decided
        grace = min(self._timeout_s, bounds.PENDING_GRACE_S)
        try:
            store.wait([keys.id], store_timeout(grace))
        except Exception as exc:  # noqa: BLE001 - a timeout: the maker died making the id
            if not is_store_timeout(exc):
                raise
        # Whoever writes the id key first decides: the id, or ABANDONED if the maker is gone.
        decided = store.compare_set(keys.id, "", ABANDONED)
        if decided == ABANDONED:
            self._advance(keys.base, keys.generation)
        return decided

    def _advance(self, base: str, generation: int) -> None:
        """Move the shared generation past ``generation`` (decided). Anyone may: it is a
        compare_set from that value, so a rank that died before doing it stalls nobody."""
        current = str(generation) if generation else ""  # generation 0 has no key
        self._store.compare_set(f"{base}/generation", current, str(generation + 1))

    def _step_past(self, base: str, generation: int) -> int:
        """The generation to use after finding ``generation`` decided: the shared one, moved
        past it if it is not yet."""
        store = self._store
        gen_key = f"{base}/generation"
        shared = self._generation_value(gen_key)
        if shared > generation:
            return shared
        moved = store.compare_set(gen_key, str(shared) if shared else "", str(generation + 1))
        return self._parse_generation(moved, gen_key)

    def _generation_value(self, gen_key: str) -> int:
        store = self._store
        return self._parse_generation(store.get(gen_key), gen_key) if store.check([gen_key]) else 0

    def _parse_generation(self, value, gen_key: str) -> int:
        """A generation read from the store: a whole number, or a typed error naming it (any
        client of the store may have written the key)."""
        text = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
        if not text.isdigit():
            raise CupycollValueError(
                f"process group {self._name()!r} rank {self._rank}: the store's {gen_key!r} holds "
                f"{text[:40]!r}, not a generation number; delete the key (another program wrote it)")
        return int(text)

    def _delete(self, keys) -> None:
        delete_keys(self._store, keys)

    def _wait(self, key: str, deadline: float, what: str, progress: Callable[[], str] = lambda: "",
              limit: Optional[float] = None) -> None:
        """Wait, served by the store, until ``key`` exists, the deadline passes or the owner
        is aborted (checked before every slice of at most STORE_WAIT_S seconds)."""
        store = self._store
        while True:
            self._check()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                detail = progress()
                raise CollectiveTimeoutError(
                    f"process group {self._name()!r} rank {self._rank}: timed out after "
                    f"{self._timeout_s if limit is None else limit:g} s waiting for {what}"
                    + (f" ({detail})" if detail else ""))
            try:
                store.wait([key], store_timeout(min(bounds.STORE_WAIT_S, remaining)))
                return
            except Exception as exc:  # noqa: BLE001 - a slice ran out: check, then wait on
                if not is_store_timeout(exc):
                    raise
