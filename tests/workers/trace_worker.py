"""One rank of the flight-recorder scenarios (tests/trace/test_trace.py), on CPU only.

Usage: trace_worker.py SCENARIO OUT_DIR

``mismatch``: cupycoll.trace.mismatch.check over a real gloo group: calls that agree, then one
call per kind of mismatch (shape, dtype, op, root, a skipped collective) made by rank 1
only, each of which must raise CupycollValueError on every rank, then a call that agrees
again (the exchange must still line up).

``diagnose``: a timeout diagnosis across processes. Ranks 0 and 1 are stuck in all_reduce
#42; rank 2 completed #41 (broadcast) and serves the responder; rank 3 answers nothing
(stuck outside cupycoll). Ranks 0 and 1 run diagnose_timeout, which also dumps every
answering rank's recorder into OUT_DIR/traces.

Each rank writes OUT_DIR/rank<N>.json with what it saw; the test asserts.
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

from cupycoll.trace import exchange, listener
from cupycoll.trace import mismatch
from cupycoll.trace import recorder
from cupycoll.errors import CupycollValueError
from epilogue import write_json

WAIT_S = 4.0  # what the peers have to answer in: room for 4 processes on a loaded 2-core box


def mismatch_scenario(rank: int, world: int) -> dict:
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    group = dist.group.WORLD
    out = {"agreed": 0, "raised": {}}
    seq = 0

    def call(op, shape, dtype="float32", root=None, reduce_op=None, skip=False):
        nonlocal seq
        seq += 1
        sig = mismatch.signature(seq + (1 if skip else 0), op, [shape], [dtype], root, reduce_op)
        mismatch.check(group, sig, rank, world, "0")

    for _ in range(3):
        call("all_reduce", (4, 4), reduce_op=dist.ReduceOp.SUM)
        out["agreed"] += 1
    odd = rank == 1
    cases = {
        "shape": dict(op="all_reduce", shape=(4, 3) if odd else (4, 4)),
        "dtype": dict(op="all_reduce", shape=(8,), dtype="float16" if odd else "float32"),
        "op": dict(op="broadcast" if odd else "all_reduce", shape=(8,), root=0 if odd else None),
        "root": dict(op="broadcast", shape=(8,), root=1 if odd else 0),
        "reduce_op": dict(op="all_reduce", shape=(8,),
                          reduce_op=dist.ReduceOp.MAX if odd else dist.ReduceOp.SUM),
        "seq": dict(op="all_reduce", shape=(8,), skip=odd),
    }
    for name, kwargs in cases.items():
        try:
            call(**kwargs)
            out["raised"][name] = None
        except CupycollValueError as exc:
            out["raised"][name] = str(exc)
    # all_to_all's shapes may differ by design: no error.
    call("all_to_all_single", (rank + 1,))
    call("all_reduce", (2,))
    out["agreed"] += 2
    start = time.perf_counter()
    for _ in range(50):
        call("all_reduce", (1024,), reduce_op=dist.ReduceOp.SUM)
    out["check_us"] = (time.perf_counter() - start) / 50 * 1e6
    # No destroy_process_group: main() ends the process with os._exit.
    return out


def diagnose_scenario(rank: int, world: int, out_dir: str) -> dict:
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          rank == 0, timeout=datetime.timedelta(seconds=30))
    trace_dir = os.path.join(out_dir, "traces")
    rec = recorder.new_recorder("0", list(range(world)), rank)
    tensor = torch.empty(1024)
    for seq in range(1, 42):
        op = "broadcast" if seq == 41 else "all_reduce"
        entry = rec.record(op, (tensor.shape,), (tensor.dtype,), 0 if op == "broadcast" else None)
        rec.mark(entry, "completed")
    stuck = None
    if rank in (0, 1):
        stuck = rec.record("all_reduce", ((1048576,),), (torch.float32,))
    if rank != 3:  # rank 3 stands for a rank stuck outside cupycoll: it never answers
        listener.serve(store, rec, trace_dir, interval=0.1)
    store.add("ready", 1)
    while store.add("ready", 0) < world:
        time.sleep(0.01)
    out = {}
    if stuck is not None:
        report = exchange.diagnose_timeout(store, rec, stuck, timeout_s=30, wait_s=WAIT_S,
                                           dump_dir=trace_dir)
        out = {"message": report.message, "elapsed_s": report.elapsed_s,
               "answered": sorted(report.records)}
        store.add("done", 1)
    while store.add("done", 0) < 2:
        time.sleep(0.02)
    listener.unserve(rec)
    # The store's host (rank 0) must outlive the others' last use of it.
    store.add("exited", 1)
    deadline = time.monotonic() + 30
    while rank == 0 and store.add("exited", 0) < world and time.monotonic() < deadline:
        time.sleep(0.02)
    return out


def main() -> None:
    scenario, out_dir = sys.argv[1:3]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if scenario == "mismatch":
        result = mismatch_scenario(rank, world)
    elif scenario == "diagnose":
        result = diagnose_scenario(rank, world, out_dir)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    write_json(out_dir, f"rank{rank}.json", result)
    os._exit(0)  # the responder thread may sit in a store call: no interpreter teardown


if __name__ == "__main__":
    main()
