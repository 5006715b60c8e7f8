"""What a rank publishes to the timeout diagnosis, and what a peer wrote, checked.

:func:`progress` is this rank's record of a collective that timed out here (or that a peer
asked about): its last issued and last completed collective, the one it is stuck in, its
host and process. Everything else here reads what the store hands back.

**The store is input, not trust.** Any client of torch's TCPStore may write the
diagnosis's keys, and peers may run another cupycoll: every record (:func:`valid_record`),
every item of a group's news (:func:`valid_item`) and the diagnoser's verdict
(:func:`valid_verdict`) is checked field by field, and a copy of what matters returned; a
malformed record counts as a rank that did not answer, a malformed item is skipped, and
text from a peer (op names, messages) is escaped before it reaches a message or a log
(:func:`escape`).

Deliberately left out: the store calls themselves (:mod:`cupycoll.trace.exchange`,
:mod:`cupycoll.trace.news`) and the words a diagnosis ends in (:mod:`cupycoll.trace.diagnosis`).
"""

from __future__ import annotations

import json
import os
import socket
from typing import Dict, List, Optional

from .recorder import E_DTYPES, E_OP, E_SEQ, E_SHAPES, E_STATE, STATES, Recorder, describe

# The errors a published fault may name; anything else reads as a peer's failure.
FAULT_KINDS = ("CollectiveTimeoutError", "PeerFailedError", "NcclError", "CommunicatorAbortedError")
# Longest text from a peer that reaches a message (an op name, a described collective).
_TEXT_LIMIT = 200
# Longest published fault message, and longest verdict message, kept.
MESSAGE_LIMIT = 4000


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
                "message": escape(value["message"], MESSAGE_LIMIT)}
    return None


def json_lines(blob) -> List[object]:
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
    for value in json_lines(blob):
        record = valid_record(value, size)
        if record is None:
            continue
        known = found.get(record["rank"])
        if known is None or ("answered_by" in known and "answered_by" not in record):
            found[record["rank"]] = record
    return found


def valid_verdict(blob, size: int) -> Optional[dict]:
    """The diagnoser's report of a collective, checked as any peer's text is."""
    values = json_lines(blob)
    value = values[0] if len(values) == 1 else None
    if not isinstance(value, dict) or not isinstance(value.get("message"), str) \
            or not isinstance(value.get("records"), dict):
        return None
    records = {}
    for key, record in value["records"].items():
        checked = valid_record(record, size)
        if checked is not None and str(checked["rank"]) == key:
            records[checked["rank"]] = checked
    return {"message": escape(value["message"], MESSAGE_LIMIT), "records": records}
