"""The stage runner of ``make verify-gpu``: steps as subprocesses under time limits.

A :class:`Step` is one command of one stage (``tier.api``, ``bench.large``). :func:`run_plan`
runs the steps in order against one overall deadline: each gets ``min(its limit, time
left)``; one that cannot start in time (less left than its ``min_s``) is recorded
"skipped: out of time budget", never dropped. Every step runs in its own process group
(``start_new_session``), so a timeout kills the whole tree (torchrun, benchmark ranks),
and stragglers left behind after a normal exit are killed too. All output goes to one
log file; ``snapshot`` (the caller's: summary and compressed log) runs before and after
every step, so a run killed from outside still leaves what it had and names the step.

A step may name exit codes that end the run (the environment stage's "no GPU torch can
use"): the steps after it are then skipped with that reason. A failed step never stops
the others otherwise.

Pure standard library; knows nothing of GPUs. Left out: what the stages are
(verify_gpu.py) and what their output means (verify_figures.py, verify_summary.py).
"""

from __future__ import annotations

import dataclasses
import gzip
import os
import shlex
import shutil
import signal
import subprocess
import time
from typing import Callable, Dict, List, Optional

TAIL_CHARS = 6000
KILL_GRACE_S = 3.0  # SIGTERM first so that ranks can print why; then SIGKILL


@dataclasses.dataclass
class Step:
    stage: str
    name: str
    argv: List[str]
    limit_s: float
    estimate_s: float                 # what it should take on one H100 (shown, not enforced)
    env: Dict[str, str] = dataclasses.field(default_factory=dict)
    min_s: float = 10.0               # do not start with less time than this left
    fatal_codes: Dict[int, str] = dataclasses.field(default_factory=dict)
    read: Optional[Callable] = None   # (StepResult) -> figures dict, run after the step
    # A flag through which the step stops itself a margin before the limit it really gets
    # (its own limit, or less when the budget runs short), so it can still write its results.
    own_timeout_flag: Optional[str] = None
    own_timeout_margin_s: float = 10.0

    @property
    def key(self) -> str:
        return f"{self.stage}.{self.name}"

    def argv_for(self, limit_s: float) -> List[str]:
        if self.own_timeout_flag is None:
            return list(self.argv)
        own = max(1, int(limit_s - self.own_timeout_margin_s))
        return [*self.argv, self.own_timeout_flag, str(own)]


@dataclasses.dataclass
class StepResult:
    step: Step
    status: str                       # "passed", "failed", "skipped"
    reason: str = ""                  # why it failed or was skipped (one line)
    seconds: float = 0.0
    limit_s: float = 0.0              # the limit it actually ran under
    returncode: Optional[int] = None
    tail: str = ""                    # the end of its output
    figures: Dict = dataclasses.field(default_factory=dict)

    @property
    def verdict(self) -> str:
        return f"{self.status}: {self.reason}" if self.reason else self.status


def _kill_group(pgid: int, grace_s: float, leader: Optional[subprocess.Popen] = None) -> None:
    """SIGTERM the process group, give it ``grace_s``, then SIGKILL what is left."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if leader is not None and leader.poll() is None:
            time.sleep(0.05)
            continue
        try:
            os.killpg(pgid, 0)  # anyone left in the group?
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.05)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_from(path: str, offset: int) -> str:
    with open(path, "rb") as fh:
        fh.seek(offset)
        data = fh.read()
    return data.decode("utf-8", errors="replace")


def seconds_text(value: float) -> str:
    return f"{value:.0f}" if value >= 10 else f"{value:.1f}"


def error_line(text: str) -> str:
    """The line of a failed step's output that most likely says why (for one-line reports)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for marker in ("Error", "error:", "problem:", "FAILED", "AssertionError", "assert ", "Traceback"):
        for line in reversed(lines):
            if marker in line and not line.startswith("+ "):
                return line[:300]
    return lines[-1][:300] if lines else "(no output)"


def run_step(step: Step, log_path: str, limit_s: float, cwd: str, base_env: Dict[str, str]) -> StepResult:
    """Run one step under ``limit_s``, its output appended to ``log_path``."""
    env = dict(base_env)
    env.update(step.env)
    argv = step.argv_for(limit_s)
    with open(log_path, "ab") as log:
        log.write(f"\n===== {step.key}: limit {limit_s:.0f} s, estimate ~{step.estimate_s:.0f} s "
                  f"({time.strftime('%H:%M:%S')})\n+ {shlex.join(argv)}\n".encode())
        log.flush()
        offset = log.tell()
        start = time.monotonic()
        try:
            proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as exc:
            log.write(f"cannot start: {exc}\n".encode())
            return StepResult(step, "failed", f"cannot start {step.argv[0]}: {exc.strerror or exc}",
                              limit_s=limit_s)
        timed_out = False
        try:
            proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc.pid, KILL_GRACE_S, proc)
            proc.wait()
        seconds = time.monotonic() - start
        # Ranks or torchrun workers that outlived their parent would hold the GPU (and this
        # session's minutes) for the next step.
        _kill_group(proc.pid, 1.0)
        log.flush()
        tail = _read_from(log_path, offset)[-TAIL_CHARS:]
        verdict = "timed out" if timed_out else f"exit status {proc.returncode}"
        log.write(f"===== {step.key}: {verdict} after {seconds:.1f} s\n".encode())
    if timed_out:
        cut = " (cut to the time budget left)" if limit_s < step.limit_s else ""
        result = StepResult(step, "failed", f"timed out after {seconds_text(limit_s)} s{cut}", seconds, limit_s,
                            proc.returncode, tail)
    elif proc.returncode == 0:
        result = StepResult(step, "passed", "", seconds, limit_s, 0, tail)
    else:
        result = StepResult(step, "failed", f"exit status {proc.returncode}: {error_line(tail)}",
                            seconds, limit_s, proc.returncode, tail)
    if step.read is not None:
        try:
            result.figures = dict(step.read(result) or {})
        except Exception as exc:  # noqa: BLE001 - a broken reader must not lose the run
            result.figures = {"read_error": f"{type(exc).__name__}: {exc}"}
        # A reader may fail a step that exited 0 but proved nothing (every test skipped).
        failure = result.figures.pop("_fail", None)
        if failure and result.status == "passed":
            result.status, result.reason = "failed", failure
    return result


def run_plan(steps: List[Step], log_path: str, budget_s: float, cwd: str,
             base_env: Optional[Dict[str, str]] = None,
             snapshot: Optional[Callable[[List[StepResult], List[Step], Optional[Step]], None]] = None,
             clock: Callable[[], float] = time.monotonic) -> List[StepResult]:
    """Run ``steps`` in order within ``budget_s`` seconds. ``snapshot(results, pending,
    running)`` is called before and after every step, so that whatever stops this process
    leaves a record naming the step it was in."""
    base_env = dict(os.environ if base_env is None else base_env)
    deadline = clock() + budget_s
    results: List[StepResult] = []
    stop_reason = ""
    for index, step in enumerate(steps):
        left = deadline - clock()
        if stop_reason:
            result = StepResult(step, "skipped", stop_reason)
        elif left < min(step.min_s, step.limit_s):
            result = StepResult(step, "skipped", f"out of time budget ({max(0.0, left):.0f} s of "
                                                 f"{budget_s:.0f} s left, needs ~{step.estimate_s:.0f} s)")
        else:
            if snapshot:
                snapshot(results, steps[index + 1:], step)
            result = run_step(step, log_path, min(step.limit_s, left), cwd, base_env)
            if result.returncode in step.fatal_codes:
                stop_reason = step.fatal_codes[result.returncode]
        if result.status == "skipped":
            with open(log_path, "ab") as log:
                log.write(f"\n===== {step.key}: {result.verdict}\n".encode())
        results.append(result)
        if snapshot:
            snapshot(results, steps[index + 1:], None)
    return results


def compress_log(log_path: str, dest: str) -> None:
    """``dest`` = gzip of the log so far, replaced atomically (a reader never sees half)."""
    tmp = f"{dest}.tmp{os.getpid()}"
    with open(log_path, "rb") as src, gzip.open(tmp, "wb", compresslevel=6) as out:
        shutil.copyfileobj(src, out)
    os.replace(tmp, dest)
