"""The watchdog: one background thread that notices stuck or failed collectives.

Each process group that issues CUDA work owns a :class:`Watch`: the Works it has in flight
(in issue order), a way to list its communicators, its timeout and what to do on a fault.
The hot path only calls :meth:`Watch.track` (a timestamp and a deque append). One daemon
thread per process (:class:`Watchdog`, started on demand, gone when nothing is watched)
polls every watch each interval:

* Works whose completion event has fired are dropped, releasing their tensors (the caller's
  Work may live on);
* a Work not done ``timeout`` after it was issued is a timeout fault;
* a call (or NCCL group) inside NCCL on one of its communicators for longer than
  ``timeout`` is a timeout fault too: a blocking communicator connects inside the first
  call that needs a connection and waits there, in the host, for a peer that has not made
  that call, before any Work exists (``Communicator.stuck_call``);
* ``ncclCommGetAsyncError`` reporting an error on any communicator is an async fault;
* any exception from querying an event or the async error (a sticky CUDA error) is a
  fault of that group too: it must not silence fault handling. Except a query refused
  because another thread captures a CUDA graph: that Work is not done yet.

Events are queried with the group's device current (``Watch.device``, once the group has
one), and the watchdog thread runs in thread-local capture mode, so that it neither creates
a context on cuda:0 nor invalidates a capture (:mod:`cupycoll.faults.watchdog_cuda`).

On a fault the watchdog thread only *detects*; a fault thread handles it, so that one hung
``ncclCommAbort`` cannot blind the other groups. Handling marks every Work in flight
failed (first: a caller woken by the ended kernel must already see the fault), calls the
group's ``on_fault`` (which aborts the communicators), then releases the Works' tensors.
With the ``terminate`` policy the process exits once that is done or after
:data:`FAULT_DEADLINE` seconds, whichever comes first (like
``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` with torch's bounded abort). A monitor thread checks
the watchdog's heartbeat (:mod:`cupycoll.faults.heartbeat`): a pass stuck too long is logged with
the watchdog's stack, and ends the process when a watched group's policy is ``terminate``.

The contract with a Work: it offers the watch the four methods of :class:`Watched`
(``query_done``, ``describe``, ``mark_failed``, ``release``; stand-ins in tests offer the
same), and :meth:`Watch.track` returns a :class:`WatchHandle`, which the Work cancels once
it has seen its own completion (``is_completed()``, a blocking ``wait()``): the watch then
drops it at its next pass without querying its event, as torch's ``_watchdog`` cancels a
``stream_timeout`` handle.

Hooks (default None, set by the group): ``on_done(work)`` runs for each Work found
completed (by the watchdog or a drain); ``on_claim(fault)`` when a fault is claimed, first
(the group refuses calls from then on); ``explain_timeout(work, timeout_s)`` on the fault
thread before a timed-out group is failed (it may block a few seconds): a string it
returns is the CollectiveTimeoutError's message. ``work`` is None for a call stuck inside
NCCL: the hook then explains the batch being launched.

Closing: from a claimed fault or the start of an abort, ``closed`` holds the reason, and a
Work tracked later (its call passed the group's checks before) is failed by ``track``: it
appends, then reads ``closed``; the closer sets ``closed`` before it takes the Works out of
flight, so one side always sees it. ``settled``: the abort has ended the kernels (a late
Work is then released at once, and a second aborter waiting on it may return).

Deliberately left out: any device synchronisation (events are only queried), and
retries: a fault is final for its group. A Python watchdog cannot detect a thread that
hangs while holding the GIL (its monitor needs the GIL too).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import weakref
from typing import Callable, List, Optional, Protocol, Tuple

from . import heartbeat, watchdog_cuda
from .. import hooks
from ..errors import CollectiveTimeoutError, CommunicatorAbortedError, CupycollError, NcclError

logger = logging.getLogger(__name__)  # a child of "cupycoll"

TERMINATE_EXIT_CODE = 70  # EX_SOFTWARE: an internal error ended the job on purpose

# How long a fault thread may take (explain_timeout, up to ~5 s in all, plus ncclCommAbort, which
# takes tens to hundreds of ms when healthy) before ``terminate`` exits without it and
# ``raise`` logs that the abort hangs. torch bounds its abort the same way.
FAULT_DEADLINE = 15.0


class Watched(Protocol):
    """What a Work offers the watch that tracks it."""

    def query_done(self) -> bool:
        """Has the GPU finished it (or has it failed)? Never synchronises."""

    def describe(self) -> str:
        """What a timeout message names: op, sequence number, shapes, peers."""

    def mark_failed(self, error: BaseException) -> None:
        """Record ``error`` (the first one wins); its tensors stay kept until release()."""

    def release(self) -> None:
        """Drop the tensors it kept for the GPU."""


class StuckCall:
    """What :meth:`Watch.check` gives in a Work's place for a call inside NCCL, in the host,
    for longer than the group's timeout: no Work exists for it yet."""

    def __init__(self, function: str, seconds: float):
        self.where = (f"{function} has been inside NCCL for {seconds:.1f} s: a peer has not made this "
                      f"call (a blocking communicator connects inside it, and a split waits there for "
                      f"every rank), or the GPU's launch queue is full behind a stuck kernel")


class WatchHandle:
    """One tracked Work's place in its watch, returned by :meth:`Watch.track`."""

    __slots__ = ("work", "issued_at", "cancelled")

    def __init__(self, work: Watched):
        self.work = work
        self.issued_at = time.monotonic()
        self.cancelled = False

    def cancel(self) -> None:
        """The Work saw its own completion: no timeout can fire for it, and the watch
        drops it (releasing its tensors) at its next pass without querying its event."""
        self.cancelled = True

    def done(self) -> bool:
        return self.cancelled or watchdog_cuda.query_done(self.work)


class Watch:
    """The watchdog's view of one group."""

    def __init__(self, name: str, timeout: float, interval: float,
                 communicators: Callable[[], list], on_fault: Callable[[CupycollError], None],
                 policy: str = "raise", on_done: Optional[Callable[[object], None]] = None,
                 explain_timeout: Optional[Callable[[object, float], Optional[str]]] = None,
                 device=None):
        self.name = name
        # The group's CUDA device (index or torch.device), current while events are queried;
        # None until the group has one (then no guard). Settable: the device comes later.
        self.device = device
        self.timeout = float(timeout)
        self.interval = float(interval)
        self.policy = policy
        self.on_done = on_done
        self.explain_timeout = explain_timeout
        self._communicators = communicators
        self._on_fault = on_fault
        self.on_claim: Optional[Callable[[CupycollError], None]] = None
        self.inflight: collections.deque = collections.deque()
        self.fault: Optional[CupycollError] = None
        self.closed: Optional[BaseException] = None  # see "Closing" in the module docstring
        self.settled = threading.Event()
        self.aborters: set = set()  # the threads running the group's abort (asker, NCCL part)
        self.pid = os.getpid()  # the process whose group this is (a forked child's is not)
        # Guards popping (the watchdog, drain and fail-all all pop; the hot path only
        # appends, which needs no lock) and claiming the fault.
        self._lock = threading.Lock()

    def track(self, work: Watched) -> WatchHandle:
        """Hot path: note ``work`` as issued now; the handle is the Work's to cancel."""
        handle = WatchHandle(work)
        self.inflight.append(handle)
        if self.closed is not None:  # after the append: see "Closing" above
            self._late(handle, self.closed)
        return handle

    def works(self) -> List[Watched]:
        """The Works in flight, in issue order."""
        return [handle.work for handle in list(self.inflight)]

    def close(self, reason: BaseException) -> None:
        """No Work may run from now on (a fault was claimed or the abort begins)."""
        self.closed = self.closed or reason

    def _late(self, handle: WatchHandle, reason: BaseException) -> None:
        """A Work tracked once closed: failed; released too once the abort has returned."""
        handle.work.mark_failed(reason)
        if self.settled.is_set():
            with self._lock:
                try:
                    self.inflight.remove(handle)
                except ValueError:
                    pass  # the abort's last sweep took it
            handle.work.release()

    # -- finding completed Works ---------------------------------------------------------
    def _pop_done(self) -> None:
        """Drop the completed Works at the head, releasing their tensors. Raises what querying
        an event raises (but a refusal during a graph capture: see watchdog_cuda.query_done).

        The event is queried outside the lock (it may be slow); the pop then only happens if
        the head is still the Work queried, so two poppers never drop an unfinished one."""
        inflight = self.inflight
        while inflight:
            head = inflight[0]
            if not head.done():
                return
            with self._lock:
                if not inflight or inflight[0] is not head:
                    continue
                inflight.popleft()
            # Its event fired: the GPU is done with its tensors. (Once closed, it may be done
            # only because it was failed, its kernel still running: the abort releases it.)
            if self.closed is None:
                head.work.release()
            self._done(head.work)

    def _done(self, work) -> None:
        if self.on_done is not None:
            try:
                self.on_done(work)
            except Exception:  # noqa: BLE001 - a hook must not break fault detection
                logger.exception("on_done hook of group %r failed", self.name)

    def drain(self, timeout: float) -> bool:
        """Wait (polling events, never syncing) until every tracked Work is done; False on a
        fault, when querying an event fails, or when ``timeout`` seconds pass first."""
        deadline = time.monotonic() + timeout
        while True:
            if self.fault is not None or self.closed is not None:
                return False
            try:
                with watchdog_cuda.on_device(self.device):
                    self._pop_done()
            except Exception as exc:  # noqa: BLE001 - a sticky CUDA error: not drained
                logger.error("draining group %r failed: %r", self.name, exc)
                return False
            if not self.inflight:
                return self.fault is None
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)

    # -- detecting a fault ---------------------------------------------------------------
    def check(self, now: Optional[float] = None) -> Tuple[Optional[CupycollError], object]:
        """Detect (never handle) a fault: ``(fault, the stalled Work, a StuckCall or None)``."""
        if self.fault is not None or self.closed is not None:
            return None, None
        now = time.monotonic() if now is None else now
        try:
            with watchdog_cuda.on_device(self.device):
                return self._check(now)
        except Exception as exc:  # noqa: BLE001 - e.g. cudaEventQuery after an illegal address
            fault = CommunicatorAbortedError(
                f"process group {self.name!r}: checking its work in flight failed ({exc!r}); "
                f"the GPU or a communicator is in an error state")
            fault.__cause__ = exc
            return fault, None

    def _check(self, now: float) -> Tuple[Optional[CupycollError], object]:
        self._pop_done()
        for handle in list(self.inflight):
            if now - handle.issued_at > self.timeout and not handle.done():
                work = handle.work
                return CollectiveTimeoutError(
                    f"process group {self.name!r}: {work.describe()} did not complete within "
                    f"{self.timeout:g} s; a peer may have hung, died or skipped it"), work
        communicators = self._communicators()
        for comm in communicators:
            if self.closed is not None:  # aborted meanwhile: the abort ends its calls
                return None, None
            stuck = comm.stuck_call(self.timeout)
            if stuck is not None:
                call = StuckCall(*stuck)
                return CollectiveTimeoutError(
                    f"process group {self.name!r}: the call being issued did not complete within "
                    f"{self.timeout:g} s; {call.where}"), call
        for comm in communicators:
            if self.closed is not None:  # aborted meanwhile: its comms are not ours to poll
                return None, None
            error = comm.async_error()
            if error is not None:
                return NcclError(error.status, error.function,
                                 f"asynchronous error on process group {self.name!r}",
                                 error.last_error), None
        return None, None

    def poll(self, now: Optional[float] = None) -> Optional[CupycollError]:
        """One pass over this group, handling a fault on the calling thread; returns the
        fault (after handling it). The watchdog thread uses :meth:`check` instead."""
        fault, work = self.check(now)
        if fault is not None:
            self.handle(fault, work)
            return self.fault
        return None

    # -- handling it ---------------------------------------------------------------------
    def claim(self, fault: CupycollError) -> bool:
        """Make ``fault`` this group's (False: it already has one; a fault is final)."""
        with self._lock:
            if self.fault is not None:
                return False
            self.fault = fault
            self.close(fault)
        try:
            if self.on_claim is not None:
                self.on_claim(fault)
        except Exception:  # noqa: BLE001 - the fault is handled whatever the hook does
            logger.exception("on_claim hook of group %r failed", self.name)
        return True

    def handle(self, fault: CupycollError, work=None, claimed: bool = False) -> None:
        """Record ``fault``; mark every Work in flight failed, tell the group (which aborts
        its communicators), then release the Works' tensors."""
        if not claimed and not self.claim(fault):
            return
        fault = self._explain(fault, work)
        logger.error("%s; aborting the group's NCCL communicators", fault)
        failed = self.mark_failed(fault)
        try:
            self._on_fault(fault)
        except Exception:  # noqa: BLE001 - the Works are failed whatever the abort does
            logger.exception("aborting group %r failed", self.name)
        finally:
            self.release(failed)

    def _explain(self, fault: CupycollError, work) -> CupycollError:
        if self.explain_timeout is None or work is None or not isinstance(fault, CollectiveTimeoutError):
            return fault
        stuck = isinstance(work, StuckCall)
        try:
            message = self.explain_timeout(None if stuck else work, self.timeout)
        except Exception:  # noqa: BLE001 - the plain message still describes the fault
            logger.exception("explain_timeout of group %r failed", self.name)
            return fault
        if isinstance(message, str) and message:
            fault = CollectiveTimeoutError(message + (f" ({work.where})" if stuck else ""))
            self.fault = self.closed = fault
        return fault

    def mark_failed(self, error: BaseException) -> List[Watched]:
        """Take every Work out of flight and mark it failed with ``error``; its tensors stay
        referenced until :meth:`release` (the kernels may still run until the abort). A Work
        whose handle was cancelled has shown its caller that it completed: it stays a
        success (works on another stream can end out of issue order, behind a stuck one)."""
        taken = []
        while True:
            with self._lock:
                if not self.inflight:
                    return taken
                handle = self.inflight.popleft()
            try:
                if not handle.cancelled:
                    handle.work.mark_failed(error)
            finally:
                taken.append(handle.work)

    @staticmethod
    def release(works: List[Watched]) -> None:
        for work in works:
            work.release()


class Watchdog:
    """The process's watchdog thread over every registered :class:`Watch`, and the monitor
    thread that checks the watchdog's heartbeat."""

    def __init__(self):
        self._reset()

    def _reset(self) -> None:
        self._watches: "weakref.WeakSet[Watch]" = weakref.WeakSet()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._monitor: Optional[threading.Thread] = None
        self._wake = threading.Event()
        self._wake_monitor = threading.Event()  # set when the watchdog thread ends
        self._stopped = False
        self.heartbeat = time.monotonic()

    def watch(self, watch: Watch) -> None:
        if watch.closed is not None:  # a late Work of an aborted group: nothing to watch
            return
        with self._lock:
            self._watches.add(watch)
            if self._thread is None and not self._stopped:
                self.heartbeat = time.monotonic()
                self._thread = threading.Thread(target=self._run, name="cupycoll-watchdog", daemon=True)
                self._thread.start()
                if self._monitor is None:
                    self._monitor = threading.Thread(
                        target=heartbeat.monitor, args=(self._monitor_state, self._wake_monitor, _terminate),
                        name="cupycoll-watchdog-monitor", daemon=True)
                    self._monitor.start()

    def unwatch(self, watch: Watch) -> None:
        with self._lock:
            self._watches.discard(watch)
        self._wake.set()

    def stop(self) -> None:
        """Stop watching for good (process exit): the thread ends at its next wake-up."""
        with self._lock:
            self._stopped = True
            self._watches = weakref.WeakSet()
        self._wake.set()

    @property
    def running(self) -> bool:
        """Is the watchdog thread (or its monitor, which follows it out) still alive?"""
        return self._thread is not None or self._monitor is not None

    def _run(self) -> None:
        try:
            # Once per thread: querying events must not break another thread's graph capture.
            watchdog_cuda.use_thread_local_capture_mode()
            while True:
                interval = self._poll_once()
                if interval is None:
                    return
                self._wake.wait(interval)
                self._wake.clear()
        except Exception:  # noqa: BLE001 - a bug here must not end watching for good
            logger.exception("the watchdog thread failed; the next tracked "
                             "collective starts a new one")
        finally:
            # Whatever ended the loop, a later watch() must be able to start a new thread.
            with self._lock:
                if self._thread is threading.current_thread():
                    self._thread = None
            self._wake_monitor.set()

    def _poll_once(self) -> Optional[float]:
        """Poll every watch once; the time to sleep, or None when the thread should end.
        (A function of its own so that no watch stays referenced while the thread sleeps.)"""
        self.heartbeat = time.monotonic()
        with self._lock:
            watches = list(self._watches)
            if not watches or self._stopped:
                if self._thread is threading.current_thread():
                    self._thread = None  # a later watch() starts a new thread
                return None
        for watch in watches:
            fault, work = watch.check()
            if fault is not None and watch.claim(fault):
                self.unwatch(watch)
                handle_fault(watch, fault, work)
            self.heartbeat = time.monotonic()
        return min(w.interval for w in watches)

    def _monitor_state(self) -> Optional[Tuple[threading.Thread, List[Watch], float]]:
        """For the heartbeat monitor: (the watchdog thread, the watches, the last heartbeat),
        or None once the thread has ended (the monitor then ends too)."""
        with self._lock:
            if self._thread is None:
                self._monitor = None
                return None
            return self._thread, list(self._watches), self.heartbeat

    def _after_fork_in_child(self) -> None:
        # The child has none of the parent's threads, and may hold copies of locks taken
        # when it forked; its groups' communicators are unusable. Start from scratch.
        self._reset()


def handle_fault(watch: Watch, fault: CupycollError, work=None) -> threading.Thread:
    """Handle a claimed fault off the watchdog thread, bounded by FAULT_DEADLINE: past it,
    ``terminate`` exits anyway and ``raise`` logs that the group's abort hangs."""
    handler = threading.Thread(target=watch.handle, args=(fault, work, True),
                               name=f"cupycoll-fault-{watch.name}", daemon=True)

    def supervise() -> None:
        try:
            handler.start()
            handler.join(FAULT_DEADLINE)
            if handler.is_alive():
                logger.error("handling the fault of group %r has not finished "
                             "after %g s (ncclCommAbort hangs?); its Works are failed", watch.name,
                             FAULT_DEADLINE)
        finally:
            if watch.policy == "terminate":
                _terminate(watch, watch.fault or fault)

    supervisor = threading.Thread(target=supervise, name=f"cupycoll-fault-{watch.name}-deadline",
                                  daemon=True)
    supervisor.start()
    return supervisor


def _terminate(watch: Watch, fault: BaseException) -> None:
    message = (f"watchdog: terminating the process (on_timeout='terminate') after a "
               f"fault in process group {watch.name!r}: {fault}")
    try:
        logger.critical(message)
    finally:
        os._exit(TERMINATE_EXIT_CODE)


WATCHDOG = Watchdog()
hooks.in_forked_child("watchdog", WATCHDOG._after_fork_in_child)
