"""CPU tier: the scenarios' bookkeeping — ratios, own shares, PASS/MISS targets, time-sliced
rows, the ring-kernel rows — and the group that times torch's front alone.

The measurements themselves need a GPU (tests/gpu/test_gpu_bench.py); here synthetic
numbers go through the same code that turns measurements into rows and verdicts, and one
run on CPU (``--device cpu``) times the front beside gloo.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch.distributed as dist  # noqa: E402

from bench import metrics, output, scenarios  # noqa: E402
from bench.calls import FrontOnlyGroup  # noqa: E402
from bench.rank import Rank  # noqa: E402

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
    assert len(verdicts) == 4
    cpu_sync = verdicts["coalesced sync: CPU time cupycoll / torch:nccl"]
    assert cpu_sync["status"] == "PASS" and cpu_sync["value"] == pytest.approx(100 / 120)
    assert verdicts["coalesced async: CPU time cupycoll / torch:nccl"]["status"] == "PASS"  # 90 / 80 = 1.125
    assert verdicts["1-element all_reduce sync: CPU per call cupycoll / torch:nccl"]["status"] == "MISS"  # 1.2
    assert verdicts["1-element all_reduce async: CPU per call cupycoll / torch:nccl"]["status"] == "MISS"  # 1.3


def test_a_coalesced_block_passes_within_1_2x_and_a_synchronous_call_within_1_0x():
    rows = coalescing_rows(ours_cpu=143.0, tiny_cpu=10.0)  # 143 / 120 = 1.19; 10 / 10 = 1.0
    verdicts = {t["target"]: t for t in scenarios._targets(rows, "torch:nccl")}
    assert verdicts["coalesced sync: CPU time cupycoll / torch:nccl"]["status"] == "PASS"
    assert verdicts["1-element all_reduce sync: CPU per call cupycoll / torch:nccl"]["status"] == "PASS"
    rows = coalescing_rows(ours_cpu=145.0, tiny_cpu=10.1)
    verdicts = {t["target"]: t for t in scenarios._targets(rows, "torch:nccl")}
    assert verdicts["coalesced sync: CPU time cupycoll / torch:nccl"]["status"] == "MISS"
    assert verdicts["1-element all_reduce sync: CPU per call cupycoll / torch:nccl"]["status"] == "MISS"


def test_no_target_is_judged_on_a_gpu_time():
    # a coalesced block's GPU time far above its flat all_reduce's: what a shared GPU's slices give
    verdicts = scenarios._targets(coalescing_rows(ours_gpu=16000.0), "torch:nccl")
    assert not [t for t in verdicts if "GPU" in t["target"]]
    assert {field for _, field, _, _ in scenarios.TARGETS} == {"cpu"}


def test_targets_without_a_measurement_are_na_not_pass():
    rows = [r for r in coalescing_rows() if r["candidate"] != "torch:nccl"]
    verdicts = scenarios._targets(rows, "torch:nccl")
    assert [t["status"] for t in verdicts] == ["n/a"] * 4


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
    assert text.count("# target:") == 4 and "MISS" in text and "PASS" in text


# -- torch's front alone, and each candidate's own share ----------------------------------
def with_front(rows, front_cpu=60.0):
    """The rows plus a front row per case (CPU time only, as the scenario measures it)."""
    cases = list(dict.fromkeys(r["case"] for r in rows))
    return rows + [{"kind": "scenario", "scenario": "coalescing", "case": case, "candidate": scenarios.FRONT,
                    "status": "ok", "cpu_us": front_cpu, "parts": 64} for case in cases]


def test_own_share_is_cpu_time_less_the_front_and_its_ratio_is_over_the_baselines_own():
    rows = with_front(coalescing_rows(ours_cpu=100.0))  # torch:nccl's block 120, the front 60
    scenarios._ratios(rows, "torch:nccl")
    scenarios._shares(rows, "torch:nccl")
    sync = {r["candidate"]: r for r in rows if r["case"] == "coalesced sync"}
    assert sync["cupycoll:nccl"]["own_cpu_us"] == pytest.approx(40.0)
    assert sync["torch:nccl"]["own_cpu_us"] == pytest.approx(60.0)
    assert sync["cupycoll:nccl"]["own_ratio"] == pytest.approx(40 / 60)
    assert sync["torch:nccl"]["own_ratio"] == pytest.approx(1.0)
    front = sync[scenarios.FRONT]
    assert "own_cpu_us" not in front and "gpu_ratio" not in front  # the front has no GPU time to compare
    assert front["cpu_ratio"] == pytest.approx(60 / 120)  # torch:nccl's block is half its front


def test_without_the_front_no_share_is_made_up():
    rows = coalescing_rows()
    scenarios._shares(rows, "torch:nccl")
    assert not [r for r in rows if "own_cpu_us" in r or "own_ratio" in r]
    failed = with_front(coalescing_rows())
    for r in failed:
        if r["candidate"] == scenarios.FRONT and r["case"] == "flat":
            r.update(status="error", note="boom")
            del r["cpu_us"]
    scenarios._shares(failed, "torch:nccl")
    assert not [r for r in failed if r["case"] == "flat" and "own_cpu_us" in r]
    assert [r for r in failed if r["case"] == "coalesced sync" and "own_cpu_us" in r]


def test_scenario_lines_show_each_candidates_own_share_per_part():
    rows = with_front(coalescing_rows(ours_cpu=100.0))
    for r in rows:
        r.setdefault("parts", 64 if r["case"].startswith(("coalesced", "uncoalesced")) else 1)
    scenarios._ratios(rows, "torch:nccl")
    scenarios._shares(rows, "torch:nccl")
    lines = output.scenario_lines("coalescing", rows, "torch:nccl")
    shares = lines[lines.index(next(line for line in lines if line.startswith("# own share"))):]
    mine = next(line for line in shares if "coalesced sync" in line and "cupycoll:nccl" in line)
    assert mine.split()[-4:] == ["100.00", "40.00", "0.62", "0.667"]  # CPU, own, own per part (40 / 64), ratio
    front = next(line for line in shares if "coalesced sync" in line and scenarios.FRONT in line)
    assert front.split()[-4:] == ["60.00", "-", "-", "-"]  # the front's CPU time, nothing to subtract
    assert output.share_lines(coalescing_rows(), "torch:nccl") == []  # no front, no share lines


class _FrontCtx:
    device = torch.device("cpu")


class _Recording(FrontOnlyGroup):
    """What reaches the front-only group (a stand-in for the test alone: the group itself
    keeps nothing)."""

    def __init__(self):
        super().__init__(0, 2)
        self.seen = []

    def allreduce(self, tensors, opts=None):
        self.seen.append(("allreduce", len(tensors)))
        return super().allreduce(tensors, opts)

    def allreduce_coalesced(self, tensors, opts=None):
        self.seen.append(("allreduce_coalesced", len(tensors)))
        return super().allreduce_coalesced(tensors, opts)

    def _start_coalescing(self, device):
        self.seen.append(("start", str(device)))

    def _end_coalescing(self, device):
        self.seen.append(("end", str(device)))
        return super()._end_coalescing(device)


def test_the_front_only_group_gets_the_calls_torch_makes_and_finishes_them_at_once():
    group = _Recording()
    flat, pieces = torch.zeros(8), [torch.zeros(2) for _ in range(4)]
    cases = {case: (fn, finish) for case, fn, finish in scenarios.coalescing_cases(_FrontCtx(), group, flat, pieces)}
    assert list(cases) == list(scenarios.COALESCING_CASES)
    expected = {"flat": [("allreduce", 1)],
                "coalesced sync": [("start", "cpu"), ("allreduce_coalesced", 4), ("end", "cpu")],
                "coalesced async": [("start", "cpu"), ("allreduce_coalesced", 4), ("end", "cpu")],
                "uncoalesced": [("allreduce", 1)] * 4,
                "1-element sync": [("allreduce", 1)], "1-element async": [("allreduce", 1)]}
    for case, (fn, finish) in cases.items():
        group.seen.clear()
        result = fn()
        if finish is not None:
            finish(result)
        assert group.seen == expected[case], case
    work = dist.all_reduce(flat, group=group, async_op=True)
    assert work.is_completed() and work.wait()
    assert not dist.distributed_c10d._world.pg_coalesce_state.get(group)  # every block closed


# -- time-sliced GPU times ----------------------------------------------------------------
def test_gpu_times_below_16_mib_on_a_shared_gpu_are_time_sliced():
    assert metrics.time_sliced(True, 1) and metrics.time_sliced(True, (16 << 20) - 1)
    assert not metrics.time_sliced(True, 16 << 20) and not metrics.time_sliced(True, 256 << 20)
    assert not metrics.time_sliced(False, 1)  # one rank per GPU: nothing takes turns


class _RowCtx:
    world = 2

    def __init__(self, shared):
        self.shared_gpu = shared

    def time_sliced(self, size_bytes):
        return Rank.time_sliced(self, size_bytes)


def test_a_scenario_row_says_when_its_gpu_time_is_time_sliced():
    ok = {"status": "ok", "gpu_us": 4500.0, "cpu_us": 30.0}
    assert scenarios._scenario_row(_RowCtx(True), "overhead", "1-element sync", "torch:nccl", ok, 4)["time_sliced"]
    assert "time_sliced" not in scenarios._scenario_row(_RowCtx(True), "coalescing", "flat", "torch:nccl", ok,
                                                        16 << 20)
    assert "time_sliced" not in scenarios._scenario_row(_RowCtx(False), "overhead", "1-element sync",
                                                        "torch:nccl", ok, 4)
    front = {"status": "ok", "cpu_us": 6.0}  # no GPU time at all
    assert "time_sliced" not in scenarios._scenario_row(_RowCtx(True), "coalescing", "flat", scenarios.FRONT,
                                                        front, 4)
    failed = {"status": "error", "note": "boom"}
    assert "time_sliced" not in scenarios._scenario_row(_RowCtx(True), "coalescing", "flat", "torch:nccl",
                                                        failed, 4)


def test_scenario_lines_mark_time_sliced_cases_and_say_what_that_means():
    rows = coalescing_rows()
    for r in rows:
        if r["case"] != "flat":
            r["time_sliced"] = True
    lines = output.scenario_lines("coalescing", rows, "torch:nccl")
    flat = [line for line in lines if line.lstrip().startswith("flat")]
    sliced = [line for line in lines if line.lstrip().startswith("1-element sync")]
    assert flat and not any(line.endswith(output.SLICED_MARK) for line in flat)
    assert sliced and all(line.endswith(output.SLICED_MARK) for line in sliced)
    note = next(line for line in lines if "marked time-sliced" in line)
    assert note.startswith("# 5 cases marked time-sliced") and "16 MiB" in note and "host times do not" in note
    assert not [line for line in output.scenario_lines("c", coalescing_rows(), "torch:nccl")
                if "time-sliced" in line]


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
