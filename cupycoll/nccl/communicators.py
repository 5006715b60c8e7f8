"""The communicators of one group, in one object that its backend (to issue) and its
lifetime (to watch and end them) both hold.

:class:`Communicators` holds the group's own communicator, its two-rank pair communicators,
those being created (an abort must reach them), the blocking creations under way that no
communicator holds yet, the parent a child is being made from, and the algorithms' runners
on them. It answers the watchdog (the oldest call stuck inside NCCL; whether a
multi-communicator ncclGroupEnd is under way; whether an aborted one is blocked) and ends
them all: each aborted whatever the others did, side by side, within a deadline.

Deliberately left out: one communicator's calls and its own end
(:mod:`cupycoll.nccl.communicator`), and when to abort or shut down (the group's lifetime,
:mod:`cupycoll.faults.lifecycle`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Optional, Tuple

from .. import bounds
from .communicator import Communicator


class Communicators:
    """The communicators of one group, which its backend issues on and its lifetime watches
    and ends: the group's own (``group``), its two-rank pair communicators by peer
    (``pairs``), those being created (``pending``: an abort must reach them), the blocking
    creations under way that no communicator holds yet (``creating``), and the algorithms'
    runners on them (``runners``, each with ``close()``)."""

    def __init__(self):
        self.group: Optional[Communicator] = None
        self.pairs: dict = {}
        self.pending: list = []
        self.creating: list = []  # [thread, when it entered, the NCCL function] per creation
        self.runners: dict = {}  # (algorithm, id(communicator)) -> its runner
        # While the group's communicator is split, or shrunk, from a parent's: that parent
        # (its calls made for this group are noted under this object, and are this group's).
        self.parent: Optional[Communicator] = None

    def all(self) -> list:
        """The communicators made (the pair ones, then the group's)."""
        comms = list(self.pairs.values())
        if self.group is not None:
            comms.append(self.group)
        return comms

    def reachable(self) -> list:
        """Those being created too: what an abort must reach."""
        return list(self.pending) + self.all()

    @contextlib.contextmanager
    def creation(self, function: str):
        """A blocking creation under way on this thread: no communicator holds it yet, but
        the watchdog must see it (it waits for every peer inside NCCL)."""
        note = [threading.get_ident(), time.monotonic(), function]
        self.creating.append(note)
        try:
            yield
        finally:
            self.creating.remove(note)

    def stuck_call(self, after_s: float, now: Optional[float] = None,
                   ended: bool = False) -> Optional[Tuple[str, float]]:
        """(NCCL function, seconds inside) of the oldest call of this group inside NCCL for
        more than ``after_s``: on its communicators, its blocking creations, and the calls
        its parent makes for it (a split, a shrink); None when there is none. ``ended``: on
        aborted communicators too (their calls are the group's end's, not a new fault)."""
        now = time.monotonic() if now is None else now
        found = [comm.stuck_call(after_s, now) for comm in self.reachable() if ended or not comm.ended]
        found += [(note[2], now - note[1]) for note in list(self.creating) if now - note[1] > after_s]
        if self.parent is not None:
            found.append(self.parent.stuck_call(after_s, now, child=self))
        found = [item for item in found if item is not None]
        return max(found, key=lambda item: item[1], default=None)

    def fenced(self) -> bool:
        """Is a multi-communicator ncclGroupEnd under way on them (cupycoll.nccl.group)?"""
        return any(comm.fences for comm in self.all())

    def blocked(self) -> bool:
        """Is a call inside NCCL on an aborted communicator that NCCL's abort could not be run
        beside (a blocking call that never returns), or a creation still under way?"""
        return bool(self.creating) or any(comm.abort_deferred() for comm in self.reachable())

    def abort(self, asker: Optional[int] = None) -> list:
        """Abort every communicator, each whatever the others did; the errors met. With more
        than one, their aborts run side by side, one thread each (on behalf of ``asker``, the
        thread that asked: see :meth:`Communicator.abort`), waited for at most
        ``bounds.ABORT_DEADLINE`` in all: an abort frees the communicator's memory, and where
        that free synchronises the device (``NCCL_CUMEM_ENABLE=0``: ``cudaFree``) it waits for
        every kernel on it, a stuck kernel of a communicator not aborted yet included, which
        only that communicator's own abort ends."""
        errors: list = []

        def run(comm) -> None:
            try:
                comm.abort(asker)
            except BaseException as exc:  # noqa: BLE001 - every communicator is attempted
                errors.append((comm, exc))
        comms = self.reachable()
        if len(comms) <= 1:
            for comm in comms:
                run(comm)
            return errors
        if asker is None:
            asker = threading.get_ident()  # this thread, which is not inside NCCL
        threads = [threading.Thread(target=run, args=(comm,), name="cupycoll-abort-communicator", daemon=True)
                   for comm in comms]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + bounds.ABORT_DEADLINE
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return list(errors)

    def settled(self, timeout: float, blocked_after: float) -> bool:
        """Wait at most ``timeout`` seconds for every aborted communicator's ncclCommAbort to
        have returned; False if one has not (a hung abort), at once if one is left to a call
        inside NCCL for longer than ``blocked_after`` (blocked: it may never come out)."""
        deadline = time.monotonic() + timeout
        for comm in self.reachable():
            if not comm.ended or comm.abort_done.is_set():
                continue
            if comm.abort_deferred() and comm.blocked(blocked_after):
                return False
            if not comm.abort_done.wait(max(0.0, deadline - time.monotonic())):
                return False
        return True

    def close_runners(self) -> list:
        """Close the algorithms' runners (their scratch and streams); the errors met."""
        runners, self.runners = list(self.runners.items()), {}
        errors = []
        for (algorithm, _), runner in runners:
            try:
                runner.close()
            except BaseException as exc:  # noqa: BLE001 - teardown goes on
                errors.append((algorithm, exc))
        return errors
