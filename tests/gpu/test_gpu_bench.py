"""GPU tier, part "bench": cupycoll-bench end to end on CUDA, two ranks (sharing one GPU when
there is one).

Short runs, one after another, each a subprocess with a hard timeout that kills the
launcher and all its ranks (the limits add up to less than the part's budget): every
collective for every candidate with checks on (#wrong must be 0, cupycoll:ring "n/a" exactly
where the ring has no implementation), then `bench plot` from its JSON; the ring-capable
collectives across types and ops; the coalescing and overhead scenarios at a small scale
(targets are reported PASS or MISS: whether a target is met is a measurement, recorded with
the run, not a test outcome; this test requires that each was measured, with positive
times); and a run under torchrun.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from bench import catalog, output  # noqa: E402
from gpu.tier import GPU_TIER_BUDGETS_S  # noqa: E402
from mp import run_python  # noqa: E402

pytestmark = pytest.mark.gpu

CANDIDATES = ("cupycoll:nccl", "cupycoll:ring", "torch:nccl")

BUDGET_S = GPU_TIER_BUDGETS_S["bench"]
# The runs go one after another, so the part's budget must hold pytest's start plus the sum
# of their limits (tests/tooling/test_gpu_tier_cpu.py checks it), not just the longest. Each
# bench run starts 2 ranks (~10 s), initialises cupycoll and torch's nccl (~3 s), then
# measures over sockets; each limit is ~2x what the run should take:
#   smoke      3 sizes x 7 collectives x 3 candidates, each point checked, ~25 s
#   plot       matplotlib import and one figure, ~8 s
#   types      2 collectives x 7 dtypes x 6 ops x 3 candidates at 64K (ring kernels compiled
#              on first use, NVRTC), ~22 s; avg: the same on 3 float dtypes, ~15 s
#   scenarios  coalescing (6 cases x 2 candidates and torch's front, 20 iterations of 8 MiB) and
#              overhead, ~25 s
#   torchrun   torchrun's start, 2 candidates x 3 sizes, ~22 s
SUBPROCESS_LIMITS_S = {"smoke": 60, "plot": 25, "types": 45, "avg": 30, "scenarios": 50, "torchrun": 45}
# The order the tests run them in, one at a time (the plot only with matplotlib).
SEQUENTIAL_RUNS = ["smoke", "plot", "types", "avg", "scenarios", "torchrun"]


def _run(argv, timeout: float) -> subprocess.CompletedProcess:
    return run_python(*argv, timeout=timeout)


def bench(*args: str, timeout: float) -> subprocess.CompletedProcess:
    # --run_timeout makes the launcher stop its ranks a little before the test gives up.
    return _run(["-m", "bench", *args, "--run_timeout", str(int(timeout - 10))], timeout)


def _have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


NO_MATPLOTLIB = "matplotlib is not installed: bench --plot and `bench plot` need it (pip install -e '.[bench]')"


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("smoke")
    js = tmp / "smoke.json"
    proc = bench("all", "--ranks", "2", "-b", "4K", "-e", "256K", "-f", "8", "-c", "1", "-n", "3", "-w", "1",
                 "--json", str(js), "--csv", str(tmp / "smoke.csv"), timeout=SUBPROCESS_LIMITS_S["smoke"])
    return proc, js


def explain(proc) -> str:
    return f"exit {proc.returncode}\nstdout:\n{proc.stdout[-8000:]}\nstderr:\n{proc.stderr[-8000:]}"


def test_smoke_sweep_every_collective_every_candidate(smoke):
    proc, js = smoke
    assert proc.returncode == 0, explain(proc)
    document = output.read_json(str(js))
    meta, rows = document["meta"], document["rows"]
    assert meta["world_size"] == 2 and meta["gpu"] not in ("", "cpu")
    assert meta["torch_nccl"] != "n/a" and meta["cupy_nccl"] != "n/a"
    for collective in catalog.COLLECTIVES:
        for cand in CANDIDATES:
            mine = [r for r in rows if r.get("collective") == collective and r["candidate"] == cand]
            assert mine, (collective, cand)
            if cand == "cupycoll:ring" and collective not in catalog.RING_COLLECTIVES:
                assert all(r["status"] == "n/a" for r in mine), mine
                continue
            assert all(r["status"] == "ok" for r in mine), [r for r in mine if r["status"] != "ok"]
            assert all(r["wrong"] == 0 for r in mine), [r for r in mine if r["wrong"]]
            assert all(r["time_us"] > 0 and r["host_us"] > 0 and r["busbw_gbps"] > 0 for r in mine)
    assert "# Out of bounds values : 0 OK" in proc.stdout
    assert js.with_suffix(".csv").stat().st_size > 0


def test_plot_subcommand_from_the_smoke_json(smoke, tmp_path):
    if not _have_matplotlib():
        pytest.skip(NO_MATPLOTLIB)
    proc, js = smoke
    assert proc.returncode == 0, explain(proc)
    png = tmp_path / "smoke.png"
    plot = _run(["-m", "bench", "plot", str(js), "-o", str(png)], timeout=SUBPROCESS_LIMITS_S["plot"])
    assert plot.returncode == 0, explain(plot)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_ring_capable_collectives_across_types_and_ops(tmp_path):
    js = tmp_path / "types.json"
    proc = bench("all_reduce,reduce_scatter", "--ranks", "2", "-b", "64K", "-e", "64K", "-n", "2", "-w", "1",
                 "-d", "float,half,bfloat16,double,int32,int8,uint8", "-o", "sum,prod,max,min,band,bxor",
                 "--json", str(js), timeout=SUBPROCESS_LIMITS_S["types"])
    assert proc.returncode == 0, explain(proc)
    rows = output.read_json(str(js))["rows"]
    # avg separately, on floats only (NCCL averages floats by pre-multiplying by 1/n)
    js_avg = tmp_path / "avg.json"
    proc = bench("all_reduce,reduce_scatter", "--ranks", "2", "-b", "64K", "-e", "64K", "-n", "2", "-w", "1",
                 "-d", "float,half,bfloat16", "-o", "avg", "--json", str(js_avg), timeout=SUBPROCESS_LIMITS_S["avg"])
    assert proc.returncode == 0, explain(proc)
    rows += output.read_json(str(js_avg))["rows"]
    assert not [r for r in rows if r["status"] == "error"]
    assert all(r["wrong"] == 0 for r in rows if r["status"] == "ok")
    for r in rows:
        bitwise = r["redop"] in catalog.BITWISE_OPS
        floating = catalog.DTYPES[r["type"]][2] == "float"
        if bitwise and (floating or r["candidate"] != "cupycoll:ring"):
            assert r["status"] == "n/a", r
        if r["candidate"] in ("torch:nccl", "cupycoll:nccl") and not bitwise:
            assert r["status"] == "ok", r
        if r["candidate"] == "cupycoll:ring" and floating and r["redop"] in ("sum", "avg"):
            assert r["status"] == "ok", r
    # the ring's bitwise reductions run and check out on integers
    assert [r for r in rows if r["candidate"] == "cupycoll:ring" and r["redop"] == "band" and r["status"] == "ok"]


def test_coalescing_and_overhead_scenarios_small(tmp_path):
    js, png = tmp_path / "scenarios.json", tmp_path / "scenarios.png"
    plot = ["--plot", str(png)] if _have_matplotlib() else []
    if not plot:
        print(NO_MATPLOTLIB)
    proc = bench("--scenario", "coalescing,overhead", "--ranks", "2", "--coalesce-bytes", "8M",
                 "--coalesce-ops", "16", "--scenario-iters", "20", "--overhead-calls", "50",
                 "--json", str(js), *plot, timeout=SUBPROCESS_LIMITS_S["scenarios"])
    assert proc.returncode == 0, explain(proc)
    document = output.read_json(str(js))
    rows, shared = document["rows"], document["meta"]["shared_gpu"]
    coalescing = [r for r in rows if r.get("scenario") == "coalescing" and r["kind"] == "scenario"]
    cases = {"flat", "coalesced sync", "coalesced async", "uncoalesced", "1-element sync", "1-element async"}
    for cand in ("cupycoll:nccl", "torch:nccl"):
        mine = {r["case"]: r for r in coalescing if r["candidate"] == cand}
        assert set(mine) == cases, cand
        assert all(r["status"] == "ok" and r["gpu_us"] > 0 and r["cpu_us"] > 0 for r in mine.values()), mine
        # each with its own share: its CPU time less torch's front alone
        assert all(r["own_cpu_us"] is not None for r in mine.values()), mine
        # 2 ranks on one GPU: every case moves less than 16 MiB a call, so its GPU time is time slices
        assert {case for case, r in mine.items() if r.get("time_sliced")} == (cases if shared else set()), mine
    front = {r["case"]: r for r in coalescing if r["candidate"] == "torch front"}
    assert set(front) == cases and all(r["status"] == "ok" and r["cpu_us"] > 0 for r in front.values()), front
    targets = [r for r in rows if r["kind"] == "target"]
    assert len(targets) == 4 and all(t["status"] in ("PASS", "MISS") for t in targets), targets
    for t in targets:
        # a ratio of two measured times: positive and finite, and its verdict follows from it
        assert 0 < t["value"] < 1e6 and t["status"] == ("PASS" if t["value"] <= t["limit"] else "MISS"), t
        print(f"target {t['target']}: {t['value']:.3g} (limit {t['limit']}) {t['status']}")
    assert proc.stdout.count("# target:") == 4
    overhead = [r for r in rows if r.get("scenario") == "overhead"]
    assert {r["candidate"] for r in overhead} == set(CANDIDATES)
    # every candidate makes every call but the ring its all_gather (it reduces only)
    ring_gather = [r for r in overhead if r["candidate"] == "cupycoll:ring" and "all_gather" in r["case"]]
    assert [r["status"] for r in ring_gather] == ["n/a"], ring_gather
    assert all(r["status"] == "ok" for r in overhead if r not in ring_gather), overhead
    if plot:
        assert png.stat().st_size > 10_000


def test_under_torchrun(tmp_path):
    js = tmp_path / "torchrun.json"
    proc = _run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "bench",
                 "all_reduce", "--share-gpu", "-b", "1K", "-e", "64K", "-f", "8", "-n", "2", "-w", "1",
                 "--backends", "cupycoll:nccl,torch:nccl", "--json", str(js)],
                timeout=SUBPROCESS_LIMITS_S["torchrun"])
    assert proc.returncode == 0, explain(proc)
    rows = output.read_json(str(js))["rows"]
    assert rows and all(r["status"] == "ok" and r["wrong"] == 0 for r in rows)
