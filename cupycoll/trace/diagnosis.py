"""Live diagnosis on timeout: which rank is behind, and where it is; and a fault one rank
found, told to every other rank of the group.

When a collective times out (the watchdog, for CUDA; gloo's wait, for CPU), the rank calls
:func:`diagnose_timeout`. It publishes its progress (:func:`progress`: last issued and last
completed collective, the one it is stuck in) to the group's store and reads the other
ranks' for at most ``wait_s`` (4 s); :func:`build_message`, a pure function, then says who is
where::

    all_reduce #42 (float32[1048576]) timed out after 30 s on ranks 0,1,3; rank 2 is
    behind: its last collective was #41 (broadcast) — it never reached #42

**The exchange costs every rank a few store calls, whatever the world size.** The keys are
made of the group, its incarnation and the stuck sequence number (so a later timeout in
the same group never reads stale records). Each rank appends one JSON line to one key
(``.../<seq>/records``) and counts itself in (``.../<seq>/count``); the one whose count
reaches the group's size sets ``.../<seq>/all`` (one short of it, ``.../<seq>/most``, for a
diagnosis that knows a peer is gone). The first rank to count itself in is the
*diagnoser*: it asks the other ranks (one item in the group's news, every member's bell
rung with one ``multi_set``), waits for ``all`` (served by the store: no polling), reads the
records with one ``get`` and publishes its report (``.../<seq>/verdict``). Every other rank
timing out in the same collective waits for that verdict instead of reading every record,
so the store sends the N records once, not N times; it reads them itself only when no
verdict comes in time. Each wait ends by the deadline at the latest, and the exchange's
thread with it.

A rank that is behind is not timing out itself: it may be computing, or waiting in another
group. Its **listener** answers for it: one daemon thread per rank of the process (one per
process but in tests), which waits, served by the store, on that rank's one *bell* key
(``cupycoll-bell/<global rank>`` on the root store beneath the groups' prefixes) on a
connection of its own (a clone of the store: torch 2.8+, :data:`cupycoll.compat.STORE_CLONE`);
idle, it makes no store call at all. Rung, it reads the news of each group it serves (one
``get`` each), appends that rank's record for a peer's request (unless the rank published
its own for that collective) and, with a trace folder, dumps its recorders too. Where the
store cannot be cloned it looks at its bell every :data:`cupycoll.bounds.RESPONDER_INTERVAL_S`
instead (one ``check`` a look, whatever the number of groups). A store error ends the
serving of that group, logged as a warning. A rank that neither times out nor answers
(dead, or holding the GIL outside cupycoll) is named as not answering.

**A fault one rank finds reaches every rank.** Once a group's lifetime has made a fault its
own (and explained it), :func:`publish_fault` appends it to the group's news and rings the
members' bells; each member's listener hands it to that group's ``on_fault`` callback (its
lifetime, which fails the group's pending Works at once with the same typed error). A
published fault is never published again.

**The store is input, not trust.** Any client of torch's TCPStore may write these keys, and
peers may run another cupycoll: every record and every news item is validated
(:func:`valid_record`, :func:`valid_item`); a malformed record counts as a rank that did not
answer, a malformed item is skipped, and text from a peer (op names, messages) is escaped
before it reaches a message or a log (:func:`escape`). :func:`diagnose` never raises.

Every store operation of the exchange runs on a daemon thread that the caller leaves after
``wait_s``: torch's store calls block for the store's own timeout (minutes), so a dead store
or a dead peer must not hold the timeout report back.

The keys live as long as the group: when a rank closes the group it counts itself out
(:func:`forget`), and the last rank out deletes every key of that group's diagnoses and
news (and the bells the group rang), so a store that outlives many groups (a job that
recovers by making new ones) does not grow with their timeouts. A group that never
diagnosed anything leaves no key behind either. A rank that dies never counts itself out,
so the keys of a group with a dead rank stay in the store.

Deliberately left out: deciding what happens next (the caller raises, aborts, terminates:
the group's lifetime decides what a published fault means), and reading the other ranks'
whole recorders (that is ``python -m cupycoll.trace``).
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
from typing import Callable, Dict, List, Optional, Sequence

from .. import bounds, compat, hooks
from . import recorder as _recorder
from .recorder import E_OP, E_SEQ, E_SHAPES, E_DTYPES, E_STATE, STATES, Recorder, describe, \
    dump_on_timeout

logger = logging.getLogger(__name__)  # a child of "cupycoll"

DEFAULT_WAIT_S = bounds.DIAGNOSIS_WAIT_S
RESPONDER_INTERVAL_S = bounds.RESPONDER_INTERVAL_S
FORGET_WAIT_S = bounds.FORGET_WAIT_S
KEY_ROOT = "cupycoll-diag"
BELL_ROOT = "cupycoll-bell"
# How long a listener's wait for its bell lasts before it waits again: as long as it gets.
# It is rung to wake (a peer's news, or its own stop at exit); a wait that runs out costs a
# store call and a warning line from torch's TCPStore client.
_BELL_WAIT_S = 24 * 3600.0
_STATE_TEXT = {"completed": "", "issued": "not completed", "queued": "not yet issued",
               "failed": "failed", "aborted": "aborted"}
# The errors a published fault may name; anything else reads as a peer's failure.
FAULT_KINDS = ("CollectiveTimeoutError", "PeerFailedError", "NcclError", "CommunicatorAbortedError")
# Longest text from a peer that reaches a message (an op name, a described collective) and
# longest published fault message kept.
_TEXT_LIMIT = 200
# How long the caller waits past ``wait_s`` for the exchange to read the records once its
# waits have ended (one get): within the second the timeout's bound leaves the diagnosis.
_READ_S = 0.5
_MESSAGE_LIMIT = 4000

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


def key_prefix(group: str, incarnation: int) -> str:
    return f"{KEY_ROOT}/{group}/{incarnation}"


def bell_key(global_rank: int) -> str:
    return f"{BELL_ROOT}/{global_rank}"


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


# -- what a peer wrote: validated, escaped --------------------------------------------------

def escape(text, limit: int = _TEXT_LIMIT) -> str:
    """``text`` from a peer, fit for a message or a log line: control characters (a newline
    that would forge a log line, an escape sequence) written as escapes, at most ``limit``
    characters."""
    text = str(text)
    if len(text) > limit:
        text = text[:limit] + "..."
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def _whole(value, low: int = 0) -> bool:
    return type(value) is int and value >= low


def _optional_text(value) -> bool:
    return value is None or isinstance(value, str)


def valid_record(value, size: Optional[int] = None) -> Optional[dict]:
    """A record a peer published (:func:`progress`'s shape), checked field by field: a copy
    of the fields that matter, its text escaped; None when it is not one (it then counts as
    a rank that did not answer). With ``size``, its ``rank`` must be a rank of the group."""
    if not isinstance(value, dict):
        return None
    rank, last = value.get("rank"), value.get("last_issued") or 0
    stuck = value.get("stuck")
    if size is not None and not (_whole(rank) and rank < size):
        return None
    if not (_whole(last) and _whole(value.get("last_completed") or 0)):
        return None
    if not (_optional_text(value.get("last_issued_op")) and value.get("last_issued_state") in (None, *STATES)):
        return None
    if stuck is not None:
        if not (isinstance(stuck, dict) and _whole(stuck.get("seq"), 1) and isinstance(stuck.get("op"), str)
                and _optional_text(stuck.get("desc"))):
            return None
        stuck = {"seq": stuck["seq"], "op": escape(stuck["op"]),
                 **({"desc": escape(stuck["desc"])} if stuck.get("desc") else {})}
    op = value.get("last_issued_op")
    out = {"rank": rank, "last_issued": last, "last_issued_op": None if op is None else escape(op),
           "last_issued_state": value.get("last_issued_state"),
           "last_completed": value.get("last_completed") or 0, "stuck": stuck}
    for name in ("global_rank", "pid"):
        if _whole(value.get(name)):
            out[name] = value[name]
    if isinstance(value.get("host"), str):
        out["host"] = escape(value["host"], 64)
    if value.get("answered_by") is not None:
        out["answered_by"] = "listener"
    return out


def valid_item(value) -> Optional[dict]:
    """One item of a group's news (a peer's request, or a fault it published), checked;
    None when it is not one (it is then skipped)."""
    if not isinstance(value, dict) or not _whole(value.get("from")):
        return None
    kind = value.get("kind")
    if kind == "ask" and _whole(value.get("seq"), 1):
        return {"kind": kind, "seq": value["seq"], "from": value["from"]}
    if kind == "fault" and isinstance(value.get("message"), str) and value.get("error") in FAULT_KINDS:
        return {"kind": kind, "from": value["from"], "error": value["error"],
                "message": escape(value["message"], _MESSAGE_LIMIT)}
    return None


def _json_lines(blob) -> List[object]:
    """The JSON values of ``blob``'s lines; a line that is not JSON is dropped."""
    text = blob.decode("utf-8", errors="replace") if isinstance(blob, bytes) else str(blob)
    out = []
    for line in text.split("\n"):
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def parse_records(blob, size: int) -> Dict[int, dict]:
    """The group ranks' records appended to one key: per rank, its own record over an
    answer its listener gave; a malformed line is no record."""
    found: Dict[int, dict] = {}
    for value in _json_lines(blob):
        record = valid_record(value, size)
        if record is None:
            continue
        known = found.get(record["rank"])
        if known is None or ("answered_by" in known and "answered_by" not in record):
            found[record["rank"]] = record
    return found


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
    """Sort the group's ranks (``records``: group rank -> record or None) around ``seq``; a
    record that is not one (:func:`valid_record`) counts as no answer."""
    out = Classified()
    for group_rank, name in enumerate(ranks):
        rec = valid_record(records.get(group_rank))
        if not rec:
            out.silent.append(name)
            continue
        stuck = rec.get("stuck") or None
        last = rec["last_issued"]
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
    seq, op = stuck["seq"], escape(stuck["op"])
    c = classify(seq, op, records, ranks)
    desc = escape(stuck.get("desc") or f"{op} #{seq}")
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
        parts.append(f"the store did not answer within {wait_s:g} s ({escape(store_error)}), so no "
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
        store.wait([key], _store_timeout(remaining))
    except Exception as exc:  # noqa: BLE001 - the deadline: read what is there
        if not _is_store_timeout(exc):
            raise


def _store_timeout(seconds: float):
    import datetime

    # never under 1 ms: torch's stores read a timeout that rounds to 0 ms as none at all
    return datetime.timedelta(milliseconds=max(1, int(seconds * 1000)))


def _is_store_timeout(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and "timeout" in str(exc).lower()


def _ring(store, ranks: Sequence[int], but: int) -> None:
    """Ring the bells of ``ranks`` (global ranks) but ``but``: one multi_set."""
    keys = [bell_key(r) for r in ranks if r != but]
    if keys:
        compat.store_set_many(compat.root_store(store), keys, [b"1"] * len(keys))


def _news(store, prefix: str, item: dict, ranks: Sequence[int], me: int) -> None:
    """Append ``item`` to the group's news, then ring the other members' bells."""
    store.append(f"{prefix}/news", json.dumps(item) + "\n")
    _ring(store, ranks, me)


def diagnose(store, group: str, rank: int, size: int, mine: dict, timeout_s: Optional[float] = None,
             wait_s: float = DEFAULT_WAIT_S, ranks: Optional[Sequence[int]] = None,
             incarnation: int = 0, what: str = "timed out", one_gone: bool = False) -> Report:
    """Publish ``mine`` (:func:`progress`, whose ``stuck`` names the collective), ask the
    other ranks, read their records for at most ``wait_s``, and build the report. Returns
    within ``wait_s`` + 0.5 s (the last read) whatever the store and the peers do; never raises.
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
            _news(store, prefix, {"kind": "ask", "seq": seq, "from": ranks[rank]}, ranks, ranks[rank])
        elif count is None or count > 1:  # another rank diagnoses this collective: its verdict
            _wait(waiter, f"{base}/verdict", deadline)
            if store.check([f"{base}/verdict"]):
                verdict = _valid_verdict(store.get(f"{base}/verdict"), size)
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


def _valid_verdict(blob, size: int) -> Optional[dict]:
    """The diagnoser's report of a collective, checked as any peer's text is."""
    values = _json_lines(blob)
    value = values[0] if len(values) == 1 else None
    if not isinstance(value, dict) or not isinstance(value.get("message"), str) \
            or not isinstance(value.get("records"), dict):
        return None
    records = {}
    for key, record in value["records"].items():
        checked = valid_record(record, size)
        if checked is not None and str(checked["rank"]) == key:
            records[checked["rank"]] = checked
    return {"message": escape(value["message"], _MESSAGE_LIMIT), "records": records}


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


def publish_fault(store, recorder: Recorder, error: BaseException, wait_s: float = bounds.PUBLISH_WAIT_S) -> bool:
    """Tell the group's other ranks that ``error`` ended the group here: one item in its
    news, their bells rung. Returns within ``wait_s`` whatever the store does (True once the
    store took it); never raises."""
    if store is None or len(recorder.ranks) < 2:
        return False
    name = type(error).__name__
    item = {"kind": "fault", "from": recorder.ranks[recorder.rank],
            "error": name if name in FAULT_KINDS else "PeerFailedError",
            "message": str(error)[:_MESSAGE_LIMIT]}
    done = threading.Event()

    def publish() -> None:
        try:
            _news(store, key_prefix(recorder.group, recorder.incarnation), item, recorder.ranks,
                  recorder.ranks[recorder.rank])
            done.set()
        except Exception as exc:  # noqa: BLE001 - the peers find it by their own timeout
            logger.debug("publishing the fault of group %r failed: %r", recorder.group, exc)
    thread = threading.Thread(target=publish, name="cupycoll-publish", daemon=True)
    try:
        thread.start()
    except RuntimeError:  # Python 3.12+ at interpreter exit: no new threads
        return False
    thread.join(wait_s)
    return done.is_set()


def forget(store, recorder: Recorder, wait_s: float = FORGET_WAIT_S) -> None:
    """This rank closed the group: count it out of the group's diagnosis keys; the last rank
    out deletes them all (the records, the news, their counters). Returns within ``wait_s``
    whatever the store does; never raises (a store without ``delete_key`` keeps its keys)."""
    size = len(recorder.ranks)
    if store is None or size < 2:
        return
    thread = threading.Thread(target=_count_out, name="cupycoll-diagnosis-forget", daemon=True,
                              args=(store, key_prefix(recorder.group, recorder.incarnation), list(recorder.ranks)))
    try:
        thread.start()
    except RuntimeError:  # Python 3.12+ at interpreter exit: no new threads; the keys stay
        return
    thread.join(wait_s)


def _count_out(store, prefix: str, ranks: List[int]) -> None:
    try:
        if store.add(f"{prefix}/closed", 1) < len(ranks):
            return
        keys = [f"{prefix}/closed"]
        news_key = f"{prefix}/news"
        if store.check([news_key]):
            keys.append(news_key)
            seqs = {item["seq"] for item in map(valid_item, _json_lines(store.get(news_key)))
                    if item is not None and item["kind"] == "ask"}
            for seq in seqs:
                keys += [f"{prefix}/{seq}/{name}" for name in ("records", "count", "all", "most", "verdict")]
            # the group rang its members' bells: a bell its listener has not taken stays rung
            root = compat.root_store(store)
            for rank in ranks:
                root.delete_key(bell_key(rank))
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


# -- the listener -------------------------------------------------------------------------

class _Served:
    """One group a listener serves: the news it has read, the collectives it answered for."""

    def __init__(self, store, recorder: Recorder, dump_dir: Optional[str],
                 on_fault: Optional[Callable[[str, str, int], None]]):
        self.store, self.recorder, self.dump_dir = store, recorder, dump_dir
        self.on_fault = on_fault
        self.prefix = key_prefix(recorder.group, recorder.incarnation)
        self.read = 0  # bytes of the news read
        self.answered: collections.deque = collections.deque(maxlen=64)

    def poll(self) -> None:
        """Read the group's news since the last look (one ``check``, then one ``get`` when
        there is any) and act on each item; a malformed one is skipped."""
        store = self.store
        news_key = f"{self.prefix}/news"
        # check first: get() would wait for a key a group that never had news never gets
        if not store.check([news_key]):
            return
        news = store.get(news_key)
        end = news.rfind(b"\n") + 1 if isinstance(news, bytes) else 0  # whole lines only
        fresh, self.read = news[self.read:end], max(self.read, end)
        me = self.recorder.ranks[self.recorder.rank]
        for value in _json_lines(fresh):
            item = valid_item(value)
            if item is None:
                logger.debug("group %r: a malformed news item was skipped: %s",
                             self.recorder.group, escape(value))
            elif item["from"] == me:
                continue
            elif item["kind"] == "ask" and item["seq"] not in self.answered:
                self.answered.append(item["seq"])
                self.answer(item["seq"])
            elif item["kind"] == "fault" and self.on_fault is not None:
                self.on_fault(item["error"], item["message"], item["from"])

    def answer(self, seq: int) -> None:
        recorder = self.recorder
        rank = recorder.rank
        base = f"{self.prefix}/{seq}"
        key = (self.store, f"{base}/{rank}")
        # This rank publishes its own record when it timed out at ``seq`` too (the request may
        # be its own): that one names the collective it is stuck in, and a reader takes it
        # over this answer, which may find it already failed and say it "completed #seq".
        if not _first(key, own=False):
            return
        # A rank that failed in #seq itself (its own record may not be there yet) was in it.
        entry = recorder.find(seq)
        held = entry if entry is not None and entry[E_STATE] in ("issued", "failed") else None
        self.store.append(f"{base}/records",
                          json.dumps({**progress(recorder, held), "answered_by": "listener"}) + "\n")
        _count_in(self.store, base, len(recorder.ranks))
        dump_on_timeout(self.dump_dir, recorder.ranks[rank], f"a peer's timeout in group {recorder.group!r} at #{seq}")


class _Listener:
    """One rank's listener: a thread waiting on the rank's bell, serving every group of that
    rank on one root store."""

    def __init__(self, root, global_rank: int, interval: float, on_end: Callable[["_Listener"], None]):
        self.root, self.global_rank = root, global_rank
        self.bell = bell_key(global_rank)
        self.interval = interval
        self.served: Dict[int, _Served] = {}
        self.lock = threading.Lock()
        self.stopping = False
        self.waits = False  # waiting on a clone, served by the store (else looking every interval)
        self._on_end = on_end
        self._wake = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"cupycoll-listener-{global_rank}", daemon=True)

    def ring(self) -> None:
        """Wake the thread now (from this process: its own bell, through the main connection)."""
        self._wake.set()
        if self.waits:
            self.root.set(self.bell, b"1")

    def _run(self) -> None:
        waiter = None
        try:
            waiter = compat.clone_store(self.root)
        except Exception as exc:  # noqa: BLE001 - no clone: look every interval instead
            logger.debug("the store could not be cloned (%r): looking every %g s", exc, self.interval)
        self.waits = waiter is not None
        try:
            while True:
                with self.lock:
                    served = list(self.served.values())
                    if self.stopping or (not served and not self.waits):
                        return
                if waiter is not None:
                    try:
                        waiter.wait([self.bell], _store_timeout(_BELL_WAIT_S))
                    except Exception as exc:  # noqa: BLE001 - ran out: wait again
                        if not _is_store_timeout(exc):
                            raise
                        continue
                    waiter.delete_key(self.bell)  # first: a ring from now on is seen next time
                else:
                    self._wake.wait(self.interval)
                    self._wake.clear()
                    with self.lock:
                        if self.stopping:
                            return
                    if not self.root.check([self.bell]):
                        continue
                    self.root.delete_key(self.bell)
                self._poll()
        except Exception as exc:  # noqa: BLE001 - a dead store: stop listening
            with self.lock:
                served, self.served = list(self.served.values()), {}
            for item in served:
                logger.warning("group %r: the store failed (%s); no longer answering diagnosis requests "
                               "for it", item.recorder.group, exc)
        finally:
            self._on_end(self)

    def _poll(self) -> None:
        with self.lock:  # the groups served now: one may have come while it waited
            if self.stopping:
                return
            served = list(self.served.values())
        for item in served:
            try:
                item.poll()
            except Exception as exc:  # noqa: BLE001 - that group's store failed: stop serving it
                logger.warning("group %r: the store failed (%s); no longer answering diagnosis requests "
                               "for it", item.recorder.group, exc)
                with self.lock:
                    self.served.pop(id(item.recorder), None)


class Responder:
    """The process's listeners (one per rank and root store; in a real job, one), which
    answer peers' diagnosis requests and hand their published faults on, for every served
    group."""

    def __init__(self):
        self._listeners: Dict[tuple, _Listener] = {}
        self._lock = threading.Lock()

    def serve(self, store, recorder: Recorder, dump_dir: Optional[str] = None,
              interval: float = RESPONDER_INTERVAL_S,
              on_fault: Optional[Callable[[str, str, int], None]] = None) -> None:
        """Answer for ``recorder``'s rank in its group on ``store`` (``interval``: how often
        to look where the store cannot wait for us); ``on_fault(error, message, from_rank)``:
        a peer published the group's fault."""
        root = compat.root_store(store)
        key = (id(root), recorder.ranks[recorder.rank])
        with self._lock:
            listener = self._listeners.get(key)
            if listener is None or listener.stopping or not listener.thread.is_alive() and listener.thread.ident:
                listener = self._listeners[key] = _Listener(root, key[1], interval, self._ended)
                start = True
            else:
                start = False
            with listener.lock:
                listener.served[id(recorder)] = _Served(store, recorder, dump_dir, on_fault)
                listener.interval = min(listener.interval, interval)
        if start:
            listener.thread.start()

    def unserve(self, recorder: Recorder, wait_s: float = FORGET_WAIT_S) -> None:
        """Stop answering for ``recorder``'s group; a listener left with no group ends (rung
        awake, waited for at most ``wait_s``), taking its bell with it."""
        with self._lock:
            listeners = list(self._listeners.values())
        for listener in listeners:
            with listener.lock:
                if listener.served.pop(id(recorder), None) is None:
                    continue
                last = not listener.served
                if last:
                    listener.stopping = True
            if last:
                _end_listeners([listener], wait_s)

    def _ended(self, listener: _Listener) -> None:
        with self._lock:
            for key, known in list(self._listeners.items()):
                if known is listener:
                    del self._listeners[key]

    @property
    def running(self) -> bool:
        with self._lock:
            return any(listener.thread.is_alive() for listener in self._listeners.values())

    def stop(self, wait_s: float = 2.0) -> None:
        """Stop listening and let the threads leave (at exit: a daemon thread still inside a
        store call when the interpreter finalizes can abort the process, "terminate called
        without an active exception"): each is rung awake, then joined."""
        with self._lock:
            listeners = list(self._listeners.values())
        for listener in listeners:
            with listener.lock:
                listener.stopping = True
                listener.served = {}
        _end_listeners(listeners, wait_s)


def _end_listeners(listeners: List[_Listener], wait_s: float) -> None:
    """Ring each of ``listeners`` (set to stop) awake and wait for its thread, at most
    ``wait_s`` in all (a ring may block on a dead store: it runs on a thread of its own)."""
    deadline = time.monotonic() + wait_s
    for listener in listeners:
        ringer = threading.Thread(target=_quietly, args=(listener.ring,), daemon=True)
        try:
            ringer.start()
        except RuntimeError:  # Python 3.12+ at interpreter exit: no new threads
            _quietly(listener.ring)
            continue
        ringer.join(max(0.0, deadline - time.monotonic()))
    for listener in listeners:
        thread = listener.thread
        if thread is not threading.current_thread() and thread.ident is not None:
            thread.join(max(0.0, deadline - time.monotonic()))


def _quietly(call: Callable[[], None]) -> None:
    try:
        call()
    except Exception:  # noqa: BLE001 - a dead store at exit: nothing to wake
        pass


RESPONDER = Responder()
serve = RESPONDER.serve
unserve = RESPONDER.unserve


def _after_fork_in_child() -> None:
    # The parent's listener threads are not in the child, and a thread of the parent may
    # have held their locks or the recorders' when it forked; the parent's groups are not
    # the child's to answer for. Start afresh (serve() starts a thread again).
    global _records_lock
    RESPONDER.__init__()
    _recorder._lock = threading.Lock()
    _records_lock = threading.Lock()
    _own_records.clear()
    _counted.clear()


hooks.in_forked_child("diagnosis", _after_fork_in_child)
hooks.at_exit("diagnosis", RESPONDER.stop)
