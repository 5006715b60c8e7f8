"""Ranks that misbehave on purpose, for the CPU tests of tests/mp.py's harness.

Usage: harness_worker.py SCENARIO
  chatty: rank 1 writes far more than a pipe holds (64 KiB) to stdout and stderr before it
          sets a store key that rank 0 waits for.
  hang:   rank 0 prints a line, then sleeps forever.
  fail:   rank 1 exits 3 at once; rank 0 sleeps forever (a peer stuck in a collective).
  helpers: imports ring_simulator, a helper of tests/ the workers share, by name, and
          prints the file it came from.
"""

from __future__ import annotations

import datetime
import os
import sys
import time

CHATTY_BYTES = 256 * 1024


def main() -> int:
    scenario = sys.argv[1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if scenario == "chatty":
        # imported here, not at the top: "hang" and "fail" must speak within ms, not after
        # the seconds torch's import takes on a loaded box
        from torch.distributed import TCPStore

        store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0,
                         timeout=datetime.timedelta(seconds=60))
        if rank == 1:
            line = "x" * 1023 + "\n"
            for _ in range(CHATTY_BYTES // len(line)):
                sys.stdout.write(line)
                sys.stderr.write(line)
            store.set("spoken", "1")
        else:
            store.wait(["spoken"])
        store.add("done", 1)
        if rank == 0:  # the store's host must outlive the others' last use of it
            while store.add("done", 0) < world:
                time.sleep(0.01)
        return 0
    if scenario == "hang":
        if rank == 0:
            print("rank 0 is about to hang", flush=True)
            time.sleep(3600)
        return 0
    if scenario == "fail":
        if rank == 1:
            print("rank 1 fails on purpose", file=sys.stderr, flush=True)
            return 3
        time.sleep(3600)
        return 0
    if scenario == "helpers":
        import ring_simulator

        print(ring_simulator.__file__, flush=True)
        return 0
    raise SystemExit(f"unknown scenario {scenario!r}")


if __name__ == "__main__":
    sys.exit(main())
