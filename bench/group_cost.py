"""Host cost of one empty NCCL group: ``python -m bench.group_cost [--iterations N]``.

Prints microseconds per empty group opened through :meth:`cupycoll.nccl.communicator.Communicator.group`
next to the raw ctypes ``ncclGroupStart(); ncclGroupEnd()`` pair of the same library, and
their ratio. Every coalescing block, point-to-point batch, all_to_all / gather / scatter and
ring exchange opens one such group, so this is per-call overhead the GPU never sees.

Runs on a CPU-only machine: ncclGroupStart/End need no GPU, and the communicator is built
in blocking mode around no NCCL communicator (only its library and group are used).

Deliberately left out: groups with calls inside (that is NCCL's time, measured by the
collective benchmarks) and nonblocking communicators (their groups add one poll per member).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from typing import Callable, List, Optional


def per_call_us(call: Callable[[], None], iterations: int, repeats: int = 7,
                clock: Callable[[], float] = time.perf_counter) -> float:
    """Median over ``repeats`` runs of the mean time of one ``call``, in microseconds, on
    ``clock`` (wall time; ``time.thread_time``: this thread's CPU time)."""
    samples = []
    for _ in range(repeats):
        start = clock()
        for _ in range(iterations):
            call()
        samples.append((clock() - start) / iterations * 1e6)
    return statistics.median(samples)


def _communicator(nccl_library: Optional[str]):
    """A blocking-mode Communicator with no NCCL communicator (a NULL handle) and no device:
    enough for group(), which only needs the library the communicator holds."""
    from cupycoll import _cuda
    from cupycoll.nccl import communicator

    class Stream:
        ptr = 0

        def synchronize(self):
            """Nothing ran on it: a shutdown's wait for the stream returns at once."""

    class NoDevice(_cuda.Runtime):
        """The CUDA runtime of a communicator that never touches a device."""

        def on_device(self, index):
            return contextlib.nullcontext()

        def new_stream(self, index):
            return Stream()

    return communicator.Communicator(0, 0, 1, nccl_library, handle=0, timeout=60.0, runtime=NoDevice())


def measure(iterations: int = 20000, nccl_library: Optional[str] = None) -> dict:
    comm = _communicator(nccl_library)
    lib = comm._lib

    def raw() -> None:
        lib.ncclGroupStart()
        lib.ncclGroupEnd()

    def through_communicator() -> None:
        with comm.group():
            pass

    for call in (raw, through_communicator):
        per_call_us(call, iterations // 10, repeats=1)  # warm-up
    raw_us = per_call_us(raw, iterations)
    group_us = per_call_us(through_communicator, iterations)
    return {"library": lib.path, "nccl_version": ".".join(map(str, lib.version_tuple())),
            "iterations": iterations, "raw_us": raw_us, "group_us": group_us,
            "ratio": group_us / raw_us if raw_us else float("inf")}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.group_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=20000, help="groups per timed run (default 20000)")
    parser.add_argument("--nccl-library", default=None, help="libnccl.so.2 to use (default: as cupycoll finds it)")
    args = parser.parse_args(argv)
    if args.iterations < 1:
        parser.error("--iterations must be >= 1")
    result = measure(args.iterations, args.nccl_library)
    print(f"NCCL {result['nccl_version']} ({result['library']}), {result['iterations']} empty groups per run")
    print(f"  raw ncclGroupStart/End      {result['raw_us']:8.3f} us per group")
    print(f"  Communicator.group()        {result['group_us']:8.3f} us per group")
    print(f"  ratio                       {result['ratio']:8.2f} x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
