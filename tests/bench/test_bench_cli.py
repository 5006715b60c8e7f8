"""CPU tier: cupycoll-bench's command line — nccl-tests flags, sizes, names, bad input, no GPU.

Bad input is checked the way a user meets it: ``python -m bench ...`` run from the
repository root must end with exit status 2 and one line on stderr, never a traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the checkout's bench/ package, also under a bare `pytest`

from bench import catalog, cli, launch, sizes  # noqa: E402

pytestmark = pytest.mark.any_stack  # its subject is the same on every stack: one CI leg runs it


def run_bench(*args: str, env=None, timeout: float = 60.0) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, **(env or {}))
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [(env or {}).get("PYTHONPATH"), str(ROOT),
                                                            os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "bench", *args], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


# -- sizes ------------------------------------------------------------------------------
@pytest.mark.parametrize("text,expected", [
    ("8", 8), ("1K", 1024), ("1k", 1024), ("64M", 64 << 20), ("1G", 1 << 30), ("1.5M", 3 << 19),
    ("128m", 128 << 20), ("64MB", 64 << 20), (" 2 K ", 2048), ("0", 0),
])
def test_parse_size_accepts_nccl_tests_suffixes(text, expected):
    assert sizes.parse_size(text) == expected


@pytest.mark.parametrize("text", ["12Q", "", "K", "-1", "1T", "1e3", "abc", "1KK"])
def test_parse_size_rejects_garbage(text):
    with pytest.raises(sizes.SizeError):
        sizes.parse_size(text)


def test_sweep_with_a_factor_doubles_up_to_max_inclusive():
    assert sizes.sweep(8, 128, 2) == [8, 16, 32, 64, 128]
    assert sizes.sweep(8, 100, 2) == [8, 16, 32, 64]
    assert len(sizes.sweep(8, 128 << 20, 2)) == 25  # 2^3 .. 2^27


def test_sweep_with_step_bytes_adds():
    assert sizes.sweep(1 << 20, 4 << 20, 1, 1 << 20) == [1 << 20, 2 << 20, 3 << 20, 4 << 20]
    assert sizes.sweep(100, 350, 1, 100) == [100, 200, 300]


def test_sweep_factor_wins_over_step_like_nccl_tests():
    assert sizes.sweep(8, 64, 4, 1) == [8, 32]


def test_sweep_defaults_are_one_size():
    assert sizes.sweep(32 << 20, 32 << 20, 1, 1 << 20) == [32 << 20]


@pytest.mark.parametrize("args", [(64, 8, 2, None), (0, 8, 2, None), (8, 64, 1, 0), (1, 1 << 30, 1, 1)])
def test_sweep_rejects_impossible_ranges(args):
    with pytest.raises(sizes.SizeError):
        sizes.sweep(*args)


# -- names ------------------------------------------------------------------------------
def test_datatype_names_nccl_tests_and_torch():
    assert catalog.resolve_dtypes("float") == ["float"]
    assert catalog.resolve_dtypes("float16,bf16,fp32,float64") == ["half", "bfloat16", "float", "double"]
    assert catalog.resolve_dtypes("all") == list(catalog.ALL_DTYPES) and len(catalog.ALL_DTYPES) == 10
    assert catalog.resolve_dtypes("f8e4m3,float8_e5m2") == ["f8e4m3", "f8e5m2"]  # nccl-tests' fp8 names


def test_op_all_is_nccl_tests_list_and_bitwise_is_extra():
    assert catalog.resolve_ops("all") == ["sum", "prod", "max", "min", "avg", "mulsum"]
    assert catalog.resolve_ops("band,bor,bxor") == ["band", "bor", "bxor"]


def test_collectives_accept_nccl_tests_spellings():
    assert catalog.resolve_collectives("allreduce,alltoall,reducescatter") == [
        "all_reduce", "all_to_all", "reduce_scatter"]
    assert catalog.resolve_collectives("all") == list(catalog.COLLECTIVES)


def test_candidates_and_aliases():
    assert catalog.resolve_candidates("cupycoll:nccl,torch:nccl") == ["cupycoll:nccl", "torch:nccl"]
    assert catalog.resolve_candidates("ring,nccl") == ["cupycoll:ring", "torch:nccl"]
    assert catalog.resolve_candidates("cupycoll") == ["cupycoll:nccl"]


def test_cupycolls_nccl_candidate_runs_with_no_override_as_a_users_group_does():
    # an algorithm override in force sends every call the queue's way (Issuer._later): under one the
    # candidate would measure the general path, not what a user's calls take
    from bench import calls
    from cupycoll import algorithms

    picked = {c.name: c for c in calls.build_candidates(["cupycoll:nccl", "cupycoll:ring"])}
    assert catalog.CANDIDATES["cupycoll:nccl"].algorithm == calls.GROUP_ALGORITHM
    with picked["cupycoll:nccl"].scope():
        assert algorithms.override() is None
    with picked["cupycoll:ring"].scope():
        assert algorithms.override() == "ring"


def test_cpu_mode_names_cupycolls_path_gloo_not_nccl():
    cfg = cli.parse(["--device", "cpu"])
    assert cfg.candidates == ["cupycoll:gloo", "torch:gloo"] and cfg.baseline == "torch:gloo"
    assert cli.parse(["--device", "cpu", "--backends", "cupycoll,gloo"]).candidates == ["cupycoll:gloo", "torch:gloo"]
    with pytest.raises(cli.UsageError, match="cupycoll:nccl does not run with --device cpu"):
        cli.parse(["--device", "cpu", "--backends", "cupycoll:nccl"])
    # the GPU labels stay as they were
    assert cli.parse(["--backends", "cupycoll"]).candidates == ["cupycoll:nccl"]
    assert cli.parse([]).candidates == ["cupycoll:nccl", "cupycoll:ring", "torch:nccl"]


def test_static_na_rules():
    assert catalog.static_unsupported("cupycoll:ring", "all_gather", "float", "none", 2)
    assert not catalog.static_unsupported("cupycoll:ring", "all_reduce", "int32", "band", 2)
    assert catalog.static_unsupported("torch:nccl", "all_reduce", "int32", "band", 2)
    assert catalog.static_unsupported("cupycoll:nccl", "all_reduce", "float", "bxor", 2)
    assert catalog.static_unsupported("cupycoll:ring", "all_reduce", "float", "band", 2)
    assert catalog.static_unsupported("torch:nccl", "sendrecv", "float", "none", 1)
    assert not catalog.static_unsupported("torch:nccl", "sendrecv", "float", "none", 2)


# -- the parser ----------------------------------------------------------------------------
def test_parse_nccl_tests_flags():
    cfg = cli.parse(["all_reduce", "-b", "8", "-e", "128M", "-f", "2", "-d", "half", "-o", "max",
                     "-n", "7", "-w", "3", "-c", "0", "-r", "1"])
    assert cfg.collectives == ["all_reduce"]
    assert cfg.sizes[0] == 8 and cfg.sizes[-1] == 128 << 20 and len(cfg.sizes) == 25
    assert cfg.dtypes == ["half"] and cfg.ops == ["max"]
    assert (cfg.iters, cfg.warmup, cfg.check, cfg.root) == (7, 3, False, 1)
    assert cfg.candidates == ["cupycoll:nccl", "cupycoll:ring", "torch:nccl"]
    assert cfg.baseline == "torch:nccl"
    assert cfg.placements == ["out-of-place", "in-place"]


def test_parse_long_flags_and_stepbytes():
    cfg = cli.parse(["--collective", "all_gather", "--collective", "broadcast", "--minbytes", "1M", "--maxbytes", "3M",
                     "--stepbytes", "1M", "--datatype", "bf16", "--op", "all", "--iters", "2",
                     "--warmup_iters", "0", "--check", "1", "--root", "0", "--inplace"])
    assert cfg.collectives == ["all_gather", "broadcast"]
    assert cfg.sizes == [1 << 20, 2 << 20, 3 << 20]
    assert cfg.dtypes == ["bfloat16"] and cfg.ops == list(catalog.OPS)
    assert cfg.placements == ["in-place"] and cfg.check


def test_parse_defaults_follow_nccl_tests():
    cfg = cli.parse([])
    assert cfg.collectives == ["all_reduce"]
    assert cfg.sizes == [32 << 20] and cfg.dtypes == ["float"] and cfg.ops == ["sum"]
    assert cfg.iters == 20 and cfg.check


def test_parse_scenarios_only_runs_no_sweep():
    cfg = cli.parse(["--scenario", "coalescing", "--scenario", "overhead", "--coalesce-bytes", "64M"])
    assert cfg.collectives == [] and cfg.scenarios == ["coalescing", "overhead"]
    assert cfg.coalesce_bytes == 64 << 20 and cfg.coalesce_ops == 64
    assert cli.parse(["--scenario", "all"]).scenarios == list(catalog.SCENARIOS)


def test_parse_all_and_backends():
    cfg = cli.parse(["all", "--backends", "torch:nccl,cupycoll:nccl"])
    assert cfg.collectives == list(catalog.COLLECTIVES)
    assert cfg.candidates == ["torch:nccl", "cupycoll:nccl"]


@pytest.mark.parametrize("argv,fragment", [
    (["nope"], "unknown collective 'nope'"),
    (["--backends", "mpi"], "unknown backend 'mpi'"),
    (["-d", "float7"], "unknown data type 'float7'"),
    (["-o", "mulsum2"], "unknown reduction op 'mulsum2'"),
    (["-a", "4"], "-a/--average"),
    (["-z", "2"], "-z/--blocking"),
    (["-C", "all_reduce"], "-C/--report_cputime"),
    (["-m", "0"], "-m/--agg_iters"),
    (["-T", "soon"], "-T/--timeout 'soon'"),
    (["--timeout", "-1"], "-T/--timeout"),
    (["--run_timeout", "soon"], "--run_timeout 'soon'"),
    (["-r", "first"], "-r/--root"),
    (["--plot", "out.xyz"], "matplotlib cannot write .xyz"),
    (["--format", "csv"], "invalid choice"),
    (["-b", "12Q"], "'12Q' is not a size"),
    (["-b", "1M", "-e", "1K"], "larger than maxbytes"),
    (["-n", "0"], "-n/--iters"),
    (["-n", "x"], "whole number"),
    (["-f", "0.5"], "-f/--stepfactor"),
    (["--ranks", "0"], "--ranks"),
    (["--scenario", "fast"], "unknown scenario"),
    (["--backends", "torch:gloo"], "does not run with --device cuda"),
    (["--json", "/no/such/dir/out.json"], "does not exist"),
    (["--inplace", "--outofplace"], "not allowed with"),
    (["--bogus"], "unrecognized arguments"),
    (["-t", "2"], "-t/--nthreads 2: torch.distributed runs one rank per process"),
    (["-G", "1"], "-G/--cudagraph 1: CUDA graph capture is not offered"),
    (["-G", "-1"], "-G/--cudagraph"),
    (["-N", "0"], "-N/--run_cycles 0: running forever is not offered"),
    (["-N", "two"], "whole number"),
    (["--output_file", "r.txt"], "the suffix names the format: .json or .csv"),
    (["--output_file", "r.json", "-J", "s.json"], "both name the JSON file"),
    (["--output_file", "/no/such/dir/r.csv"], "--output_file /no/such/dir/r.csv: the folder"),
])
def test_parse_errors_are_one_line_usage_errors(argv, fragment):
    with pytest.raises(cli.UsageError) as info:
        cli.parse(argv)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


def test_parse_the_other_nccl_tests_flags(tmp_path):
    cfg = cli.parse(["broadcast", "-C", "1", "-a", "3", "-m", "4", "-z", "1", "-T", "60", "-r", "all",
                     "-J", str(tmp_path / "r.json"), "-F", str(tmp_path / "r.csv"), "--format", "nccl-tests",
                     "-o", "mulsum", "-d", "f8e4m3", "--run_timeout", "900"])
    assert (cfg.report_cputime, cfg.average, cfg.agg_iters, cfg.blocking) == (True, 3, 4, True)
    assert cfg.coll_timeout == 60 and cfg.run_timeout == 900 and cfg.all_roots and cfg.root == 0
    assert cfg.json.endswith("r.json") and cfg.csv.endswith("r.csv") and cfg.format == "nccl-tests"
    assert cfg.ops == ["mulsum"] and cfg.dtypes == ["f8e4m3"]
    default = cli.parse([])
    assert (default.report_cputime, default.average, default.agg_iters, default.blocking) == (False, 1, 1, False)
    assert (default.run_timeout, default.coll_timeout, default.all_roots, default.format) == (0, 0, False, "side-by-side")


def test_an_nccl_tests_command_line_parses(tmp_path):
    out = tmp_path / "x.json"
    cfg = cli.parse(["all_reduce", "-b", "8", "-e", "128M", "-f", "2", "-g", "1", "-t", "1", "-N", "1",
                     "-G", "0", "-C", "1", "--output_file", str(out)])
    assert cfg.collectives == ["all_reduce"] and len(cfg.sizes) == 25
    assert (cfg.ngpus, cfg.run_cycles, cfg.report_cputime) == (1, 1, True)
    assert cfg.json == str(out) and cfg.csv is None
    long = cli.parse(["--nthreads", "1", "--ngpus", "4", "--run_cycles", "3", "--cudagraph", "0"])
    assert (long.ngpus, long.run_cycles) == (4, 3)


def test_output_file_format_comes_from_its_suffix(tmp_path):
    cfg = cli.parse(["--output_file", str(tmp_path / "r.CSV")])
    assert cfg.csv == str(tmp_path / "r.CSV") and cfg.json is None
    both = cli.parse(["--output_file", str(tmp_path / "r.csv"), "-J", str(tmp_path / "r.json")])
    assert both.csv.endswith("r.csv") and both.json.endswith("r.json")


def test_ngpus_above_one_is_refused_under_torchrun(monkeypatch, capsys):
    # under torchrun each rank drives one GPU (nccl-tests' -g 1 under mpirun)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv(launch.WORKER_ENV, raising=False)
    assert cli.main(["--device", "cpu", "-g", "2"]) == 2
    err = capsys.readouterr().err
    assert "-g/--ngpus 2 does not apply under torchrun" in err and len(err.strip().splitlines()) == 1


def test_plot_hint_names_the_install_at_hand(tmp_path):
    assert cli.bench_extra_install(tmp_path) == "pip install 'cupycoll[bench]'"  # a wheel install
    (tmp_path / "pyproject.toml").write_text("[project]\n")
    assert cli.bench_extra_install(tmp_path) == f"pip install -e '.[bench]' in {tmp_path}"  # a checkout


@pytest.mark.parametrize("flag", ["-T", "--timeout", "--coll_timeout"])
def test_timeout_is_the_per_collective_timeout_as_in_nccl_tests(flag):
    # an nccl-tests script passing --timeout 60 means each collective's limit, not the run's
    cfg = cli.parse([flag, "60"])
    assert cfg.coll_timeout == 60 and cfg.run_timeout == 0


def test_run_timeout_is_the_wall_clock_limit(monkeypatch):
    cfg = cli.parse(["--timeout", "60", "--run_timeout", "900"])
    assert (cfg.coll_timeout, cfg.run_timeout) == (60, 900)
    deadlines = []

    def spawn(plan, argv, package, deadline):
        deadlines.append(deadline)
        return 0
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(launch, "spawn", spawn)
    assert cli.main(["--device", "cpu", "--timeout", "60", "--run_timeout", "900"]) == 0
    assert deadlines == [900]  # the launcher's deadline is --run_timeout's, never -T's


def test_long_option_names_other_tools_use(tmp_path):
    # tools/verify_gpu.py drives the command with these names: they must keep working.
    cfg = cli.parse(["all_reduce", "reduce_scatter", "--minbytes", "8", "--maxbytes", "1K", "--datatype", "float",
                     "--op", "sum", "--iters", "2", "--warmup_iters", "1", "--check", "1", "--ranks", "2",
                     "--json", str(tmp_path / "a.json"), "--plot", str(tmp_path / "a.png"),
                     "--scenario", "overhead", "--backends", "cupycoll:nccl,torch:nccl", "--run_timeout", "300",
                     "--coll_timeout", "30", "--no-progress"])
    assert cfg.collectives == ["all_reduce", "reduce_scatter"] and cfg.ranks == 2 and cfg.run_timeout == 300
    assert cfg.coll_timeout == 30
    assert cfg.plot.endswith("a.png") and cfg.progress is False


def test_mulsum_and_fp8_rules():
    assert catalog.static_unsupported("torch:nccl", "all_reduce", "int32", "mulsum", 2)
    assert not catalog.static_unsupported("torch:nccl", "all_reduce", "half", "mulsum", 2)


# -- launch planning ---------------------------------------------------------------------
def test_plan_spawn_shares_gpus_with_distinct_hostids(monkeypatch):
    monkeypatch.setattr(launch, "cuda_devices", lambda: 1)
    plan = launch.plan_spawn("cuda", 4, None)
    assert plan.world == 4 and plan.devices == [0, 0, 0, 0] and plan.shared
    assert plan.transport == "NCCL_HOSTID ranks sharing 1 GPU(s)"
    envs = [launch.rank_env(plan, r, 1234, {}) for r in range(4)]
    assert len({e["NCCL_HOSTID"] for e in envs}) == 4
    assert envs[2]["NCCL_HOSTID"] == "cupycoll-bench-2"
    assert all(e["NCCL_SOCKET_IFNAME"] == "lo" and e["MASTER_PORT"] == "1234" for e in envs)
    assert all(e["NCCL_IB_DISABLE"] == "1" for e in envs)
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert "NCCL_HOSTID" in plan.note()


def test_plan_spawn_real_gpus(monkeypatch):
    monkeypatch.setattr(launch, "cuda_devices", lambda: 4)
    plan = launch.plan_spawn("cuda", None, None)
    assert (plan.world, plan.devices, plan.shared, plan.transport) == (4, [0, 1, 2, 3], False, "real GPUs")
    assert "NCCL_HOSTID" not in launch.rank_env(plan, 1, 1, {})
    plan = launch.plan_spawn("cuda", 3, 2)  # 3 ranks on the first 2 GPUs
    assert plan.devices == [0, 1, 0] and plan.shared


def test_plan_spawn_on_cpu_starts_g_ranks_unless_ranks_says_otherwise():
    assert launch.plan_spawn("cpu", None, None).world == 2
    assert launch.plan_spawn("cpu", None, 3).world == 3  # -g 3: three ranks, as on three GPUs
    assert launch.plan_spawn("cpu", 4, 3).world == 4


def test_plan_spawn_refuses_more_gpus_than_visible(monkeypatch):
    monkeypatch.setattr(launch, "cuda_devices", lambda: 1)
    with pytest.raises(launch.LaunchError, match="pass --ranks 4"):
        launch.plan_spawn("cuda", None, 4)


def test_torchrun_detection():
    assert launch.under_torchrun({"RANK": "0", "WORLD_SIZE": "2"})
    assert not launch.under_torchrun({"RANK": "0", "WORLD_SIZE": "2", launch.WORKER_ENV: "1"})
    assert not launch.under_torchrun({})


# -- the real command, as a subprocess ----------------------------------------------------
@pytest.mark.parametrize("args,fragment", [
    (["frobnicate"], "unknown collective"),
    (["all_reduce", "--backends", "cupycoll:magic"], "unknown backend"),
    (["all_reduce", "-d", "complex64"], "unknown data type"),
    (["all_reduce", "-o", "median"], "unknown reduction op"),
    (["all_reduce", "-b", "1G", "-e", "8"], "larger than maxbytes"),
    (["all_reduce", "-b", "12Q"], "not a size"),
    (["all_reduce", "-e", "-5"], "not a size"),
    (["plot", "/no/such/results.json"], "no such file"),
    (["all_reduce", "-t", "4"], "-t/--nthreads 4"),
    (["all_reduce", "-G", "1"], "-G/--cudagraph 1"),
])
def test_bad_input_exits_2_with_one_line(args, fragment):
    proc = run_bench(*args)
    assert proc.returncode == 2, proc.stderr
    assert fragment in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("cupycoll-bench: error: ")


def test_plot_of_a_non_json_file_exits_2(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    proc = run_bench("plot", str(bad), "-o", str(tmp_path / "x.png"))
    assert proc.returncode == 2 and "not JSON" in proc.stderr and "Traceback" not in proc.stderr


def test_no_gpu_exits_2():
    # CUDA_VISIBLE_DEVICES="" hides any GPU, so this holds on GPU machines too.
    proc = run_bench("all_reduce", env={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no CUDA GPU visible" in proc.stderr
    assert "--device cpu runs the pipeline on gloo" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_help_mentions_the_nccl_tests_flags():
    proc = run_bench("--help")
    assert proc.returncode == 0
    for flag in ("--minbytes", "--maxbytes", "--stepfactor", "--stepbytes", "--datatype", "--op",
                 "--iters", "--warmup_iters", "--check", "--root", "--backends", "--scenario", "--plot"):
        assert flag in proc.stdout


def test_version_is_the_package_version():
    import cupycoll

    proc = run_bench("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"cupycoll-bench {cupycoll.__version__}"


def test_version_imports_neither_torch_nor_cupycoll():
    from cupycoll._version import __version__

    probe = ("import sys; from bench import cli; print(cli.version_text()); "
             "print(sorted({'torch', 'cupycoll'} & set(sys.modules)))")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
                              str(ROOT), os.environ.get("PYTHONPATH")]))))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [f"cupycoll-bench {__version__}", "[]"]


def test_plot_without_matplotlib_fails_before_measuring(tmp_path):
    # A stand-in matplotlib that cannot be imported, first on the path.
    fake = tmp_path / "shadow" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    pythonpath = os.pathsep.join([str(tmp_path / "shadow"), str(ROOT)])
    for args in (["--device", "cpu", "--ranks", "2", "--plot", str(tmp_path / "r.png")],
                 ["plot", str(ROOT / "pyproject.toml"), "--plot", str(tmp_path / "r.png")]):
        proc = run_bench(*args, env={"PYTHONPATH": pythonpath})
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "needs matplotlib" in proc.stderr and "Traceback" not in proc.stderr
        assert f"pip install -e '.[bench]' in {ROOT}" in proc.stderr  # run from this checkout
        assert len(proc.stderr.strip().splitlines()) == 1 and proc.stdout == ""


def test_plot_with_an_unknown_extension_fails_at_once(tmp_path):
    proc = run_bench("--device", "cpu", "--ranks", "2", "--plot", str(tmp_path / "r.bmpx"))
    assert proc.returncode == 2 and "matplotlib cannot write .bmpx" in proc.stderr
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1


def test_the_store_scenario_runs_alone_on_the_host():
    cfg = cli.parse(["--scenario", "store", "--store-ranks", "4,8", "--store-skew", "0.2"])
    assert cfg.scenarios == ["store"] and cfg.collectives == []
    assert (cfg.store_ranks, cfg.store_skew) == ([4, 8], 0.2)
    assert "store" not in cli.parse(["--scenario", "all"]).scenarios  # the GPU scenarios only
    for argv, words in ((["all_reduce", "--scenario", "store"], "runs alone"),
                        (["--scenario", "store,overhead"], "runs alone"),
                        (["--scenario", "store", "--store-ranks", "8"], "at least two world sizes")):
        with pytest.raises(cli.UsageError, match=words):
            cli.parse(argv)
