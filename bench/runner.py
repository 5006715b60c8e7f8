"""What each rank does: process groups, candidates, buffers, timing, the sweep, the output.

Every rank builds one default group ``"cpu:gloo,cuda:cupycoll"``, a torch nccl group
(``new_group(backend="nccl")``) and a plain gloo group used only to coordinate (barriers,
summing the per-rank measurements). cupycoll's two algorithms run on the cupycoll group
inside ``cupycoll.algorithm("nccl" | "ring")``; with a cupycoll that lacks that context
manager, each gets its own group created with ``cupycoll.Options(algorithm=...)`` instead.

For each point (collective, type, op, size, placement) the candidates run one after the
other on the same buffers, so drift hits them alike. For each candidate: one checked call
(inputs filled, outputs compared: #wrong), ``-w`` warm-up calls, ``-n`` timed calls between
two CUDA events (GPU time per call, like nccl-tests), then ``-n`` calls timed one by one on
the host with ``perf_counter`` and no synchronization (host time per call, median). The
ranks' numbers are averaged (times) or summed (#wrong) over the gloo group, like
nccl-tests' default ``-a 1``; every rank ends with the same rows, and rank 0 prints and
writes them.

Left out: argument parsing (cli), starting processes (launch), the scenarios (scenarios),
formatting (output), plotting (plot), result checking (checks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import socket
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from . import catalog, checks, launch, metrics, output

# Where the torch.distributed call has each form; the others have no such call.
PLACEMENTS = {
    "all_reduce": ("in-place",), "broadcast": ("in-place",), "reduce": ("in-place",),
    "all_gather": ("out-of-place", "in-place"), "reduce_scatter": ("out-of-place", "in-place"),
    "all_to_all": ("out-of-place",), "sendrecv": ("out-of-place",),
}
# torch 2.13 renamed the tensor-in/tensor-out forms (the old names warn there).
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
COMMIT_ENV = "CUPYCOLL_BENCH_GIT_COMMIT"  # the commit to record where git cannot tell
# Exceptions that mean "this candidate does not do that" rather than "it broke".
_UNSUPPORTED = (NotImplementedError, TypeError, ValueError)


# -- candidates -------------------------------------------------------------------------
@dataclasses.dataclass
class Candidate:
    spec: catalog.CandidateSpec
    group: object
    scope: Callable[[], contextlib.AbstractContextManager]

    @property
    def name(self) -> str:
        return self.spec.name


def reduce_op(name: str):
    return {
        "sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN, "avg": dist.ReduceOp.AVG, "band": dist.ReduceOp.BAND,
        "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR,
    }[name]


def torch_dtype(name: str) -> torch.dtype:
    attr = catalog.DTYPES[name][0]
    dtype = getattr(torch, attr, None)
    if dtype is None:
        raise TypeError(f"this torch ({torch.__version__}) has no torch.{attr}")
    return dtype


def algorithm_selection(cupycoll_module) -> str:
    if callable(getattr(cupycoll_module, "algorithm", None)):
        return "cupycoll.algorithm() context on one cupycoll group"
    return "one cupycoll group per algorithm (cupycoll.Options(algorithm=...))"


def build_candidates(names: List[str], cupycoll_module) -> List[Candidate]:
    """Create the groups in one fixed order (every rank must create the same groups)."""
    picked = []
    use_context = callable(getattr(cupycoll_module, "algorithm", None))
    for name in names:
        spec = catalog.CANDIDATES[name]
        if spec.library == "cupycoll":
            if use_context:
                group = dist.group.WORLD
                scope = (lambda alg=spec.algorithm: cupycoll_module.algorithm(alg))
            else:
                group = dist.new_group(backend="cupycoll",
                                       pg_options=cupycoll_module.Options(algorithm=spec.algorithm))
                scope = contextlib.nullcontext
        else:
            group = dist.new_group(backend=spec.algorithm)
            scope = contextlib.nullcontext
        picked.append(Candidate(spec, group, scope))
    return picked


def ring_unsupported(candidate: str, dtype_name: str, op: str) -> str:
    """Why the ring cannot reduce this pair ("" if it can, or if cupycoll cannot say).

    Asked up front because under ``algorithm("ring")`` an unsupported pair might quietly
    run on NCCL, and the table would then credit the ring with NCCL's numbers."""
    if candidate != "cupycoll:ring":
        return ""
    try:
        from cupycoll import ring
    except Exception:  # noqa: BLE001 - an older cupycoll: let the call decide
        return ""
    name = catalog.DTYPES[dtype_name][0]
    ring_op = {"prod": "product"}.get(op, op)
    if ring.supports(name, ring_op):
        return ""
    return f"the ring does not reduce {dtype_name} with {op}"


# -- buffers and calls ----------------------------------------------------------------
@dataclasses.dataclass
class Buffers:
    send: torch.Tensor
    recv: torch.Tensor
    count: int          # nccl-tests' count (per rank for the split collectives)
    in_place: bool


def make_buffers(collective: str, lay: metrics.Layout, dtype: torch.dtype, device, placement: str,
                 rank: int) -> Buffers:
    in_place = placement == "in-place"
    c = lay.count
    if collective in ("all_reduce", "broadcast", "reduce"):
        buf = torch.empty(lay.send_count, dtype=dtype, device=device)
        return Buffers(buf, buf, c, True)
    if in_place and collective == "all_gather":
        recv = torch.empty(lay.recv_count, dtype=dtype, device=device)
        return Buffers(recv[rank * c:(rank + 1) * c], recv, c, True)
    if in_place and collective == "reduce_scatter":
        send = torch.empty(lay.send_count, dtype=dtype, device=device)
        return Buffers(send, send[rank * c:(rank + 1) * c], c, True)
    send = torch.empty(lay.send_count, dtype=dtype, device=device)
    recv = torch.empty(lay.recv_count, dtype=dtype, device=device)
    return Buffers(send, recv, c, False)


def make_call(collective: str, bufs: Buffers, group, op: str, root: int, rank: int, world: int):
    """A no-argument function issuing the collective once (synchronous form)."""
    red = reduce_op(op) if collective in catalog.REDUCING else None
    if collective == "all_reduce":
        return lambda: dist.all_reduce(bufs.recv, op=red, group=group)
    if collective == "broadcast":
        return lambda: dist.broadcast(bufs.recv, src=root, group=group)
    if collective == "reduce":
        return lambda: dist.reduce(bufs.recv, dst=root, op=red, group=group)
    if collective == "all_gather":
        return lambda: _ALL_GATHER(bufs.recv, bufs.send, group=group)
    if collective == "reduce_scatter":
        return lambda: _REDUCE_SCATTER(bufs.recv, bufs.send, op=red, group=group)
    if collective == "all_to_all":
        return lambda: dist.all_to_all_single(bufs.recv, bufs.send, group=group)
    if collective == "sendrecv":
        nxt, prv = (rank + 1) % world, (rank - 1) % world

        def ring_exchange():
            ops = [dist.P2POp(dist.isend, bufs.send, nxt, group), dist.P2POp(dist.irecv, bufs.recv, prv, group)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return ring_exchange
    raise ValueError(collective)


# -- timing ---------------------------------------------------------------------------
class Timer:
    """GPU time with CUDA events (cuda), wall time around synchronous calls (cpu)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.description = ("GPU time per call (CUDA events around the -n calls, mean of ranks)"
                            if self.cuda else "wall time per call (CPU development mode)")

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def per_call(self, fn: Callable[[], None], iters: int) -> float:
        """Microseconds per call over ``iters`` back-to-back calls."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) * 1e3 / iters
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) * 1e6 / iters

    def each(self, fn: Callable[[], None], iters: int) -> List[float]:
        """Microseconds of each of ``iters`` back-to-back calls (one event pair per call)."""
        if not self.cuda:
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
            return times
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(iters)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        events[-1][1].synchronize()
        return [start.elapsed_time(end) * 1e3 for start, end in events]

    @staticmethod
    def host(fn: Callable[[], object], calls: int, sync_each: Optional[Callable[[], None]] = None) -> List[float]:
        """Host microseconds of each call: perf_counter around the call only."""
        times = []
        for _ in range(calls):
            if sync_each is not None:
                sync_each()
            t0 = time.perf_counter_ns()
            fn()
            times.append((time.perf_counter_ns() - t0) / 1e3)
        return times


# -- the rank's context ---------------------------------------------------------------
class Progress:
    """A tqdm bar on stderr on rank 0 (none elsewhere, or without tqdm)."""

    def __init__(self, enabled: Optional[bool], total: int, active: bool):
        self.bar = None
        if not active or enabled is False or total <= 0:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        # disable=None: tqdm shows the bar only on a terminal, unless --progress forces it.
        self.bar = tqdm(total=total, file=sys.stderr, unit="pt", dynamic_ncols=True, leave=False,
                        disable=None if enabled is None else False)

    def update(self, text: str = "") -> None:
        if self.bar is not None:
            if text:
                self.bar.set_description_str(text, refresh=False)
            self.bar.update(1)

    def write(self, line: str) -> None:
        if self.bar is not None and not self.bar.disable:
            self.bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


@dataclasses.dataclass
class Rank:
    config: object
    rank: int
    world: int
    device: torch.device
    transport: str
    coord: object                 # plain gloo group: barriers and summaries
    candidates: List[Candidate]
    timer: Timer
    progress: Optional[Progress] = None
    rows: List[Dict] = dataclasses.field(default_factory=list)
    meta: Dict = dataclasses.field(default_factory=dict)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def say(self, line: str) -> None:
        if self.leader:
            (self.progress.write if self.progress else print)(line)

    def barrier(self) -> None:
        dist.barrier(group=self.coord)

    def total(self, values: List[float]) -> List[float]:
        """Sum over ranks (float64, through gloo)."""
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, group=self.coord)
        return t.tolist()

    def most(self, values: List[float]) -> List[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.coord)
        return t.tolist()

    def save(self) -> None:
        """Write the files asked for (rank 0); called after every collective and scenario,
        so a run that dies later still leaves what it measured."""
        if not self.leader:
            return
        if self.config.json:
            output.write_json(self.config.json, self.meta, self.rows)
        if self.config.csv:
            output.write_csv(self.config.csv, self.meta, self.rows)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:160]


def agree(ctx: Rank, exc: Optional[BaseException]):
    """Did the step fail on any rank? Returns (status, note) or None when it worked everywhere."""
    unsupported = exc is not None and _is_unsupported(exc)
    codes = ctx.most([0.0 if exc is None else (1.0 if unsupported else 2.0)])
    if codes[0] == 0:
        return None
    status = "n/a" if codes[0] == 1 else "error"
    note = _first_line(exc) if exc is not None else "failed on another rank"
    return status, note


def _is_unsupported(exc: BaseException) -> bool:
    try:
        import cupycoll

        if isinstance(exc, (cupycoll.CupycollTypeError, cupycoll.CupycollValueError)):
            return True
    except ImportError:
        pass
    if isinstance(exc, RuntimeError):
        # torch's own way of saying a backend lacks a feature.
        text = str(exc).lower()
        return any(phrase in text for phrase in (
            "does not implement", "not implemented for", "not supported", "unsupported",
            "unconvertible"))
    return isinstance(exc, _UNSUPPORTED)


# -- one measurement ------------------------------------------------------------------
def measure(ctx: Rank, cand: Candidate, collective: str, bufs: Buffers, dtype_name: str, op: str) -> Dict:
    """Check, warm up and time one candidate on one point; the same dict on every rank."""
    cfg = ctx.config
    reason = (catalog.static_unsupported(cand.name, collective, dtype_name, op, ctx.world)
              or ring_unsupported(cand.name, dtype_name, op))
    if reason:
        return {"status": "n/a", "note": reason}
    call = make_call(collective, bufs, cand.group, op, cfg.root, ctx.rank, ctx.world)
    wrong = None
    failure = None
    try:
        with cand.scope():
            if cfg.check:
                checks.prepare(collective, op, ctx.rank, ctx.world, cfg.root, bufs)
            call()
            ctx.timer.sync()
            if cfg.check:
                wrong = checks.count_wrong(collective, op, ctx.rank, ctx.world, cfg.root, bufs)
    except Exception as exc:  # noqa: BLE001 - reported in the table, the sweep goes on
        failure = exc
    verdict = agree(ctx, failure)
    if verdict is not None:
        return {"status": verdict[0], "note": verdict[1]}

    with cand.scope():
        for _ in range(cfg.warmup):
            call()
        ctx.timer.sync()
        ctx.barrier()
        gpu_us = ctx.timer.per_call(call, cfg.iters)
        ctx.barrier()
        host = Timer.host(call, cfg.iters)
        ctx.timer.sync()
    host_us = metrics.median(host)
    sums = ctx.total([gpu_us, host_us, float(wrong or 0)])
    return {"status": "ok", "time_us": sums[0] / ctx.world, "host_us": sums[1] / ctx.world,
            "wrong": int(sums[2]) if cfg.check else None}


def sweep_collective(ctx: Rank, collective: str) -> List[Dict]:
    cfg = ctx.config
    names = [c.name for c in ctx.candidates]
    placements = [p for p in cfg.placements if p in PLACEMENTS[collective]]
    if not placements:
        ctx.say(f"# {collective}: torch.distributed has only the {'/'.join(PLACEMENTS[collective])} "
                f"form; skipped (drop --inplace/--outofplace)")
        return []
    ops = cfg.ops if collective in catalog.REDUCING else ["none"]
    root = cfg.root if collective in catalog.ROOTED else -1
    for line in output.table_header(collective, names, cfg.baseline, ctx.world, ctx.transport,
                                    ctx.timer.description):
        ctx.say(line)
    rows: List[Dict] = []
    skipped = []
    for dtype_name in cfg.dtypes:
        typesize = catalog.DTYPES[dtype_name][1]
        try:
            dtype = torch_dtype(dtype_name)
        except TypeError as exc:
            ctx.say(f"# {collective} {dtype_name}: {exc}")
            continue
        for op in ops:
            for size in cfg.sizes:
                lay = metrics.layout(collective, size, typesize, ctx.world)
                if lay.count == 0:
                    skipped.append(size)
                    for _ in range(len(placements) * len(names)):
                        ctx.progress.update()
                    continue
                for placement in placements:
                    bufs = make_buffers(collective, lay, dtype, ctx.device, placement, ctx.rank)
                    point = {"kind": "sweep", "collective": collective, "size": lay.size, "count": lay.count,
                             "type": dtype_name, "redop": op, "root": root, "placement": placement,
                             "world_size": ctx.world}
                    cells = {}
                    for cand in ctx.candidates:
                        result = measure(ctx, cand, collective, bufs, dtype_name, op)
                        row = dict(point, candidate=cand.name, **result)
                        if row["status"] == "ok":
                            row["algbw_gbps"] = metrics.algbw(lay.size, row["time_us"])
                            row["busbw_gbps"] = metrics.busbw(collective, lay.size, row["time_us"], ctx.world)
                        cells[cand.name] = row
                        if ctx.progress:
                            ctx.progress.update(f"{collective} {output.format_bytes(lay.size)} {cand.name}")
                    base = cells.get(cfg.baseline)
                    for row in cells.values():
                        if row["status"] == "ok" and base is not None and base["status"] == "ok":
                            row["speedup"] = metrics.speedup(base["time_us"], row["time_us"])
                    rows.extend(cells.values())
                    ctx.say(output.table_line(point, cells, names, cfg.baseline))
                    del bufs
    if skipped:
        ctx.say(f"# skipped {len(set(skipped))} size(s) below {ctx.world} ranks x 16 bytes: "
                "nothing to split")
    for line in output.table_footer(rows, names):
        ctx.say(line)
    return rows


# -- metadata -------------------------------------------------------------------------
def _git(*args: str) -> Optional[str]:
    try:
        out = subprocess.run(["git", "-C", str(launch.PACKAGE_ROOT), *args], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _driver_version() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def _nccl_text(code) -> str:
    if isinstance(code, tuple):
        return ".".join(map(str, code))
    code = int(code)
    if code >= 10000:  # NCCL >= 2.9 encodes major*10000 + minor*100 + patch
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"


def collect_meta(ctx: Rank, cupycoll_module) -> Dict:
    cfg = ctx.config
    me = {"rank": ctx.rank, "pid": os.getpid(), "host": socket.gethostname(),
          "device": str(ctx.device), "device_name": "cpu",
          "nccl_hostid": os.environ.get("NCCL_HOSTID", "")}
    if ctx.device.type == "cuda":
        me["device_name"] = torch.cuda.get_device_name(ctx.device)
    everyone: List[Dict] = [None] * ctx.world  # type: ignore[list-item]
    dist.all_gather_object(everyone, me, group=ctx.coord)
    if not ctx.leader:
        return {}
    meta = {
        "tool": "cupycoll-bench", "schema": output.SCHEMA,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": cfg.command,
        # A copy of the tree without .git (e.g. on a lent GPU machine) can be told its commit.
        "git_commit": _git("rev-parse", "HEAD") or os.environ.get(COMMIT_ENV) or "unknown",
        "git_dirty": (None if _git("rev-parse", "HEAD") is None
                      else bool(_git("status", "--porcelain", "--untracked-files=no"))),
        "world_size": ctx.world, "transport": ctx.transport,
        "gpu": me["device_name"], "gpus_visible": torch.cuda.device_count() if ctx.device.type == "cuda" else 0,
        "driver_version": _driver_version() if ctx.device.type == "cuda" else "n/a",
        "torch": torch.__version__, "torch_cuda": torch.version.cuda or "none",
        "torch_nccl": "n/a", "cupy": "not installed", "cupy_nccl": "n/a",
        "cupycoll": getattr(cupycoll_module, "__version__", "unknown"),
        "algorithm_selection": algorithm_selection(cupycoll_module),
        "candidates": [c.name for c in ctx.candidates], "baseline": cfg.baseline,
        "timer": ctx.timer.description,
        "host_time": "median over -n calls of perf_counter around one call (no synchronization), mean of ranks",
        "speedup": output.SPEEDUP_HELP.format(base=cfg.baseline),
        "sizes": cfg.sizes, "dtypes": cfg.dtypes, "ops": cfg.ops, "iters": cfg.iters,
        "warmup_iters": cfg.warmup, "check": cfg.check, "root": cfg.root, "placements": cfg.placements,
        "ranks": everyone,
    }
    if ctx.device.type == "cuda":
        try:
            meta["torch_nccl"] = _nccl_text(torch.cuda.nccl.version())
        except Exception:  # noqa: BLE001 - metadata is best effort
            pass
    try:
        import cupy

        meta["cupy"] = cupy.__version__
        if ctx.device.type == "cuda":
            from cupy.cuda import nccl

            meta["cupy_nccl"] = _nccl_text(nccl.get_version())
    except Exception:  # noqa: BLE001
        pass
    return meta


# -- the whole rank -------------------------------------------------------------------
def _count_points(cfg, world: int, candidates: int) -> int:
    total = 0
    for collective in cfg.collectives:
        places = len([p for p in cfg.placements if p in PLACEMENTS[collective]])
        ops = len(cfg.ops) if collective in catalog.REDUCING else 1
        total += len(cfg.dtypes) * ops * len(cfg.sizes) * places * candidates
    return total


def rank_main(cfg, plan: Optional[launch.Plan]) -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if plan is None:  # started by our launcher: it put the plan in the environment
        transport = os.environ.get(launch.TRANSPORT_ENV, "")
        index = int(os.environ.get(launch.DEVICE_ENV, "0"))
    else:  # under torchrun
        transport = plan.transport
        index = plan.devices[0] if plan.devices else 0
        if plan.shared:
            # Set before NCCL starts: NCCL refuses two ranks of one host on one GPU.
            os.environ["NCCL_HOSTID"] = launch.hostid_for(rank)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        if cfg.root >= world:
            if rank == 0:
                print(f"cupycoll-bench: error: -r/--root {cfg.root}: there are only {world} ranks",
                      file=sys.stderr)
            return 2
    if cfg.device == "cuda":
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    import cupycoll  # registers the "cupycoll" backend

    timeout = datetime.timedelta(seconds=max(1800.0, cfg.timeout))
    # No device_id: a bound default group would make new_group(backend="nccl") try to split
    # from cupycoll's communicator, which is not a ProcessGroupNCCL.
    dist.init_process_group("cpu:gloo,cuda:cupycoll", init_method="env://", rank=rank,
                            world_size=world, timeout=timeout)
    coord = dist.new_group(backend="gloo", timeout=timeout)
    candidates = build_candidates(cfg.candidates, cupycoll)
    ctx = Rank(cfg, rank, world, device, transport, coord, candidates, Timer(device))
    ctx.meta = collect_meta(ctx, cupycoll)
    for line in output.describe_meta(ctx.meta):
        ctx.say(line)
    ctx.save()

    from . import scenarios

    total = _count_points(cfg, world, len(candidates)) + scenarios.count_steps(cfg, candidates)
    ctx.progress = Progress(cfg.progress, total, ctx.leader)
    try:
        for collective in cfg.collectives:
            ctx.rows.extend(sweep_collective(ctx, collective))
            ctx.save()
        for name in cfg.scenarios:
            ctx.rows.extend(scenarios.run(ctx, name))
            ctx.save()
    finally:
        ctx.progress.close()

    if ctx.leader:
        if cfg.plot:
            from . import plot

            try:
                plot.plot_results({"meta": ctx.meta, "rows": ctx.rows}, cfg.plot)
            except plot.NothingToPlot as exc:
                print(f"# no plot: {exc}")
        for path in (cfg.json, cfg.csv, cfg.plot):
            if path and os.path.exists(path):
                print(f"# wrote {output.describe_file(path)}")
    wrong = sum(r.get("wrong") or 0 for r in ctx.rows if r.get("kind") == "sweep")
    errors = [r for r in ctx.rows if r.get("status") == "error"]
    ctx.barrier()
    dist.destroy_process_group()
    if wrong or errors:
        if ctx.leader:
            print(f"cupycoll-bench: {wrong} wrong values, {len(errors)} failed measurements", file=sys.stderr)
        return 1
    return 0
