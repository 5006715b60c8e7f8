"""make verify-gpu on CPU: its stage runner, time limits, summary, results folder, plans.

The stages are replaced by tiny Python commands (sleeps, prints, children that outlive
their parent); the figures come from result files built with the benchmark's own writer
(bench/output.py), so the targets are judged from the real schema. The one real run is the
no-GPU exit, timed.
"""

from __future__ import annotations

import gzip
import json
import re
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import cli as bench_cli, fault_bench, output  # noqa: E402
from tools import bench_merge, verify_figures, verify_gpu, verify_runner, verify_summary  # noqa: E402
from tools.verify_runner import Step, StepResult, run_plan, run_step  # noqa: E402
from mp import process_alive  # noqa: E402

pytestmark = pytest.mark.any_stack  # its subject is the same on every stack: one CI leg runs it

PY = sys.executable
MIB = 1 << 20


def py(code: str):
    return [PY, "-c", code]


def spawner(pid_file, ignore_term=False, then="time.sleep(60)"):
    """A command that starts a child sleeping 60 s (its pid in pid_file), then runs ``then``."""
    child = "import signal, time; " + ("signal.signal(signal.SIGTERM, signal.SIG_IGN); " if ignore_term else "") \
            + "time.sleep(60)"
    return py("import subprocess, sys, time; "
              f"p = subprocess.Popen([sys.executable, '-c', {child!r}]); "
              f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(0.3); {then}")


def wait_dead(pid, seconds=3.0) -> bool:
    deadline = time.monotonic() + seconds
    while process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not process_alive(pid)


# -- the stage runner -------------------------------------------------------------------
def test_a_passing_step_logs_its_output(tmp_path):
    log = tmp_path / "log"
    result = run_step(Step("s", "ok", py("print('hello from the step')"), 20, 1), str(log), 20, str(tmp_path),
                      dict(os.environ))
    assert (result.status, result.returncode, result.reason) == ("passed", 0, "")
    assert "hello from the step" in result.tail
    text = log.read_text(encoding="utf-8")
    assert "===== s.ok: limit 20 s" in text and "hello from the step" in text and "exit status 0" in text


def test_a_step_stops_itself_before_the_limit_it_really_gets(tmp_path):
    # a bench step cut short by the budget must still stop itself (and write its JSON) before
    # the runner kills it: its own --timeout follows the limit it runs under, not its nominal one
    step = Step("s", "own", py("import sys; print('argv', sys.argv[1:])"), 150, 1, own_timeout_flag="--timeout")
    result = run_step(step, str(tmp_path / "log"), 40, str(tmp_path), dict(os.environ))
    assert "argv ['--timeout', '30']" in result.tail
    bench_steps = [s for s in verify_gpu.plan("full", sys.executable, str(tmp_path), str(tmp_path))
                   if s.stage == "bench"]
    # the bench's wall-clock flag (its --timeout is nccl-tests' per-collective -T)
    assert bench_steps and all(s.own_timeout_flag == "--run_timeout" and "--run_timeout" not in s.argv
                               for s in bench_steps)


def test_a_failing_step_says_why_in_one_line(tmp_path):
    step = Step("s", "bad", py("import sys; print('noise'); print('ValueError: the real cause'); "
                               "print('more noise'); sys.exit(4)"), 20, 1)
    result = run_step(step, str(tmp_path / "log"), 20, str(tmp_path), dict(os.environ))
    assert result.status == "failed" and result.returncode == 4
    assert result.reason == "exit status 4: ValueError: the real cause"


@pytest.mark.launches
def test_a_timeout_kills_the_whole_process_group(tmp_path, monkeypatch):
    monkeypatch.setattr(verify_runner, "KILL_GRACE_S", 0.5)
    pid_file = tmp_path / "child.pid"
    step = Step("s", "hang", spawner(pid_file, ignore_term=True), 30, 1)
    start = time.monotonic()
    result = run_step(step, str(tmp_path / "log"), 3, str(tmp_path), dict(os.environ))
    assert time.monotonic() - start < 3 + 5  # not the step's own 30 s
    assert result.status == "failed" and result.reason == "timed out after 3.0 s (cut to the time budget left)"
    child = int(pid_file.read_text(encoding="utf-8"))
    assert wait_dead(child), "the step's child (which ignores SIGTERM) survived the timeout"


def test_children_left_behind_by_a_finished_step_are_killed(tmp_path):
    pid_file = tmp_path / "child.pid"
    result = run_step(Step("s", "leaky", spawner(pid_file, then="print('done')"), 30, 1), str(tmp_path / "log"),
                      30, str(tmp_path), dict(os.environ))
    assert result.status == "passed"
    assert wait_dead(int(pid_file.read_text(encoding="utf-8"))), "a straggler outlived its step"


def test_the_budget_cuts_a_step_short_and_skips_the_rest_without_hiding_it(tmp_path):
    steps = [Step("a", "slow", py("import time; time.sleep(20)"), 10, 5, min_s=1),
             Step("b", "next", py("print('never')"), 10, 3, min_s=1)]
    start = time.monotonic()
    results = run_plan(steps, str(tmp_path / "log"), 1.5, str(tmp_path))
    assert time.monotonic() - start < 6
    assert [r.status for r in results] == ["failed", "skipped"]
    assert re.fullmatch(r"timed out after 1\.[0-5] s \(cut to the time budget left\)", results[0].reason)
    assert results[1].reason.startswith("out of time budget") and "needs ~3 s" in results[1].reason
    assert "b.next: skipped: out of time budget" in (tmp_path / "log").read_text(encoding="utf-8")


def test_the_plan_goes_on_after_a_failure_and_snapshots_around_every_step(tmp_path):
    seen = []
    steps = [Step("a", "fails", py("raise SystemExit(2)"), 20, 1), Step("b", "passes", py("pass"), 20, 1)]
    results = run_plan(steps, str(tmp_path / "log"), 60, str(tmp_path),
                       snapshot=lambda res, pending, running: seen.append(
                           ([r.status for r in res], [s.key for s in pending], running and running.key)))
    assert [r.status for r in results] == ["failed", "passed"]
    assert seen == [([], ["b.passes"], "a.fails"), (["failed"], ["b.passes"], None),
                    (["failed"], [], "b.passes"), (["failed", "passed"], [], None)]


def test_a_fatal_exit_code_skips_the_rest_with_its_reason(tmp_path):
    steps = [Step("env", "env", py("raise SystemExit(3)"), 20, 1, fatal_codes={3: "no GPU for torch"}),
             Step("b", "x", py("pass"), 20, 1), Step("c", "y", py("pass"), 20, 1)]
    results = run_plan(steps, str(tmp_path / "log"), 60, str(tmp_path))
    assert [(r.status, r.reason) for r in results[1:]] == [("skipped", "no GPU for torch")] * 2


def test_readers_add_figures_and_can_fail_a_step_that_proved_nothing(tmp_path):
    skipped = Step("tier", "all-skipped", py("print('5 skipped in 0.12s')"), 20, 1, read=verify_figures.read_pytest)
    result = run_step(skipped, str(tmp_path / "log"), 20, str(tmp_path), dict(os.environ))
    assert result.status == "failed" and "no test ran on the GPU (5 skipped)" in result.reason
    broken = Step("x", "broken-reader", py("pass"), 20, 1, read=lambda r: 1 / 0)
    result = run_step(broken, str(tmp_path / "log"), 20, str(tmp_path), dict(os.environ))
    assert result.status == "passed" and result.figures["read_error"].startswith("ZeroDivisionError")


def test_pytest_and_demo_readers():
    assert verify_figures.pytest_counts("x\n1 failed, 12 passed, 2 skipped, 1 error in 3.21s\n") == {
        "failed": 1, "passed": 12, "skipped": 2, "errors": 1}
    assert verify_figures.pytest_counts("!!! stopping after 1 failures !!!\n") == {}
    line = "max |param difference| cupycoll vs nccl: 2.384e-07 (tolerance 1e-05): OK"
    figures = verify_figures.read_demo(StepResult(Step("demo", "demo", [], 1, 1), "passed", tail=f"x\n{line}\n"))
    assert figures == {"ddp_max_param_diff": 2.384e-07, "compared": "cupycoll vs nccl"}


# -- figures and targets from files in the real schema ----------------------------------
def scenario_row(scenario, case, candidate, cpu_ratio=None, world=1, **extra):
    row = {"kind": "scenario", "scenario": scenario, "case": case, "candidate": candidate, "status": "ok",
           "gpu_us": 10.0, "cpu_us": 8.0, "world_size": world, **extra}
    if cpu_ratio is not None:
        row.update(cpu_ratio=cpu_ratio, gpu_ratio=1.0)
    return row


def sweep_row(candidate, size, time_us, collective="all_reduce", dtype="float", placement="in-place", **extra):
    return {"kind": "sweep", "collective": collective, "size": size, "count": size // 4, "type": dtype,
            "redop": "sum", "root": -1, "placement": placement, "candidate": candidate, "status": "ok",
            "time_us": time_us, "algbw_gbps": size / time_us / 1e3, "busbw_gbps": size / time_us / 1e3,
            "wrong": 0, "host_us": 9.0, **extra}


def trials(abort, hung, killed):
    """Raw per-trial figures as bench/fault_bench.py's ranks collect them."""
    return {"abort_call_s": [0.01] * len(abort), "abort_latency_s": abort, "hung_error_s": hung,
            "hung_error": ["CollectiveTimeoutError: all_reduce #2 ..."] * len(hung),
            "watchdog_release_past_timeout_s": [0.2] * len(hung), "killed_error_s": killed,
            "killed_error": ["NcclError: remote process exited"] * len(killed), "killed_runs": [1]}


def write_fixtures(work: Path, out: Path) -> None:
    meta = {"world_size": 1, "gpu": "NVIDIA H100 80GB HBM3", "git_commit": "abc"}
    scen1 = [scenario_row("overhead", "1-element sync", "cupycoll:nccl", 1.1),
             scenario_row("overhead", "1-element sync", "torch:nccl", 1.0),
             # 64 parts: cupycoll's own share 10 µs an all_reduce, torch:nccl's 1.5, the front 6
             scenario_row("coalescing", "coalesced sync", "cupycoll:nccl", 0.8, cpu_us=1024.0, own_cpu_us=640.0,
                          parts=64),
             scenario_row("coalescing", "coalesced sync", "torch:nccl", 1.0, cpu_us=480.0, own_cpu_us=96.0,
                          parts=64),
             scenario_row("coalescing", "coalesced sync", "torch front", cpu_us=384.0, gpu_us=None, parts=64),
             scenario_row("coalescing", "coalesced async", "cupycoll:nccl", 1.15),
             scenario_row("kernel", "ring_reduce float32 1 GiB", "cupycoll:ring", kernel="ring_reduce",
                          dtype="float32", size_bytes=1 << 30, gbps=2900.0, copy_gbps=3000.0, ratio_to_copy=0.967),
             scenario_row("kernel", "ring_reduce_final bfloat16 1 GiB", "cupycoll:ring", kernel="ring_reduce_final",
                          dtype="bfloat16", size_bytes=1 << 30, gbps=2800.0, copy_gbps=3000.0, ratio_to_copy=0.933),
             scenario_row("kernel", "ring_reduce float32 1 MiB", "cupycoll:ring", kernel="ring_reduce",
                          dtype="float32", size_bytes=MIB, gbps=100.0, copy_gbps=900.0, ratio_to_copy=0.11)]
    output.write_json(str(work / "scenarios-1rank.json"), meta, scen1)
    large = [sweep_row("cupycoll:nccl", 64 * MIB, 1000.0), sweep_row("cupycoll:ring", 64 * MIB, 1350.0),  # 1.35x
             sweep_row("cupycoll:nccl", 256 * MIB, 4000.0, dtype="bfloat16"),
             sweep_row("cupycoll:ring", 256 * MIB, 8800.0, dtype="bfloat16"),   # 2.2x: above all_reduce's 1.7
             sweep_row("cupycoll:nccl", 64 * MIB, 500.0, dtype="bfloat16", collective="reduce_scatter"),
             sweep_row("cupycoll:ring", 64 * MIB, 1100.0, dtype="bfloat16", collective="reduce_scatter"),  # 2.2x
             sweep_row("cupycoll:ring", 256 * MIB, 3000.0),  # no NCCL row to compare with
             sweep_row("cupycoll:nccl", 16 * MIB, 100.0),
             sweep_row("cupycoll:ring", 16 * MIB, 900.0, host_us=19.8),  # < 64 MiB: host time only, 2.2x
             sweep_row("torch:nccl", 256 * MIB, 3900.0, dtype="bfloat16")]
    output.write_json(str(work / "sweep-large.json"), dict(meta, world_size=2), large)
    # fault_bench's own summarizer makes the modes from raw per-trial figures.
    rounds = {"tracked": [26.0 + d for d in (0.9, 0.7, 0.8, 0.6, 1.0)], "untracked": [26.0] * 5}
    watchdog = {"sync": fault_bench.watchdog_cost(rounds), "async": {"watchdog_us": 3.1}}
    faults = {"gpu": "NVIDIA H100", "watchdog_overhead": watchdog,
              "modes": {"blocking": fault_bench._summarize(trials([0.1, 0.14], [2.3], [1.1])),
                        "nonblocking": fault_bench._summarize(trials([2.5, 2.5], [2.4], []))}}
    (out / "faults.json").write_text(json.dumps(faults))


def test_the_summary_judges_host_time_by_the_benchmarks_own_limits():
    from bench.scenarios import FRONT, TARGETS

    limits = {case: limit for _, kind, case, limit in TARGETS if kind == "cpu"}
    assert verify_figures.HOST_RATIO_LIMIT == limits["1-element sync"] == 1.0
    assert verify_figures.COALESCED_RATIO_LIMIT == limits["coalesced sync"] == limits["coalesced async"] == 1.2
    assert verify_figures.WATCHDOG_LIMIT_US == fault_bench.WATCHDOG_TARGET_US == 1.0
    assert verify_figures.FRONT == FRONT


def test_targets_pass_miss_and_not_measured_from_real_schema_files(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    out.mkdir()
    write_fixtures(work, out)
    targets = verify_figures.evaluate_targets(str(work), str(out), 3e-6, {"scenarios-2ranks": "bench.x skipped"})
    got = {t["target"]: (t["status"], t["value"]) for t in targets}
    detail = {t["target"]: t["detail"] for t in targets}
    assert got["host µs per synchronous all_reduce, cupycoll / torch:nccl (1 rank)"] == ("MISS", 1.1)  # above 1.0
    assert got["host µs per synchronous all_reduce, cupycoll / torch:nccl (2 ranks)"] == ("not measured", None)
    coalesced = "64-op coalesced host time, cupycoll / torch:nccl (1 rank)"
    assert got[coalesced] == ("PASS", 1.15)  # the worse of two, within 1.2
    assert detail[coalesced] == ("sync 0.800, async 1.150 (worse of the two); own share per all_reduce: "
                                 "cupycoll:nccl 10.0 µs, torch:nccl 1.5 µs (torch's front 6.0 µs)")
    assert got["ring kernel bandwidth / device-to-device copy (1 GPU)"] == ("PASS", 0.933)  # largest size only
    assert got["ring / NCCL time at ≥ 64 MiB (2 ranks, fp32)"] == ("MISS", 1.35)  # above 1.15
    assert got["ring / NCCL time at ≥ 64 MiB (2 ranks, bf16 all_reduce)"] == ("MISS", 2.2)  # above 1.7
    assert got["ring / NCCL time at ≥ 64 MiB (2 ranks, bf16 reduce_scatter)"] == ("PASS", 2.2)  # within 2.3
    assert got["ring / NCCL host µs per call, every size (2 ranks)"] == ("MISS", 2.2)
    watchdog = "watchdog per synchronous call (µs, the calling thread's CPU)"
    assert got[watchdog] == ("PASS", pytest.approx(0.8))
    assert detail[watchdog] == ("median of 5 rounds' differences, interquartile +0.70 to +0.90, range +0.60 to "
                                "+1.00; async +3.10 (no target: its Work keeps its event)")
    assert got["abort latency: abort() → stuck collective released (s)"] == ("MISS", 2.5)
    hung = next(t for t in targets if t["target"].startswith("hung peer"))
    killed = next(t for t in targets if t["target"].startswith("killed peer"))
    assert (hung["status"], round(hung["value"], 6)) == ("PASS", 0.4) and "(timeout 2.0 s)" in hung["detail"]
    assert (killed["status"], round(killed["value"], 6)) == ("PASS", -3.9)  # the nonblocking run saw none
    assert "NCCL, before the timeout" in killed["detail"]
    assert fault_bench._summarize(trials([], [], []))["killed_error"].startswith("no error within")
    assert "killed_error" not in fault_bench._summarize({})  # the killed trial never ran
    assert got["DDP largest parameter difference vs torch nccl (fp32)"] == ("MISS", 3e-6)
    missing = next(t for t in targets if t["target"].endswith("(2 ranks)") and t["target"].startswith("64-op"))
    assert missing["detail"] == "bench.x skipped"
    assert len(targets) == 14
    assert not [t for t in targets if "GPU time" in t["target"] and "flat" in t["target"]]


def test_a_watchdog_figure_of_the_earlier_method_is_judged_and_said_to_have_no_spread(tmp_path):
    (tmp_path / "faults.json").write_text(json.dumps({"watchdog_overhead": {"sync": {"watchdog_us": 3.24}}}))
    targets = verify_figures.evaluate_targets(str(tmp_path), str(tmp_path), None, {})
    watchdog = next(t for t in targets if t["target"].startswith("watchdog"))
    assert (watchdog["status"], watchdog["value"]) == ("MISS", 3.24)
    assert watchdog["detail"] == "a difference of two medians of host time, no spread"


def test_bench_runs_merge_into_one_file_per_kind(tmp_path):
    write_fixtures(tmp_path, tmp_path)
    output.write_json(str(tmp_path / "sweep-small.json"), {"world_size": 2},
                      [sweep_row("torch:nccl", 1024, 10.0, collective="broadcast")])
    said = bench_merge.write_merged(str(tmp_path), str(tmp_path), plot=False)
    assert len([s for s in said if s.startswith("wrote")]) == 2
    sweep = output.read_json(str(tmp_path / "bench-sweep.json"))
    assert [r["run"] for r in sweep["meta"]["runs"]] == ["sweep-small.json", "sweep-large.json"]
    assert {r["run"] for r in sweep["rows"]} == {"sweep-small.json", "sweep-large.json"} and len(sweep["rows"]) == 11
    (tmp_path / "scenarios-2ranks.json").write_text("{broken")
    scen = bench_merge.merge([str(tmp_path / "scenarios-1rank.json"), str(tmp_path / "scenarios-2ranks.json")])
    assert len(scen["meta"]["runs"]) == 1 and "not JSON" in scen["meta"]["missing"][0]


# -- summary and results folder ----------------------------------------------------------
ENV = {"gpu": "NVIDIA H100 80GB HBM3", "gpus": 1, "driver": "580.65", "python": "3.12.3", "torch": "2.11.0+cu130",
       "torch_cuda": "13.0", "cupy": "14.2.0", "cuda_runtime": "13.0", "nccl_cupy": "2.28.3",
       "nccl_bindings": "2.28.3", "nccl_library": "/x/libnccl.so.2", "nccl_torch": "2.28.3", "problems": []}


def info_for(out, work, **extra):
    return verify_summary.RunInfo(command="make verify-gpu", mode="full", budget_s=525, started="2026-11-23T12:00:00+00:00",
                                  commit="0123456789abcdef", out_dir=str(out), work_dir=str(work), not_selected=[],
                                  env=ENV, **extra)


def test_summary_has_the_table_the_targets_the_docs_row_and_the_failures(tmp_path):
    (tmp_path / "faults.json").write_text("{}")
    api = StepResult(Step("tier", "api", [], 150, 110), "failed", "exit status 1: AssertionError: rank 1",
                     80.0, 150, 1, "line\n" * 50 + "E   AssertionError: rank 1\n", {"passed": 10, "failed": 1})
    sem = StepResult(Step("tier", "semantics", [], 60, 35), "passed", "", 30.0, 60, 0, "", {"passed": 5, "skipped": 2})
    late = StepResult(Step("faults", "fault_bench", [], 150, 70), "skipped", "out of time budget (3 s of 525 s left, needs ~70 s)")
    targets = [{"target": "watchdog overhead per collective (µs)", "limit": "≤ 2", "value": 0.5, "status": "PASS",
                "detail": "sync +0.50"}]
    verify_summary.write(info_for(tmp_path, tmp_path, finished=True), [sem, api, late], [], None, targets)
    text = (tmp_path / "summary.md").read_text(encoding="utf-8")
    assert "| tier | semantics | passed | 30 (60 / ~35) | passed 5; skipped 2 |" in text
    assert "| tier | api | failed: exit status 1: AssertionError: rank 1 | 80 (150 / ~110) |" in text
    assert "| faults | fault_bench | skipped: out of time budget (3 s of 525 s left, needs ~70 s) |" in text
    assert "| watchdog overhead per collective (µs) | ≤ 2 | 0.500 | PASS | sync +0.50 |" in text
    assert "no target reads them" in text.split("## Targets")[1].split("| target |")[0]
    assert "Stages: **tier** failed, **faults** skipped" in text
    row = next(line for line in text.splitlines() if line.startswith("| 2026-11-23 |"))
    assert ("| 0123456789ab | NVIDIA H100 80GB HBM3, driver 580.65 | 2.11.0+cu130 / 14.2.0 / 2.28.3 | "
            "`make verify-gpu` | 15 / 1 / 2 (GPU tier;") in row
    assert "`bench/results/2026-11-23-h100-faults.json`" in row and "`bench/results/2026-11-23-h100-summary.md`" in row
    assert f"RESULTS={tmp_path}\nmkdir -p bench/results\n" in text
    assert 'cp "$RESULTS/faults.json" bench/results/2026-11-23-h100-faults.json' in text
    assert "### tier.api: failed: exit status 1" in text and "E   AssertionError: rank 1" in text
    data = json.loads((tmp_path / "results.json").read_text(encoding="utf-8"))
    assert data["stages"] == {"tier": "failed", "faults": "skipped"} and data["docs_row"] == row
    assert [s["step"] for s in data["steps"]] == ["tier.semantics", "tier.api", "faults.fault_bench"]


def test_a_summary_written_mid_step_names_it_for_a_killed_run(tmp_path):
    running, pending = Step("bench", "large", [], 150, 50), [Step("faults", "fault_bench", [], 150, 70)]
    verify_summary.write(info_for(tmp_path, tmp_path), [], pending, running, [])
    text = (tmp_path / "summary.md").read_text(encoding="utf-8")
    assert "RUNNING or KILLED during bench.large" in text
    assert "| bench | large | running (if this is the last summary: killed here) |" in text
    assert "| faults | fault_bench | not run yet |" in text


def test_the_results_folder_rule(tmp_path):
    assert len(verify_summary.OUT_FILES) <= verify_summary.MAX_FILES == 8
    for name in verify_summary.OUT_FILES:
        (tmp_path / name).write_text("x")
    assert verify_summary.check_out_dir(str(tmp_path)) == []
    (tmp_path / "extra.json").write_text("x")
    (tmp_path / "sub").mkdir()
    problems = verify_summary.check_out_dir(str(tmp_path))
    assert "extra.json is not one of the results folder's files" in problems
    assert "sub/ is a folder (the results folder has none)" in problems
    assert "10 entries, more than the 8 the GPU machine brings back" in problems
    with pytest.raises(ValueError, match="not one of the results folder's files"):
        verify_summary.out_path(str(tmp_path), "notes.txt")
    with pytest.raises(ValueError, match="holds files that are not verify-gpu's"):
        verify_gpu.prepare_out(str(tmp_path))
    os.remove(tmp_path / "extra.json")
    os.rmdir(tmp_path / "sub")
    verify_gpu.prepare_out(str(tmp_path))  # a previous run's files go
    assert os.listdir(tmp_path) == []


def test_end_to_end_with_stand_in_stages(tmp_path, capsys):
    out = tmp_path / "out"
    fixtures = tmp_path / "fixtures"
    fixtures.mkdir()
    output.write_json(str(fixtures / "sweep-small.json"), {"world_size": 2, "gpu": "NVIDIA H100"},
                      [sweep_row("cupycoll:nccl", 1024, 10.0), sweep_row("torch:nccl", 1024, 11.0)])

    def steps(work, out_dir):
        env = json.dumps(ENV)
        check = (f"import gzip, sys; s = open({str(out / 'summary.md')!r}, encoding='utf-8').read(); "
                 f"g = gzip.open({str(out / 'verify.log.gz')!r}).read().decode(); "
                 "sys.exit(0 if '| env | env | passed' in s and 'ENV-OUTPUT' in g else 'no snapshot')")
        return [
            Step("env", "env", py(f"import json; json.dump({env}, open({os.path.join(work, 'env.json')!r}, 'w')); "
                                  "print('ENV-OUTPUT')"), 20, 1),
            Step("tier", "snapshot-seen", py(check), 20, 1),
            Step("bench", "small", py(f"import shutil; shutil.copy({str(fixtures / 'sweep-small.json')!r}, "
                                      f"{os.path.join(work, 'sweep-small.json')!r})"), 20, 1),
            Step("demo", "demo", py("print('max |param difference| cupycoll vs nccl: 1.000e-07 (tol): OK'); "
                                    "raise SystemExit('DemoError: stand-in failure')"), 20, 1,
                 read=verify_figures.read_demo),
        ]

    status = verify_gpu.main(["--out", str(out), "--allow-no-gpu", "--budget", "60"], steps_factory=steps)
    assert status == 1  # the demo failed
    files = sorted(os.listdir(out))
    assert len(files) <= 8 and set(files) <= set(verify_summary.OUT_FILES) and verify_summary.check_out_dir(str(out)) == []
    assert {"summary.md", "results.json", "verify.log.gz", "bench-sweep.json"} <= set(files)
    text = (out / "summary.md").read_text(encoding="utf-8")
    assert "| tier | snapshot-seen | passed |" in text  # it saw the summary and log after the env step
    assert "| demo | demo | failed: exit status 1: DemoError: stand-in failure |" in text
    assert "| DDP largest parameter difference vs torch nccl (fp32) | ≤ 1e-06 | 1e-07 | PASS |" in text
    assert "finished" in text and "NVIDIA H100 80GB HBM3 × 1" in text
    log = gzip.open(out / "verify.log.gz").read().decode()
    assert "ENV-OUTPUT" in log and "DemoError: stand-in failure" in log and "bench_merge: wrote" in log
    assert "demo failed" in capsys.readouterr().out


# -- the plans and selection -------------------------------------------------------------
def test_full_plan_takes_its_tier_parts_from_tier_py(tmp_path):
    tier = verify_gpu.gpu_tier()
    names = [name for name, _path, _budget in tier.GPU_TIER]
    assert {"semantics", "api", "ring", "faults", "bench"} <= set(names)
    steps = verify_gpu.plan("full", PY, str(tmp_path), str(tmp_path))
    parts = {s.name: s for s in steps if s.stage == "tier"}
    assert set(parts) == set(names) - {"bench"}  # stage 4 runs the real benchmarks
    for name, path, budget in tier.GPU_TIER:
        if name in parts:
            assert parts[name].limit_s == budget and path in parts[name].argv
            assert parts[name].argv[:5] == [PY, "-m", "pytest", "-m", "gpu"]
            assert ("-x" in parts[name].argv) == (path not in tier.READS_FINISHED_RUNS)
    assert "--deselect=tests/gpu/test_gpu_semantics.py::test_ddp_parity_with_torch_nccl" in parts["semantics"].argv
    assert [s.stage for s in steps][:2] == ["env", "tier"] and {s.stage for s in steps} == set(verify_gpu.STAGES)
    assert all(s.estimate_s <= s.limit_s for s in steps)
    # 9 minutes on paper for every step but the last tier part, which a short budget leaves
    # to `--stage tier.fsdp`
    assert steps[-1].key == "tier.fsdp"
    assert sum(s.estimate_s for s in steps[:-1]) <= verify_gpu.BUDGET_S["full"] <= 540


def test_a_tier_list_that_cannot_load_is_a_failing_step_not_a_crash(tmp_path):
    class Broken:
        def __getattr__(self, name):
            raise ImportError("tier.py is mid-edit")

    steps = verify_gpu.plan("full", PY, str(tmp_path), str(tmp_path), tier_module=Broken())
    tier = [s for s in steps if s.stage == "tier"]
    assert [s.key for s in tier] == ["tier.tier.py"]
    result = run_step(tier[0], str(tmp_path / "log"), 10, str(tmp_path), dict(os.environ))
    assert result.status == "failed" and "cannot load tests/gpu/tier.py: ImportError: tier.py is mid-edit" in result.reason
    assert [s.key for s in steps if s.stage != "tier"][:2] == ["env.env", "demo.demo"]


def test_quick_plan_is_the_informative_subset_within_three_minutes(tmp_path):
    steps = verify_gpu.plan("quick", PY, str(tmp_path), str(tmp_path))
    assert [s.key for s in steps] == ["env.env", "tier.probe", "tier.semantics", "demo.demo", "bench.small"]
    assert sum(s.estimate_s for s in steps) <= verify_gpu.BUDGET_S["quick"] <= 180
    small = next(s for s in steps if s.key == "bench.small")
    assert {"all_reduce", "all_gather", "broadcast", "sendrecv"} <= set(small.argv) and "2" in small.argv


# What the GPU runs still owe, first; then what earlier leases measured, as time allows.
LEASE_OWED = ["env.env", "tier.probe", "tier.api", "tier.faults", "tier.compile", "tier.fsdp", "tier.ring"]
LEASE_AS_TIME_ALLOWS = ["bench.scenarios-1rank", "faults.fault_bench", "demo.demo", "bench.row", "tier.semantics",
                        "bench.large", "bench.scenarios-2ranks", "bench.small"]


def _lease_within_budget(monkeypatch, takes):
    """The lease plan through the real runner (run_plan) on a fake clock, each step taking
    ``takes(step)`` seconds (at most the limit it is given): {key: status}."""
    now = [0.0]

    def run_step(step, log_path, limit_s, cwd, base_env):
        now[0] += min(takes(step), limit_s)
        return StepResult(step, "passed", seconds=min(takes(step), limit_s), limit_s=limit_s, returncode=0)

    monkeypatch.setattr(verify_runner, "run_step", run_step)
    steps = verify_gpu.plan("lease", PY, "WORK", "OUT")
    results = run_plan(steps, os.devnull, verify_gpu.BUDGET_S["lease"], ".", clock=lambda: now[0])
    return {r.step.key: r.status for r in results}


def test_lease_plan_runs_what_is_owed_first_then_every_other_step(tmp_path):
    steps = verify_gpu.plan("lease", PY, str(tmp_path), str(tmp_path))
    keys = [s.key for s in steps]
    assert keys == LEASE_OWED + LEASE_AS_TIME_ALLOWS
    full = {s.key for s in verify_gpu.plan("full", PY, str(tmp_path), str(tmp_path))}
    assert set(keys) == full | {"tier.probe", "bench.row"} and len(keys) == len(set(keys))
    # by the times in the table, what is owed is in within about 5.5 minutes of the command
    assert sum(s.estimate_s for s in steps[:len(LEASE_OWED)]) <= 330
    assert verify_gpu.BUDGET_S["lease"] == 570
    row = steps[keys.index("bench.row")]
    assert {"all_reduce", "1M", "64M", verify_gpu.CANDIDATES} <= set(row.argv)
    assert all(s.min_s == s.limit_s for s in steps)  # a step starts only with its whole limit left


def test_lease_runs_every_owed_part_when_steps_take_their_times(monkeypatch):
    ran = _lease_within_budget(monkeypatch, lambda step: step.estimate_s)
    assert all(ran[key] == "passed" for key in LEASE_OWED), ran
    # by the times a whole lease measured (all fifteen steps ran), every step fits
    assert [k for k in LEASE_AS_TIME_ALLOWS if ran[k] == "passed"] == LEASE_AS_TIME_ALLOWS


def test_lease_still_runs_the_fsdp_part_when_faults_and_compile_run_to_their_limits(monkeypatch):
    # a hang in each of the two parts before it: the fsdp part must still start
    whole = {"tier.faults", "tier.compile"}
    ran = _lease_within_budget(monkeypatch, lambda step: step.limit_s if step.key in whole else step.estimate_s)
    assert all(ran[key] == "passed" for key in LEASE_OWED), ran
    assert ran["bench.scenarios-1rank"] == "passed", ran  # and the hot path's host cost is still measured
    # ... even when it runs to its own limit too (the ring part then no longer fits)
    whole.add("tier.fsdp")
    ran = _lease_within_budget(monkeypatch, lambda step: step.limit_s if step.key in whole else step.estimate_s)
    assert [k for k in LEASE_OWED if ran[k] == "passed"] == LEASE_OWED[:-1], ran


def test_every_step_of_every_plan_has_its_limit_and_time_in_the_one_table(tmp_path, capsys):
    tier = verify_gpu.gpu_tier()
    for mode in ("full", "quick", "lease"):
        for step in verify_gpu.plan(mode, PY, str(tmp_path), str(tmp_path)):
            key = "bench.small-quick" if (mode, step.key) == ("quick", "bench.small") else step.key
            timing = verify_gpu.TIMINGS[key]
            assert step.estimate_s == timing.seconds <= step.limit_s, key
            limit = timing.limit_s if timing.limit_s is not None else tier.GPU_TIER_BUDGETS_S[step.name]
            assert step.limit_s == limit, key
    assert verify_gpu.main(["--lease", "--list"]) == 0
    listed = capsys.readouterr().out
    assert "tier.api                   limit  120 s  measured  32 s" in listed
    assert "tier.compile               limit  120 s  measured  57 s" in listed
    assert "tier.fsdp                  limit  110 s  measured  29 s" in listed
    assert [line.split()[0] for line in listed.splitlines()[:-1]] == LEASE_OWED + LEASE_AS_TIME_ALLOWS
    assert f"lease: 524 s of a 570 s budget by these times (measured on {verify_gpu.MEASURED_ON})" in listed


def test_a_step_that_must_have_its_whole_limit_is_skipped_and_a_shorter_one_still_runs(tmp_path):
    steps = [Step("a", "long", py("print('never')"), 5, 1, min_s=5),
             Step("b", "short", py("print('ran')"), 2, 1, min_s=2)]
    results = run_plan(steps, str(tmp_path / "log"), 3, str(tmp_path))
    assert [r.status for r in results] == ["skipped", "passed"]
    assert results[0].reason.startswith("out of time budget")


def test_a_commit_named_by_the_sender_wins_over_the_trees_git(monkeypatch):
    monkeypatch.setenv("CUPYCOLL_BENCH_GIT_COMMIT", "5f536ccde840")
    assert verify_gpu._commit() == "5f536ccde840"
    monkeypatch.delenv("CUPYCOLL_BENCH_GIT_COMMIT")
    assert verify_gpu._commit() != "5f536ccde840"


def test_every_2_rank_gpu_figure_of_every_plan_is_the_mean_of_20_iterations_or_more(tmp_path):
    # two ranks on one GPU take turns in ~2.3 ms slices: a figure of 3 calls is 3 slices more or less
    shared = 0
    for mode in ("full", "lease"):
        for step in verify_gpu.plan(mode, PY, str(tmp_path), str(tmp_path)):
            if step.stage != "bench" or "--ranks" not in step.argv:
                continue
            shared += 1
            cfg = bench_cli.parse(step.argv[3:])
            assert cfg.ranks == 2 and (cfg.iters if cfg.collectives else cfg.scenario_iters) >= 20, step.key
    assert shared == 3 + 4  # full: small, large, scenarios-2ranks; lease: and the row


def test_the_large_sweep_measures_the_sizes_whose_gpu_times_are_not_time_sliced(tmp_path):
    from bench import metrics

    large = next(s for s in verify_gpu.plan("lease", PY, str(tmp_path), str(tmp_path)) if s.key == "bench.large")
    cfg = bench_cli.parse(large.argv[3:])
    assert cfg.sizes and min(cfg.sizes) >= metrics.UNSLICED_BYTES and max(cfg.sizes) >= 64 * MIB


def test_the_fault_bench_step_measures_the_watchdog_over_15_alternated_rounds(tmp_path):
    step = next(s for s in verify_gpu.plan("lease", PY, str(tmp_path), str(tmp_path)) if s.key == "faults.fault_bench")
    argv = step.argv[3:]
    assert int(argv[argv.index("--rounds") + 1]) >= fault_bench.WATCHDOG_ROUNDS == 15
    assert int(argv[argv.index("--iterations") + 1]) // 15 >= 200  # calls per group and round


def test_bench_steps_use_long_flags_the_bench_cli_accepts(tmp_path):
    for mode in ("full", "quick", "lease"):
        for step in verify_gpu.plan(mode, PY, str(tmp_path), str(tmp_path)):
            if step.stage != "bench":
                continue
            args = step.argv[3:]
            assert not [a for a in args if len(a) == 2 and a.startswith("-")], (step.key, args)
            bench_cli.parse(args)  # raises UsageError on anything the CLI would refuse


def test_stage_selection(tmp_path, capsys):
    steps = verify_gpu.plan("full", PY, str(tmp_path), str(tmp_path))
    chosen, left_out = verify_gpu.select(steps, ["bench"])
    assert [s.key for s in chosen][0] == "env.env" and {s.stage for s in chosen} == {"env", "bench"}
    assert len(chosen) == 5 and left_out == ["tier", "demo", "faults"]
    chosen, _ = verify_gpu.select(steps, ["tier.api", "faults"])
    assert [s.key for s in chosen] == ["env.env", "faults.fault_bench", "tier.api"]
    with pytest.raises(ValueError, match="no such stage or step here"):
        verify_gpu.select(steps, ["benchmarks"])
    assert verify_gpu.main(["--stage", "nope", "--allow-no-gpu", "--out", str(tmp_path / "o")]) == 2
    assert "--stage nope: no such stage" in capsys.readouterr().err


@pytest.mark.parametrize("hidden", [True, False], ids=["CUDA_VISIBLE_DEVICES-empty", "no-nvidia-devices"])
def test_without_a_gpu_it_says_so_and_exits_1_within_5_seconds(tmp_path, hidden):
    if not hidden and verify_gpu.find_gpu() is not None:
        pytest.skip("this machine has an NVIDIA GPU")
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update({"CUDA_VISIBLE_DEVICES": ""} if hidden else {})
    start = time.monotonic()
    proc = subprocess.run([PY, "-m", "tools.verify_gpu", "--out", str(tmp_path / "never")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=30)
    assert time.monotonic() - start < 5
    assert proc.returncode == 1 and proc.stdout == "" and not (tmp_path / "never").exists()
    assert proc.stderr == ("verify-gpu: no GPU visible (CUDA_VISIBLE_DEVICES=''); it needs an NVIDIA GPU\n" if hidden
                           else "verify-gpu: no NVIDIA GPU on this machine (no /dev/nvidia*, no "
                                "/proc/driver/nvidia/gpus, nvidia-smi lists none); run it on a GPU machine\n")


@pytest.mark.launches
@pytest.mark.skipif(verify_gpu.find_gpu() is not None, reason="this machine has an NVIDIA GPU")
def test_the_real_quick_plan_where_torch_sees_no_gpu_stops_after_the_environment(tmp_path):
    status = verify_gpu.main(["--quick", "--allow-no-gpu", "--out", str(tmp_path)])
    assert status == 1
    data = json.loads((tmp_path / "results.json").read_text(encoding="utf-8"))
    steps = {s["step"]: s for s in data["steps"]}
    assert steps["env.env"]["status"] == "failed" and steps["env.env"]["returncode"] == 3
    assert "problem: no GPU for torch" in steps["env.env"]["reason"]
    assert [s["reason"] for s in data["steps"][1:]] == ["the environment stage found no GPU that torch can use"] * 4
    assert data["environment"]["torch"] and all(t["status"] == "not measured" for t in data["targets"])


@pytest.mark.launches
def test_the_probe_itself_on_cpu(tmp_path):
    # --cpu runs the same checks on CPU tensors (cupycoll's gloo route): the launcher, the
    # per-rank records and the report are what is tested here; gloo has no PREMUL_SUM.
    from tools import gpu_probe

    status = gpu_probe.launch(str(tmp_path / "probe.json"), timeout=60, on_cpu=True)
    report = json.loads((tmp_path / "probe.json").read_text(encoding="utf-8"))
    checks = {c["check"]: c for c in report["checks"]}
    assert status == 1 and report["exit_codes"] == [1, 1] and not report["timed_out"]
    for name in ("all_reduce fp32", "all_gather list", "broadcast fp16 from rank 1", "send/recv", "batch_isend_irecv"):
        assert checks[name]["ok"], checks[name]
    premul = checks["PREMUL_SUM scalar"]
    assert not premul["ok"] and [e.split(":")[0] for e in premul["errors"]] == ["rank 0", "rank 1"]
    assert report["failed"] == 2 and len(report["checks"]) == 14


def test_fault_bench_rejects_unknown_parts():
    with pytest.raises(SystemExit) as exc:
        fault_bench.main(["--parts", "hung,bogus"])
    assert exc.value.code == 2
