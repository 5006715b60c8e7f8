"""The GPU tier as parts: which files, in which order, and each one's time budget.

One pytest command per part, quick semantic checks first. A part whose tests run one
after another stops at its first failure (``-x``), so that the failure prints at once and
the next part still runs; a part whose tests only read what runs started together recorded
(api, faults, fsdp) goes on, since one failed assertion must not hide the verdicts after it. The
budget is the wall-clock limit of the part's command: every subprocess limit inside a
part's tests is below it, so a hang fails inside the part, with the ranks' output.

Budgets are for one H100/H200 with up to 3 ranks sharing it through distinct
NCCL_HOSTIDs (NCCL's socket transport: millisecond latency, a few GB/s), with torch, CuPy
and NCCL as the device machine has them. How they were estimated (process start with torch
and CuPy imported 5-10 s, cold page cache on the first one; NCCL init over sockets 1-3 s;
5 s group timeouts in the fault scenarios) is in docs/gpu-verification.md; the estimates
are the times measured on the GPU machine where a part has run.

The budgets add up to more than one device command may take (the device tool stops a
command after 600 s; we plan for 540 s), so ``--run`` has a budget of its own, 540 s unless
``--budget`` says otherwise: it starts a part only while the part's whole budget fits in what
is left, and names every part it did not start, in its output, in the last line and in its
exit status (3; 1 when a part failed). The first four parts always fit together; the bench
part fits after them when they take about their estimates. A device call should therefore
run the tier part by part when needed: ``make test-gpu`` first, then ``make test-gpu-PART``
for each part it reports as not run, in a call of its own.

Importable without pytest, torch or a GPU (tools/verify_gpu.py imports it), and runnable:

    python tests/gpu/tier.py --check           what is installed and what is missing
    python tests/gpu/tier.py --run [PART ...]  the parts in order, each under its budget,
        [--budget SECONDS]                     all of them within SECONDS (default 540)

Exit status of ``--run``: 0 every chosen part ran and passed; 1 a part failed (or the tier
cannot run here); 3 none failed, but some were not run for want of time.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parent.parent.parent

# (part name, test file, budget in seconds), in the order the parts run. A part's budget
# covers pytest's start (PART_START_S) plus the limits of the subprocesses its tests run one
# after another (runs started side by side count once, at the longest limit): a hang then
# fails inside the part, with the ranks' output, before the part itself is killed
# (tests/tooling/test_gpu_tier_cpu.py checks it against each file's SUBPROCESS_LIMITS_S).
#   semantics  15 + DDP parity 50, and ~10 s of tests in process: 90 leaves room for a cold start
#   api        15 + the five suite runs together 100
#   ring       15 + the three ring runs together 75
#   faults     15 + every launch together 130 + the trace analysis after the CUDA hang 60
#   bench      15 + six runs one after another, 255 (tests/gpu/test_gpu_bench.py)
#   compile    15 + two runs side by side 50 + one run on both backends 50
#   fsdp       15 + four launches side by side 90 (examples/train_fsdp.py, 12 ranks in all) + 5 s
#              to compare what they saved. The whole part took 29 s on one H200; on a loaded
#              2-core CPU the same runs take 7 s (2 ranks) and 16 s (4 ranks), both backends
#              each. 90 s leaves room for a cold start (tests/gpu/test_gpu_fsdp.py).
GPU_TIER: List[Tuple[str, str, int]] = [
    ("semantics", "tests/gpu/test_gpu_semantics.py", 90),
    ("api", "tests/gpu/test_gpu_api.py", 120),
    ("ring", "tests/gpu/test_gpu_ring.py", 90),
    ("faults", "tests/gpu/test_gpu_faults.py", 205),
    ("bench", "tests/gpu/test_gpu_bench.py", 270),
    ("compile", "tests/gpu/test_gpu_compile.py", 120),
    ("fsdp", "tests/gpu/test_gpu_fsdp.py", 110),
]
GPU_TIER_BUDGETS_S = {name: budget for name, _path, budget in GPU_TIER}
# What each part takes (s), measured on one H200 (docs/gpu-verification.md): semantics 24
# without its DDP parity run (~25 s more), api 32, ring 37, faults 81, compile 57, fsdp 29
# (the lease of 2026-11-27). The bench part has not run yet (the lease runs the benchmark
# as steps of its own): 140 s is an estimate.
GPU_TIER_ESTIMATES_S = {"semantics": 50, "api": 32, "ring": 37, "faults": 81, "bench": 140, "compile": 57,
                        "fsdp": 29}

# pytest's own start in a part's command, before its first subprocess: the interpreter,
# torch and CuPy imported, test collection (more on a cold page cache).
PART_START_S = 15

# What one device command may take: the device tool stops a command after 600 s; 60 s are
# left for the machine's start-up and the transfers. The default of --run --budget.
COMMAND_LIMIT_S = 540
# --run's exit status when no part failed but some were not run for want of time.
NOT_RUN_EXIT = 3

# What the tier imports: without the first group nothing runs; without the second, the
# tests that need it say so (the benchmark's plots and progress bar).
REQUIRED = {
    "pytest": "the test runner: pip install pytest (or carry a wheel: docs/gpu-verification.md)",
    "torch": "torch with CUDA",
    "numpy": "numpy",
    "cupy": "CuPy for your CUDA: pip install cupy-cuda12x / cupy-cuda13x",
}
OPTIONAL = {
    "matplotlib": "bench --plot and `bench plot` (tests/gpu/test_gpu_bench.py skips those checks)",
    "tqdm": "the benchmark's progress bar (optional; the benchmark runs without it)",
}


# Parts whose tests only read what the runs a fixture started recorded: one failed
# assertion must not hide the verdicts after it, the device time is already spent.
READS_FINISHED_RUNS = {"tests/gpu/test_gpu_api.py", "tests/gpu/test_gpu_faults.py", "tests/gpu/test_gpu_fsdp.py"}


def print_figure(capsys, name: str, value) -> None:
    """One figure of a part as a ``GPU-FIGURE name: value`` line, printed past pytest's
    capture (``capsys``, the test's fixture) so that a passing test's figures reach the
    part's output, which ``make verify-gpu`` reads (tools/verify_figures.py)."""
    with capsys.disabled():
        print(f"\nGPU-FIGURE {name}: {value}", flush=True)


def pytest_command(path: str, python: Optional[str] = None, extra: Sequence[str] = ()) -> List[str]:
    """The command of one part: stop at the first failure and report it right away, unless
    the part's tests only read finished runs (READS_FINISHED_RUNS)."""
    stop = [] if path in READS_FINISHED_RUNS else ["-x"]
    return [python or sys.executable, "-m", "pytest", "-m", "gpu", *stop, "-q", "-rfEs", *extra, path]


def _probe(module: str) -> Optional[str]:
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any import failure counts as missing
        return f"{type(exc).__name__}: {exc}"
    return None


def check() -> List[str]:
    """Print what the GPU tier has and lacks; the list of missing required pieces."""
    missing = []
    for module, what in REQUIRED.items():
        problem = _probe(module)
        print(f"{'ok     ' if problem is None else 'MISSING'} {module:<11} {what if problem else ''}"
              f"{'' if problem is None else ' (' + problem + ')'}")
        if problem is not None:
            missing.append(module)
    if "cupy" not in missing:
        problem = _probe("cupy.cuda.nccl")
        print(f"{'ok     ' if problem is None else 'MISSING'} {'NCCL':<11} "
              f"{'' if problem is None else 'cupy.cuda.nccl: ' + problem + ' (pip install nvidia-nccl-cu12/cu13)'}")
        if problem is not None:
            missing.append("nccl")
    for module, what in OPTIONAL.items():
        problem = _probe(module)
        print(f"{'ok     ' if problem is None else 'absent '} {module:<11} {'' if problem is None else what}")
    if "torch" not in missing:
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        print(f"{'ok     ' if count else 'MISSING'} {'GPU':<11} {count} visible to torch {torch.__version__}")
        if not count:
            missing.append("gpu")
    mode = _compute_mode()
    if mode is not None:
        # ranks sharing one GPU need the Default compute mode
        print(f"{'ok     ' if mode.startswith('Default') else 'WARNING'} {'mode':<11} compute mode, MIG: {mode}")
    return missing


def _compute_mode() -> Optional[str]:
    """The first GPU's compute mode and MIG mode ("Default, Disabled"), or None where the
    driver does not answer."""
    if str(ROOT) not in sys.path:  # run as a script without PYTHONPATH: the checkout's bench
        sys.path.append(str(ROOT))
    from bench import gpu_info

    try:
        first = gpu_info.gpus()[0]
    except gpu_info.GpuInfoUnavailable:
        return None
    return ", ".join(filter(None, [first.compute_mode, first.mig_mode]))


def run_part(name: str, path: str, budget: float, python: Optional[str] = None,
             cmd: Optional[Sequence[str]] = None) -> int:
    """One part under its budget; its exit status (124 when the budget ran out). ``cmd``
    replaces the part's pytest command (the CPU tests run stand-ins)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("NCCL_DEBUG", "WARN")
    cmd = list(cmd) if cmd is not None else pytest_command(path, python)
    print(f"\n=== GPU tier part {name!r}: {' '.join(cmd[1:])} (budget {budget:g} s)", flush=True)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
    try:
        status = proc.wait(timeout=min(budget, COMMAND_LIMIT_S))
    except subprocess.TimeoutExpired:
        # SIGTERM ends pytest, and with it (tests/mp.py binds them to it) the ranks it
        # started in sessions of their own; SIGKILL if that does not do it.
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        print(f"=== part {name!r} ran past its budget of {budget:g} s and was killed", flush=True)
        status = 124
    print(f"=== part {name!r}: exit {status} after {time.monotonic() - start:.0f} s", flush=True)
    return status


NOT_RUN = "not run"


def not_run_text(name: str) -> str:
    return f"{name} {NOT_RUN}: over the command budget, run `make test-gpu-{name}`"


def run_parts(parts: Sequence[Tuple[str, str, float]], budget_s: float,
              run: Optional[Callable[[str, str, float], int]] = None,
              clock: Callable[[], float] = time.monotonic) -> Dict[str, object]:
    """Run ``parts`` in order within ``budget_s`` seconds: a part starts only when its whole
    budget fits in what is left (it can take all of it), else it is not run, and said so at
    once; a later, shorter part may still fit. Each part's exit status, or NOT_RUN. (A part
    killed at its budget has up to 10 s more to end: 540 s leaves that room under 600.)"""
    run = run or run_part
    start = clock()
    statuses: Dict[str, object] = {}
    for name, path, budget in parts:
        left = budget_s - (clock() - start)
        if budget > left:
            print(f"\n=== GPU tier part {name!r} NOT RUN: its budget is {budget:g} s and {max(0.0, left):.0f} s "
                  f"of this command's {budget_s:g} s are left; run `make test-gpu-{name}` "
                  f"(tests/gpu/tier.py --run {name}) in a command of its own", flush=True)
            statuses[name] = NOT_RUN
            continue
        statuses[name] = run(name, path, budget)
    return statuses


def summary(statuses: Dict[str, object]) -> Tuple[str, int]:
    """The last line of --run and its exit status: 1 if a part failed, NOT_RUN_EXIT if none
    failed but some were not run, else 0."""
    words = [not_run_text(n) if s == NOT_RUN else f"{n} {'passed' if s == 0 else 'FAILED (exit %s)' % s}"
             for n, s in statuses.items()]
    if any(s not in (0, NOT_RUN) for s in statuses.values()):
        status = 1
    elif NOT_RUN in statuses.values():
        status = NOT_RUN_EXIT
    else:
        status = 0
    return "=== GPU tier: " + ", ".join(words), status


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="report the prerequisites and exit")
    ap.add_argument("--run", nargs="*", metavar="PART", help="run these parts (default: all, in order)")
    ap.add_argument("--budget", type=float, default=COMMAND_LIMIT_S, metavar="SECONDS",
                    help=f"seconds for all the parts together (default {COMMAND_LIMIT_S}: one device command); "
                         "a part whose budget no longer fits is not run, and named")
    args = ap.parse_args(argv)
    if args.budget <= 0:
        ap.error("--budget must be positive")
    if args.run is None and not args.check:
        ap.error("give --check or --run")
    missing = check()
    if missing:
        print(f"the GPU tier cannot run here: missing {', '.join(missing)}", file=sys.stderr)
        return 1
    if args.run is None:
        return 0
    names = [name for name, _path, _budget in GPU_TIER]
    unknown = [p for p in args.run if p not in names]
    if unknown:
        ap.error(f"unknown part(s) {unknown}; the parts are {names}")
    chosen = [part for part in GPU_TIER if not args.run or part[0] in args.run]
    line, status = summary(run_parts(chosen, args.budget))
    print("\n" + line, flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
