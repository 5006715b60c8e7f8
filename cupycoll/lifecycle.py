"""How a CUDA group ends: shutdown, abort, and the abort at process exit.

The rules these functions keep (the guarantees docs/design.md states):

* **abort** (``CudaBackend.abort``; the watchdog's fault path; ``abort_all``) first marks
  the group ``"aborted"`` and every Work in flight failed, *then* calls ``ncclCommAbort``
  on each communicator, and releases the Works' tensors and ring scratch only after the
  aborts returned: a caller woken by the ended kernel already sees the fault, and no
  buffer is freed under a kernel that still runs. Every step and every communicator is
  attempted whatever an earlier one raised; nothing is retried. ``ncclCommAbort`` and the
  release after it run on a thread of their own, waited for at most :data:`ABORT_DEADLINE`
  seconds: an abort returns within that bound even when NCCL's abort hangs (the tensors then
  stay held until it returns). The group's watch is closed
  with the state (a Work tracked later fails: see cupycoll.watchdog), and a second aborter
  (the fault thread, abort_all) waits, at most ``watchdog.FAULT_DEADLINE`` seconds, for the
  first one's ncclCommAbort before it returns (and its caller releases anything).
  A claimed watchdog fault marks the group ``"aborting"`` at once: calls are refused while
  the fault is diagnosed, before the abort itself; until that abort ran, the group's backend
  is held here, so that torch dropping the group meanwhile cannot skip it (the fault thread
  reaches the backend weakly, and CuPy's ``__dealloc__`` would ``ncclCommDestroy`` a
  communicator with a hung kernel).
* **shutdown** (``destroy_process_group``) never raises: it waits at most
  :data:`SHUTDOWN_GRACE` seconds (and never more than the group's timeout) for the work in
  flight, then finalizes and destroys the communicators; if the work does not finish,
  anything fails, or a communicator cannot be finalized, it aborts instead. During a fault's
  diagnosis (``"aborting"``) it runs the fault's abort at once (the fault thread's then
  waits for it, as a second aborter).
* **process exit**: an ``atexit`` hook stops the watchdog and aborts (never destroys: a
  destroy waits for peers and the GPU) every group still alive, warning that it was not
  destroyed, and every group whose fault's abort has not run yet, bounded by
  :data:`EXIT_DEADLINE` seconds in all. A forked child leaves the
  groups of its parent alone (their communicators are the parent's).

Deliberately left out: anything in ``__del__`` (a collective teardown at garbage
collection runs in whatever thread collects, possibly the watchdog's), and retries.
"""

from __future__ import annotations

import atexit
import faulthandler
import logging
import os
import sys
import threading
import warnings
from typing import Optional

from . import watchdog
from .errors import CommunicatorAbortedError
from .watchdog import WATCHDOG

logger = logging.getLogger(__name__)  # a child of "cupycoll"

# destroy_process_group's wait for work still in flight before it aborts instead. Short:
# work a program never waited for at destroy time is either done in microseconds or stuck
# (an unmatched send, a peer that already left), and torch's own shutdown is an abort.
SHUTDOWN_GRACE = 10.0

# The atexit abort of the groups never destroyed, in all: past it the process exits anyway.
EXIT_DEADLINE = 10.0

# How long any abort a user can call (group.abort(), abort_all(), a shutdown that falls back
# to an abort) waits for ncclCommAbort before it returns anyway, and how long a second
# aborter waits for the first.
ABORT_DEADLINE = watchdog.FAULT_DEADLINE

# Makes abort's check-and-set of the state atomic (the watchdog's fault thread, abort_all in
# a signal handler and the user may abort at once). Held only for the check, never across NCCL.
_STATE_LOCK = threading.Lock()

# The backends marked "aborting" whose abort has not run yet (see the module docstring).
_ABORTING: set = set()


def _warn(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=4)


def _step(what: str, function, *args) -> Optional[BaseException]:
    """Run one teardown step; a failure is reported, and returned, never raised."""
    try:
        function(*args)
    except BaseException as exc:  # noqa: BLE001 - teardown must finish every step
        _warn(f"cupycoll: {what} failed: {exc!r}")
        return exc
    return None


def abort(backend, reason: Optional[BaseException] = None, bounded: bool = True) -> None:
    """``CudaBackend.abort``: see the module docstring. Raises only a KeyboardInterrupt or
    SystemExit met on the way, and only after every step has run. ``bounded=False``: the
    caller bounds the whole abort itself (the exit hook), so ncclCommAbort runs inline."""
    if reason is None:
        reason = CommunicatorAbortedError(f"process group {backend._name()!r} was aborted")
    watch = backend._watch
    with _STATE_LOCK:
        second = backend.state == "aborted"
        if not second:
            backend.state = "aborted"
            watch.close(reason)  # before the Works are marked: a late one fails in track
            watch.aborters.add(threading.get_ident())
    if second:
        # Never return (so that the caller releases anything) under a kernel still running.
        if threading.get_ident() not in watch.aborters and not watch.settled.wait(ABORT_DEADLINE):
            _warn(f"cupycoll: the abort of process group {backend._name()!r} has not finished "
                  f"after {ABORT_DEADLINE:g} s (ncclCommAbort hangs?)")
        return
    interrupts = []
    failed = []

    def mark() -> None:
        failed.extend(backend._watch.mark_failed(reason))

    # Queued (never issued) Works fail with the same reason; they hold no running kernel.
    for what, step in (("dropping the queued calls", lambda: backend.calls.drop(reason)),
                       ("stopping the watchdog's tracking", backend._stop_watching),
                       ("failing the Works in flight", mark)):
        interrupts.append(_step(what, step))
    asker = threading.get_ident()

    def end_kernels_then_release() -> None:
        watch.aborters.add(threading.get_ident())  # an abort re-entered from here waits for nothing
        try:
            for comm in list(backend._pending_comms) + backend.communicators():
                interrupts.append(_step(f"aborting {comm}", comm.abort, asker))
        finally:
            # Only now, with the kernels ended, may the Works' tensors and scratch be released
            # (with those tracked late, once settled: any later one releases itself).
            watch.settled.set()
            interrupts.append(_step("failing the Works tracked late", mark))
            interrupts.append(_step("releasing the Works' tensors", watch.release, failed))
            interrupts.append(_step("closing the rings", backend._close_rings))
            interrupts.append(_step("shutting down the group's CPU half", backend._on_abort))
            _ABORTING.discard(backend)

    if not bounded:
        end_kernels_then_release()
        _reraise(interrupts)
        return
    # ncclCommAbort can hang (NCCL's known hangs): it runs on a thread of its own, and the
    # caller waits for it at most ABORT_DEADLINE. Past that the Works have failed already and
    # their tensors stay held until it returns (a kernel may still use them).
    finisher = threading.Thread(target=end_kernels_then_release, name="cupycoll-abort", daemon=True)
    try:
        finisher.start()
    except RuntimeError:  # Python 3.12+ at interpreter exit: no new threads; the exit hook bounds it
        end_kernels_then_release()
    else:
        if not watch.settled.wait(ABORT_DEADLINE):
            _warn(f"cupycoll: ncclCommAbort of process group {backend._name()!r} has not returned after "
                  f"{ABORT_DEADLINE:g} s; its Works have failed, and their tensors stay held until it does")
        else:
            finisher.join(ABORT_DEADLINE)
    _reraise(interrupts)


def _reraise(interrupts) -> None:
    """Raise the first KeyboardInterrupt or SystemExit a step met (after every step ran)."""
    for exc in interrupts:
        if exc is not None and not isinstance(exc, Exception):
            raise exc


def refuse(backend, fault: BaseException) -> None:
    """The watchdog claimed ``fault`` (its Watch's ``on_claim``): refuse calls from now on,
    while the fault thread diagnoses it and until its abort runs."""
    with _STATE_LOCK:
        if backend.state == "ok":
            backend.fault = fault
            backend.state = "aborting"
            _ABORTING.add(backend)  # until the abort ran, whatever torch drops


def shutdown(backend) -> None:
    """``CudaBackend.shutdown``: see the module docstring. Never raises."""
    if backend.state == "aborting":
        # The fault thread is still diagnosing; the group may be gone once we return.
        _step("aborting a group whose fault is being diagnosed", abort, backend, backend.fault)
        return
    if backend.state != "ok":
        return
    timeout = backend.settings.timeout.total_seconds()
    try:
        try:
            backend.calls.flush()
        except Exception:  # noqa: BLE001 - the Works of that batch carry the error
            pass
        drained = backend._watch.drain(min(SHUTDOWN_GRACE, timeout))
    except BaseException as exc:  # noqa: BLE001 - shutdown never raises; abort instead
        _warn(f"cupycoll: shutting down process group {backend._name()!r} failed ({exc!r}); aborting it")
        drained = False
    if not drained:
        abort(backend, CommunicatorAbortedError(
            f"process group {backend._name()!r} was shut down with work that did not finish "
            f"within {min(SHUTDOWN_GRACE, timeout):g} s; it was aborted"))
        return
    with _STATE_LOCK:
        if backend.state != "ok":
            return
        backend.state = "shut down"
    _step("stopping the watchdog's tracking", backend._stop_watching)
    _step("closing the rings", backend._close_rings)
    for comm in backend.communicators():
        if _step(f"shutting down {comm}", comm.shutdown, timeout) is not None:
            _step(f"aborting {comm} after its shutdown failed", comm.abort)


def _abort_at_exit() -> None:
    """The atexit hook: see the module docstring."""
    WATCHDOG.stop()
    process_group = sys.modules.get("cupycoll.process_group")
    groups = list(getattr(process_group, "_LIVE_GROUPS", ()))
    backends = [g._cuda for g in groups if getattr(g, "_cuda", None) is not None]
    # A group whose fault is still being diagnosed ("aborting") has not run its abort yet:
    # aborted here too, or CuPy's teardown would destroy a communicator with a hung kernel.
    backends += [b for b in list(_ABORTING) if b not in backends]
    live = [b for b in backends
            if b._watch.pid == os.getpid()  # not a forking parent's groups
            and b.state in ("ok", "aborting") and (b.communicators() or b._pending_comms)]
    if not live:
        return
    for backend in live:
        if backend.state == "aborting":
            message = (f"process group {backend._name()!r} faulted ({backend.fault}) and the "
                       f"process exits before its abort ran; aborting its NCCL communicators now.")
        else:
            message = (f"process group {backend._name()!r} has NOT been destroyed before "
                       f"the process exits; aborting its NCCL communicators. Call "
                       f"torch.distributed.destroy_process_group() before exiting: otherwise this "
                       f"rank may leave before its peers finish their collectives with it.")
        logger.warning(message)

    def abort_all() -> None:
        for backend in live:
            _step("aborting a group at exit", abort, backend,
                  backend.fault if backend.state == "aborting" else None, False)

    thread = threading.Thread(target=abort_all, name="cupycoll-exit-abort", daemon=True)
    try:
        thread.start()
    except RuntimeError:  # Python 3.12+: no new threads once the interpreter is finalizing
        # faulthandler's watchdog is a C thread: past the deadline it prints where the
        # abort hangs and ends the process (status 1), as the threaded path would give up.
        faulthandler.dump_traceback_later(EXIT_DEADLINE, exit=True)
        try:
            abort_all()
        finally:
            faulthandler.cancel_dump_traceback_later()
        return
    thread.join(EXIT_DEADLINE)
    if thread.is_alive():
        logger.warning("aborting the groups at exit did not finish within %g s; exiting anyway", EXIT_DEADLINE)


def interrupted(exc: BaseException) -> CommunicatorAbortedError:
    """The group's fault for a KeyboardInterrupt (or exit) after part of a batch launched: a
    typed error every later call can raise (torch's futures reject a BaseException)."""
    fault = CommunicatorAbortedError(f"interrupted ({type(exc).__name__}) after part of a batch "
                                     "was launched; the peers wait for the rest")
    fault.__cause__ = exc
    return fault


def _after_fork_in_child() -> None:
    global _STATE_LOCK
    _STATE_LOCK = threading.Lock()  # a thread of the parent may have held it
    _ABORTING.clear()  # the parent's groups, whose fault threads are not in the child


atexit.register(_abort_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
