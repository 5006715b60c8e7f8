"""The record ``make verify-gpu`` leaves: the results folder, ``summary.md`` and ``results.json``.

The folder holds at most :data:`MAX_FILES` files and no subfolders (the GPU machine brings
back 8 files per command), all named in :data:`OUT_FILES`; :func:`check_out_dir` says what
breaks that rule. ``summary.md`` has, in order: the machine and versions; one table row per
step (stage, part, passed / failed / skipped with the reason, time against its limit and
estimate, key figures); the targets (PASS / MISS / not measured, with why), under a note on
which 2-rank figures a shared GPU's time slices make; the ready-to-paste row for
docs/gpu-verification.md and the commands that copy the result files to bench/results/; the
output tail of every failed step. ``results.json`` holds the same as
data. Both are rewritten after every step, so a run killed from outside leaves the summary
so far, naming the step it was killed in.

Pure standard library. Left out: running steps (verify_runner.py) and reading figures
(verify_figures.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Dict, List, Optional

MAX_FILES = 8
OUT_FILES = ("summary.md", "results.json", "verify.log.gz", "bench-sweep.json", "bench-sweep.png",
             "bench-scenarios.json", "bench-scenarios.png", "faults.json")
# What docs/gpu-verification.md's row names, copied to bench/results/ under a dated prefix.
RECORDED = ("bench-sweep.json", "bench-sweep.png", "bench-scenarios.json", "bench-scenarios.png",
            "faults.json", "summary.md")
TAIL_LINES = 40
# What the 2-rank figures are (the ranks share the lease's one GPU).
SLICED_NOTE = ("The 2 ranks share one GPU, which runs their kernels in turns (~2.3 ms time slices): their GPU "
               "times below 16 MiB a call measure the turns, so no target reads them (the bench files mark those "
               "rows `time_sliced`); their host times and the ratios at ≥ 16 MiB stand.")
assert len(OUT_FILES) <= MAX_FILES


def out_path(out_dir: str, name: str) -> str:
    if name not in OUT_FILES:
        raise ValueError(f"{name} is not one of the results folder's files ({', '.join(OUT_FILES)})")
    return os.path.join(out_dir, name)


def check_out_dir(out_dir: str) -> List[str]:
    """What breaks the folder's rule (at most 8 files, no subfolders, known names); [] if none."""
    problems = []
    try:
        entries = sorted(os.listdir(out_dir))
    except OSError as exc:
        return [f"{out_dir}: {exc.strerror or exc}"]
    for name in entries:
        path = os.path.join(out_dir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            problems.append(f"{name}/ is a folder (the results folder has none)")
        elif name not in OUT_FILES:
            problems.append(f"{name} is not one of the results folder's files")
    if len(entries) > MAX_FILES:
        problems.append(f"{len(entries)} entries, more than the {MAX_FILES} the GPU machine brings back")
    return problems


@dataclasses.dataclass
class RunInfo:
    command: str
    mode: str                      # "full" or "quick"
    budget_s: float
    started: str                   # UTC, ISO
    commit: str
    out_dir: str
    work_dir: str
    not_selected: List[str]        # stage names left out by --stage
    env: Dict = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    finished: bool = False


def _gpu_slug(name: str) -> str:
    match = re.search(r"\b([A-Z]\d{2,4}[A-Za-z]?)\b", name or "")
    return (match.group(1) if match else re.sub(r"[^a-z0-9]+", "-", (name or "gpu").lower()).strip("-")).lower()


def _fmt_value(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e-3 or abs(value) >= 1e4 else f"{value:.3f}"
    return str(value)


def _figures_text(figures: Dict) -> str:
    parts = []
    for key, value in figures.items():
        if isinstance(value, float):
            value = f"{value:.3g}"
        parts.append(f"{key} {value}")
    return "; ".join(parts).replace("|", "/")


def _cell(text: str) -> str:
    return str(text).replace("|", "/").replace("\n", " ")


def tier_counts(results) -> Dict[str, int]:
    totals = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    for r in results:
        if r.step.stage == "tier" and r.step.name != "probe":
            for key in totals:
                totals[key] += int(r.figures.get(key, 0) or 0)
    return totals


def stage_verdicts(results, pending, running) -> Dict[str, str]:
    """passed / failed / skipped / incomplete per stage, in run order."""
    by_stage: Dict[str, List[str]] = {}
    for r in results:
        by_stage.setdefault(r.step.stage, []).append(r.status)
    for step in ([running] if running else []) + list(pending):
        by_stage.setdefault(step.stage, []).append("pending")
    verdicts = {}
    for stage, statuses in by_stage.items():
        if "failed" in statuses:
            verdicts[stage] = "failed"
        elif "pending" in statuses:
            verdicts[stage] = "incomplete"
        elif all(s == "skipped" for s in statuses):
            verdicts[stage] = "skipped"
        elif "skipped" in statuses:
            verdicts[stage] = "incomplete"
        else:
            verdicts[stage] = "passed"
    return verdicts


def docs_row(info: RunInfo, results) -> str:
    env = info.env
    nccl = env.get("nccl_cupy") or env.get("nccl_bindings") or env.get("nccl_torch") or "?"
    gpu = env.get("gpu") or env.get("smi_name") or "?"
    if env.get("driver"):
        gpu += f", driver {env['driver']}"
    counts = tier_counts(results)
    verdicts = stage_verdicts(results, [], None)
    passed = sum(v == "passed" for v in verdicts.values())
    present = _present(info)
    prefix = f"bench/results/{info.started[:10]}-{_gpu_slug(env.get('gpu', ''))}-"
    files = ", ".join(f"`{prefix}{name}`" for name in present) or "none"
    stages = ", ".join(f"{stage} {verdict}" for stage, verdict in verdicts.items())
    return (f"| {info.started[:10]} | {info.commit[:12]} | {_cell(gpu)} | {env.get('torch', '?')} / "
            f"{env.get('cupy', '?')} / {nccl} | `{_cell(info.command)}` | {counts['passed']} / "
            f"{counts['failed'] + counts['errors']} / {counts['skipped']} (GPU tier; verify-gpu: {passed} of "
            f"{len(verdicts)} stages passed: {stages}) | {files} |")


def _present(info: RunInfo) -> List[str]:
    # summary.md is being written right now; the others only exist once their step ran.
    return [name for name in RECORDED
            if name == "summary.md" or os.path.exists(os.path.join(info.out_dir, name))]


def _record_commands(info: RunInfo) -> List[str]:
    prefix = f"{info.started[:10]}-{_gpu_slug(info.env.get('gpu', ''))}-"
    present = _present(info)
    # RESULTS is wherever the folder ends up (the GPU machine's files come back elsewhere).
    return [f"RESULTS={info.out_dir}", "mkdir -p bench/results"] + [
        f'cp "$RESULTS/{n}" bench/results/{prefix}{n}' for n in present]


def render(info: RunInfo, results, pending, running, targets: List[Dict], problems: List[str]) -> str:
    env = info.env
    verdicts = stage_verdicts(results, pending, running)
    lines = [f"# make verify-gpu ({info.mode}) — {info.started}", ""]
    if env:
        lines.append(f"{env.get('gpu', env.get('smi_name', '?'))} × {env.get('gpus', '?')} · driver "
                     f"{env.get('driver', '?')} · Python {env.get('python', '?')} · torch {env.get('torch', '?')} "
                     f"(CUDA {env.get('torch_cuda', '?')}, NCCL {env.get('nccl_torch', '?')}) · CuPy "
                     f"{env.get('cupy', '?')} · CUDA runtime {env.get('cuda_runtime', '?')} · NCCL "
                     f"{env.get('nccl_cupy', '?')} (CuPy) / {env.get('nccl_bindings', '?')} (ctypes: "
                     f"{env.get('nccl_library', '?')})")
        for problem in env.get("problems", []):
            lines.append(f"- environment problem: {problem}")
    else:
        lines.append("Environment: not recorded (the environment stage has not run or wrote nothing).")
    state = "finished" if info.finished else (
        f"RUNNING or KILLED during {running.key}" if running else "in progress")
    lines += ["", f"Commit {info.commit} · `{info.command}` · budget {info.budget_s:.0f} s, "
                  f"{info.seconds:.0f} s used · {state}", ""]
    lines.append("Stages: " + ", ".join(f"**{s}** {v}" for s, v in verdicts.items())
                 + "".join(f", **{s}** not run (not selected by --stage)" for s in info.not_selected))
    lines += ["", "| stage | part | result | seconds (limit / estimate) | key figures |", "|---|---|---|---|---|"]
    for r in results:
        ran = f"{r.seconds:.0f} ({r.limit_s:.0f} / ~{r.step.estimate_s:.0f})" if r.status != "skipped" else \
            f"— ({r.step.limit_s:.0f} / ~{r.step.estimate_s:.0f})"
        lines.append(f"| {r.step.stage} | {r.step.name} | {_cell(r.verdict)} | {ran} | {_figures_text(r.figures)} |")
    for step in ([running] if running else []):
        lines.append(f"| {step.stage} | {step.name} | running (if this is the last summary: killed here) | "
                     f"— ({step.limit_s:.0f} / ~{step.estimate_s:.0f}) | |")
    for step in pending:
        lines.append(f"| {step.stage} | {step.name} | not run yet | — ({step.limit_s:.0f} / "
                     f"~{step.estimate_s:.0f}) | |")
    lines += ["", "## Targets (ratios from this run; figures, not timed tests)", "", SLICED_NOTE, "",
              "| target | limit | measured | result | detail |", "|---|---|---|---|---|"]
    for t in targets:
        lines.append(f"| {t['target']} | {t['limit']} | {_fmt_value(t['value'])} | {t['status']} | "
                     f"{_cell(t['detail'])} |")
    lines += ["", "## For docs/gpu-verification.md", "", "```", docs_row(info, results), "```", "",
              "Result files to commit:", "", "```sh", *_record_commands(info), "```"]
    if problems:
        lines += ["", "## Results folder problems", ""] + [f"- {p}" for p in problems]
    failed = [r for r in results if r.status == "failed"]
    if failed:
        lines += ["", "## Failures (output tails; the whole output is in verify.log.gz)"]
        for r in failed:
            tail = "\n".join(r.tail.rstrip().splitlines()[-TAIL_LINES:]).replace("```", "'''")
            lines += ["", f"### {r.step.key}: {r.verdict}", "", "```", tail, "```"]
    return "\n".join(lines) + "\n"


def as_data(info: RunInfo, results, pending, running, targets, problems) -> Dict:
    return {
        "tool": "make verify-gpu", "mode": info.mode, "command": info.command, "started": info.started,
        "seconds": round(info.seconds, 1), "budget_s": info.budget_s, "commit": info.commit,
        "finished": info.finished, "running": running.key if running else None,
        "environment": info.env, "stages": stage_verdicts(results, pending, running),
        "not_selected": info.not_selected,
        "steps": [{"step": r.step.key, "status": r.status, "reason": r.reason, "seconds": round(r.seconds, 1),
                   "limit_s": r.limit_s or r.step.limit_s, "estimate_s": r.step.estimate_s,
                   "returncode": r.returncode, "figures": r.figures} for r in results],
        "pending": [s.key for s in pending], "targets": targets, "docs_row": docs_row(info, results),
        "folder_problems": problems,
    }


def _atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)


def write(info: RunInfo, results, pending, running, targets, problems: Optional[List[str]] = None) -> None:
    problems = problems or []
    _atomic(out_path(info.out_dir, "summary.md"), render(info, results, pending, running, targets, problems))
    data = as_data(info, results, pending, running, targets, problems)
    _atomic(out_path(info.out_dir, "results.json"), json.dumps(data, indent=1, default=str) + "\n")
