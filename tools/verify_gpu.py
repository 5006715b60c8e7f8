"""``make verify-gpu``: one command that proves cupycoll's CUDA path on a GPU and records it.

On a GPU machine with torch, CuPy and NCCL already installed (it installs nothing and needs
no network), it runs the stages below, each step a subprocess under its own time
limit, going on after a failure, all within one overall budget (``--budget``, default
540 s full, 170 s ``--quick``, so that the command ends inside 9 / 3 minutes):

1. **env**: GPU, driver, Python, torch, CuPy, CUDA runtime, and NCCL as CuPy loaded it and
   as the ctypes bindings loaded it (they must agree); tools/gpu_env.py.
2. **tier**: the GPU test tier, part by part (tests/gpu/tier.py's ``GPU_TIER``, less its
   bench part: stage 4 runs the real benchmarks); in ``--quick``, tools/gpu_probe.py (world
   2: all_reduce, all_gather, reduce_scatter, broadcast, send/recv, PREMUL_SUM, ring) and
   the semantics part.
3. **demo**: ``examples/demo.py`` (what ``make demo`` runs): DDP on cupycoll vs torch nccl.
4. **bench**: the benchmark CLI at 2 ranks, 20 iterations a figure: every collective at
   small sizes; all_reduce and reduce_scatter at 16 and 64 MiB, fp32 and bf16, for
   cupycoll:nccl, cupycoll:ring, torch:nccl; the coalescing and overhead scenarios at world 1
   and 2; the ring kernels vs a copy. The 2 ranks share the GPU, so their GPU times below
   16 MiB are time slices (the results mark them): what they give is host times and the
   large messages' ratios.
5. **faults**: bench/fault_bench.py: the watchdog's cost per call (thread CPU, 15 alternated
   rounds, with its spread), abort latency, hung peer -> error, killed peer -> error.

The full run goes measurements first (env, semantics, demo, the world-1 scenarios, faults,
the sweeps), then the long tier parts, so that a budget that runs short costs test parts
(``--stage tier`` re-runs them in one command) rather than the only figures. A step that
cannot start in the time left is recorded "skipped: out of time budget". The estimates
(``--list``; the tier's from tests/gpu/tier.py) add up to about 500 s of the 540, so the
last tier part, fsdp, is what a full run that overruns them leaves to ``--stage
tier.fsdp``. ``--lease`` runs what the GPU runs still owe first (env, probe, api, faults,
compile, fsdp, ring), then the rest while each step's whole limit fits (about 525 s of its
570 by the estimates).

Output, ``--out DIR`` (default verify-gpu-out/), at most 8 files and no folder:
summary.md (table of steps, targets PASS/MISS, the docs/gpu-verification.md row),
results.json, verify.log.gz (everything every step printed), bench-sweep.json/.png,
bench-scenarios.json/.png, faults.json. All rewritten after every step.

    make verify-gpu                                  # everything, within 9 min on one H100
    make verify-gpu VERIFY_ARGS=--quick              # <= 3 min: the most telling subset
    make verify-gpu VERIFY_ARGS="--stage bench,faults"   # some stages again (plus env)
    python -m tools.verify_gpu --list                # the plan: limits and estimates

Exit status 0 when every step passed, 1 otherwise; without a GPU it says so and exits 1 at
once (no torch import). Left out: installing anything, and judging correctness beyond what
the steps report (the tests and the benchmark's #wrong do that).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import glob
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, List, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import gpu_info  # noqa: E402
from tools import bench_merge, verify_figures, verify_summary  # noqa: E402
from tools.verify_runner import Step, run_plan, compress_log  # noqa: E402

PROG = "verify-gpu"
# --lease: what one command on a lent GPU machine may take (600 s at most a command; the
# rest is the machine's start and the transfers).
BUDGET_S = {"full": 540.0, "quick": 170.0, "lease": 570.0}
STAGES = ("env", "tier", "demo", "bench", "faults")
NO_GPU_EXIT_ENV = 3  # tools/gpu_env.py: torch sees no GPU
# The tier's own bench part is left out: stage 4 runs the real benchmarks.
TIER_SKIP = ("bench",)
# Minutes matter more than running one test twice: make demo (stage 3) is the DDP parity
# run. Node id -> the seconds it takes out of its part's estimate.
DESELECT = {"tests/gpu/test_gpu_semantics.py::test_ddp_parity_with_torch_nccl": 25}

# Every step's time limit and what it took when last measured, in one table (``--list``
# prints it). A limit of None is the part's budget in tests/gpu/tier.py. ``seconds`` is the
# step's time on the GPU machine named in MEASURED_ON where ``measured``, otherwise an
# estimate; it is the estimate the summary shows, and a measured time replaces it after
# each run that recorded it.
MEASURED_ON = "one NVIDIA H200, torch 2.11.0+cu130, CuPy 14.2.0, NCCL 2.28.9, the lease of 2026-11-27 at b9f8a17"


@dataclasses.dataclass(frozen=True)
class Timing:
    limit_s: Optional[float]
    seconds: float
    measured: bool = True


TIMINGS = {
    "env.env": Timing(60, 9),
    "tier.probe": Timing(60, 8),
    "tier.semantics": Timing(None, 24),  # DDP parity deselected: the demo runs it
    "tier.api": Timing(None, 32),
    "tier.ring": Timing(None, 37),
    "tier.faults": Timing(None, 81),
    "tier.compile": Timing(None, 57),
    "tier.fsdp": Timing(None, 29),
    "demo.demo": Timing(120, 28),
    # The watchdog part's 15 rounds add under a second of calls to the measured 43 s.
    "faults.fault_bench": Timing(150, 43),
    # The 2-rank steps at 20 iterations, estimated from the third lease's steps at 3 (10 for
    # the scenarios): ~14 s of start-up per step (what the step took less its calls), plus its
    # calls at the GPU times that lease measured per point or case (each point: a checked
    # call, the warm-up, the -n timed calls and -n host-timed ones, which queue as many).
    "bench.row": Timing(60, 20, measured=False),
    "bench.small": Timing(60, 19, measured=False),
    "bench.small-quick": Timing(60, 9),  # the first lease's (2026-11-26); not run since
    "bench.large": Timing(150, 47, measured=False),  # 16 and 64 MiB: 256 MiB alone would take ~100 s
    "bench.scenarios-1rank": Timing(90, 15),
    "bench.scenarios-2ranks": Timing(100, 75, measured=False),  # 2 warm-up + 20 + 20 iterations of each case
}


def gpu_tier():
    """tests/gpu/tier.py, loaded by path (it imports neither pytest nor torch): the parts
    ``GPU_TIER`` [(name, file, budget s)] and the command of one part."""
    path = ROOT / "tests" / "gpu" / "tier.py"
    spec = importlib.util.spec_from_file_location("cupycoll_gpu_tier", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tier_steps(py: str, tier_module) -> List[Step]:
    try:
        module = gpu_tier() if tier_module is None else tier_module
        parts = list(module.GPU_TIER)
    except Exception as exc:  # noqa: BLE001 - recorded as a failing step, the other stages still run
        why = f"cannot load tests/gpu/tier.py: {type(exc).__name__}: {exc}"
        return [Step("tier", "tier.py", [py, "-c", f"raise SystemExit({why!r})"], 10, 1, min_s=1)]
    estimates = getattr(module, "GPU_TIER_ESTIMATES_S", {})
    steps = []
    for name, path, budget in parts:
        if name in TIER_SKIP:
            continue
        deselect = [node for node in DESELECT if node.startswith(path + "::")]
        argv = module.pytest_command(path, py, ["-p", "no:cacheprovider"] + [f"--deselect={n}" for n in deselect])
        timing = TIMINGS.get(f"tier.{name}")
        if timing is not None:
            estimate = timing.seconds
        else:
            estimate = min(estimates.get(name, budget), budget) - sum(DESELECT[n] for n in deselect)
        steps.append(Step("tier", name, argv, float(budget), float(max(5, min(estimate, budget))), min_s=20,
                          read=verify_figures.read_pytest))
    return steps


def _timed(step: Step, key: Optional[str] = None) -> Step:
    """``step`` with the limit and time of its row in TIMINGS (``key``: another row)."""
    timing = TIMINGS[key or step.key]
    if timing.limit_s is not None:
        step.limit_s = float(timing.limit_s)
    step.estimate_s = float(timing.seconds)
    return step


# -- is there a GPU at all? (fast: no torch) -------------------------------------------
def find_gpu() -> Optional[str]:
    """A few words on the NVIDIA GPU found, or None. Looks at device files, the driver's
    /proc entries and the driver (bench/gpu_info.py: NVML, or nvidia-smi): importing torch to
    ask would take seconds."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return None
    devices = sorted(glob.glob("/dev/nvidia[0-9]*"))
    if devices:
        return f"{len(devices)} device file(s) {', '.join(devices[:4])}"
    gpus = glob.glob("/proc/driver/nvidia/gpus/*")
    if gpus:
        return f"{len(gpus)} GPU(s) in /proc/driver/nvidia/gpus"
    try:
        return gpu_info.gpus(timeout=3)[0].listing()
    except gpu_info.GpuInfoUnavailable:
        return None


def no_gpu_message() -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return f"{PROG}: no GPU visible (CUDA_VISIBLE_DEVICES={visible!r}); it needs an NVIDIA GPU"
    return (f"{PROG}: no NVIDIA GPU on this machine (no /dev/nvidia*, no /proc/driver/nvidia/gpus, "
            "nvidia-smi lists none); run it on a GPU machine")


# -- the plan -------------------------------------------------------------------------
CANDIDATES = "cupycoll:nccl,cupycoll:ring,torch:nccl"
# Iterations of every 2-rank GPU figure: two processes on one GPU take turns in ~2.3 ms
# slices, so a figure of a few calls is a few slices more or less.
SHARED_ITERS = "20"


def _bench(name: str, est: float, limit: float, json_name: str, args: List[str], py: str, work: str) -> Step:
    # --coll_timeout: a hung collective becomes an error row within 30 s (the largest call,
    # 256 MiB over loopback sockets, takes about a second) instead of eating the step.
    # --run_timeout (the bench's own wall-clock stop) is appended by the runner, 10 s below the
    # limit the step really gets, so a step cut short by the budget still writes its JSON.
    argv = [py, "-m", "bench", *args, "--no-progress",
            "--coll_timeout", "30", "--json", os.path.join(work, json_name)]
    return Step("bench", name, argv, limit, est, own_timeout_flag="--run_timeout",
                read=lambda r: verify_figures.bench_counts(os.path.join(work, json_name)))


def plan(mode: str, py: str, work: str, out: str, tier_module=None) -> List[Step]:
    """Every step of ``mode`` ("full", "quick" or "lease"), in run order."""
    env_json = os.path.join(work, "env.json")
    env = _timed(Step("env", "env", [py, "-m", "tools.gpu_env", "--json", env_json], 0, 0,
                      fatal_codes={NO_GPU_EXIT_ENV: "the environment stage found no GPU that torch can use"},
                      read=lambda r: _env_figures(env_json)))
    parts = {step.name: step for step in _tier_steps(py, tier_module)}
    demo = _timed(Step("demo", "demo", [py, "examples/demo.py"], 0, 0, read=verify_figures.read_demo))
    faults_json = verify_summary.out_path(out, "faults.json")
    faults = _timed(Step("faults", "fault_bench", [py, "-m", "bench.fault_bench", "--json", faults_json,
                                                   "--iterations", "6000", "--rounds", "15", "--trials", "2"],
                         0, 0,
                         read=lambda r: _faults_figures(faults_json)))
    probe_json = os.path.join(work, "probe.json")
    probe = _timed(Step("tier", "probe", [py, "-m", "tools.gpu_probe", "--json", probe_json, "--timeout", "50"],
                        0, 0, read=lambda r: verify_figures.read_probe(probe_json)))
    if mode == "quick":
        small = _timed(_bench("small", 0, 0, "sweep-small.json",
                              ["all_reduce", "all_gather", "broadcast", "sendrecv", "--ranks", "2", "--minbytes",
                               "1K", "--maxbytes", "1M", "--stepfactor", "32", "--iters", "3", "--warmup_iters",
                               "1", "--check", "1"], py, work), "bench.small-quick")
        semantics = [parts[name] for name in ("tier.py", "semantics") if name in parts]  # or why not
        return [env, probe, *semantics, demo, small]
    # 2 ranks share the GPU: every 2-rank GPU figure is the mean of SHARED_ITERS calls or more.
    small = _timed(_bench("small", 0, 0, "sweep-small.json",
                          ["all", "--ranks", "2", "--minbytes", "1K", "--maxbytes", "256K", "--stepfactor", "256",
                           "--iters", SHARED_ITERS, "--warmup_iters", "1", "--check", "1"], py, work))
    large = _timed(_bench("large", 0, 0, "sweep-large.json",
                          ["all_reduce", "reduce_scatter", "--ranks", "2", "--minbytes", "16M", "--maxbytes",
                           "64M", "--stepfactor", "4", "--datatype", "float,bfloat16", "--iters", SHARED_ITERS,
                           "--warmup_iters", "1", "--check", "1", "--backends", CANDIDATES], py, work))
    scen1 = _timed(_bench("scenarios-1rank", 0, 0, "scenarios-1rank.json",
                          ["--scenario", "coalescing,overhead,kernel", "--ngpus", "1", "--coalesce-bytes", "256M",
                           "--scenario-iters", "20", "--overhead-calls", "200"], py, work))
    scen2 = _timed(_bench("scenarios-2ranks", 0, 0, "scenarios-2ranks.json",
                          ["--scenario", "coalescing,overhead", "--ranks", "2", "--coalesce-bytes", "16M",
                           "--scenario-iters", SHARED_ITERS, "--warmup_iters", "2", "--overhead-calls", "100"],
                          py, work))
    if mode == "lease":
        # One all_reduce row per candidate at 1 MiB and 64 MiB.
        row = _timed(_bench("row", 0, 0, "sweep-row.json",
                            ["all_reduce", "--ranks", "2", "--minbytes", "1M", "--maxbytes", "64M", "--stepfactor",
                             "64", "--iters", SHARED_ITERS, "--warmup_iters", "1", "--check", "1", "--backends",
                             CANDIDATES], py, work))
        # What the runs still owe, first: the environment, the probe and the api part (quick,
        # and what everything after them stands on), then the faults part (the blocking
        # recovery, shrink and killed-rank scenarios, the cycles, the stuck call's abort), the
        # compile part, the fsdp part and the ring bit for bit. Then, as time allows, the host
        # cost of the rebuilt hot path against torch's nccl (the world-1 scenarios; fault_bench's
        # watchdog cost per call), and what earlier leases measured: the demo, a benchmark row,
        # the semantics part (it owes only a check that needs two GPUs) and the further figures.
        owed = [env, probe, *[parts.pop(n) for n in ("api", "faults", "compile", "fsdp", "ring") if n in parts]]
        rest = [scen1, faults, demo, row, *[parts.pop(n) for n in ("semantics",) if n in parts],
                large, scen2, small, *parts.values()]
        steps = owed + rest
        for step in steps:
            # Never start a step that could not finish: a step starts only with its whole limit left.
            step.min_s = step.limit_s
        return steps
    first = [parts.pop("semantics")] if "semantics" in parts else []
    return [env, *first, demo, scen1, faults, large, scen2, small, *parts.values()]


def _env_figures(path: str) -> dict:
    env = verify_figures.load_json(path) or {}
    keys = ("gpu", "driver", "cuda_runtime", "nccl_cupy", "nccl_bindings")
    figures = {k: env[k] for k in keys if env.get(k)}
    if env.get("problems"):
        figures["problems"] = "; ".join(env["problems"])
    return figures


def _faults_figures(path: str) -> dict:
    data = verify_figures.load_json(path) or {}
    figures = {}
    for label, o in (data.get("watchdog_overhead") or {}).items():
        if isinstance(o, dict) and o.get("watchdog_us") is not None:
            figures[f"watchdog {label} µs"] = round(o["watchdog_us"], 2)
            spread = o.get("spread_us")
            if isinstance(spread, dict):
                figures[f"watchdog {label} interquartile µs"] = f"{spread['q1']:+.2f} to {spread['q3']:+.2f}"
    for mode, f in (data.get("modes") or {}).items():
        for key in ("abort_latency_s", "hung_error_s", "killed_error_s"):
            if isinstance(f, dict) and f.get(key) is not None:
                figures[f"{mode} {key}"] = round(f[key], 3)
    for part, error in (data.get("errors") or {}).items():
        figures[f"{part} error"] = error[:120]
    return figures


def select(steps: List[Step], names: Sequence[str]) -> (List[Step], List[str]):
    """The steps ``--stage`` names (stages or stage.step keys), plus env; the stages left out."""
    known = {s.stage for s in steps} | {s.key for s in steps}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"--stage {','.join(unknown)}: no such stage or step here (choose from "
                         f"{', '.join(sorted(known))})")
    chosen = [s for s in steps if s.stage == "env" or s.stage in names or s.key in names]
    chosen_stages = {s.stage for s in chosen}
    return chosen, [st for st in dict.fromkeys(s.stage for s in steps) if st not in chosen_stages]


def _commit() -> str:
    def git(*args):
        try:
            done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    # A commit named by whoever sent the tree wins: a copied tree may carry a .git that is
    # not the tree's own.
    named = os.environ.get("CUPYCOLL_BENCH_GIT_COMMIT", "").strip()
    if named:
        return named
    head = git("rev-parse", "HEAD")
    if head:
        return head + (" (with uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else "")
    return "unknown (no git here: set CUPYCOLL_BENCH_GIT_COMMIT)"


def _base_env(commit: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env["CUPYCOLL_BENCH_GIT_COMMIT"] = commit.split()[0]
    # Ranks sharing one GPU talk over loopback sockets (docs: NCCL_HOSTID); keep the user's
    # settings where given.
    for key, value in (("NCCL_IB_DISABLE", "1"), ("NCCL_SOCKET_IFNAME", "lo"), ("GLOO_SOCKET_IFNAME", "lo"),
                       ("OMP_NUM_THREADS", "2"), ("NCCL_DEBUG", "WARN"), ("MPLBACKEND", "Agg")):
        env.setdefault(key, value)
    return env


# -- running --------------------------------------------------------------------------
def prepare_out(out: str) -> None:
    """Create the folder; remove a previous run's files; refuse a folder holding others."""
    os.makedirs(out, exist_ok=True)
    foreign = [n for n in sorted(os.listdir(out)) if n not in verify_summary.OUT_FILES]
    if foreign:
        raise ValueError(f"--out {out} holds files that are not {PROG}'s ({', '.join(foreign[:5])}); "
                         "give an empty or new folder")
    for name in verify_summary.OUT_FILES:
        if os.path.exists(os.path.join(out, name)):
            os.remove(os.path.join(out, name))


def execute(steps: List[Step], info: verify_summary.RunInfo, quiet: bool = False,
            base_env: Optional[dict] = None) -> int:
    """Run ``steps``, keeping summary, results and log in ``info.out_dir`` up to date."""
    log_path = os.path.join(info.work_dir, "verify.log")
    open(log_path, "ab").close()
    start = time.monotonic()
    reasons = {}
    planned = {s.key for s in steps}

    def say(text):
        if not quiet:
            try:
                print(f"{PROG}: {text}", flush=True)
            except OSError:  # stdout gone (a closed pipe): the files are the record
                pass

    def record(results, pending, running, final=False):
        info.seconds = time.monotonic() - start
        info.env = verify_figures.load_json(os.path.join(info.work_dir, "env.json")) or info.env
        sources = {"bench.scenarios-1rank": "scenarios-1rank", "bench.scenarios-2ranks": "scenarios-2ranks",
                   "bench.large": "sweep-large", "faults.fault_bench": "faults", "demo.demo": "demo"}
        for r in results:
            if r.step.key in sources and r.status != "passed":
                reasons[sources[r.step.key]] = f"{r.step.key} {r.verdict}"
        for key, source in sources.items():
            if key not in planned:
                reasons.setdefault(source, f"{key} is not part of this run ({info.mode}"
                                           f"{', --stage' if info.not_selected else ''})")
        if results and results[-1].step.stage == "bench" or final:
            for line in bench_merge.write_merged(info.work_dir, info.out_dir, plot=final):
                with open(log_path, "a", encoding="utf-8") as log:
                    log.write(f"bench_merge: {line}\n")
        demo = next((r for r in results if r.step.key == "demo.demo"), None)
        ddp = demo.figures.get("ddp_max_param_diff") if demo else None
        targets = verify_figures.evaluate_targets(info.work_dir, info.out_dir, ddp, reasons)
        compress_log(log_path, verify_summary.out_path(info.out_dir, "verify.log.gz"))
        verify_summary.write(info, results, pending, running, targets)
        if final:
            problems = verify_summary.check_out_dir(info.out_dir)
            if problems:
                verify_summary.write(info, results, pending, running, targets, problems)
            return problems
        if running is not None:
            say(f"{running.key}: started (limit {running.limit_s:.0f} s, ~{running.estimate_s:.0f} s)")
        elif results:
            r = results[-1]
            say(f"{r.step.key}: {r.verdict} ({r.seconds:.0f} s)")
        return []

    def snapshot(res, pending, running):
        try:
            record(res, pending, running)
        except Exception as exc:  # noqa: BLE001 - a bug in the record must not end the GPU run
            with open(log_path, "a", encoding="utf-8") as log:
                log.write(f"{PROG}: could not write the summary: {type(exc).__name__}: {exc}\n")
            say(f"could not write the summary: {type(exc).__name__}: {exc}")

    results = run_plan(steps, log_path, info.budget_s, str(ROOT), base_env or _base_env(info.commit),
                       snapshot=snapshot)
    info.finished = True
    problems = record(results, [], None, final=True)
    verdicts = verify_summary.stage_verdicts(results, [], None)
    say("; ".join(f"{stage} {verdict}" for stage, verdict in verdicts.items())
        + f" — {info.seconds:.0f} s; summary: {os.path.join(info.out_dir, 'summary.md')}")
    for problem in problems:
        say(f"results folder: {problem}")
    return 0 if all(r.status == "passed" for r in results) and not problems else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m tools.verify_gpu ({PROG})",
                                description=__doc__.split("\n\n")[0])
    how = p.add_mutually_exclusive_group()
    how.add_argument("--quick", action="store_true", help="the most telling subset, <= 3 minutes")
    how.add_argument("--lease", action="store_true",
                     help="one command for a 15-minute GPU lease (<= 570 s): the proofs first, then every "
                          "further step whose whole limit still fits")
    p.add_argument("--stage", default="", help="comma list of stages (env, tier, demo, bench, faults) or "
                                               "steps (tier.api): run only those, plus env")
    p.add_argument("--out", default="verify-gpu-out", help="results folder (default verify-gpu-out/)")
    p.add_argument("--budget", type=float, default=None,
                   help=f"overall seconds (default {BUDGET_S['full']:.0f}, --quick {BUDGET_S['quick']:.0f}, "
                        f"--lease {BUDGET_S['lease']:.0f})")
    p.add_argument("--list", action="store_true", help="print the plan (limits, estimates) and exit")
    p.add_argument("--allow-no-gpu", action="store_true", help=argparse.SUPPRESS)  # CPU tests of the runner
    return p


def main(argv: Optional[Sequence[str]] = None,
         steps_factory: Optional[Callable[[str, str], List[Step]]] = None) -> int:
    """``steps_factory(work, out)``, for tests, replaces the real plan."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    mode = "quick" if args.quick else "lease" if args.lease else "full"
    budget = args.budget if args.budget is not None else BUDGET_S[mode]
    if budget <= 0:
        print(f"{PROG}: error: --budget {budget:g}: must be positive", file=sys.stderr)
        return 2
    out = os.path.abspath(args.out)
    if args.list:
        steps = steps_factory("WORK", out) if steps_factory else plan(mode, sys.executable, "WORK", out)
        total = sum(s.estimate_s for s in steps)
        for s in steps:
            timing = TIMINGS.get(s.key)
            took = "measured" if timing is not None and timing.measured else "estimate"
            print(f"{s.key:<26} limit {s.limit_s:4.0f} s  {took} {s.estimate_s:3.0f} s  {shlex.join(s.argv[1:])}")
        print(f"{mode}: {total:.0f} s of a {budget:.0f} s budget by these times (measured on {MEASURED_ON})")
        return 0
    if not args.allow_no_gpu and find_gpu() is None:
        print(no_gpu_message(), file=sys.stderr)
        return 1
    work = tempfile.mkdtemp(prefix="verify-gpu-")
    try:
        prepare_out(out)
        steps = steps_factory(work, out) if steps_factory else plan(mode, sys.executable, work, out)
        names = [n.strip() for n in args.stage.split(",") if n.strip()]
        steps, not_selected = select(steps, names) if names else (steps, [])
    except ValueError as exc:
        shutil.rmtree(work, ignore_errors=True)
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    command = "make verify-gpu" + (f" VERIFY_ARGS={shlex.quote(' '.join(argv))}" if argv else "")
    info = verify_summary.RunInfo(
        command=command, mode=mode, budget_s=budget,
        started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        commit=_commit(), out_dir=out, work_dir=work, not_selected=not_selected)
    try:
        return execute(steps, info)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
