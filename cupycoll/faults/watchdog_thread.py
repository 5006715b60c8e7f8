"""The watchdog thread: one per process, polling every watched group.

:class:`Watchdog` starts its thread when the first group is watched and polls each group
every interval (the smallest of their ``watchdog_interval``): it calls the group's ``poll``
(its lifetime's, :class:`Polled`), which checks the group's watch
(:meth:`cupycoll.faults.watchdog.Watch.check`) and decides. The thread ends when no group is
left, or when a pass raises (logged), and the next watch starts a new one; at process exit
it stops for good (:meth:`Watchdog.stop`). It queries events in thread-local capture mode
(:mod:`cupycoll.faults.watchdog_cuda`), and a monitor thread checks its heartbeat, stamped
before and after each group (:mod:`cupycoll.faults.heartbeat`). :data:`WATCHDOG` is the
process's; a forked child starts it afresh.

Deliberately left out: what is in flight and what is wrong with it (the watch's), what a
finding means (the lifetime's), and any device synchronisation.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Optional, Protocol, Tuple

from . import heartbeat, watchdog_cuda
from .. import hooks
from .last_words import terminate

logger = logging.getLogger(__name__)  # a child of "cupycoll"

_monotonic = time.monotonic


class Polled(Protocol):
    """What the watchdog thread polls: a group's lifetime (cupycoll.faults.lifecycle)."""

    interval: float
    policy: str
    name: str
    pid: int

    def poll(self, now: float) -> None:
        """Check the group's watch and decide on what it finds; never raises."""


class Watchdog:
    """The process's watchdog thread over every registered group, and the monitor thread that
    checks the watchdog's heartbeat."""

    def __init__(self):
        self._reset()

    def _reset(self) -> None:
        self._groups: "weakref.WeakSet[Polled]" = weakref.WeakSet()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._monitor: Optional[threading.Thread] = None
        self._wake = threading.Event()
        self._wake_monitor = threading.Event()  # set when the watchdog thread ends
        self._stopped = False
        self.heartbeat = _monotonic()

    def watch(self, group: Polled) -> None:
        with self._lock:
            self._groups.add(group)
            if self._thread is None and not self._stopped:
                self.heartbeat = _monotonic()
                self._thread = threading.Thread(target=self._run, name="cupycoll-watchdog", daemon=True)
                self._thread.start()
                if self._monitor is None:
                    self._monitor = threading.Thread(
                        target=heartbeat.monitor, args=(self._monitor_state, self._wake_monitor, terminate),
                        name="cupycoll-watchdog-monitor", daemon=True)
                    self._monitor.start()

    def unwatch(self, group: Polled) -> None:
        with self._lock:
            self._groups.discard(group)
        self._wake.set()

    def stop(self) -> None:
        """Stop watching for good (process exit): the thread ends at its next wake-up."""
        with self._lock:
            self._stopped = True
            self._groups = weakref.WeakSet()
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
            logger.exception("the watchdog thread failed; the next tracked collective starts a new one")
        finally:
            with self._lock:
                if self._thread is threading.current_thread():
                    self._thread = None
            self._wake_monitor.set()

    def _poll_once(self) -> Optional[float]:
        """Poll every group once; the time to sleep, or None when the thread should end.
        (A function of its own so that no group stays referenced while the thread sleeps.)"""
        self.heartbeat = _monotonic()
        with self._lock:
            groups = list(self._groups)
            if not groups or self._stopped:
                if self._thread is threading.current_thread():
                    self._thread = None  # a later watch() starts a new thread
                return None
        for group in groups:
            group.poll(_monotonic())
            self.heartbeat = _monotonic()
        return min(group.interval for group in groups)

    def _monitor_state(self) -> Optional[Tuple[threading.Thread, list, float]]:
        """For the heartbeat monitor: (the watchdog thread, its groups, the last heartbeat),
        or None once the thread has ended (the monitor then ends too)."""
        with self._lock:
            if self._thread is None:
                self._monitor = None
                return None
            return self._thread, list(self._groups), self.heartbeat

    def _after_fork_in_child(self) -> None:
        # The child has none of the parent's threads, and may hold copies of locks taken
        # when it forked; its groups' communicators are unusable. Start from scratch.
        self._reset()


WATCHDOG = Watchdog()
hooks.in_forked_child("watchdog", WATCHDOG._after_fork_in_child)
