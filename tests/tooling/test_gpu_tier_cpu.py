"""What the GPU tier relies on that a CPU can check: the multi-process harness (no pipe
deadlock, hangs and failures end with every rank's output), the API suite's expectations
(exactness of each reduction check against every order NCCL may reduce in, the cases torch's
nccl cannot run as a reference, the cross-backend comparison), the one-rank fp8 AVG choice,
a communicator creation that times out, and the tier's split into parts with budgets.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import datetime
import importlib
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import mp
from cupycoll import _args
from cupycoll.nccl import bootstrap as bootstrap_module
from cupycoll.nccl import header as nh
from cupycoll.errors import CollectiveTimeoutError, CommunicatorAbortedError, CupycollValueError
from gpu import tier
from gpu.tier import (COMMAND_LIMIT_S, GPU_TIER, GPU_TIER_BUDGETS_S, GPU_TIER_ESTIMATES_S, PART_START_S,
                      pytest_command)
from standins import CUDA, CpuAsCudaGroup
from workers import api_plan, api_worker

pytestmark = pytest.mark.any_stack  # its subject is the same on every stack: one CI leg runs it

R = dist.ReduceOp
ROOT = Path(__file__).resolve().parents[2]


# -- the harness (tests/mp.py) ---------------------------------------------------------


@pytest.mark.launches
def test_a_rank_writing_more_than_a_pipe_holds_does_not_deadlock_the_harness():
    # rank 1 writes 256 KiB to each stream before rank 0 may go on: with pipes read one
    # rank at a time this hung until the timeout
    start = time.monotonic()
    results = mp.run_ranks("harness_worker.py", 2, ["chatty"], timeout=60)
    assert time.monotonic() - start < 45
    assert [r.returncode for r in results] == [0, 0]
    assert len(results[1].stdout) >= 256 * 1024 and len(results[1].stderr) >= 256 * 1024


@pytest.mark.launches
def test_a_hung_rank_fails_the_run_with_its_output_and_is_killed():
    job = mp.start_ranks("harness_worker.py", 2, ["hang"], timeout=8)
    with pytest.raises(mp.WorkersFailed, match="did not finish within 8 s") as info:
        job.wait()
    assert "rank 0 is about to hang" in str(info.value)
    assert "full logs:" in str(info.value) and os.path.isdir(job.log_dir)
    assert all(p.poll() is not None for p in job.procs)


def test_a_failed_rank_ends_the_run_after_a_grace_period(monkeypatch):
    monkeypatch.setattr(mp, "FAIL_GRACE_S", 1.0)
    start = time.monotonic()
    with pytest.raises(mp.WorkersFailed, match="a rank failed") as info:
        mp.run_ranks("harness_worker.py", 2, ["fail"], timeout=60)
    assert time.monotonic() - start < 30  # not the 60 s timeout
    assert "rank 1 fails on purpose" in str(info.value) and "exit 3" in str(info.value)


@pytest.mark.launches
def test_jobs_run_side_by_side_and_a_failure_kills_the_rest():
    hung = mp.start_ranks("harness_worker.py", 1, ["hang"], timeout=60)
    failing = mp.start_ranks("harness_worker.py", 2, ["fail"], timeout=4)
    with pytest.raises(mp.WorkersFailed):
        mp.wait_all([failing, hung])
    assert all(p.poll() is not None for p in hung.procs + failing.procs)


@pytest.mark.launches
def test_workers_import_the_helpers_of_tests_by_name(monkeypatch):
    # ring_worker.py imports ring_simulator as the tests do; the harness, not the caller's
    # environment, puts tests/ on the ranks' path
    monkeypatch.delenv("PYTHONPATH", raising=False)
    [result] = mp.run_ranks("harness_worker.py", 1, ["helpers"], timeout=120)
    assert Path(result.stdout.strip()) == ROOT / "tests" / "ring_simulator.py"


def test_ranks_end_when_the_test_process_is_killed():
    # a tier part over its budget is killed with its process group; the ranks lead sessions
    # of their own, so only their tie to the test process (tests/mp.py) can end them
    code = ("import sys, time, mp; job = mp.start_ranks('harness_worker.py', 2, ['fail'], timeout=60); "
            "print(*[p.pid for p in job.procs], flush=True); time.sleep(60)")
    test_process = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT / "tests", stdout=subprocess.PIPE,
                                    text=True, env=dict(os.environ, PYTHONPATH=f"{ROOT / 'tests'}:{ROOT}"))
    pids = [int(p) for p in test_process.stdout.readline().split()]
    assert len(pids) == 2
    test_process.kill()
    test_process.wait()
    deadline = time.monotonic() + 20
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [pid for pid in pids if mp.process_alive(pid)]
    assert not alive, f"ranks {alive} outlived the killed test process"


def test_ranks_sharing_a_gpu_use_loopback_sockets_not_infiniband():
    envs = [mp.shared_gpu_env(rank) for rank in range(3)]
    assert len({e["NCCL_HOSTID"] for e in envs}) == 3
    for env in envs:
        assert env["NCCL_IB_DISABLE"] == "1" and env["NCCL_SOCKET_IFNAME"] == "lo"
        assert env["GLOO_SOCKET_IFNAME"] == "lo"


# -- the API suite's expectations (tests/workers/api_plan.py, api_worker.Suite) ----------


def _fold_orders(values, combine):
    """Every result of reducing ``values`` pairwise in any order and grouping (ring, tree,
    any rotation), each partial result rounded by ``combine``."""
    if len(values) == 1:
        return [values[0]]
    results = []
    for i, j in itertools.combinations(range(len(values)), 2):
        rest = [v for k, v in enumerate(values) if k not in (i, j)]
        results += _fold_orders(rest + [combine(values[i], values[j])], combine)
    return results


def _nccl_like_results(dtype, op, world, n=1001):
    """What NCCL may return for the suite's inputs: the reduction in ``dtype``, rounded at
    every step; AVG pre-multiplies by 1/n (the factor itself in ``dtype`` or exact)."""
    inputs = [api_worker.value(r, n, dtype) for r in range(world)]
    wide = torch.complex128 if dtype.is_complex else torch.float64 if dtype.is_floating_point else torch.int64

    def rounded(x):
        return x.to(dtype)

    def combine(a, b):
        a, b = a.to(wide), b.to(wide)
        if op in (R.SUM, R.AVG):
            return rounded(a + b)
        if op == R.PRODUCT:
            return rounded(a * b)
        return rounded(torch.minimum(a, b) if op == R.MIN else torch.maximum(a, b))

    if op == R.AVG and world == 1 and api_plan.is_fp8(dtype):
        op_inputs = [inputs]  # cupycoll issues SUM on one rank (for_group_size)
    elif op == R.AVG and not (dtype.is_floating_point or dtype.is_complex):
        # NCCL divides integers once, at the end
        return [rounded(torch.div(sum(i.to(wide) for i in inputs), world, rounding_mode="trunc"))]
    elif op == R.AVG:
        factors = [torch.tensor(1.0 / world, dtype=torch.float64), torch.tensor(1.0 / world).to(dtype)]
        op_inputs = [[rounded(i.to(wide) * f.to(wide)) for i in inputs] for f in factors]
    else:
        op_inputs = [inputs]
    return [result for ins in op_inputs for result in _fold_orders(ins, combine)]


FULL_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
               torch.int32, torch.int64, torch.float8_e4m3fn, torch.float8_e5m2,
               torch.complex64, torch.complex128]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", FULL_DTYPES, ids=str)
def test_every_reduction_check_holds_for_every_order_nccl_may_reduce_in(dtype, world):
    # The worker's own Suite.check, with the exactness api_plan chose, against each result a
    # correct NCCL may produce: a check that a correct backend can fail is a broken test
    # (e5m2 cannot hold 9, so fp8 sums at 3 ranks must be checked with a tolerance).
    ops = [R.SUM, R.AVG] if dtype.is_complex else [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.AVG]
    suite = api_worker.Suite(torch.device("cpu"), out=None)
    for op in ops:
        expected = api_worker.reduce_ref([api_worker.value(r, 1001, dtype) for r in range(world)], op)
        for index, got in enumerate(_nccl_like_results(dtype, op, world)):
            suite.check(f"{op}/{index}", got, expected, **api_plan.reduce_check(dtype, op, world))
    assert suite.failures == []


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_fp8_checks_still_catch_a_wrong_result(dtype):
    suite = api_worker.Suite(torch.device("cpu"), out=None)
    expected = api_worker.reduce_ref([api_worker.value(r, 1001, dtype) for r in range(3)], R.SUM)
    one_rank_missing = sum(api_worker.value(r, 1001, dtype).float() for r in range(2)).to(dtype)
    suite.check("sum", one_rank_missing, expected, **api_plan.reduce_check(dtype, R.SUM, 3))
    assert suite.failures


def test_exact_checks_stay_exact_where_the_dtype_holds_the_result():
    assert api_plan.reduce_check(torch.int32, R.SUM, 4) == {"exact": True}
    assert api_plan.reduce_check(torch.float16, R.PRODUCT, 4) == {"exact": True}
    assert api_plan.reduce_check(torch.float32, R.AVG, 2)["exact"] is False
    assert api_plan.reduce_check(torch.float8_e5m2, R.SUM, 3)["exact"] is False


def test_reduce_runs_no_max_on_complex_which_cupycoll_rejects():
    assert api_plan.reduce_ops_for(torch.complex64) == (R.SUM,)
    assert api_plan.reduce_ops_for(torch.float32) == (R.SUM, R.MAX)
    with pytest.raises(CupycollValueError, match="MAX is not defined for dtype torch.complex64"):
        _args.reduction(torch.complex64, R.MAX, True)


def test_ring_exchanges_are_skipped_at_one_rank_where_they_would_send_to_self():
    assert not api_plan.self_p2p_cases_apply(1) and api_plan.self_p2p_cases_apply(2)
    group = CpuAsCudaGroup(dist.HashStore(), 0, 1, datetime.timedelta(seconds=5))
    with pytest.raises(CupycollValueError, match="own rank"):
        group.send([torch.ones(1)], 0)


@pytest.mark.parametrize("family, dtype, reason", [
    ("broadcast", torch.int16, "no NCCL type"),
    ("all_gather", torch.uint16, "no NCCL type"),
    ("all_gather_into_tensor", torch.int16, "no NCCL type"),
    ("reduce", torch.complex128, "unconverted"),
    ("coalesced/exception_then_collective", None, "coalescing mode"),
])
def test_torch_nccl_reference_skips_what_it_cannot_run(family, dtype, reason):
    assert reason in api_plan.reference_lacks("nccl", family, dtype)
    for backend in ("cupycoll", "cpu:gloo,cuda:cupycoll", "gloo"):
        assert api_plan.reference_lacks(backend, family, dtype) == ""


def test_torch_nccl_reference_runs_everything_else():
    assert api_plan.reference_lacks("nccl", "broadcast", torch.float32) == ""
    assert api_plan.reference_lacks("nccl", "reduce", torch.float64) == ""
    assert api_plan.reference_lacks("nccl", "all_reduce", torch.complex64) == ""


def test_suite_records_a_skipped_case_without_running_it():
    suite = api_worker.Suite(torch.device("cpu"), out=None, backend="nccl")
    ran = []
    suite.run("broadcast/torch.int16/root0/sync", ran.append, "broadcast", torch.int16)
    suite.run("broadcast/torch.int32/root0/sync", ran.append, "broadcast", torch.int32)
    assert ran == ["broadcast/torch.int32/root0/sync"]
    assert list(suite.skipped) == ["broadcast/torch.int16/root0/sync"]


def test_large_outputs_are_kept_as_digests_and_small_ones_as_tensors():
    small = torch.arange(api_plan.KEEP_TENSORS_UP_TO, dtype=torch.float32)
    large = torch.arange(api_plan.LARGE, dtype=torch.float32)
    assert api_plan.kept(small) is small
    d = api_plan.kept(large)
    assert isinstance(d, str) and d.startswith("sha256:float32:(1048579,):")
    assert api_plan.kept([large, small])[1] is small
    assert api_plan.digest(large) == api_plan.digest(large.clone())
    changed = large.clone()
    changed[-1] += 1
    assert api_plan.digest(changed) != d
    assert api_plan.digest(large.view(torch.int32)) != d  # same bytes, another dtype


def test_comparison_with_the_reference_covers_common_exact_cases_only():
    t = torch.arange(5.0)
    ours = {"all_reduce/torch.float32/RedOpType.SUM/5/sync": t, "broadcast/x": [t, t],
            "all_reduce/torch.float32/RedOpType.AVG/5/sync": t, "all_reduce/torch.float8_e5m2/x": t,
            "only_ours": t, "big": api_plan.digest(torch.ones(5000))}
    reference = {"all_reduce/torch.float32/RedOpType.SUM/5/sync": t.clone(), "broadcast/x": [t, t.clone()],
                 "all_reduce/torch.float32/RedOpType.AVG/5/sync": t + 1e-6,
                 "all_reduce/torch.float8_e5m2/x": t + 1, "only_reference": t,
                 "big": api_plan.digest(torch.ones(5000))}
    compared, mismatches = api_plan.compare_runs(ours, reference)
    assert (compared, mismatches) == (3, [])
    reference["broadcast/x"] = [t, t + 1]
    reference["big"] = api_plan.digest(torch.zeros(5000))
    reference["all_reduce/torch.float32/RedOpType.SUM/5/sync"] = t.to(torch.float64)
    compared, mismatches = api_plan.compare_runs(ours, reference)
    assert compared == 3 and [m.split("[")[0] for m in mismatches] == [
        "all_reduce/torch.float32/RedOpType.SUM/5/sync", "big", "broadcast/x"]


def test_comparison_leaves_out_cases_the_reference_got_wrong():
    t = torch.arange(3.0)
    compared, mismatches = api_plan.compare_runs({"a": t, "b": t}, {"a": t + 1, "b": t}, exclude={"a"})
    assert (compared, mismatches) == (1, [])
    assert api_plan.failed_case_names(["a[0]: got [1] expected [0]", "b: raised TypeError: x"]) == {"a", "b"}


# -- cupycoll behaviour the GPU tier relies on ---------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_fp8_avg_on_one_rank_is_issued_as_sum(dtype, monkeypatch):
    # NCCL's one-rank path has no fp8 pre-multiply on the host: ncclInvalidArgument
    red = _args.reduction(dtype, R.AVG, True)
    assert red.op == nh.ncclAvg
    assert _args.for_group_size(red, dtype, 1).op == nh.ncclSum
    assert _args.for_group_size(red, dtype, 2).op == nh.ncclAvg
    other = _args.reduction(torch.float16, R.AVG, True)
    assert _args.for_group_size(other, torch.float16, 1) is other
    monkeypatch.setattr(_args, "fp8_supported", lambda: True)
    for size, op in ((1, nh.ncclSum), (3, nh.ncclAvg)):
        assert _args.reduction_plan(torch.ones(2, dtype=dtype), R.AVG, "auto", size).op == op


def test_a_communicator_creation_that_times_out_faults_the_group(monkeypatch):
    # the peers failed (or are stuck) in the same creation: the group must be dead, failing fast
    monkeypatch.setattr(bootstrap_module, "new_unique_id", lambda: b"\1" * 128)
    store = dist.HashStore()
    group = CpuAsCudaGroup(store, 0, 3, datetime.timedelta(seconds=0.3))
    with pytest.raises(CollectiveTimeoutError, match="all 3 ranks to join"):
        group._cuda.comm_for(CUDA)
    assert group._cuda.state == "aborted"
    joined = store.add("cupycoll/comm/0/arrived", 0)
    start = time.monotonic()
    with pytest.raises(CommunicatorAbortedError, match="timed out") as info:
        group._cuda.comm_for(CUDA)
    # fails fast: well inside the 0.3 s a second creation would wait (and no arrival below)
    assert time.monotonic() - start < 0.25 and isinstance(info.value.__cause__, CollectiveTimeoutError)
    assert store.add("cupycoll/comm/0/arrived", 0) == joined  # no second arrival counted
    assert not store.check(["cupycoll/comm/1/arrived"])


def test_a_pair_communicator_creation_that_times_out_faults_the_group(monkeypatch):
    monkeypatch.setattr(bootstrap_module, "new_unique_id", lambda: b"\1" * 128)
    group = CpuAsCudaGroup(dist.HashStore(), 1, 3, datetime.timedelta(seconds=0.3))
    group._cuda.device = CUDA
    with pytest.raises(CollectiveTimeoutError):
        group._cuda.p2p_comm(2)
    with pytest.raises(CommunicatorAbortedError):
        group._cuda.p2p_comm(0)


# -- the tier's split (tests/gpu/tier.py) ----------------------------------------------------


def test_the_tier_runs_semantics_first_and_every_part_fits_one_command():
    assert [name for name, _, _ in GPU_TIER] == ["semantics", "api", "ring", "faults", "bench", "compile", "fsdp"]
    for name, path, budget in GPU_TIER:
        assert (ROOT / path).is_file(), path
        assert 0 < budget <= COMMAND_LIMIT_S < 600, name
        assert GPU_TIER_BUDGETS_S[name] == budget
        assert 0 < GPU_TIER_ESTIMATES_S[name] < budget, name
    assert pytest_command("tests/gpu/x.py", "py") == ["py", "-m", "pytest", "-m", "gpu", "-x", "-q", "-rfEs",
                                                      "tests/gpu/x.py"]


def test_parts_that_only_read_finished_runs_judge_every_test():
    stops = {name: "-x" in pytest_command(path, "py") for name, path, _ in GPU_TIER}
    assert stops == {"semantics": True, "api": False, "ring": True, "faults": False, "bench": True, "compile": True,
                     "fsdp": False}


# How each part's subprocesses run, read from its test file: stages one after another, the
# runs of a stage side by side. A string is a key of the file's SUBPROCESS_LIMITS_S, a number
# a limit written at the call. The bench part declares its order (SEQUENTIAL_RUNS).
RUN_STAGES = {
    # one torchrun (test_ddp_parity_with_torch_nccl), then the no-context-on-cuda:0 check;
    # the other tests run in pytest's process
    "semantics": [["ddp parity"], ["no context on cuda:0"]],
    # the `runs` fixture starts all five suite runs, then waits for them
    "api": [["suite runs"]],
    # test_ring_under_algorithm_context_and_options starts three runs, then wait_all
    "ring": [["ring run"]],
    # the `launched` fixture starts the suites and every gpu_hang_worker launch at once; after
    # the CUDA hang's launch, `python -m cupycoll.trace` reads its dumps (timeout=60)
    "faults": [["suite launch", "cold skip", "kill mid-DDP", "cycles", "CUDA hang", "pair abort"], [60]],
    # two torchruns side by side (one per backend), then one torchrun training on both
    "compile": [["side by side"], ["one process"]],
    # the `trained` fixture starts the four train_fsdp.py launches at once, then waits
    "fsdp": [["launches"]],
}


def _stages(name, module):
    if name in RUN_STAGES:
        return RUN_STAGES[name]
    return [[label] for label in module.SEQUENTIAL_RUNS]


def _limits_at_calls(path):
    """What each ``timeout=`` keyword of a call in ``path`` says: a SUBPROCESS_LIMITS_S key, a
    number, or nothing (a variable passed on, a timedelta, a helper such as _limit)."""
    found = []
    for node in ast.walk(ast.parse((ROOT / path).read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Call):
            continue
        for keyword in node.keywords:
            value = keyword.value
            if keyword.arg != "timeout":
                continue
            if (isinstance(value, ast.Subscript) and isinstance(value.value, ast.Name)
                    and value.value.id == "SUBPROCESS_LIMITS_S" and isinstance(value.slice, ast.Constant)):
                found.append(value.slice.value)
            elif isinstance(value, ast.Constant) and isinstance(value.value, (int, float)):
                found.append(value.value)
    return found


@pytest.mark.parametrize("name, path, budget", GPU_TIER, ids=[p[0] for p in GPU_TIER])
def test_every_subprocess_limit_is_below_its_parts_budget(name, path, budget):
    # so that a hang fails inside the part, with the ranks' output, before the part is killed:
    # pytest's start plus each stage's longest limit, stage after stage, must fit the budget
    module = importlib.import_module("gpu." + Path(path).stem)
    limits = module.SUBPROCESS_LIMITS_S
    assert limits and max(limits.values()) < budget, limits
    assert module.BUDGET_S == budget
    stages = _stages(name, module)
    named = [entry for stage in stages for entry in stage]
    # the plan names every limit the file declares, and every limit its calls use
    assert {e for e in named if isinstance(e, str)} == set(limits), (named, limits)
    assert set(_limits_at_calls(path)) <= set(named), (_limits_at_calls(path), named)
    worst = PART_START_S + sum(max(limits[e] if isinstance(e, str) else e for e in stage) for stage in stages)
    assert worst <= budget, f"{name}: {PART_START_S} s start + {stages} = {worst} s > budget {budget} s"


def test_the_bench_part_declares_each_run_once_per_call_that_makes_it():
    # each call site runs once, so its SEQUENTIAL_RUNS must list each limit once per call
    bench = importlib.import_module("gpu.test_gpu_bench")
    assert collections.Counter(_limits_at_calls("tests/gpu/test_gpu_bench.py")) == collections.Counter(
        bench.SEQUENTIAL_RUNS)
    assert PART_START_S + sum(bench.SUBPROCESS_LIMITS_S[r] for r in bench.SEQUENTIAL_RUNS) <= bench.BUDGET_S


def test_the_sequential_check_catches_runs_that_add_up_past_the_budget():
    # the old bench part: limits 100+45+60+60+100+90 = 455 s in turn in a 180 s part
    old = {"smoke": 100, "plot": 45, "types": 60, "scenarios": 100, "torchrun": 90}
    runs = ["smoke", "plot", "types", "types", "scenarios", "torchrun"]
    assert max(old.values()) < 180  # what the old check looked at: it passed
    assert PART_START_S + sum(old[r] for r in runs) > 180


# -- --run within one command's budget (tests/gpu/tier.py run_parts) ---------------------------


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _simulate(parts, budget_s, takes):
    """run_parts with each part taking ``takes(name, budget)`` seconds of a fake clock."""
    clock, ran = FakeClock(), []

    def run(name, path, budget):
        ran.append(name)
        clock.now += takes(name, budget)
        return 0

    return tier.run_parts(parts, budget_s, run=run, clock=clock), ran


def test_the_tier_runs_in_one_command_when_parts_take_their_estimates(capsys):
    statuses, ran = _simulate(GPU_TIER, COMMAND_LIMIT_S, lambda name, budget: GPU_TIER_ESTIMATES_S[name])
    assert ran == [name for name, _, _ in GPU_TIER]
    assert tier.summary(statuses) == ("=== GPU tier: semantics passed, api passed, ring passed, faults passed, "
                                      "bench passed, compile passed, fsdp passed", 0)
    assert "NOT RUN" not in capsys.readouterr().out


def test_a_part_that_no_longer_fits_is_not_run_and_named(capsys):
    # the worst case: every part takes its whole budget; the first four still fit one command
    first_four = [name for name, _, _ in GPU_TIER][:4]
    assert sum(GPU_TIER_BUDGETS_S[n] for n in first_four) <= COMMAND_LIMIT_S
    statuses, ran = _simulate(GPU_TIER, COMMAND_LIMIT_S, lambda name, budget: budget)
    assert ran == first_four
    line, status = tier.summary(statuses)
    assert status == tier.NOT_RUN_EXIT == 3
    assert line.endswith("faults passed, bench not run: over the command budget, run `make test-gpu-bench`, "
                         "compile not run: over the command budget, run `make test-gpu-compile`, "
                         "fsdp not run: over the command budget, run `make test-gpu-fsdp`")
    out = capsys.readouterr().out
    assert "part 'bench' NOT RUN" in out and "run `make test-gpu-bench`" in out
    # ... and it fits a command of its own
    statuses, ran = _simulate([p for p in GPU_TIER if p[0] == "bench"], COMMAND_LIMIT_S, lambda n, b: b)
    assert ran == ["bench"] and tier.summary(statuses)[1] == 0


def test_a_later_part_that_still_fits_runs_and_a_failure_outranks_a_skip():
    parts = [("a", "-", 100), ("big", "-", 300), ("small", "-", 50)]
    clock, ran = FakeClock(), []

    def run(name, path, budget):
        ran.append(name)
        clock.now += 100
        return 1 if name == "small" else 0

    statuses = tier.run_parts(parts, 300, run=run, clock=clock)
    assert ran == ["a", "small"] and statuses["big"] == tier.NOT_RUN
    line, status = tier.summary(statuses)
    assert status == 1
    assert line == ("=== GPU tier: a passed, big not run: over the command budget, run `make test-gpu-big`, "
                    "small FAILED (exit 1)")


def test_tier_run_with_stand_in_commands_kills_overruns_and_skips_what_does_not_fit(monkeypatch, capsys):
    # main() end to end, real processes: stand-in parts instead of pytest on the GPU files
    commands = {"quick": "pass", "failing": "raise SystemExit(1)", "hung": "import time; time.sleep(60)",
                "big": "pass", "late": "pass"}
    parts = [("quick", "-", 5), ("failing", "-", 5), ("hung", "-", 1), ("big", "-", 60), ("late", "-", 5)]
    real_run_part = tier.run_part
    monkeypatch.setattr(tier, "check", lambda: [])
    monkeypatch.setattr(tier, "GPU_TIER", parts)
    monkeypatch.setattr(tier, "run_part", lambda name, path, budget: real_run_part(
        name, path, budget, cmd=[sys.executable, "-c", commands[name]]))
    start = time.monotonic()
    status = tier.main(["--run", "--budget", "12"])
    assert time.monotonic() - start < 10  # the hung stand-in was killed after its 1 s
    out = capsys.readouterr().out
    assert status == 1
    assert out.rstrip().splitlines()[-1] == (
        "=== GPU tier: quick passed, failing FAILED (exit 1), hung FAILED (exit 124), "
        "big not run: over the command budget, run `make test-gpu-big`, late passed")
    assert "part 'hung' ran past its budget of 1 s and was killed" in out
    assert "part 'big' NOT RUN: its budget is 60 s" in out

    # nothing failed, something not run: its own exit status
    assert tier.main(["--run", "quick", "big", "--budget", "12"]) == tier.NOT_RUN_EXIT
    assert tier.main(["--run", "quick", "late"]) == 0


def test_the_fault_suite_runs_every_scenario_and_kills_a_rank_last():
    fault_worker = importlib.import_module("workers.fault_worker")
    assert set(fault_worker.SUITE) == set(fault_worker.SCENARIOS)
    assert fault_worker.SUITE[-1] == "killed"  # it ends a rank: nothing may come after it


def test_a_hung_fault_scenario_shows_its_stacks_before_the_launch_is_killed():
    fault_worker = importlib.import_module("workers.fault_worker")
    faults = importlib.import_module("gpu.test_gpu_faults")
    # the suite's scenarios before the longest (recover) take about 60 s on the GPU machine
    assert fault_worker.SCENARIO_STACKS_AFTER_S + 60 < faults.SUBPROCESS_LIMITS_S["suite launch"]


@pytest.mark.launches
def test_tier_check_names_what_is_missing():
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "tests/gpu/tier.py", "--check"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "MISSING GPU" in proc.stdout and "ok      pytest" in proc.stdout
    assert "cannot run here: missing gpu" in proc.stderr


@pytest.mark.launches
def test_the_gpu_tier_collects_and_skips_with_a_reason_without_a_gpu():
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider",
                           "tests/gpu"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "passed" not in proc.stdout and "failed" not in proc.stdout
    assert "needs a CUDA GPU" in proc.stdout


@pytest.mark.launches
def test_a_passing_tests_figures_reach_the_parts_output_and_the_summary(tmp_path):
    from tools import verify_figures
    from tools.verify_runner import StepResult

    (tmp_path / "test_figure.py").write_text(
        "from gpu.tier import print_figure\n\n"
        "def test_one(capsys):\n"
        "    print('captured, not shown')\n"
        "    print_figure(capsys, 'fsdp 2 fp32', 'largest parameter difference 0.000e+00')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "captured, not shown" not in proc.stdout
    figures = verify_figures.read_pytest(StepResult(None, "passed", "", 1.0, 10.0, 0, proc.stdout))
    assert figures["passed"] == 1 and figures["fsdp 2 fp32"] == "largest parameter difference 0.000e+00", figures


# -- the gpu_hang_worker launches of the faults part (tests/workers/gpu_hang_worker.py) -------


def test_the_hang_worker_parses_its_arguments():
    from workers import gpu_hang_worker as w

    assert w.parse_args(["cycles", "blocking", "/o"]) == ("cycles", "blocking", "/o", w.DEFAULT_CYCLES)
    assert w.DEFAULT_CYCLES == 200  # outside the tier: enough cycles for a small leak to show
    assert w.parse_args(["cuda_hang", "nonblocking", "/o", "7"])[3] == 7
    for bad in (["nope", "blocking", "/o"], ["cycles", "eager", "/o"], ["cycles", "blocking", "/o", "1"],
                ["cycles", "blocking"], ["cycles", "blocking", "/o", "x"]):
        with pytest.raises(ValueError):
            w.parse_args(bad)


def test_every_hang_scenario_is_launched_by_the_faults_part_within_its_limit():
    from workers import gpu_hang_worker as w

    faults = importlib.import_module("gpu.test_gpu_faults")
    assert set(w.SCENARIOS) == set(w.WORLDS) == {s for s, _m, _l in faults.LAUNCHES}
    assert all(callable(getattr(w, s)) for s in w.SCENARIOS)
    assert {(s, m) for s, m, _l in faults.LAUNCHES if s in ("cold_skip", "kill_mid_ddp")} == {
        (s, m) for s in ("cold_skip", "kill_mid_ddp") for m in ("blocking", "nonblocking")}
    for _s, _m, label in faults.LAUNCHES:
        assert label in faults.SUBPROCESS_LIMITS_S
    # the deadline thread records a cold-communicator hang well before the launch is killed
    assert w.HANG_DEADLINE_S + 20 < faults.SUBPROCESS_LIMITS_S["cold skip"]
    assert w.HANG_SLEEP_S > faults.TIMEOUT_S + 5  # rank 1 answers the diagnosis while it sleeps
    assert faults.TIER_CYCLES < w.DEFAULT_CYCLES and faults._limit("cycles") < faults.BUDGET_S


def _cycles_report(count=24, keys_late=10, threads_late=30, reserved_late=2 << 20, mib_late=600):
    def sample(cycle, keys, threads, reserved, mib):
        return {"cycle": cycle, "gpu_free": 70 << 30, "process_gpu_mib": mib, "reserved": reserved,
                "store_keys": keys, "threads": threads, "fds": 40}
    return {"count": count, "warm": 5, "seconds_per_cycle": 1.234,
            "after_warm": sample(4, 50, 30, 2 << 20, 600), "middle": sample(13, 140, 30, 2 << 20, 600),
            "after_all": sample(23, 140 + 10 * keys_late, threads_late, reserved_late, mib_late)}


def test_cycle_figures_pass_when_flat_and_fail_on_growth():
    faults = importlib.import_module("gpu.test_gpu_faults")
    flat = faults.cycle_deltas(_cycles_report())
    assert flat["keys_per_cycle_first_half"] == flat["keys_per_cycle_second_half"] == 10
    assert flat["threads"] == 0 and flat["process_gpu_mib"] == 0 and flat["reserved_mib"] == 0
    faults.check_cycle_deltas(flat)
    faults.check_cycle_deltas(faults.cycle_deltas(_cycles_report(keys_late=11)))  # one key a cycle by chance
    for leak in ({"keys_late": 12}, {"threads_late": 34}, {"reserved_late": 200 << 20}, {"mib_late": 900}):
        with pytest.raises(AssertionError):
            faults.check_cycle_deltas(faults.cycle_deltas(_cycles_report(**leak)))


def test_verify_gpu_records_the_figures_a_tier_part_prints():
    from tools import verify_figures
    from tools.verify_runner import Step, StepResult

    tail = ("..\nGPU-FIGURE cold skip nonblocking: error after 5.21 s (timeout 5 s)\n.x\n"
            "GPU-FIGURE CUDA hang error: after 6.80 s (timeout 5 s)\n7 passed, 1 xfailed in 88.1s\n")
    figures = verify_figures.read_pytest(StepResult(Step("tier", "faults", [], 150, 95), "passed", "", 88, 150, 0,
                                                    tail))
    assert figures["passed"] == 7 and figures["failed"] == 0
    assert figures["cold skip nonblocking"] == "error after 5.21 s (timeout 5 s)"
    assert figures["CUDA hang error"] == "after 6.80 s (timeout 5 s)"


# -- the environment stage's driver figures (tools/gpu_env.py) --------------------------------

def _h100(mode="Default", mig="Disabled", index=0):
    from bench.gpu_info import Gpu

    return Gpu(index, "NVIDIA H100 80GB HBM3", f"GPU-{index}", "580.65.06", 81559, mode, mig)


def test_driver_figures_in_the_default_compute_mode_are_no_problem():
    from tools import gpu_env

    info = gpu_env.smi_figures([_h100()])
    assert info == {"smi_name": "NVIDIA H100 80GB HBM3", "driver": "580.65.06", "smi_memory": "81559 MiB",
                    "compute_modes": ["Default"], "compute_mode": "Default", "mig_mode": "Disabled"}
    assert gpu_env.smi_problems(info) == []


@pytest.mark.parametrize("mode", ["Exclusive_Process", "Prohibited"])
def test_a_compute_mode_other_than_default_is_a_problem(mode):
    from tools import gpu_env

    (problem,) = gpu_env.smi_problems(gpu_env.smi_figures([_h100(mode=mode)]))
    assert f"GPU 0 is in compute mode {mode}, not Default" in problem
    assert "nvidia-smi -i 0 -c DEFAULT" in problem


def test_each_gpus_modes_are_read_and_the_odd_one_named():
    from tools import gpu_env

    info = gpu_env.smi_figures([_h100(mig="Enabled"), _h100(mode="Exclusive_Process", index=1)])
    assert info["compute_mode"] == "GPU 0: Default; GPU 1: Exclusive_Process"
    assert info["mig_mode"] == "GPU 0: Enabled; GPU 1: Disabled"
    (problem,) = gpu_env.smi_problems(info)
    assert problem.startswith("GPU 1 is in compute mode Exclusive_Process")
    # a GPU without MIG says [N/A]; a driver without the field gives none
    assert gpu_env.smi_figures([_h100(mig="[N/A]")])["mig_mode"] == "[N/A]"
    assert "mig_mode" not in gpu_env.smi_figures([_h100(mig=None)])
    assert gpu_env.smi_figures([dataclasses.replace(_h100(), memory_mib=None)])["smi_memory"] == "[N/A]"


def test_a_driver_that_does_not_answer_is_recorded_as_is(monkeypatch):
    from bench import gpu_info
    from tools import gpu_env

    def unavailable(timeout=None):
        raise gpu_info.GpuInfoUnavailable("No devices were found")

    monkeypatch.setattr(gpu_info, "gpus", unavailable)
    info = gpu_env._driver_figures()
    assert info == {"nvidia_smi": "No devices were found"}
    assert gpu_env.smi_problems(info) == []


H100_SMI = "0, NVIDIA H100 80GB HBM3, GPU-0, 580.65.06, 81559, {mode}, {mig}\n"


def test_the_environment_stage_reports_an_exclusive_gpu_as_a_problem(monkeypatch, tmp_path, capsys):
    # collect() and main() as make verify-gpu runs them, without NVML, nvidia-smi's answer canned
    from tools import gpu_env

    def smi(argv, **kwargs):
        return subprocess.CompletedProcess(argv, 0, H100_SMI.format(mode="Exclusive_Process", mig="Disabled"), "")

    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(subprocess, "run", smi)
    out_json = tmp_path / "env.json"
    status = gpu_env.main(["--json", str(out_json)])
    printed = capsys.readouterr().out
    assert "smi_memory: 81559 MiB" in printed
    assert "compute_mode: Exclusive_Process" in printed and "mig_mode: Disabled" in printed
    assert "problem: GPU 0 is in compute mode Exclusive_Process, not Default" in printed
    recorded = json.loads(out_json.read_text(encoding="utf-8"))
    assert recorded["compute_mode"] == "Exclusive_Process" and recorded["mig_mode"] == "Disabled"
    assert "compute_modes" not in recorded
    assert any("compute mode Exclusive_Process" in p for p in recorded["problems"])
    if not torch.cuda.is_available():  # this machine: torch's missing GPU decides the status
        assert status == gpu_env.NO_GPU_EXIT
    else:
        assert status == 1
