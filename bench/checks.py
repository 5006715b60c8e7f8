"""Result checking (nccl-tests' #wrong): known inputs, expected outputs, mismatch counts.

Every rank fills its input from a hash of (rank, element index), so that any rank can
compute any other rank's input, and so the expected output, without communicating. The
values are small integers, which every data type holds exactly and whose sums, products,
minima, maxima and bitwise combinations are exact too; only ``avg`` of floats can round
(NCCL pre-multiplies by 1/n), so it is compared with a tolerance. Chunk-dependent values
make a misplaced chunk (wrong offset, wrong peer) show up as wrong elements.

Work is done in slices of :data:`CHUNK` elements, so checking a 1 GiB buffer needs a few
tens of MiB of scratch memory. Left out: which buffers a collective uses (runner).
"""

from __future__ import annotations

from typing import Optional

import torch

from .catalog import MULSUM_FACTOR

CHUNK = 1 << 22
POISON = 99  # what an output holds before the call; outside every input's range
_AVG_TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 2e-2, torch.float32: 1e-5, torch.float64: 1e-12}


def _hash(seed: int, start: int, length: int, device) -> torch.Tensor:
    """Pseudo-random int64 in [0, 32768) for element indices start..start+length-1."""
    i = torch.arange(start, start + length, dtype=torch.int64, device=device)
    h = (i * 1103515245 + (seed * 2654435761 + 12345)) & 0x7FFFFFFF
    return h >> 16


def _avg_offset(rank: int, world: int) -> int:
    """Per-rank offsets that sum to zero, so the average is exact (also for integers)."""
    if rank % 2 == 1:
        return -1
    return 1 if rank + 1 < world else 0


def values(collective: str, op: str, rank: int, world: int, start: int, length: int, device) -> torch.Tensor:
    """Rank ``rank``'s input elements start..start+length-1, as int64."""
    h = _hash(rank, start, length, device)
    if collective not in ("all_reduce", "reduce", "reduce_scatter"):
        return h % 64
    if op in ("sum", "mulsum"):
        return h % 4
    if op == "prod":
        return 1 + h % 2
    if op == "avg":
        return 1 + _hash(-1, start, length, device) % 4 + _avg_offset(rank, world)
    return h % 16  # min, max, band, bor, bxor


def reduced(collective: str, op: str, world: int, start: int, length: int, device) -> torch.Tensor:
    """The reduction over all ranks of elements start..start+length-1, as int64."""
    if op == "avg":
        return 1 + _hash(-1, start, length, device) % 4
    if op == "mulsum":  # every rank's input times the factor, summed
        return reduced(collective, "sum", world, start, length, device) * int(MULSUM_FACTOR)
    acc = values(collective, op, 0, world, start, length, device)
    for rank in range(1, world):
        v = values(collective, op, rank, world, start, length, device)
        if op == "sum":
            acc += v
        elif op == "prod":
            acc *= v
        elif op == "max":
            acc = torch.maximum(acc, v)
        elif op == "min":
            acc = torch.minimum(acc, v)
        elif op == "band":
            acc &= v
        elif op == "bor":
            acc |= v
        elif op == "bxor":
            acc ^= v
        else:
            raise ValueError(f"no reference for op {op!r}")
    return acc


def _chunks(n: int):
    for start in range(0, n, CHUNK):
        yield start, min(CHUNK, n - start)


def write(dst: torch.Tensor, src_fn, offset: int = 0) -> None:
    """dst[k] = src_fn(offset + k) slice by slice; src_fn(start, length) gives int64."""
    flat = dst.view(-1)
    for start, length in _chunks(flat.numel()):
        flat[start:start + length].copy_(src_fn(offset + start, length).to(dst.dtype))


def poison(dst: torch.Tensor) -> None:
    # Through copy_ rather than fill_: copy_ handles every dtype (uint32/uint64 included).
    write(dst, lambda s, n: torch.full((n,), POISON, dtype=torch.int64, device=dst.device))


def mismatches(got: torch.Tensor, expected_fn, offset: int = 0, op: Optional[str] = None) -> int:
    """Elements of ``got`` that differ from expected_fn(offset + k) (int64 slices)."""
    flat = got.view(-1)
    wrong = 0
    floating = got.dtype.is_floating_point
    for start, length in _chunks(flat.numel()):
        have = flat[start:start + length].to(torch.float64)
        # The expectation takes the same trip through the data type (e.g. int8 wrap-around).
        want = expected_fn(offset + start, length).to(got.dtype).to(torch.float64)
        if floating and got.element_size() == 1 and op not in (None, "none"):
            # float8 holds 2 or 3 mantissa bits, and NCCL rounds every partial sum to them.
            bad = (have - want).abs() > 0.25 * torch.clamp(want.abs(), min=1.0)
        elif op == "avg" and floating:
            tol = _AVG_TOLERANCE.get(got.dtype, 1e-5) * torch.clamp(want.abs(), min=1.0)
            bad = (have - want).abs() > tol
        else:
            bad = have != want
        wrong += int(bad.sum().item())
    return wrong


# -- per collective: fill the inputs, count wrong outputs ---------------------------------
# ``bufs`` is the runner's Buffers: .send, .recv (one inside the other when .in_place),
# .count (nccl-tests' count: per rank for the split collectives).

def prepare(collective: str, op: str, rank: int, world: int, root: int, bufs) -> None:
    device = bufs.send.device
    # In place, the output holds the input (all_reduce, reduce, broadcast) or contains it
    # (reduce_scatter); only all_gather's in-place input is a slice of a larger output.
    if not bufs.in_place or collective == "all_gather":
        poison(bufs.recv)
    if collective == "broadcast" and rank != root:
        poison(bufs.send)
        return
    write(bufs.send, lambda s, n: values(collective, op, rank, world, s, n, device))


def count_wrong(collective: str, op: str, rank: int, world: int, root: int, bufs) -> int:
    device = bufs.send.device
    c = bufs.count
    if collective == "all_reduce":
        return mismatches(bufs.recv, lambda s, n: reduced(collective, op, world, s, n, device), op=op)
    if collective == "reduce":
        if rank != root:
            return 0  # only the root's buffer is defined after a reduce
        return mismatches(bufs.recv, lambda s, n: reduced(collective, op, world, s, n, device), op=op)
    if collective == "broadcast":
        return mismatches(bufs.recv, lambda s, n: values(collective, op, root, world, s, n, device))
    if collective == "reduce_scatter":
        return mismatches(bufs.recv, lambda s, n: reduced(collective, op, world, s, n, device),
                          offset=rank * c, op=op)
    if collective == "all_gather":
        return sum(mismatches(bufs.recv[src * c:(src + 1) * c],
                              lambda s, n, src=src: values(collective, op, src, world, s, n, device))
                   for src in range(world))
    if collective == "all_to_all":
        return sum(mismatches(bufs.recv[src * c:(src + 1) * c],
                              lambda s, n, src=src: values(collective, op, src, world, s, n, device),
                              offset=rank * c)
                   for src in range(world))
    if collective == "sendrecv":
        src = (rank - 1) % world
        return mismatches(bufs.recv, lambda s, n: values(collective, op, src, world, s, n, device))
    raise ValueError(f"no check for {collective!r}")
