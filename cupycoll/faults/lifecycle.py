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
3. *end*: ``ncclCommAbort`` of every communicator, then, once every abort has returned,
   the Works' tensors and the algorithms' scratch released, then the group's CPU half shut
   down (:func:`cupycoll.faults.teardown.end`: every step runs whatever an earlier one
   raised; nothing is retried).

A fault the watchdog finds is claimed on its thread and explained and ended on one fault
thread (with ``terminate``, the process then exits 70). So is a fault a peer published
(:meth:`GroupLifetime.peer_fault`: every Work in flight fails with that same error) and the
CPU route's own (:meth:`GroupLifetime.caller_fault`: its caller raises it already, so it
never ends the process). Once the end has run, a fault the watchdog found is written to the
trace folder (``dump``, when one is set: a timeout's diagnosis and every exit 70 write it
too) and logged, bounded (:mod:`cupycoll.faults.reports`). A user's abort (``group.abort()``,
``abort_all()``, a shutdown that falls back to one) claims on the caller's thread and ends
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
flight, then finalizes and destroys the communicators
(:func:`cupycoll.faults.teardown.finalize`); work that does not finish, a fault, or anything
failing aborts instead.

Deliberately left out: the steps of an end (:mod:`cupycoll.faults.teardown`), what is told
of a fault (:mod:`cupycoll.faults.reports`), the process's groups together (``abort_all()``,
the aborts at exit: :mod:`cupycoll.faults.all_groups`), anything in ``__del__`` (a collective
teardown at garbage collection runs in whatever thread collects, possibly the watchdog's),
and retries.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from typing import Callable, Optional

from . import reports, teardown
from .. import bounds
from ..errors import CollectiveTimeoutError, CommunicatorAbortedError
from .last_words import terminate
from .teardown import step, warn
from .watchdog import Finding, Watch
from .watchdog_thread import WATCHDOG

logger = logging.getLogger(__name__)  # a child of "cupycoll"


class GroupState(str, enum.Enum):
    """A group's state; equal to its text ("ok", "aborting", "shut down", "aborted")."""

    OK = "ok"
    ABORTING = "aborting"  # a fault was claimed; it is being explained
    SHUT_DOWN = "shut down"
    ABORTED = "aborted"

    def __str__(self) -> str:
        return self.value


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
            telling = reports.publish(self._publish, fault)
        if bounded:
            teardown.within(self._end, (fault, threading.get_ident()), self.ended, self._name)
        else:
            self._end(fault)
        if telling is not None:
            telling.join(bounds.PUBLISH_WAIT_S)
        # Ended first: what follows may block (a folder, a logging handler), never the abort.
        terminating = self.policy == "terminate" and finding.source is not Finding.CALLER
        # A timeout's diagnosis wrote the dump, and so did the CPU route's; an exit writes its own.
        if finding.source is Finding.FOUND and not finding.is_timeout and not terminating:
            reports.dump(self.dump, fault)
        if finding.source is not Finding.CALLER:  # a CPU-route error raised to its caller is not logged, as gloo's
            reports.log(fault)
        if terminating:
            terminate(self, fault)
        if self.comms.blocked() and finding.stuck is not None:
            terminate(self, CollectiveTimeoutError(
                f"{fault} (a blocking NCCL call is stuck inside NCCL and no abort can end it safely: "
                f"ending the process; nonblocking communicators, Options(nonblocking=True), are "
                f"ended in place)"))

    def _explained(self, finding: Finding) -> BaseException:
        """The fault, explained when it is a timeout (:func:`reports.explained`): then the
        group's fault, and the watch's reason, from here on."""
        explained = reports.explained(finding, self._explain, self.watch.timeout, self._name)
        if explained is None:
            return finding.fault
        self.fault = explained
        self.watch.explain(explained)
        return explained

    def _end(self, reason: BaseException, asker: Optional[int] = None) -> None:
        """Step 3, once: the group aborted, then taken apart (:func:`teardown.end`). A second
        caller waits for the first."""
        with self._lock:
            first = not self._ending
            self._ending = True
            if self.state is not GroupState.SHUT_DOWN:
                self.state = GroupState.ABORTED
        if not first:
            if threading.get_ident() not in self._enders and not self.ended.wait(bounds.ABORT_DEADLINE):
                warn(f"cupycoll: the abort of process group {self.name!r} has not finished after "
                     f"{bounds.ABORT_DEADLINE:g} s (ncclCommAbort hangs?)")
            return
        me = threading.get_ident()
        self._enders.add(me)
        try:
            interrupts = teardown.end(self._name, self.watch, self.comms, self._close_cpu,
                                      asker if asker is not None else me)
        finally:
            self._enders.discard(me)
            self.ended.set()
        teardown.reraise(interrupts)

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
            teardown.within(self._end, (reason, asker), self.ended, self._name)
        else:
            self._end(reason, asker)
        if handed_over is not None:
            raise handed_over

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
            step("aborting a group whose fault is being explained", self.abort, self.fault)
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
            warn(f"cupycoll: shutting down process group {self.name!r} failed ({exc!r}); aborting it")
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
        teardown.finalize(self.watch, self.comms, timeout)
        self.ended.set()

    def has_communicators(self) -> bool:
        return bool(self.comms.reachable())

    def after_fork_in_child(self) -> None:
        """In a forked child: a thread of the parent may have held the lock when it forked."""
        self._lock = threading.Lock()

