"""nccl-tests arithmetic: buffer layouts, algorithm bandwidth and bus bandwidth.

Pure Python (no torch). Definitions, as nccl-tests' src/*.cu and doc/PERFORMANCE.md give them:

* A requested size ``S`` bytes becomes ``count = S // typesize`` elements. all_reduce,
  broadcast, reduce and sendrecv move ``count`` elements per rank. all_gather,
  reduce_scatter and all_to_all split it over ranks: each rank contributes (all_gather),
  receives (reduce_scatter) or exchanges with each peer (all_to_all) ``per_rank =
  (count // n)`` elements, rounded down to a multiple of 16 bytes' worth.
* The "size" column is the larger of the send and receive buffers in bytes; the "count"
  column is the count passed to NCCL (per rank for the split collectives).
* ``algbw = size / time`` in GB/s (1 GB = 1e9 bytes); for the split collectives that size
  is the whole array, ``per_rank * n * typesize``.
* ``busbw = algbw * factor``: all_reduce 2(n-1)/n; all_gather, reduce_scatter and
  all_to_all (n-1)/n; broadcast, reduce and sendrecv 1.

And which GPU times measure the GPU rather than the collective (:func:`time_sliced`): ranks
that share one GPU (``--ranks`` above the GPUs) are separate processes, whose kernels the
GPU runs in turns, in time slices of about 2.3 ms; a collective waits for its peer's
kernel, so its GPU time is a whole number of slices until the message is large enough for
the transfer to outlast them.

Left out: timing itself, and anything about which backend runs what.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Iterable, Optional

SPLIT = frozenset({"all_gather", "reduce_scatter", "all_to_all"})
# From this size up (per call, nccl-tests' size), a GPU time on a shared GPU is read as the
# collective's: a 16 MiB all_reduce over the loopback sockets takes ~10 ms, several slices.
UNSLICED_BYTES = 16 << 20


@dataclasses.dataclass(frozen=True)
class Layout:
    """Element counts of one measurement point (see the module docstring)."""

    count: int          # nccl-tests' "count" column: the count argument NCCL gets
    size: int           # nccl-tests' "size" column: max(send, recv) buffer bytes
    send_count: int     # elements in each rank's input buffer
    recv_count: int     # elements in each rank's output buffer


def layout(collective: str, nbytes: int, typesize: int, nranks: int) -> Layout:
    """Counts for a requested size of ``nbytes`` (nccl-tests' setupArgs / GetCollByteCount)."""
    count = nbytes // typesize
    if collective in SPLIT:
        align = max(1, 16 // typesize)
        per_rank = (count // nranks) // align * align
        if collective == "all_gather":
            send, recv = per_rank, per_rank * nranks
        elif collective == "reduce_scatter":
            send, recv = per_rank * nranks, per_rank
        else:  # all_to_all: per_rank elements to each peer
            send = recv = per_rank * nranks
        return Layout(per_rank, max(send, recv) * typesize, send, recv)
    return Layout(count, count * typesize, count, count)


def bus_factor(collective: str, nranks: int) -> float:
    if collective == "all_reduce":
        return 2.0 * (nranks - 1) / nranks
    if collective in SPLIT:
        return (nranks - 1) / nranks
    if collective in ("broadcast", "reduce", "sendrecv"):
        return 1.0
    raise ValueError(f"no bus factor for {collective!r}")


def algbw(size_bytes: int, time_us: float) -> float:
    """GB/s (1e9 bytes per second) for ``size_bytes`` moved in ``time_us`` microseconds."""
    if not time_us or time_us <= 0:
        return 0.0
    return size_bytes / (time_us * 1e3)


def busbw(collective: str, size_bytes: int, time_us: float, nranks: int) -> float:
    return algbw(size_bytes, time_us) * bus_factor(collective, nranks)


def speedup(baseline_us: Optional[float], candidate_us: Optional[float]) -> Optional[float]:
    """The benchmark's ratio column: baseline time / candidate time (> 1: candidate faster)."""
    if not baseline_us or not candidate_us:
        return None
    return baseline_us / candidate_us


def time_sliced(shared_gpu: bool, size_bytes: int) -> bool:
    """Does a GPU time of calls of ``size_bytes`` measure the GPU's time slices between
    ranks (``shared_gpu``: several ranks on one GPU) rather than the collective?"""
    return shared_gpu and size_bytes < UNSLICED_BYTES


def median(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")
