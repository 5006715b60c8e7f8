"""One rank of a job in which one rank (the last) does not make a collective the others make,
on ``"cuda:cupycoll"`` with CPU tensors: what the others' errors say about it. That string
names no CPU backend, so CPU calls take cupycoll's gloo route, with the flight recorder and
the diagnosis, in both shapes (in the Backend shape through the group's CpuView). With
``"cpu:gloo,cuda:cupycoll"`` that holds in the ProcessGroup shape only: in the Backend shape
torch hands CPU tensors to its own gloo, whose timeout names no rank. Writes
``<out>/rank<R>.json``.

usage: hang_worker.py OUT_DIR skip|kill|mismatch|bad_input

* skip: the last rank makes 3 all_reduces and a broadcast, then sleeps through the 4th
  all_reduce (#5) the others make: they time out (5 s) and must name it as behind;
* kill: the last rank SIGKILLs itself before #5: the others must name it as not answering;
* mismatch: with CUPYCOLL_CHECK_COLLECTIVES=1, rank 1 passes another shape to #5: every rank
  must raise CupycollValueError naming rank 1, then the group must still work;
* bad_input: every rank passes #5 arguments gloo refuses (a uint32 tensor, BAND on float,
  AVG on bool): each must raise gloo's own error for it, ask no other rank and log nothing,
  and the group must still work.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import cupycoll
from cupycoll import compat
from epilogue import write_json


def wait_for_reports(out_dir: str, count: int, seconds: float = 30) -> None:
    """Until ``count`` ranks have written their report to ``out_dir`` (or ``seconds`` passed)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and len([n for n in os.listdir(out_dir) if n.startswith("rank")]) < count:
        time.sleep(0.1)


def main() -> int:
    out_dir, scenario = sys.argv[1], sys.argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    last = world - 1
    logged = []  # the cupycoll log: before torch 2.7 a test asserts it stays empty (see compat)
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("cupycoll").addHandler(handler)
    # The rendezvous gets its own generous timeout: with env:// the 5 s below would also bound
    # how far apart the ranks' imports may finish, which a loaded 2-core box can exceed.
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("cuda:cupycoll", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=5))
    store.set_timeout(datetime.timedelta(seconds=5))  # as env:// leaves it
    report = {"rank": rank, "group": type(dist.group.WORLD).__name__}
    t = torch.ones(1024)
    for _ in range(3):
        dist.all_reduce(t)
    dist.broadcast(t, 0)  # #4
    started = time.monotonic()
    if scenario == "mismatch":
        x = torch.ones(8 if rank == 1 else 4)
        try:
            dist.all_reduce(x)
        except Exception as exc:  # noqa: BLE001 - reported
            report.update(error=str(exc), type=type(exc).__name__,
                          value_error=isinstance(exc, cupycoll.CupycollValueError))
        y = torch.full((2,), float(rank))
        dist.all_reduce(y)  # the group still works
        report["after"] = y.tolist()
    elif scenario == "bad_input":
        calls = {"uint32": lambda: dist.all_reduce(torch.ones(2, dtype=torch.uint32)),
                 "band on float": lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND),
                 "avg on bool": lambda: dist.all_reduce(torch.ones(2, dtype=torch.bool), op=dist.ReduceOp.AVG)}
        report["errors"] = {}
        for name, call in calls.items():
            try:
                call()
                report["errors"][name] = None
            except Exception as exc:  # noqa: BLE001 - reported
                report["errors"][name] = {"type": type(exc).__name__, "text": str(exc)[:300],
                                          "cupycoll": isinstance(exc, cupycoll.CupycollError)}
        y = torch.full((2,), float(rank))
        dist.all_reduce(y)  # the group still works
        report["after"] = y.tolist()
    elif rank == last:
        if scenario == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        # Busy elsewhere until the others have timed out, asked this rank where it is (its
        # responder thread answers) and written their reports.
        wait_for_reports(out_dir, last)
    else:
        try:
            dist.all_reduce(t)  # #5
            report["error"] = None
        except Exception as exc:  # noqa: BLE001 - reported
            report.update(error=str(exc), type=type(exc).__name__,
                          timeout=isinstance(exc, cupycoll.CollectiveTimeoutError),
                          peer_failed=isinstance(exc, cupycoll.PeerFailedError))
    report["elapsed_s"] = time.monotonic() - started
    report["log"] = list(logged)
    write_json(out_dir, f"rank{rank}.json", report)
    sys.stdout.flush()
    if rank == 0:  # it hosts the store: the others may still be asking it
        wait_for_reports(out_dir, world - (scenario == "kill"))
    # A group whose collective failed is not torn down collectively: skip the teardown.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
