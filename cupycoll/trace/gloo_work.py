"""gloo's side of a group's trace: its Works wrapped so that ``wait()`` keeps the flight
recorder and names the rank behind, and its errors read.

:class:`TracedWork` wraps the Work of a CPU call gloo runs (made by
:meth:`cupycoll.trace.group.GroupTrace.gloo`): its ``wait()`` marks the call's entry
completed, or, when gloo raises between the ranks, has the group's trace explain the error
(:meth:`~cupycoll.trace.group.GroupTrace.failure`) and raises what that gives. Both it and a
synchronous call the group waits on itself wait in gloo in slices of
:data:`cupycoll.bounds.CPU_WAIT_SLICE_S` (:func:`wait_in_slices`), so that a fault the
group's lifetime claimed meanwhile fails the call at once rather than at gloo's own
timeout. gloo says what went wrong only in its text: :func:`looks_like_timeout` and
:func:`looks_like_peer_failure` read it.

Deliberately left out: the group's verdict and its diagnosis (:mod:`cupycoll.trace.group`),
and gloo point-to-point Works, which stay gloo's own (``recv_anysource``'s
``source_rank()`` must stay gloo's).
"""

from __future__ import annotations

import datetime
import threading
from typing import Callable, Optional
from weakref import ref

import torch
import torch.distributed as dist

from .. import bounds
from ..errors import CupycollError
from .recorder import E_DTYPES, E_OP, E_ROOT, E_SEQ, E_SHAPES, describe

# Held for a moment, by the first failure of a Work, to make that Work's lock.
_MAKING_LOCKS = threading.Lock()
# How a CPU Work waits in gloo: in slices, so that the group's end fails it meanwhile. What
# c10d's Work.wait(timeout) raises when a slice runs out (every supported torch): gloo's own
# errors, a timeout included, say otherwise ("Timed out waiting 5000ms for ...").
_SLICE = datetime.timedelta(seconds=bounds.CPU_WAIT_SLICE_S)
_SLICE_RAN_OUT = "Operation timed out!"


def wait_in_slices(work: dist.Work, failed: Callable[..., Optional[BaseException]], *args) -> bool:
    """gloo's ``work.wait()``, in slices of CPU_WAIT_SLICE_S: between two, ``failed(*args)``
    says whether the group's end (a peer's published fault, an abort) failed the call
    meanwhile, and that error is raised."""
    while True:
        try:
            return work.wait(_SLICE)
        except RuntimeError as exc:
            if _SLICE_RAN_OUT not in str(exc):
                raise  # gloo's own error
        # the slice ran out, the call still under way
        error = failed(*args)
        if error is not None:
            raise error


def described(entry: Optional[list]) -> str:
    """A CPU call in words, from its flight-recorder entry ("a call" without one)."""
    if entry is None:
        return "a call"
    return describe(entry[E_OP], entry[E_SEQ], entry[E_SHAPES], entry[E_DTYPES])


class TracedWork(dist.Work):
    """A gloo Work whose ``wait()`` keeps the flight recorder and names the rank behind on a
    timeout. Everything else is gloo's Work's.

    Its state is read from gloo's future, never through gloo's ``exception()`` or
    ``is_success()``: torch 2.11 cannot hand ``exception()``'s result to Python, and later
    releases print a deprecation warning for both. A Work gloo gives no future (send, recv)
    answers those two with gloo's own methods. A failure is explained once, by whichever of
    ``wait()``, ``exception()`` and the future meets it first, and all three give that
    same error.

    Made on every CPU call, so it costs little: slots, no lock (the first failure makes
    one), and its group (``trace``: the :class:`~cupycoll.trace.group.GroupTrace` that
    explains its failure) tracks it in a plain dict that its completion leaves."""

    __slots__ = ("_work", "_entry", "_trace", "_outputs", "_waited", "_failing", "_key")

    def __init__(self, work: dist.Work, entry: list, trace, outputs: Optional[list] = None):
        super().__init__()
        self._work = work
        self._entry = entry
        self._trace = trace
        self._outputs = outputs  # the call's outputs, for a future gloo does not give (get_future)
        # [error or None] once wait() returned or raised, or the group closed before it finished
        self._waited: Optional[list] = None
        self._failing: Optional[threading.Lock] = None  # made by the first failure
        key = self._key = entry[E_SEQ] if entry is not None else id(self)
        opened = trace._open
        opened[key] = ref(self)
        if len(opened) > trace._prune_at:
            trace._prune_open()

    @property
    def description(self) -> str:
        return described(self._entry)

    def fail_unfinished(self, error: BaseException) -> None:
        """The group closed: unless gloo finished this Work already, it has failed with
        ``error`` (a later ``wait()`` raises it at once; a ``wait()`` already inside gloo's
        returns when gloo does)."""
        if self._waited is None and not self._work.is_completed():
            self._waited = [error]
            self._trace.recorder.mark(self._entry, "failed")

    def _unfinished(self) -> Optional[BaseException]:
        """What the group's close failed this Work with, while gloo still runs it."""
        waited = self._waited
        return waited[0] if waited is not None else None

    def _finished(self) -> None:
        """Seen finished: the group's close has nothing to fail here."""
        self._trace._open.pop(self._key, None)

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        waited = self._waited
        if waited is not None and waited[0] is not None:
            raise waited[0]
        try:
            done = self._work.wait(timeout) if timeout else wait_in_slices(self._work, self._unfinished)
        except Exception as exc:  # noqa: BLE001 - explained, then raised again
            waited = self._waited
            if waited is not None and exc is waited[0]:
                raise
            error = self._fail(exc)
            if error is exc:
                raise
            raise error from exc
        trace = self._trace
        trace.recorder.mark(self._entry, "completed")
        if done:
            self._waited = _SUCCEEDED
            trace._open.pop(self._key, None)
        return done

    def _fail(self, exc: BaseException) -> BaseException:
        """gloo's error as the group explains it
        (:meth:`~cupycoll.trace.group.GroupTrace.failure`), once: wait(), exception() and
        the future may all see it, and the ranks are asked one time."""
        lock = self._failing
        if lock is None:
            with _MAKING_LOCKS:
                lock = self._failing
                if lock is None:
                    lock = self._failing = threading.Lock()
        with lock:
            if self._waited is None:
                self._trace.recorder.mark(self._entry, "failed")
                error = self._trace.failure(self._entry, exc)
                if error is not exc:
                    error.__cause__ = exc
                self._waited = [error]
                self._finished()
            return self._waited[0]

    def _settled(self, error) -> None:
        self._trace.recorder.mark(self._entry, "completed" if error is None else "failed")
        self._finished()

    def _gloo_future(self):
        try:
            return self._work.get_future()
        except RuntimeError:  # send and recv Works have none
            return None

    def _future_outcome(self, future):
        """(finished, its error or None) from gloo's future."""
        if not future.done():
            return False, None
        error = _future_error(future)
        self._settled(error)
        return True, error

    def is_completed(self) -> bool:
        if self._waited is not None:
            return True
        done = self._work.is_completed()
        future = self._gloo_future() if done and self._waited is None else None
        if future is not None:
            self._future_outcome(future)
        return done

    def is_success(self) -> bool:
        if self._waited is not None:
            return self._waited[0] is None
        future = self._gloo_future()
        if future is None:
            return self._work.is_success()
        finished, error = self._future_outcome(future)
        return finished and error is None

    def exception(self):
        """None while unfinished or successful; on failure the error ``wait()`` raises
        (explaining it asks the other ranks, as the first ``wait()`` would)."""
        if self._waited is not None:
            return self._waited[0]
        future = self._gloo_future()
        if future is not None:
            error = self._future_outcome(future)[1]
            return None if error is None else self._fail(error)
        try:
            return self._work.exception()
        except TypeError:  # torch 2.11: gloo's exception_ptr cannot reach Python
            if not self._work.is_completed() or self._work.is_success():
                return None
            return CupycollError(f"{self!r} failed; wait() raises gloo's error")

    def result(self):
        return self._work.result()

    def source_rank(self) -> int:
        return self._work.source_rank()

    def synchronize(self) -> None:
        self._work.synchronize()

    def get_future(self):
        """gloo's future, continued: its value, or on failure the error wait() raises
        (cupycoll's, naming the rank behind): DDP's comm hooks and async callers consume the
        future, never wait(). An error a callback raises is the only failure a Python future
        can hand to C++ (DDP's reducer), which sees a RuntimeError with its text. The ranks
        are asked on the thread that completes gloo's future.

        Where gloo's Work has no future (its reduce-scatters: "getFuture not implemented"), a
        reduction's Work makes one by waiting on itself: this returns once gloo finished, with
        a completed future holding the outputs, or the error ``wait()`` raises."""
        try:
            gloos = self._work.get_future()
        except RuntimeError:
            if self._outputs is None:
                raise
            return self._waited_future()

        def settle(done):
            error = _future_error(done)
            if error is not None:
                raise self._fail(error)
            self._settled(None)
            return done.value()
        return gloos.then(settle)

    def _waited_future(self) -> torch.futures.Future:
        future = torch.futures.Future()
        try:
            self.wait()
        except Exception as exc:  # noqa: BLE001 - handed to the future, as gloo's own would be
            future.set_exception(exc)
        else:
            future.set_result(list(self._outputs))
        return future

    def __repr__(self) -> str:
        entry = self._entry
        if entry is None:
            return f"TracedWork({self._work!r})"
        return f"TracedWork({self.description}, root={entry[E_ROOT]})"


_SUCCEEDED = [None]  # a TracedWork's ``_waited`` once its wait() returned True


def first_sentence(exc: BaseException) -> str:
    """gloo's "[.../pair.cc:553] Connection closed by peer [host]:port. This is typically
    caused by ..." as "Connection closed by peer [host]:port"."""
    text = (str(exc).strip().splitlines() or [""])[0]
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". ", 1)[0].rstrip(".") or type(exc).__name__


def looks_like_timeout(exc: BaseException) -> bool:
    """Is ``exc`` (raised by a gloo Work's wait) a timeout? gloo says so only in its text."""
    if isinstance(exc, TimeoutError):
        return True
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


# What gloo's errors say when the trouble is between the ranks (a peer died or closed its
# connection), as against an argument this rank passed ("Invalid scalar type", an op gloo
# lacks), which gloo also reports only at wait().
_PEER_WORDS = ("connection", "closed by peer", "reset by peer", "broken pipe", "pair closure", "socket",
               "peer")


def looks_like_peer_failure(exc: BaseException) -> bool:
    """Is ``exc`` (raised by a gloo Work's wait) about a peer or the link to it?"""
    if isinstance(exc, (ConnectionError, EOFError)):
        return True
    text = str(exc).lower()
    return any(words in text for words in _PEER_WORDS)


def _future_error(future) -> Optional[BaseException]:
    try:
        future.wait()
    except Exception as exc:  # noqa: BLE001 - handed back, not raised
        return exc
    return None
