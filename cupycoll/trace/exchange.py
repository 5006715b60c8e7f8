"""The timeout diagnosis's store exchange: every rank that timed out publishes its record,
and the ranks' records come back, with the diagnoser's verdict.

When a collective times out (the watchdog, for CUDA; gloo's wait, for CPU), the rank calls
:func:`diagnose_timeout`. It publishes its progress (:func:`~cupycoll.trace.records.progress`:
last issued and last completed collective, the one it is stuck in) to the group's store and
reads the other ranks' for at most ``wait_s`` (4 s); the message
(:func:`cupycoll.trace.diagnosis.build_message`) then says who is where.

**The exchange costs every rank a few store calls, whatever the world size.** The keys are
made of the group, its incarnation and the stuck sequence number (so a later timeout in
the same group never reads stale records). Each rank appends one JSON line to one key
(``.../<seq>/records``) and counts itself in (``.../<seq>/count``); the one whose count
reaches the group's size sets ``.../<seq>/all`` (one short of it, ``.../<seq>/most``, for a
diagnosis that knows a peer is gone). The first rank to count itself in is the
*diagnoser*: it asks the other ranks (one item in the group's news, every member's bell
rung with one ``multi_set``: :mod:`cupycoll.trace.news`), waits for ``all`` (served by the
store: no polling), reads the records with one ``get`` and publishes its report
(``.../<seq>/verdict``). Every other rank timing out in the same collective waits for that
verdict instead of reading every record, so the store sends the N records once, not N
times; it reads them itself only when no verdict comes in time. Each wait ends by the
deadline at the latest, and the exchange's thread with it. A rank that is not timing out
is answered for by its listener (:mod:`cupycoll.trace.listener`), through :func:`answer`.

Every store operation of the exchange runs on a daemon thread that the caller leaves after
``wait_s``: torch's store calls block for the store's own timeout (minutes), so a dead store
or a dead peer must not hold the timeout report back. :func:`diagnose` never raises.

Deliberately left out: deciding what happens next (the caller raises, aborts, terminates),
and reading the other ranks' whole recorders (that is ``python -m cupycoll.trace``).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import threading
import time
from typing import Dict, Optional, Sequence

from .. import bounds
from .diagnosis import Classified, build_message, classify
from .dumps import dump_on_timeout
from .news import append_news, is_store_timeout, key_prefix, store_timeout
from .recorder import E_STATE, Recorder
from .records import escape, parse_records, progress, valid_verdict

logger = logging.getLogger(__name__)  # a child of "cupycoll"

DEFAULT_WAIT_S = bounds.DIAGNOSIS_WAIT_S
# How long the caller waits past ``wait_s`` for the exchange to read the records once its
# waits have ended (one get): within the second the timeout's bound leaves the diagnosis.
_READ_S = 0.5

# A rank's own record (its own timeout) and its listener's answer for the same collective
# are written by two threads of one process, often at the same moment (two ranks time out
# together, each one's request wakes the other's listener). Whichever comes first counts
# the rank in; both append, and a reader takes the rank's own record over an answer, which,
# taken later, may find the collective already failed and tell the peers it "completed
# #seq and went on". These sets (bounded) say which came, per store (held: its id is never
# another's while it is here) and record key, under this lock.
_records_lock = threading.Lock()
_own_records: collections.deque = collections.deque(maxlen=256)
_counted: collections.deque = collections.deque(maxlen=512)


@dataclasses.dataclass
class Report:
    message: str
    records: Dict[int, dict]  # group rank -> record, for the ranks that answered
    classified: Classified
    store_error: Optional[str] = None
    elapsed_s: float = 0.0


def _signal(store, base: str, count: int, size: int) -> None:
    """This rank counted itself in as the ``count``-th of ``size``: the count that ends a
    wait publishes it (``all``; one short of it, ``most``, for a known-gone peer)."""
    if count == size:
        store.set(f"{base}/all", b"1")
    if count == size - 1 and size > 1:
        store.set(f"{base}/most", b"1")


def _first(key: tuple, own: bool) -> bool:
    """Is this the first record of ``key`` (store, record key) this process publishes (its
    own, or its listener's answer)? It then counts the rank in. ``own``: the rank's own,
    which the listener never answers over. Decided under _records_lock; the store calls
    that follow are made outside it."""
    with _records_lock:
        if own:
            _own_records.append(key)
        elif key in _own_records:
            return False
        if key in _counted:
            return False
        _counted.append(key)
        return True


def _count_in(store, base: str, size: int) -> int:
    """Count this rank in for the collective at ``base``; the count."""
    count = store.add(f"{base}/count", 1)
    _signal(store, base, count, size)
    return count


def _wait(store, key: str, deadline: float) -> None:
    """Wait, served by the store, until ``key`` exists or the deadline passes."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        return
    try:
        store.wait([key], store_timeout(remaining))
    except Exception as exc:  # noqa: BLE001 - the deadline: read what is there
        if not is_store_timeout(exc):
            raise


def diagnose(store, group: str, rank: int, size: int, mine: dict, timeout_s: Optional[float] = None,
             wait_s: float = DEFAULT_WAIT_S, ranks: Optional[Sequence[int]] = None,
             incarnation: int = 0, what: str = "timed out", one_gone: bool = False) -> Report:
    """Publish ``mine`` (:func:`~cupycoll.trace.records.progress`, whose ``stuck`` names the
    collective), ask the other ranks, read their records for at most ``wait_s``, and build
    the report. Returns within ``wait_s`` + 0.5 s (the last read) whatever the store and the
    peers do; never raises.
    ``one_gone``: a peer is known to be gone (gloo saw its connection close), so the records
    are read only until every rank but one has published."""
    started = time.monotonic()
    try:
        ranks = list(range(size)) if ranks is None else list(ranks)
        stuck = mine.get("stuck") or {"seq": int(mine.get("last_issued") or 0) + 1, "op": "?"}
        shared = _Shared(rank, mine)
        thread = threading.Thread(
            target=_exchange, name="cupycoll-diagnosis", daemon=True,
            args=(store, key_prefix(group, incarnation), stuck, rank, size, ranks, shared,
                  started + wait_s, size - 1 if one_gone else size,
                  (timeout_s, wait_s, group, what, one_gone)))
        thread.start()
        thread.join(wait_s + _READ_S)  # its waits end by wait_s; then it reads what is there
        return shared.report(stuck, timeout_s, ranks, wait_s, group, what, one_gone, started)
    except Exception as exc:  # noqa: BLE001 - the report of a diagnosis that could not run
        logger.debug("the diagnosis of group %r failed: %r", group, exc)
        stuck = {"seq": 0, "op": "?"}
        if isinstance(mine, dict) and isinstance(mine.get("stuck"), dict):
            stuck = mine["stuck"]
        text = f"the diagnosis failed ({type(exc).__name__}: {escape(exc)})"
        desc = escape(stuck.get("desc") or f"{stuck.get('op')} #{stuck.get('seq')}")
        return Report(f"{desc} {what}; {text}", {}, Classified(), text, time.monotonic() - started)


class _Shared:
    """What the exchange's thread hands its caller, who may leave before it ends: read under
    the lock, and only once, in :meth:`report`."""

    def __init__(self, rank: int, mine: dict):
        self.lock = threading.Lock()
        self.records: Dict[int, dict] = {rank: mine}
        self.published = False  # the store took our record: silence is the peers'
        self.error: Optional[str] = None  # the first store error
        self.verdict: Optional[dict] = None  # another rank's report of the same collective
        self.done = False

    def report(self, stuck, timeout_s, ranks, wait_s, group, what, one_gone, started) -> Report:
        with self.lock:
            self.done = True  # what the thread finds from now on is not read
            records, verdict = dict(self.records), self.verdict
            published, error = self.published, self.error
        size = len(ranks)
        if verdict is not None:
            records = verdict["records"]
            return Report(verdict["message"], records, classify(stuck["seq"], stuck["op"], records, ranks),
                          None, time.monotonic() - started)
        # No answer at all: if the store never took our record (the thread is stuck in its first
        # call, or it raised), blame the store; if it did, the peers are silent.
        store_error = None
        if len(records) == 1 and size > 1:
            store_error = error if error is not None else (None if published else "no reply")
        message = build_message(stuck, timeout_s, records, ranks, wait_s, store_error, group, what,
                                one_gone and len(records) == size - 1)
        return Report(message, records, classify(stuck["seq"], stuck["op"], records, ranks), store_error,
                      time.monotonic() - started)


def _exchange(store, prefix, stuck, rank, size, ranks, shared: _Shared, deadline, enough, about) -> None:
    seq = stuck["seq"]
    base = f"{prefix}/{seq}"
    try:
        first = _first((store, f"{base}/{rank}"), own=True)
        store.append(f"{base}/records", json.dumps(shared.records[rank]) + "\n")
        count = _count_in(store, base, size) if first else None
        with shared.lock:
            shared.published = True
        # The waits below hold this rank's client (a client serves one call at a time) for at most
        # the diagnosis; a connection of their own would cost the server a burst of connections.
        waiter = store
        if count is not None and count == 1:  # the first here: ask the others, then report
            append_news(store, prefix, {"kind": "ask", "seq": seq, "from": ranks[rank]}, ranks, ranks[rank])
        elif count is None or count > 1:  # another rank diagnoses this collective: its verdict
            _wait(waiter, f"{base}/verdict", deadline)
            if store.check([f"{base}/verdict"]):
                verdict = valid_verdict(store.get(f"{base}/verdict"), size)
                if verdict is not None:
                    with shared.lock:
                        shared.verdict = verdict
                    return
        if size > 1 and (count is None or count < enough):
            _wait(waiter, f"{base}/{'most' if enough < size else 'all'}", deadline)
        found = parse_records(store.get(f"{base}/records"), size) if size > 1 else {}
        with shared.lock:
            if shared.done:
                return
            for other, record in found.items():
                if other != rank:
                    shared.records[other] = record
            records = dict(shared.records)
        if count == 1:
            timeout_s, wait_s, group, what, one_gone = about
            message = build_message(stuck, timeout_s, records, ranks, wait_s, None, group, what,
                                    one_gone and len(records) == size - 1)
            store.set(f"{base}/verdict", json.dumps({"message": message, "records": records}))
    except Exception as exc:  # noqa: BLE001 - reported in the message, never raised
        with shared.lock:
            if shared.error is None:
                shared.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def diagnose_timeout(store, recorder: Recorder, stuck=None, timeout_s: Optional[float] = None,
                     wait_s: float = DEFAULT_WAIT_S, dump_dir: Optional[str] = None,
                     what: str = "timed out", one_gone: bool = False) -> Report:
    """The timeout path: :func:`diagnose` this rank's stuck collective (an entry, or
    ``{"seq", "op", "desc"}``), write the trace to ``dump_dir`` when set, log the message."""
    mine = progress(recorder, stuck)
    report = diagnose(store, recorder.group, recorder.rank, len(recorder.ranks), mine,
                      timeout_s, wait_s, recorder.ranks, recorder.incarnation, what, one_gone)
    dump_on_timeout(dump_dir, recorder.ranks[recorder.rank], f"{what}: {report.message}")
    # The caller raises this message (the CPU route) or the watchdog logs its fault at ERROR
    # (the CUDA route, as torch's nccl watchdog does): logged once, there.
    logger.debug("%s", report.message)
    return report


def answer(store, recorder: Recorder, seq: int, dump_dir: Optional[str] = None) -> None:
    """A peer asked for this rank's record of collective ``seq`` (the rank's listener read
    the request): append it and count the rank in, unless this process published the
    rank's own; with a trace folder, dump the recorders too."""
    rank = recorder.rank
    base = f"{key_prefix(recorder.group, recorder.incarnation)}/{seq}"
    key = (store, f"{base}/{rank}")
    # This rank publishes its own record when it timed out at ``seq`` too (the request may
    # be its own): that one names the collective it is stuck in, and a reader takes it
    # over this answer, which may find it already failed and say it "completed #seq".
    if not _first(key, own=False):
        return
    # A rank that failed in #seq itself (its own record may not be there yet) was in it.
    entry = recorder.find(seq)
    held = entry if entry is not None and entry[E_STATE] in ("issued", "failed") else None
    store.append(f"{base}/records", json.dumps({**progress(recorder, held), "answered_by": "listener"}) + "\n")
    _count_in(store, base, len(recorder.ranks))
    dump_on_timeout(dump_dir, recorder.ranks[rank], f"a peer's timeout in group {recorder.group!r} at #{seq}")


def after_fork_in_child() -> None:
    """Forget which records this process published: the parent's are not the child's, and
    a thread of the parent may have held the lock when it forked."""
    global _records_lock
    _records_lock = threading.Lock()
    _own_records.clear()
    _counted.clear()
