"""The command line: parse and validate the arguments, then hand over.

``cupycoll-bench [COLLECTIVE ...] [nccl-tests flags] [--backends ...] [--scenario ...]``
runs a benchmark; ``cupycoll-bench plot results.json --plot out.png`` draws a saved run.
Every mistake in the arguments (an unknown name, a bad size, no GPU, too few GPUs) ends
with one line on stderr and exit status 2, before any rank starts. This module imports
neither torch nor CuPy until the arguments are known to be good (the GPU check needs torch).

nccl-tests' flags keep their meaning (``-C`` reports CPU time in a column named
``cputime``, ``-T``/``--timeout`` bounds each collective, ``-N`` repeats the sweep and
prints every cycle, ``-a``/``-m``/``-z``, ``-r all``, ``-o mulsum``, ``-d f8e4m3``,
``-J``/``--output_file`` JSON), so that an nccl-tests command line runs unchanged.
The whole run's wall-clock limit, which nccl-tests lacks, is ``--run_timeout``.
Where they differ: ``-g N`` is N GPUs with one rank (one process) each, the world that one
nccl-tests process of one thread drives (default: every visible GPU; under torchrun each
rank has one GPU, so only 1); ``-t`` takes only 1, since torch.distributed runs one rank per
process; ``-G`` takes only 0 (no CUDA graphs: a replayed graph would skip the Python cupycoll
runs around every NCCL call); ``-N 0``, forever, is refused; ``--output_file`` writes JSON
or CSV by its suffix and refuses another one (nccl-tests writes JSON, and nothing for an
unknown suffix); ``-I``, per-iteration timing, is not offered; in-place vs out-of-place is
``--inplace`` / ``--outofplace`` (default: both, where the torch.distributed call has both
forms); ``-w`` defaults to 5 (Python backends create their communicators on the first
call); ``-d``/``-o`` take comma lists; ``-f`` may be fractional. Whatever can fail before
measuring (an output folder, ``--plot`` without matplotlib or with a format it cannot
write) fails here, not after the sweep.

Left out: what a rank does (runner, scenarios), process management (launch), output.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
from pathlib import Path
from typing import List, Optional, Tuple

from . import catalog, launch, sizes

PROG = "cupycoll-bench"
FORMATS = ("side-by-side", "nccl-tests")


def version_text() -> str:
    """The version of the cupycoll that the ranks would import (installed with this
    command, or beside it in a checkout), read from its ``_version.py`` without importing
    the package: ``cupycoll/__init__`` imports torch, which takes seconds."""
    found = importlib.util.find_spec("cupycoll")  # a top-level name: located, nothing run
    path = Path(found.origin).parent / "_version.py"
    loaded = importlib.util.spec_from_file_location("_cupycoll_version", path)
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    return f"{PROG} {module.__version__}"


class _Version(argparse.Action):
    """--version, read only when asked (argparse's own wants the text up front)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit()


class UsageError(Exception):
    """Bad input: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    # argparse prints the whole usage before its message; one line is what we promise.
    def error(self, message):  # noqa: D401
        raise UsageError(f"{message} (see {PROG} --help)")


@dataclasses.dataclass
class Config:
    """Validated settings, the same in the launcher and in every rank."""

    collectives: List[str]
    candidates: List[str]
    minbytes: int
    maxbytes: int
    stepfactor: float
    stepbytes: int
    sizes: List[int]
    dtypes: List[str]
    ops: List[str]
    iters: int
    warmup: int
    check: bool
    root: int
    all_roots: bool                # -r all: every rank in turn is the root
    report_cputime: bool           # -C 1: the time column is host time, as nccl-tests' -C
    run_cycles: int                # -N: the sweep runs this many times, each cycle printed
    average: int                   # -a: 0 rank 0, 1 mean, 2 min, 3 max over ranks
    agg_iters: int                 # -m: calls per timed iteration, issued as one group
    blocking: bool                 # -z 1: synchronize after every call
    format: str                    # "side-by-side" or "nccl-tests"
    placements: List[str]          # "out-of-place", "in-place"
    scenarios: List[str]
    store_ranks: List[int]         # --scenario store: the simulated world sizes
    store_skew: float              # ... the spread of the ranks' arrival at a creation, seconds
    store_idle: float              # ... the seconds an idle minute is measured over
    coalesce_bytes: int
    coalesce_ops: int
    scenario_iters: int
    overhead_calls: int
    json: Optional[str]
    csv: Optional[str]
    plot: Optional[str]
    device: str
    ranks: Optional[int]
    ngpus: Optional[int]
    share_gpu: bool
    run_timeout: float             # --run_timeout: seconds the whole run may take (0: no limit)
    coll_timeout: float            # -T/--timeout: seconds each collective may take (0: 30 min)
    progress: Optional[bool]
    command: str
    baseline: str


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG,
        description="Compare collective algorithms (cupycoll's NCCL path, cupycoll's ring) with "
                    "torch's nccl backend, side by side, in nccl-tests terms.",
        epilog="Examples: %(prog)s all_reduce -b 8 -e 128M -f 2 --plot ar.png ; "
               "%(prog)s all --ranks 2 -b 1K -e 1M -f 4 ; "
               "%(prog)s --scenario coalescing,overhead --json s.json ; "
               "%(prog)s plot results.json --plot results.png",
    )
    p.add_argument("collective", nargs="*",
                   help=f"collectives to sweep: {', '.join(catalog.COLLECTIVES)}, or all "
                        "(default: all_reduce unless --scenario is given)")
    p.add_argument("--collective", dest="collective_opt", action="append", default=[],
                   metavar="NAME", help="same as the positional argument (comma list, repeatable)")
    p.add_argument("--version", action=_Version, help="print the version and exit")
    p.add_argument("--backends", default=None,
                   help="comma list of candidates: cupycoll:nccl, cupycoll:ring, torch:nccl "
                        "(default: all three; torch:nccl is the baseline); with --device cpu: "
                        "cupycoll:gloo, torch:gloo")
    g = p.add_argument_group("nccl-tests flags")
    g.add_argument("-b", "--minbytes", default="32M", help="smallest size (default 32M; 8, 1K, 64M, 1G)")
    g.add_argument("-e", "--maxbytes", default="32M", help="largest size (default 32M)")
    g.add_argument("-f", "--stepfactor", default="1", help="multiply the size by this (default 1: use -i)")
    g.add_argument("-i", "--stepbytes", default="1M", help="add this many bytes when -f is 1 (default 1M)")
    g.add_argument("-d", "--datatype", default="float",
                   help="int8 uint8 int32 uint32 int64 uint64 half float double bfloat16, torch names "
                        "(float16, bf16, ...), f8e4m3 f8e5m2 (NCCL >= 2.24), a comma list, or all "
                        "(the ten classic types; default float)")
    g.add_argument("-o", "--op", default="sum",
                   help="sum prod min max avg mulsum, all, or band bor bxor (ring only); comma list "
                        "(default sum)")
    g.add_argument("-n", "--iters", default="20", help="timed iterations per point (default 20)")
    g.add_argument("-w", "--warmup_iters", default="5", help="warm-up iterations per point (default 5)")
    g.add_argument("-c", "--check", default="1", help="1: check every result (#wrong), 0: do not (default 1)")
    g.add_argument("-r", "--root", default="0",
                   help="root rank of broadcast and reduce, or all: every rank in turn (default 0)")
    g.add_argument("-C", "--report_cputime", default="0",
                   help="1: the time column is CPU time (host clock around the -n calls and the "
                        "final synchronize) instead of GPU time (default 0)")
    g.add_argument("-N", "--run_cycles", default="1",
                   help="run the sweep this many times, printing every cycle (default 1; nccl-tests' "
                        "0, forever, is not offered)")
    g.add_argument("-a", "--average", default="1",
                   help="times over ranks: 0 rank 0's, 1 the mean, 2 the minimum, 3 the maximum (default 1)")
    g.add_argument("-m", "--agg_iters", default="1",
                   help="calls per timed iteration, issued as one group (a coalescing block on CUDA); "
                        "times stay per call (default 1)")
    g.add_argument("-z", "--blocking", default="0", help="1: synchronize after every call (default 0)")
    g.add_argument("-t", "--nthreads", default="1",
                   help="threads per process: 1 only (one rank per process; more ranks: -g or --ranks)")
    g.add_argument("-G", "--cudagraph", default="0",
                   help="CUDA graph launches: 0 only (graph capture is not offered)")
    # nccl-tests spells -T --timeout, so a script written for nccl-tests gets its meaning;
    # --coll_timeout is kept for the scripts written while --timeout was the wall-clock guard.
    g.add_argument("-T", "--timeout", "--coll_timeout", dest="coll_timeout", default="0",
                   help="seconds each collective may take before the run fails (the groups' timeout: "
                        "cupycoll's watchdog, torch's nccl watchdog); default 0: 30 minutes")
    place = g.add_mutually_exclusive_group()
    place.add_argument("--inplace", action="store_true", help="only in-place calls")
    place.add_argument("--outofplace", action="store_true", help="only out-of-place calls")
    s = p.add_argument_group("scenarios")
    s.add_argument("--scenario", action="append", default=[],
                   help="coalescing, overhead, kernel, or all (comma list, repeatable); store "
                        "alone: the store calls cupycoll's ranks make, simulated on threads "
                        "against one TCPStore (no GPU), projected to 1,024 and 16,384 ranks")
    s.add_argument("--store-ranks", default="8,16,32,64",
                   help="store: the simulated world sizes (comma list, default 8,16,32,64)")
    s.add_argument("--store-skew", default="0.5",
                   help="store: seconds over which the ranks arrive at a creation (default 0.5)")
    s.add_argument("--store-idle", default="12",
                   help="store: seconds the idle load is measured over, scaled to a minute (default 12)")
    s.add_argument("--coalesce-bytes", default="512M",
                   help="coalescing: bytes of the flattened all_reduce; split into --coalesce-ops "
                        "tensors (default 512M; make it smaller for small GPUs or shared GPUs)")
    s.add_argument("--coalesce-ops", default="64", help="coalescing: number of all_reduce calls (default 64)")
    s.add_argument("--scenario-iters", default="30",
                   help="coalescing/overhead: timed iterations, medians reported (default 30)")
    s.add_argument("--overhead-calls", default="200",
                   help="overhead and coalescing: calls timed for the per-call host cost (default 200)")
    r = p.add_argument_group("ranks")
    r.add_argument("--ranks", default=None,
                   help="number of ranks; more than the GPUs shares them, each rank with its own NCCL_HOSTID")
    r.add_argument("-g", "--ngpus", default=None,
                   help="use this many GPUs, one rank each: nccl-tests' -g in one process (default: all "
                        "visible; under torchrun 1, each rank's own GPU)")
    r.add_argument("--share-gpu", action="store_true",
                   help="under torchrun: let several local ranks share a GPU (sets NCCL_HOSTID per rank)")
    r.add_argument("--run_timeout", default="0",
                   help="stop every rank after this many seconds of wall clock (default 0: never); "
                        "each collective's limit is -T/--timeout")
    r.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: development mode on gloo without a GPU (the numbers mean nothing)")
    o = p.add_argument_group("output")
    o.add_argument("--format", choices=FORMATS, default="side-by-side",
                   help="side-by-side (default): the candidates in one table; nccl-tests: one "
                        "nccl-tests table per candidate, out-of-place and in-place column groups")
    o.add_argument("-J", "--json", default=None, metavar="FILE", help="write metadata and every row as JSON")
    o.add_argument("-F", "--csv", default=None, metavar="FILE",
                   help="write every row as CSV (metadata as # lines)")
    o.add_argument("--output_file", default=None, metavar="FILE",
                   help="nccl-tests' name: -J for a .json file, -F for a .csv file")
    o.add_argument("--plot", default=None, metavar="FILE",
                   help="plot busbw and host time vs size (png, pdf, svg: what matplotlib writes)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.add_argument("--progress", action="store_true", help="a progress bar even when stderr is not a terminal")
    return p


def _int(text: str, flag: str, minimum: int = 0) -> int:
    try:
        value = int(str(text), 0)
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected a whole number") from None
    if value < minimum:
        raise UsageError(f"{flag} {text!r}: must be at least {minimum}")
    return value


def _float(text: str, flag: str, minimum: float = 0.0) -> float:
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected a number") from None
    if not value >= minimum:
        raise UsageError(f"{flag} {text!r}: must be at least {minimum:g}")
    return value


def _size(text: str, flag: str) -> int:
    try:
        return sizes.parse_size(text, flag)
    except sizes.SizeError as exc:
        raise UsageError(str(exc)) from None


def _output_path(path: Optional[str], flag: str) -> Optional[str]:
    if path is None:
        return None
    parent = Path(path).expanduser().resolve().parent
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: the folder {parent} does not exist")
    return str(Path(path).expanduser())


def _only(text: str, flag: str, allowed: int, why: str) -> int:
    """A nccl-tests flag of which one value has a meaning here: that value, else why not."""
    value = _int(text, flag, 0)
    if value != allowed:
        raise UsageError(f"{flag} {text}: {why}")
    return value


def _output_files(args) -> Tuple[Optional[str], Optional[str]]:
    """The JSON and CSV paths: -J, -F, and --output_file by its suffix (nccl-tests infers
    the format from the suffix; one it cannot write is refused, not silently skipped)."""
    paths = {"json": (args.json, "-J/--json"), "csv": (args.csv, "-F/--csv")}
    if args.output_file is not None:
        kind = Path(args.output_file).suffix.lower().lstrip(".")
        if kind not in paths:
            raise UsageError(f"--output_file {args.output_file}: the suffix names the format: .json or .csv")
        if paths[kind][0] is not None:
            raise UsageError(f"--output_file and {paths[kind][1]} both name the {kind.upper()} file; give one")
        paths[kind] = (args.output_file, "--output_file")
    return _output_path(*paths["json"]), _output_path(*paths["csv"])


def bench_extra_install(root: Path = launch.PACKAGE_ROOT) -> str:
    """How to install the bench extra for this copy of the command: from the checkout when
    its pyproject.toml is beside the package (``python -m bench``, an editable install),
    else from the package index (a regular install, where no checkout is at hand)."""
    if (root / "pyproject.toml").is_file():
        return f"pip install -e '.[bench]' in {root}"
    return "pip install 'cupycoll[bench]'"


def _flag(text: str, flag: str) -> bool:
    value = _int(text, flag, 0)
    if value > 1:
        raise UsageError(f"{flag} {text!r}: expected 0 or 1")
    return value == 1


def check_plot_output(path: Optional[str], flag: str) -> Optional[str]:
    """Fail now, not after the sweep: matplotlib missing, or a format it cannot write."""
    path = _output_path(path, flag)
    if path is None:
        return None
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UsageError(f"{flag} {path}: plotting needs matplotlib (pip install matplotlib, "
                         f"or the bench extra: {bench_extra_install()})") from None
    formats = Figure().canvas.get_supported_filetypes()
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in formats:
        raise UsageError(f"{flag} {path}: matplotlib cannot write {('.' + suffix) if suffix else 'a file without an extension'} "
                         f"(use one of: {', '.join('.' + f for f in sorted(formats))})")
    return path


def command_line(argv: List[str]) -> str:
    import shlex

    prog = "python -m bench" if __package__ == "bench" else PROG
    return " ".join([prog, *map(shlex.quote, argv)])


def parse(argv: List[str]) -> Config:
    """Parse and validate; raises :class:`UsageError` with a one-line message."""
    # Intermixed: "all_reduce -b 8 reduce" names two collectives, as a user would expect.
    args = build_parser().parse_intermixed_args(argv)
    try:
        names = list(args.collective) + list(args.collective_opt)
        scenarios: List[str] = []
        for item in args.scenario:
            scenarios += [s for s in catalog.resolve_scenarios(item) if s not in scenarios]
        collectives = catalog.resolve_collectives(",".join(names)) if names else (
            [] if scenarios else ["all_reduce"])
        device = args.device
        if args.backends is None:
            candidates = list(catalog.DEFAULT_CANDIDATES[device])
        else:
            candidates = catalog.resolve_candidates(args.backends, device)
        for name in candidates:
            if name not in catalog.ALLOWED_CANDIDATES[device]:
                raise UsageError(f"backend {name} does not run with --device {device} (choose from "
                                 f"{', '.join(catalog.ALLOWED_CANDIDATES[device])})")
        dtypes = catalog.resolve_dtypes(args.datatype)
        ops = catalog.resolve_ops(args.op)
    except catalog.NameError_ as exc:
        raise UsageError(str(exc)) from None

    minbytes = _size(args.minbytes, "-b/--minbytes")
    maxbytes = _size(args.maxbytes, "-e/--maxbytes")
    stepbytes = _size(args.stepbytes, "-i/--stepbytes")
    stepfactor = _float(args.stepfactor, "-f/--stepfactor", 1.0)
    try:
        sweep = sizes.sweep(minbytes, maxbytes, stepfactor, stepbytes)
    except sizes.SizeError as exc:
        raise UsageError(str(exc)) from None

    if args.inplace:
        placements = ["in-place"]
    elif args.outofplace:
        placements = ["out-of-place"]
    else:
        placements = ["out-of-place", "in-place"]

    coalesce_bytes = _size(args.coalesce_bytes, "--coalesce-bytes")
    coalesce_ops = _int(args.coalesce_ops, "--coalesce-ops", 1)
    if coalesce_bytes < coalesce_ops * 4:
        raise UsageError(f"--coalesce-bytes {args.coalesce_bytes}: needs at least 4 bytes (one float) "
                         f"for each of the {coalesce_ops} calls")
    all_roots = str(args.root).strip().lower() == "all"
    root = 0 if all_roots else _int(args.root, "-r/--root", 0)
    ranks = None if args.ranks is None else _int(args.ranks, "--ranks", 1)
    ngpus = None if args.ngpus is None else _int(args.ngpus, "-g/--ngpus", 1)
    if args.no_progress and args.progress:
        raise UsageError("--progress and --no-progress contradict each other")
    _only(args.nthreads, "-t/--nthreads", 1,
          "torch.distributed runs one rank per process, on one thread; for more ranks pass -g N "
          "(N GPUs) or --ranks N")
    _only(args.cudagraph, "-G/--cudagraph", 0,
          "CUDA graph capture is not offered: a replayed graph runs only the GPU work, without "
          "the Python cupycoll runs around every NCCL call, so its times would not be cupycoll's")
    run_cycles = _int(args.run_cycles, "-N/--run_cycles", 0)
    if run_cycles == 0:
        raise UsageError("-N/--run_cycles 0: running forever is not offered (every cycle's rows are "
                         "kept for the tables and files); give a number of cycles")
    json_path, csv_path = _output_files(args)
    store_ranks = [_int(part, "--store-ranks", 2) for part in str(args.store_ranks).split(",") if part.strip()]
    if "store" in scenarios and (len(scenarios) > 1 or names):
        raise UsageError("--scenario store runs alone, on the host (no GPU): give it without "
                         "collectives or other scenarios")
    if "store" in scenarios and len(store_ranks) < 2:
        raise UsageError(f"--store-ranks {args.store_ranks}: give at least two world sizes (the "
                         "projection fits a line through them)")

    return Config(
        collectives=collectives, candidates=candidates,
        minbytes=minbytes, maxbytes=maxbytes, stepfactor=stepfactor, stepbytes=stepbytes, sizes=sweep,
        dtypes=dtypes, ops=ops,
        iters=_int(args.iters, "-n/--iters", 1), warmup=_int(args.warmup_iters, "-w/--warmup_iters", 0),
        check=_int(args.check, "-c/--check", 0) > 0, root=root, all_roots=all_roots,
        report_cputime=_flag(args.report_cputime, "-C/--report_cputime"), run_cycles=run_cycles,
        average=_average(args.average), agg_iters=_int(args.agg_iters, "-m/--agg_iters", 1),
        blocking=_flag(args.blocking, "-z/--blocking"), format=args.format,
        placements=placements, scenarios=scenarios, store_ranks=store_ranks,
        store_skew=_float(args.store_skew, "--store-skew"), store_idle=_float(args.store_idle, "--store-idle", 1.0),
        coalesce_bytes=coalesce_bytes, coalesce_ops=coalesce_ops,
        scenario_iters=_int(args.scenario_iters, "--scenario-iters", 1),
        overhead_calls=_int(args.overhead_calls, "--overhead-calls", 1),
        json=json_path, csv=csv_path,
        plot=check_plot_output(args.plot, "--plot"),
        device=device, ranks=ranks, ngpus=ngpus, share_gpu=args.share_gpu,
        run_timeout=_float(args.run_timeout, "--run_timeout", 0.0),
        coll_timeout=_float(args.coll_timeout, "-T/--timeout", 0.0),
        progress=False if args.no_progress else (True if args.progress else None),
        command=command_line(argv), baseline=catalog.BASELINE[device],
    )


def _average(text: str) -> int:
    value = _int(text, "-a/--average", 0)
    if value > 3:
        raise UsageError(f"-a/--average {text!r}: expected 0 (rank 0), 1 (mean), 2 (min) or 3 (max)")
    return value


def parse_plot(argv: List[str]):
    p = _Parser(prog=f"{PROG} plot", description="Plot a saved --json result: busbw and host time vs size.")
    p.add_argument("results", help="a JSON file written by --json")
    # --plot, as in the main command; -o/--output kept for scripts written before.
    p.add_argument("--plot", "-o", "--output", dest="plot", default=None, metavar="FILE",
                   help="the image to write (default: the JSON's name with .png)")
    args = p.parse_args(argv)
    source = Path(args.results)
    if not source.is_file():
        raise UsageError(f"{args.results}: no such file")
    output = args.plot or str(source.with_suffix(".png"))
    return str(source), check_plot_output(output, "--plot")


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "plot":
            source, output = parse_plot(argv[1:])
            from . import output as out, plot

            try:
                document = out.read_json(source)
            except out.ResultsError as exc:
                raise UsageError(str(exc)) from None
            try:
                plot.plot_results(document, output)
            except plot.NothingToPlot as exc:
                raise UsageError(f"{source}: {exc}") from None
            print(f"wrote {output}")
            return 0
        config = parse(argv)
        if config.scenarios == ["store"]:  # the host alone: no GPU, no ranks spawned
            from . import store_load

            return store_load.run(config)
        if launch.is_worker() or launch.under_torchrun():
            if launch.under_torchrun() and config.ranks is not None:
                raise UsageError("--ranks does not apply under torchrun (it already started "
                                 f"WORLD_SIZE={os.environ['WORLD_SIZE']} ranks)")
            if launch.under_torchrun() and config.ngpus not in (None, 1):
                raise UsageError(f"-g/--ngpus {config.ngpus} does not apply under torchrun: each of its "
                                 f"WORLD_SIZE={os.environ['WORLD_SIZE']} ranks drives one GPU (-g 1)")
            if launch.is_worker():
                launch.bind_to_launcher()
                plan = None
            else:
                plan = launch.plan_torchrun(config.device, config.share_gpu)
            from . import runner

            return runner.rank_main(config, plan)
        plan = launch.plan_spawn(config.device, config.ranks, config.ngpus)
        if config.root >= plan.world:
            raise UsageError(f"-r/--root {config.root}: there are only {plan.world} ranks")
        if plan.shared:
            print(f"# note: {plan.note()}", flush=True)
        package = __package__ or "bench"
        return launch.spawn(plan, argv, package, config.run_timeout)
    except (UsageError, launch.LaunchError) as exc:  # bad input, no GPU, too few GPUs
        return _fail(str(exc))
