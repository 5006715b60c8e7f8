"""Fault-tolerant DDP under torchft on cupycoll: a replica killed mid-run, restarted, healed.

Two replicas, each one process (a replica group of one rank), train a small model data
parallel under torchft's Manager (its fault-tolerant all_reduce of the gradients, its
OptimizerWrapper), on cupycoll's torchft process group
(``cupycoll.torchft.ProcessGroupCupycoll``; CPU tensors: cupycoll's gloo route). In step
``--kill-step`` replica 1 is killed (SIGKILL) before its gradient all_reduce. Replica 0 meets
the death in that all_reduce (cupycoll's error, which its Manager takes: the step is
discarded) or, as timing has it, in its next quorum, and trains on alone (a step then takes
``--alone-step-time``, as if the model were larger); the launcher starts replica 1 again,
which heals from replica 0 (torchft sends it replica 0's step, model and optimizer) and
joins; both train to ``--steps``.

    python examples/torchft_ddp.py                    # on cupycoll
    python examples/torchft_ddp.py --backend gloo     # on torchft's own gloo group, to compare

It prints the recovery: how long after the death replica 0 committed a step again, and how
long until both replicas committed one together, the restart included. It ends with its
verdict: ``torchft_ddp: OK`` (exit 0) when the killed replica died, the restarted one healed
(its first committed step lies past the killed one) and both finished with the same
parameters, else ``torchft_ddp: FAILED`` saying why (exit 1). ``--out DIR`` keeps each
replica's record (``replica{N}.json``); without it a temporary folder is deleted at the end.

The gradients go through ``manager.allreduce``, not torchft's DistributedDataParallel: in
torchft 0.2.0 that wrapper's communication hook fails (an AssertionError out of
``loss.backward()``) when a peer dies during its all_reduce, on torchft's gloo group as on
cupycoll's (docs/usage.md, "torchft").

Needs torchft (``pip install torchft==0.2.0``; not a dependency of cupycoll); no GPU. The
script is its own launcher: it runs torchft's lighthouse and starts, waits for and restarts
the replicas.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

FEATURES, HIDDEN, BATCH = 16, 32, 16
REPLICAS = 2
KILLED = 1  # the replica killed mid-run


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["cupycoll", "gloo"], default="cupycoll",
                   help="the replicas' process group: cupycoll's, or torchft's own gloo group")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--kill-step", type=int, default=10, help="the step in which replica 1 is killed")
    p.add_argument("--timeout", type=float, default=10, help="the process group's timeout, seconds")
    p.add_argument("--alone-step-time", type=float, default=0.2,
                   help="seconds a step takes while a replica trains alone (the model is tiny): the restarted "
                        "replica finds replica 0 still training")
    p.add_argument("--out", help="folder for each replica's record (default: a temporary one)")
    return p.parse_args(argv)


def batch(step: int, replica: int):
    """The data of (step, replica): the same whichever incarnation computes it."""
    g = torch.Generator().manual_seed(1000 * step + replica)
    x = torch.randn(BATCH, FEATURES, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def new_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1))


def process_group(backend: str, timeout: datetime.timedelta):
    if backend == "gloo":
        from torchft.process_group import ProcessGroupGloo

        return ProcessGroupGloo(timeout=timeout)
    from cupycoll.torchft import ProcessGroupCupycoll

    return ProcessGroupCupycoll(timeout=timeout)


def all_reduce_gradients(manager, model) -> None:
    """The gradients averaged over the step's participants, as one flat all_reduce: torchft's
    fault-tolerant all_reduce, whose Work's wait() reports a failure to the Manager (the step
    is then not committed) instead of raising."""
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.flatten() for g in grads])
    manager.allreduce(flat).wait()  # ReduceOp.AVG: divided by the participants
    for g, part in zip(grads, torch.split(flat, [g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def run_replica(args, replica: int, restarted: bool) -> int:
    import torch.distributed as dist
    from torchft.manager import Manager
    from torchft.optim import OptimizerWrapper

    timeout = datetime.timedelta(seconds=args.timeout)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the replica group's
    model = new_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def state_dict():
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(state):
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    manager = Manager(pg=process_group(args.backend, timeout), min_replica_size=1, load_state_dict=load_state_dict,
                      state_dict=state_dict, replica_id=str(replica), store_addr="127.0.0.1",
                      store_port=store.port, rank=0, world_size=1,
                      lighthouse_addr=os.environ["TORCHFT_LIGHTHOUSE"], timeout=timeout, quorum_timeout=timeout,
                      connect_timeout=timeout)
    optimizer = OptimizerWrapper(manager, inner)
    record = {"replica": replica, "restarted": restarted, "commits": [], "failures": [], "first_step": None}
    while manager.current_step() < args.steps:
        optimizer.zero_grad()  # starts the step's quorum (a healing replica gets its state in it)
        step = manager.current_step()
        x, y = batch(step, replica)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if replica == KILLED and not restarted and step == args.kill_step:
            with open(os.path.join(args.out, "killed_at"), "w") as fh:
                fh.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)  # dies mid-step: replica 0 waits in its all_reduce
        all_reduce_gradients(manager, model)
        failed = manager.errored()  # the all_reduce's error, reported to the Manager
        if failed is not None:
            record["failures"].append({"step": step, "time": time.time(), "error": str(failed.original_exception)})
        optimizer.step()  # applied only where the Manager commits the step (on every participant)
        if manager.num_participants() < REPLICAS:
            time.sleep(args.alone_step_time)
        if manager.current_step() > step:  # committed (a healing replica's step jumps to its peer's)
            committed = manager.current_step() - 1
            if record["first_step"] is None:
                record["first_step"] = committed
            record["commits"].append({"step": committed, "time": time.time(),
                                      "participants": manager.num_participants()})
    record["params"] = [p.detach().flatten().tolist() for p in model.parameters()]
    with open(os.path.join(args.out, f"replica{replica}.json"), "w") as fh:
        json.dump(record, fh)
    manager.shutdown(wait=False)
    return 0


def launch(args, argv) -> int:
    """Run the lighthouse and the replicas; restart the killed one once it has died."""
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=1000)
    env = dict(os.environ, TORCHFT_LIGHTHOUSE=lighthouse.address(), CUPYCOLL_TORCHFT_DDP_OUT=args.out)

    def start(replica: int, restarted: bool = False) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv],
                                env=dict(env, TORCHFT_DDP_REPLICA=str(replica),
                                         TORCHFT_DDP_RESTARTED=str(int(restarted))))

    try:
        replicas = [start(r) for r in range(REPLICAS)]
        killed_code = replicas[KILLED].wait()
        restarted_at = time.time()
        restarted = start(KILLED, restarted=True)
        codes = [replicas[0].wait(), killed_code, restarted.wait()]
    finally:
        lighthouse.shutdown()
    problems = verdict(args, codes, restarted_at)
    print(f"torchft_ddp: {'FAILED: ' + '; '.join(problems) if problems else 'OK'}")
    return 1 if problems else 0


def verdict(args, codes, restarted_at: float) -> list:
    """What went wrong (an empty list: nothing); prints the recovery times."""
    expected = [0, -signal.SIGKILL, 0]
    if codes != expected:
        return [f"exit codes (replica 0, replica 1, replica 1 restarted) {codes}, expected {expected}"]
    with open(os.path.join(args.out, "killed_at")) as fh:
        killed_at = float(fh.read())
    records = []
    for replica in range(REPLICAS):
        with open(os.path.join(args.out, f"replica{replica}.json")) as fh:
            records.append(json.load(fh))
    survivor, back = records
    problems = []
    if back["first_step"] is None or back["first_step"] <= args.kill_step:
        problems.append(f"the restarted replica first committed step {back['first_step']}, not one past step "
                        f"{args.kill_step}: it did not heal from replica 0")
    alone = [c for c in survivor["commits"] if c["time"] > killed_at and c["step"] >= args.kill_step]
    together = [c for c in back["commits"] if c["participants"] == REPLICAS]
    if not alone or not together:
        problems.append("no step was committed after the death" if not alone else
                        "the replicas never committed a step together again")
    else:
        print(f"[{args.backend}] replica {KILLED} was killed in step {args.kill_step} and restarted "
              f"{restarted_at - killed_at:.1f} s later; replica 0 committed step {alone[0]['step']} "
              f"{alone[0]['time'] - killed_at:.1f} s after the death (with {alone[0]['participants']} "
              f"participant{'s' if alone[0]['participants'] != 1 else ''}); both committed step "
              f"{together[0]['step']} together {together[0]['time'] - killed_at:.1f} s after the death "
              f"(recovery time); both reached step {args.steps}")
    if survivor["params"] != back["params"]:
        problems.append("the replicas ended with different parameters")
    return problems


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if "TORCHFT_DDP_REPLICA" in os.environ:
        args.out = os.environ["CUPYCOLL_TORCHFT_DDP_OUT"]
        restarted = os.environ["TORCHFT_DDP_RESTARTED"] == "1"
        return run_replica(args, int(os.environ["TORCHFT_DDP_REPLICA"]), restarted)
    try:
        import torchft  # noqa: F401
    except ImportError:
        print("torchft_ddp: this example needs torchft (pip install torchft==0.2.0)", file=sys.stderr)
        return 2
    if args.out is not None:
        os.makedirs(args.out, exist_ok=True)
        status = launch(args, argv)
        print(f"each replica's record: {args.out}")
        return status
    args.out = tempfile.mkdtemp(prefix="torchft_ddp-")
    try:
        return launch(args, argv)
    finally:
        shutil.rmtree(args.out, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
