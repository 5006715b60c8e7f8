"""What ``make verify-gpu``'s stages measured: figures from their output, and the targets.

Readers turn one step's output (its log tail, or the JSON file it wrote) into a small dict
of key figures for the summary table: pytest's counts, the demo's largest parameter
difference, a benchmark run's ok / error / n/a / #wrong counts, the probe's checks.
:func:`evaluate_targets` then judges the figures of one run against the targets below
(bench/README.md, "Targets"), each PASS, MISS or "not measured" (with why), never left out:

* host µs per synchronous all_reduce, cupycoll / torch:nccl <= 1.0 (1 and 2 ranks);
* 64-op coalesced host time, cupycoll / torch:nccl <= 1.2 (sync and async, worse of two),
  with each backend's own share per all_reduce beside it (its time less torch's front alone,
  which the benchmark times on a group that does nothing);
* ring kernel bandwidth >= 0.9x a device-to-device copy (worst dtype x kernel, largest size);
* ring / NCCL time at >= 64 MiB, 2 ranks: <= 1.15x for fp32; for bf16, whose partials travel
  in fp32 (byte floors 1.5 and 2.0), all_reduce <= 1.7x and reduce_scatter <= 2.3x; ring /
  NCCL host time per call <= 2x at every size, 2 ranks (worst point; NCCL = cupycoll:nccl);
* the watchdog's cost per synchronous call <= 1 µs (the calling thread's CPU, the median of
  alternated rounds' differences, shown with its interquartile range; the asynchronous
  figure beside it, without a target); abort latency <= 2 s; hung peer -> error <= timeout
  + 5 s; killed peer -> error <= timeout + 5 s;
* DDP parameter difference vs torch's nccl <= 1e-6 (fp32).

No target reads a GPU time of calls below 16 MiB at 2 ranks: the two ranks share one GPU,
which runs their kernels in ~2.3 ms turns, so such a time measures the turns (the benchmark
marks those rows ``time_sliced``).

Inputs are the files bench/output.py (``{"schema", "meta", "rows"}``) and
bench/fault_bench.py write. Pure standard library. Left out: running anything, layout.
"""

from __future__ import annotations

import json
import os
import re
from typing import Dict, List, Optional

MIB = 1 << 20
OURS, RING, TORCH = "cupycoll:nccl", "cupycoll:ring", "torch:nccl"
FRONT = "torch front"  # bench.scenarios.FRONT: the coalescing scenario's calls on a group that does nothing
# The benchmark's own host-time targets (bench.scenarios.TARGETS, which imports torch; a test
# keeps the two equal): a synchronous one-element all_reduce, and a 64-op coalesced block.
HOST_RATIO_LIMIT = 1.0
COALESCED_RATIO_LIMIT = 1.2
# bench/fault_bench.py's WATCHDOG_TARGET_US (a test keeps the two equal).
WATCHDOG_LIMIT_US = 1.0
# Ring / NCCL time at >= 64 MiB: (label, dtype, collective or None for both, limit). bf16's
# partials travel in fp32, so its byte floors against NCCL are 1.5 (all_reduce) and 2.0
# (reduce_scatter); fp32's is 1.0.
RING_TIME_LIMITS = (("fp32", "float", None, 1.15), ("bf16 all_reduce", "bfloat16", "all_reduce", 1.7),
                    ("bf16 reduce_scatter", "bfloat16", "reduce_scatter", 2.3))

_PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)\b")
_TIER_FIGURE = re.compile(r"^GPU-FIGURE ([^:]+): (.+)$", re.MULTILINE)  # tests/gpu/tier.print_figure
_DEMO_DIFF = re.compile(r"max \|param difference\| (\S+) vs (\S+): ([0-9.eE+-]+)")


def load_json(path: str) -> Optional[Dict]:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


# -- readers: one step's output -> figures ---------------------------------------------
def pytest_counts(text: str) -> Dict:
    """pytest's closing counts (``3 passed, 1 skipped in 4.2s``), from the last such line."""
    for line in reversed(text.splitlines()):
        found = _PYTEST_COUNT.findall(line)
        if found and (" in " in line or "no tests ran" in line):
            counts = {}
            for number, word in found:
                word = "errors" if word.startswith("error") else word
                counts[word] = counts.get(word, 0) + int(number)
            return counts
    return {}


def read_pytest(result) -> Dict:
    counts = pytest_counts(result.tail)
    figures = {k: counts.get(k, 0) for k in ("passed", "failed", "skipped", "errors")}
    for name, value in _TIER_FIGURE.findall(result.tail):  # a test's own figures, the last of each
        figures[name.strip()] = value.strip()
    if result.status == "passed" and figures["passed"] == 0:
        figures["_fail"] = (f"no test ran on the GPU ({figures['skipped']} skipped): "
                            "nothing was verified")
    return figures


def read_demo(result) -> Dict:
    found = _DEMO_DIFF.findall(result.tail)
    if not found:
        return {}
    ours, ref, diff = found[-1]
    return {"ddp_max_param_diff": float(diff), "compared": f"{ours} vs {ref}"}


def bench_counts(path: str) -> Dict:
    """ok / error / n/a rows and #wrong of one --json file (absent: {})."""
    document = load_json(path)
    if not document or not isinstance(document.get("rows"), list):
        return {}
    rows = [r for r in document["rows"] if r.get("kind") in ("sweep", "scenario")]
    figures = {"rows_ok": sum(r.get("status") == "ok" for r in rows),
               "rows_error": sum(r.get("status") == "error" for r in rows),
               "rows_na": sum(r.get("status") == "n/a" for r in rows)}
    wrong = [r["wrong"] for r in rows if isinstance(r.get("wrong"), int)]
    if wrong:
        figures["wrong"] = sum(wrong)
    return figures


def read_probe(path: str) -> Dict:
    document = load_json(path) or {}
    if not document.get("checks"):
        return {}
    figures = {"checks_passed": document.get("passed", 0), "checks_failed": document.get("failed", 0)}
    failed = [c["check"] for c in document["checks"] if not c["ok"]]
    if failed:
        figures["failed_checks"] = ", ".join(failed)
    return figures


# -- targets --------------------------------------------------------------------------
def _target(name: str, limit: float, better: str, value: Optional[float], detail: str = "",
            why_not: str = "") -> Dict:
    """better: "max" (value must be <= limit) or "min" (>= limit)."""
    if value is None:
        status = "not measured"
    elif better == "max":
        status = "PASS" if value <= limit else "MISS"
    else:
        status = "PASS" if value >= limit else "MISS"
    return {"target": name, "limit": f"{'≤' if better == 'max' else '≥'} {limit:g}", "value": value,
            "status": status, "detail": detail if value is not None else why_not}


def _rows(document: Optional[Dict]) -> List[Dict]:
    return [r for r in (document or {}).get("rows", []) if isinstance(r, dict)]


def _scenario(document, scenario: str, case: str, candidate: str) -> Optional[Dict]:
    for r in _rows(document):
        if (r.get("kind") == "scenario" and r.get("scenario") == scenario and r.get("case") == case
                and r.get("candidate") == candidate and r.get("status") == "ok"):
            return r
    return None


def _own_share(document, case: str) -> str:
    """"own share per call: cupycoll:nccl X µs, torch:nccl Y µs (front Z µs)" of a coalescing
    case whose front the run timed ("" where it did not)."""
    ours, base = (_scenario(document, "coalescing", case, name) for name in (OURS, TORCH))
    front = _scenario(document, "coalescing", case, FRONT)
    if not (ours and base and front) or ours.get("own_cpu_us") is None or base.get("own_cpu_us") is None:
        return ""
    parts = ours.get("parts") or 1
    unit = "per all_reduce" if parts > 1 else "per call"
    return (f"; own share {unit}: {OURS} {ours['own_cpu_us'] / parts:.1f} µs, {TORCH} "
            f"{base['own_cpu_us'] / parts:.1f} µs (torch's front {front['cpu_us'] / parts:.1f} µs)")


def _host_ratio(document, world: int, missing: str) -> Dict:
    name = f"host µs per synchronous all_reduce, cupycoll / torch:nccl ({world} rank{'s' * (world > 1)})"
    row = _scenario(document, "overhead", "1-element sync", OURS) or _scenario(
        document, "coalescing", "1-element sync", OURS)
    value = row.get("cpu_ratio") if row else None
    detail = (f"{row['cpu_us']:.1f} µs per call ({row['scenario']}){_own_share(document, '1-element sync')}"
              if row and value is not None else "")
    return _target(name, HOST_RATIO_LIMIT, "max", value, detail, missing)


def _coalesced(document, world: int, missing: str) -> Dict:
    name = f"64-op coalesced host time, cupycoll / torch:nccl ({world} rank{'s' * (world > 1)})"
    found = {case: _scenario(document, "coalescing", case, OURS) for case in ("coalesced sync", "coalesced async")}
    ratios = {case: r.get("cpu_ratio") for case, r in found.items() if r and r.get("cpu_ratio") is not None}
    value = max(ratios.values()) if ratios else None
    detail = ", ".join(f"{case.split()[1]} {v:.3f}" for case, v in ratios.items())
    return _target(name, COALESCED_RATIO_LIMIT, "max", value,
                   detail + " (worse of the two)" + _own_share(document, "coalesced sync"), missing)


def _kernel(document, missing: str) -> Dict:
    name = "ring kernel bandwidth / device-to-device copy (1 GPU)"
    rows = [r for r in _rows(document) if r.get("scenario") == "kernel" and r.get("status") == "ok"
            and isinstance(r.get("ratio_to_copy"), (int, float))]
    if not rows:
        return _target(name, 0.9, "min", None, why_not=missing)
    largest = max(r.get("size_bytes") or 0 for r in rows)
    at = [r for r in rows if (r.get("size_bytes") or 0) == largest]
    worst = min(at, key=lambda r: r["ratio_to_copy"])
    detail = (f"worst of {len(at)} at {largest // MIB} MiB: {worst.get('kernel')} {worst.get('dtype')} "
              f"{worst.get('gbps', 0):.0f} GB/s vs copy {worst.get('copy_gbps', 0):.0f} GB/s")
    return _target(name, 0.9, "min", worst["ratio_to_copy"], detail)


def _ring_pairs(documents) -> List:
    """(ring row, cupycoll:nccl row) of every sweep point both measured."""
    key = ("collective", "size", "type", "redop", "placement")
    rows = [r for document in documents for r in _rows(document)
            if r.get("kind") == "sweep" and r.get("status") == "ok"]
    nccl = {tuple(r.get(k) for k in key): r for r in rows if r.get("candidate") == OURS}
    return [(r, nccl[tuple(r.get(k) for k in key)]) for r in rows
            if r.get("candidate") == RING and tuple(r.get(k) for k in key) in nccl]


def _worst(pairs, field: str):
    ratios = [(ring[field] / base[field], ring) for ring, base in pairs
              if isinstance(ring.get(field), (int, float)) and base.get(field)]
    return max(ratios, key=lambda p: p[0]) if ratios else (None, None)


def _ring_vs_nccl(documents, label: str, dtype: str, collective: Optional[str], limit: float,
                  missing: str) -> Dict:
    """``documents``: the sweeps that may hold rows of 64 MiB and more (large, lease row)."""
    name = f"ring / NCCL time at ≥ 64 MiB (2 ranks, {label})"
    pairs = [(ring, base) for ring, base in _ring_pairs(documents)
             if ring.get("type") == dtype and (ring.get("size") or 0) >= 64 * MIB
             and collective in (None, ring.get("collective"))]
    ratio, worst = _worst(pairs, "time_us")
    if ratio is None:
        return _target(name, limit, "max", None, why_not=missing)
    detail = (f"worst of {len(pairs)}: {worst['collective']} {worst['size'] // MIB} MiB "
              f"{worst.get('placement', '')}".rstrip())
    return _target(name, limit, "max", ratio, detail)


def _ring_host(documents, missing: str) -> Dict:
    name = "ring / NCCL host µs per call, every size (2 ranks)"
    pairs = _ring_pairs(documents)
    ratio, worst = _worst(pairs, "host_us")
    if ratio is None:
        return _target(name, 2.0, "max", None, why_not=missing)
    detail = (f"worst of {len(pairs)}: {worst['collective']} {worst['type']} {worst['size'] // MIB} MiB "
              f"{worst.get('placement', '')}, {worst['host_us']:.0f} µs".rstrip())
    return _target(name, 2.0, "max", ratio, detail)


def _watchdog(overhead: Dict, missing: str) -> Dict:
    """The watchdog's cost per synchronous call, its spread, and the asynchronous figure."""
    name = "watchdog per synchronous call (µs, the calling thread's CPU)"
    sync, other = overhead.get("sync"), overhead.get("async")
    if not isinstance(sync, dict) or sync.get("watchdog_us") is None:
        return _target(name, WATCHDOG_LIMIT_US, "max", None, why_not=missing)
    s = sync.get("spread_us")
    if isinstance(s, dict):
        detail = (f"median of {s.get('n')} rounds' differences, interquartile {s['q1']:+.2f} to {s['q3']:+.2f}, "
                  f"range {s['min']:+.2f} to {s['max']:+.2f}")
    else:  # a file of the earlier method
        detail = "a difference of two medians of host time, no spread"
    if isinstance(other, dict) and other.get("watchdog_us") is not None:
        detail += f"; async {other['watchdog_us']:+.2f} (no target: its Work keeps its event)"
    return _target(name, WATCHDOG_LIMIT_US, "max", sync["watchdog_us"], detail)


def _faults(faults: Optional[Dict], missing: str) -> List[Dict]:
    faults = faults or {}
    found = []
    found.append(_watchdog(faults.get("watchdog_overhead") or {}, missing))
    modes = faults.get("modes") or {}

    def worst(field):
        values = {m: f.get(field) for m, f in modes.items() if isinstance(f, dict) and f.get(field) is not None}
        if not values:
            return None, ""
        return max(values.values()), ", ".join(f"{m} {v:.3f}" for m, v in values.items())

    value, detail = worst("abort_latency_s")
    found.append(_target("abort latency: abort() → stuck collective released (s)", 2.0, "max", value,
                         detail, missing))
    value, detail = worst("hung_error_past_timeout_s")
    timeout = next((f.get("hung_timeout_s") for f in modes.values() if isinstance(f, dict)), None)
    found.append(_target("hung peer → error, seconds past the group timeout", 5.0, "max",
                         value, f"{detail} (timeout {timeout} s)", missing))
    value, detail = worst("killed_error_past_timeout_s")
    timeout = next((f.get("killed_timeout_s") for f in modes.values() if isinstance(f, dict)), None)
    killed = [f.get("killed_detected_by") for f in modes.values() if isinstance(f, dict) and f.get("killed_detected_by")]
    found.append(_target("killed peer → error, seconds past the group timeout (negative: NCCL noticed first)",
                         5.0, "max", value, f"{detail} (timeout {timeout} s; detected by {', '.join(killed)})",
                         missing))
    return found


def evaluate_targets(work_dir: str, out_dir: str, ddp_diff: Optional[float], why: Dict[str, str]) -> List[Dict]:
    """Every target, judged from the run files in ``work_dir`` / ``out_dir``. ``why`` maps a
    source ("scenarios-1rank", "scenarios-2ranks", "sweep-large", "faults", "demo") to why
    it has no figures (its step failed, was skipped or not selected)."""
    def why_not(source):
        return why.get(source) or f"no figures ({source} produced none)"

    scen1 = load_json(os.path.join(work_dir, "scenarios-1rank.json"))
    scen2 = load_json(os.path.join(work_dir, "scenarios-2ranks.json"))
    large = load_json(os.path.join(work_dir, "sweep-large.json"))
    row = load_json(os.path.join(work_dir, "sweep-row.json"))
    faults = load_json(os.path.join(out_dir, "faults.json"))
    targets = [
        _host_ratio(scen1, 1, why_not("scenarios-1rank")),
        _host_ratio(scen2, 2, why_not("scenarios-2ranks")),
        _coalesced(scen1, 1, why_not("scenarios-1rank")),
        _coalesced(scen2, 2, why_not("scenarios-2ranks")),
        _kernel(scen1, why_not("scenarios-1rank")),
        *[_ring_vs_nccl([d for d in (large, row) if d], label, dtype, collective, limit, why_not("sweep-large"))
          for label, dtype, collective, limit in RING_TIME_LIMITS],
        _ring_host([d for d in (large, row) if d], why_not("sweep-large")),
    ]
    targets += _faults(faults, why_not("faults"))
    targets.append(_target("DDP largest parameter difference vs torch nccl (fp32)", 1e-6, "max", ddp_diff,
                           "make demo (examples/train_ddp.py --compare nccl)", why_not("demo")))
    return targets
