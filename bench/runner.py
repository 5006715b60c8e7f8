"""What each rank does: process groups, measurements, the sweep, the exit status.

Every rank builds one default group ``"cpu:gloo,cuda:cupycoll"``, a torch nccl group
(``new_group(backend="nccl")``) and a plain gloo group used only to coordinate (barriers,
summing the per-rank measurements). cupycoll's two algorithms run on the cupycoll group:
NCCL as the group's own algorithm (``Options(algorithm="nccl")``, the path a user's calls
take), the ring inside ``cupycoll.algorithm("ring")``.

For each point (collective, type, op, size, placement) the candidates run one after the
other on the same buffers, so drift hits them alike. For each candidate: one checked call
(inputs filled, outputs compared: #wrong), ``-w`` warm-up calls, ``-n`` timed calls between
two CUDA events (GPU time per call, like nccl-tests; with ``-C 1`` the host clock around
them and a final synchronize instead), then ``-n`` calls timed one by one on the host with
``perf_counter`` and no synchronization (host time per call, median). ``-m N`` makes each
timed iteration N calls in one coalescing block, ``-z 1`` synchronizes after every call.
``-N C`` runs the sizes of each type and op C times, as nccl-tests' cycles; each row then
names its ``cycle`` (1..C).
Where ranks share one GPU, a point below 16 MiB says ``time_sliced`` (its GPU time measures
the GPU's turns between the ranks: :func:`metrics.time_sliced`) and its table line is marked.
The ranks' times are combined as ``-a`` says (default: mean) and #wrong summed over the
gloo group; a candidate that fails on any rank is a status row on every rank
(:meth:`rank.Rank.agree`). Every rank ends with the same rows, and rank 0 prints and
writes them.

Left out: argument parsing (cli), starting processes (launch), the rank's coordination
(rank), the calls and buffers (calls), clocks (timing), metadata (meta), the scenarios
(scenarios), formatting (output), plotting (plot), result checking (checks).
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

import cupycoll  # registers the "cupycoll" backend for init_process_group

from . import catalog, checks, launch, metrics, output, scenarios
from .calls import (GROUP_ALGORITHM, PLACEMENTS, Buffers, Candidate, build_candidates, group_timeout,
                    make_buffers, make_call, ring_unsupported, torch_dtype)
from .meta import collect_meta, describe_time
from .rank import Rank
from .timing import Progress, Timer


# -- one measurement ------------------------------------------------------------------
def aggregated(call: Callable[[], None], calls: int, group, device) -> Callable[[], None]:
    """-m: ``calls`` calls as one iteration; on CUDA inside one coalescing block, which is
    one NCCL group as nccl-tests' ncclGroupStart/End."""
    if calls == 1:
        return call
    if device.type != "cuda":
        def repeated():
            for _ in range(calls):
                call()
        return repeated

    def grouped():
        with dist._coalescing_manager(group, device):
            for _ in range(calls):
                call()
    return grouped


def measure(ctx: Rank, cand: Candidate, collective: str, bufs: Buffers, dtype_name: str, op: str,
            root: int) -> Dict:
    """Check, warm up and time one candidate on one point; the same dict on every rank."""
    cfg = ctx.config
    reason = (catalog.static_unsupported(cand.name, collective, dtype_name, op, ctx.world)
              or ring_unsupported(cand.name, dtype_name, op))
    if op == "mulsum" and ctx.device.type != "cuda":
        reason = "gloo has no PreMulSum"
    if reason:
        return {"status": "n/a", "note": reason}
    call = make_call(collective, bufs, cand.group, op, root, ctx.rank, ctx.world)
    agg = cfg.agg_iters if collective != "sendrecv" else 1  # batch_isend_irecv is a group already
    step = aggregated(call, agg, cand.group, ctx.device)
    if cfg.blocking:
        unblocked = step

        def step():
            unblocked()
            ctx.timer.sync()
    wrong = None
    failure = None
    try:
        with cand.scope():
            if cfg.check:
                checks.prepare(collective, op, ctx.rank, ctx.world, root, bufs)
            call()
            ctx.timer.sync()
            if cfg.check:
                wrong = checks.count_wrong(collective, op, ctx.rank, ctx.world, root, bufs)
            if agg > 1:  # the grouped form fails here, before timing, if it fails at all
                step()
                ctx.timer.sync()
    except Exception as exc:  # noqa: BLE001 - reported in the table, the sweep goes on
        failure = exc
    failed = ctx.agree(failure)
    if failed is not None:
        return failed

    with cand.scope():
        for _ in range(cfg.warmup):
            step()
        ctx.timer.sync()
        ctx.barrier()
        if cfg.report_cputime:
            t0 = time.perf_counter()
            for _ in range(cfg.iters):
                step()
            ctx.timer.sync()
            time_us = (time.perf_counter() - t0) * 1e6 / cfg.iters
        else:
            time_us = ctx.timer.per_call(step, cfg.iters)
        time_us /= agg
        ctx.barrier()
        host = Timer.host(call, cfg.iters)
        ctx.timer.sync()
    host_us = metrics.median(host)
    times = ctx.combine([time_us, host_us], cfg.average)
    wrong_total = ctx.total([float(wrong or 0)])[0]
    return {"status": "ok", "time_us": times[0], "host_us": times[1],
            "wrong": int(wrong_total) if cfg.check else None}


def sweep_collective(ctx: Rank, collective: str) -> List[Dict]:
    cfg = ctx.config
    names = [c.name for c in ctx.candidates]
    placements = [p for p in cfg.placements if p in PLACEMENTS[collective]]
    if not placements:
        ctx.say(f"# {collective}: torch.distributed has only the {'/'.join(PLACEMENTS[collective])} "
                f"form; skipped (drop --inplace/--outofplace)")
        return []
    ops = cfg.ops if collective in catalog.REDUCING else ["none"]
    if collective not in catalog.ROOTED:
        roots = [-1]
    else:
        roots = list(range(ctx.world)) if cfg.all_roots else [cfg.root]
    side_by_side = cfg.format == "side-by-side"
    if side_by_side:
        for line in output.table_header(collective, names, cfg.baseline, ctx.world, ctx.transport,
                                        ctx.timer.description, cfg.report_cputime):
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
            for cycle in range(1, cfg.run_cycles + 1):
                for size in cfg.sizes:
                    lay = metrics.layout(collective, size, typesize, ctx.world)
                    if lay.count == 0:
                        skipped.append(size)
                        for _ in range(len(placements) * len(names) * len(roots)):
                            ctx.progress.update()
                        continue
                    for root in roots:
                        for placement in placements:
                            rows.extend(_point(ctx, collective, lay, dtype, dtype_name, op, root, placement,
                                               names, side_by_side, cycle if cfg.run_cycles > 1 else None))
    if skipped:
        ctx.say(f"# skipped {len(set(skipped))} size(s) below {ctx.world} ranks x 16 bytes: "
                "nothing to split")
    if not side_by_side:
        for line in output.nccl_tests_tables(collective, rows, names, ctx.world, ctx.transport,
                                             ctx.timer.description, PLACEMENTS[collective], cfg.check,
                                             cfg.report_cputime):
            ctx.say(line)
    for line in output.table_footer(rows, names, cfg.check, bandwidth=side_by_side):
        ctx.say(line)
    return rows


def _point(ctx: Rank, collective, lay, dtype, dtype_name, op, root, placement, names, say,
           cycle: Optional[int] = None) -> List[Dict]:
    """Every candidate on one point (one buffer set), as rows; the table line when ``say``.
    ``cycle``: the -N cycle, recorded only when there are several."""
    cfg = ctx.config
    bufs = make_buffers(collective, lay, dtype, ctx.device, placement, ctx.rank)
    point = {"kind": "sweep", "collective": collective, "size": lay.size, "count": lay.count,
             "type": dtype_name, "redop": op, "root": root, "placement": placement,
             "world_size": ctx.world}
    if cycle is not None:
        point["cycle"] = cycle
    cells = {}
    for cand in ctx.candidates:
        result = measure(ctx, cand, collective, bufs, dtype_name, op, max(root, 0))
        row = dict(point, candidate=cand.name, **result)
        if row["status"] == "ok":
            row["algbw_gbps"] = metrics.algbw(lay.size, row["time_us"])
            row["busbw_gbps"] = metrics.busbw(collective, lay.size, row["time_us"], ctx.world)
            if ctx.time_sliced(lay.size):
                row["time_sliced"] = True
        cells[cand.name] = row
        if ctx.progress:
            ctx.progress.update(f"{collective} {output.format_bytes(lay.size)} {cand.name}")
    base = cells.get(cfg.baseline)
    for row in cells.values():
        if row["status"] == "ok" and base is not None and base["status"] == "ok":
            row["speedup"] = metrics.speedup(base["time_us"], row["time_us"])
    if say:
        ctx.say(output.table_line(point, cells, names, cfg.baseline))
    return list(cells.values())


# -- the whole rank -------------------------------------------------------------------
def _count_points(cfg, world: int, candidates: int) -> int:
    total = 0
    for collective in cfg.collectives:
        places = len([p for p in cfg.placements if p in PLACEMENTS[collective]])
        ops = len(cfg.ops) if collective in catalog.REDUCING else 1
        roots = world if collective in catalog.ROOTED and cfg.all_roots else 1
        total += len(cfg.dtypes) * ops * cfg.run_cycles * len(cfg.sizes) * places * candidates * roots
    return total


def rank_main(cfg, plan: Optional[launch.Plan]) -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if plan is None:  # started by our launcher: it put the plan in the environment
        transport = os.environ.get(launch.TRANSPORT_ENV, "")
        index = int(os.environ.get(launch.DEVICE_ENV, "0"))
        shared = os.environ.get(launch.SHARED_ENV) == "1"
    else:  # under torchrun
        transport = plan.transport
        index = plan.devices[0] if plan.devices else 0
        shared = plan.shared
        if plan.shared:
            # Set before NCCL starts: NCCL refuses two ranks of one host on one GPU.
            os.environ.update(launch.share_gpu_env(rank))
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

    timeout = group_timeout(cfg)
    # No device_id: a bound default group would make new_group(backend="nccl") try to split
    # from cupycoll's communicator, which is not a ProcessGroupNCCL.
    dist.init_process_group("cpu:gloo,cuda:cupycoll", init_method="env://", rank=rank,
                            world_size=world, timeout=timeout,
                            pg_options=cupycoll.Options(algorithm=GROUP_ALGORITHM))
    # Coordination waits for the slowest rank's whole measurement: never shorter than 30 min.
    coord = dist.new_group(backend="gloo", timeout=max(timeout, datetime.timedelta(minutes=30)))
    candidates = build_candidates(cfg.candidates, timeout)
    timer = Timer(device)
    timer.description = describe_time(cfg, timer)
    ctx = Rank(cfg, rank, world, device, transport, coord, candidates, timer,
               shared_gpu=shared and device.type == "cuda")
    ctx.meta = collect_meta(ctx)
    for line in output.describe_meta(ctx.meta):
        ctx.say(line)
    ctx.save()

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
    measured = [r for r in ctx.rows if r.get("kind") in ("sweep", "scenario") and r.get("status") == "ok"]
    problem = None
    if not measured and not errors:
        problem = ("nothing was measured: every cell is n/a (see the reasons above); "
                   "change the backends, types, ops or collectives")
    elif wrong or errors:
        problem = f"{wrong} wrong values, {len(errors)} failed measurements"
    if problem and ctx.leader:  # said before any rank exits, so no rank is stopped mid-sentence
        print(f"cupycoll-bench: {problem}", file=sys.stderr, flush=True)
    ctx.barrier()
    dist.destroy_process_group()
    # Rank 0 alone reports the outcome (every rank saw the same rows), so that launchers
    # blame it, with its message, rather than whichever rank happened to exit first.
    return 1 if problem and ctx.leader else 0
