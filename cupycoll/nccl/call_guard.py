"""NCCL calls counted while they run, so that an abort never frees a communicator under one,
and the watchdog's ncclCommGetAsyncError never runs beside one.

:class:`GuardedCalls` is a part of :class:`cupycoll.nccl.communicator.Communicator`: each NCCL
call on a communicator runs through :meth:`GuardedCalls._guarded` (refused once the
communicator is aborted or shut down; the thread noted while NCCL has it), an NCCL group
that used the communicator is noted until its ``ncclGroupEnd`` (where its calls really
launch, and connect), and ``abort``/``shutdown`` first wait, at most :data:`ENTER_WAIT_S`,
for the calls of other threads to return. NCCL promises no thread safety between calls on
one communicator, ``ncclCommGetAsyncError`` included (it may run NCCL's own clean-up), so a
call or group enters under the lock the watchdog's query holds, and the query is skipped
while one entered less than ENTER_WAIT_S ago is under way (``busy``).

What the class needs of its host: ``state``, ``_handle`` and ``device``.

Deliberately left out: ending a call that does not return (only ncclCommAbort can, so the
wait is bounded and the abort goes ahead), and waiting for a call on the aborting thread
itself (``abort_all`` from a signal handler that interrupted it).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional, Tuple

from ..errors import CommunicatorAbortedError

# How long abort (or destroy) waits for NCCL calls under way on other threads before it
# frees the communicator anyway: an enqueue takes microseconds, so a call inside NCCL for
# longer is blocked (also for the watchdog's query: ``busy``).
ENTER_WAIT_S = 1.0
_USABLE = frozenset(("ok", "initializing"))
_ENDED = frozenset(("aborted", "shut down"))  # terminal: no lock needed to read


class GuardedCalls:
    """The calls under way on one communicator, and the wait for them (see the module)."""

    def _init_guard(self) -> None:
        # Re-entrant: abort_all from a signal handler may run on a thread that the signal
        # interrupted inside one of this lock's blocks.
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)
        # (thread, when it entered, the NCCL function) for each call or open group on it
        self._callers: list = []
        self._group_entries: dict = {}  # thread -> its open group's entry in _callers
        self._aborter_waiting = False  # an abort or destroy waits in _wait_for_callers

    def _guarded(self, function: str, call: Callable[[Optional[int]], object]):
        """``call(handle)``, one NCCL call on this communicator, refused once it is aborted or
        shut down (the handle is gone then, and NCCL would say ncclInvalidArgument) and
        counted while it runs, so that :meth:`abort` waits for it before freeing the
        communicator under it (an abort that waited past ``ENTER_WAIT_S`` makes the call's
        error a CommunicatorAbortedError). ``handle``: the communicator's, read under the lock."""
        me = threading.get_ident()
        with self._lock:
            if self.state not in _USABLE or not self._handle:
                raise CommunicatorAbortedError(
                    f"{function}: the NCCL communicator on cuda:{self.device} was {self.state}")
            entry = (me, time.monotonic(), function)
            self._callers.append(entry)
            handle = self._handle
        try:
            return call(handle)
        except Exception as exc:
            if self.ended:
                raise self.cut_short(function) from exc
            raise
        finally:
            # No lock on the way out (list.remove is atomic): an aborter sets the flag before
            # it first checks ``_callers``, so either it sees this removal or this sees the flag.
            self._callers.remove(entry)
            if self._aborter_waiting:
                with self._lock:
                    self._idle.notify_all()

    def _enter_group(self) -> None:
        """An NCCL group open on this thread uses this communicator until its ncclGroupEnd
        (where the calls really launch, and connect): an abort waits for it as for a call.
        Under the lock, as a call's entry: a ncclCommGetAsyncError under way ends first."""
        me = threading.get_ident()
        with self._lock:
            # its calls launch (and connect) in the group's ncclGroupEnd
            self._group_entries[me] = entry = (me, time.monotonic(), "ncclGroupEnd")
            self._callers.append(entry)

    def _leave_group(self) -> None:
        self._callers.remove(self._group_entries.pop(threading.get_ident()))
        if self._aborter_waiting:
            with self._lock:
                self._idle.notify_all()

    def busy(self) -> bool:
        """A thread entered an NCCL call or group on this communicator less than ENTER_WAIT_S
        ago and is still in it. Asked under the lock: no call can enter until the asker lets
        the lock go. One inside for longer is blocked (a connect, a full launch queue), and
        NCCL's asynchronous error may be the only news of what blocks it: not counted."""
        since = time.monotonic() - ENTER_WAIT_S
        return any(entered > since for _thread, entered, _function in list(self._callers))

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

    def stuck_call(self, after_s: float) -> Optional[Tuple[str, float]]:
        """(NCCL function, seconds inside) of the call or group that entered first, when that
        was more than ``after_s`` ago; None otherwise. A blocking communicator connects inside
        the first call that needs a connection, waiting there for a peer that has not made
        that call: no Work exists yet for the watchdog to time out, this is what it sees."""
        if self.state not in _USABLE:  # aborted: its calls are being ended already
            return None
        oldest = min(list(self._callers), key=lambda entry: entry[1], default=None)
        if oldest is None:
            return None
        seconds = time.monotonic() - oldest[1]
        return (oldest[2], seconds) if seconds > after_s else None

    def _wait_for_callers(self, on_behalf_of: Optional[int] = None) -> None:
        """Under the lock, with the state already changed: let the NCCL calls under way on
        other threads return before the communicator is freed, at most ENTER_WAIT_S. An
        enqueue takes microseconds; one still inside NCCL after that is blocked (a peer that
        never connects, a full queue) and only ncclCommAbort can end it. A caller on this
        thread, or on the thread the abort runs for (``on_behalf_of``: abort_all from a signal
        handler that interrupted it), is not waited for."""
        exempt = {threading.get_ident(), on_behalf_of}
        self._aborter_waiting = True
        try:
            self._idle.wait_for(lambda: all(entry[0] in exempt for entry in self._callers), ENTER_WAIT_S)
        finally:
            self._aborter_waiting = False
