"""Starting the ranks: one process per rank, or none when torchrun already started them.

The launcher (the process the user ran) finds the GPUs, decides how many ranks run on
which device and starts each rank as ``python -m <this package> <same arguments>`` with
torch's elastic process launcher (``torch.distributed.elastic.multiprocessing``, what
torchrun uses): it sets each rank's environment, keeps the logs of ranks 1.. in files,
and stops every rank as soon as one fails. The launcher hosts the rendezvous store itself,
as torchrun's agent does (the ranks connect to it with ``TORCHELASTIC_USE_AGENT_STORE``),
so no free port has to be guessed. Launchers whose rank 0 hosts the store (the fault
benchmark, tools/gpu_probe.py, the tests' harness) take a port from :func:`free_port`.

What torchrun cannot do, and is why this module exists: ranks beyond the number of GPUs
share them, and each such rank needs its own ``NCCL_HOSTID`` (NCCL refuses two ranks of
one host on one GPU), with ``NCCL_SOCKET_IFNAME=lo`` and ``NCCL_IB_DISABLE=1`` so that NCCL
talks over loopback sockets. Rank 0 inherits the launcher's stdout and stderr (tables,
progress bar); another rank's stderr is shown when it fails. ``--run_timeout`` stops every
rank after that much wall-clock time. The elastic launcher starts each rank in a session of
its own, out of reach of a signal sent to the launcher's process group, so every rank asks
the kernel to end it when the launcher dies (:func:`bind_to_launcher`), however it dies.

Left out: everything a rank does (runner), and argument parsing (cli).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import random
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

WORKER_ENV = "CUPYCOLL_BENCH_WORKER"      # set in the ranks the launcher starts
DEVICE_ENV = "CUPYCOLL_BENCH_DEVICE"      # the CUDA device index of that rank
TRANSPORT_ENV = "CUPYCOLL_BENCH_TRANSPORT"
SHARED_ENV = "CUPYCOLL_BENCH_SHARED_GPU"  # "1" where several ranks share a GPU (Plan.shared)
LAUNCHER_ENV = "CUPYCOLL_BENCH_LAUNCHER"  # the launcher's pid, for bind_to_launcher
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# What torch's elastic launcher handles (TORCHELASTIC_SIGNALS_TO_HANDLE's default).
_ELASTIC_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
PACKAGE_ROOT = Path(__file__).resolve().parent.parent  # holds bench/ (checkout) or cupycoll_bench/


# Said wherever no GPU is found: the one way to run the command without one.
CPU_HINT = ("--device cpu runs the pipeline on gloo without a GPU (development mode; the numbers "
            "mean nothing)")


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
                          f"CUDA; install a CUDA build of torch on a machine with a GPU; {CPU_HINT}")
    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        raise LaunchError("no CUDA GPU visible (check the driver, nvidia-smi and CUDA_VISIBLE_DEVICES); "
                          + CPU_HINT)
    return torch.cuda.device_count()


def plan_spawn(device: str, ranks: Optional[int], ngpus: Optional[int]) -> Plan:
    """How many ranks to start and on which GPUs, for the launcher."""
    if device == "cpu":  # -g N: N ranks, as on GPUs (one process each); --ranks wins
        world = ranks or ngpus or 2
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


def rank_env(plan: Plan, rank: int, port: int, base: Dict[str, str]) -> Dict[str, str]:
    env = dict(base)
    env.update(
        RANK=str(rank), WORLD_SIZE=str(plan.world), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(plan.world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        # The launcher hosts the store: every rank is a client, as under torchrun's agent.
        TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_RUN_ID="cupycoll-bench",
        PYTHONUNBUFFERED="1",
        **{WORKER_ENV: "1", TRANSPORT_ENV: plan.transport, LAUNCHER_ENV: str(os.getpid()),
           SHARED_ENV: "1" if plan.shared else "0"},
    )
    # The ranks import this package by name; make sure they find it (and cupycoll beside
    # it in a checkout) wherever the launcher was started from.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), base.get("PYTHONPATH")]))
    if plan.devices:
        env[DEVICE_ENV] = str(plan.devices[rank])
    if plan.shared:
        env.update(share_gpu_env(rank))
    # Several ranks per machine: one OpenMP thread each keeps them from fighting over cores.
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def bind_to_launcher(environ=os.environ) -> None:
    """In a rank the launcher started: have the kernel end this process when the launcher
    dies. The elastic launcher gives every rank its own session, so neither a Ctrl-C nor a
    kill of the launcher's process group (a test's or a CI step's timeout) reaches the ranks
    otherwise, and they would hold the GPU. Linux only; elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if str(os.getppid()) != environ.get(LAUNCHER_ENV, str(os.getppid())):
        os._exit(1)  # the launcher died before the request was in place


def share_gpu_env(rank: int, environ=os.environ) -> Dict[str, str]:
    """What a rank sharing its GPU needs before NCCL starts (the user's own values kept)."""
    return {"NCCL_HOSTID": hostid_for(rank),
            "NCCL_SOCKET_IFNAME": environ.get("NCCL_SOCKET_IFNAME", "lo"),
            "NCCL_IB_DISABLE": environ.get("NCCL_IB_DISABLE", "1")}


_PORTS = random.Random()  # its own generator: a caller seeding ``random`` must not pin ports


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (0 when it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def free_port() -> int:
    """A port free now that nothing else is likely to take before rank 0 binds it.

    Rank 0 binds it only after importing torch (seconds on a loaded box). A port the kernel
    handed out for ``bind(0)`` lies in its ephemeral range, from which every outgoing
    connection meanwhile (store clients, gloo, a download) draws too; one below that range is
    only ever taken by an explicit bind."""
    low = _ephemeral_low()
    if low > 20000:
        for _ in range(100):
            port = _PORTS.randrange(low - 10000, low)
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn(plan: Plan, argv: List[str], package: str, deadline: float = 0.0) -> int:
    """Run ``plan.world`` ranks of ``python -m package argv``; return the exit status."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes
    from torch.distributed.elastic.multiprocessing.api import SignalException

    # Its own reports (one per stopped rank) would bury the one line this command promises.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    # start_processes turns SIGTERM, SIGINT, SIGHUP and SIGQUIT into its SignalException for
    # good; the caller's handlers come back when the ranks are done (a test process, a script).
    handlers = {sig: signal.getsignal(sig) for sig in _ELASTIC_SIGNALS}
    store = TCPStore("127.0.0.1", 0, plan.world, is_master=True, wait_for_workers=False)
    ranks = range(plan.world)
    with tempfile.TemporaryDirectory(prefix="cupycoll-bench-") as logs:
        specs = DefaultLogsSpecs(log_dir=logs, redirects={r: Std.NONE if r == 0 else Std.ALL for r in ranks})
        context = start_processes(
            name="cupycoll-bench", entrypoint=sys.executable,
            args={r: ("-m", package, *argv) for r in ranks},
            envs={r: rank_env(plan, r, store.port, dict(os.environ)) for r in ranks},
            logs_specs=specs)
        try:
            return _wait(context, deadline)
        except (KeyboardInterrupt, SignalException):  # start_processes turns Ctrl-C into the latter
            print("cupycoll-bench: interrupted; stopped every rank", file=sys.stderr)
            return 130
        finally:
            context.close(timeout=5)
            del store
            if threading.current_thread() is threading.main_thread():  # where it set them
                for sig, handler in handlers.items():
                    signal.signal(sig, handler)


def _wait(context, deadline: float) -> int:
    """Wait for the ranks; the elastic context stops the others when one fails."""
    until = time.monotonic() + deadline if deadline > 0 else None
    # The one semi-private use of the context (SubprocessContext.subprocess_handlers[r].proc,
    # the same on torch 2.7.1 - 2.15): the grace period below needs a rank's exit status while
    # others still run, and the public API cannot give it. wait() answers only when every
    # rank ended or one failed; pids() gives pids, but the context's own poll (inside every
    # wait()) reaps a finished rank, after which its status lives only in that Popen, so
    # neither os.waitpid nor os.waitid(WNOWAIT) on the pid can read it.
    procs = [handler.proc for handler in context.subprocess_handlers.values()]
    grace_until = None
    while True:
        result = context.wait(timeout=0.5, period=0.05)
        if result is not None:
            break
        if until is not None and time.monotonic() > until:
            print(f"cupycoll-bench: error: the ranks did not finish within --run_timeout {deadline:g} s; "
                  "stopped them", file=sys.stderr)
            # What the other ranks said is the clue to a hang; their logs go with the launcher.
            for rank, path in sorted(context.stderrs.items()):
                if rank != 0:
                    _show_log(path, rank)
            return 124
        # Every rank that ended so far ended well; the rest may be stuck tearing down.
        if grace_until is None and any(p.poll() is not None for p in procs):
            grace_until = time.monotonic() + 120.0
        if grace_until is not None and time.monotonic() > grace_until:
            print("cupycoll-bench: warning: some ranks did not exit 120 s after another finished; "
                  "stopped them", file=sys.stderr)
            return 0 if procs[0].poll() == 0 else 1
    if not result.is_failed():
        return 0
    first = min(result.failures.values(), key=lambda f: f.timestamp)
    if first.local_rank == 0 and first.exitcode in (1, 2):
        return first.exitcode  # rank 0 said why itself (wrong values, nothing measured)
    print(f"cupycoll-bench: error: rank {first.local_rank} exited with status {first.exitcode}; "
          "the other ranks were stopped", file=sys.stderr)
    _show_log(result.stderrs.get(first.local_rank), first.local_rank)
    return first.exitcode if first.exitcode > 0 else 1


def _show_log(path: Optional[str], rank: int) -> None:
    if not path or not os.path.isfile(path):
        return
    with open(path, errors="replace") as log:
        text = log.read()[-6000:]
    if text.strip():
        print(f"--- rank {rank} stderr (last lines) ---\n{text}", file=sys.stderr)
