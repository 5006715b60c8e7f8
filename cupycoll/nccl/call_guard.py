"""NCCL calls counted while they run, so that an abort never frees a communicator under one,
and the watchdog's ncclCommGetAsyncError never runs beside one.

:class:`GuardedCalls` is a part of :class:`cupycoll.nccl.communicator.Communicator`. Its rules:

1. every NCCL call on a communicator runs through :meth:`~GuardedCalls._guarded`, which
   refuses it once the communicator is aborted or shut down and notes the thread, the time
   and the function while NCCL has it; an NCCL group that used the communicator is noted the
   same way until its ``ncclGroupEnd`` (where its calls really launch, and connect);
2. NCCL promises no thread safety between calls on one communicator, so ``ncclCommAbort``
   never runs while another thread is inside a call on it: an abort marks the communicator
   aborted (no call enters from then on) and, if a call is inside, leaves ncclCommAbort to
   that call's way out (the last one out runs it). Nothing waits: a call still inside a
   blocking communicator is blocked (a peer that never connects) and only ends with the
   process (the lifetime's rule, :mod:`cupycoll.faults.lifecycle`);
3. the watchdog's ncclCommGetAsyncError enters under the lock the calls enter by and is
   skipped while a call entered less than :data:`cupycoll.bounds.CALL_BLOCKED_S` ago is
   inside (:meth:`~GuardedCalls.busy`); beside one inside for longer (blocked) it goes ahead,
   as NCCL's asynchronous error may be the only news of what blocks it;
4. :meth:`~GuardedCalls.stuck_call` names the oldest call inside NCCL for longer than the
   group's timeout: a blocking communicator connects inside the first call that needs a
   connection, before any CUDA event exists, and the watchdog times that out instead. A call
   made on this communicator for a child (a split, a shrink) is the child's to time out.

What the class needs of its host: ``state``, ``_handle``, ``device`` and ``_abort_now(handle)``.

Deliberately left out: ending a call that does not return (only ncclCommAbort could, and it
may not run beside it), and waiting for a call on the aborting thread itself (``abort_all``
from a signal handler that interrupted it): such a call is not inside NCCL at that moment.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional, Tuple

from .. import bounds
from ..errors import CommunicatorAbortedError

_USABLE = frozenset(("ok", "initializing"))
_ENDED = frozenset(("aborted", "shut down"))  # terminal: no lock needed to read

# A call's note: [thread, when it entered, the NCCL function, for a child: its name]
_THREAD, _ENTERED, _FUNCTION, _FOR_CHILD = range(4)


class GuardedCalls:
    """The calls under way on one communicator, and an abort that waits for none (see the module)."""

    def _init_guard(self) -> None:
        # Re-entrant: abort_all from a signal handler may run on a thread that the signal
        # interrupted inside one of this lock's blocks.
        self._lock = threading.RLock()
        self._callers: list = []  # a note per call or open NCCL group inside NCCL
        self._group_entries: dict = {}  # thread -> its open group's note in _callers
        self._abort_pending = False  # aborted with a call inside: the last one out aborts
        self.fences = 0  # open multi-communicator ncclGroupEnds using it (cupycoll.nccl.group)
        self.abort_done = threading.Event()  # ncclCommAbort returned (or there was none to run)

    def _guarded(self, function: str, call: Callable[[Optional[int]], object], for_child: object = None):
        """``call(handle)``, one NCCL call on this communicator (rule 1). ``for_child``: the
        communicators of the group a split or shrink makes, whose timeout applies (rule 4)."""
        handle, note = self._enter(function, for_child)
        try:
            return call(handle)
        except Exception as exc:
            if self.ended:
                raise self.cut_short(function) from exc
            raise
        finally:
            self._leave(note)

    def _enter(self, function: str, for_child: object = None):
        """Rule 1's way in: (the handle, the call's note), or CommunicatorAbortedError once the
        communicator is aborted or shut down. Every caller leaves by :meth:`_leave`, whatever
        the call did (and raises :meth:`cut_short`'s error for a call an abort ended)."""
        with self._lock:
            handle = self._handle
            if self.state not in _USABLE or not handle:
                raise CommunicatorAbortedError(
                    f"{function}: the NCCL communicator on cuda:{self.device} was {self.state}")
            note = [threading.get_ident(), time.monotonic(), function, for_child]
            self._callers.append(note)
        return handle, note

    def _leave(self, note: list) -> None:
        # No lock to leave (list.remove is atomic): an aborter marks _abort_pending before it
        # reads _callers, so either it sees this note gone or this sees the mark (rule 2).
        self._callers.remove(note)
        if self._abort_pending:
            self._abort_if_last()

    def _enter_group(self) -> None:
        """An NCCL group open on this thread uses this communicator until its ncclGroupEnd.
        Under the lock, as a call's note: a ncclCommGetAsyncError under way ends first."""
        me = threading.get_ident()
        with self._lock:
            self._group_entries[me] = note = [me, time.monotonic(), "ncclGroupEnd", None]
            self._callers.append(note)

    def _leave_group(self) -> None:
        self._leave(self._group_entries.pop(threading.get_ident()))

    def inside(self) -> int:
        """How many calls (or open NCCL groups) are inside NCCL on this communicator now."""
        return len(self._callers)

    def busy(self) -> bool:
        """A call entered less than CALL_BLOCKED_S ago is still inside (rule 3). Asked under
        the lock: no call can enter until the asker lets it go."""
        since = time.monotonic() - bounds.CALL_BLOCKED_S
        return any(note[_ENTERED] > since for note in list(self._callers))

    def blocked(self, after_s: float = bounds.CALL_BLOCKED_S) -> bool:
        """A call has been inside NCCL for longer than ``after_s``: blocked (rule 3)."""
        since = time.monotonic() - after_s
        return any(note[_ENTERED] <= since for note in list(self._callers))

    @property
    def ended(self) -> bool:
        """Aborted or shut down, for good."""
        return self.state in _ENDED

    def cut_short(self, function: str) -> CommunicatorAbortedError:
        """The error of ``function``, a call this communicator's abort (or shutdown) ended."""
        error = CommunicatorAbortedError(
            f"{function}: the NCCL communicator on cuda:{self.device} was {self.state} during the call")
        error.during_call = True
        return error

    def stuck_call(self, after_s: float, now: Optional[float] = None,
                   child: object = None) -> Optional[Tuple[str, float]]:
        """(NCCL function, seconds inside) of the oldest call inside NCCL for more than
        ``after_s``, or None (rule 4). ``child``: only the calls made for that child group;
        None: only this communicator's own."""
        now = time.monotonic() if now is None else now
        oldest = min((note for note in list(self._callers) if note[_FOR_CHILD] is child),
                     key=lambda note: note[_ENTERED], default=None)
        if oldest is None:
            return None
        seconds = now - oldest[_ENTERED]
        return (oldest[_FUNCTION], seconds) if seconds > after_s else None

    # -- the abort (rule 2) ---------------------------------------------------------------
    def _end(self, state: str, on_behalf_of: Optional[int] = None) -> Optional[int]:
        """Under the lock: mark the communicator ``state`` and, unless another thread is inside
        a call on it, take its handle for the caller to end now (None: nothing to end now;
        the last call out ends it). The calling thread, and ``on_behalf_of`` (the thread
        abort_all runs for, from a signal handler), are not inside NCCL while this runs."""
        self.state = state
        self._abort_pending = True
        exempt = (threading.get_ident(), on_behalf_of)
        if any(note[_THREAD] not in exempt for note in list(self._callers)):
            return None
        return self._take_handle()

    def _take_handle(self) -> Optional[int]:
        self._abort_pending = False
        handle, self._handle = self._handle, None
        if not handle:
            self.abort_done.set()
        return handle

    def _abort_if_last(self) -> None:
        with self._lock:
            if not self._abort_pending or self._callers:
                return
            handle = self._take_handle()
        if handle:
            self._abort_now(handle)

    def abort_deferred(self) -> bool:
        """Was this communicator aborted with a call inside that has not come out yet?"""
        return self._abort_pending
