"""How a CUDA group lives and ends: one :class:`GroupLifetime` per group owns its state, the
lock that guards it, its watch and the Works in flight there, and keeps these rules (the
guarantees docs/design.md states):

* **state** (:class:`GroupState`): ``ok`` until a fault is claimed (``aborting``: calls are
  refused while the fault is diagnosed), then ``aborted``; or ``shut down``. Only this
  object changes it, under its own lock, held for the check-and-set and never across NCCL.
* **watching**: an issued call gets one completion event per batch, recorded on the batch's
  stream, and is marked ``issued`` in the group's flight recorder; an async call's Work keeps
  its tensors until the event fires (the watchdog releases them). It is handed to the
  group's :class:`~cupycoll.faults.watchdog.Watch` unless this thread's current stream is capturing
  a CUDA graph, as ProcessGroupNCCL does: a captured call runs nothing until the graph is
  replayed, and the watchdog's event queries would invalidate the capture. A Work handed
  over is marked ``tracked`` on its Issue: from then on its failure and release are the
  watch's (see ``CallQueue._flush``). The watch is registered with the process's watchdog
  at the first tracked Work, and again whenever the watchdog has no thread.
* **abort** (``CudaBackend.abort``; the watchdog's fault path; ``abort_all``) first marks
  the group ``aborted`` and every Work in flight failed, *then* calls ``ncclCommAbort``
  on each communicator, and releases the Works' tensors and the algorithms' scratch only after the
  aborts returned: a caller woken by the ended kernel already sees the fault, and no
  buffer is freed under a kernel that still runs. Every step and every communicator is
  attempted whatever an earlier one raised; nothing is retried. ``ncclCommAbort`` and the
  release after it run on a thread of their own, waited for at most :data:`ABORT_DEADLINE`
  seconds: an abort returns within that bound even when NCCL's abort hangs (the tensors then
  stay held until it returns). The watch is closed with the reason (a Work tracked later
  fails: see cupycoll.faults.watchdog), and a second aborter (the fault thread, abort_all) waits,
  at most ``watchdog.FAULT_DEADLINE`` seconds, for the first one's ncclCommAbort before it
  returns (and its caller releases anything). A claimed watchdog fault marks the group
  ``aborting`` at once; until that abort ran, the group's backend is held here, so that
  torch dropping the group meanwhile cannot skip it (the fault thread reaches the backend
  weakly, and CuPy's ``__dealloc__`` would ``ncclCommDestroy`` a communicator with a hung
  kernel).
* **shutdown** (``destroy_process_group``) never raises: it waits at most
  :data:`SHUTDOWN_GRACE` seconds (and never more than the group's timeout) for the work in
  flight, then finalizes and destroys the communicators; if the work does not finish,
  anything fails, or a communicator cannot be finalized, it aborts instead. During a fault's
  diagnosis (``aborting``) it runs the fault's abort at once (the fault thread's then
  waits for it, as a second aborter).
* **process exit**: every lifetime is in :data:`LIVE` while its group lives. An ``atexit``
  hook stops the watchdog and aborts (never destroys: a destroy waits for peers and the
  GPU) every group still alive, warning that it was not destroyed, and every group whose
  fault's abort has not run yet, bounded by :data:`EXIT_DEADLINE` seconds in all.
  :func:`abort_all` aborts every live group on demand. A forked child leaves the groups of
  its parent alone (their communicators are the parent's).

The lifetime reaches its backend weakly, for the parts only the backend has: its
communicators (also those being created), its queue of calls, its algorithms' runners and
its CPU half.

Deliberately left out: anything in ``__del__`` (a collective teardown at garbage
collection runs in whatever thread collects, possibly the watchdog's), and retries.
"""

from __future__ import annotations

import enum
import faulthandler
import logging
import os
import threading
import time
import warnings
import weakref
from typing import Callable, List, Optional

import torch

from .. import hooks
from . import watchdog
from ..errors import CollectiveTimeoutError, CommunicatorAbortedError
from .watchdog import WATCHDOG, Watch

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


class GroupState(str, enum.Enum):
    """A group's state; equal to its text ("ok", "aborting", "shut down", "aborted")."""

    OK = "ok"
    ABORTING = "aborting"  # a fault was claimed; its abort has not run yet
    SHUT_DOWN = "shut down"
    ABORTED = "aborted"

    def __str__(self) -> str:
        return self.value


# Every group's lifetime while the group lives: what abort_all and the exit hook abort.
LIVE: "weakref.WeakSet[GroupLifetime]" = weakref.WeakSet()

# The lifetimes marked "aborting" whose abort has not run yet; each holds its backend.
_ABORTING: set = set()


def capturing() -> bool:
    """Is this thread's current stream capturing a CUDA graph? (Never initializes CUDA.)"""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


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


def _reraise(interrupts) -> None:
    """Raise the first KeyboardInterrupt or SystemExit a step met (after every step ran)."""
    for exc in interrupts:
        if exc is not None and not isinstance(exc, Exception):
            raise exc


class GroupLifetime:
    """The state, watch and ending of one CUDA group (see the module docstring)."""

    def __init__(self, backend, watch: Watch):
        self._backend = weakref.ref(backend)
        self.watch = watch
        self.state = GroupState.OK
        self.fault: Optional[BaseException] = None
        # Why the group ended when another took its place (a shrink): what later calls say.
        self.replaced: Optional[BaseException] = None
        self._lock = threading.Lock()
        self._watched = False  # registered with the process's watchdog
        self._held = None  # the backend, while "aborting"
        this = weakref.ref(self)  # the watch must not keep its lifetime alive
        watch.on_claim = lambda fault: this() is not None and this().refuse(fault)
        LIVE.add(self)

    def _name(self) -> str:
        backend = self._backend()
        return backend._name() if backend is not None else self.watch.name

    # -- state ---------------------------------------------------------------------------
    @property
    def usable(self) -> bool:
        return self.state is GroupState.OK

    def check_usable(self) -> None:
        """Raise CommunicatorAbortedError unless the group is ``ok``."""
        state = self.state
        if state is not GroupState.OK:  # "aborting": a fault was claimed, its abort is under way
            if self.replaced is not None:
                raise CommunicatorAbortedError(str(self.replaced)) from self.fault
            reason = f": {self.fault}" if self.fault is not None else ""
            shown = GroupState.ABORTED if state is GroupState.ABORTING else state
            raise CommunicatorAbortedError(
                f"process group {self._name()!r} was {shown}{reason}") from self.fault

    def refuse(self, fault: BaseException) -> None:
        """The watchdog claimed ``fault`` (the watch's ``on_claim``): refuse calls from now
        on, while the fault thread diagnoses it and until its abort runs."""
        with self._lock:
            if self.state is GroupState.OK:
                self.fault = fault
                self.state = GroupState.ABORTING
                self._held = self._backend()  # until the abort ran, whatever torch drops
                _ABORTING.add(self)

    def timeout_that_cut(self, error: BaseException) -> Optional[CollectiveTimeoutError]:
        """For ``error``, a call's: when it is a call inside NCCL that the group's abort ended
        and the group's fault is a timeout (the call timed out in NCCL, or waited behind the
        collective that did), that timeout, to raise in its place; else None. A call refused
        because the group was aborted keeps its CommunicatorAbortedError."""
        fault = self.fault
        if (isinstance(error, CommunicatorAbortedError) and error.during_call
                and isinstance(fault, CollectiveTimeoutError)):
            return CollectiveTimeoutError(str(fault))
        return None

    def fault_once(self, exc: BaseException) -> None:
        """A communicator (or its creation) failed: fault the group unless it already has."""
        if self.state is GroupState.OK:
            self.on_fault(exc)

    def on_fault(self, fault: BaseException) -> None:
        """A timeout, an async NCCL error or a failed creation (from the watchdog's fault
        thread, or the caller's): the group's fault, final."""
        self.fault = fault
        self.abort(fault)

    # -- watching ------------------------------------------------------------------------
    def watching(self) -> bool:
        """Should the Works issued now be watched? Registers the watch (again) when they
        should and the watchdog has no thread."""
        if capturing():
            return False
        if not self._watched or not WATCHDOG.running:
            WATCHDOG.watch(self.watch)
            self._watched = True
        return True

    def track(self, issues: List, stream, async_op: bool, recorder=None, submitting=None) -> None:
        """The batch ``issues`` was launched on ``stream``; ``submitting``: the recorder
        entry of the call being submitted now, if it is in the batch."""
        event = torch.cuda.Event()
        event.record(stream)
        watched = self.watching()
        for issue in issues:
            work = issue.work
            entry = work.trace_entry
            if entry is None and submitting is not None:  # the call being submitted now
                entry = work.trace_entry = submitting
            if entry is not None and recorder is not None:
                recorder.mark(entry, "issued")
            work._issued(stream, event, issue.keepalive if async_op else None)
            if watched:
                work.watch_handle = self.watch.track(work)
                issue.tracked = True

    def track_work(self, work) -> None:
        """The queue's ``track``: a coalescing block's covering Work."""
        if self.watching():
            work.watch_handle = self.watch.track(work)

    def stop_watching(self) -> None:
        if self._watched:
            WATCHDOG.unwatch(self.watch)
            self._watched = False

    # -- ending --------------------------------------------------------------------------
    def abort(self, reason: Optional[BaseException] = None, bounded: bool = True,
              before_kernels_end: Optional[Callable[[], None]] = None) -> None:
        """See the module docstring. Raises only a KeyboardInterrupt or SystemExit met on the
        way, and only after every step has run. ``bounded=False``: the caller bounds the
        whole abort itself (the exit hook), so ncclCommAbort runs inline.

        ``before_kernels_end``: run on the caller's thread once the Works have failed and
        before any communicator is aborted (a shrink takes the survivors' communicator from
        the live one there); what it raises is raised after the abort finished. When the
        group was aborted already it does not run, and CommunicatorAbortedError is raised."""
        if reason is None:
            reason = CommunicatorAbortedError(f"process group {self._name()!r} was aborted")
        watch = self.watch
        with self._lock:
            second = self.state is GroupState.ABORTED
            if not second:
                self.state = GroupState.ABORTED
                watch.close(reason)  # before the Works are marked: a late one fails in track
                watch.aborters.add(threading.get_ident())
        if second:
            # Never return (so that the caller releases anything) under a kernel still running.
            if threading.get_ident() not in watch.aborters and not watch.settled.wait(ABORT_DEADLINE):
                _warn(f"cupycoll: the abort of process group {self._name()!r} has not finished "
                      f"after {ABORT_DEADLINE:g} s (ncclCommAbort hangs?)")
            if before_kernels_end is not None:
                raise CommunicatorAbortedError(
                    f"process group {self._name()!r} was aborted: {watch.closed}") from watch.closed
            return
        backend = self._backend()
        interrupts = []
        failed = []

        def mark() -> None:
            failed.extend(watch.mark_failed(reason))

        # Queued (never issued) Works fail with the same reason; they hold no running kernel.
        steps = [("stopping the watchdog's tracking", self.stop_watching),
                 ("failing the Works in flight", mark)]
        if backend is not None:
            steps.insert(0, ("dropping the queued calls", lambda: backend.calls.drop(reason)))
        for what, step in steps:
            interrupts.append(_step(what, step))
        handed_over: List[BaseException] = []
        if before_kernels_end is not None:
            try:
                before_kernels_end()
            except BaseException as exc:  # noqa: BLE001 - raised once the abort finished
                handed_over.append(exc)
        asker = threading.get_ident()

        def end_kernels_then_release() -> None:
            watch.aborters.add(threading.get_ident())  # an abort re-entered from here waits for nothing
            try:
                if backend is not None:
                    for comm in backend.all_communicators():
                        interrupts.append(_step(f"aborting {comm}", comm.abort, asker))
            finally:
                # Only now, with the kernels ended, may the Works' tensors and scratch be
                # released (with those tracked late, once settled: any later one releases itself).
                watch.settled.set()
                interrupts.append(_step("failing the Works tracked late", mark))
                interrupts.append(_step("releasing the Works' tensors", watch.release, failed))
                if backend is not None:
                    interrupts.append(_step("closing the algorithms' runners", backend.close_runners))
                    interrupts.append(_step("shutting down the group's CPU half", backend.on_abort))
                _ABORTING.discard(self)
                self._held = None

        if bounded:
            self._finish_abort(end_kernels_then_release, watch)
        else:
            end_kernels_then_release()
        _reraise(interrupts)
        if handed_over:
            raise handed_over[0]

    def _finish_abort(self, end_kernels_then_release, watch) -> None:
        # ncclCommAbort can hang (NCCL's known hangs): it runs on a thread of its own, and the
        # caller waits for it at most ABORT_DEADLINE. Past that the Works have failed already
        # and their tensors stay held until it returns (a kernel may still use them).
        finisher = threading.Thread(target=end_kernels_then_release, name="cupycoll-abort", daemon=True)
        try:
            finisher.start()
        except RuntimeError:  # Python 3.12+ at interpreter exit: no new threads; the exit hook bounds it
            end_kernels_then_release()
        else:
            if not watch.settled.wait(ABORT_DEADLINE):
                _warn(f"cupycoll: ncclCommAbort of process group {self._name()!r} has not returned after "
                      f"{ABORT_DEADLINE:g} s; its Works have failed, and their tensors stay held until it does")
            else:
                finisher.join(ABORT_DEADLINE)

    def work_in_flight(self) -> bool:
        """Has an issued Work not finished on the GPU yet (or the watch faulted)? Asks each
        event once, never waits."""
        return not self.watch.drain(0.0)

    def replace(self, reason: BaseException, before_kernels_end: Optional[Callable[[], None]] = None) -> None:
        """The group ends because another takes its place (a shrink): aborted with ``reason``
        (see :meth:`abort` for ``before_kernels_end``), unless a fault aborted it already,
        and every later call says ``reason``."""
        self.replaced = reason
        if self.state is GroupState.ABORTED and before_kernels_end is None:
            return
        self.abort(reason, before_kernels_end=before_kernels_end)

    def shutdown(self, timeout: float) -> None:
        """See the module docstring (``timeout``: the group's). Never raises."""
        if self.state is GroupState.ABORTING:
            # The fault thread is still diagnosing; the group may be gone once we return.
            _step("aborting a group whose fault is being diagnosed", self.abort, self.fault)
            return
        backend = self._backend()
        if self.state is not GroupState.OK or backend is None:
            return
        grace = min(SHUTDOWN_GRACE, timeout)
        try:
            try:
                backend.calls.flush()
            except Exception:  # noqa: BLE001 - the Works of that batch carry the error
                pass
            drained = self.watch.drain(grace)
        except BaseException as exc:  # noqa: BLE001 - shutdown never raises; abort instead
            _warn(f"cupycoll: shutting down process group {self._name()!r} failed ({exc!r}); aborting it")
            drained = False
        if not drained:
            self.abort(CommunicatorAbortedError(
                f"process group {self._name()!r} was shut down with work that did not finish "
                f"within {grace:g} s; it was aborted"))
            return
        with self._lock:
            if self.state is not GroupState.OK:
                return
            self.state = GroupState.SHUT_DOWN
        _step("stopping the watchdog's tracking", self.stop_watching)
        _step("closing the algorithms' runners", backend.close_runners)
        for comm in backend.communicators():
            if _step(f"shutting down {comm}", comm.shutdown, timeout) is not None:
                _step(f"aborting {comm} after its shutdown failed", comm.abort)

    def has_communicators(self) -> bool:
        backend = self._backend()
        return backend is not None and bool(backend.all_communicators())


def abort_all(timeout: Optional[float] = None) -> int:
    """Abort every live cupycoll group of this process, from any thread or a signal handler;
    how many were live. The groups are aborted side by side, each on a thread of its own, so
    one whose ncclCommAbort hangs delays no other; returns once all are done, or after
    ``timeout`` seconds (default :data:`ABORT_DEADLINE`), whichever comes first.

    From a signal handler: if the signal interrupted cupycoll itself while it held one of
    its locks, those threads wait for the lock, so this returns after ``timeout`` and the
    aborts finish as soon as the handler returns."""
    timeout = ABORT_DEADLINE if timeout is None else float(timeout)
    lives = [life for life in list(LIVE) if life.watch.pid == os.getpid()]  # not a forking parent's
    live = sum(life.state is not GroupState.ABORTED for life in lives)
    aborters = [threading.Thread(target=life.abort, name="cupycoll-abort-all", daemon=True) for life in lives]
    for aborter in aborters:
        aborter.start()
    deadline = time.monotonic() + timeout
    for aborter in aborters:
        aborter.join(max(0.0, deadline - time.monotonic()))
    return live


def _abort_at_exit() -> None:
    """The atexit hook: see the module docstring."""
    WATCHDOG.stop()
    # A group whose fault is still being diagnosed ("aborting") has not run its abort yet:
    # aborted here too, or CuPy's teardown would destroy a communicator with a hung kernel.
    lives = list(LIVE) + [life for life in list(_ABORTING) if life not in LIVE]
    live = [life for life in lives
            if life.watch.pid == os.getpid()  # not a forking parent's groups
            and life.state in (GroupState.OK, GroupState.ABORTING) and life.has_communicators()]
    if not live:
        return
    for life in live:
        if life.state is GroupState.ABORTING:
            message = (f"process group {life._name()!r} faulted ({life.fault}) and the "
                       f"process exits before its abort ran; aborting its NCCL communicators now.")
        else:
            message = (f"process group {life._name()!r} has NOT been destroyed before "
                       f"the process exits; aborting its NCCL communicators. Call "
                       f"torch.distributed.destroy_process_group() before exiting: otherwise this "
                       f"rank may leave before its peers finish their collectives with it.")
        logger.warning(message)

    def abort_each() -> None:
        for life in live:
            _step("aborting a group at exit", life.abort,
                  life.fault if life.state is GroupState.ABORTING else None, False)

    thread = threading.Thread(target=abort_each, name="cupycoll-exit-abort", daemon=True)
    try:
        thread.start()
    except RuntimeError:  # Python 3.12+: no new threads once the interpreter is finalizing
        # faulthandler's watchdog is a C thread: past the deadline it prints where the
        # abort hangs and ends the process (status 1), as the threaded path would give up.
        faulthandler.dump_traceback_later(EXIT_DEADLINE, exit=True)
        try:
            abort_each()
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
    # The parent's groups are not the child's (their fault threads are not in it either);
    # a thread of the parent may have held a lifetime's lock when it forked.
    _ABORTING.clear()
    for life in list(LIVE):
        life._lock = threading.Lock()


hooks.at_exit("lifecycle", _abort_at_exit)
hooks.in_forked_child("lifecycle", _after_fork_in_child)
