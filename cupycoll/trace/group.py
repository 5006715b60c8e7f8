"""A group's flight recorder, timeout diagnosis and mismatch check, as the ProcessGroup uses
them: one :class:`GroupTrace` per :class:`~cupycoll.ProcessGroupCupycoll`.

The group calls :meth:`GroupTrace.call` once per call it routes, CPU and CUDA alike, with
the tensors every rank passes alike. That records the call (:mod:`cupycoll.trace.recorder`) and,
with ``check_collectives``, compares it across ranks first (:mod:`cupycoll.trace.mismatch`).

* A CUDA call's entry goes down the call with it (the group hands it to the collective,
  which hands it to the backend's ``submit``): the backend marks it issued when the call's
  batch launches, the watch completed when the batch is retired, and on a timeout the
  group's lifetime asks :meth:`GroupTrace.explain_timeout` for the message.
* A CPU call goes to gloo; :meth:`GroupTrace.gloo` wraps gloo's Work in a
  :class:`TracedWork` whose ``wait()`` marks the entry completed, or, when gloo reports a
  timeout, runs the diagnosis and raises :class:`~cupycoll.CollectiveTimeoutError` with its
  message ("rank 2 is behind: ..."). A synchronous all_reduce is waited on in the call
  instead (:meth:`GroupTrace.gloo_waited`), marked and explained alike.

Every group also registers with its rank's listener (:mod:`cupycoll.trace.diagnosis`), which
answers the other ranks' diagnosis requests while this rank is busy elsewhere, and hands a
fault a peer published to the group's lifetime (:meth:`GroupTrace.attach`).

**One diagnosis per fault.** The group's first diagnosis (a CPU Work's failure, or the
lifetime asking to explain a CUDA timeout) is the group's *verdict*: every later Work that
fails with that fault, on either route, gets the same typed error at once, and so does the
lifetime, without asking the other ranks again; a fault a peer published is the verdict
too. The CPU route's own fault is then the lifetime's (``caller_fault``): it ends the group,
and it reaches the other ranks. A CPU Work waited on waits in slices of
:data:`cupycoll.bounds.CPU_WAIT_SLICE_S`, so a fault the group's lifetime claimed meanwhile
(a peer's) fails it at once rather than at gloo's own timeout.

Deliberately left out: gloo point-to-point calls are recorded but their Works are not
wrapped (``recv_anysource``'s ``source_rank()`` must stay gloo's).
"""

from __future__ import annotations

import datetime
import logging
import threading
from typing import Callable, Dict, Optional, Sequence
from weakref import ref

import torch
import torch.distributed as dist

from . import diagnosis, mismatch, recorder
from .. import bounds
from ..config import Settings
from ..errors import CollectiveTimeoutError, CommunicatorAbortedError, CupycollError, PeerFailedError

logger = logging.getLogger(__name__)  # a child of "cupycoll"
from .recorder import E_DTYPES, E_OP, E_ROOT, E_SEQ, E_SHAPES

# Calls that every rank makes alike and that the mismatch check compares.
_P2P = frozenset({"send", "recv", "recv_anysource"})
# How many CPU Works a group tracks, not yet seen finished, before it drops those gloo has
# finished meanwhile (Works never waited on: the dict must not grow with them).
_OPEN_PRUNE_AT = 64
# Held for a moment, by the first failure of a Work, to make that Work's lock.
_MAKING_LOCKS = threading.Lock()
# How a CPU Work waits in gloo: in slices, so that the group's end fails it meanwhile. What
# c10d's Work.wait(timeout) raises when a slice runs out (every supported torch): gloo's own
# errors, a timeout included, say otherwise ("Timed out waiting 5000ms for ...").
_SLICE = datetime.timedelta(seconds=bounds.CPU_WAIT_SLICE_S)
_SLICE_RAN_OUT = "Operation timed out!"
# The fault kinds a verdict takes, by the name a peer publishes.
_KINDS = {"CollectiveTimeoutError": CollectiveTimeoutError}


class GroupTrace:
    """The recorder of one group, and what uses it."""

    def __init__(self, store, name: str, global_ranks: Sequence[int], rank: int, settings: Settings):
        self.store = store
        self.settings = settings
        self.recorder = recorder.new_recorder(name, global_ranks, rank, settings.trace_buffer)
        self.check = settings.check_collectives
        # The CPU Works not seen finished yet, by their entry's number (weakly: a Work nobody
        # holds needs no failing): what close() fails. A finished Work leaves it.
        self._open: Dict[int, "ref[TracedWork]"] = {}
        self._prune_at = _OPEN_PRUNE_AT
        self._closed: Optional[str] = None  # how the group ended: "shut down", "aborted", "failed"
        # The group's fault as first explained here, or as a peer published it: what every
        # later failure of the group reuses (see the module). Set once.
        self._verdict: Optional[BaseException] = None
        self._explaining = threading.RLock()  # held by the one diagnosis under way
        # The group's lifetime, told of the CPU route's own fault and of a peer's (attach).
        self._caller_fault: Optional[Callable[[BaseException], None]] = None
        self._peer_fault: Optional[Callable[[BaseException], None]] = None

    def attach(self, caller_fault: Callable[[BaseException], None],
               peer_fault: Callable[[BaseException], None]) -> None:
        """The group's lifetime exists: tell it the faults this trace finds (``caller_fault``:
        the CPU route's, raised to the caller too) and those a peer publishes
        (``peer_fault``), and start answering the other ranks. A group of one has nobody to
        ask; the stand-ins of the tests have no store."""
        self._caller_fault, self._peer_fault = caller_fault, peer_fault
        if self.store is not None and len(self.recorder.ranks) > 1:
            diagnosis.serve(self.store, self.recorder, self.settings.trace_dir,
                            on_fault=self._published if self.settings.publish_faults else None)

    def call(self, op: str, tensors, root=None, opts=None, route: str = "nccl", cpu_group=None) -> Optional[list]:
        """Record one call (``tensors``: a flat sequence, those every rank passes alike) and,
        when enabled, check it against the other ranks first; its entry, which goes down
        the call (None for a gloo point-to-point call, whose Work stays gloo's own)."""
        if len(tensors) == 1:  # the hot paths: one tensor, or FSDP's two
            shapes, dtypes = (tensors[0].shape,), (tensors[0].dtype,)
        elif len(tensors) == 2:
            first, second = tensors
            shapes, dtypes = (first.shape, second.shape), (first.dtype, second.dtype)
        else:
            shapes, dtypes = tuple(t.shape for t in tensors), tuple(t.dtype for t in tensors)
        rec = self.recorder
        if op in _P2P:
            entry = rec.record_p2p(op, shapes, dtypes, root, route)
            return entry if route != "gloo" else None
        entry = rec.record(op, shapes, dtypes, root, route, "queued" if route != "gloo" else "issued")
        if self.check and cpu_group is not None:
            try:
                mismatch.check(cpu_group, mismatch.signature(entry[E_SEQ], op, shapes, dtypes, root,
                                                             getattr(opts, "reduceOp", None)),
                               rec.rank, len(rec.ranks), rec.group, rec.ranks)
            except BaseException:
                rec.mark(entry, "failed")
                raise
        return entry

    def gloo(self, work: dist.Work, entry: Optional[list], outputs: Optional[list] = None) -> dist.Work:
        return TracedWork(work, entry, self, outputs)

    def gloo_waited(self, entry: Optional[list], call, *args) -> dist.Work:
        """``call(*args)`` on the gloo half, waited on now, for a caller that would wait on
        its Work at once: gloo's own Work, finished (its ``wait()`` returns at once). A
        failure raises here, as :meth:`TracedWork.wait` raises it: explained, or, when the
        group was closed meanwhile, the close's :class:`~cupycoll.CommunicatorAbortedError`
        (nobody is left to ask). Nothing is tracked for :meth:`close` to fail: the caller is
        inside gloo's wait until gloo returns, as a :class:`TracedWork`'s ``wait()`` is."""
        try:
            work = call(*args)
            self._wait_in_slices(work, self._closed_error, entry)
        except Exception as exc:  # noqa: BLE001 - explained, then raised again
            self.recorder.mark(entry, "failed")
            closed = self._closed_error(entry)
            if closed is not None:
                if exc is closed:
                    raise
                raise closed from exc
            error = self.failure(entry, exc)
            if error is exc:
                raise
            raise error from exc
        self.recorder.mark(entry, "completed")
        return work

    def _prune_open(self) -> None:
        """Drop the tracked Works gloo has finished (or nobody holds any more)."""
        for key, work_ref in list(self._open.items()):
            work = work_ref()
            if work is None or work._work.is_completed():
                self._open.pop(key, None)
        self._prune_at = max(_OPEN_PRUNE_AT, 2 * len(self._open))

    def _wait_in_slices(self, work: dist.Work, failed: Callable[..., Optional[BaseException]], *args) -> bool:
        """gloo's ``work.wait()``, in slices of CPU_WAIT_SLICE_S: between two, ``failed(*args)``
        says whether the group's end (a peer's published fault, an abort) failed the call
        meanwhile, and that error is raised."""
        while True:
            try:
                return work.wait(_SLICE)
            except RuntimeError as exc:
                if _SLICE_RAN_OUT not in str(exc):
                    raise  # gloo's own error
            # the slice ran out, the call still under way
            error = failed(*args)
            if error is not None:
                raise error

    def _closed_error(self, entry: Optional[list]) -> Optional[BaseException]:
        """What a call the group's end caught fails with: the group's verdict when a fault
        ended it, else the close's; None while the group is open."""
        ended = self._closed
        if ended is None:
            return None
        if self._verdict is not None and ended == "aborted":
            return _again(self._verdict)
        return self._ended_error(ended, _described(entry))

    def failure(self, entry: Optional[list], error: BaseException):
        """What gloo raised from a wait, as cupycoll's error naming the rank behind when it
        happened between the ranks: a timeout (CollectiveTimeoutError) or a peer that died
        or closed its connection (PeerFailedError). Anything else is this rank's own
        argument, which gloo also reports only at wait() ("Invalid scalar type", an op it
        lacks): ``error`` itself, as plain gloo raises it, asking no other rank. The group's
        first such fault is its verdict and its lifetime's (see the module); later ones reuse
        it at once."""
        timeout = diagnosis.looks_like_timeout(error)
        if not timeout and not diagnosis.looks_like_peer_failure(error):
            return error
        verdict = self._verdict
        if verdict is not None:
            return _again(verdict)
        with self._explaining:
            mine = None
            if self._verdict is None:
                if timeout:
                    # gloo's own words stay in the message: torch's tests and users match on them
                    mine = CollectiveTimeoutError(self.explain_timeout(entry, self.settings.timeout.total_seconds())
                                                  + f" (gloo: {_first_sentence(error)})")
                else:
                    # gloo saw a connection close: a peer is gone, and it will not answer. Once every
                    # other rank has, the silent one is named at once rather than after the whole wait.
                    mine = PeerFailedError(self.explain_timeout(entry, None, f"failed ({_first_sentence(error)})",
                                                                one_gone=True))
                self._set_verdict(mine)  # unless a peer's published fault came first
        fault = self._verdict
        if fault is mine and self._caller_fault is not None:
            self._caller_fault(fault)
        return _again(fault)

    def _set_verdict(self, fault: BaseException) -> None:
        if self._verdict is None:
            self._verdict = fault

    def explain_timeout(self, entry: Optional[list], timeout_s: Optional[float],
                        what: str = "timed out", one_gone: bool = False) -> str:
        """The message of a call that timed out (or failed: ``what``) across the ranks: the
        group's verdict's when it has one (asking nobody), else diagnosed now, waiting at most
        ``diagnosis.DEFAULT_WAIT_S`` (with ``one_gone``, a peer is known to be gone: only until
        every rank but one has answered). Whoever makes the group's fault of it sets the
        verdict (:meth:`failure`; the lifetime, through :meth:`publish_fault`)."""
        verdict = self._verdict
        if verdict is not None:
            return str(verdict)
        with self._explaining:
            verdict = self._verdict
            return str(verdict) if verdict is not None else self._diagnose(entry, timeout_s, what, one_gone)

    def _diagnose(self, entry: Optional[list], timeout_s: Optional[float], what: str = "timed out",
                  one_gone: bool = False) -> str:
        """Ask the other ranks (dumping the trace when a folder is set); the message."""
        report = diagnosis.diagnose_timeout(self.store, self.recorder, entry, timeout_s,
                                            dump_dir=self.settings.trace_dir, what=what,
                                            one_gone=one_gone)
        return report.message

    def _published(self, kind: str, message: str, reporter: int) -> None:
        """A peer published the group's fault (its listener read it): the verdict, unless the
        group has one, and the lifetime's to claim."""
        fault = _KINDS.get(kind, PeerFailedError)(f"{message} (rank {reporter} found it)")
        self._set_verdict(fault)
        if self._peer_fault is not None:
            self._peer_fault(fault)

    def publish_fault(self, fault: BaseException) -> None:
        """Tell the other ranks the fault that ended the group here (bounded; see
        :func:`cupycoll.trace.diagnosis.publish_fault`), unless publishing is off."""
        self._set_verdict(fault)
        if self.settings.publish_faults and self.store is not None:
            diagnosis.publish_fault(self.store, self.recorder, fault)

    def dump_fault(self, reason: str) -> Optional[str]:
        """Write every recorder of the process into the trace folder, when one is set (the
        file written, else None); never raises."""
        return recorder.dump_on_timeout(self.settings.trace_dir, self.recorder.ranks[self.recorder.rank], reason)

    def close(self, state: str, fault: Optional[BaseException] = None) -> None:
        """The group is shut down, aborted or ``"failed"`` (its construction), ``fault``
        being what ended it, if anything did. A CPU Work not finished yet fails now: with the
        group's fault (the same typed error, naming the rank behind), else with the close as
        its reason: gloo cannot cancel it, and its own timeout may be minutes away. Then this
        rank stops answering diagnoses for the group and counts itself out of its store keys."""
        if self._closed is not None:
            return
        if fault is not None and isinstance(fault, (CollectiveTimeoutError, PeerFailedError)):
            self._set_verdict(fault)
        self._closed = state
        for work_ref in list(self._open.values()):
            work = work_ref()
            if work is not None:
                work.fail_unfinished(_again(self._verdict) if fault is not None and self._verdict is not None
                                     else self._ended_error(state, work.description))
        self._open.clear()
        diagnosis.unserve(self.recorder)
        self.recorder.mark_unfinished("aborted" if state == "aborted" else "failed")
        recorder.retire(self.recorder)
        diagnosis.forget(self.store, self.recorder)

    def _ended_error(self, state: str, description: str) -> CommunicatorAbortedError:
        """What a CPU call the group's close caught unfinished fails with."""
        return CommunicatorAbortedError(
            f"process group {self.recorder.group!r} was {state} before {description} finished on rank "
            f"{self.recorder.rank}; gloo may still write its output until its own timeout")


def _again(fault: BaseException) -> BaseException:
    """A fresh error of ``fault``'s type and message: each Work raises its own object."""
    again = type(fault)(str(fault))
    again.__cause__ = fault.__cause__
    return again


def _described(entry: Optional[list]) -> str:
    """A CPU call in words, from its flight-recorder entry ("a call" without one)."""
    if entry is None:
        return "a call"
    return recorder.describe(entry[E_OP], entry[E_SEQ], entry[E_SHAPES], entry[E_DTYPES])


class TracedWork(dist.Work):
    """A gloo Work whose ``wait()`` keeps the flight recorder and names the rank behind on a
    timeout. Everything else is gloo's Work's.

    Its state is read from gloo's future, never through gloo's ``exception()`` or
    ``is_success()``: torch 2.11 cannot hand ``exception()``'s result to Python, and later
    releases print a deprecation warning for both. A Work gloo gives no future (send, recv)
    answers those two with gloo's own methods. A failure is explained once, by whichever of
    ``wait()``, ``exception()`` and the future meets it first, and all three give that
    same error.

    Made on every CPU call, so it costs little: slots, no lock (the first failure makes
    one), and its group tracks it in a plain dict that its completion leaves."""

    __slots__ = ("_work", "_entry", "_trace", "_outputs", "_waited", "_failing", "_key")

    def __init__(self, work: dist.Work, entry: list, trace: GroupTrace, outputs: Optional[list] = None):
        super().__init__()
        self._work = work
        self._entry = entry
        self._trace = trace
        self._outputs = outputs  # the call's outputs, for a future gloo does not give (get_future)
        # [error or None] once wait() returned or raised, or the group closed before it finished
        self._waited: Optional[list] = None
        self._failing: Optional[threading.Lock] = None  # made by the first failure
        key = self._key = entry[E_SEQ] if entry is not None else id(self)
        opened = trace._open
        opened[key] = ref(self)
        if len(opened) > trace._prune_at:
            trace._prune_open()

    @property
    def description(self) -> str:
        return _described(self._entry)

    def fail_unfinished(self, error: BaseException) -> None:
        """The group closed: unless gloo finished this Work already, it has failed with
        ``error`` (a later ``wait()`` raises it at once; a ``wait()`` already inside gloo's
        returns when gloo does)."""
        if self._waited is None and not self._work.is_completed():
            self._waited = [error]
            self._trace.recorder.mark(self._entry, "failed")

    def _unfinished(self) -> Optional[BaseException]:
        """What the group's close failed this Work with, while gloo still runs it."""
        waited = self._waited
        return waited[0] if waited is not None else None

    def _finished(self) -> None:
        """Seen finished: the group's close has nothing to fail here."""
        self._trace._open.pop(self._key, None)

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        waited = self._waited
        if waited is not None and waited[0] is not None:
            raise waited[0]
        try:
            done = self._work.wait(timeout) if timeout else self._trace._wait_in_slices(self._work, self._unfinished)
        except Exception as exc:  # noqa: BLE001 - explained, then raised again
            waited = self._waited
            if waited is not None and exc is waited[0]:
                raise
            error = self._fail(exc)
            if error is exc:
                raise
            raise error from exc
        trace = self._trace
        trace.recorder.mark(self._entry, "completed")
        if done:
            self._waited = _SUCCEEDED
            trace._open.pop(self._key, None)
        return done

    def _fail(self, exc: BaseException) -> BaseException:
        """gloo's error as the group explains it (:meth:`GroupTrace.failure`), once: wait(),
        exception() and the future may all see it, and the ranks are asked one time."""
        lock = self._failing
        if lock is None:
            with _MAKING_LOCKS:
                lock = self._failing
                if lock is None:
                    lock = self._failing = threading.Lock()
        with lock:
            if self._waited is None:
                self._trace.recorder.mark(self._entry, "failed")
                error = self._trace.failure(self._entry, exc)
                if error is not exc:
                    error.__cause__ = exc
                self._waited = [error]
                self._finished()
            return self._waited[0]

    def _settled(self, error) -> None:
        self._trace.recorder.mark(self._entry, "completed" if error is None else "failed")
        self._finished()

    def _gloo_future(self):
        try:
            return self._work.get_future()
        except RuntimeError:  # send and recv Works have none
            return None

    def _future_outcome(self, future):
        """(finished, its error or None) from gloo's future."""
        if not future.done():
            return False, None
        error = _future_error(future)
        self._settled(error)
        return True, error

    def is_completed(self) -> bool:
        if self._waited is not None:
            return True
        done = self._work.is_completed()
        future = self._gloo_future() if done and self._waited is None else None
        if future is not None:
            self._future_outcome(future)
        return done

    def is_success(self) -> bool:
        if self._waited is not None:
            return self._waited[0] is None
        future = self._gloo_future()
        if future is None:
            return self._work.is_success()
        finished, error = self._future_outcome(future)
        return finished and error is None

    def exception(self):
        """None while unfinished or successful; on failure the error ``wait()`` raises
        (explaining it asks the other ranks, as the first ``wait()`` would)."""
        if self._waited is not None:
            return self._waited[0]
        future = self._gloo_future()
        if future is not None:
            error = self._future_outcome(future)[1]
            return None if error is None else self._fail(error)
        try:
            return self._work.exception()
        except TypeError:  # torch 2.11: gloo's exception_ptr cannot reach Python
            if not self._work.is_completed() or self._work.is_success():
                return None
            return CupycollError(f"{self!r} failed; wait() raises gloo's error")

    def result(self):
        return self._work.result()

    def source_rank(self) -> int:
        return self._work.source_rank()

    def synchronize(self) -> None:
        self._work.synchronize()

    def get_future(self):
        """gloo's future, continued: its value, or on failure the error wait() raises
        (cupycoll's, naming the rank behind): DDP's comm hooks and async callers consume the
        future, never wait(). An error a callback raises is the only failure a Python future
        can hand to C++ (DDP's reducer), which sees a RuntimeError with its text. The ranks
        are asked on the thread that completes gloo's future.

        Where gloo's Work has no future (its reduce-scatters: "getFuture not implemented"), a
        reduction's Work makes one by waiting on itself: this returns once gloo finished, with
        a completed future holding the outputs, or the error ``wait()`` raises."""
        try:
            gloos = self._work.get_future()
        except RuntimeError:
            if self._outputs is None:
                raise
            return self._waited_future()

        def settle(done):
            error = _future_error(done)
            if error is not None:
                raise self._fail(error)
            self._settled(None)
            return done.value()
        return gloos.then(settle)

    def _waited_future(self) -> torch.futures.Future:
        future = torch.futures.Future()
        try:
            self.wait()
        except Exception as exc:  # noqa: BLE001 - handed to the future, as gloo's own would be
            future.set_exception(exc)
        else:
            future.set_result(list(self._outputs))
        return future

    def __repr__(self) -> str:
        entry = self._entry
        if entry is None:
            return f"TracedWork({self._work!r})"
        return f"TracedWork({self.description}, root={entry[E_ROOT]})"


_SUCCEEDED = [None]  # a TracedWork's ``_waited`` once its wait() returned True


def _first_sentence(exc: BaseException) -> str:
    """gloo's "[.../pair.cc:553] Connection closed by peer [host]:port. This is typically
    caused by ..." as "Connection closed by peer [host]:port"."""
    text = (str(exc).strip().splitlines() or [""])[0]
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". ", 1)[0].rstrip(".") or type(exc).__name__


def _future_error(future) -> Optional[BaseException]:
    try:
        future.wait()
    except Exception as exc:  # noqa: BLE001 - handed back, not raised
        return exc
    return None
