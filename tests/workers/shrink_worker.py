"""One rank of a 3-rank job whose last rank leaves, and whose other two shrink a group to
themselves with ``cupycoll.shrink_group`` (CPU tensors: cupycoll's gloo route). Writes
``<out>/rank<R>.json``.

usage: shrink_worker.py OUT_DIR BACKEND default|subgroup|second_fault

* before the last rank leaves, ranks 0 and 1 try every kind of bad argument (each must raise
  its typed error and change nothing: an all_reduce of all three ranks follows);
* default: the last rank exits without a word; ranks 0 and 1 shrink the default group
  (a subgroup made earlier is destroyed with it), and the survivors' group becomes the
  default one: world size 2, its collectives among them alone;
* subgroup: the ranks shrink a new_group of all three, which the last rank leaves alone;
  the default group stays as it was;
* second_fault: the last rank leaves, and rank 0 shrinks while rank 1 fails it too: first
  rank 1 is busy elsewhere and ``abort_all()`` ends rank 0's shrink of a subgroup (timeout
  20 s) at once; then rank 1 is gone, and rank 0's shrink of the default group (timeout 3 s)
  fails naming it, leaving the world as it was and no key of its own in the store; the
  shrink without rank 1 then works.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

import cupycoll
from epilogue import write_json
from shapes import TORCHS_GLOO


def shell_of(group):
    """cupycoll's object behind ``group``: the group itself, or in the Backend shape the
    backend torch registered (a shrunk group's under the CPU when it was not bound)."""
    if hasattr(group, "_trace"):
        return group
    for device in ("cuda", "cpu"):
        try:
            return group._get_backend(torch.device(device))
        except RuntimeError:
            pass
    raise AssertionError(f"no cupycoll backend in {group!r}")


def _error(call):
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - reported
        return {"type": type(exc).__name__, "text": str(exc)[:300],
                "mro": [c.__name__ for c in type(exc).__mro__]}
    return None


def bad_arguments(group, rank):
    """Each bad call's error; none may change anything."""
    cases = {
        "not a list": lambda: cupycoll.shrink_group((2,), group),
        "empty": lambda: cupycoll.shrink_group([], group),
        "out of range": lambda: cupycoll.shrink_group([3], group),
        "duplicate": lambda: cupycoll.shrink_group([2, 2], group),
        "every rank": lambda: cupycoll.shrink_group([0, 1, 2], group),
        "bad flags": lambda: cupycoll.shrink_group([2], group, shrink_flags=5),
        "not a rank": lambda: cupycoll.shrink_group(["2"], group),
        "excluded caller": lambda: cupycoll.shrink_group([rank], group),
        "bad options": lambda: cupycoll.shrink_group([2], group, pg_options={"timeout": 5}),
        "gloo group": lambda: cupycoll.shrink_group([2], dist.new_group(backend="gloo",
                                                                         ranks=[0, 1],
                                                                         use_local_synchronization=True)),
    }
    return {name: _error(call) for name, call in cases.items()}


def second_fault(out_dir, store, rank, last) -> int:
    """See the module: rank 0's report; ranks 1 and 2 leave without one."""
    sub = dist.new_group(ranks=[0, 1, last], timeout=datetime.timedelta(seconds=20))
    t = torch.ones(2)
    dist.all_reduce(t, group=sub)
    if rank == last:
        os._exit(0)
    if rank == 1:  # busy elsewhere while rank 0 shrinks the subgroup, then gone
        store.wait(["aborted shrink done"])
        os._exit(0)
    report = {"rank": rank}
    threading.Timer(1.0, cupycoll.abort_all).start()
    started = time.monotonic()
    report["aborted"] = _error(lambda: cupycoll.shrink_group([last], sub))
    report["aborted_s"] = time.monotonic() - started
    store.set("aborted shrink done", "1")
    world = dist.group.WORLD
    started = time.monotonic()
    report["missing"] = _error(lambda: cupycoll.shrink_group([last]))
    report["missing_s"] = time.monotonic() - started
    report["world_kept"] = dist.is_initialized() and dist.group.WORLD is world
    report["prefix_keys"] = [key for key in ("cupycoll-shrink/prefix", "cupycoll-shrink/prefix-read")
                             if store.check([key])]
    child = cupycoll.shrink_group([1, last])
    x = torch.full((3,), 5.0)
    dist.all_reduce(x, group=child)
    report.update(size=child.size(), world_size=dist.get_world_size(), after=x.tolist(),
                  is_default=child is dist.group.WORLD)
    write_json(out_dir, f"rank{rank}.json", report)
    dist.destroy_process_group()
    return 0


def main() -> int:
    out_dir, backend, scenario = sys.argv[1], sys.argv[2], sys.argv[3]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    last = world - 1
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=3 if scenario == "second_fault" else 20))
    if scenario == "second_fault":
        return second_fault(out_dir, store, rank, last)
    parent = dist.group.WORLD if scenario == "default" else dist.new_group(ranks=list(range(world)))
    other = dist.new_group(ranks=list(range(world)))  # destroyed with a shrunk default group
    report = {"rank": rank}
    if rank != last:
        report["bad"] = bad_arguments(parent, rank)
    t = torch.ones(4)
    dist.all_reduce(t, group=parent)  # bad arguments changed nothing
    report["before"] = t.tolist()
    if rank == last:
        if scenario == "default":
            os._exit(0)  # leaves without a word
        time.sleep(1)
        write_json(out_dir, f"rank{rank}.json", report)
        # the default group stays whole: its last collective with the survivors
        barrier = torch.ones(1)
        dist.all_reduce(barrier)
        report["default_after"] = barrier.tolist()
        write_json(out_dir, f"rank{rank}.json", report)
        dist.destroy_process_group()
        return 0

    # In the Backend shape with "cpu:gloo" torch's own gloo serves the parent's CPU calls:
    # after the shrink destroyed the parent, torch's gloo waits for the rank that left.
    torchs_gloo = backend.startswith("cpu:gloo") and not hasattr(parent, "_trace")
    started = time.monotonic()
    child = cupycoll.shrink_group([last], parent, shrink_flags=cupycoll.SHRINK_ABORT)
    report["shrink_s"] = time.monotonic() - started
    report.update(size=child.size(), rank=child.rank(), shrunk_by=shell_of(child).shrunk_by,
                  type=type(child).__name__, is_default=child is dist.group.WORLD,
                  world_size=dist.get_world_size(),
                  # torch no longer knows the parent; the group itself names its shrink
                  parent_error=(TORCHS_GLOO if torchs_gloo else
                                _error(lambda: dist.all_reduce(torch.ones(1), group=parent))),
                  parent_call_error=_error(lambda: shell_of(parent).allreduce([torch.ones(1)]).wait()),
                  other_registered=other in dist.distributed_c10d._world.pg_map)
    # torch code that trusts the group's backend type works on it (DDP's logger), and a
    # CUDA call would reach cupycoll whatever device torch found when it shrank
    torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1), process_group=child)
    report["cuda_backend"] = type(child._get_backend(torch.device("cuda"))).__name__
    x = torch.full((3,), float(rank + 1))
    dist.all_reduce(x, group=child)
    report["after"] = x.tolist()
    gathered = [torch.zeros(1) for _ in range(child.size())]
    dist.all_gather(gathered, torch.tensor([float(rank)]), group=child)
    report["gathered"] = [g.item() for g in gathered]
    if scenario == "subgroup":
        barrier = torch.ones(1)
        dist.all_reduce(barrier)  # the default group of three still works
        report["default_after"] = barrier.tolist()
    write_json(out_dir, f"rank{rank}.json", report)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
