"""Starting the ranks: one process per rank, or none when torchrun already started them.

The launcher (the process the user ran) finds the GPUs, decides how many ranks run on
which device, picks a free port for the env:// rendezvous and starts each rank as
``python -m <this package> <same arguments>`` with RANK / WORLD_SIZE / LOCAL_RANK /
MASTER_ADDR / MASTER_PORT set, like torchrun would. Ranks beyond the number of GPUs share
them: each such rank gets its own NCCL_HOSTID (NCCL refuses two ranks of one host on one
GPU) and NCCL_SOCKET_IFNAME=lo, so NCCL talks over loopback sockets.

Rank 0 inherits the launcher's stdout and stderr (the tables, the progress bar); the other
ranks' stderr is kept in a temporary file and shown if they fail. When one rank fails or
the --timeout passes, the launcher stops the others, so a hang cannot outlive it.

Left out: everything a rank does (runner), and argument parsing (cli).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

WORKER_ENV = "CUPYCOLL_BENCH_WORKER"      # set in the ranks the launcher starts
DEVICE_ENV = "CUPYCOLL_BENCH_DEVICE"      # the CUDA device index of that rank
TRANSPORT_ENV = "CUPYCOLL_BENCH_TRANSPORT"
PACKAGE_ROOT = Path(__file__).resolve().parent.parent  # holds bench/ (checkout) or cupycoll_bench/


class LaunchError(Exception):
    """A setup the launcher cannot run (exit status 2); the message is for the user."""


@dataclasses.dataclass
class Plan:
    world: int
    devices: List[int]            # CUDA device per rank (empty on --device cpu)
    shared: bool                  # several ranks on one GPU, told apart by NCCL_HOSTID
    transport: str                # how the ranks talk, in words, for the output

    def note(self) -> str:
        if not self.shared:
            return ""
        gpus = len(set(self.devices))
        return (f"{self.world} ranks on {gpus} GPU(s): each rank has its own NCCL_HOSTID, so NCCL "
                "uses its socket transport over loopback; read the numbers as same-setup ratios "
                "and correctness, not absolute speed")


def under_torchrun(environ=os.environ) -> bool:
    """Started by torchrun (or another launcher that sets RANK/WORLD_SIZE), not by us."""
    return "RANK" in environ and "WORLD_SIZE" in environ and WORKER_ENV not in environ


def is_worker(environ=os.environ) -> bool:
    return environ.get(WORKER_ENV) == "1"


def cuda_devices() -> int:
    """Number of CUDA devices torch sees; raises :class:`LaunchError` when there are none.

    Uses torch, not CuPy: torch is needed anyway and its check does not create a context.
    """
    import torch

    if torch.version.cuda is None and not getattr(torch.version, "hip", None):
        raise LaunchError(f"no CUDA GPU visible: this torch ({torch.__version__}) was built without "
                          "CUDA; install a CUDA build of torch on a machine with a GPU")
    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        raise LaunchError("no CUDA GPU visible (check the driver, nvidia-smi and CUDA_VISIBLE_DEVICES)")
    return torch.cuda.device_count()


def plan_spawn(device: str, ranks: Optional[int], ngpus: Optional[int]) -> Plan:
    """How many ranks to start and on which GPUs, for the launcher."""
    if device == "cpu":
        world = ranks or 2
        return Plan(world, [], False, f"{world} CPU processes over gloo (development mode)")
    visible = cuda_devices()
    if ngpus is not None and ngpus > visible:
        if ranks is None:
            raise LaunchError(f"asked for {ngpus} GPUs but {visible} visible; pass --ranks {ngpus} "
                              f"to run {ngpus} ranks sharing the {visible} GPU(s)")
    usable = min(ngpus or visible, visible)
    world = ranks if ranks is not None else usable
    devices = [rank % usable for rank in range(world)]
    shared = world > usable
    if shared:
        transport = f"NCCL_HOSTID ranks sharing {usable} GPU(s)"
    else:
        transport = "real GPUs"
    return Plan(world, devices, shared, transport)


def plan_torchrun(device: str, share_gpu: bool, environ=os.environ) -> Plan:
    """The plan of one rank started by torchrun: its device, and whether GPUs are shared."""
    world = int(environ["WORLD_SIZE"])
    if device == "cpu":
        return Plan(world, [], False, f"{world} CPU processes over gloo (development mode)")
    visible = cuda_devices()
    local = int(environ.get("LOCAL_RANK", environ["RANK"]))
    local_world = int(environ.get("LOCAL_WORLD_SIZE", world))
    if local >= visible and not share_gpu:
        raise LaunchError(f"local rank {local} has no GPU of its own ({visible} visible); start fewer "
                          "ranks per node or pass --share-gpu")
    shared = share_gpu and local_world > visible
    devices = [local % visible]  # only this rank's device is known here
    transport = f"NCCL_HOSTID ranks sharing {visible} GPU(s)" if shared else "real GPUs"
    return Plan(world, devices, shared, transport)


def hostid_for(rank: int) -> str:
    return f"cupycoll-bench-{rank}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_env(plan: Plan, rank: int, port: int, base: Dict[str, str]) -> Dict[str, str]:
    env = dict(base)
    env.update(
        RANK=str(rank), WORLD_SIZE=str(plan.world), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(plan.world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        PYTHONUNBUFFERED="1", **{WORKER_ENV: "1", TRANSPORT_ENV: plan.transport},
    )
    # The ranks import this package by name; make sure they find it (and cupycoll beside
    # it in a checkout) wherever the launcher was started from.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), base.get("PYTHONPATH")]))
    if plan.devices:
        env[DEVICE_ENV] = str(plan.devices[rank])
    if plan.shared:
        env["NCCL_HOSTID"] = hostid_for(rank)
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    # Several ranks per machine: one OpenMP thread each keeps them from fighting over cores.
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def spawn(plan: Plan, argv: List[str], package: str, timeout: float = 0.0) -> int:
    """Run ``plan.world`` ranks of ``python -m package argv``; return the exit status."""
    port = free_port()
    procs: List[subprocess.Popen] = []
    logs: List[Optional[tempfile._TemporaryFileWrapper]] = []
    try:
        for rank in range(plan.world):
            env = rank_env(plan, rank, port, dict(os.environ))
            if rank == 0:
                log, stdout, stderr = None, None, None  # inherit: tables and progress bar
            else:
                log = tempfile.TemporaryFile(mode="w+", prefix=f"cupycoll-bench-rank{rank}-")
                stdout, stderr = subprocess.DEVNULL, log
            logs.append(log)
            procs.append(subprocess.Popen([sys.executable, "-m", package, *argv], env=env,
                                          stdout=stdout, stderr=stderr))
        return _wait(procs, logs, timeout)
    except KeyboardInterrupt:
        _stop(procs)
        print("cupycoll-bench: interrupted; stopped every rank", file=sys.stderr)
        return 130
    finally:
        _stop(procs)
        for log in logs:
            if log is not None:
                log.close()


def _wait(procs: List[subprocess.Popen], logs, timeout: float) -> int:
    deadline = time.monotonic() + timeout if timeout > 0 else None
    first: Optional[int] = None      # the first rank to exit
    grace_until = None
    straggled = False
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            break
        if first is None:
            done = [r for r, c in enumerate(codes) if c is not None]
            if done:
                first = done[0]
                # The others may be stuck in a collective with a dead rank (give them a moment
                # to fail by themselves), or still tearing down after a clean finish.
                grace_until = time.monotonic() + (15.0 if codes[first] else 120.0)
        if grace_until is not None and time.monotonic() > grace_until:
            straggled = True
            _stop(procs)
            break
        if deadline is not None and time.monotonic() > deadline:
            _stop(procs)
            print(f"cupycoll-bench: error: the ranks did not finish within --timeout {timeout:g} s; "
                  "stopped them", file=sys.stderr)
            _show_logs(logs)
            return 124
        time.sleep(0.05)
    codes = [p.returncode for p in procs]
    if not any(codes):
        return 0
    if straggled and codes[0] == 0 and codes[first] == 0:
        print("cupycoll-bench: warning: some ranks did not exit after rank 0 finished; stopped them",
              file=sys.stderr)
        return 0
    if all(c in (0, 1) for c in codes) and codes[0] == 1:
        return 1  # rank 0 reported wrong values or failed measurements itself, and said so
    failed = first if first is not None and codes[first] else next(r for r, c in enumerate(codes) if c)
    print(f"cupycoll-bench: error: rank {failed} exited with status {codes[failed]}; "
          "the other ranks were stopped", file=sys.stderr)
    _show_logs(logs, only=failed)
    return codes[0] if codes[0] and codes[0] > 0 else 1


def _show_logs(logs, only: Optional[int] = None) -> None:
    for rank, log in enumerate(logs):
        if log is None or (only is not None and rank != only):
            continue
        log.flush()
        log.seek(0)
        text = log.read()[-6000:]
        if text.strip():
            print(f"--- rank {rank} stderr (last lines) ---\n{text}", file=sys.stderr)


def _stop(procs: List[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 5.0
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
