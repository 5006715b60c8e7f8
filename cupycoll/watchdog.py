"""The watchdog: one background thread that notices stuck or failed collectives.

Each process group that issues CUDA work owns a :class:`Watch`: the Works it has in flight
(in issue order), a way to list its communicators, its timeout and what to do on a fault.
The hot path only calls :meth:`Watch.track` (a timestamp and a deque append). One daemon
thread per process (:class:`Watchdog`, started on demand, gone when nothing is watched)
polls every watch each interval:

* Works whose completion event has fired are dropped, releasing their tensors;
* a Work not done ``timeout`` after it was issued is a timeout fault;
* ``ncclCommGetAsyncError`` reporting an error on any communicator is an async fault.

On a fault the watch hands an exception describing the stalled collective (op, shapes,
dtype, sequence number, peers) to its group's ``on_fault`` (which aborts the communicators
and fails the Works); with the ``terminate`` policy the process then exits, like
``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``.

What a Work must offer the watch (duck-typed, so the state machine is testable with
stand-ins): ``_query_done() -> bool``, ``_issued_at`` (monotonic seconds), ``describe()``
and ``_fail(exc)``.

Deliberately left out: any device synchronisation (events are only queried), flight
recording of past collectives, and retries: a fault is final for its group.
"""

from __future__ import annotations

import collections
import logging
import os
import sys
import threading
import time
import weakref
from typing import Callable, List, Optional

from .errors import CollectiveTimeoutError, CupycollError, NcclError

logger = logging.getLogger("cupycoll")

TERMINATE_EXIT_CODE = 70  # EX_SOFTWARE: an internal error ended the job on purpose


class Watch:
    """The watchdog's view of one group."""

    def __init__(self, name: str, timeout: float, interval: float,
                 communicators: Callable[[], list], on_fault: Callable[[CupycollError], None],
                 policy: str = "raise"):
        self.name = name
        self.timeout = float(timeout)
        self.interval = float(interval)
        self.policy = policy
        self._communicators = communicators
        self._on_fault = on_fault
        self.inflight: collections.deque = collections.deque()
        self.fault: Optional[CupycollError] = None

    def track(self, work) -> None:
        """Hot path: note ``work`` as issued now."""
        work._issued_at = time.monotonic()
        self.inflight.append(work)

    def drain(self, timeout: float) -> bool:
        """Wait (polling events, never syncing) until every tracked Work is done; False on a
        fault or when ``timeout`` seconds pass first. For a clean shutdown."""
        deadline = time.monotonic() + timeout
        inflight = self.inflight
        while inflight:
            if self.fault is not None:
                return False
            if inflight[0]._query_done():
                inflight.popleft()
                continue
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return self.fault is None

    def poll(self, now: Optional[float] = None) -> Optional[CupycollError]:
        """One watchdog pass over this group; returns the fault it found (and handled)."""
        if self.fault is not None:
            return None
        now = time.monotonic() if now is None else now
        inflight = self.inflight
        # popleft only (the hot path appends concurrently; both are atomic on a deque).
        while inflight and inflight[0]._query_done():
            inflight.popleft()
        fault = None
        for work in list(inflight):
            if now - work._issued_at > self.timeout and not work._query_done():
                fault = CollectiveTimeoutError(
                    f"process group {self.name!r}: {work.describe()} did not complete within "
                    f"{self.timeout:g} s; a peer may have hung, died or skipped it")
                break
        if fault is None:
            for comm in self._communicators():
                error = comm.async_error()
                if error is not None:
                    fault = NcclError(error.status, error.function,
                                      f"asynchronous error on process group {self.name!r}", error.last_error)
                    break
        if fault is not None:
            self.handle(fault)
        return fault

    def handle(self, fault: CupycollError) -> None:
        """Record ``fault``, tell the group, and fail every Work still in flight."""
        if self.fault is not None:
            return
        self.fault = fault
        logger.error("cupycoll watchdog: %s; aborting the group's NCCL communicators", fault)
        try:
            self._on_fault(fault)
        finally:
            self.fail_all(fault)

    def fail_all(self, error: BaseException) -> List[object]:
        failed = []
        while self.inflight:
            work = self.inflight.popleft()
            work._fail(error)
            failed.append(work)
        return failed


class Watchdog:
    """The process's watchdog thread over every registered :class:`Watch`."""

    def __init__(self):
        self._watches: "weakref.WeakSet[Watch]" = weakref.WeakSet()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._wake = threading.Event()

    def watch(self, watch: Watch) -> None:
        with self._lock:
            self._watches.add(watch)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="cupycoll-watchdog", daemon=True)
                self._thread.start()

    def unwatch(self, watch: Watch) -> None:
        with self._lock:
            self._watches.discard(watch)
        self._wake.set()

    @property
    def running(self) -> bool:
        return self._thread is not None

    def _run(self) -> None:
        while True:
            interval = self._poll_once()
            if interval is None:
                return
            self._wake.wait(interval)
            self._wake.clear()

    def _poll_once(self) -> Optional[float]:
        """Poll every watch once; the time to sleep, or None when the thread should end.
        (A function of its own so that no watch stays referenced while the thread sleeps.)"""
        with self._lock:
            watches = list(self._watches)
            if not watches:
                self._thread = None  # a later watch() starts a new thread
                return None
        for watch in watches:
            try:
                fault = watch.poll()
            except Exception:  # the watchdog must outlive any one group's failure
                logger.exception("cupycoll watchdog: polling group %r failed", watch.name)
                continue
            if fault is not None:
                self.unwatch(watch)
                if watch.policy == "terminate":
                    _terminate(watch, fault)
        return min(w.interval for w in watches)


def _terminate(watch: Watch, fault: BaseException) -> None:
    message = (f"cupycoll watchdog: terminating the process (on_timeout='terminate') after a "
               f"fault in process group {watch.name!r}: {fault}")
    logger.critical(message)
    print(message, file=sys.stderr, flush=True)
    os._exit(TERMINATE_EXIT_CODE)


WATCHDOG = Watchdog()
