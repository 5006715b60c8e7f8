"""One rank of a fault scenario (tests/gpu/test_gpu_faults.py): a peer that skips a
collective, dies, never joins, an abort from another thread, init/abort cycles, recovery.

Usage: fault_worker.py SCENARIO MODE OUT_DIR, MODE being "blocking" or "nonblocking".
Each rank writes OUT_DIR/rank<N>.json with what it measured; the test reads and asserts.
Every rank exits 0 after handling the fault (except the one that is killed on purpose).

SCENARIO "suite" runs every scenario in one launch (one process start, not seven), in
SUITE's order, writing OUT_DIR/<scenario>-rank<N>.json after each: a scenario that raises is
recorded and the next one still runs; "killed" comes last, as it ends a rank.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import signal
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore

import cupycoll
from bench import gpu_info
try:  # run as a script (tests/workers on sys.path), or imported by the CPU tier
    from epilogue import write_json
except ImportError:
    from workers.epilogue import write_json

TIMEOUT_S = 5.0  # the groups' timeout: faults must surface within TIMEOUT_S + 5 s

# What a rank's error says when a peer never joins the creation of a communicator, one of
# these by who gave up first (cupycoll.nccl.bootstrap's words; tests/nccl/test_bootstrap.py checks
# them against the bootstrap's real errors, so the two cannot drift apart).
NEVER_JOINED_WORDS = ("ranks to join communicator", "ranks to arrive makes", "another rank gave up waiting")


# The order of the "suite" scenario: the leak check first, on a clean process; "killed" last.
SUITE = ("cycles", "skip", "skip_lazy", "never_joins", "abort_thread", "recover", "shrink", "killed")
SUITE_CYCLES = 8
# A scenario of the suite still running after this long is hung: every thread's stack goes
# to stderr (which the test shows), before the launch's limit ends the ranks without one.
SCENARIO_STACKS_AFTER_S = 60


def main() -> None:
    scenario, mode, out_dir = sys.argv[1:4]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0,
                          timeout=datetime.timedelta(seconds=60))
    ctx = Context(rank, world, device, store, mode == "nonblocking")
    if scenario == "suite":
        for index, name in enumerate(SUITE):
            # each scenario's own store prefixes, even if a crash left the last one's count short
            ctx.scope, ctx.cycle = name, 1000 * index
            ctx.all_reach("start")  # no scenario begins while a peer is still in the last one
            print(f"rank {rank}: scenario {name} ({mode})", flush=True)
            faulthandler.dump_traceback_later(SCENARIO_STACKS_AFTER_S)
            try:
                result = cycles(ctx, SUITE_CYCLES, warm=3) if name == "cycles" else SCENARIOS[name](ctx)
            except Exception:  # noqa: BLE001 - recorded for the test, the suite goes on
                traceback.print_exc()
                result = {"crashed": traceback.format_exc()[-3000:]}
                try:
                    if dist.is_initialized():
                        dist.group.WORLD.abort()
                        dist.destroy_process_group()
                except Exception:  # noqa: BLE001 - best effort, the next scenario starts fresh
                    traceback.print_exc()
            faulthandler.cancel_dump_traceback_later()
            write_json(out_dir, f"{name}-rank{rank}.json", result or {})
        survivors = world - 1  # "killed" ended the last rank
    else:
        result = SCENARIOS[scenario](ctx)
        write_json(out_dir, f"rank{rank}.json", result or {})
        survivors = world - 1 if scenario == "killed" else world
    # The store's host must outlive the others' last use of it.
    store.add("exited", 1)
    if rank == 0:
        deadline = time.monotonic() + 30
        while store.add("exited", 0) < survivors and time.monotonic() < deadline:
            time.sleep(0.05)
    os._exit(0)  # a faulted group's NCCL state is gone; skip interpreter teardown races


class Context:
    def __init__(self, rank, world, device, store, nonblocking):
        self.rank, self.world, self.device, self.store = rank, world, device, store
        self.nonblocking = nonblocking
        self.cycle = 0
        self.scope = ""  # the running scenario: its store keys cannot meet another's

    def key(self, name):
        return f"{self.scope}/{name}"

    def init(self, eager=True, timeout=TIMEOUT_S):
        """A fresh default group on a fresh store prefix (what recovery does)."""
        self.cycle += 1
        dist.init_process_group(
            "cpu:gloo,cuda:cupycoll", store=PrefixStore(f"cycle{self.cycle}/", self.store),
            rank=self.rank, world_size=self.world, timeout=datetime.timedelta(seconds=60),
            device_id=self.device if eager else None,
            pg_options=cupycoll.Options(timeout=timeout, nonblocking=self.nonblocking, watchdog_interval=0.05))
        return dist.group.WORLD

    def wait_for(self, key, seconds=60):
        key = self.key(key)
        deadline = time.monotonic() + seconds
        while not self.store.check([key]) and time.monotonic() < deadline:
            time.sleep(0.05)

    def last_of(self, key, count, then):
        """Count this rank in under ``key``; the ``count``-th rank to do so sets ``then``
        (what :meth:`wait_for` waits for)."""
        if self.store.add(self.key(key), 1) == count:
            self.store.set(self.key(then), "1")

    def all_reach(self, key, seconds=60):
        """A store-only barrier (the group under test may be dead)."""
        self.all_reach_of(key, self.world, seconds)

    def all_reach_of(self, key, count, seconds=60):
        """A store-only barrier of ``count`` ranks."""
        key = self.key(key)
        self.store.add(key, 1)
        deadline = time.monotonic() + seconds
        while self.store.add(key, 0) < count and time.monotonic() < deadline:
            time.sleep(0.02)


def expect_fault(action):
    """Run ``action`` until it raises a cupycoll error; (seconds taken, error text)."""
    start = time.monotonic()
    try:
        action()
    except Exception as exc:  # noqa: BLE001 - through DDP's C++ reducer it may be re-wrapped
        return time.monotonic() - start, f"{type(exc).__name__}: {exc}"
    return time.monotonic() - start, None


def skip(ctx, eager=True):
    """The last rank skips an all_reduce the others issue."""
    ctx.init(eager=eager)
    x = torch.ones(1 << 16, device=ctx.device)
    if eager:
        dist.all_reduce(x)  # a healthy collective first: the fault is in a working group
        torch.cuda.synchronize()
    result = {}
    if ctx.rank == ctx.world - 1:
        ctx.wait_for("survivors-done")
    else:
        def collective():
            work = dist.all_reduce(x, async_op=True)
            work.wait()
            torch.cuda.synchronize()  # ends when the watchdog's abort ends the kernel
            # Works are failed before the abort: the Work must say failed right away, not
            # once the abort has finished
            result["after_sync"] = {"is_success": _quietly(work.is_success),
                                    "exception": _quietly(lambda: work.exception() is not None)}
            work.wait()  # the fault, now on the Work
        result["seconds"], result["error"] = expect_fault(collective)
        # every later call raises at once
        result["later_seconds"], result["later_error"] = expect_fault(lambda: dist.all_reduce(x))
        ctx.last_of("survivors", ctx.world - 1, then="survivors-done")
    dist.destroy_process_group()
    return result


def _quietly(call):
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - recorded
        return f"raised {type(exc).__name__}: {exc}"


def skip_lazy(ctx):
    """The last rank never joins: the others' first collective creates the communicator."""
    return skip(ctx, eager=False)


def train_until_killed(ctx, model, kill_at_step=20, before_step=None):
    """DDP training of ``model`` in which the last rank SIGKILLs itself at ``kill_at_step``;
    the survivors train until the fault. ``before_step(step, optimizer)`` runs first in each
    step. Returns the DDP module, its optimizer and ``{"steps", "seconds", "error",
    "since_last_step"}`` (seconds from the last finished step to the error)."""
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[ctx.device.index])
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    result = {}

    def train():
        for step in range(10_000):
            if before_step is not None:
                before_step(step, optimizer)
            if ctx.rank == ctx.world - 1 and step == kill_at_step:
                ctx.store.set(ctx.key("killed_at"), repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            loss = ddp(torch.randn(32, 256, device=ctx.device)).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            torch.cuda.synchronize()
            result["steps"] = step + 1
            result["last_step_at"] = time.monotonic()
    result["seconds"], result["error"] = expect_fault(train)
    result["since_last_step"] = time.monotonic() - result.pop("last_step_at")
    return ddp, optimizer, result


def killed(ctx):
    """The last rank is SIGKILLed in the middle of a training loop. The survivors shrink the
    default group to themselves (the watchdog aborted its communicator: a new one is made)
    and run each kind of collective on it; ``death_to_first_collective_s``: from the kill to
    the end of the shrunk group's first all_reduce."""
    ctx.init()
    _, _, result = train_until_killed(ctx, torch.nn.Linear(256, 256).to(ctx.device))
    group = cupycoll.shrink_group([ctx.world - 1])
    x = torch.full((4,), float(ctx.rank + 1), device=ctx.device)
    dist.all_reduce(x)
    torch.cuda.synchronize()
    result["death_to_first_collective_s"] = time.time() - float(ctx.store.get(ctx.key("killed_at")))
    size, rank = group.size(), group.rank()
    gathered = torch.empty(size, device=ctx.device)
    dist.all_gather_into_tensor(gathered, torch.full((1,), float(rank), device=ctx.device))
    scattered = torch.empty(1, device=ctx.device)
    dist.reduce_scatter_tensor(scattered, torch.ones(size, device=ctx.device))
    root = torch.full((2,), float(rank), device=ctx.device)
    dist.broadcast(root, 0)
    peer = torch.full((3,), float(rank), device=ctx.device)
    if rank == 0:
        dist.send(peer, 1)
    else:
        dist.recv(peer, 0)
    dist.barrier()
    torch.cuda.synchronize()
    result["shrunk"] = {"by": group.shrunk_by, "size": size, "sum": x[0].item(), "gathered": gathered.tolist(),
                        "scattered": scattered.item(), "broadcast": root.tolist(), "received": peer.tolist()}
    dist.destroy_process_group()
    return result


def abort_thread(ctx):
    """Rank 0 is stuck in an all_reduce rank 1 never issues; another thread aborts."""
    ctx.init(timeout=120)  # long: the watchdog must not be what frees it
    x = torch.ones(1 << 16, device=ctx.device)
    dist.all_reduce(x)
    torch.cuda.synchronize()
    result = {}
    if ctx.rank == 0:
        aborted_at = []

        def abort_soon():
            time.sleep(1.0)
            aborted_at.append(time.monotonic())
            dist.group.WORLD.abort()
            aborted_at.append(time.monotonic())

        thread = threading.Thread(target=abort_soon)
        dist.all_reduce(x)
        thread.start()
        torch.cuda.synchronize()  # stuck until the abort
        released_at = time.monotonic()
        thread.join()
        result["release_after_abort_s"] = released_at - aborted_at[0]
        result["abort_call_s"] = aborted_at[1] - aborted_at[0]
        result["later_seconds"], result["later_error"] = expect_fault(lambda: dist.all_reduce(x))
        ctx.store.set(ctx.key("aborted"), "1")
    else:
        ctx.wait_for("aborted")
    dist.destroy_process_group()
    return result


def never_joins(ctx):
    """The last rank joins the store rendezvous but never creates the NCCL communicator."""
    result = {}
    if ctx.rank == ctx.world - 1:
        ctx.init(eager=False)  # in the group (gloo connects), but no NCCL communicator
        ctx.wait_for("init-failed")
        dist.destroy_process_group()
        return result
    start = time.monotonic()
    try:
        ctx.init(eager=True)
        result["error"] = None
    except Exception as exc:  # torch may wrap the backend's error
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["error_types"] = [cls.__name__ for cls in type(exc).__mro__]
        forget_failed_init()
    result["seconds"] = time.monotonic() - start
    ctx.last_of("failed", ctx.world - 1, then="init-failed")
    if dist.is_initialized():
        dist.destroy_process_group()
    return result


def forget_failed_init():
    """After an init_process_group that raised: name the next default group as a rank whose
    init succeeded and was destroyed does. torch counts the group before creating it and
    only destroy_process_group resets the count, so otherwise the next default group's
    store prefix here ("1/") differs from the other ranks' ("0/") and its rendezvous waits
    for good."""
    from torch.distributed import distributed_c10d
    if not dist.is_initialized():
        distributed_c10d._world.group_count = 0


def _resources():
    free, _total = torch.cuda.mem_get_info()
    return {"gpu_free": free, "process_gpu_mib": process_gpu_mib(), "threads": len(os.listdir("/proc/self/task")),
            "fds": len(os.listdir("/proc/self/fd"))}


def process_gpu_mib(pid=None):
    """This process's GPU memory (MiB) as the driver reports it (NVML, or nvidia-smi), or
    None where it cannot."""
    return gpu_info.process_memory_mib(pid)


def cycles(ctx, count=50, warm=5):
    """init, all_reduce, abort, destroy: ``count`` times; resources sampled after ``warm``
    cycles (NCCL's one-time allocations done) and after the last."""
    samples = []
    for cycle in range(count):
        group = ctx.init()
        x = torch.full((1 << 16,), float(cycle), device=ctx.device)
        dist.all_reduce(x)
        torch.cuda.synchronize()
        # A rank's all_reduce ends when its own part is done, not when its peers have
        # received what it sent (the network proxy may still be sending): aborting at once
        # could cut a peer's collective short. Every rank has its result before any aborts.
        ctx.all_reach(f"reduced/{cycle}")
        assert x[0].item() == cycle * ctx.world, (cycle, x[0].item())
        group.abort()
        dist.destroy_process_group()
        ctx.all_reach(f"cycle-done/{cycle}")
        if cycle in (min(warm, count - 1) - 1, count - 1):
            time.sleep(0.5)  # let NCCL's proxy threads finish exiting
            samples.append(_resources())
    return {"after_warm": samples[0], "after_all": samples[-1], "count": count}


def recover(ctx):
    """Three times: train, a peer skips a collective (fault: the others' time out), every
    rank aborts and builds a new group on a new store prefix, and training goes on from the
    same model. The skipped collective is one every rank has run on this communicator
    before, and the skipping rank keeps its communicator until the others have their error:
    otherwise it is the cold case (cold_skip), where a blocking communicator's call hangs in
    the host while NCCL connects what that collective needs, and no timeout can end it.
    DDP's bucket all_reduce does not warm a smaller one: NCCL may pick another algorithm or
    protocol for it, with connections of its own."""
    model = torch.nn.Linear(64, 64).to(ctx.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    result = {"faults": [], "steps_after_recovery": []}
    for round_ in range(3):
        ctx.init()
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[ctx.device.index])
        for _ in range(5):
            ddp(torch.randn(8, 64, device=ctx.device)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        torch.cuda.synchronize()
        result["steps_after_recovery"].append(5)
        x = torch.ones(4, device=ctx.device)
        dist.all_reduce(x)  # the collective the fault skips, once by every rank: connected
        torch.cuda.synchronize()
        if ctx.rank == ctx.world - 1:
            ctx.wait_for(f"faulted-{round_}")  # this rank "fails": it skips the collective
            dist.group.WORLD.abort()
            error = "skipped"
        else:
            def collective():
                dist.all_reduce(x)
                torch.cuda.synchronize()
                dist.all_reduce(x)
            _seconds, error = expect_fault(collective)
            ctx.last_of(f"faulted/{round_}", ctx.world - 1, then=f"faulted-{round_}")
        result["faults"].append(error)
        del ddp
        dist.destroy_process_group()
        ctx.all_reach(f"round-{round_}")
    # parameters stayed identical across ranks through the recoveries
    ctx.init()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(ctx.world)]
    dist.all_gather(gathered, flat)
    result["params_equal"] = all(torch.equal(gathered[0], g) for g in gathered)
    dist.destroy_process_group()
    return result


def shrink(ctx):
    """Recovery in place. The last rank leaves a healthy group: the others shrink it to
    themselves (the default group; ncclCommShrink on its communicator) and train on. Then
    rank 1 skips a collective: rank 0's times out, the watchdog aborts the communicator, and
    rank 0 shrinks the faulted group to itself (a communicator made anew)."""
    model = torch.nn.Linear(64, 64).to(ctx.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    group = ctx.init()
    x = torch.ones(4, device=ctx.device)
    dist.all_reduce(x)
    torch.cuda.synchronize()
    result = {"before": x[0].item()}
    if ctx.rank == ctx.world - 1:
        ctx.wait_for("shrunk")  # the survivors shrink without it; then it lets its group go
        group.abort()
        dist.destroy_process_group()
        return result
    started = time.monotonic()
    healthy = cupycoll.shrink_group([ctx.world - 1])
    result["healthy"] = {"seconds": time.monotonic() - started, "by": healthy.shrunk_by,
                         "size": healthy.size(), "is_default": healthy is dist.group.WORLD}
    ctx.all_reach_of("shrunk-ready", ctx.world - 1)
    ctx.store.set(ctx.key("shrunk"), "1")
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[ctx.device.index])
    for _ in range(3):
        ddp(torch.randn(8, 64, device=ctx.device)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    del ddp
    y = torch.full((4,), float(ctx.rank + 1), device=ctx.device)
    dist.all_reduce(y)
    torch.cuda.synchronize()
    result["healthy"]["sum"] = y[0].item()
    if ctx.rank == 1:  # fails: skips the collective rank 0 makes
        healthy.abort()
        ctx.wait_for("shrunk-again")
        dist.destroy_process_group()
        return result
    result["fault"] = expect_fault(lambda: (dist.all_reduce(y), torch.cuda.synchronize(), dist.all_reduce(y)))[1]
    started = time.monotonic()
    alone = cupycoll.shrink_group([1])
    z = torch.full((4,), 5.0, device=ctx.device)
    dist.all_reduce(z)
    torch.cuda.synchronize()
    result["faulted"] = {"seconds": time.monotonic() - started, "by": alone.shrunk_by, "size": alone.size(),
                         "sum": z[0].item()}
    ctx.store.set(ctx.key("shrunk-again"), "1")
    dist.destroy_process_group()
    return result


SCENARIOS = {f.__name__: f for f in (skip, skip_lazy, killed, abort_thread, never_joins, cycles, recover, shrink)}

if __name__ == "__main__":
    main()
