"""One rank of the GPU faults that tests/workers/fault_worker.py's suite lacks; read by
tests/gpu/test_gpu_faults.py.

Usage: gpu_hang_worker.py SCENARIO MODE OUT_DIR [CYCLES]; MODE "blocking" or "nonblocking".
Each rank writes OUT_DIR/<scenario>-rank<N>.json and exits 0 (except a rank killed on purpose).

* cold_skip: the last rank skips the FIRST collective after an eager init (device_id, no
  warm-up): NCCL connects lazily inside that first call. In blocking mode the caller may be
  blocked in the host inside NCCL, where the watchdog cannot see it (docs/design.md,
  "Decision: blocking communicators by default, for now"); a deadline thread then records
  ``"outcome": "hang"`` with the stacks and ends the rank, so the tier records what happened
  instead of hanging. When the timeout ends rank 0's process instead (exit 70), the
  skipper's wait on the store (rank 0 hosts it) ends with it, and the skipper records that.
  Rank 0 records what the Work said right after ``torch.cuda.synchronize()`` returned (it
  must already say failed: Works are failed before the abort).
* kill_mid_ddp: 3 ranks train DDP; the last is SIGKILLed at step 20. The survivors'
  error latency, ``destroy_process_group`` time, whether their parameters still agree
  (an aborted last bucket may already be applied), then the documented recovery:
  restore the checkpoint of step 10, a new 2-rank group, 5 more steps, parameters equal and
  finite; threads and fds before the fault and after recovery.
* cycles: CYCLES (default 200) init -> all_reduce -> abort -> destroy cycles; after the
  warm-up and at the end: GPU memory (this process's, from the driver, and the device's free
  memory), torch's reserved memory, threads, fds and the store's key count.
* cuda_hang: 2 ranks on CUDA with CUPYCOLL_TRACE_DIR set: 3 all_reduces and a
  broadcast, then rank 1 sleeps through all_reduce #5; rank 0's CollectiveTimeoutError must
  name rank 1 as behind (the watchdog's diagnosis).
* pair_abort: 2 ranks, communicators made lazily, a send/recv (a pair communicator) then an
  all_reduce (the group's), then rank 1 skips an all_reduce: rank 0's timeout must end within
  its bound with the Works' tensors released, although the group's end aborts two
  communicators and, with ``NCCL_CUMEM_ENABLE=0`` (the launch's environment), one's free
  synchronises the device behind the other's stuck kernel (they are aborted side by side).
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore

import cupycoll
try:  # run as a script (tests/workers on sys.path) or imported as workers.gpu_hang_worker
    from fault_worker import TIMEOUT_S, Context, expect_fault, process_gpu_mib, train_until_killed
except ImportError:
    from workers.fault_worker import TIMEOUT_S, Context, expect_fault, process_gpu_mib, train_until_killed

SCENARIOS = ("cold_skip", "kill_mid_ddp", "cycles", "cuda_hang", "pair_abort")
WORLDS = {"cold_skip": 2, "kill_mid_ddp": 3, "cycles": 2, "cuda_hang": 2, "pair_abort": 2}
DEFAULT_CYCLES = 200  # enough for a leak of a little a cycle to show; the tier passes fewer
HANG_DEADLINE_S = TIMEOUT_S + 12  # cold_skip: past this the caller counts as hung in the host
KILL_AT_STEP, CHECKPOINT_AT_STEP = 20, 10
HANG_SLEEP_S = 16  # cuda_hang: rank 1 outlives rank 0's timeout (5 s) and diagnosis (<= 5 s)


def parse_args(argv):
    """(scenario, mode, out_dir, cycles) from ``argv`` (sys.argv[1:]); ValueError if wrong."""
    if len(argv) not in (3, 4):
        raise ValueError("usage: gpu_hang_worker.py SCENARIO MODE OUT_DIR [CYCLES]")
    scenario, mode, out_dir = argv[:3]
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; one of {SCENARIOS}")
    if mode not in ("blocking", "nonblocking"):
        raise ValueError(f"mode must be blocking or nonblocking, not {mode!r}")
    cycles = int(argv[3]) if len(argv) == 4 else DEFAULT_CYCLES
    if cycles < 2:
        raise ValueError(f"cycles must be >= 2, not {cycles}")
    return scenario, mode, out_dir, cycles


def main() -> None:
    scenario, mode, out_dir, cycles_count = parse_args(sys.argv[1:])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0,
                          timeout=datetime.timedelta(seconds=60))
    ctx = Context(rank, world, device, store, mode == "nonblocking")
    ctx.scope = scenario
    ctx.out_path = os.path.join(out_dir, f"{scenario}-rank{rank}.json")
    try:
        result = cycles(ctx, cycles_count) if scenario == "cycles" else globals()[scenario](ctx)
    except Exception:  # noqa: BLE001 - recorded for the test
        traceback.print_exc()
        result = {"crashed": traceback.format_exc()[-3000:]}
    write(ctx.out_path, result)
    survivors = world - 1 if scenario == "kill_mid_ddp" else world
    store_add_quietly(store, "exited")
    if rank == 0:  # the store's host outlives the others' last use of it
        deadline = time.monotonic() + 30
        while store_add_quietly(store, "exited", 0) < survivors and time.monotonic() < deadline:
            time.sleep(0.05)
    os._exit(0)  # a faulted group's NCCL state is gone; skip interpreter teardown races


def write(path, result):
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(result or {}, fh)
    os.replace(tmp, path)


def store_add_quietly(store, key, amount=1):
    try:
        return store.add(key, amount)
    except Exception:  # noqa: BLE001 - the store's host may be gone: nothing left to wait for
        return 1 << 30


def work_state(work):
    """What a Work says about itself, each call guarded (one may raise)."""
    state = {}
    for name in ("is_completed", "is_success", "exception"):
        try:
            value = getattr(work, name)()
            state[name] = value if isinstance(value, bool) or value is None else f"{type(value).__name__}: {value}"
        except Exception as exc:  # noqa: BLE001 - recorded
            state[name] = f"raised {type(exc).__name__}: {exc}"
    return state


def _stacks():
    with tempfile.TemporaryFile("w+") as fh:
        faulthandler.dump_traceback(fh, all_threads=True)
        fh.seek(0)
        return fh.read()[-4000:]


# -- cold_skip -------------------------------------------------------------------------------
def cold_skip(ctx):
    ctx.init(eager=True)  # device_id: the communicator exists, no collective has run
    x = torch.ones(1 << 16, device=ctx.device)
    if ctx.rank == ctx.world - 1:
        try:
            ctx.wait_for("done", seconds=HANG_DEADLINE_S + 20)  # alive, but never issues it
        except dist.DistError:  # rank 0 hosts the store: its process ended (blocking: exit 70)
            return {"skipped": True, "store_host_ended": True}
        return {"skipped": True}
    result = {"timeout_s": TIMEOUT_S, "mode": "nonblocking" if ctx.nonblocking else "blocking"}
    start = time.monotonic()
    stage = {"where": "issuing all_reduce (NCCL connects in this call)"}

    def deadline():
        # Runs only if the main thread released the GIL (it is inside NCCL); otherwise the
        # test's own limit ends the ranks and the test records an external timeout.
        if finished.wait(HANG_DEADLINE_S):
            return
        result.update(outcome="hang", seconds=time.monotonic() - start, stuck_in=stage["where"], stacks=_stacks())
        write(ctx.out_path, result)
        ctx.store.set(ctx.key("done"), "1")
        time.sleep(2)  # this rank hosts the store: the skipper reads "done" first
        os._exit(0)

    finished = threading.Event()
    threading.Thread(target=deadline, daemon=True).start()

    def collective():
        work = dist.all_reduce(x, async_op=True)
        result["issue_s"] = time.monotonic() - start
        stage["where"] = "work.wait()"
        work.wait()
        stage["where"] = "torch.cuda.synchronize()"
        torch.cuda.synchronize()
        result["after_sync"] = work_state(work)  # failed before the abort: must already say so
        stage["where"] = "work.wait() after synchronize"
        work.wait()

    result["seconds"], result["error"] = expect_fault(collective)
    result["outcome"] = "error" if result["error"] else "no error"
    result["later_seconds"], result["later_error"] = expect_fault(lambda: dist.all_reduce(x))
    finished.set()
    ctx.store.set(ctx.key("done"), "1")
    dist.destroy_process_group()
    return result


# -- kill_mid_ddp ----------------------------------------------------------------------------
def _resources():
    return {"threads": len(os.listdir("/proc/self/task")), "fds": len(os.listdir("/proc/self/fd"))}


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _agree(ctx, world, flat):
    """(parameters equal on every rank of the group, all finite)."""
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    return all(torch.equal(gathered[0], g) for g in gathered), all(bool(torch.isfinite(g).all()) for g in gathered)


def kill_mid_ddp(ctx):
    ctx.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256).to(ctx.device)
    checkpoint = {}
    before = {}

    def save_checkpoint(step, optimizer):
        if step == CHECKPOINT_AT_STEP:
            checkpoint["model"] = {k: v.clone() for k, v in model.state_dict().items()}
            checkpoint["optimizer"] = optimizer.state_dict()
            before["resources"] = _resources()

    ddp, optimizer, trained = train_until_killed(ctx, model, KILL_AT_STEP, save_checkpoint)
    result = {"timeout_s": TIMEOUT_S, "before": before.get("resources"), "steps": trained.get("steps"),
              "seconds": trained["seconds"], "error": trained["error"],
              "error_after_last_step_s": trained["since_last_step"]}
    del ddp
    start = time.monotonic()
    dist.destroy_process_group()
    result["destroy_s"] = time.monotonic() - start
    # Recovery among the survivors: a 2-rank group on a new store prefix.
    survivors = ctx.world - 1
    start = time.monotonic()
    ctx.cycle += 1
    dist.init_process_group(
        "cpu:gloo,cuda:cupycoll", store=PrefixStore(f"recovery{ctx.cycle}/", ctx.store), rank=ctx.rank,
        world_size=survivors, timeout=datetime.timedelta(seconds=60), device_id=ctx.device,
        pg_options=cupycoll.Options(timeout=TIMEOUT_S, nonblocking=ctx.nonblocking, watchdog_interval=0.05))
    result["reinit_s"] = time.monotonic() - start
    # Without a restore the survivors may disagree (the aborted step may be applied)
    result["equal_without_restore"], result["finite_without_restore"] = _agree(ctx, survivors, _flat(model))
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[ctx.device.index])
    for _ in range(5):
        loss = ddp(torch.randn(32, 256, device=ctx.device)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    torch.cuda.synchronize()
    result["params_equal"], result["params_finite"] = _agree(ctx, survivors, _flat(model))
    result["recovery_s"] = time.monotonic() - start
    del ddp
    dist.destroy_process_group()
    time.sleep(0.5)  # NCCL's proxy threads finish exiting
    result["after"] = _resources()
    return result


# -- cycles ----------------------------------------------------------------------------------
def _sample(store):
    free, _total = torch.cuda.mem_get_info()
    return {"gpu_free": free, "process_gpu_mib": process_gpu_mib(), "reserved": torch.cuda.memory_reserved(),
            "store_keys": store.num_keys(), **_resources()}


def cycles(ctx, count=DEFAULT_CYCLES, warm=5):
    """init, all_reduce, abort, destroy, ``count`` times on fresh store prefixes; samples
    after ``warm`` cycles (NCCL's one-time allocations done), at the middle and at the end.
    A fresh prefix costs a fixed number of store keys per cycle (torch's rendezvous and
    cupycoll's communicator keys; TCPStore cannot delete a prefix): "flat" for keys means
    the second half adds no more per cycle than the first."""
    warm = min(warm, count // 2)
    marks = {warm - 1: "after_warm", warm - 1 + (count - warm) // 2: "middle", count - 1: "after_all"}
    result = {"count": count, "warm": warm}
    start = time.monotonic()
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
        if cycle in marks:
            time.sleep(0.5)  # let NCCL's proxy threads finish exiting
            ctx.all_reach(f"sample/{cycle}")  # every rank's keys counted at the same point
            result[marks[cycle]] = _sample(ctx.store)
            result[marks[cycle]]["cycle"] = cycle
            ctx.all_reach(f"sampled/{cycle}")  # no rank adds keys before all have counted
    result["seconds_per_cycle"] = (time.monotonic() - start) / count
    return result


# -- cuda_hang -------------------------------------------------------------------------------
def cuda_hang(ctx):
    dist.init_process_group("cpu:gloo,cuda:cupycoll", store=PrefixStore("hang/", ctx.store), rank=ctx.rank,
                            world_size=ctx.world, timeout=datetime.timedelta(seconds=TIMEOUT_S),
                            device_id=ctx.device,
                            pg_options=cupycoll.Options(nonblocking=ctx.nonblocking, watchdog_interval=0.05))
    report = {"rank": ctx.rank, "group": type(dist.group.WORLD).__name__, "timeout_s": TIMEOUT_S}
    t = torch.ones(1024, device=ctx.device)
    for _ in range(3):
        dist.all_reduce(t)  # #1-#3
    dist.broadcast(t, 0)  # #4
    torch.cuda.synchronize()
    start = time.monotonic()
    if ctx.rank == ctx.world - 1:
        time.sleep(HANG_SLEEP_S)  # busy elsewhere: rank 0 times out and asks where it is
    else:
        work = None
        try:
            work = dist.all_reduce(t, async_op=True)  # #5
            work.wait()
            torch.cuda.synchronize()
            report["after_sync"] = work_state(work)
            work.wait()
            report["error"] = None
        except Exception as exc:  # noqa: BLE001 - reported
            report.update(error=str(exc), type=type(exc).__name__,
                          timeout=isinstance(exc, cupycoll.CollectiveTimeoutError))
    report["elapsed_s"] = time.monotonic() - start
    return report


# -- pair_abort ------------------------------------------------------------------------------
def pair_abort(ctx):
    group = ctx.init(eager=False)  # lazily: the send/recv takes a pair communicator of its own
    report = {"rank": ctx.rank, "cumem": os.environ.get("NCCL_CUMEM_ENABLE", "default"), "timeout_s": TIMEOUT_S}
    t = torch.ones(1 << 16, device=ctx.device)
    peer = 1 - ctx.rank
    ops = [dist.P2POp(dist.isend, t, peer), dist.P2POp(dist.irecv, torch.empty_like(t), peer)]
    for work in dist.batch_isend_irecv(ops) if ctx.rank == 0 else dist.batch_isend_irecv(ops[::-1]):
        work.wait()
    dist.send(t, peer) if ctx.rank == 0 else dist.recv(t, peer)  # a lone one: a pair communicator
    dist.all_reduce(t)
    torch.cuda.synchronize()
    cuda = group._get_backend(torch.device("cuda"))
    report["communicators"] = len(cuda.communicators())
    if ctx.rank == 1:
        ctx.wait_for("rank0-done", seconds=TIMEOUT_S + 40)
        return report
    start = time.monotonic()
    seconds, error = expect_fault(lambda: (dist.all_reduce(t, async_op=True).wait(), torch.cuda.synchronize()))
    ended = cuda.life.ended.wait(TIMEOUT_S + 40)
    report.update(seconds=seconds, error=error, ended=ended, ended_s=time.monotonic() - start,
                  in_flight=cuda.watch.in_flight(), state=str(cuda.state))
    ctx.store.set(ctx.key("rank0-done"), "1")
    return report


if __name__ == "__main__":
    main()
