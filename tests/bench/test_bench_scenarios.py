"""CPU tier: the scenarios' bookkeeping — ratios, PASS/MISS targets, the ring-kernel rows.

The measurements themselves need a GPU (tests/gpu/test_gpu_bench.py); here synthetic
numbers go through the same code that turns measurements into rows and verdicts.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import output, scenarios  # noqa: E402

pytestmark = pytest.mark.any_stack  # its subject is the same on every stack: one CI leg runs it


def _row(case, candidate, gpu, cpu):
    return {"kind": "scenario", "scenario": "coalescing", "case": case, "candidate": candidate,
            "status": "ok", "gpu_us": gpu, "cpu_us": cpu}


def coalescing_rows(ours_cpu=100.0, ours_gpu=1000.0, tiny_cpu=12.0):
    return [
        _row("flat", "cupycoll:nccl", 1000.0, 10.0), _row("flat", "torch:nccl", 990.0, 9.0),
        _row("coalesced sync", "cupycoll:nccl", ours_gpu, ours_cpu),
        _row("coalesced sync", "torch:nccl", 1100.0, 120.0),
        _row("coalesced async", "cupycoll:nccl", 1030.0, 90.0),
        _row("coalesced async", "torch:nccl", 1100.0, 80.0),
        _row("uncoalesced", "cupycoll:nccl", 3000.0, 900.0), _row("uncoalesced", "torch:nccl", 2000.0, 600.0),
        _row("1-element sync", "cupycoll:nccl", 20.0, tiny_cpu), _row("1-element sync", "torch:nccl", 20.0, 10.0),
        _row("1-element async", "cupycoll:nccl", 20.0, 13.0), _row("1-element async", "torch:nccl", 20.0, 10.0),
    ]


def test_ratios_are_candidate_over_baseline():
    rows = coalescing_rows()
    scenarios._ratios(rows, "torch:nccl")
    sync = {r["candidate"]: r for r in rows if r["case"] == "coalesced sync"}
    assert sync["cupycoll:nccl"]["cpu_ratio"] == pytest.approx(100 / 120)
    assert sync["cupycoll:nccl"]["gpu_ratio"] == pytest.approx(1000 / 1100)
    assert sync["torch:nccl"]["cpu_ratio"] == 1.0


def test_targets_pass_and_miss():
    verdicts = {t["target"]: t for t in scenarios._targets(coalescing_rows(), "torch:nccl")}
    assert len(verdicts) == 6
    cpu_sync = verdicts["coalesced sync: CPU time cupycoll / torch:nccl"]
    assert cpu_sync["status"] == "PASS" and cpu_sync["value"] == pytest.approx(100 / 120)
    assert verdicts["coalesced async: CPU time cupycoll / torch:nccl"]["status"] == "MISS"  # 90 / 80
    assert verdicts["1-element all_reduce sync: CPU per call cupycoll / torch:nccl"]["status"] == "PASS"  # 1.2
    assert verdicts["1-element all_reduce async: CPU per call cupycoll / torch:nccl"]["status"] == "MISS"  # 1.3
    gpu_sync = verdicts["coalesced sync: GPU time cupycoll / its flat all_reduce"]
    assert gpu_sync["status"] == "PASS" and gpu_sync["value"] == pytest.approx(1.0)
    assert verdicts["coalesced async: GPU time cupycoll / its flat all_reduce"]["status"] == "PASS"  # 1.03
    slow = {t["target"]: t for t in scenarios._targets(coalescing_rows(ours_gpu=1060.0), "torch:nccl")}
    assert slow["coalesced sync: GPU time cupycoll / its flat all_reduce"]["status"] == "MISS"


def test_targets_without_a_measurement_are_na_not_pass():
    rows = [r for r in coalescing_rows() if r["candidate"] != "torch:nccl"]
    verdicts = scenarios._targets(rows, "torch:nccl")
    assert [t["status"] for t in verdicts[:4]] == ["n/a"] * 4
    assert [t["status"] for t in verdicts[4:]] == ["PASS", "PASS"]


def test_targets_judge_the_candidate_they_are_given():
    # --device cpu: cupycoll's path is cupycoll:gloo, judged against torch:gloo
    rename = {"cupycoll:nccl": "cupycoll:gloo", "torch:nccl": "torch:gloo"}
    rows = [dict(r, candidate=rename[r["candidate"]]) for r in coalescing_rows()]
    verdicts = scenarios._targets(rows, "torch:gloo", "cupycoll:gloo")
    assert {t["candidate"] for t in verdicts} == {"cupycoll:gloo"}
    assert [t["value"] for t in verdicts] == [t["value"] for t in scenarios._targets(coalescing_rows(), "torch:nccl")]
    assert all(t["value"] is not None for t in verdicts)


def test_scenario_lines_print_every_target():
    rows = coalescing_rows()
    scenarios._ratios(rows, "torch:nccl")
    rows += scenarios._targets(rows, "torch:nccl")
    text = "\n".join(output.scenario_lines("coalescing", rows, "torch:nccl"))
    assert text.count("# target:") == 6 and "MISS" in text and "PASS" in text


def test_scenario_lines_head_the_time_column_by_the_clock_that_measured_it():
    rows = coalescing_rows()
    scenarios._ratios(rows, "torch:nccl")
    gpu = output.scenario_lines("overhead", rows, "torch:nccl")[2]
    wall = output.scenario_lines("overhead", rows, "torch:nccl", "wall")[2]
    assert "GPU us" in gpu and "GPU ratio" in gpu
    assert "GPU" not in wall and "wall us" in wall and "wall ratio" in wall
    assert len(gpu) == len(wall)  # the columns stay where they were
    assert scenarios._clock(types.SimpleNamespace(device=torch.device("cpu"))) == "wall"
    assert scenarios._clock(types.SimpleNamespace(device=torch.device("cuda", 0))) == "GPU"


class _Ctx:
    """Just enough of rank.Rank for the kernel scenario's rank-0 part."""

    def __init__(self):
        self.device = torch.device("cuda", 0)  # never touched: the fake module does the work
        self.config = types.SimpleNamespace(scenario_iters=7, warmup=2)
        self.lines = []

    def say(self, line):
        self.lines.append(line)


def test_kernel_scenario_reads_ring_kernels_run(monkeypatch):
    calls = {}

    def run(sizes=(1,), dtypes=("float32",), iterations=20, warmup=3, device=0, verbose=True):
        calls.update(iterations=iterations, warmup=warmup, device=device, verbose=verbose)
        return {"device": "Fake GPU", "rows": [
            {"dtype": "float32", "size_bytes": 1 << 20, "kernel": "ring_reduce", "seconds": 2e-6,
             "bytes_moved": 3 << 20, "gbps": 1500.0, "copy_gbps": 3000.0, "ratio_to_copy": 0.5}]}

    fake = types.ModuleType("bench.ring_kernels")
    fake.run = run
    monkeypatch.setitem(sys.modules, "bench.ring_kernels", fake)
    import bench

    monkeypatch.setattr(bench, "ring_kernels", fake, raising=False)
    ctx = _Ctx()
    rows = scenarios._kernel_rows(ctx)
    assert calls == {"iterations": 7, "warmup": 2, "device": 0, "verbose": False}
    assert len(rows) == 1
    row = rows[0]
    assert row["status"] == "ok" and row["scenario"] == "kernel" and row["case"] == "ring_reduce float32 1 MiB"
    assert row["gpu_us"] == pytest.approx(2.0) and row["gbps"] == 1500.0 and row["device"] == "Fake GPU"
    assert any("50.0%" in line for line in ctx.lines)


def test_kernel_scenario_failure_is_a_row(monkeypatch):
    fake = types.ModuleType("bench.ring_kernels")

    def run(sizes=(1,), dtypes=("float32",), iterations=20, warmup=3, device=0, verbose=True):
        raise RuntimeError("no NVRTC")

    fake.run = run
    monkeypatch.setitem(sys.modules, "bench.ring_kernels", fake)
    import bench

    monkeypatch.setattr(bench, "ring_kernels", fake, raising=False)
    rows = scenarios._kernel_rows(_Ctx())
    assert rows[0]["status"] == "error" and "no NVRTC" in rows[0]["note"]
