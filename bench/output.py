"""What rank 0 shows and saves: the side-by-side tables, scenario reports, JSON and CSV.

Rows are flat dicts, one per measurement (a collective, size, type, op, root, placement
and candidate, or one scenario case of one candidate, or one scenario target). The table
puts the candidates of one point side by side; the files keep one row per candidate, so
they load straight into a spreadsheet or pandas. JSON holds ``{"meta": {...}, "rows":
[...]}``; CSV holds the same rows, with the metadata as leading ``# key: value`` lines
(``pandas.read_csv(path, comment="#")`` skips them).

Pure Python (no torch). Left out: measuring (runner, scenarios) and plotting (plot).
"""

from __future__ import annotations

import csv
import json
import math
import os
from typing import Callable, Dict, Iterable, List, Optional, Sequence

from .metrics import UNSLICED_BYTES
from .sizes import format_bytes

SCHEMA = "cupycoll-bench/1"
SPEEDUP_HELP = "speedup = {base} time / candidate time (> 1: faster than {base})"

# Column order of the CSV (and of each JSON row); keys not listed here follow, sorted.
FIELDS = [
    "kind", "collective", "scenario", "case", "target", "cycle", "size", "count", "type", "redop", "root",
    "placement", "candidate", "status", "time_us", "algbw_gbps", "busbw_gbps", "wrong", "host_us",
    "speedup", "time_sliced", "gpu_us", "cpu_us", "gpu_ratio", "cpu_ratio", "own_cpu_us", "own_ratio", "parts",
    "value", "limit", "iterations", "world_size", "note",
]
# After a table line or scenario line whose GPU time measures the GPU's time slices between
# ranks sharing it (metrics.time_sliced), and what it means, once under the table.
SLICED_MARK = "time-sliced"
SLICED_NOTE = ("# {n} marked time-sliced: the ranks share one GPU, which runs their kernels in turns (~2.3 ms "
               "slices), so GPU times (and bandwidths, speedups, GPU ratios) of calls below {limit} measure the "
               "slices, not the collective; host times do not")


class ResultsError(ValueError):
    """A results file that cannot be read; the message is for the user."""


# -- table ----------------------------------------------------------------------------
_PRE = [("size", 12, "(B)"), ("count", 12, "(elements)"), ("type", 8, ""), ("redop", 6, ""),
        ("root", 5, ""), ("place", 5, "")]
_CELL = [("time", 9, "(us)"), ("algbw", 7, "(GB/s)"), ("busbw", 7, "(GB/s)"), ("#wrong", 6, ""),
         ("host", 9, "(us/call)"), ("speedup", 7, "(x)")]
_SEP = " |"


def _time_name(columns, cputime: bool):
    """The columns with the time column named as nccl-tests names it: ``cputime`` under -C 1."""
    return [("cputime",) + c[1:] if c[0] == "time" and cputime else c for c in columns]


def _columns(columns, texts) -> str:
    return "".join(f" {text:>{width}}" for (_, width, _), text in zip(columns, texts))


def table_header(collective: str, candidates: Sequence[str], baseline: str, world: int,
                 transport: str, timer: str, cputime: bool = False) -> List[str]:
    """Comment lines above a collective's table: what the numbers are, then the columns
    (the time column is ``cputime`` when ``cputime``: -C 1)."""
    lines = [
        "#",
        f"# {collective}: {world} ranks ({transport}); time = {timer}; "
        f"host = median host time of one call (launch only, no synchronization)",
        "# " + SPEEDUP_HELP.format(base=baseline),
    ]
    pre_width = len(_columns(_PRE, [""] * len(_PRE)))
    cell_width = len(_columns(_CELL, [""] * len(_CELL)))
    lines.append(("#" + " " * (pre_width - 1)
                  + "".join(_SEP + name.center(cell_width) for name in candidates)).rstrip())
    cell = _time_name(_CELL, cputime)
    for index in (0, 2):  # names, then units
        text = "#" + _columns(_PRE, [c[index] for c in _PRE])[1:]
        text += "".join(_SEP + _columns(cell, [c[index] for c in cell]) for _ in candidates)
        lines.append(text.rstrip())
    return lines


def fmt_num(value, width: int, digits: int) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return f"{'-':>{width}}"
    text = f"{value:.{digits}f}"
    if len(text) > width:  # keep the columns aligned for huge values
        text = f"{value:.{max(0, width - 6)}e}"
    return f"{text:>{width}}"


def table_line(point: Dict, cells: Dict[str, Optional[Dict]], candidates: Sequence[str], baseline: str) -> str:
    """One table line: the point's description, then one cell per candidate."""
    place = {"out-of-place": "out", "in-place": "in"}.get(point["placement"], point["placement"])
    text = _columns(_PRE, [str(point[k]) for k in ("size", "count", "type", "redop", "root")] + [place])
    for name in candidates:
        row = cells.get(name)
        text += _SEP
        if row is None or row["status"] != "ok":
            text += _columns(_CELL, ["n/a" if row is None else row["status"]] + ["-"] * (len(_CELL) - 1))
            continue
        wrong = "N/A" if row.get("wrong") is None else str(row["wrong"])
        speed = "base" if name == baseline else fmt_num(row.get("speedup"), 7, 2).strip()
        text += _columns(_CELL, [fmt_num(row["time_us"], 9, 2), fmt_num(row["algbw_gbps"], 7, 2),
                                 fmt_num(row["busbw_gbps"], 7, 2), wrong, fmt_num(row["host_us"], 9, 2),
                                 speed])
    if any(row and row.get("time_sliced") for row in cells.values()):
        text = text.rstrip() + "  " + SLICED_MARK
    return text.rstrip()


def sliced_note(rows: Sequence[Dict], what: str = "points") -> List[str]:
    """The note under a table or scenario with time-sliced rows ([] when none is)."""
    marked = {_point_key(r) for r in rows if r.get("time_sliced")}
    if not marked:
        return []
    return [SLICED_NOTE.format(n=f"{len(marked)} {what}", limit=format_bytes(UNSLICED_BYTES))]


def _point_key(row: Dict) -> tuple:
    return tuple(row.get(k) for k in ("kind", "collective", "scenario", "case", "cycle", "size", "type", "redop",
                                      "root", "placement"))


def _wrong_text(rows: Sequence[Dict], checked: bool) -> str:
    wrong = sum(r.get("wrong") or 0 for r in rows if r.get("status") == "ok")
    return f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}" + (
        "" if checked else " (not checked: -c 0)")


def _reasons(rows: Sequence[Dict]) -> List[str]:
    reasons: Dict[tuple, int] = {}
    for r in rows:
        if r.get("status") != "ok":
            key = (r["candidate"], r["status"], r.get("note") or "")
            reasons[key] = reasons.get(key, 0) + 1
    return [f"# {name} {status} ({n} points): {note}" for (name, status, note), n in reasons.items()]


def table_footer(rows: Sequence[Dict], candidates: Sequence[str], checked: bool = True,
                 bandwidth: bool = True) -> List[str]:
    """nccl-tests' closing lines: wrong values, average bus bandwidth (unless ``bandwidth`` is
    False: the nccl-tests tables carry their own); plus n/a reasons. ``checked`` is False
    only for ``-c 0``."""
    lines = [_wrong_text(rows, checked)] if bandwidth else []  # else each table had its own
    for name in candidates if bandwidth else ():
        bws = [r["busbw_gbps"] for r in rows if r["candidate"] == name and r.get("status") == "ok"]
        if bws:
            lines.append(f"# Avg bus bandwidth    : {sum(bws) / len(bws):.4g} GB/s  {name} ({len(bws)} points)")
    lines += _reasons(rows)
    lines += sliced_note(rows)
    lines.append("#")
    return lines


# -- nccl-tests' own table (--format nccl-tests) ----------------------------------------
# One table per candidate, laid out as nccl-tests prints it, so that scripts written for
# its output read this one: per line size, count, type, redop, root, then the out-of-place
# group (time, algbw, busbw, #wrong) and the in-place group. A group torch.distributed has
# no call for, or a candidate could not run, holds N/A.
_NT_PRE = (("size", "(B)", 12), ("count", "(elements)", 12), ("type", "", 8), ("redop", "", 6),
           ("root", "", 6))
_NT_CELL = (("time", "(us)", 7), ("algbw", "(GB/s)", 6), ("busbw", "(GB/s)", 6), ("#wrong", "", 6))
_NT_GROUP = 2 + len(_columns(((None, 7, None), (None, 6, None), (None, 6, None), (None, 6, None)),
                             ["", "", "", ""]))


def _nt_line(pre: Sequence[str], groups: Sequence[Sequence[str]]) -> str:
    text = "  ".join(f"{value:>{width}}" for value, (_, _, width) in zip(pre, _NT_PRE))
    for group in groups:
        text += "".join(f"  {value:>{width}}" for value, (_, _, width) in zip(group, _NT_CELL))
    return text


def _nt_time(value: float) -> str:
    digits = 2 if value < 1e4 else (1 if value < 1e5 else 0)  # keep the column 7 wide
    return f"{value:.{digits}f}"


def _nt_cell(row: Optional[Dict]) -> List[str]:
    if row is None or row.get("status") != "ok":
        return ["N/A"] * 4
    wrong = "N/A" if row.get("wrong") is None else str(row["wrong"])
    return [_nt_time(row["time_us"]), f"{row['algbw_gbps']:.2f}", f"{row['busbw_gbps']:.2f}", wrong]


def nccl_tests_tables(collective: str, rows: Sequence[Dict], candidates: Sequence[str], world: int,
                      transport: str, timer: str, forms: Sequence[str], checked: bool = True,
                      cputime: bool = False) -> List[str]:
    """One nccl-tests table per candidate; the time columns are ``cputime`` when ``cputime``
    (-C 1), and each -N cycle repeats the lines, as nccl-tests prints them."""
    cell = _time_name(_NT_CELL, cputime)
    lines = []
    for name in candidates:
        mine = [r for r in rows if r.get("candidate") == name]
        lines += ["#", f"# {collective} on {name}: {world} ranks ({transport}); time = {timer}"]
        missing = [p for p in ("out-of-place", "in-place") if p not in forms]
        if missing:
            lines.append(f"# torch.distributed has no {missing[0]} {collective}: those columns are N/A")
        lines.append("#" + " " * (len(_nt_line([""] * 5, [])) - 1)
                     + "out-of-place".center(_NT_GROUP) + "in-place".center(_NT_GROUP).rstrip())
        for index in (0, 1):
            lines.append("#" + _nt_line([c[index] for c in _NT_PRE],
                                        [[c[index] for c in cell]] * 2)[1:].rstrip())
        points: Dict[tuple, Dict[str, Dict]] = {}
        for r in mine:
            key = (r.get("cycle"), r["size"], r["count"], r["type"], r["redop"], r["root"])
            points.setdefault(key, {})[r["placement"]] = r
        for key, cells in points.items():
            lines.append(_nt_line([str(k) for k in key[1:]],
                                  [_nt_cell(cells.get("out-of-place")), _nt_cell(cells.get("in-place"))]))
        bws = [r["busbw_gbps"] for r in mine if r.get("status") == "ok"]
        lines.append(_wrong_text(mine, checked))
        lines.append(f"# Avg bus bandwidth    : {sum(bws) / len(bws) if bws else 0:g}")
    return lines


def scenario_lines(title: str, rows: Sequence[Dict], baseline: str, clock: str = "GPU") -> List[str]:
    """A scenario's cases, one line per case and candidate, with the ratio to the baseline;
    then the candidates' own shares where the scenario timed torch's front alone, the note on
    time-sliced GPU times, the targets. ``clock`` heads the first time column: "GPU" (CUDA
    events), "wall" with --device cpu."""
    lines = ["#", f"# scenario {title}: medians per iteration; ratio = candidate / {baseline} "
                  "(< 1: less time than the baseline)",
             f"# {'case':<34} {'candidate':<14} {clock + ' us':>11} {'CPU us':>11} {clock + ' ratio':>10} "
             f"{'CPU ratio':>9}"]
    cases = [r for r in rows if r.get("kind") == "scenario"]
    for r in cases:
        if r.get("status") != "ok":
            lines.append(f"  {r['case']:<34} {r['candidate']:<14} {r['status']}: {r.get('note', '')}")
            continue
        lines.append((f"  {r['case']:<34} {r['candidate']:<14} {fmt_num(r.get('gpu_us'), 11, 2)} "
                      f"{fmt_num(r.get('cpu_us'), 11, 2)} {fmt_num(r.get('gpu_ratio'), 10, 3)} "
                      f"{fmt_num(r.get('cpu_ratio'), 9, 3)}"
                      + (f"  {SLICED_MARK}" if r.get("time_sliced") else "")).rstrip())
    lines += share_lines(cases, baseline)
    lines += sliced_note(cases, "cases")
    for r in rows:
        if r.get("kind") == "target":
            value = "-" if r.get("value") is None else f"{r['value']:.3f}"
            lines.append(f"# target: {r['target']:<58} {value:>7} (limit {r['limit']:g})  {r['status']}")
    return lines


def share_lines(rows: Sequence[Dict], baseline: str) -> List[str]:
    """Per case: the front's CPU time, then each candidate's own share (its CPU time less the
    front's) and that over the baseline's; per part for a block of several calls ([] when
    no case has a share)."""
    owned = [r for r in rows if r.get("own_cpu_us") is not None]
    if not owned:
        return []
    lines = ["#", f"# own share = CPU time less the same calls' on a group that does nothing (torch's Python "
                  f"front, which every backend pays); own ratio = own share / {baseline}'s",
             f"# {'case':<34} {'candidate':<14} {'CPU us':>11} {'own us':>11} {'own/part':>10} {'own ratio':>9}"]
    for case in dict.fromkeys(r["case"] for r in owned):
        # A case with shares had its front measured: its rows are the front and the candidates.
        for r in [r for r in rows if r["case"] == case and r.get("status") == "ok"]:
            own, parts = r.get("own_cpu_us"), r.get("parts") or 1
            per_part = own / parts if own is not None and parts > 1 else None
            lines.append((f"  {case:<34} {r['candidate']:<14} {fmt_num(r.get('cpu_us'), 11, 2)} "
                          f"{fmt_num(own, 11, 2)} {fmt_num(per_part, 10, 2)} "
                          f"{fmt_num(r.get('own_ratio'), 9, 3)}").rstrip())
    return lines


def describe_meta(meta: Dict) -> List[str]:
    keys = ["command", "date", "git_commit", "world_size", "transport", "gpu", "driver_version",
            "torch", "torch_cuda", "torch_nccl", "cupy", "cupy_nccl", "cupycoll", "algorithm_selection",
            "ring_scratch", "timer"]
    lines = ["# cupycoll-bench"]
    for key in keys:
        if key in meta:
            lines.append(f"#  {key:<20} {meta[key]}")
    for rank in meta.get("ranks", []):
        lines.append(f"#  rank {rank.get('rank')}: pid {rank.get('pid')} on {rank.get('host')} "
                     f"device {rank.get('device')} [{rank.get('device_name')}]"
                     + (f" NCCL_HOSTID={rank['nccl_hostid']}" if rank.get("nccl_hostid") else ""))
    return lines


# -- files ----------------------------------------------------------------------------
def _clean(value):
    # JSON has no NaN/inf; an absent measurement is null.
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    return value


def ordered(row: Dict) -> Dict:
    keys = [k for k in FIELDS if k in row] + sorted(k for k in row if k not in FIELDS)
    return {k: _clean(row[k]) for k in keys}


def _atomic_write(path: str, write: Callable) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", newline="") as fh:
        write(fh)
    os.replace(tmp, path)


def write_json(path: str, meta: Dict, rows: Iterable[Dict]) -> None:
    document = {"schema": SCHEMA, "meta": {k: _clean(v) for k, v in meta.items()},
                "rows": [ordered(r) for r in rows]}
    _atomic_write(path, lambda fh: (json.dump(document, fh, indent=1), fh.write("\n")))


def read_json(path: str) -> Dict:
    try:
        with open(path) as fh:
            document = json.load(fh)
    except OSError as exc:
        raise ResultsError(f"{path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ResultsError(f"{path}: not JSON ({exc})") from None
    if not isinstance(document, dict) or not isinstance(document.get("rows"), list):
        raise ResultsError(f"{path}: not a cupycoll-bench --json file (no \"rows\" list)")
    document.setdefault("meta", {})
    return document


def csv_columns(rows: Sequence[Dict]) -> List[str]:
    present = set().union(*(r.keys() for r in rows)) if rows else set()
    return [k for k in FIELDS if k in present] + sorted(present - set(FIELDS))


def write_csv(path: str, meta: Dict, rows: Sequence[Dict]) -> None:
    rows = [ordered(r) for r in rows]
    columns = csv_columns(rows)

    def write(fh):
        for key, value in meta.items():
            if isinstance(value, (dict, list)):
                value = json.dumps(value)
            fh.write(f"# {key}: {str(value).replace(chr(10), ' ')}\n")
        writer = csv.DictWriter(fh, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if row.get(k) is None else row[k]) for k in columns})

    _atomic_write(path, write)


def _parse_cell(text: str):
    if text == "":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def read_csv(path: str):
    """(meta, rows) from :func:`write_csv`'s file; numbers come back as int / float."""
    meta: Dict[str, str] = {}
    with open(path, newline="") as fh:
        lines = fh.read().splitlines()
    body = []
    for line in lines:
        if line.startswith("# ") and not body:
            key, _, value = line[2:].partition(": ")
            meta[key] = value
        else:
            body.append(line)
    rows = [{k: _parse_cell(v) for k, v in row.items()} for row in csv.DictReader(body)]
    return meta, rows


def describe_file(path: str) -> str:
    try:
        return f"{path} ({os.path.getsize(path)} bytes)"
    except OSError:
        return path


__all__ = ["write_json", "read_json", "write_csv", "read_csv", "table_header", "table_line",
           "table_footer", "nccl_tests_tables", "scenario_lines", "describe_meta", "format_bytes"]
