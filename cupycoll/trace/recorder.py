"""The flight recorder: what every cupycoll group of this process was asked to do, and when.

Each group owns a :class:`Recorder` (made by :func:`new_recorder`, kept in a per-process
registry) holding a bounded ring buffer of its last calls, CUDA and CPU routes alike. An
entry is one call: its per-group sequence number, op, shapes, dtypes, root (or peer), route
(``nccl``, ``ring`` or ``gloo``), state (``queued``, ``issued``, ``completed``, ``failed``,
``aborted``) and the monotonic times it was recorded, issued and finished.

Collectives and point-to-point calls are numbered apart (as torch's own recorder does):
every rank makes the same collectives in the same order, so collective ``#42`` names the
same call on every rank, whereas a rank's sends and receives differ from its peers'.

The hot path is :meth:`Recorder.record` (a counter, a clock read, a list literal, a deque
append) and :meth:`Recorder.mark`; everything else (shapes made lists, dtypes made text,
monotonic times made wall-clock times) happens when a snapshot is taken. Entries are plain
lists indexed by the ``E_*`` constants, not objects: a list literal costs a fifth of a
Python ``__init__``. ``python -m cupycoll.trace --bench`` prints what a call costs.

A buffer of size 0 keeps no entries but still counts: the last issued and completed sequence
numbers, which the timeout diagnosis publishes (:func:`cupycoll.trace.records.progress`), work
either way.

Deliberately left out: writing and reading dumps (:mod:`cupycoll.trace.dumps` writes every
recorder of the process as one JSON document), tensor contents, stack traces (they cost far
more than the 1 µs a call may spend here), and any configuration parsing (``cupycoll.config``
resolves the size).
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from typing import Dict, List, Optional, Sequence

from ..config import DEFAULT_TRACE_BUFFER
from ..errors import CupycollTypeError, CupycollValueError

STATES = ("queued", "issued", "completed", "failed", "aborted")
UNFINISHED = ("queued", "issued")
RETIRED_KEPT = 16  # recorders of destroyed groups kept for dumps (init/abort cycles add up)

# An entry's fields, in order.
(E_SEQ, E_P2P, E_OP, E_SHAPES, E_DTYPES, E_ROOT, E_ROUTE, E_STATE,
 E_RECORDED, E_ISSUED, E_DONE) = range(11)

_monotonic = time.monotonic


class Recorder:
    """One group's flight recorder.

    Attributes:
        group: the group's name; ranks: its members' global ranks, by group rank;
        rank: this process's rank in the group; incarnation: how many groups of that name
        this process made before this one (a re-created group starts again at #1);
        last_issued / last_completed: the highest collective sequence numbers issued and
        completed (0: none yet); last_issued_entry: the entry of ``last_issued``.
    """

    __slots__ = ("group", "ranks", "rank", "size", "incarnation", "entries", "_next_seq",
                 "_next_p2p", "last_issued", "last_issued_entry", "last_completed", "__weakref__")

    def __init__(self, group: str, ranks: Sequence[int], rank: int, size: int = DEFAULT_TRACE_BUFFER,
                 incarnation: int = 0):
        if not isinstance(group, str):
            raise CupycollTypeError(f"group={group!r}: expected the group's name (a str)")
        if isinstance(size, bool) or not isinstance(size, int):
            raise CupycollTypeError(f"size={size!r}: expected a whole number of entries")
        if size < 0:
            raise CupycollValueError(f"size={size!r}: expected 0 (off) or a positive number")
        ranks = [int(r) for r in ranks]
        if not 0 <= rank < len(ranks):
            raise CupycollValueError(f"rank={rank!r}: not a rank of a group of {len(ranks)}")
        self.group, self.ranks, self.rank, self.size = group, ranks, int(rank), size
        self.incarnation = incarnation
        # deque(maxlen=0) drops every append: size 0 needs no test on the hot path.
        self.entries: collections.deque = collections.deque(maxlen=size)
        # itertools.count's __next__ is atomic under the GIL: threads (DDP's autograd hooks)
        # calling one group at once still get distinct numbers, without a lock.
        self._next_seq = itertools.count(1).__next__
        self._next_p2p = itertools.count(1).__next__
        self.last_issued = 0
        self.last_issued_entry: Optional[list] = None
        self.last_completed = 0

    @property
    def enabled(self) -> bool:
        return self.size > 0

    # -- the hot path ---------------------------------------------------------------
    def record(self, op: str, shapes: Sequence = (), dtypes: Sequence = (), root=None,
               route: str = "nccl", state: str = "issued") -> list:
        """Record one collective; returns its entry (``entry[E_SEQ]`` is its number).

        ``shapes`` and ``dtypes`` are per tensor (``(t.shape,)``, ``(t.dtype,)``), stored
        as given (a ``torch.Size`` is immutable) and converted only in snapshots. Record the
        tensors every rank passes alike (the input of all_gather, the output of scatter).
        ``state`` is ``"issued"`` for a call made now, ``"queued"`` for one held back
        (coalescing, batched P2P): :meth:`mark` it issued later."""
        seq = self._next_seq()
        now = _monotonic()
        if state == "issued":
            entry = [seq, False, op, shapes, dtypes, root, route, state, now, now, None]
            self.last_issued = seq
            self.last_issued_entry = entry
        elif state == "queued":
            entry = [seq, False, op, shapes, dtypes, root, route, state, now, None, None]
        else:
            raise CupycollValueError(f"state={state!r}: a call is recorded queued or issued")
        self.entries.append(entry)
        return entry

    def record_p2p(self, op: str, shapes: Sequence = (), dtypes: Sequence = (), peer=None,
                   route: str = "nccl", state: str = "queued") -> list:
        """Record a send or recv (``peer``: the other group rank), numbered apart."""
        now = _monotonic()
        if state not in UNFINISHED:
            raise CupycollValueError(f"state={state!r}: a call is recorded queued or issued")
        entry = [self._next_p2p(), True, op, shapes, dtypes, peer, route, state, now,
                 now if state == "issued" else None, None]
        self.entries.append(entry)
        return entry

    def mark(self, entry: Optional[list], state: str) -> None:
        """Move ``entry`` to ``state``; None (no entry) is ignored."""
        if entry is None:
            return
        now = _monotonic()
        if state == "completed":
            entry[E_STATE] = state
            entry[E_DONE] = now
            if not entry[E_P2P] and entry[E_SEQ] > self.last_completed:
                self.last_completed = entry[E_SEQ]
        elif state == "issued":
            entry[E_STATE] = state
            entry[E_ISSUED] = now
            if not entry[E_P2P] and entry[E_SEQ] > self.last_issued:
                self.last_issued = entry[E_SEQ]
                self.last_issued_entry = entry
        elif state == "failed" or state == "aborted":
            if entry[E_STATE] in UNFINISHED:  # a late abort does not undo a completion
                entry[E_STATE] = state
                entry[E_DONE] = now
        else:
            raise CupycollValueError(f"state={state!r}: expected one of {', '.join(STATES)}")

    def mark_all(self, entries, state: str) -> None:
        """:meth:`mark` ``entries``: one entry (a list), a tuple of them (the parts of one
        coalesced call, marked issued in one pass) or None."""
        if entries is None:
            return
        if type(entries) is list:
            self.mark(entries, state)
            return
        if state != "issued":
            for entry in entries:
                self.mark(entry, state)
            return
        now, last = _monotonic(), None
        for entry in entries:
            entry[E_STATE] = state
            entry[E_ISSUED] = now
            if not entry[E_P2P]:
                last = entry
        if last is not None and last[E_SEQ] > self.last_issued:
            self.last_issued = last[E_SEQ]
            self.last_issued_entry = last

    @staticmethod
    def describe_batch(found) -> str:
        """What a timeout message names a batch by (``found``: its entries, a sequence): its
        first call, and how many more it had."""
        if not found:
            return "a collective"
        text = describe_entry(found[0])
        return text if len(found) == 1 else f"{text} (and {len(found) - 1} more calls of its batch)"

    def record_parts(self, op: str, tensors: Sequence, route: str = "nccl") -> tuple:
        """Record each of ``tensors`` as one ``op`` of its own, queued (the parts of one
        coalesced call, numbered one by one as each would be alone, so that the ranks'
        records still match call for call), in one pass; their entries, as a tuple."""
        now, next_seq, append, made = _monotonic(), self._next_seq, self.entries.append, []
        for t in tensors:
            entry = [next_seq(), False, op, (t.shape,), (t.dtype,), None, route, "queued", now, None, None]
            append(entry)
            made.append(entry)
        return tuple(made)

    # -- off the hot path -----------------------------------------------------------
    def mark_unfinished(self, state: str = "aborted") -> int:
        """Mark every entry still queued or issued (a group abort); returns how many."""
        count = 0
        for entry in list(self.entries):
            if entry[E_STATE] in UNFINISHED:
                self.mark(entry, state)
                count += 1
        return count

    def find(self, seq: int) -> Optional[list]:
        """The collective entry numbered ``seq``, if still in the buffer."""
        for entry in reversed(list(self.entries)):
            if entry[E_SEQ] == seq and not entry[E_P2P]:
                return entry
        return None

    def stuck(self) -> Optional[list]:
        """The oldest collective issued but not finished (what this rank waits in)."""
        for entry in list(self.entries):
            if not entry[E_P2P] and entry[E_STATE] == "issued":
                return entry
        last = self.last_issued_entry  # with the buffer off, the last one is all we know
        if last is not None and last[E_STATE] == "issued":
            return last
        return None

    def snapshot(self) -> List[dict]:
        """The buffer, oldest first, as JSON-ready dicts (times: Unix seconds)."""
        # list(deque) runs in C without releasing the GIL: a consistent copy even while
        # another thread appends (iterating the deque itself could raise).
        offset = time.time() - _monotonic()
        return [entry_dict(entry, offset) for entry in list(self.entries)]

    def info(self) -> dict:
        return {"group": self.group, "ranks": list(self.ranks), "rank": self.rank,
                "global_rank": self.ranks[self.rank], "incarnation": self.incarnation,
                "buffer": self.size, "last_issued": self.last_issued,
                "last_completed": self.last_completed}

    def __repr__(self) -> str:
        return (f"Recorder(group={self.group!r}, rank={self.rank}, size={self.size}, "
                f"last_issued={self.last_issued}, last_completed={self.last_completed})")


def entry_dict(entry: list, offset: Optional[float] = None) -> dict:
    """One entry as a dict; ``offset`` turns monotonic times into Unix times."""
    if offset is None:
        offset = time.time() - _monotonic()
    seq, p2p, op, shapes, dtypes, root, route, state, recorded, issued, done = list(entry)

    def wall(t):
        return None if t is None else round(t + offset, 6)

    return {"seq": seq, "p2p": p2p, "op": op, "shapes": [shape_list(s) for s in shapes],
            "dtypes": [dtype_name(d) for d in dtypes], "root": None if p2p else root,
            "peer": root if p2p else None, "route": route, "state": state,
            "recorded_at": wall(recorded), "issued_at": wall(issued), "finished_at": wall(done)}


def shape_list(shape) -> list:
    return [int(n) for n in shape]


def dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def describe(op: str, seq: int, shapes: Sequence = (), dtypes: Sequence = ()) -> str:
    """``all_reduce #42 (float32[1048576])``: a collective as messages name it."""
    parts = [f"{dtype_name(d)}[{', '.join(str(int(n)) for n in s)}]"
             for s, d in zip(list(shapes)[:3], list(dtypes)[:3])]
    if len(shapes) > 3:
        parts.append(f"... {len(shapes)} tensors")
    return f"{op} #{seq} ({', '.join(parts)})" if parts else f"{op} #{seq}"


def describe_entry(entry) -> str:
    """:func:`describe` of an entry list or an entry dict."""
    if isinstance(entry, dict):
        return describe(entry["op"], entry["seq"], entry.get("shapes", ()), entry.get("dtypes", ()))
    return describe(entry[E_OP], entry[E_SEQ], entry[E_SHAPES], entry[E_DTYPES])


# -- the per-process registry -------------------------------------------------------------

_lock = threading.Lock()
_live: Dict[str, Recorder] = {}
_retired: collections.deque = collections.deque(maxlen=RETIRED_KEPT)
_incarnations: Dict[str, int] = {}


def new_recorder(group: str, ranks: Sequence[int], rank: int,
                 size: int = DEFAULT_TRACE_BUFFER) -> Recorder:
    """Make and register the recorder of a group being built. A group of the same name made
    before (destroyed, or re-created after a fault) is retired: still dumped, up to
    RETIRED_KEPT of them."""
    with _lock:
        incarnation = _incarnations.get(group, 0)
        recorder = Recorder(group, ranks, rank, size, incarnation)
        _incarnations[group] = incarnation + 1
        old = _live.pop(group, None)
        if old is not None:
            _retired.append(old)
        _live[group] = recorder
        return recorder


def retire(recorder: Recorder) -> None:
    """The group is gone (destroyed): keep its recorder for dumps, among the retired."""
    with _lock:
        if _live.get(recorder.group) is recorder:
            del _live[recorder.group]
            _retired.append(recorder)


def get_recorder(group: str) -> Optional[Recorder]:
    return _live.get(group)


def recorders() -> List[Recorder]:
    """Every recorder of the process: the retired ones (oldest first), then the live ones."""
    with _lock:
        return list(_retired) + list(_live.values())


def reset() -> None:
    """Forget every recorder (for tests)."""
    with _lock:
        _live.clear()
        _retired.clear()
        _incarnations.clear()
