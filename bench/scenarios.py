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
the host). Medians over ``--scenario-iters`` iterations after warm-up. Then the targets:
coalesced CPU time <= 1.0x the baseline's, one-element CPU time <= 1.2x the baseline's,
coalesced GPU time within 5 % of the flattened all_reduce (<= 1.05x); each printed as PASS
or MISS, never dropped.

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
from .rank import Rank

TARGETS = (
    # (what, "cpu" or "gpu", case, limit): cupycoll's time over the baseline's, same case.
    ("coalesced sync: CPU time cupycoll / baseline", "cpu", "coalesced sync", 1.0),
    ("coalesced async: CPU time cupycoll / baseline", "cpu", "coalesced async", 1.0),
    ("1-element all_reduce sync: CPU per call cupycoll / baseline", "cpu", "1-element sync", 1.2),
    ("1-element all_reduce async: CPU per call cupycoll / baseline", "cpu", "1-element async", 1.2),
)
GPU_TARGET_LIMIT = 1.05


def count_steps(cfg, candidates) -> int:
    steps = 0
    for name in cfg.scenarios:
        if name == "coalescing":
            ours = catalog.CUPYCOLL[cfg.device]
            steps += 6 * len([c for c in candidates if c.name in (ours, cfg.baseline)])
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
    """GPU and CPU microseconds per iteration (medians, mean of ranks) of ``iteration``.

    ``finish`` receives what an iteration returned (e.g. an async Work) and completes it;
    it is outside the CPU timing but inside the GPU timing.
    """
    timer = ctx.timer
    try:
        with cand.scope():
            def whole():
                result = iteration()
                if finish is not None:
                    finish(result)
            for _ in range(max(1, warmup)):
                whole()
            timer.sync()
            ctx.barrier()
            gpu = timer.each(whole, iters)
            timer.sync()
            ctx.barrier()
            cpu = []
            pending = []
            for sample in timer.host(lambda: pending.append(iteration()), iters, sync_each=timer.sync):
                cpu.append(sample)
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
            r["gpu_ratio"] = r["gpu_us"] / base["gpu_us"] if base["gpu_us"] else None
            r["cpu_ratio"] = r["cpu_us"] / base["cpu_us"] if base["cpu_us"] else None


def _clock(ctx) -> str:
    """What the first time column measures: CUDA events on a GPU, the wall clock on CPU."""
    return "GPU" if ctx.device.type == "cuda" else "wall"


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

    def cases(cand):
        g = cand.group

        def coalesced_sync():
            with _coalescing(g, ctx.device, async_ops=False):
                for t in pieces:
                    dist.all_reduce(t, group=g)

        def coalesced_async():
            with _coalescing(g, ctx.device, async_ops=True) as cm:
                for t in pieces:
                    dist.all_reduce(t, group=g, async_op=True)
            return cm

        def uncoalesced():
            for t in pieces:
                dist.all_reduce(t, group=g)

        return [
            ("flat", lambda: dist.all_reduce(flat, group=g), None),
            ("coalesced sync", coalesced_sync, None),
            ("coalesced async", coalesced_async, lambda cm: cm.wait()),
            ("uncoalesced", uncoalesced, None),
        ] + _tiny_cases(ctx, g)

    rows = []
    names = [name for name, _, _ in cases(cands[0])]
    descriptions = {"flat": f"flat all_reduce {output.format_bytes(total * 4)}",
                    "coalesced sync": f"coalesced sync {label}", "coalesced async": f"coalesced async {label}",
                    "uncoalesced": f"uncoalesced {label}", "1-element sync": "1-element all_reduce sync",
                    "1-element async": "1-element all_reduce async_op=True"}
    for index, case in enumerate(names):
        for cand in cands:  # alternate the candidates case by case
            _, fn, finish = cases(cand)[index]
            tiny = case.startswith("1-element")
            iters = cfg.overhead_calls if tiny else cfg.scenario_iters
            result = _measure(ctx, cand, fn, iters, cfg.warmup, finish)
            rows.append({"kind": "scenario", "scenario": "coalescing", "case": case,
                         "candidate": cand.name, "world_size": ctx.world,
                         "note": descriptions[case], **result})
            ctx.progress.update(f"coalescing {case} {cand.name}")
    _ratios(rows, cfg.baseline)
    rows += _targets(rows, cfg.baseline, ours)
    lines = output.scenario_lines(f"coalescing ({ctx.world} ranks, {ctx.transport})", rows, cfg.baseline,
                                  _clock(ctx))
    lines.insert(2, f"# flat = one all_reduce of {output.format_bytes(total * 4)} float32; coalesced and "
                    f"uncoalesced = {label} all_reduce calls; 1-element: CPU time of one call")
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
    flat = _find(rows, candidate, "flat")
    for case in ("coalesced sync", "coalesced async"):
        ours = _find(rows, candidate, case)
        value = ours["gpu_us"] / flat["gpu_us"] if ours and flat and flat["gpu_us"] else None
        found.append(_target(f"{case}: GPU time cupycoll / its flat all_reduce", value, GPU_TARGET_LIMIT,
                             candidate))
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
            rows.append({"kind": "scenario", "scenario": "overhead", "case": case, "candidate": cand.name,
                         "world_size": ctx.world, **result})
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
