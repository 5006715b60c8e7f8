"""Scenarios beyond size sweeps: coalescing, per-call overhead, the ring kernels.

``coalescing`` compares cupycoll (its NCCL path; with ``--device cpu`` its CPU route) with
the baseline on the pattern DDP-like code produces: one flattened all_reduce of
``--coalesce-bytes``; the same bytes as ``--coalesce-ops`` all_reduce calls inside
``dist._coalescing_manager`` (synchronous, and ``async_ops=True`` followed by
``cm.wait()``); the same calls uncoalesced; and one-element
all_reduce calls, synchronous and ``async_op=True``. Each case is measured twice per
candidate, the candidates alternating case by case: GPU time per iteration (one CUDA event
pair per iteration, iterations back to back) and CPU time per iteration (the host time of
the calls, with the GPU drained before each iteration so that a full queue never blocks
the host). Medians over ``--scenario-iters`` iterations after warm-up. Beside them, the
same calls on :class:`calls.FrontOnlyGroup` (``torch front``: torch's Python front alone,
which every backend pays, host time only), and each candidate's own share: its CPU time
less the front's, with cupycoll's own share over the baseline's. Then the targets, on CPU
time: coalesced <= 1.2x the baseline's, a synchronous one-element all_reduce <= 1.0x, an
asynchronous one <= 1.2x; each printed as PASS or MISS, never dropped.

GPU times of ranks sharing one GPU are time slices below 16 MiB a call
(:func:`metrics.time_sliced`): such rows say ``time_sliced`` and are marked in the output.
No target is judged on a GPU time here.

``overhead`` times one-element all_reduce calls (sync and async) and FSDP's two calls
(all_gather_into_tensor and reduce_scatter_tensor, torch 2.13's all_gather_single and
reduce_scatter_single; sync, one element per rank) for every candidate.
``kernel`` runs :func:`ring_kernels.run` (the ring's reduction kernels against a
device-to-device copy) on rank 0 and shares its rows with every rank.

A case that fails on any rank is a status row on every rank (:meth:`rank.Rank.agree`, the
protocol the sweep uses too).

Left out: the sweep (runner), the rank's coordination (rank), formatting (output).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from cupycoll import compat

from . import catalog, metrics, output
from .calls import FrontOnlyGroup
from .rank import Rank

TARGETS = (
    # (what, "cpu", case, limit): cupycoll's CPU time over the baseline's, same case. None on
    # GPU time: at 1 rank a coalesced block's GPU time is its host time (NCCL has nothing to do
    # for one rank), and ranks sharing one GPU measure its time slices.
    ("coalesced sync: CPU time cupycoll / baseline", "cpu", "coalesced sync", 1.2),
    ("coalesced async: CPU time cupycoll / baseline", "cpu", "coalesced async", 1.2),
    ("1-element all_reduce sync: CPU per call cupycoll / baseline", "cpu", "1-element sync", 1.0),
    ("1-element all_reduce async: CPU per call cupycoll / baseline", "cpu", "1-element async", 1.2),
)
# The coalescing scenario's extra candidate: the same calls on a group that does nothing.
FRONT = "torch front"


def count_steps(cfg, candidates) -> int:
    steps = 0
    for name in cfg.scenarios:
        if name == "coalescing":
            ours = catalog.CUPYCOLL[cfg.device]
            measured = [c for c in candidates if c.name in (ours, cfg.baseline)]
            steps += len(COALESCING_CASES) * (len(measured) + 1) if measured else 0  # + the front
        elif name == "overhead":
            steps += len(OVERHEAD_CALLS) * len(candidates)
        else:
            steps += 1
    return steps


def run(ctx: Rank, name: str) -> List[Dict]:
    return {"coalescing": coalescing, "overhead": overhead, "kernel": kernel}[name](ctx)


# -- measuring one case ---------------------------------------------------------------
def _measure(ctx: Rank, cand, iteration: Callable[[], object], iters: int, warmup: int,
             finish: Optional[Callable[[object], None]] = None) -> Dict:
    """GPU and CPU microseconds per iteration (medians, mean of ranks) of ``iteration``;
    ``cand`` None: the calls run on a :class:`calls.FrontOnlyGroup`, CPU time alone (nothing
    runs on the GPU), clocked as a candidate's CPU time is.

    ``finish`` receives what an iteration returned (e.g. an async Work) and completes it;
    it is outside the CPU timing but inside the GPU timing.
    """
    timer = ctx.timer
    gpu = None
    try:
        with cand.scope() if cand is not None else contextlib.nullcontext():
            def whole():
                result = iteration()
                if finish is not None:
                    finish(result)
            for _ in range(max(1, warmup)):
                whole()
            timer.sync()
            ctx.barrier()
            if cand is not None:
                gpu = timer.each(whole, iters)
                timer.sync()
                ctx.barrier()
            # CPU time: the GPU drained before each iteration; what they returned is finished
            # afterwards, outside the timing.
            pending = []
            cpu = timer.host(lambda: pending.append(iteration()), iters, sync_each=timer.sync)
            if finish is not None:
                for result in pending:
                    finish(result)
            timer.sync()
        failure = None
    except Exception as exc:  # noqa: BLE001 - reported as a row
        failure = exc
    failed = ctx.agree(failure)
    if failed is not None:
        return failed
    if gpu is None:
        return {"status": "ok", "cpu_us": ctx.total([metrics.median(cpu)])[0] / ctx.world, "iterations": iters}
    sums = ctx.total([metrics.median(gpu), metrics.median(cpu)])
    return {"status": "ok", "gpu_us": sums[0] / ctx.world, "cpu_us": sums[1] / ctx.world,
            "iterations": iters}


def _ratios(rows: List[Dict], baseline: str) -> None:
    by_case = {}
    for r in rows:
        if r["status"] == "ok" and r["candidate"] == baseline:
            by_case[r["case"]] = r
    for r in rows:
        base = by_case.get(r["case"])
        if r["status"] == "ok" and base is not None:
            for field in ("gpu", "cpu"):
                mine, theirs = r.get(f"{field}_us"), base.get(f"{field}_us")
                if mine is not None:
                    r[f"{field}_ratio"] = mine / theirs if theirs else None


def _shares(rows: List[Dict], baseline: str) -> None:
    """Each candidate's own share of a case: its CPU time less the front's (``own_cpu_us``),
    and that over the baseline's own share (``own_ratio``)."""
    fronts = {r["case"]: r for r in rows if r["candidate"] == FRONT and r["status"] == "ok"}
    for r in rows:
        front = fronts.get(r["case"])
        if r["status"] == "ok" and front is not None and r["candidate"] != FRONT:
            r["own_cpu_us"] = r["cpu_us"] - front["cpu_us"]
    bases = {r["case"]: r for r in rows if r["candidate"] == baseline and "own_cpu_us" in r}
    for r in rows:
        base = bases.get(r["case"])
        if "own_cpu_us" in r and base is not None:
            r["own_ratio"] = r["own_cpu_us"] / base["own_cpu_us"] if base["own_cpu_us"] > 0 else None


def _clock(ctx) -> str:
    """What the first time column measures: CUDA events on a GPU, the wall clock on CPU."""
    return "GPU" if ctx.device.type == "cuda" else "wall"


def _scenario_row(ctx: Rank, scenario: str, case: str, candidate: str, result: Dict, size_bytes: int,
                  **extra) -> Dict:
    """One case's row; ``time_sliced`` where its GPU time measures the GPU's time slices."""
    row = {"kind": "scenario", "scenario": scenario, "case": case, "candidate": candidate,
           "world_size": ctx.world, **extra, **result}
    if result.get("status") == "ok" and result.get("gpu_us") is not None and ctx.time_sliced(size_bytes):
        row["time_sliced"] = True
    return row


def _tiny_cases(ctx, group, dtype=torch.float32):
    tiny = torch.zeros(1, dtype=dtype, device=ctx.device)
    return [
        ("1-element sync", lambda: dist.all_reduce(tiny, group=group), None),
        ("1-element async", lambda: dist.all_reduce(tiny, group=group, async_op=True), lambda w: w.wait()),
    ]


# The overhead scenario's cases: (the collective, for static_unsupported); _overhead_cases
# makes them in this order.
OVERHEAD_CALLS = ("all_reduce", "all_reduce", "all_gather", "reduce_scatter")


def _overhead_cases(ctx, group):
    """The one-element all_reduces, then FSDP's two calls on a one-element shard per rank."""
    shard = torch.zeros(1, dtype=torch.float32, device=ctx.device)
    whole = torch.zeros(ctx.world, dtype=torch.float32, device=ctx.device)
    return _tiny_cases(ctx, group) + [
        ("shard all_gather sync", lambda: compat.all_gather_single(whole, shard, group=group), None),
        ("shard reduce_scatter sync",
         lambda: compat.reduce_scatter_single(shard, whole, group=group), None),
    ]


# -- coalescing -----------------------------------------------------------------------
COALESCING_CASES = ("flat", "coalesced sync", "coalesced async", "uncoalesced", "1-element sync",
                    "1-element async")


@contextlib.contextmanager
def _coalescing(group, device, async_ops: bool):
    """``dist._coalescing_manager``, but a failure inside it does not leave torch thinking
    the group is still coalescing (every later async op would then return an IllegalWork)."""
    try:
        with dist._coalescing_manager(group, device, async_ops=async_ops) as cm:
            yield cm
    except BaseException:
        compat.forget_coalescing_manager(group)
        raise


def coalescing_cases(ctx, group, flat, pieces) -> List:
    """(case, iteration, finish) of every case of COALESCING_CASES, in that order, on ``group``."""
    def coalesced_sync():
        with _coalescing(group, ctx.device, async_ops=False):
            for t in pieces:
                dist.all_reduce(t, group=group)

    def coalesced_async():
        with _coalescing(group, ctx.device, async_ops=True) as cm:
            for t in pieces:
                dist.all_reduce(t, group=group, async_op=True)
        return cm

    def uncoalesced():
        for t in pieces:
            dist.all_reduce(t, group=group)

    return [
        ("flat", lambda: dist.all_reduce(flat, group=group), None),
        ("coalesced sync", coalesced_sync, None),
        ("coalesced async", coalesced_async, lambda cm: cm.wait()),
        ("uncoalesced", uncoalesced, None),
    ] + _tiny_cases(ctx, group)


def coalescing(ctx: Rank) -> List[Dict]:
    cfg = ctx.config
    ours = catalog.CUPYCOLL[cfg.device]
    cands = [c for c in ctx.candidates if c.name in (ours, cfg.baseline)]
    if not cands:
        ctx.say(f"# scenario coalescing: needs {ours} or {cfg.baseline} in --backends; skipped")
        return []
    ops = cfg.coalesce_ops
    per = cfg.coalesce_bytes // 4 // ops  # float32 elements per call
    total = per * ops
    flat = torch.zeros(total, dtype=torch.float32, device=ctx.device)
    # Separate allocations, not views of one buffer: cupycoll may fuse adjacent slices,
    # which real gradient tensors do not offer.
    pieces = [torch.zeros(per, dtype=torch.float32, device=ctx.device) for _ in range(ops)]
    label = f"{ops} x {output.format_bytes(per * 4)}"
    front = FrontOnlyGroup(ctx.rank, ctx.world)

    rows = []
    descriptions = {"flat": f"flat all_reduce {output.format_bytes(total * 4)}",
                    "coalesced sync": f"coalesced sync {label}", "coalesced async": f"coalesced async {label}",
                    "uncoalesced": f"uncoalesced {label}", "1-element sync": "1-element all_reduce sync",
                    "1-element async": "1-element all_reduce async_op=True"}
    sizes = {"flat": total * 4, "1-element sync": 4, "1-element async": 4}
    for index, case in enumerate(COALESCING_CASES):
        tiny = case.startswith("1-element")
        iters = cfg.overhead_calls if tiny else cfg.scenario_iters
        extra = {"note": descriptions[case], "parts": 1 if case in sizes else ops}
        for cand in cands:  # alternate the candidates case by case
            _, fn, finish = coalescing_cases(ctx, cand.group, flat, pieces)[index]
            result = _measure(ctx, cand, fn, iters, cfg.warmup, finish)
            rows.append(_scenario_row(ctx, "coalescing", case, cand.name, result, sizes.get(case, per * 4),
                                      **extra))
            ctx.progress.update(f"coalescing {case} {cand.name}")
        _, fn, finish = coalescing_cases(ctx, front, flat, pieces)[index]
        result = _measure(ctx, None, fn, iters, cfg.warmup, finish)
        rows.append(_scenario_row(ctx, "coalescing", case, FRONT, result, 0, **extra))
        ctx.progress.update(f"coalescing {case} {FRONT}")
    _ratios(rows, cfg.baseline)
    _shares(rows, cfg.baseline)
    rows += _targets(rows, cfg.baseline, ours)
    lines = output.scenario_lines(f"coalescing ({ctx.world} ranks, {ctx.transport})", rows, cfg.baseline,
                                  _clock(ctx))
    lines.insert(2, f"# flat = one all_reduce of {output.format_bytes(total * 4)} float32; coalesced and "
                    f"uncoalesced = {label} all_reduce calls; 1-element: CPU time of one call; {FRONT} = the "
                    "same calls on a group whose calls do nothing (torch's Python front alone, CPU time only)")
    for line in lines:
        ctx.say(line)
    return rows


def _find(rows, candidate, case) -> Optional[Dict]:
    for r in rows:
        if r.get("kind") == "scenario" and r["candidate"] == candidate and r["case"] == case and r["status"] == "ok":
            return r
    return None


def _target(name, value, limit, candidate) -> Dict:
    status = "n/a" if value is None else ("PASS" if value <= limit else "MISS")
    return {"kind": "target", "scenario": "coalescing", "target": name, "candidate": candidate,
            "value": value, "limit": limit, "status": status}


def _targets(rows: List[Dict], baseline: str, candidate: str = catalog.CUPYCOLL["cuda"]) -> List[Dict]:
    """The targets of ``candidate`` (cupycoll's path on this device) against ``baseline``."""
    found = []
    for name, field, case, limit in TARGETS:
        ours, base = _find(rows, candidate, case), _find(rows, baseline, case)
        value = None
        if ours and base and base[f"{field}_us"]:
            value = ours[f"{field}_us"] / base[f"{field}_us"]
        found.append(_target(name.replace("baseline", baseline), value, limit, candidate))
    return found


# -- overhead -------------------------------------------------------------------------
def overhead(ctx: Rank) -> List[Dict]:
    cfg = ctx.config
    rows = []
    for index, collective in enumerate(OVERHEAD_CALLS):
        for cand in ctx.candidates:
            case, fn, finish = _overhead_cases(ctx, cand.group)[index]
            reason = catalog.static_unsupported(cand.name, collective, "float", "sum", ctx.world)
            if reason:
                result = {"status": "n/a", "note": reason}
            else:
                result = _measure(ctx, cand, fn, cfg.overhead_calls, cfg.warmup, finish)
            rows.append(_scenario_row(ctx, "overhead", case, cand.name, result, 4 * ctx.world))
            ctx.progress.update(f"overhead {case} {cand.name}")
    _ratios(rows, cfg.baseline)
    for line in output.scenario_lines(f"overhead ({ctx.world} ranks, {ctx.transport}; "
                                      "CPU = host time of one call)", rows, cfg.baseline, _clock(ctx)):
        ctx.say(line)
    return rows


# -- ring kernels ---------------------------------------------------------------------
def kernel(ctx: Rank) -> List[Dict]:
    """Rank 0 runs :func:`ring_kernels.run`; every rank returns its rows."""
    rows: List[Dict] = []
    if ctx.leader:
        rows = _kernel_rows(ctx)
    ctx.progress.update("kernel")
    ctx.barrier()
    # Every rank keeps the same rows (the exit status looks at them).
    everyone = [None] * ctx.world
    dist.all_gather_object(everyone, rows, group=ctx.coord)
    return everyone[0]


def _kernel_rows(ctx: Rank) -> List[Dict]:
    base = {"kind": "scenario", "scenario": "kernel", "candidate": "cupycoll:ring", "world_size": 1}
    if ctx.device.type != "cuda":
        ctx.say("# scenario kernel: n/a (the ring kernels need a GPU)")
        return [dict(base, case="ring kernels", status="n/a", note="the ring kernels need a GPU")]
    from . import ring_kernels  # rank 0 on a GPU only

    cfg = ctx.config
    try:
        result = ring_kernels.run(device=ctx.device.index, verbose=False, iterations=cfg.scenario_iters,
                                  warmup=cfg.warmup)
    except Exception as exc:  # noqa: BLE001 - reported as a row
        ctx.say(f"# scenario kernel: ring_kernels failed: {exc}")
        return [dict(base, case="ring kernels", status="error", note=str(exc)[:200])]
    device = result["device"]
    rows = []
    ctx.say("#")
    ctx.say(f"# scenario kernel: ring reduction kernels vs a device-to-device copy on {device}")
    ctx.say(f"# {'case':<44} {'GPU us':>10} {'GB/s':>9} {'copy GB/s':>10} {'of copy':>8}")
    for r in result["rows"]:
        row = dict(base, status="ok", **r)
        row["case"] = f"{r['kernel']} {r['dtype']} {output.format_bytes(r['size_bytes'])}"
        row["gpu_us"] = r["seconds"] * 1e6
        row["device"] = device
        rows.append(row)
        share = f"{100 * r['ratio_to_copy']:.1f}%"
        ctx.say(f"  {row['case']:<44} {output.fmt_num(row['gpu_us'], 10, 1)} {output.fmt_num(r['gbps'], 9, 1)} "
                f"{output.fmt_num(r['copy_gbps'], 10, 1)} {share:>8}")
    return rows
