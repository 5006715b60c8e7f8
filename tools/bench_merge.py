"""Stage 4's last step: fold the benchmark runs of ``make verify-gpu`` into few files.

The device machine brings back at most 8 files, so the sweeps (small sizes, every
collective; large sizes, all_reduce and reduce_scatter) become one ``bench-sweep.json``
and the scenario runs (world size 1 and 2) one ``bench-scenarios.json``, each with a PNG
drawn by the benchmark's own plotter. The merged files keep bench/output.py's schema:
``meta`` is the first run's, with ``runs`` listing every run's meta; every row gains
``run`` (the source file's name). Runs that are missing or unreadable are listed under
``meta.missing`` and skipped; nothing is merged from them.

verify_gpu calls :func:`write_merged` after every benchmark step (JSON only, so a killed
run keeps the data) and once at the end with the plots; ``python -m tools.bench_merge
--work DIR --out DIR`` does the same by hand and exits 1 when no run could be read. Left out: measuring, and judging the figures
(verify_summary.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import output  # noqa: E402  (pure Python: no torch)

# merged file -> the verify_gpu run files it is made of, in order
GROUPS = {
    "bench-sweep": ["sweep-row.json", "sweep-small.json", "sweep-large.json"],
    "bench-scenarios": ["scenarios-1rank.json", "scenarios-2ranks.json"],
}


def merge(paths: List[str]) -> Dict:
    """One document from several --json files; absent or broken ones go to meta.missing."""
    meta: Dict = {}
    runs, rows, missing = [], [], []
    for path in paths:
        try:
            document = output.read_json(path)
        except output.ResultsError as exc:
            missing.append(str(exc))
            continue
        name = os.path.basename(path)
        if not meta:
            meta = dict(document["meta"])
        runs.append(dict(document["meta"], run=name))
        rows += [dict(row, run=name) for row in document["rows"]]
    meta.pop("ranks", None)  # per run, under runs
    meta.update(runs=runs, missing=missing, merged_by="tools/bench_merge.py")
    if len({r.get("world_size") for r in runs}) > 1:
        meta["world_size"] = "/".join(str(r.get("world_size")) for r in runs)
    return {"meta": meta, "rows": rows}


def _for_plot(document: Dict) -> Dict:
    # The plotter keys scenario bars by scenario and case; runs at two world sizes would
    # land on the same bar, so the copy it draws names the world size.
    rows = []
    for row in document["rows"]:
        if row.get("kind") == "scenario" and row.get("world_size"):
            row = dict(row, scenario=f"{row['scenario']} ({row['world_size']}r)")
        rows.append(row)
    return {"meta": document["meta"], "rows": rows}


def write_merged(work: str, out: str, plot: bool = True) -> List[str]:
    """Merge what exists in ``work`` into ``out``; the lines to show (what was written, or why not)."""
    said = []
    for merged, parts in GROUPS.items():
        paths = [os.path.join(work, p) for p in parts if os.path.exists(os.path.join(work, p))]
        if not paths:
            continue
        document = merge(paths)
        if not document["rows"]:
            said.append(f"{merged}: no readable rows ({'; '.join(document['meta']['missing'])})")
            continue
        target = os.path.join(out, f"{merged}.json")
        output.write_json(target, document["meta"], document["rows"])
        said.append(f"wrote {target} ({len(document['rows'])} rows from {len(document['meta']['runs'])} runs)")
        if not plot:
            continue
        try:
            from bench import plot as plotting

            said.append("wrote " + plotting.plot_results(_for_plot(document), os.path.join(out, f"{merged}.png")))
        except Exception as exc:  # noqa: BLE001 - a plot is a nicety; the JSON is the record
            said.append(f"{merged}: no plot ({type(exc).__name__}: {exc})")
    return said


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench_merge", description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", required=True, help="the folder with the benchmark runs' JSON files")
    parser.add_argument("--out", required=True, help="the results folder")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    said = write_merged(args.work, args.out, plot=not args.no_plot)
    for line in said:
        print(f"bench_merge: {line}")
    return 0 if any(line.startswith("wrote") for line in said) else 1


if __name__ == "__main__":
    sys.exit(main())
