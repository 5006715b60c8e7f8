"""Run a worker script as N ranks, each in its own process, like torchrun would.

Each rank gets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT (a free port), its own
NCCL_HOSTID when several ranks share a GPU, and a hard timeout: a hang fails the test
instead of eating the suite. On failure the message shows every rank's stderr.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        return 0


@dataclasses.dataclass
class RankResult:
    rank: int
    returncode: Optional[int]
    stdout: str
    stderr: str


class WorkersFailed(AssertionError):
    pass


def _report(results: Sequence[RankResult], headline: str) -> str:
    parts = [headline]
    for r in results:
        parts.append(f"--- rank {r.rank}: exit {r.returncode} ---")
        if r.stdout.strip():
            parts.append("stdout:\n" + r.stdout[-4000:])
        parts.append("stderr:\n" + (r.stderr[-8000:] or "(empty)"))
    return "\n".join(parts)


def run_ranks(
    script: str,
    world: int,
    args: Sequence[str] = (),
    timeout: float = 120.0,
    env: Optional[Dict[str, str]] = None,
    expect_success: bool = True,
    share_gpu: bool = False,
) -> List[RankResult]:
    """Start ``world`` ranks of ``tests/workers/<script>`` and wait for all of them."""
    port = free_port()
    procs = []
    for rank in range(world):
        child_env = dict(os.environ)
        child_env.update(
            RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), child_env.get("PYTHONPATH")])),
            PYTHONUNBUFFERED="1",
        )
        if share_gpu:
            child_env.update(NCCL_HOSTID=f"cupycoll-test-rank{rank}", NCCL_SOCKET_IFNAME="lo")
        child_env.update(env or {})
        procs.append(subprocess.Popen(
            [sys.executable, str(WORKERS / script), *args],
            env=child_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        ))
    deadline = time.monotonic() + timeout
    results = []
    timed_out = False
    for rank, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            for p in procs:
                p.kill()
            out, err = proc.communicate()
        results.append(RankResult(rank, proc.returncode, out, err))
    if timed_out:
        raise WorkersFailed(_report(results, f"{script}: ranks did not finish within {timeout:g} s"))
    if expect_success and any(r.returncode != 0 for r in results):
        raise WorkersFailed(_report(results, f"{script}: a rank failed"))
    return results


def run_python(*args: str, timeout: float, env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """Run ``python *args`` from the repository root (checkout on PYTHONPATH). On a timeout,
    kill it with every process it started (torchrun's or the benchmark's ranks) and fail
    showing what it printed."""
    import pytest

    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=full_env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(args)} did not finish within {timeout:g} s\n"
                    f"stdout:\n{out[-6000:]}\nstderr:\n{err[-8000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
