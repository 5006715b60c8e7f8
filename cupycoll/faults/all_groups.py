"""Every live group of the process together: the registry of their lifetimes (:data:`LIVE`),
:func:`abort_all`, and what process exit and a fork do to them.

The backend adds each group's lifetime to :data:`LIVE` when it makes it; the set holds it
weakly, so a group torch drops leaves it. :func:`abort_all` aborts every live group of this
process side by side, from any thread or a signal handler.

**Process exit**: an ``atexit`` hook (:mod:`cupycoll.hooks`) stops the watchdog and aborts
(never destroys: a destroy waits for peers and the GPU) every group that still has
communicators, warning that it was not destroyed, bounded by
:data:`cupycoll.bounds.EXIT_DEADLINE` in all. A forked child leaves its parent's groups
alone, and their lifetimes' locks are made afresh there.

Deliberately left out: how one group ends, and what its state means (its lifetime's,
:mod:`cupycoll.faults.lifecycle`).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import threading
import time
import weakref
from typing import Optional

from .. import bounds, hooks
from .lifecycle import GroupLifetime, GroupState
from .teardown import step
from .watchdog_thread import WATCHDOG

logger = logging.getLogger(__name__)  # a child of "cupycoll"

# Every group's lifetime while the group lives: what abort_all and the exit hook abort.
LIVE: "weakref.WeakSet[GroupLifetime]" = weakref.WeakSet()

# abort_all's callers, by thread: a signal handler that interrupts one must not start another.
_ABORTING_ALL: set = set()


def abort_all(timeout: Optional[float] = None) -> int:
    """Abort every live cupycoll group of this process, from any thread or a signal handler;
    how many were live (not ended). The groups are aborted side by side, each on a thread of
    its own, so one whose ncclCommAbort hangs delays no other; returns once all are done, or
    after ``timeout`` seconds (default :data:`cupycoll.bounds.ABORT_DEADLINE`), whichever
    comes first. Called again on a thread already inside it (a signal handler that interrupted
    it), it returns at once: the aborts under way go on.

    From a signal handler: if the signal interrupted cupycoll itself while it held one of
    its locks, those threads wait for the lock, so this returns after ``timeout`` and the
    aborts finish as soon as the handler returns."""
    timeout = bounds.ABORT_DEADLINE if timeout is None else float(timeout)
    me = threading.get_ident()
    # Not a forking parent's, nor one ended already (shut down, or aborted and done); one
    # whose abort is under way is waited for (a second aborter), not counted as live.
    lives = [life for life in list(LIVE) if life.pid == os.getpid()
             and life.state is not GroupState.SHUT_DOWN and not life.ended.is_set()]
    live = sum(life.state is not GroupState.ABORTED for life in lives)
    if me in _ABORTING_ALL:
        return live
    _ABORTING_ALL.add(me)
    try:
        aborters = [threading.Thread(target=life.abort, name="cupycoll-abort-all", daemon=True) for life in lives]
        for aborter in aborters:
            aborter.start()
        deadline = time.monotonic() + timeout
        for aborter in aborters:
            aborter.join(max(0.0, deadline - time.monotonic()))
    finally:
        _ABORTING_ALL.discard(me)
    return live


def _abort_at_exit() -> None:
    """The atexit hook: see the module docstring."""
    WATCHDOG.stop()
    live = [life for life in list(LIVE)
            if life.pid == os.getpid()  # not a forking parent's groups
            and not life.ended.is_set() and life.state is not GroupState.SHUT_DOWN
            and life.has_communicators()]
    if not live:
        return
    for life in live:
        if life.state is GroupState.ABORTING:
            message = (f"process group {life.name!r} faulted ({life.fault}) and the "
                       f"process exits before its abort ran; aborting its NCCL communicators now.")
        elif life.state is GroupState.ABORTED:
            message = (f"process group {life.name!r} was aborted and the process exits before "
                       f"its communicators were; aborting them now.")
        else:
            message = (f"process group {life.name!r} has NOT been destroyed before "
                       f"the process exits; aborting its NCCL communicators. Call "
                       f"torch.distributed.destroy_process_group() before exiting: otherwise this "
                       f"rank may leave before its peers finish their collectives with it.")
        logger.warning(message)

    def abort_each() -> None:
        for life in live:
            step("aborting a group at exit", life.abort, None, False)

    thread = threading.Thread(target=abort_each, name="cupycoll-exit-abort", daemon=True)
    try:
        thread.start()
    except RuntimeError:  # Python 3.12+: no new threads once the interpreter is finalizing
        # faulthandler's watchdog is a C thread: past the deadline it prints where the
        # abort hangs and ends the process (status 1), as the threaded path would give up.
        faulthandler.dump_traceback_later(bounds.EXIT_DEADLINE, exit=True)
        try:
            abort_each()
        finally:
            faulthandler.cancel_dump_traceback_later()
        return
    thread.join(bounds.EXIT_DEADLINE)
    if thread.is_alive():
        logger.warning("aborting the groups at exit did not finish within %g s; exiting anyway",
                       bounds.EXIT_DEADLINE)


def _after_fork_in_child() -> None:
    # The parent's groups are not the child's (their fault threads are not in it either);
    # a thread of the parent may have held a lifetime's lock when it forked.
    _ABORTING_ALL.clear()
    for life in list(LIVE):
        life.after_fork_in_child()


hooks.at_exit("all_groups", _abort_at_exit)
hooks.in_forked_child("all_groups", _after_fork_in_child)
