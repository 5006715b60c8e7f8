"""The opt-in collective mismatch check: do all ranks make the same call?

With ``Options(check_collectives=True)`` (``CUPYCOLL_CHECK_COLLECTIVES=1``) a group compares,
before each collective, what every rank passes: the sequence number, op, shapes, dtypes, root
and reduce op (:func:`signature`). :func:`check` exchanges them over the group's CPU (gloo)
group in two steps: every call, an all_gather of one 64-bit digest per rank (one small gloo
round trip); only when the digests differ, an all_gather of the signatures themselves, so
that every rank raises the same :class:`~cupycoll.CupycollValueError`, naming the rank and
the field (:func:`compare`), instead of hanging or reducing mismatched data.

Shapes are not compared for all-to-all, whose split sizes may differ by design; the caller
records the tensors every rank passes alike (the input of all_gather, the output of
scatter). :func:`compare` is also what ``python -m cupycoll.trace`` uses on dumps.

Deliberately left out: a rank that never makes the call at all. The check's own all_gather
then waits like the collective would, until gloo's timeout, and the timeout diagnosis
(:mod:`cupycoll.trace.diagnosis`) names the missing rank. Also left out: point-to-point calls,
which pair ranks rather than make all of them agree.
"""

from __future__ import annotations

import collections
import hashlib
import json
from typing import Dict, List, Optional, Sequence

from .diagnosis import ranks_text  # one rank-list format for every message
from ..errors import CupycollValueError

# Ops whose per-rank shapes may differ legitimately (uneven all-to-all splits).
SHAPES_MAY_DIFFER = frozenset({"all_to_all", "all_to_all_single", "alltoall", "alltoall_base"})
# The fields in the order a mismatch is reported: the first that differs is the cause (a
# skipped collective shifts every later number; another op makes shapes moot).
FIELDS = ("seq", "op", "root", "reduce_op", "dtypes", "shapes")


def signature(seq: int, op: str, shapes: Sequence = (), dtypes: Sequence = (), root=None,
              reduce_op=None) -> dict:
    """What every rank must agree on for collective ``seq``, as JSON-ready values."""
    return {"seq": int(seq), "op": str(op),
            "shapes": None if op in SHAPES_MAY_DIFFER else [[int(n) for n in s] for s in shapes],
            "dtypes": [str(d).replace("torch.", "") for d in dtypes],
            "root": None if root is None else int(root),
            "reduce_op": None if reduce_op is None else _reduce_name(reduce_op)}


def _reduce_name(reduce_op) -> str:
    # dist.ReduceOp.SUM prints "ReduceOp.SUM" on some torch versions, "RedOpType.SUM" on
    # others; the member name alone reads the same everywhere.
    op = getattr(reduce_op, "op", reduce_op)  # an options' ReduceOp wraps its RedOpType
    return str(getattr(op, "name", op)).rsplit(".", 1)[-1]


def digest(sig: dict) -> int:
    """A 63-bit digest of a signature, stable across processes (not Python's salted hash)."""
    text = json.dumps(sig, sort_keys=True, separators=(",", ":")).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def _value_text(field: str, value) -> str:
    if field == "shapes":
        shapes = [tuple(s) for s in value]
        return str(shapes[0]) if len(shapes) == 1 else str(shapes)
    if field == "dtypes":
        return value[0] if len(value) == 1 else "[" + ", ".join(value) + "]"
    if field == "seq":
        return f"#{value}"
    return "none" if value is None else str(value)


def _what(field: str, value, plural: bool = False) -> str:
    # "passed shape (4, 3)" / "passed shapes [(4, 3), (2,)]" / "called broadcast"
    if field == "op":
        return "called"
    if field == "seq":
        return "are at" if plural else "is at"
    noun = {"reduce_op": "reduce op", "root": "root", "dtypes": "dtype", "shapes": "shape"}[field]
    if field in ("dtypes", "shapes") and value is not None and len(value) != 1:
        noun += "s"
    return f"passed {noun}"


def compare(signatures: Dict[int, dict], ranks: Optional[Sequence[int]] = None) -> Optional[str]:
    """The mismatch among ``signatures`` (group rank -> :func:`signature`), or None.

    ``ranks`` maps group ranks to the global ranks the message names (default: the same).
    The message names the first differing field (:data:`FIELDS`), the odd ranks first and
    what the most ranks passed last: ``all_reduce #7: rank 1 passed shape (4, 3), ranks 0,2
    passed (4, 4)``."""
    if len(signatures) < 2:
        return None
    name = (lambda r: r) if ranks is None else (lambda r: ranks[r])
    for field in FIELDS:
        values = {rank: sig.get(field) for rank, sig in signatures.items()}
        if field == "shapes" and any(v is None for v in values.values()):
            continue  # an all-to-all somewhere: shapes are not comparable
        groups: "collections.OrderedDict[str, List[int]]" = collections.OrderedDict()
        originals = {}
        for rank in sorted(values):
            key = json.dumps(values[rank], sort_keys=True)
            groups.setdefault(key, []).append(name(rank))
            originals[key] = values[rank]
        if len(groups) < 2:
            continue
        # The most common value is "normal" (on a tie, the lowest rank's); the rest are odd.
        ordered = sorted(groups, key=lambda k: (-len(groups[k]), groups[k][0]))
        common, odd = ordered[0], ordered[1:]
        odd.sort(key=lambda k: groups[k][0])
        parts = [f"{ranks_text(groups[k])} {_what(field, originals[k], len(groups[k]) > 1)} "
                 f"{_value_text(field, originals[k])}" for k in odd]
        verb = _what(field, None, len(groups[common]) > 1) if field in ("op", "seq") else "passed"
        parts.append(f"{ranks_text(groups[common])} {verb} {_value_text(field, originals[common])}")
        first = signatures[min(signatures)]
        if field == "seq":
            head = f"{first.get('op')}: ranks disagree on the collective's number " \
                   "(a rank skipped or added a collective on this group)"
        elif field == "op":
            head = f"collective #{first.get('seq')}"
        else:
            common_sig = signatures[min(r for r in signatures
                                        if json.dumps(signatures[r].get(field), sort_keys=True) == common)]
            head = f"{common_sig.get('op')} #{common_sig.get('seq')}"
        return f"{head}: " + ", ".join(parts)
    return None


def check(cpu_group, sig: dict, rank: int, size: int, group_name: str = "",
          ranks: Optional[Sequence[int]] = None) -> None:
    """Compare ``sig`` with every other rank's over ``cpu_group`` (a gloo ProcessGroup: the
    group's inner CPU group, called directly, so it need not be registered with torch).
    Raises :class:`CupycollValueError` on every rank when they differ. Collective: every
    rank of the group must call it, before the collective it checks."""
    import torch

    mine = digest(sig)
    gathered = _all_gather(cpu_group, torch.tensor([mine], dtype=torch.int64), size)
    if all(int(t[0]) == mine for t in gathered):
        return
    # Digests differ: every rank sees it and takes this path, so the exchange lines up.
    signatures = {r: json.loads(text) for r, text in enumerate(_all_gather_text(cpu_group, sig, size))}
    message = compare(signatures, ranks)
    if message is None:  # pragma: no cover - distinct digests of equal signatures
        message = f"collective #{sig['seq']}: ranks' signatures differ ({signatures})"
    where = f"process group {group_name!r}: " if group_name else ""
    raise CupycollValueError(f"{where}collective mismatch, {message}")


def _all_gather(cpu_group, tensor, size: int) -> list:
    import torch

    outputs = [torch.empty_like(tensor) for _ in range(size)]
    cpu_group.allgather([outputs], [tensor]).wait()
    return outputs


def _all_gather_text(cpu_group, sig: dict, size: int) -> List[str]:
    """Every rank's signature as JSON text: lengths first, then padded bytes."""
    import torch

    data = json.dumps(sig, sort_keys=True).encode()
    lengths = _all_gather(cpu_group, torch.tensor([len(data)], dtype=torch.int64), size)
    longest = max(int(t[0]) for t in lengths)
    buffer = torch.zeros(longest, dtype=torch.uint8)
    buffer[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    texts = _all_gather(cpu_group, buffer, size)
    return [bytes(t[:int(n[0])].tolist()).decode() for t, n in zip(texts, lengths)]
