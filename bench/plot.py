"""Plots of a run (live, or from a saved --json file) as one PNG, with matplotlib's Agg backend.

For every swept collective, two panels side by side: bus bandwidth vs size and host time
per call vs size, both on log-log axes, one line per candidate (and per placement, type,
op and ``-N`` cycle when the run had several). When the run has scenario rows, a last row
of panels shows their GPU and CPU time per iteration as grouped bars. Failed and n/a points
are left out.

Left out: measuring, and the tables (output).
"""

from __future__ import annotations

from typing import Dict, List, Sequence

from .sizes import format_bytes


class NothingToPlot(ValueError):
    """The results hold no measured row."""


def _series(rows: Sequence[Dict], collective: str):
    """{label: [(size, busbw, host_us)]} for one collective; the label names only what varies."""
    mine = [r for r in rows if r.get("collective") == collective]
    keys = ("placement", "type", "redop", "cycle")  # cycle: only in -N runs
    varies = {key: len({r.get(key) for r in mine}) > 1 for key in keys}
    series: Dict[str, List] = {}
    for r in mine:
        parts = [r["candidate"]]
        parts += [f"cycle {r[k]}" if k == "cycle" else str(r[k]) for k in keys if varies[k]]
        series.setdefault(" ".join(parts), []).append((r["size"], r.get("busbw_gbps"), r.get("host_us")))
    return {label: sorted(points) for label, points in sorted(series.items())}


def plot_results(document: Dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed (or wanted) on a GPU node
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    rows = document.get("rows", [])
    meta = document.get("meta", {})
    swept = [r for r in rows if r.get("kind") == "sweep" and r.get("status") == "ok"
             and r.get("time_us") and r.get("size")]
    scen = [r for r in rows if r.get("kind") == "scenario" and r.get("status") == "ok"
            and r.get("gpu_us") is not None]
    collectives = list(dict.fromkeys(r["collective"] for r in swept))
    if not collectives and not scen:
        raise NothingToPlot("no measured rows to plot (every row is n/a, failed, or missing)")

    nrows = len(collectives) + (1 if scen else 0)
    fig, axes = plt.subplots(nrows, 2, figsize=(13, 4.2 * nrows), squeeze=False)
    size_fmt = FuncFormatter(lambda x, _: format_bytes(x) if x >= 1 else "")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    for i, collective in enumerate(collectives):
        bw_ax, host_ax = axes[i]
        for j, (label, points) in enumerate(_series(swept, collective).items()):
            color = colors[j % len(colors)]
            sizes = [p[0] for p in points]
            bw = [p[1] if p[1] and p[1] > 0 else float("nan") for p in points]
            host = [p[2] if p[2] and p[2] > 0 else float("nan") for p in points]
            bw_ax.plot(sizes, bw, marker="o", ms=3, color=color, label=label)
            host_ax.plot(sizes, host, marker="o", ms=3, color=color, label=label)
        bw_ax.set_title(f"{collective}: bus bandwidth")
        bw_ax.set_ylabel("busbw (GB/s)")
        host_ax.set_title(f"{collective}: host time per call (launch only)")
        host_ax.set_ylabel("host time (µs/call)")
        for ax in (bw_ax, host_ax):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.xaxis.set_major_formatter(size_fmt)
            ax.set_xlabel("size (nccl-tests convention)")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)

    if scen:
        gpu_ax, cpu_ax = axes[-1]
        cases = list(dict.fromkeys(f"{r['scenario']}: {r['case']}" for r in scen))
        cands = list(dict.fromkeys(r["candidate"] for r in scen))
        width = 0.8 / max(1, len(cands))
        for j, cand in enumerate(cands):
            values = {f"{r['scenario']}: {r['case']}": r for r in scen if r["candidate"] == cand}
            xs = [k + j * width for k in range(len(cases))]
            for ax, field in ((gpu_ax, "gpu_us"), (cpu_ax, "cpu_us")):
                ys = [values[c][field] if c in values and values[c].get(field) else float("nan") for c in cases]
                ax.bar(xs, ys, width=width, color=colors[j % len(colors)], label=cand)
        for ax, title in ((gpu_ax, "scenarios: GPU time per iteration (median)"),
                          (cpu_ax, "scenarios: CPU time per iteration (median)")):
            ax.set_title(title)
            ax.set_ylabel("µs")
            ax.set_yscale("log")
            ax.set_xticks([k + 0.4 - width / 2 for k in range(len(cases))])
            ax.set_xticklabels(cases, rotation=25, ha="right", fontsize=8)
            ax.grid(True, axis="y", which="both", alpha=0.3)
            ax.legend(fontsize=8)

    title = "cupycoll-bench"
    if meta:
        title += (f" — {meta.get('gpu', '?')}, {meta.get('world_size', '?')} ranks "
                  f"({meta.get('transport', '?')}), commit {str(meta.get('git_commit', '?'))[:10]}")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
