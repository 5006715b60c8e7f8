"""A timeout diagnosis in words: which rank is behind, and where it is.

The ranks' records (:mod:`cupycoll.trace.records`), gathered by the store exchange
(:mod:`cupycoll.trace.exchange`), are sorted around the collective that timed out
(:func:`classify`: in it, in it as another op, behind it, still in an older one, past it,
silent), and :func:`build_message`, a pure function, says who is where::

    all_reduce #42 (float32[1048576]) timed out after 30 s on ranks 0,1,3; rank 2 is
    behind: its last collective was #41 (broadcast) — it never reached #42

Ranks are named by their global rank, a list of them as :func:`ranks_text` writes it (the
one format every message of cupycoll's uses). A record that is not one counts as a rank
that did not answer, and text from a peer is escaped before it reaches the message.

Deliberately left out: asking the ranks (:mod:`cupycoll.trace.exchange`) and deciding what
happens next (the caller raises, aborts, terminates).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence

from .. import bounds
from .records import escape, valid_record

_STATE_TEXT = {"completed": "", "issued": "not completed", "queued": "not yet issued",
               "failed": "failed", "aborted": "aborted"}


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
                  ranks: Sequence[int], wait_s: float = bounds.DIAGNOSIS_WAIT_S,
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
