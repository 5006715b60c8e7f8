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
  :class:`~cupycoll.trace.gloo_work.TracedWork` whose ``wait()`` marks the entry completed,
  or, when gloo reports a timeout, has :meth:`GroupTrace.failure` run the diagnosis
  (:mod:`cupycoll.trace.exchange`) and raises :class:`~cupycoll.CollectiveTimeoutError` with
  its message ("rank 2 is behind: ..."). A synchronous all_reduce is waited on in the call
  instead (:meth:`GroupTrace.gloo_waited`), marked and explained alike.

Every group also registers with its rank's listener (:mod:`cupycoll.trace.listener`), which
answers the other ranks' diagnosis requests while this rank is busy elsewhere, and hands a
fault a peer published to the group's lifetime (:meth:`GroupTrace.attach`).

**One diagnosis per fault.** The group's first diagnosis (a CPU Work's failure, or the
lifetime asking to explain a CUDA timeout) is the group's *verdict*: every later Work that
fails with that fault, on either route, gets the same typed error at once, and so does the
lifetime, without asking the other ranks again; a fault a peer published is the verdict
too. The CPU route's own fault is then the lifetime's (``caller_fault``): it ends the group,
and it reaches the other ranks (:func:`cupycoll.trace.news.publish_fault`). A CPU Work
waited on waits in slices of :data:`cupycoll.bounds.CPU_WAIT_SLICE_S`, so a fault the
group's lifetime claimed meanwhile (a peer's) fails it at once rather than at gloo's own
timeout.

Deliberately left out: how gloo's Works are waited on and its errors read
(:mod:`cupycoll.trace.gloo_work`); gloo point-to-point calls are recorded but their Works
are not wrapped (``recv_anysource``'s ``source_rank()`` must stay gloo's).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Dict, Optional, Sequence
from weakref import ref

import torch.distributed as dist

from . import exchange, listener, mismatch, news, recorder
from ..config import Settings
from ..errors import CollectiveTimeoutError, CommunicatorAbortedError, PeerFailedError
from .dumps import dump_on_timeout
from .gloo_work import TracedWork, described, first_sentence, looks_like_peer_failure, looks_like_timeout, \
    wait_in_slices
from .recorder import E_SEQ

logger = logging.getLogger(__name__)  # a child of "cupycoll"

# Calls that every rank makes alike and that the mismatch check compares.
_P2P = frozenset({"send", "recv", "recv_anysource"})
# How many CPU Works a group tracks, not yet seen finished, before it drops those gloo has
# finished meanwhile (Works never waited on: the dict must not grow with them).
_OPEN_PRUNE_AT = 64
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
            listener.serve(self.store, self.recorder, self.settings.trace_dir,
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
        failure raises here, as :meth:`~cupycoll.trace.gloo_work.TracedWork.wait` raises it:
        explained, or, when the group was closed meanwhile, the close's
        :class:`~cupycoll.CommunicatorAbortedError` (nobody is left to ask). Nothing is
        tracked for :meth:`close` to fail: the caller is inside gloo's wait until gloo
        returns, as a TracedWork's ``wait()`` is."""
        try:
            work = call(*args)
            wait_in_slices(work, self._closed_error, entry)
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

    def _closed_error(self, entry: Optional[list]) -> Optional[BaseException]:
        """What a call the group's end caught fails with: the group's verdict when a fault
        ended it, else the close's; None while the group is open."""
        ended = self._closed
        if ended is None:
            return None
        if self._verdict is not None and ended == "aborted":
            return _again(self._verdict)
        return self._ended_error(ended, described(entry))

    def failure(self, entry: Optional[list], error: BaseException):
        """What gloo raised from a wait, as cupycoll's error naming the rank behind when it
        happened between the ranks: a timeout (CollectiveTimeoutError) or a peer that died
        or closed its connection (PeerFailedError). Anything else is this rank's own
        argument, which gloo also reports only at wait() ("Invalid scalar type", an op it
        lacks): ``error`` itself, as plain gloo raises it, asking no other rank. The group's
        first such fault is its verdict and its lifetime's (see the module); later ones reuse
        it at once."""
        timeout = looks_like_timeout(error)
        if not timeout and not looks_like_peer_failure(error):
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
                                                  + f" (gloo: {first_sentence(error)})")
                else:
                    # gloo saw a connection close: a peer is gone, and it will not answer. Once every
                    # other rank has, the silent one is named at once rather than after the whole wait.
                    mine = PeerFailedError(self.explain_timeout(entry, None, f"failed ({first_sentence(error)})",
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
        ``exchange.DEFAULT_WAIT_S`` (with ``one_gone``, a peer is known to be gone: only until
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
        report = exchange.diagnose_timeout(self.store, self.recorder, entry, timeout_s,
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
        :func:`cupycoll.trace.news.publish_fault`), unless publishing is off."""
        self._set_verdict(fault)
        if self.settings.publish_faults and self.store is not None:
            news.publish_fault(self.store, self.recorder, fault)

    def dump_fault(self, reason: str) -> Optional[str]:
        """Write every recorder of the process into the trace folder, when one is set (the
        file written, else None); never raises."""
        return dump_on_timeout(self.settings.trace_dir, self.recorder.ranks[self.recorder.rank], reason)

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
        listener.unserve(self.recorder)
        self.recorder.mark_unfinished("aborted" if state == "aborted" else "failed")
        recorder.retire(self.recorder)
        news.forget(self.store, self.recorder)

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
