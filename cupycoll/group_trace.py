"""A group's flight recorder, timeout diagnosis and mismatch check, as the ProcessGroup uses
them: one :class:`GroupTrace` per :class:`~cupycoll.ProcessGroupCupycoll`.

The group calls :meth:`GroupTrace.call` once per call it routes, CPU and CUDA alike, with
the tensors every rank passes alike. That records the call (:mod:`cupycoll.recorder`) and,
with ``check_collectives``, compares it across ranks first (:mod:`cupycoll.mismatch`).

* A CUDA call's entry is handed to the backend (``CudaBackend.trace_entry``), which marks it
  issued when it launches; the watchdog marks it completed, and on a timeout the backend
  asks :meth:`GroupTrace.explain_timeout` for the message.
* A CPU call goes to gloo; :meth:`GroupTrace.gloo` wraps gloo's Work in a
  :class:`TracedWork` whose ``wait()`` marks the entry completed, or, when gloo reports a
  timeout, runs the diagnosis and raises :class:`~cupycoll.CollectiveTimeoutError` with its
  message ("rank 2 is behind: ...").

Every group also registers with the process's responder (:mod:`cupycoll.diagnosis`), which
answers the other ranks' diagnosis requests while this rank is busy elsewhere.

Deliberately left out: gloo point-to-point calls are recorded but their Works are not
wrapped (``recv_anysource``'s ``source_rank()`` must stay gloo's), and a gloo Work's
``get_future()`` is gloo's own, so a timeout seen only through the future carries gloo's
text.
"""

from __future__ import annotations

import datetime
from typing import Optional, Sequence

import torch.distributed as dist

from . import diagnosis, mismatch, recorder
from .config import Settings
from .errors import CollectiveTimeoutError, PeerFailedError
from .recorder import E_DTYPES, E_OP, E_ROOT, E_SEQ, E_SHAPES

# Calls that every rank makes alike and that the mismatch check compares.
_P2P = frozenset({"send", "recv", "recv_anysource"})


class GroupTrace:
    """The recorder of one group, and what uses it."""

    def __init__(self, store, name: str, global_ranks: Sequence[int], rank: int, settings: Settings):
        self.store = store
        self.settings = settings
        self.recorder = recorder.new_recorder(name, global_ranks, rank, settings.trace_buffer)
        self.check = settings.check_collectives
        if store is not None:  # (the CPU stand-ins of the tests have none)
            diagnosis.serve(store, self.recorder, settings.trace_dir)
        self._closed = False

    def call(self, op: str, tensors, root=None, reduce_op=None, route: str = "nccl",
             cpu_group=None) -> list:
        """Record one call (``tensors``: a flat sequence, those every rank passes alike) and,
        when enabled, check it against the other ranks first. Returns its entry."""
        shapes = tuple(t.shape for t in tensors)
        dtypes = tuple(t.dtype for t in tensors)
        rec = self.recorder
        if op in _P2P:
            return rec.record_p2p(op, shapes, dtypes, root, route)
        entry = rec.record(op, shapes, dtypes, root, route, "queued" if route != "gloo" else "issued")
        if self.check and cpu_group is not None:
            try:
                mismatch.check(cpu_group, mismatch.signature(entry[E_SEQ], op, shapes, dtypes, root, reduce_op),
                               rec.rank, len(rec.ranks), rec.group, rec.ranks)
            except BaseException:
                rec.mark(entry, "failed")
                raise
        return entry

    def gloo(self, work: dist.Work, entry: list) -> dist.Work:
        return TracedWork(work, entry, self)

    def explain_timeout(self, entry: Optional[list], timeout_s: Optional[float],
                        what: str = "timed out") -> str:
        """Diagnose a call that timed out (or failed: ``what``) across the ranks, in at most
        5 s; logs the message, dumps the trace when a folder is set, returns the message."""
        report = diagnosis.diagnose_timeout(self.store, self.recorder, entry, timeout_s,
                                            dump_dir=self.settings.trace_dir, what=what)
        return report.message

    def close(self, state: str) -> None:
        """The group is shut down ("completed" leaves finished entries alone) or aborted."""
        if self._closed:
            return
        self._closed = True
        diagnosis.unserve(self.recorder)
        self.recorder.mark_unfinished("aborted" if state == "aborted" else "failed")
        recorder.retire(self.recorder)


class TracedWork(dist.Work):
    """A gloo Work whose ``wait()`` keeps the flight recorder and names the rank behind on a
    timeout. Everything else is gloo's Work's."""

    def __init__(self, work: dist.Work, entry: list, trace: GroupTrace):
        super().__init__()
        self._work, self._entry, self._trace = work, entry, trace

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        try:
            done = self._work.wait(timeout) if timeout else self._work.wait()
        except Exception as exc:  # noqa: BLE001 - explained, then raised again
            # gloo raises from wait() only for what happened between the ranks (bad input
            # raises at the call): a timeout, or a peer that died or closed its connection.
            self._trace.recorder.mark(self._entry, "failed")
            if diagnosis.looks_like_timeout(exc):
                seconds = self._trace.settings.timeout.total_seconds()
                raise CollectiveTimeoutError(self._trace.explain_timeout(self._entry, seconds)) from exc
            cause = _first_sentence(exc)
            message = self._trace.explain_timeout(self._entry, None, f"failed ({cause})")
            raise PeerFailedError(message) from exc
        self._trace.recorder.mark(self._entry, "completed")
        return done

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def is_success(self) -> bool:
        return self._work.is_success()

    def exception(self):
        return self._work.exception()

    def result(self):
        return self._work.result()

    def source_rank(self) -> int:
        return self._work.source_rank()

    def synchronize(self) -> None:
        self._work.synchronize()

    def get_future(self):
        return self._work.get_future()

    def __repr__(self) -> str:
        entry = self._entry
        return (f"TracedWork({recorder.describe(entry[E_OP], entry[E_SEQ], entry[E_SHAPES], entry[E_DTYPES])}, "
                f"root={entry[E_ROOT]})")


def _first_sentence(exc: BaseException) -> str:
    """gloo's "[.../pair.cc:553] Connection closed by peer [host]:port. This is typically
    caused by ..." as "Connection closed by peer [host]:port"."""
    text = (str(exc).strip().splitlines() or [""])[0]
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". ", 1)[0].rstrip(".") or type(exc).__name__
