"""One rank of tests/test_work_surface.py: every method of the Works one backend returns for
CPU tensors, recorded as what each returned or raised, so the test can hold cupycoll's Works
to gloo's on whatever torch runs it.

usage: work_surface_worker.py BACKEND OUT_DIR   (RANK, WORLD_SIZE=2, MASTER_ADDR/PORT from
tests/mp.py). BACKEND is "gloo" or "cupycoll" (in the shape CUPYCOLL_SHAPE gives). Writes
``<OUT_DIR>/rank<R>.json``: ``case -> method -> outcome``, and for cupycoll
``rank<R>.closed.json``: its own rules for failed and closed Works.
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

import cupycoll  # noqa: F401 - registers the backend
try:  # run as a script (tests/workers on sys.path), or imported by the CPU tier
    from epilogue import plain_gloo_teardown_can_hang, write_json
except ImportError:
    from workers.epilogue import plain_gloo_teardown_can_hang, write_json

QUIET_DONE = "--- wait, is_completed and get_future done ---"

def outcome(call):
    """What ``call()`` gave, as JSON: a value, tensors as lists, or the error it raised."""
    try:
        value = call()
    except Exception as exc:  # noqa: BLE001 - recorded
        return {"raised": type(exc).__name__, "text": str(exc).splitlines()[0][:200] if str(exc) else ""}
    if isinstance(value, torch.Tensor):
        return {"value": value.tolist()}
    if isinstance(value, (list, tuple)):
        return {"value": [v.tolist() if isinstance(v, torch.Tensor) else repr(v) for v in value]}
    if isinstance(value, BaseException):
        return {"value": f"{type(value).__name__}"}
    return {"value": value}


def surface(work, source_rank=False, timeout=None):
    """Every method of a Work, in the order a user would call them, waited on once (a second
    wait() of a gloo send or recv waits for another message): with ``timeout`` if given."""
    wait = (lambda: work.wait(timeout)) if timeout is not None else work.wait
    got = {"wait" if timeout is None else "wait_timeout": outcome(wait),
           "is_completed": outcome(work.is_completed), "is_success": outcome(work.is_success),
           "exception": outcome(work.exception), "result": outcome(work.result)}
    try:
        future = work.get_future()
    except Exception as exc:  # noqa: BLE001 - some Works have no future: recorded as such
        got["get_future"] = {"raised": type(exc).__name__}
    else:
        got["get_future"] = outcome(lambda: future.wait())
    if source_rank:
        got["source_rank"] = outcome(work.source_rank)
    return got


def main() -> None:
    backend, out_dir = sys.argv[1:3]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
    cases = {}
    # First the methods torch does not deprecate, alone: nothing may warn before the marker.
    quiet = dist.all_reduce(torch.ones(2), async_op=True)
    cases["quiet"] = {"wait": outcome(quiet.wait), "is_completed": outcome(quiet.is_completed),
                      "get_future": outcome(lambda: quiet.get_future().wait())}
    print(QUIET_DONE, file=sys.stderr, flush=True)
    x = torch.full((4,), float(rank + 1))
    cases["all_reduce async"] = surface(dist.all_reduce(x, async_op=True))
    cases["broadcast async"] = surface(dist.broadcast(torch.full((2,), float(rank)), 0, async_op=True),
                                       timeout=datetime.timedelta(seconds=30))
    cases["barrier async"] = surface(dist.barrier(async_op=True))
    y = torch.full((3,), float(rank))
    if rank == 0:
        cases["send"] = surface(dist.isend(y, 1))
    else:
        cases["recv"] = surface(dist.irecv(y, 0), source_rank=True, timeout=datetime.timedelta(seconds=30))
    if rank == 1:
        z = torch.zeros(2)
        cases["recv any source"] = surface(dist.irecv(z), source_rank=True)
    else:
        dist.send(torch.full((2,), 7.0), 1)
    # A Work not finished yet: only rank 0 receives, rank 1 sends after the checks below.
    if rank == 0:
        late = torch.zeros(1)
        work = dist.irecv(late, 1)
        cases["unfinished recv"] = {"is_completed": outcome(work.is_completed)}
        dist.barrier()
        cases["unfinished recv"]["wait"] = outcome(work.wait)
        cases["unfinished recv"]["is_completed after"] = outcome(work.is_completed)
    else:
        dist.barrier()
        dist.send(torch.ones(1), 0)
    dist.barrier()
    write_json(out_dir, f"rank{rank}.json", cases)
    if backend == "cupycoll":
        write_json(out_dir, f"rank{rank}.closed.json", closed_with_work_in_flight(rank))
    elif plain_gloo_teardown_can_hang(backend):
        # the reference's answers are written; its teardown is not what this test compares
        sys.stderr.flush()
        os._exit(0)
    dist.destroy_process_group()


def closed_with_work_in_flight(rank: int) -> dict:
    """cupycoll's own rules, which gloo lacks: a CPU collective that times out is explained
    (the rank behind named) by whichever of ``exception()`` and ``wait()`` is asked first, and
    both give that same error; one that has not finished when its group is aborted or
    destroyed fails at once, not at gloo's timeout. Only rank 0 calls the all_reduces, so
    they cannot finish; gloo gives up on each after the group's timeout."""
    cases = {}
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2))
    if rank == 0:
        work = dist.all_reduce(torch.ones(2), group=group, async_op=True)
        time.sleep(3)  # past gloo's timeout; exception() is the first to look
        error = work.exception()
        cases["timed out"] = {"exception": outcome(lambda: error), "wait": outcome(work.wait),
                              "is_completed": outcome(work.is_completed),
                              "is_success": outcome(work.is_success),
                              "same error": error is not None and str(error) == str(_raised(work.wait))}
    dist.barrier()  # rank 1 waits here, its responder answering rank 0's diagnosis
    dist.destroy_process_group(group)
    for how in ("aborted", "shut down"):
        group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=3))
        if rank == 0:
            work = dist.all_reduce(torch.ones(2), group=group, async_op=True)
        if how == "aborted":
            group.abort()
        dist.destroy_process_group(group)
        if rank == 0:
            started = time.monotonic()
            cases[how] = {"wait": outcome(work.wait), "wait_s": time.monotonic() - started,
                          "is_completed": outcome(work.is_completed),
                          "is_success": outcome(work.is_success)}
    time.sleep(3.5)  # gloo's own timeout ends the all_reduce in its thread before the exit
    return cases


def _raised(call):
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - returned
        return exc
    return None


if __name__ == "__main__":
    main()
