"""CPU tier: the benchmark's arithmetic against nccl-tests' definitions, by hand.

nccl-tests (src/*.cu, doc/PERFORMANCE.md): algbw = size / time with 1 GB = 1e9 B; the size
of all_gather / reduce_scatter / all_to_all is the whole array (per-rank count x n x type
size, the per-rank count rounded down to 16 bytes' worth); busbw = algbw x factor, with
all_reduce 2(n-1)/n, all_gather / reduce_scatter / all_to_all (n-1)/n, the rest 1.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import metrics  # noqa: E402

pytestmark = pytest.mark.any_stack  # its subject is the same on every stack: one CI leg runs it


@pytest.mark.parametrize("collective,n,factor", [
    ("all_reduce", 2, 1.0), ("all_reduce", 4, 1.5), ("all_reduce", 8, 1.75), ("all_reduce", 1, 0.0),
    ("all_gather", 4, 0.75), ("reduce_scatter", 8, 0.875), ("all_to_all", 2, 0.5),
    ("broadcast", 8, 1.0), ("reduce", 8, 1.0), ("sendrecv", 8, 1.0),
])
def test_bus_factors(collective, n, factor):
    assert metrics.bus_factor(collective, n) == pytest.approx(factor)


def test_algbw_is_bytes_over_time_in_decimal_gigabytes():
    # 1 GiB in 1 ms: 1073741824 B / 1e-3 s = 1073.741824 GB/s
    assert metrics.algbw(1 << 30, 1000.0) == pytest.approx(1073.741824)
    # nccl-tests-like line: 128 MiB all_reduce in 1500 us on 8 ranks
    algbw = (128 << 20) / 1500e-6 / 1e9  # 89.478...
    assert metrics.algbw(128 << 20, 1500.0) == pytest.approx(89.4784853)
    assert metrics.busbw("all_reduce", 128 << 20, 1500.0, 8) == pytest.approx(algbw * 1.75)
    assert metrics.algbw(100, 0.0) == 0.0


def test_all_reduce_layout_is_the_whole_buffer():
    lay = metrics.layout("all_reduce", 32 << 20, 4, 8)
    assert (lay.count, lay.size, lay.send_count, lay.recv_count) == (8 << 20, 32 << 20, 8 << 20, 8 << 20)
    # a size that is not a whole number of elements is rounded down, and the size column follows
    lay = metrics.layout("broadcast", 10, 4, 2)
    assert (lay.count, lay.size) == (2, 8)


def test_all_gather_layout_per_rank_count_total_size():
    # 1 MiB float on 4 ranks: 65536 floats each, the output is the whole 1 MiB
    lay = metrics.layout("all_gather", 1 << 20, 4, 4)
    assert (lay.count, lay.size, lay.send_count, lay.recv_count) == (65536, 1 << 20, 65536, 262144)
    # algbw uses the total size: 1 MiB in 100 us = 10.48576 GB/s; busbw x 3/4
    assert metrics.algbw(lay.size, 100.0) == pytest.approx(10.48576)
    assert metrics.busbw("all_gather", lay.size, 100.0, 4) == pytest.approx(10.48576 * 0.75)


def test_reduce_scatter_layout_mirrors_all_gather():
    lay = metrics.layout("reduce_scatter", 1 << 20, 2, 8)  # half on 8 ranks
    assert (lay.count, lay.size, lay.send_count, lay.recv_count) == (65536, 1 << 20, 524288, 65536)


def test_split_counts_round_down_to_16_bytes():
    # 1000 B of float on 3 ranks: 250 floats, 83 per rank, rounded down to a multiple of 4 -> 80
    lay = metrics.layout("all_gather", 1000, 4, 3)
    assert (lay.count, lay.size) == (80, 80 * 3 * 4)
    # int8: multiples of 16 elements; double: multiples of 2
    assert metrics.layout("reduce_scatter", 100, 1, 2).count == 48
    assert metrics.layout("all_to_all", 100, 8, 2).count == 6
    # too small to split: count 0 (the sweep skips such sizes)
    assert metrics.layout("all_gather", 8, 4, 2).count == 0


def test_all_to_all_layout():
    # 1 MiB float on 4 ranks: 65536 elements to each peer; both buffers are 1 MiB
    lay = metrics.layout("all_to_all", 1 << 20, 4, 4)
    assert (lay.count, lay.size, lay.send_count, lay.recv_count) == (65536, 1 << 20, 262144, 262144)
    assert metrics.busbw("all_to_all", lay.size, 1000.0, 4) == pytest.approx(1.048576 * 0.75)


def test_sendrecv_layout_and_busbw():
    lay = metrics.layout("sendrecv", 4096, 2, 8)
    assert (lay.count, lay.size) == (2048, 4096)
    assert metrics.busbw("sendrecv", lay.size, 2.0, 8) == pytest.approx(2.048)


def test_speedup_is_baseline_over_candidate():
    assert metrics.speedup(200.0, 100.0) == 2.0   # candidate twice as fast
    assert metrics.speedup(100.0, 200.0) == 0.5
    assert metrics.speedup(None, 1.0) is None
