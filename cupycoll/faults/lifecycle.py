"""How a CUDA group lives and ends: one :class:`GroupLifetime` per group decides, and is the
only thing that does. It owns the group's state, its fault, its watch (what is in flight:
:mod:`cupycoll.faults.watchdog`) and, with the backend, its communicators
(:class:`cupycoll.nccl.communicators.Communicators`). Others find and report (the watchdog's
pass, a communicator that fails, a user's abort); the lifetime decides what follows, once.

States (:class:`GroupState`): ``ok``; ``aborting`` (a fault was claimed and is being
explained); ``aborted``; ``shut down``. A shrink ends its parent as an abort does, with its
own reason (:meth:`GroupLifetime.replace`).

**One end.** Every way a group can end runs the same steps, in this order, once:

1. *claim*: the state leaves ``ok`` and the watch is closed with the reason, under the
   lifetime's lock. From here every call is refused and every batch in flight has failed:
   a Work asks the watch and never reports success for it (unless its caller saw it
   complete before), so a caller woken by a kernel the abort ends already sees the fault;
2. *explain* (a timeout only, on the fault thread): which rank is behind, at most
   :data:`cupycoll.bounds.DIAGNOSIS_WAIT_S`; the watch's reason becomes that message; then
   the fault is *published* to the group's other ranks (``publish``, beside the end, waited
   for at most :data:`cupycoll.bounds.PUBLISH_WAIT_S`), unless a peer published it;
3. *end*: ``ncclCommAbort`` of every communicator, never beside a call another thread has
   inside NCCL (the call runs it on its way out: :mod:`cupycoll.nccl.call_guard`); then,
   once every abort has returned, the Works' tensors and the algorithms' scratch are
   released (no buffer is freed under a kernel that still runs), and the group's CPU half
   is shut down. Every step runs whatever an earlier one raised; nothing is retried.

A fault the watchdog finds is claimed on its thread and explained and ended on one fault
thread (with ``terminate``, the process then exits 70). So is a fault a peer published
(:meth:`GroupLifetime.peer_fault`: every Work in flight fails with that same error) and the
CPU route's own (:meth:`GroupLifetime.caller_fault`: its caller raises it already, so it
never ends the process). Once the end has run, a fault the watchdog found is written to the
trace folder (``dump``, when one is set: a timeout's diagnosis and every exit 70 write it
too) and logged, each on a thread waited for at most :data:`cupycoll.bounds.DUMP_WAIT_S`: a
logging handler or a folder that blocks cannot hold back the abort, nor the exit. A user's abort (``group.abort()``,
:func:`abort_all`, a shutdown that falls back to one) claims on the caller's thread and ends
on a thread of its own, waited for at most :data:`cupycoll.bounds.ABORT_DEADLINE`; a second
aborter waits for the first one's end as long. The watchdog keeps polling an ending group:
past :data:`cupycoll.bounds.FAULT_DEADLINE` ``terminate`` exits anyway and ``raise`` logs that
the abort hangs.

**A call no abort can end.** A blocking communicator's call stuck inside NCCL (it connects to
a peer that never made the call) may not have ``ncclCommAbort`` run beside it, and nothing
else ends it. Such a call past the timeout is a timeout fault like any, explained and ended
as above; since its own communicator cannot be aborted, the process then ends with that
message (exit 70), whatever the policy: a stuck process or a crash are the alternatives.
Nonblocking communicators never block in NCCL's host code and are always ended in place.

**Shutdown** (``destroy_process_group``) never raises: it waits at most
:data:`cupycoll.bounds.SHUTDOWN_GRACE` seconds (never more than the timeout) for the work in
flight, then finalizes and destroys the communicators; work that does not finish, a fault,
or anything failing aborts instead.

**Process exit**: every lifetime is in :data:`LIVE` while its group lives. An ``atexit`` hook
stops the watchdog and aborts (never destroys: a destroy waits for peers and the GPU) every
group that still has communicators, warning that it was not destroyed, bounded by
:data:`cupycoll.bounds.EXIT_DEADLINE` in all. A forked child leaves its parent's groups alone.

Deliberately left out: anything in ``__del__`` (a collective teardown at garbage collection
runs in whatever thread collects, possibly the watchdog's), and retries.
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
from typing import Callable, Optional

from .. import bounds, hooks
from ..errors import CollectiveTimeoutError, CommunicatorAbortedError
from .watchdog import WATCHDOG, Finding, Watch, bounded_call, entries, terminate

logger = logging.getLogger(__name__)  # a child of "cupycoll"


class GroupState(str, enum.Enum):
    """A group's state; equal to its text ("ok", "aborting", "shut down", "aborted")."""

    OK = "ok"
    ABORTING = "aborting"  # a fault was claimed; it is being explained
    SHUT_DOWN = "shut down"
    ABORTED = "aborted"

    def __str__(self) -> str:
        return self.value


# Every group's lifetime while the group lives: what abort_all and the exit hook abort.
LIVE: "weakref.WeakSet[GroupLifetime]" = weakref.WeakSet()


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


def interrupted(exc: BaseException) -> CommunicatorAbortedError:
    """The group's fault for a KeyboardInterrupt (or exit) after part of a batch launched: a
    typed error every later call can raise (torch's futures reject a BaseException)."""
    fault = CommunicatorAbortedError(f"interrupted ({type(exc).__name__}) after part of a batch "
                                     "was launched; the peers wait for the rest")
    fault.__cause__ = exc
    return fault


class GroupLifetime:
    """The state, fault and end of one CUDA group (see the module docstring).

    ``name()``: the group's name for messages; ``watch`` and ``comms``: its calls in flight
    and its communicators; ``explain(entry, timeout_s)``: the message naming the rank behind
    a timed-out call (``entry``: its flight-recorder entry, None for the call being issued);
    ``close_cpu()``: shut the group's CPU half down once its CUDA half has ended;
    ``publish(fault)``: tell the group's other ranks (bounded); ``dump(reason)``: write the
    flight recorder into the trace folder, when one is set."""

    def __init__(self, name: Callable[[], str], watch: Watch, comms, interval: float, policy: str = "raise",
                 explain: Optional[Callable] = None, close_cpu: Optional[Callable[[], None]] = None,
                 publish: Optional[Callable[[BaseException], None]] = None,
                 dump: Optional[Callable[[str], object]] = None):
        self._name = name
        self._publish = publish
        self._dump = dump
        self.watch = watch
        self.comms = comms
        self.interval = float(interval)
        self.policy = policy
        self._explain = explain
        self._close_cpu = close_cpu
        self.pid = os.getpid()  # the process whose group this is (a forked child's is not)
        self.state = GroupState.OK
        self.fault: Optional[BaseException] = None
        # Why the group ended when another took its place (a shrink): what later calls say.
        self.replaced: Optional[BaseException] = None
        self._lock = threading.Lock()
        self._watched = False  # registered with the process's watchdog
        self._ending = False  # the end (step 3) has begun
        self.ended = threading.Event()  # ... and has finished
        self._enders: set = set()  # the threads running it (an abort they re-enter waits for nothing)
        self._deadline: Optional[float] = None  # when a claimed fault's end must be done by
        self._overdue_reported = False
        LIVE.add(self)

    @property
    def name(self) -> str:
        return self._name()

    # -- state -----------------------------------------------------------------------------
    @property
    def usable(self) -> bool:
        return self.state is GroupState.OK

    @property
    def ended_by(self) -> Optional[BaseException]:
        """What ended the group: its fault (a timeout, an NCCL error), else the reason it was
        aborted (a user's abort, a shrink that replaced it); None while it is ``ok`` and after
        a clean shutdown. Read, never kept: the lifetime's own fields."""
        state = self.state
        if state is GroupState.OK or state is GroupState.SHUT_DOWN:
            return None
        ended = self.fault or self.replaced or self.watch.closed
        # an abort between its claim and the watch's close has no reason recorded yet
        return ended if ended is not None else CommunicatorAbortedError(f"process group {self.name!r} was {state}")

    def check_usable(self) -> None:
        """Raise CommunicatorAbortedError unless the group is ``ok``."""
        state = self.state
        if state is GroupState.OK:
            return
        if self.replaced is not None:
            raise CommunicatorAbortedError(str(self.replaced)) from self.fault
        reason = f": {self.fault}" if self.fault is not None else ""
        shown = GroupState.ABORTED if state is GroupState.ABORTING else state
        raise CommunicatorAbortedError(f"process group {self.name!r} was {shown}{reason}") from self.fault

    def timeout_that_cut(self, error: BaseException) -> Optional[CollectiveTimeoutError]:
        """For ``error``, a call's: when it is a call inside NCCL that the group's end cut short
        and the group's fault is a timeout (the call timed out in NCCL, or waited behind the
        collective that did), that timeout, to raise in its place; else None. A call refused
        because the group had ended keeps its CommunicatorAbortedError."""
        fault = self.fault
        if (isinstance(error, CommunicatorAbortedError) and getattr(error, "during_call", False)
                and isinstance(fault, CollectiveTimeoutError)):
            return CollectiveTimeoutError(str(fault))
        return None

    # -- watching --------------------------------------------------------------------------
    def watching(self) -> None:
        """Watch the group (again, when the watchdog has no thread)."""
        if not self._watched or not WATCHDOG.running:
            WATCHDOG.watch(self)
            self._watched = True

    def poll(self, now: float) -> None:
        """The watchdog's pass over this group: find (in ``ok``) and decide; bound an end
        under way; a blocking call left stuck after an end ends the process."""
        try:
            if self.state is GroupState.OK:
                finding = self.watch.check(now)
                if finding is not None:
                    self.claim(finding)
            elif self._deadline is not None and not self.ended.is_set():
                self._check_deadline(now)
            elif self.ended.is_set():
                self._check_left_blocked(now)
        except Exception:  # noqa: BLE001 - one group's bug must not blind the others
            logger.exception("polling process group %r failed", self.name)

    def _check_deadline(self, now: float) -> None:
        if now < self._deadline or self._overdue_reported:
            return
        self._overdue_reported = True
        if self.policy == "terminate":
            terminate(self, self.fault)
        logger.error("the end of process group %r has not finished after %g s (ncclCommAbort "
                     "hangs?); its Works have failed", self.name, bounds.FAULT_DEADLINE)

    def _check_left_blocked(self, now: float) -> None:
        stuck = self.comms.stuck_call(self.watch.timeout, now, ended=True)
        if stuck is None:
            if not self.comms.blocked():
                self._unwatch()
            return
        function, seconds = stuck
        terminate(self, CollectiveTimeoutError(
            f"process group {self.name!r} was {self.state}, but {function} has been inside NCCL for "
            f"{seconds:.1f} s on a blocking communicator, which no abort can end safely"))

    def _unwatch(self) -> None:
        if self._watched:
            WATCHDOG.unwatch(self)
            self._watched = False

    # -- step 1: claim ---------------------------------------------------------------------
    def claim(self, finding: Finding, here: bool = False) -> bool:
        """A fault was found: make it the group's, fail everything in flight, then explain it
        and end the group: on the fault thread (the watchdog's findings), or ``here``, on the
        caller's thread within ABORT_DEADLINE (a fault a call met: the call then raises on a
        group that has ended). False when the group had ended or faulted already (a fault is
        final)."""
        with self._lock:
            if self.state is not GroupState.OK:
                return False
            self.state = GroupState.ABORTING
            self.fault = finding.fault
            self._deadline = time.monotonic() + bounds.FAULT_DEADLINE
        self.watch.close(finding.fault)
        self.watching()  # kept polled until the end is done (its deadline, a call left blocked)
        if here:
            self._handle(finding, bounded=True)
            return True
        thread = threading.Thread(target=self._handle, args=(finding,), name=f"cupycoll-fault-{self.watch.name}",
                                  daemon=True)
        try:
            thread.start()
        except RuntimeError:  # Python 3.12+ at interpreter exit: no new threads
            self._handle(finding)
        return True

    def fault_once(self, error: BaseException) -> None:
        """A communicator (or its creation, or a launch) failed with ``error`` on this thread:
        the group's fault, unless it already has one, ended before this returns (within
        ABORT_DEADLINE). Once a fault was claimed, the Works have failed already: nothing to do."""
        self.claim(Finding(error), here=True)

    def peer_fault(self, error: BaseException) -> None:
        """A peer published ``error`` as the group's fault: the group's too (its Works fail
        with it at once), ended on the fault thread and never published again."""
        self.claim(Finding(error, source=Finding.PEER))

    def caller_fault(self, error: BaseException) -> None:
        """The CPU route found ``error`` (explained already) and raises it to its caller: the
        group's fault, ended and published on the fault thread; the policy does not end the
        process for it (the caller has it)."""
        self.claim(Finding(error, source=Finding.CALLER))

    def dump(self, reason: str) -> None:
        """Write the flight recorder for ``reason`` (``dump``, when given; bounded by the caller)."""
        if self._dump is not None:
            self._dump(reason)

    # -- step 2 and 3 ----------------------------------------------------------------------
    def _handle(self, finding: Finding, bounded: bool = False) -> None:
        fault = self._explained(finding)
        telling = None
        if self._publish is not None and finding.source is not Finding.PEER:
            telling = bounded_call(self._publish, (fault,), "cupycoll-publish")
        if bounded:
            self._end_within(fault, threading.get_ident())
        else:
            self._end(fault)
        if telling is not None:
            telling.join(bounds.PUBLISH_WAIT_S)
        # Ended first: what follows may block (a folder, a logging handler), never the abort.
        terminating = self.policy == "terminate" and finding.source is not Finding.CALLER
        # A timeout's diagnosis wrote the dump, and so did the CPU route's; an exit writes its own.
        if finding.source is Finding.FOUND and not finding.is_timeout and not terminating:
            bounded_call(self.dump, (f"{fault}",), "cupycoll-dump").join(bounds.DUMP_WAIT_S)
        if finding.source is not Finding.CALLER:  # a CPU-route error raised to its caller is not logged, as gloo's
            bounded_call(logger.error, ("%s; aborting the group's NCCL communicators", fault),
                         "cupycoll-log").join(bounds.DUMP_WAIT_S)
        if terminating:
            terminate(self, fault)
        if self.comms.blocked() and finding.stuck is not None:
            terminate(self, CollectiveTimeoutError(
                f"{fault} (a blocking NCCL call is stuck inside NCCL and no abort can end it safely: "
                f"ending the process; nonblocking communicators, Options(nonblocking=True), are "
                f"ended in place)"))

    def _explained(self, finding: Finding) -> BaseException:
        fault = finding.fault
        batch = finding.batch
        # A timeout of a batch or of a call inside NCCL; a call's own error names itself.
        if self._explain is None or not finding.is_timeout or (batch is None and finding.stuck is None):
            return fault
        entry = None
        if batch is not None:
            found = entries(batch.records)
            entry = found[0] if found else None
        try:
            message = self._explain(entry, self.watch.timeout)
        except Exception:  # noqa: BLE001 - the plain message still describes the fault
            logger.exception("explaining the timeout of group %r failed", self.name)
            return fault
        if isinstance(message, str) and message:
            explained = CollectiveTimeoutError(message + (f" ({finding.stuck})" if finding.stuck else ""))
            explained.__cause__ = fault.__cause__
            self.fault = explained
            self.watch.explain(explained)
            return explained
        return fault

    def _end(self, reason: BaseException, asker: Optional[int] = None) -> None:
        """Step 3, once: abort the communicators, then (all aborts returned) release the
        tensors and scratch, then the CPU half. A second caller waits for the first."""
        with self._lock:
            first = not self._ending
            self._ending = True
            if self.state is not GroupState.SHUT_DOWN:
                self.state = GroupState.ABORTED
        if not first:
            if threading.get_ident() not in self._enders and not self.ended.wait(bounds.ABORT_DEADLINE):
                _warn(f"cupycoll: the abort of process group {self.name!r} has not finished after "
                      f"{bounds.ABORT_DEADLINE:g} s (ncclCommAbort hangs?)")
            return
        me = threading.get_ident()
        self._enders.add(me)
        interrupts = []
        # The end's CUDA calls (the aborts, freeing events and scratch) run with the group's
        # device current: on a thread that never chose one, cuda:0 is, and NCCL's abort sets
        # back the device it was called with, which would make a context there.
        guard = self.watch.on_device()
        try:
            guard.__enter__()
        except BaseException as exc:  # noqa: BLE001 - the end runs anyway, on this device
            _warn(f"cupycoll: making the device of process group {self.name!r} current failed: {exc!r}")
            guard = None
        try:
            for comm, error in self.comms.abort(asker if asker is not None else me):
                _warn(f"cupycoll: aborting {comm} failed: {error!r}")
                if not isinstance(error, Exception):
                    interrupts.append(error)
            # Only once every ncclCommAbort returned may what the kernels used be released;
            # one left to a blocked call's way out keeps it all held.
            # A call inside NCCL past the timeout (or CALL_BLOCKED_S) is blocked: not waited for.
            if self.comms.settled(bounds.ABORT_DEADLINE, min(bounds.CALL_BLOCKED_S, self.watch.timeout)):
                interrupts.append(_step("releasing the Works' tensors", self.watch.release))
                for algorithm, error in self.comms.close_runners():
                    _warn(f"cupycoll: closing the {algorithm} algorithm's runner failed: {error!r}")
            if self._close_cpu is not None:
                interrupts.append(_step("shutting down the group's CPU half", self._close_cpu))
        finally:
            if guard is not None:
                _step("setting the previous device back", guard.__exit__, None, None, None)
            self._enders.discard(me)
            self.ended.set()
        _reraise(interrupts)

    # -- a user's abort, a shrink's replacement ---------------------------------------------
    def abort(self, reason: Optional[BaseException] = None, bounded: bool = True,
              before_kernels_end: Optional[Callable[[], None]] = None) -> None:
        """End the group now (see the module docstring). Raises only a KeyboardInterrupt or
        SystemExit met on the way, after every step has run. ``bounded=False``: the caller
        bounds the whole abort itself (the exit hook), so ncclCommAbort runs inline.

        ``before_kernels_end``: run on the caller's thread once the Works have failed and
        before any communicator is aborted (a shrink takes the survivors' communicator from
        the live one there); what it raises is raised after the abort finished. When the
        group had ended already it does not run, and CommunicatorAbortedError is raised."""
        if reason is None:
            reason = self.fault or CommunicatorAbortedError(f"process group {self.name!r} was aborted")
        with self._lock:
            ended_before = self._ending or self.state in (GroupState.ABORTED, GroupState.SHUT_DOWN)
            if not ended_before:
                self.state = GroupState.ABORTED
        if ended_before:
            self._end(reason)  # waits for the first end (never on its own threads)
            if before_kernels_end is not None:
                raise CommunicatorAbortedError(
                    f"process group {self.name!r} was {self.state}: {self.watch.closed or self.fault}")
            return
        self.watch.close(reason)
        handed_over = None
        if before_kernels_end is not None:
            try:
                before_kernels_end()
            except BaseException as exc:  # noqa: BLE001 - raised once the abort finished
                handed_over = exc
        asker = threading.get_ident()
        if bounded:
            self._end_within(reason, asker)
        else:
            self._end(reason, asker)
        if handed_over is not None:
            raise handed_over

    def _end_within(self, reason: BaseException, asker: int) -> None:
        # ncclCommAbort can hang (NCCL's known hangs): the end runs on a thread of its own,
        # waited for at most ABORT_DEADLINE. Past that the Works have failed already and
        # their tensors stay held until it returns (a kernel may still use them).
        ender = threading.Thread(target=self._end, args=(reason, asker), name="cupycoll-abort", daemon=True)
        try:
            ender.start()
        except RuntimeError:  # Python 3.12+ at interpreter exit: no new threads; the exit hook bounds it
            self._end(reason, asker)
            return
        if not self.ended.wait(bounds.ABORT_DEADLINE):
            _warn(f"cupycoll: ncclCommAbort of process group {self.name!r} has not returned after "
                  f"{bounds.ABORT_DEADLINE:g} s; its Works have failed, and their tensors stay held until it does")
        else:
            ender.join(bounds.ABORT_DEADLINE)

    def replace(self, reason: BaseException, before_kernels_end: Optional[Callable[[], None]] = None) -> None:
        """The group ends because another takes its place (a shrink): aborted with ``reason``
        (see :meth:`abort` for ``before_kernels_end``), unless it had ended already, and every
        later call says ``reason``."""
        self.replaced = reason
        if self.ended.is_set() and before_kernels_end is None:
            return
        self.abort(reason, before_kernels_end=before_kernels_end)

    def work_in_flight(self) -> bool:
        """Has an issued batch not finished on the GPU yet (or the watch closed)? Asks each
        stream's events once, never waits."""
        return not self.watch.drain(0.0)

    def shutdown(self, timeout: float, captured: bool = False) -> None:
        """See the module docstring (``timeout``: the group's). Never raises. ``captured``: a
        call of the group's was captured into a CUDA graph, and a blocking ncclCommFinalize
        waits until every such graph is destroyed, for as long as the program holds one: the
        group is aborted instead (bounded)."""
        state = self.state
        if state is GroupState.ABORTING:
            # The fault is still being explained; the group may be gone once we return.
            _step("aborting a group whose fault is being explained", self.abort, self.fault)
            return
        if state is not GroupState.OK:
            return
        if captured:
            self.abort(CommunicatorAbortedError(
                f"process group {self.name!r} was shut down; a CUDA graph captured its NCCL calls, "
                f"so its communicators were aborted, not finalized (finalizing waits until every "
                f"such graph is destroyed)"))
            return
        grace = min(bounds.SHUTDOWN_GRACE, timeout)
        try:
            drained = self.watch.drain(grace)
        except BaseException as exc:  # noqa: BLE001 - shutdown never raises; abort instead
            _warn(f"cupycoll: shutting down process group {self.name!r} failed ({exc!r}); aborting it")
            drained = False
        if not drained:
            self.abort(CommunicatorAbortedError(
                f"process group {self.name!r} was shut down with work that did not finish "
                f"within {grace:g} s; it was aborted"))
            return
        with self._lock:
            if self.state is not GroupState.OK:
                return
            self.state = GroupState.SHUT_DOWN
        self.watch.close(CommunicatorAbortedError(f"process group {self.name!r} was shut down"))
        self._unwatch()
        for algorithm, error in self.comms.close_runners():
            _warn(f"cupycoll: closing the {algorithm} algorithm's runner failed: {error!r}")
        for comm in self.comms.all():
            if _step(f"shutting down {comm}", comm.shutdown, timeout) is not None:
                _step(f"aborting {comm} after its shutdown failed", comm.abort)
        self.watch.release()
        self.ended.set()

    def has_communicators(self) -> bool:
        return bool(self.comms.reachable())


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
            _step("aborting a group at exit", life.abort, None, False)

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
        life._lock = threading.Lock()


hooks.at_exit("lifecycle", _abort_at_exit)
hooks.in_forked_child("lifecycle", _after_fork_in_child)
