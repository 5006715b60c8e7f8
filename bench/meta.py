"""What a run records about itself: versions, GPU, driver, commit, settings; and what
its time column means.

Left out: measuring (runner), writing the files (output).
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

import cupycoll
from cupycoll import config as cupycoll_config
from cupycoll.nccl import header as nccl_header
from cupycoll.ring import schedule as ring_schedule

from . import gpu_info, launch, output
from .calls import GROUP_ALGORITHM, group_timeout
from .timing import Timer

COMMIT_ENV = "CUPYCOLL_BENCH_GIT_COMMIT"  # the commit to record where git cannot tell
AVERAGES = {0: "rank 0's value", 1: "mean", 2: "minimum", 3: "maximum"}  # -a


def describe_time(cfg, timer: Timer) -> str:
    """What the time column holds, for the table header and the metadata."""
    if cfg.report_cputime:
        what = "CPU time per call (host clock around the -n calls and a final synchronize)"
    else:
        what = timer.description.split(",")[0].split(" (")[0]
        what += " (CUDA events around the -n calls)" if timer.cuda else " (CPU development mode)"
    extra = [f"-m {cfg.agg_iters} calls per group"] if cfg.agg_iters > 1 else []
    extra += ["-z 1: synchronized after each call"] if cfg.blocking else []
    return f"{what}, {AVERAGES[cfg.average]} of ranks" + "".join(f"; {e}" for e in extra)


def _git(*args: str) -> Optional[str]:
    try:
        out = subprocess.run(["git", "-C", str(launch.PACKAGE_ROOT), *args], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _driver_version() -> str:
    try:
        return gpu_info.gpus(timeout=20)[0].driver
    except gpu_info.GpuInfoUnavailable:
        return "unknown"


def ring_scratch(candidates) -> str:
    """The ring's scratch policy and limit as the run's cupycoll group has it (its settings
    come from the environment: the benchmark passes no Options), or why there is none."""
    if "cupycoll:ring" not in candidates:
        return "not used (no cupycoll:ring candidate)"
    limit = cupycoll_config.resolve(None).ring_scratch_bytes
    return f"{ring_schedule.describe_scratch(limit)} (CUPYCOLL_RING_SCRATCH_BYTES)"


def collect_meta(ctx) -> Dict:
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
        "world_size": ctx.world, "transport": ctx.transport, "shared_gpu": ctx.shared_gpu,
        "gpu": me["device_name"], "gpus_visible": torch.cuda.device_count() if ctx.device.type == "cuda" else 0,
        "driver_version": _driver_version() if ctx.device.type == "cuda" else "n/a",
        "torch": torch.__version__, "torch_cuda": torch.version.cuda or "none",
        "torch_nccl": "n/a", "cupy": "not installed", "cupy_nccl": "n/a",
        "cupycoll": cupycoll.__version__,
        "algorithm_selection": (f"one cupycoll group, Options(algorithm={GROUP_ALGORITHM!r}); "
                                "the other algorithms under cupycoll.algorithm()"),
        "ring_scratch": ring_scratch([c.name for c in ctx.candidates]),
        "candidates": [c.name for c in ctx.candidates], "baseline": cfg.baseline,
        "timer": ctx.timer.description,
        "host_time": "median over -n calls of perf_counter around one call (no synchronization), "
                     + AVERAGES[cfg.average] + " of ranks",
        "speedup": output.SPEEDUP_HELP.format(base=cfg.baseline),
        "sizes": cfg.sizes, "dtypes": cfg.dtypes, "ops": cfg.ops, "iters": cfg.iters,
        "warmup_iters": cfg.warmup, "check": cfg.check, "root": "all" if cfg.all_roots else cfg.root,
        "placements": cfg.placements, "report_cputime": cfg.report_cputime, "average": cfg.average,
        "run_cycles": cfg.run_cycles, "agg_iters": cfg.agg_iters, "blocking": cfg.blocking,
        "timeout_s": group_timeout(cfg).total_seconds(),
        "ranks": everyone,
    }
    if ctx.device.type == "cuda":
        try:
            meta["torch_nccl"] = nccl_header.version_text(torch.cuda.nccl.version())
        except Exception:  # noqa: BLE001 - metadata is best effort
            pass
    try:
        import cupy

        meta["cupy"] = cupy.__version__
        if ctx.device.type == "cuda":
            from cupy.cuda import nccl

            meta["cupy_nccl"] = nccl_header.version_text(nccl.get_version())
    except Exception:  # noqa: BLE001
        pass
    return meta
