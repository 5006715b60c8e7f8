"""One rank of the recovery scenarios (tests/faults/test_recovery.py), on the CPU route.
Writes ``<out>/rank<R>.json``; times are wall-clock seconds (``time.time()``), so that the
test can set them against the moment the last rank died or hung.

usage: recovery_worker.py OUT_DIR SCENARIO TIMEOUT_S

* ``death``: the last rank leaves after a barrier without a word; every other rank is in a
  synchronous all_reduce loop and records the error it gets and when. Its gloo neighbours
  see the connection close at once; the others only at their timeout, unless the fault is
  published (CUPYCOLL_PUBLISH_FAULTS).
* ``shrink``: as ``death``, then each survivor calls ``cupycoll.shrink_group([last])`` on its
  error (rank 1 ``RECOVERY_LATE_S`` seconds later) and runs one all_reduce on the shrunk
  group, recording when it began and finished.
* ``hung``: 2 ranks; rank 1 stops itself (SIGSTOP: neither its main thread nor its listener
  answers) after a barrier; rank 0 issues 4 asynchronous all_reduces and waits on each,
  recording each error and when, then ends rank 1 (SIGKILL).
* ``torch_shrink``: 2 ranks; rank 0 calls torch's own ``dist.shrink_group([1])`` on the
  cupycoll default group, records what it raises, then runs an all_reduce with rank 1 (the
  group must be as it was).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import cupycoll
from epilogue import write_json


def _error(exc: BaseException) -> dict:
    return {"type": type(exc).__name__, "text": str(exc)[:600], "at": time.time(),
            "mro": [c.__name__ for c in type(exc).__mro__]}


def main() -> int:
    out_dir, scenario, timeout_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    last = world - 1
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0,
                          timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("cupycoll", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    report = {"rank": rank}
    t = torch.ones(4)
    dist.all_reduce(t)
    dist.barrier()
    if scenario == "torch_shrink":
        if rank == 0:
            try:
                dist.shrink_group([1])
                report["raised"] = None
            except Exception as exc:  # noqa: BLE001 - reported
                report["raised"] = _error(exc)
        x = torch.ones(2)
        dist.all_reduce(x)
        report["after"] = x.tolist()
        write_json(out_dir, f"rank{rank}.json", report)
        dist.destroy_process_group()
        return 0
    if scenario == "hung":
        if rank == 1:
            report.update(hang=time.time(), pid=os.getpid())
            write_json(out_dir, f"rank{rank}.json", report)
            os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(600)
        time.sleep(0.5)
        works = [dist.all_reduce(torch.ones(4), async_op=True) for _ in range(4)]
        report["errors"] = []
        for work in works:
            try:
                work.wait()
                report["errors"].append(None)
            except Exception as exc:  # noqa: BLE001 - reported
                report["errors"].append(_error(exc))
        write_json(out_dir, f"rank{rank}.json", report)
        with open(os.path.join(out_dir, "rank1.json"), encoding="utf-8") as fh:
            os.kill(json.load(fh)["pid"], signal.SIGKILL)  # the stopped rank ends no other way
        os._exit(0)
    if rank == last:  # death, shrink
        time.sleep(0.5)
        report["death"] = time.time()
        write_json(out_dir, f"rank{rank}.json", report)
        os._exit(0)
    while True:
        try:
            dist.all_reduce(torch.ones(4))
            time.sleep(0.01)
        except Exception as exc:  # noqa: BLE001 - reported
            report["error"] = _error(exc)
            break
    if scenario == "shrink":
        # RECOVERY_LATE_S: rank 1 acts on its error that much later, as a rank that learns of
        # the death last would (whether gloo shows a rank the closed connection at once
        # depends on its pair order and release).
        if rank == 1:
            time.sleep(float(os.environ.get("RECOVERY_LATE_S", "0")))
        report["shrink_at"] = time.time()
        try:
            group = cupycoll.shrink_group([last])
            x = torch.ones(4)
            dist.all_reduce(x, group=group)
            report.update(first_at=time.time(), after=x.tolist(), size=group.size())
        except Exception as exc:  # noqa: BLE001 - reported
            report["shrink_error"] = _error(exc)
    write_json(out_dir, f"rank{rank}.json", report)
    # The store lives on rank 0: it leaves last, once the others have written their reports.
    if rank == 0:
        deadline = time.time() + 30
        while time.time() < deadline and not all(
                os.path.exists(os.path.join(out_dir, f"rank{r}.json")) for r in range(last)):
            time.sleep(0.05)
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
