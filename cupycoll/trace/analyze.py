"""``python -m cupycoll.trace DIR``: where do the ranks' flight recorders disagree?

Reads the per-rank dumps in DIR (``cupycoll_trace_rank<R>.json``, written on timeout into
``CUPYCOLL_TRACE_DIR`` or by ``cupycoll.dump_trace``), lines each group's collectives up by
sequence number across ranks, and prints, per group, the first collective the ranks disagree
on: a rank that never reached it, or a different op, root, dtype or shape (compared as
:func:`cupycoll.trace.mismatch.compare` compares a live call). Like torch's ``fr_trace``.

A rank that made no collective at all on a group (stuck in data loading or setup before the
group's first one) disagrees with ranks that made some: it "never reached" #1.
``--last N`` also prints each rank's last N entries of each group.

Exit status: 0 when every group's ranks agree, 1 when a disagreement (or a member's missing
dump) is found, 2 when DIR is missing, empty, or holds a file that is not a readable dump.

``python -m cupycoll.trace --bench`` prints what recording one call costs (the recorder's
per-call budget is 1 µs); :func:`bench` returns the figures for the benchmark suite.

Only the oldest sequence number every rank still holds onward is compared: the ring buffer
drops a rank's oldest entries, and what one rank dropped cannot be compared.

Deliberately left out: matching sends with receives (point-to-point entries are counted,
not paired), and timing analysis (the dumps' timestamps are shown, not interpreted).
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import timeit
from typing import Dict, List, Optional, Sequence, Tuple

from .diagnosis import ranks_text
from .dumps import load_dump
from ..errors import CupycollValueError
from .mismatch import compare, signature
from .recorder import Recorder, describe_entry

EXIT_AGREE, EXIT_DISAGREE, EXIT_ERROR = 0, 1, 2


def load_dir(directory: str) -> List[dict]:
    """Every dump in ``directory``, by rank; CupycollValueError naming what is wrong."""
    if not os.path.isdir(directory):
        raise CupycollValueError(f"{directory}: no such folder")
    paths = sorted(glob.glob(os.path.join(directory, "*.json")))
    if not paths:
        raise CupycollValueError(f"{directory}: no trace files (*.json) in it")
    dumps, seen = [], {}
    for path in paths:
        payload = load_dump(path)
        if payload["rank"] in seen:
            raise CupycollValueError(f"{path}: a second trace of rank {payload['rank']} "
                                     f"(the first: {seen[payload['rank']]})")
        seen[payload["rank"]] = path
        payload["_path"] = path
        dumps.append(payload)
    return sorted(dumps, key=lambda d: d["rank"])


def _groups(dumps: Sequence[dict]) -> Dict[Tuple[str, int], Dict[int, dict]]:
    """(group name, incarnation) -> {global rank: that rank's group record}."""
    groups: Dict[Tuple[str, int], Dict[int, dict]] = {}
    for dump in dumps:
        for group in dump["groups"]:
            key = (group["group"], int(group.get("incarnation", 0)))
            global_rank = group["ranks"][group["rank"]]
            groups.setdefault(key, {})[global_rank] = group
    return groups


def _label(key: Tuple[str, int]) -> str:
    name, incarnation = key
    return f"group {name!r}" + (f" (incarnation {incarnation})" if incarnation else "")


def _sig(entry: dict) -> dict:
    return signature(entry["seq"], entry["op"], entry.get("shapes", ()), entry.get("dtypes", ()),
                     entry.get("root"))


def _states(entries: Dict[int, dict]) -> str:
    by_state: Dict[str, List[int]] = {}
    for rank, entry in entries.items():
        by_state.setdefault(entry["state"], []).append(rank)
    return "; ".join(f"{state} on {ranks_text(ranks)}" for state, ranks in sorted(by_state.items()))


def _never_reached(rank: int, seq: int, last: Optional[dict], kept_none: Optional[int]) -> str:
    """Why ``rank`` has no entry ``seq``: it stopped before it. ``last``: its last collective
    entry, or None when it kept none (``kept_none``: its last collective's number, 0: none)."""
    if last is not None:
        return f"rank {rank} never reached it (its last collective was {describe_entry(last)}, {last['state']})"
    if not kept_none:
        return f"rank {rank} never reached it (it made no collective on this group)"
    reached = "it" if kept_none + 1 == seq else f"#{kept_none + 1}"
    return (f"rank {rank} never reached {reached} (its last collective was #{kept_none}; "
            "its buffer kept no entries)")


def analyze_group(key: Tuple[str, int], members: Dict[int, dict],
                  dumped: Sequence[int]) -> Tuple[bool, List[str]]:
    """(disagreement found, lines) for one group. ``dumped``: the ranks that wrote a dump."""
    label = _label(key)
    lines: List[str] = []
    found = False
    expected = next(iter(members.values()))["ranks"]
    missing = [r for r in expected if r not in members]
    if missing:
        found = True
        no_file = [r for r in missing if r not in dumped]
        no_group = [r for r in missing if r in dumped]
        if no_file:
            lines.append(f"{label}: no trace from {ranks_text(no_file)} (dead before dumping, "
                         "or CUPYCOLL_TRACE_DIR not set there)")
        if no_group:
            lines.append(f"{label}: the trace of {ranks_text(no_group)} has no such group")
    per_rank: Dict[int, Dict[int, dict]] = {}
    # Ranks whose dump holds no collective: the number of their last one (0: they made none,
    # such as a rank stuck in data loading before the group's first collective).
    kept_none: Dict[int, int] = {}
    for rank, group in sorted(members.items()):
        collectives = {e["seq"]: e for e in group["entries"] if not e.get("p2p")}
        if collectives:
            per_rank[rank] = collectives
        else:
            kept_none[rank] = int(group.get("last_issued") or 0)
            if kept_none[rank]:
                lines.append(f"{label}: rank {rank} kept no entries (buffer {group.get('buffer')}); "
                             f"its last collective was #{kept_none[rank]}")
    if not per_rank:
        top = max(kept_none.values(), default=0)
        behind = sorted(r for r, last in kept_none.items() if last < top)
        if not behind:
            return found, lines or [f"{label}: no collectives recorded"]
        first = min(kept_none[r] for r in behind) + 1
        return True, lines + [f"{label}: first disagreement at #{first}: "
                              + "; ".join(_never_reached(r, first, None, kept_none[r]) for r in behind)]
    start = max(min(c) for c in per_rank.values())
    end = max(max(c) for c in per_rank.values())
    for seq in range(start, end + 1):
        present = {r: c[seq] for r, c in per_rank.items() if seq in c}
        absent = [r for r in per_rank if r not in present]
        silent = [r for r, last in kept_none.items() if last < seq]
        if absent or silent:
            first = present[min(present)]
            never = [r for r in absent if max(per_rank[r]) < seq]
            text = [f"{label}: first disagreement at {describe_entry(first)}: "
                    f"{_states(present)}"]
            stopped = {r: per_rank[r][max(per_rank[r])] for r in never}
            stopped.update({r: None for r in silent})
            for rank in sorted(stopped):
                text.append(_never_reached(rank, seq, stopped[rank], kept_none.get(rank)))
            gaps = [r for r in absent if r not in never]
            if gaps:
                text.append(f"{ranks_text(gaps)} recorded none with that number")
            return True, lines + ["; ".join(text)]
        mismatch = compare({r: _sig(e) for r, e in present.items()})
        if mismatch:
            return True, lines + [f"{label}: first disagreement: {mismatch} ({_states(present)})"]
    last = {r: c[end] for r, c in per_rank.items()}
    verb = "agrees" if len(per_rank) == 1 else "agree"
    summary = (f"{label}: {ranks_text(list(per_rank))} {verb} on collectives "
               f"#{start}-#{end}")
    unfinished = {r: e for r, e in last.items() if e["state"] != "completed"}
    if unfinished:
        summary += f"; the last, {describe_entry(last[min(last)])}, is {_states(unfinished)}"
    return found, lines + [summary]


def _entry_text(entry: dict) -> str:
    peer = f" with rank {entry['peer']}" if entry.get("p2p") else ""
    return f"{describe_entry(entry)}{peer}: {entry['state']} ({entry.get('route')})"


def last_entries(key: Tuple[str, int], members: Dict[int, dict], count: int) -> List[str]:
    """Each member's last ``count`` entries of one group (collectives and point-to-point
    calls, oldest first), as lines."""
    lines = []
    for rank, group in sorted(members.items()):
        entries = group["entries"][-count:]
        lines.append(f"{_label(key)}, rank {rank}: last {len(entries)} of {len(group['entries'])} "
                     f"entries kept (last collective issued #{group.get('last_issued', 0)}, "
                     f"completed #{group.get('last_completed', 0)})")
        lines.extend(f"  {_entry_text(entry)}" for entry in entries)
    return lines


def analyze(dumps: Sequence[dict], last: int = 0) -> Tuple[bool, List[str]]:
    """(disagreement found, report lines) over every group in ``dumps``; with ``last``, each
    rank's last ``last`` entries of each group follow that group's verdict."""
    dumped = [d["rank"] for d in dumps]
    lines = [f"cupycoll.trace.analyze: {len(dumps)} trace(s), {ranks_text(dumped)}"]
    found = False
    for key, members in sorted(_groups(dumps).items()):
        group_found, group_lines = analyze_group(key, members, dumped)
        found = found or group_found
        lines.extend(group_lines)
        if last:
            lines.extend(last_entries(key, members, last))
    lines.append("ranks disagree (see above)" if found else "every group's ranks agree")
    return found, lines


# What each figure of bench() times.
BENCH_FIGURES = {
    "record_us": "one call recorded, its shapes and dtypes already at hand (the hot path)",
    "record_with_tensor_meta_us": "the same, reading shape and dtype off the tensor first",
    "mark_completed_us": "an entry marked completed (the watchdog, when a Work's event fires)",
    "record_buffer_off_us": "a call only counted, the recorder off (CUPYCOLL_TRACE_BUFFER=0)",
    "empty_lambda_us": "the timing loop itself (a call that does nothing), part of every figure above",
}


def bench(number: int = 100_000, repeat: int = 5) -> Dict[str, float]:
    """Microseconds per call of the recorder's hot path (best of ``repeat``)."""
    import torch

    tensor = torch.empty(1024)
    recorder = Recorder("bench", [0, 1], 0)
    off = Recorder("bench-off", [0, 1], 0, size=0)
    shapes, dtypes = (tensor.shape,), (tensor.dtype,)
    entry = recorder.record("all_reduce", shapes, dtypes)

    def best(fn) -> float:
        return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6

    def with_meta():
        recorder.record("all_reduce", (tensor.shape,), (tensor.dtype,), None, "nccl")

    return {
        "record_us": best(lambda: recorder.record("all_reduce", shapes, dtypes, None, "nccl")),
        "record_with_tensor_meta_us": best(with_meta),
        "mark_completed_us": best(lambda: recorder.mark(entry, "completed")),
        "record_buffer_off_us": best(lambda: off.record("all_reduce", shapes, dtypes, None, "nccl")),
        "empty_lambda_us": best(lambda: None),
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cupycoll.trace",
        description="Compare the per-rank cupycoll trace dumps in DIR and print, per group, "
                    "the first collective the ranks disagree on (exit 1), or that they agree "
                    "(exit 0). Exit 2: DIR missing, empty or unreadable.")
    parser.add_argument("dir", nargs="?", help="folder of cupycoll_trace_rank<R>.json files")
    parser.add_argument("--last", type=int, default=0, metavar="N",
                        help="also print each rank's last N entries of each group")
    parser.add_argument("--bench", action="store_true",
                        help="print what recording one call costs, in microseconds")
    args = parser.parse_args(argv)
    if args.bench:
        print("what the flight recorder costs a call, in microseconds (the best of 5 runs of 100,000 "
              "calls on this machine; its budget is 1 µs a call):")
        for name, value in bench().items():
            print(f"  {name + ':':<28} {value:6.3f}  {BENCH_FIGURES[name]}")
        return EXIT_AGREE
    if args.last < 0:
        parser.print_usage(sys.stderr)
        print(f"python -m cupycoll.trace: error: --last {args.last}: give a number of entries, 1 or more",
              file=sys.stderr)
        return EXIT_ERROR
    if args.dir is None:
        parser.print_usage(sys.stderr)
        print("python -m cupycoll.trace: error: give DIR (or --bench)", file=sys.stderr)
        return EXIT_ERROR
    try:
        dumps = load_dir(args.dir)
    except CupycollValueError as exc:
        print(f"cupycoll.trace.analyze: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    found, lines = analyze(dumps, args.last)
    print("\n".join(lines))
    return EXIT_DISAGREE if found else EXIT_AGREE


