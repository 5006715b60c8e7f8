"""How a worker rank hands its results to its test: a JSON file in the run's output folder,
and for the checking suites (api_worker, ring_worker) the whole end of the run.

Workers run as scripts (tests/workers on sys.path) and import this as ``epilogue``; the CPU
tier imports some of them as ``workers.<name>``, which finds it as ``workers.epilogue``.

Deliberately left out: how a rank leaves a faulted group or waits for its peers before it
exits (each worker knows what its scenario left behind).
"""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist


def write_json(out_dir: str, name: str, result) -> None:
    """``result`` as JSON in ``out_dir/name`` (``rank{rank}.json`` where the test looks)."""
    with open(os.path.join(out_dir, name), "w") as fh:
        json.dump(result, fh)


def plain_gloo_teardown_can_hang(backend: str) -> bool:
    """Whether freeing a plain gloo group right after a CPU call can hang this process: where
    torch frees a ProcessGroup holding the GIL (cupycoll.compat.PROCESS_GROUP_FREED_WITHOUT_GIL),
    gloo's worker thread dropping a finished Work can wait for that GIL for ever. cupycoll's
    own groups avoid it (GroupShell._keep_gloo_last). A reference run whose teardown is not
    what its test compares then skips that teardown."""
    if "cupycoll" in backend:
        return False
    from cupycoll import compat  # the reference alone: a cupycoll run may rely on the entry point
    return not compat.PROCESS_GROUP_FREED_WITHOUT_GIL


def end_suite(out_dir: str, rank: int, summary: dict) -> int:
    """The end of a checking suite's rank: ``summary`` (with its ``cases`` count and
    ``failures`` list) in ``out_dir/rank{rank}.json``, the default group destroyed, a line
    of totals and the first 50 failures printed. The exit status: 1 when any case failed."""
    os.makedirs(out_dir, exist_ok=True)
    write_json(out_dir, f"rank{rank}.json", summary)
    dist.destroy_process_group()
    failures = summary["failures"]
    print(f"rank {rank}: {summary['cases']} cases, {len(failures)} failures")
    for failure in failures[:50]:
        print("FAIL", failure, file=sys.stderr)
    return 1 if failures else 0
