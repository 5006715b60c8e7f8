"""Live diagnosis on timeout: which rank is behind, and where it is.

When a collective times out (the watchdog, for CUDA; gloo's wait, for CPU), the rank calls
:func:`diagnose_timeout`. It publishes its progress (:func:`progress`: last issued and last
completed collective, the one it is stuck in) to the group's store under a key made of the
group, its incarnation and the stuck sequence number (so a later timeout in the same group
never reads stale records), asks every other rank to do the same, and reads their records
for at most ``wait_s`` (4 s). :func:`build_message`, a pure function, then says who is
where::

    all_reduce #42 (float32[1048576]) timed out after 30 s on ranks 0,1,3; rank 2 is
    behind: its last collective was #41 (broadcast) — it never reached #42

A rank that is behind is not timing out itself: it may be computing, or waiting in another
group. Its :class:`Responder` answers for it, a daemon thread per process that polls each
served group's request counter in the store (one round trip per group per second) and
publishes that rank's progress (unless the rank published its own record for that
collective), and, with a trace folder, dumps its recorders too. A store error ends the
serving of that group, logged as a warning. A rank
that neither times out nor answers (dead, or holding the GIL outside cupycoll) is named as
not answering.

Every store operation of the exchange runs on a daemon thread that the caller leaves after
``wait_s``: torch's store calls block for the store's own timeout (minutes), so a dead store
or a dead peer must not hold the timeout report back.

The keys live as long as the group: when a rank closes the group it counts itself out
(:func:`forget`), and the last rank out deletes every key of that group's diagnoses, so a
store that outlives many groups (a job that recovers by making new ones) does not grow with
their timeouts. A group that never diagnosed anything leaves no key behind either: the
responder only reads the request counter once a request made it. A rank that dies never
counts itself out, so the keys of a group with a dead rank stay in the store.

Deliberately left out: deciding what happens next (the caller raises, aborts, terminates),
and reading the other ranks' whole recorders (that is ``python -m cupycoll.trace``).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import socket
import threading
import time
from typing import Dict, List, Optional, Sequence

from .. import hooks
from . import recorder as _recorder
from .recorder import E_OP, E_SEQ, E_SHAPES, E_DTYPES, E_STATE, Recorder, describe, \
    dump_on_timeout

logger = logging.getLogger(__name__)  # a child of "cupycoll"

# How long a diagnosis waits for the other ranks' records. A silent rank costs the whole
# wait, and the rest of the diagnosis up to a second more: at 4 s a timeout's error comes
# within the group timeout + 5 s, the bound docs/faults.md states.
DEFAULT_WAIT_S = 4.0
RESPONDER_INTERVAL_S = 1.0
POLL_S = 0.05
# How long closing a group waits for its count-out and, on the last rank, the deletion of the
# group's diagnosis keys: a dead store must not hold destroy_process_group back.
FORGET_WAIT_S = 1.0
KEY_ROOT = "cupycoll-diag"
_STATE_TEXT = {"completed": "", "issued": "not completed", "queued": "not yet issued",
               "failed": "failed", "aborted": "aborted"}

# A rank's own record (its own timeout) and its responder's answer for the same collective
# are written by two threads of one process, often at the same moment (two ranks time out
# together, each one's request wakes the other's responder). The responder checks and
# writes under this lock, and never writes a key this process claimed for its own record;
# the own record is claimed under it and written after, so it is the one that stays.
_records_lock = threading.Lock()
_own_records: collections.deque = collections.deque(maxlen=256)


def key_prefix(group: str, incarnation: int) -> str:
    return f"{KEY_ROOT}/{group}/{incarnation}"


# -- this rank's record -------------------------------------------------------------------

def progress(recorder: Recorder, stuck=None) -> dict:
    """This rank's record for the store. ``stuck``: the entry (or a dict with seq, op, desc)
    of the collective that timed out here; default: the oldest one issued and unfinished."""
    if stuck is None:
        stuck = recorder.stuck()
    if isinstance(stuck, list):
        stuck = {"seq": stuck[E_SEQ], "op": stuck[E_OP],
                 "desc": describe(stuck[E_OP], stuck[E_SEQ], stuck[E_SHAPES], stuck[E_DTYPES])}
    last = recorder.last_issued_entry
    return {"rank": recorder.rank, "global_rank": recorder.ranks[recorder.rank],
            "last_issued": recorder.last_issued,
            "last_issued_op": None if last is None else last[E_OP],
            "last_issued_state": None if last is None else last[E_STATE],
            "last_completed": recorder.last_completed, "stuck": stuck,
            "host": socket.gethostname(), "pid": os.getpid()}


# -- the message (pure) -------------------------------------------------------------------

def ranks_text(ranks: Sequence[int]) -> str:
    """``rank 2`` / ``ranks 0,1,3`` / ``ranks 0-63,65``: runs of three or more collapse."""
    ranks = sorted(set(int(r) for r in ranks))
    parts, start = [], 0
    while start < len(ranks):
        end = start
        while end + 1 < len(ranks) and ranks[end + 1] == ranks[end] + 1:
            end += 1
        if end - start >= 2:
            parts.append(f"{ranks[start]}-{ranks[end]}")
        else:
            parts.extend(str(r) for r in ranks[start:end + 1])
        start = end + 1
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(parts)


def _position(seq: int, op: Optional[str], state: Optional[str]) -> str:
    if not seq:
        return "none"
    note = _STATE_TEXT.get(state or "completed", state)
    return f"#{seq} ({op}{', ' + note if note else ''})"


def _listing(items: List[str], limit: int = 8) -> str:
    if len(items) > limit:
        items = items[:limit] + [f"{len(items) - limit} more"]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


@dataclasses.dataclass
class Classified:
    """Where each rank is relative to the stuck collective (global ranks)."""

    at: List[int] = dataclasses.field(default_factory=list)  # in it, with the same op
    other_op: Dict[str, List[int]] = dataclasses.field(default_factory=dict)  # in it, as another op
    behind: Dict[tuple, List[int]] = dataclasses.field(default_factory=dict)  # (seq, op, state)
    earlier: Dict[tuple, List[int]] = dataclasses.field(default_factory=dict)  # still in an older one
    ahead: Dict[tuple, List[int]] = dataclasses.field(default_factory=dict)  # past it: (seq, op)
    silent: List[int] = dataclasses.field(default_factory=list)


def classify(seq: int, op: str, records: Dict[int, Optional[dict]],
             ranks: Sequence[int]) -> Classified:
    """Sort the group's ranks (``records``: group rank -> record or None) around ``seq``."""
    out = Classified()
    for group_rank, name in enumerate(ranks):
        rec = records.get(group_rank)
        if not rec:
            out.silent.append(name)
            continue
        stuck = rec.get("stuck") or None
        last = int(rec.get("last_issued") or 0)
        if stuck is not None and stuck.get("seq") == seq:
            if stuck.get("op") == op:
                out.at.append(name)
            else:
                out.other_op.setdefault(stuck.get("op"), []).append(name)
        elif last < seq:
            key = (last, rec.get("last_issued_op"), rec.get("last_issued_state"))
            out.behind.setdefault(key, []).append(name)
        elif stuck is not None and stuck.get("seq", 0) < seq:
            out.earlier.setdefault((stuck.get("seq"), stuck.get("op")), []).append(name)
        else:
            current = stuck or {"seq": last, "op": rec.get("last_issued_op")}
            out.ahead.setdefault((current.get("seq"), current.get("op")), []).append(name)
    return out


def build_message(stuck: dict, timeout_s: Optional[float], records: Dict[int, Optional[dict]],
                  ranks: Sequence[int], wait_s: float = DEFAULT_WAIT_S,
                  store_error: Optional[str] = None, group: str = "", what: str = "timed out",
                  one_gone: bool = False) -> str:
    """The timeout report. ``stuck``: {"seq", "op", "desc"} of the collective that timed
    out; ``records``: what each group rank published (None or absent: no answer);
    ``ranks``: the global rank of each group rank (the message names global ranks);
    ``what`` happened to it here (``"failed (a peer closed the connection)"``);
    ``one_gone``: a peer is known to be gone (its connection closed), and the exchange ended
    once every rank but one had answered."""
    seq, op = stuck["seq"], stuck["op"]
    c = classify(seq, op, records, ranks)
    desc = stuck.get("desc") or f"{op} #{seq}"
    after = f" after {timeout_s:g} s" if timeout_s is not None else ""
    where = f"process group {group!r}: " if group else ""
    head = f"{where}{desc} {what}{after}"
    if c.at:
        head += " on " + ("all ranks" if len(c.at) == len(ranks) > 1 else ranks_text(c.at))
    parts = []
    for other, names in sorted(c.other_op.items(), key=lambda kv: kv[1][0]):
        verb = "is" if len(names) == 1 else "are"
        parts.append(f"{ranks_text(names)} {verb} in #{seq} as {other}, not {op}: the ranks "
                     "called their collectives in different orders")
    if c.behind:
        everyone = sorted(r for names in c.behind.values() for r in names)
        one = len(everyone) == 1
        subject = f"{ranks_text(everyone)} {'is' if one else 'are'} behind"
        never = f"{'it' if one else 'they'} never reached #{seq}"
        if len(c.behind) == 1:
            (last, last_op, state), = c.behind
            if not last:
                parts.append(f"{subject}: {'it has' if one else 'they have'} made no collective "
                             f"on this group yet — {never}")
            else:
                parts.append(f"{subject}: {'its' if one else 'their'} last collective was "
                             f"{_position(last, last_op, state)} — {never}")
        else:
            items = [f"{_position(*key)} on {ranks_text(names)}"
                     for key, names in sorted(c.behind.items(), key=lambda kv: -kv[0][0])]
            parts.append(f"{subject}: their last collectives were {_listing(items)} — {never}")
    for (old, old_op), names in sorted(c.earlier.items()):
        verb = "is" if len(names) == 1 else "are"
        parts.append(f"{ranks_text(names)} {verb} still in #{old} ({old_op})")
    for (new, new_op), names in sorted(c.ahead.items()):
        parts.append(f"{ranks_text(names)} completed #{seq} and went on to #{new} ({new_op})")
    if store_error is not None:
        parts.append(f"the store did not answer within {wait_s:g} s ({store_error}), so no "
                     "other rank could be asked")
    elif c.silent and one_gone and len(c.silent) == 1:
        parts.append(f"{ranks_text(c.silent)} did not answer and every other rank did: it is the "
                     "peer whose connection closed (dead, or it ended the group)")
    elif c.silent:
        parts.append(f"{ranks_text(c.silent)} did not answer within {wait_s:g} s (dead, "
                     "or stuck outside cupycoll)")
    if not parts and c.at and len(c.at) == len(ranks):
        parts.append(f"no rank is behind: all reached #{seq}, so the collective itself is stuck "
                     "(NCCL, the network or a GPU), or the ranks passed it different arguments "
                     "(CUPYCOLL_CHECK_COLLECTIVES=1 checks them)")
    return "; ".join([head] + parts)


# -- the exchange -------------------------------------------------------------------------

@dataclasses.dataclass
class Report:
    message: str
    records: Dict[int, dict]  # group rank -> record, for the ranks that answered
    classified: Classified
    store_error: Optional[str] = None
    elapsed_s: float = 0.0


def diagnose(store, group: str, rank: int, size: int, mine: dict, timeout_s: Optional[float] = None,
             wait_s: float = DEFAULT_WAIT_S, ranks: Optional[Sequence[int]] = None,
             incarnation: int = 0, what: str = "timed out", one_gone: bool = False) -> Report:
    """Publish ``mine`` (:func:`progress`, whose ``stuck`` names the collective), ask the
    other ranks, read their records for at most ``wait_s``, and build the report. Returns
    within ``wait_s`` (plus a few ms) whatever the store and the peers do; never raises.
    ``one_gone``: a peer is known to be gone (gloo saw its connection close), so the records
    are read only until every rank but one has published."""
    started = time.monotonic()
    ranks = list(range(size)) if ranks is None else list(ranks)
    stuck = mine.get("stuck") or {"seq": int(mine.get("last_issued", 0)) + 1, "op": "?"}
    results: Dict[int, dict] = {rank: mine}
    notes: List[str] = []  # "published" once the store took ours; then any store error
    stop = threading.Event()
    thread = threading.Thread(
        target=_exchange, name="cupycoll-diagnosis", daemon=True,
        args=(store, key_prefix(group, incarnation), stuck["seq"], rank, size, mine, results,
              notes, stop, started + wait_s, size - 1 if one_gone else size))
    thread.start()
    thread.join(wait_s)
    stop.set()
    records = dict(results)
    # No answer at all: if the store never took our record (the thread is stuck in its first
    # call, or it raised), blame the store; if it did, the peers are silent.
    error = None
    if len(records) == 1 and size > 1:
        published = "published" in notes
        errors = [f for f in notes if f != "published"]
        error = errors[0] if errors else (None if published else "no reply")
    message = build_message(stuck, timeout_s, records, ranks, wait_s, error, group, what,
                            one_gone and len(records) == size - 1)
    return Report(message, records, classify(stuck["seq"], stuck["op"], records, ranks), error,
                  time.monotonic() - started)


def _exchange(store, prefix, seq, rank, size, mine, results, notes, stop, deadline, enough) -> None:
    try:
        base = f"{prefix}/{seq}"
        with _records_lock:  # waits while this process' responder writes that key
            _own_records.append(f"{base}/{rank}")
        store.set(f"{base}/{rank}", json.dumps(mine))
        store.add(f"{base}/count", 1)
        number = store.add(f"{prefix}/requests", 1)  # wakes the other ranks' responders
        store.set(f"{prefix}/request/{number}", str(seq))
        notes.append("published")  # the store works: silence is the peers'
        if len(results) >= enough:  # a group of two whose other rank is gone: nobody to ask
            return
        seen = None
        while not stop.is_set():
            count = store.add(f"{base}/count", 0)
            if count != seen:  # someone new published: read what is there
                seen = count
                for other in range(size):
                    key = f"{base}/{other}"
                    if other not in results and store.check([key]):
                        results[other] = json.loads(store.get(key))
                if len(results) >= enough:
                    return
            if time.monotonic() >= deadline:
                return
            stop.wait(POLL_S)
    except Exception as exc:  # noqa: BLE001 - reported in the message, never raised
        notes.append(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")


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


def forget(store, recorder: Recorder, wait_s: float = FORGET_WAIT_S) -> None:
    """This rank closed the group: count it out of the group's diagnosis keys; the last rank
    out deletes them all (the records, the requests, their counters). Returns within
    ``wait_s`` whatever the store does; never raises (a store without ``delete_key`` keeps
    its keys)."""
    size = len(recorder.ranks)
    if store is None or size < 2:
        return
    thread = threading.Thread(target=_count_out, name="cupycoll-diagnosis-forget", daemon=True,
                              args=(store, key_prefix(recorder.group, recorder.incarnation), size))
    try:
        thread.start()
    except RuntimeError:  # Python 3.12+ at interpreter exit: no new threads; the keys stay
        return
    thread.join(wait_s)


def _count_out(store, prefix: str, size: int) -> None:
    try:
        if store.add(f"{prefix}/closed", 1) < size:
            return
        keys = [f"{prefix}/closed"]
        requests_key = f"{prefix}/requests"
        if store.check([requests_key]):
            keys.append(requests_key)
            seqs = set()
            for number in range(1, store.add(requests_key, 0) + 1):
                key = f"{prefix}/request/{number}"
                if store.check([key]):
                    keys.append(key)
                    seqs.add(int(store.get(key)))
            for seq in seqs:
                base = f"{prefix}/{seq}"
                keys += [f"{base}/count"] + [f"{base}/{rank}" for rank in range(size)]
        for key in keys:
            store.delete_key(key)
    except Exception as exc:  # noqa: BLE001 - the keys stay; nothing else depends on them
        logger.debug("diagnosis keys under %r not deleted: %s", prefix, exc)


def looks_like_timeout(exc: BaseException) -> bool:
    """Is ``exc`` (raised by a gloo Work's wait) a timeout? gloo says so only in its text."""
    if isinstance(exc, TimeoutError):
        return True
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


# What gloo's errors say when the trouble is between the ranks (a peer died or closed its
# connection), as against an argument this rank passed ("Invalid scalar type", an op gloo
# lacks), which gloo also reports only at wait().
_PEER_WORDS = ("connection", "closed by peer", "reset by peer", "broken pipe", "pair closure", "socket",
               "peer")


def looks_like_peer_failure(exc: BaseException) -> bool:
    """Is ``exc`` (raised by a gloo Work's wait) about a peer or the link to it?"""
    if isinstance(exc, (ConnectionError, EOFError)):
        return True
    text = str(exc).lower()
    return any(words in text for words in _PEER_WORDS)


# -- the responder ------------------------------------------------------------------------

class _Served:
    def __init__(self, store, recorder: Recorder, dump_dir: Optional[str], interval: float):
        self.store, self.recorder, self.dump_dir = store, recorder, dump_dir
        self.interval = interval
        self.prefix = key_prefix(recorder.group, recorder.incarnation)
        self.handled = 0
        self.answered: collections.deque = collections.deque(maxlen=64)

    def poll(self) -> None:
        store = self.store
        requests_key = f"{self.prefix}/requests"
        # check first: add() would create the counter, a key even a group that never timed
        # out would then leave in the store
        if not store.check([requests_key]):
            return
        pending = store.add(requests_key, 0)
        while self.handled < pending:
            key = f"{self.prefix}/request/{self.handled + 1}"
            if not store.check([key]):
                return  # counted but not written yet: the next poll reads it
            seq = int(store.get(key))
            self.handled += 1
            if seq not in self.answered:
                self.answered.append(seq)
                self.answer(seq)

    def answer(self, seq: int) -> None:
        rank = self.recorder.rank
        base = f"{self.prefix}/{seq}"
        key = f"{base}/{rank}"
        # This rank publishes its own record when it timed out at ``seq`` too (the request may
        # be its own): that one names the collective it is stuck in, while ours, taken later,
        # may find it already failed and tell the peers it "completed #seq and went on".
        with _records_lock:
            if key in _own_records:
                return
            self.store.set(key, json.dumps(progress(self.recorder)))
        self.store.add(f"{base}/count", 1)
        dump_on_timeout(self.dump_dir, self.recorder.ranks[rank],
                        f"a peer's timeout in group {self.recorder.group!r} at #{seq}")


class Responder:
    """The process's thread answering peers' diagnosis requests for every served group."""

    def __init__(self):
        self._served: Dict[int, _Served] = {}
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._wake = threading.Event()

    def serve(self, store, recorder: Recorder, dump_dir: Optional[str] = None,
              interval: float = RESPONDER_INTERVAL_S) -> None:
        with self._lock:
            self._served[id(recorder)] = _Served(store, recorder, dump_dir, interval)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="cupycoll-responder",
                                                daemon=True)
                self._thread.start()

    def unserve(self, recorder: Recorder) -> None:
        with self._lock:
            self._served.pop(id(recorder), None)
        self._wake.set()

    @property
    def running(self) -> bool:
        return self._thread is not None

    def stop(self, wait_s: float = 2.0) -> None:
        """Stop serving every group and let the thread leave (at exit: a daemon thread still
        inside a store call when the interpreter finalizes can abort the process,
        "terminate called without an active exception")."""
        with self._lock:
            self._served.clear()
            thread = self._thread
        self._wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(wait_s)

    def _run(self) -> None:
        while True:
            with self._lock:
                served = list(self._served.values())
                if not served:
                    self._thread = None
                    return
            for item in served:
                try:
                    item.poll()
                except Exception as exc:  # noqa: BLE001 - a dead store: stop asking it
                    # For good: this rank no longer answers its peers' timeouts in that group.
                    logger.warning("group %r: the store failed (%s); no "
                                   "longer answering diagnosis requests for it",
                                   item.recorder.group, exc)
                    self.unserve(item.recorder)
            self._wake.wait(min(item.interval for item in served))
            self._wake.clear()


RESPONDER = Responder()
serve = RESPONDER.serve
unserve = RESPONDER.unserve


def _after_fork_in_child() -> None:
    # The parent's responder thread is not in the child, and a thread of the parent may have
    # held its lock or the recorders' when it forked; the parent's groups are not the child's
    # to answer for. Start afresh (serve() starts a thread again).
    global _records_lock
    RESPONDER.__init__()
    _recorder._lock = threading.Lock()
    _records_lock = threading.Lock()
    _own_records.clear()


hooks.in_forked_child("diagnosis", _after_fork_in_child)
hooks.at_exit("diagnosis", RESPONDER.stop)
