"""What cupycoll runs at interpreter exit and in a forked child, in one declared order.

A module that keeps process-wide state registers its hook here by name (:func:`at_exit`,
:func:`in_forked_child`); this module installs one ``atexit`` function and one
``os.register_at_fork(after_in_child=...)`` function that run the registered hooks in the
order of :data:`EXIT_ORDER` and :data:`FORK_ORDER`, whatever order the modules were imported
in. A hook that raises is logged and the next one runs, as ``atexit`` itself does.

Exit, in order:

1. ``diagnosis``: stop the listener threads (rung awake), so that no daemon thread is inside a store call
   while the interpreter finalizes.
2. ``all_groups``: stop the watchdog and abort every group not destroyed, or whose fault's
   abort has not run yet, bounded in all.

In a forked child (whose parent's threads are gone, and whose copies of locks a parent's
thread may have held): the watchdog, the parent's groups and the diagnosis listeners start
afresh, each by its own module's hook.

Deliberately left out: torch's and NCCL's own hooks.
"""

from __future__ import annotations

import atexit
import logging
import os
from typing import Callable, Dict

logger = logging.getLogger(__name__)  # a child of "cupycoll"

EXIT_ORDER = ("diagnosis", "all_groups")
FORK_ORDER = ("watchdog", "all_groups", "diagnosis")

_exit: Dict[str, Callable[[], None]] = {}
_fork: Dict[str, Callable[[], None]] = {}


def at_exit(owner: str, hook: Callable[[], None]) -> None:
    """Run ``hook`` at interpreter exit, at ``owner``'s place in :data:`EXIT_ORDER`."""
    if owner not in EXIT_ORDER:
        raise ValueError(f"{owner!r} has no place in hooks.EXIT_ORDER {EXIT_ORDER}")
    _exit[owner] = hook


def in_forked_child(owner: str, hook: Callable[[], None]) -> None:
    """Run ``hook`` in a forked child, at ``owner``'s place in :data:`FORK_ORDER`."""
    if owner not in FORK_ORDER:
        raise ValueError(f"{owner!r} has no place in hooks.FORK_ORDER {FORK_ORDER}")
    _fork[owner] = hook


def _run(order, hooks: Dict[str, Callable[[], None]], when: str) -> None:
    for owner in order:
        hook = hooks.get(owner)
        if hook is None:
            continue
        try:
            hook()
        except Exception:  # noqa: BLE001 - the next hook still runs
            logger.exception("the %s hook of cupycoll.%s failed", when, owner)


def run_exit_hooks() -> None:
    _run(EXIT_ORDER, _exit, "exit")


def run_fork_hooks() -> None:
    _run(FORK_ORDER, _fork, "fork")


atexit.register(run_exit_hooks)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=run_fork_hooks)
