"""Recover in place: a rank dies mid-step, the others shrink the group and train on.

Three ranks train a small model with DistributedDataParallel on cupycoll (CPU tensors: the
gloo route; ``--device cuda`` for the GPUs), rank 0 writing a checkpoint every few steps.
At ``--kill-step`` the last rank is killed (SIGKILL) between its forward and its backward.
The others' gradient all_reduce fails with cupycoll's ``PeerFailedError`` naming it (DDP's C++
reducer hands it back from ``loss.backward()`` as a ``RuntimeError`` with its text); they call
``cupycoll.shrink_group([dead_rank])``, restore the last checkpoint (model and optimizer)
and train the remaining steps as a job of two. No process is restarted and no new
``init_process_group`` is written by the user.

    python examples/shrink_ddp.py                      # 3 ranks on CPU, the last one killed
    python examples/shrink_ddp.py --out /tmp/run       # and keep the checkpoint and results

It ends with its verdict: ``shrink_ddp: OK`` (exit 0) when the killed rank died, every other
rank recovered and they all ended with the same parameters, else ``shrink_ddp: FAILED``
saying why (exit 1). Without ``--out`` its temporary folder is deleted at the end.

``--from-checkpoint FILE --nproc 2`` trains a plain job of two from a checkpoint: the
reference whose final parameters the survivors' must equal (tests/multiproc/test_examples.py).

This script is its own launcher: it hosts the job's store and starts the ranks. torchrun
would not do here: its agent stops every rank when one fails, which is the very thing in-place
recovery avoids (a launcher that keeps the survivors running and the store alive is what the
job needs; the store must outlive every rank it serves).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import shutil
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import cupycoll  # registers the "cupycoll" backend with torch.distributed

FEATURES, HIDDEN, BATCH = 16, 32, 16


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=3, help="ranks to start (default: 3)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--kill-step", type=int, default=12,
                   help="the step in which the last rank is killed (-1: none)")
    p.add_argument("--from-checkpoint", metavar="FILE",
                   help="start from this checkpoint (its step, model and optimizer), kill no rank")
    p.add_argument("--timeout", type=float, default=30, help="the group timeout, seconds")
    p.add_argument("--out", help="folder for the checkpoint and each rank's result (default: a temporary one)")
    return p.parse_args(argv)


def batch(step: int, rank: int):
    """The data of (step, rank): the same whichever job computes it."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, FEATURES, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def new_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1))


def wrap(model, device) -> DDP:
    """``model`` in DDP over the current default group (which a shrink replaces)."""
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


def save_checkpoint(path: str, step: int, model, optimizer) -> None:
    partial = path + ".partial"
    torch.save({"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict()}, partial)
    os.replace(partial, path)  # never a half-written checkpoint


def restore(path: str, model, optimizer) -> int:
    state = torch.load(path)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["step"]


def run_rank(args, rank: int, world: int) -> int:
    device = torch.device("cuda", rank % torch.cuda.device_count()) if args.device == "cuda" else torch.device("cpu")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("cupycoll", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    model = new_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    checkpoint = os.path.join(args.out, "checkpoint.pt")
    step = 0
    if args.from_checkpoint:
        step = restore(args.from_checkpoint, model, optimizer)
    ddp = wrap(model, device)
    report = {"rank": rank, "recovered": None}
    while step < args.steps:
        try:
            x, y = (t.to(device) for t in batch(step, dist.get_rank()))
            loss = F.mse_loss(ddp(x), y)
            if step == args.kill_step and rank == world - 1:
                store.set("killed_at", repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)  # dies mid-step: its peers wait in backward
            optimizer.zero_grad()
            loss.backward()  # the gradients' all_reduce: where the peers see the death on CPU
            optimizer.step()  # on CUDA the error may come at a later call: the whole step is tried
        except RuntimeError as error:  # PeerFailedError; through DDP's C++ reducer, its text
            seen = time.monotonic()
            print(f"rank {rank}: step {step} failed: {str(error).splitlines()[0]}", file=sys.stderr)
            dead, failed_step = world - 1, step  # the rank the error names (here: the one killed)
            group = cupycoll.shrink_group([dead])  # the survivors' group, now the default one
            step = restore(checkpoint, model, optimizer)
            ddp = wrap(model, device)  # its first collective, on the shrunk group
            report["recovered"] = {
                "error_type": type(error).__name__, "error": str(error).splitlines()[0],
                "failed_step": failed_step, "restored_step": step, "shrunk_size": group.size(),
                "seconds_error_to_shrunk_group": time.monotonic() - seen,
                "seconds_death_to_shrunk_group": time.time() - float(store.get("killed_at"))}
            print(f"rank {rank}: shrunk to {group.size()} ranks, back at step {step}; "
                  f"{report['recovered']['seconds_death_to_shrunk_group']:.1f} s from the death to the "
                  "shrunk group's first collective", file=sys.stderr)
            continue
        step += 1
        if rank == 0 and step % args.checkpoint_every == 0 and step < args.steps:
            save_checkpoint(checkpoint, step, model, optimizer)
    report["params"] = [p.detach().cpu().flatten().tolist() for p in model.parameters()]
    report["world_size"] = dist.get_world_size()
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as fh:
        json.dump(report, fh)
    dist.destroy_process_group()
    return 0


def launch(args, argv) -> int:
    """Host the store, start the ranks, wait for them: a rank's death ends only that rank."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
               WORLD_SIZE=str(args.nproc), CUPYCOLL_SHRINK_DDP_OUT=args.out)
    ranks = [subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv], env=dict(env, RANK=str(r)))
             for r in range(args.nproc)]
    codes = [rank.wait() for rank in ranks]
    problems = verdict(args, codes)
    print(f"shrink_ddp: {'FAILED: ' + '; '.join(problems) if problems else 'OK'}")
    return 1 if problems else 0


def verdict(args, codes) -> list:
    """What went wrong, from the ranks' exit codes and result files (an empty list: nothing).
    Prints what the survivors did."""
    killed = args.nproc - 1 if args.kill_step >= 0 else None
    expected = [-signal.SIGKILL if r == killed else 0 for r in range(args.nproc)]
    if codes != expected:
        return [f"exit codes {codes}, expected {expected}"]
    reports = []
    for rank in range(args.nproc):
        if rank != killed:
            with open(os.path.join(args.out, f"rank{rank}.json")) as fh:
                reports.append(json.load(fh))
    problems = []
    if killed is not None:
        for report in reports:
            recovered = report["recovered"]
            if recovered is None:
                problems.append(f"rank {report['rank']} never saw rank {killed} die")
            elif recovered["shrunk_size"] != args.nproc - 1:
                problems.append(f"rank {report['rank']} shrank to {recovered['shrunk_size']} ranks")
        if not problems:
            first = reports[0]["recovered"]
            print(f"rank {killed} was killed in step {first['failed_step']}; ranks "
                  f"{', '.join(str(r['rank']) for r in reports)} shrank the group to {first['shrunk_size']}, "
                  f"restored step {first['restored_step']} and trained to step {args.steps} "
                  f"({first['seconds_death_to_shrunk_group']:.1f} s from the death to the shrunk group's first "
                  "collective)")
    if any(report["params"] != reports[0]["params"] for report in reports):
        problems.append("the ranks ended with different parameters")
    return problems


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.from_checkpoint:
        args.kill_step = -1
    if "RANK" in os.environ:
        args.out = os.environ["CUPYCOLL_SHRINK_DDP_OUT"]
        return run_rank(args, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    if args.out is not None:
        os.makedirs(args.out, exist_ok=True)
        status = launch(args, argv)
        print(f"checkpoint and each rank's results: {args.out}")
        return status
    args.out = tempfile.mkdtemp(prefix="shrink_ddp-")
    try:
        return launch(args, argv)
    finally:
        shutil.rmtree(args.out, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
