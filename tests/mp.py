"""Run a worker script as N ranks, each in its own process, like torchrun would.

Each rank gets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT (a free port, from
:func:`bench.launch.free_port`), its own NCCL_HOSTID when several ranks share a GPU, and a
hard timeout: a hang fails the test instead of eating the suite. On failure the message
shows every rank's output.

Every rank writes its stdout and stderr to files, never to a pipe: a pipe the harness is
not reading at that moment fills at 64 KiB, the rank blocks in write(), and its peers then
block in their next collective (a deadlock that only the timeout ends).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
WORKERS = TESTS / "workers"

if str(ROOT) not in sys.path:  # bench/ of this checkout, for its port helper
    sys.path.insert(0, str(ROOT))

from bench.launch import free_port  # noqa: E402  (standard library only)

# Seconds the other ranks get to finish once one rank has failed (when all must succeed):
# a rank that died leaves its peers waiting in a collective until their own timeout.
FAIL_GRACE_S = 15.0
# How long a rank still running at its limit gets to print its stacks before it is killed.
STACK_DUMP_WAIT_S = 3.0


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        return 0


def shared_gpu_env(rank: int, tag: str = "cupycoll-test") -> Dict[str, str]:
    """What a rank needs to share a GPU with other ranks through NCCL's network transport.

    Distinct host ids make NCCL treat each rank as another node; it then prefers
    InfiniBand/RoCE over the loopback socket whenever the host has an HCA, so IB is turned
    off; gloo is kept on loopback too, so a hostname that resolves to a dead interface
    cannot stall the rendezvous."""
    return {"NCCL_HOSTID": f"{tag}-rank{rank}", "NCCL_SOCKET_IFNAME": "lo",
            "NCCL_IB_DISABLE": "1", "GLOO_SOCKET_IFNAME": "lo"}


@dataclasses.dataclass
class RankResult:
    rank: int
    returncode: Optional[int]
    stdout: str
    stderr: str
    log_dir: str = ""


class WorkersFailed(AssertionError):
    pass


def _tail(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"[... {len(text) - limit} characters cut ...]\n" + text[-limit:]


def _report(results: Sequence[RankResult], headline: str) -> str:
    parts = [headline]
    if results and results[0].log_dir:
        parts.append(f"(full logs: {results[0].log_dir})")
    for r in results:
        parts.append(f"--- rank {r.rank}: exit {r.returncode} ---")
        if r.stdout.strip():
            parts.append("stdout:\n" + _tail(r.stdout, 4000))
        parts.append("stderr:\n" + (_tail(r.stderr, 8000) or "(empty)"))
    return "\n".join(parts)


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _child_setup() -> None:
    """In a child before exec: get SIGTERM when the test process dies, however it dies, and
    never write a core file.

    Each child leads its own session (so one killpg ends what it started), which puts it
    outside the process group a tier part's time limit kills; without this, a killed part
    would leave its ranks holding the GPU while the next part runs. SIGTERM, not SIGKILL:
    torchrun ends its own workers on SIGTERM. ``prctl`` is looked up in the parent, once: a
    dlopen in a child forked while another thread held the loader's lock would never return.

    No core file: a rank still running at its limit gets SIGABRT for its stacks, which the
    fault handler prints and then lets end the process the default way, with a core dump;
    a rank with a CUDA context dumps about a GB. The soft limit is 0 for the child and all
    it starts (torchrun's workers inherit it); the hard limit stays as it was."""
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)
    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))


_PRCTL = ctypes.CDLL(None, use_errno=True).prctl


def process_alive(pid: int) -> bool:
    """Is ``pid`` running (a zombie has ended; only its parent has not reaped it yet)?"""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _kill_tree(proc: subprocess.Popen) -> None:
    # Each rank leads its own session: this also ends whatever the rank started.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class Ranks:
    """Ranks started by :func:`start_ranks`; :meth:`wait` collects them. Several jobs can
    run side by side (distinct ports and log folders) and be waited on one after another."""

    def __init__(self, script: str, procs: List[subprocess.Popen], log_dir: str, deadline: float,
                 timeout: float, expect_success: bool, own_log_dir: bool = False, fail_fast: bool = True):
        self.script, self.procs, self.log_dir = script, procs, log_dir
        self.own_log_dir, self.fail_fast = own_log_dir, fail_fast
        self.deadline, self.timeout, self.expect_success = deadline, timeout, expect_success
        self.results: Optional[List[RankResult]] = None

    def _read(self, rank: int, stream: str) -> str:
        path = os.path.join(self.log_dir, f"rank{rank}.{stream}")
        try:
            with open(path, encoding="utf-8", errors="replace") as fh:
                return fh.read()
        except OSError:
            return ""

    def _collect(self) -> List[RankResult]:
        return [RankResult(rank, proc.returncode, self._read(rank, "out"), self._read(rank, "err"), self.log_dir)
                for rank, proc in enumerate(self.procs)]

    def _dump_stacks(self) -> None:
        """Ask each rank still running for its threads' Python stacks (SIGABRT, which the
        fault handler prints before the process ends, writing no core: _child_setup): where
        a hang was, in its stderr."""
        running = [p for p in self.procs if p.poll() is None]
        for proc in running:
            try:
                os.kill(proc.pid, signal.SIGABRT)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + STACK_DUMP_WAIT_S
        while any(p.poll() is None for p in running) and time.monotonic() < deadline:
            time.sleep(0.05)

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                _kill_tree(proc)
        for proc in self.procs:
            proc.wait()

    def wait(self) -> List[RankResult]:
        if self.results is not None:
            return self.results
        failed_at = None
        headline = None
        while True:
            codes = [p.poll() for p in self.procs]
            if all(c is not None for c in codes):
                break
            now = time.monotonic()
            if now > self.deadline:
                headline = f"{self.script}: ranks did not finish within {self.timeout:g} s"
                break
            if self.fail_fast and failed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = now
            if failed_at is not None and now - failed_at > FAIL_GRACE_S:
                headline = (f"{self.script}: a rank failed and the others did not finish within "
                            f"{FAIL_GRACE_S:g} s after it")
                break
            time.sleep(0.05)
        if headline is not None:
            self._dump_stacks()
        self.kill()
        self.results = results = self._collect()
        if headline is not None:
            raise WorkersFailed(_report(results, headline))
        if self.expect_success and any(r.returncode != 0 for r in results):
            raise WorkersFailed(_report(results, f"{self.script}: a rank failed"))
        if self.own_log_dir:  # kept on failure, for the report's "full logs"
            shutil.rmtree(self.log_dir, ignore_errors=True)
        return results


def start_ranks(
    script: str,
    world: int,
    args: Sequence[str] = (),
    timeout: float = 120.0,
    env: Optional[Dict[str, str]] = None,
    expect_success: bool = True,
    share_gpu: bool = False,
    log_dir: Optional[str] = None,
    fail_fast: Optional[bool] = None,
) -> Ranks:
    """Start ``world`` ranks of ``tests/workers/<script>`` (or of the script at that absolute
    path); the timeout counts from now.

    ``fail_fast`` (default: ``expect_success``): once a rank exits non-zero, the others get
    FAIL_GRACE_S to finish, then are killed. Off where a rank dies on purpose."""
    port = free_port()
    own_log_dir = log_dir is None
    log_dir = log_dir or tempfile.mkdtemp(prefix=f"cupycoll-{Path(script).stem}-")
    os.makedirs(log_dir, exist_ok=True)
    procs = []
    try:
        for rank in range(world):
            child_env = dict(os.environ)
            # Several ranks, each building CPU references: torch's default of one intra-op
            # thread per core oversubscribes the machine world-fold.
            child_env.setdefault("OMP_NUM_THREADS", "2")
            # A rank still running at the limit is sent SIGABRT first (Ranks.wait): with the
            # fault handler on, it prints every thread's Python stack to its stderr.
            child_env.setdefault("PYTHONFAULTHANDLER", "1")
            # The checkout, and tests/ for the helpers workers share with the tests
            # (ring_simulator), imported by name as the tests import them.
            child_env.update(
                RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), str(TESTS), child_env.get("PYTHONPATH")])),
                PYTHONUNBUFFERED="1",
            )
            if share_gpu:
                child_env.update(shared_gpu_env(rank))
            child_env.update(env or {})
            with open(os.path.join(log_dir, f"rank{rank}.out"), "w") as out, \
                    open(os.path.join(log_dir, f"rank{rank}.err"), "w") as err:
                procs.append(subprocess.Popen(
                    [sys.executable, str(WORKERS / script), *args], env=child_env,
                    stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True,
                    preexec_fn=_child_setup,
                ))
    except BaseException:
        for proc in procs:
            _kill_tree(proc)
        raise
    return Ranks(script, procs, log_dir, time.monotonic() + timeout, timeout, expect_success, own_log_dir,
                 expect_success if fail_fast is None else fail_fast)


# What rank 0's store says when its port was taken between the draw and its bind: another
# process's doing, which says nothing of the code under test.
PORT_TAKEN = "EADDRINUSE"


def run_ranks(script: str, world: int, *args, **kwargs) -> List[RankResult]:
    """Start ``world`` ranks of ``tests/workers/<script>`` (:func:`start_ranks`'s arguments)
    and wait for all of them; a launch that failed because its port was taken
    (:data:`PORT_TAKEN`) runs once more, on a port drawn anew."""
    try:
        return start_ranks(script, world, *args, **kwargs).wait()
    except WorkersFailed as failure:
        if PORT_TAKEN not in str(failure):
            raise
    return start_ranks(script, world, *args, **kwargs).wait()


def wait_all(jobs: Sequence[Ranks]) -> List[List[RankResult]]:
    """Wait for jobs started side by side; if one fails, the others are killed (their
    output is not needed, and they must not outlive the test)."""
    try:
        return [job.wait() for job in jobs]
    finally:
        for job in jobs:
            job.kill()


def run_python(*args: str, timeout: float, env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """Run ``python *args`` from the repository root (checkout on PYTHONPATH). On a timeout,
    kill it with every process it started (torchrun's or the benchmark's ranks) and fail
    showing what it printed."""
    import pytest

    # ``env`` wins over the defaults (a dict merge: the two may name the same variable)
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "NCCL_IB_DISABLE": "1",
                **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    # communicate() drains both pipes together, so one child cannot block on a full pipe.
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=full_env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=_child_setup)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # SIGTERM first: torchrun puts each worker in a session of its own, out of reach of
        # killpg, and ends them only when it is terminated, not when it is killed.
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            try:
                out, err = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:  # a straggler still holds the pipes
                out, err = "(no output: a child still holds the pipes)", ""
        pytest.fail(f"{' '.join(args)} did not finish within {timeout:g} s\n"
                    f"stdout:\n{out[-6000:]}\nstderr:\n{err[-8000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_train_ddp(timeout: float, *train_args: str, share_gpu: bool) -> subprocess.CompletedProcess:
    """examples/train_ddp.py with ``train_args`` under torchrun, two ranks (with ``share_gpu``,
    on one GPU). run_python kills torchrun and its ranks together on a timeout."""
    cmd = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "examples" / "train_ddp.py"), *train_args]
    if share_gpu:
        cmd.append("--share-gpu")
    # train_ddp.py sets each rank's NCCL_HOSTID; IB and the gloo interface are the same for all.
    env = {k: v for k, v in shared_gpu_env(0).items() if k != "NCCL_HOSTID"}
    return run_python(*cmd, timeout=timeout, env=env)


CRASH_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE})


@dataclasses.dataclass
class TrainedRun:
    """One launch of examples/train_ddp.py: how it ended, and rank 0's final parameters."""
    backend: str
    proc: subprocess.CompletedProcess
    params: Optional[list]

    def explain(self) -> str:
        return (f"train_ddp.py on {self.backend}: exit {self.proc.returncode}\n"
                f"stdout:\n{self.proc.stdout[-4000:]}\nstderr:\n{self.proc.stderr[-8000:]}")

    def crashed(self) -> Optional[str]:
        """The name of the crash signal (SIGSEGV, SIGBUS, SIGILL, SIGFPE) that ended a rank, as
        torchrun reports it (``exitcode  : -11``), or None: an error exit, a kill (a timeout,
        the OOM killer) or an abort (a watchdog) is not a crash."""
        if self.proc.returncode == 0:
            return None
        for number in re.findall(r"exitcode\s*:\s*-(\d+)", self.proc.stderr):
            if int(number) in CRASH_SIGNALS:
                return signal.Signals(int(number)).name
        return None


def train_ddp_side_by_side(timeout: float, backends: Sequence[str], out_dir: Path, *train_args: str,
                           share_gpu: bool = False) -> Dict[str, TrainedRun]:
    """examples/train_ddp.py once per backend, each under its own torchrun (two ranks; with
    ``share_gpu``, on one GPU), the launches side by side: no process trains on more than
    one backend."""
    from concurrent.futures import ThreadPoolExecutor

    def launch(backend: str) -> TrainedRun:
        params_file = out_dir / f"{backend}-params.pt"
        proc = run_train_ddp(timeout, "--backend", backend, *train_args, "--params-out", str(params_file),
                             share_gpu=share_gpu)
        params = None
        if proc.returncode == 0 and params_file.exists():
            import torch

            params = torch.load(params_file)["params"]
        return TrainedRun(backend, proc, params)

    with ThreadPoolExecutor(len(backends)) as pool:
        return dict(zip(backends, pool.map(launch, backends)))


def largest_difference(params: list, reference: list) -> float:
    """The largest absolute difference between two runs' parameters (the same model); NaN
    where either run has one (a diverged run)."""
    import torch

    assert len(params) == len(reference), (len(params), len(reference))
    # torch's max keeps a NaN; Python's max would keep whichever value came first
    return torch.stack([(a - b).abs().max() for a, b in zip(params, reference)]).max().item()


def ddp_parity_with_torch_nccl(timeout: float, *train_args: str) -> float:
    """examples/train_ddp.py --compare nccl under torchrun, two ranks (sharing the GPU when
    there is one): the largest parameter difference between cupycoll and torch's nccl.
    ``train_args``: more of train_ddp.py's flags."""
    result = run_train_ddp(timeout, *train_args, "--compare", "nccl", share_gpu=gpu_count() < 2)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    found = re.search(r"max \|param difference\| cupycoll vs nccl: ([0-9.eE+-]+)", result.stdout)
    assert found, result.stdout[-4000:]
    return float(found.group(1))


FSDP_EXAMPLE = ROOT / "examples" / "train_fsdp.py"


@dataclasses.dataclass
class FsdpLaunch:
    """One launch of examples/train_fsdp.py: how its ranks ended, and rank 0's results
    (``--params-out``: {"backends": {backend: {"runs": {"MESH PRECISION": {"params",
    "losses", "layouts"}}, "checkpoints": {"MESH": counts}}}}), or None."""
    ranks: List[RankResult]
    failure: Optional[WorkersFailed]
    results: Optional[dict]

    def explain(self) -> str:
        return str(self.failure) if self.failure else _report(self.ranks, "train_fsdp.py: the ranks' output")

    def crashed(self) -> Optional[str]:
        """The crash signal (SIGSEGV, SIGBUS, SIGILL, SIGFPE) that ended a rank, or None: an
        error exit, a kill or an abort is not a crash."""
        for rank in self.ranks:
            if rank.returncode is not None and -rank.returncode in CRASH_SIGNALS:
                return signal.Signals(-rank.returncode).name
        return None


@dataclasses.dataclass
class FsdpStart:
    """A launch of examples/train_fsdp.py in flight (:func:`start_train_fsdp`)."""
    job: Ranks
    results: Path
    again: Callable[[], Ranks]  # the same launch on a port drawn anew


def start_train_fsdp(world: int, out_dir: Path, *train_args: str, timeout: float, share_gpu: bool = False,
                     env: Optional[Dict[str, str]] = None) -> FsdpStart:
    """examples/train_fsdp.py with ``train_args`` as ``world`` ranks (the harness's: free
    port, time limit, stacks of a hung rank), rank 0's results to ``out_dir/results.pt``.
    With ``share_gpu`` the ranks share one GPU. :func:`wait_train_fsdp` collects it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results = out_dir / "results.pt"
    args = [*train_args, "--params-out", str(results), *(["--share-gpu"] if share_gpu else [])]

    def start() -> Ranks:
        return start_ranks(str(FSDP_EXAMPLE), world, args, timeout=timeout, env=env, expect_success=True,
                           share_gpu=share_gpu, log_dir=str(out_dir / "logs"))
    return FsdpStart(start(), results, start)


def wait_train_fsdp(started: FsdpStart) -> FsdpLaunch:
    """Wait for a launch of :func:`start_train_fsdp`; a failed launch is returned, not raised,
    so that launches started side by side are each judged. A launch whose port was taken
    (:data:`PORT_TAKEN`) runs once more, as in :func:`run_ranks`."""
    job = started.job
    for attempt in range(2):
        try:
            ranks, failure = job.wait(), None
        except WorkersFailed as exc:
            ranks, failure = job.results or [], exc
        if failure is None or PORT_TAKEN not in str(failure) or attempt:
            break
        job = started.again()
    loaded = None
    if failure is None and started.results.exists():
        import torch

        loaded = torch.load(started.results)
    return FsdpLaunch(ranks, failure, loaded)
