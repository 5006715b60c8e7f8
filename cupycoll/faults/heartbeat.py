"""The watchdog's heartbeat monitor: a second daemon thread that notices when the watchdog
thread itself is stuck.

The watchdog thread (:class:`cupycoll.faults.watchdog_thread.Watchdog`) stamps its heartbeat
before and after each group it polls. A pass only queries events and async errors (microseconds each),
so one that has not finished for :func:`heartbeat_limit` seconds is stuck (the CUDA driver
lock, a communicator lock held by a hung abort): :func:`monitor` logs that once per stuck
pass, with the watchdog's stack, and ends the process when a watched group's policy is
``terminate``. The monitor ends when the watchdog thread does.

Deliberately left out: restarting a stuck watchdog (a Python thread cannot be killed), and
noticing a thread that hangs while holding the GIL (the monitor needs the GIL too).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from typing import Callable, List, Optional, Tuple

from .. import bounds
from ..errors import CupycollError

logger = logging.getLogger(__name__)  # a child of "cupycoll"

def heartbeat_limit(interval: float) -> float:
    """Seconds without a watchdog heartbeat after which the watchdog counts as stuck
    (:data:`cupycoll.bounds.HEARTBEAT_TIMEOUT`, scaled up for long poll intervals)."""
    return max(bounds.HEARTBEAT_TIMEOUT, bounds.HEARTBEAT_INTERVALS * interval)


def monitor(state: Callable[[], Optional[Tuple[threading.Thread, list, float]]],
            wake: threading.Event, terminate: Callable[[object, BaseException], None]) -> None:
    """The monitor thread's body. ``state()``: (the watchdog thread, the groups it polls, its
    last heartbeat), or None once that thread has ended (the monitor then ends); ``wake`` is
    set when the watchdog thread ends; ``terminate(group, error)`` ends the process."""
    reported = None
    while True:
        current = state()
        if current is None:
            return
        thread, watches, beat = current
        limit = heartbeat_limit(max((w.interval for w in watches), default=0.0))
        if time.monotonic() - beat > limit and reported != beat:
            reported = beat  # once per stuck pass
            _stuck(thread, limit, [w for w in watches if w.policy == "terminate"], terminate)
        wake.wait(min(limit / 4, 5.0))
        wake.clear()


def _stuck(thread: Optional[threading.Thread], limit: float, terminating: List[object],
           terminate: Callable[[object, BaseException], None]) -> None:
    frame = sys._current_frames().get(thread.ident) if thread is not None else None
    stack = "".join(traceback.format_stack(frame)) if frame is not None else "(unavailable)\n"
    message = (f"watchdog: no heartbeat for {limit:g} s; the watchdog is stuck and no "
               f"group's faults are being detected. Its stack:\n{stack}")
    logger.critical(message)
    if terminating:
        terminate(terminating[0], CupycollError("the cupycoll watchdog is stuck"))
