"""CPU tier: the examples run end to end under torchrun, with no GPU.

On CPU the cupycoll group routes every collective to its inner gloo group, so
``train_ddp.py --device cpu --compare gloo`` checks that DDP driving the Python group (through
torch's C++ reducer) trains exactly as DDP on plain gloo. The GPU runs are in the GPU tier.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from mp import largest_difference, train_ddp_side_by_side
from mp import run_python as _run_python

pytestmark = pytest.mark.launches

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "train_ddp.py"
DEMO = ROOT / "examples" / "demo.py"
SHRINK = ROOT / "examples" / "shrink_ddp.py"
TORCHFT_DDP = ROOT / "examples" / "torchft_ddp.py"
TIMEOUT = 180.0


def run_python(*args: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    return _run_python(*args, timeout=timeout)

HAS_CUDA = torch.cuda.is_available()
DIFF = re.compile(r"max \|param difference\| (\S+) vs (\S+): (\S+) \(tolerance (\S+)\): (OK|FAILED)")
LOSS = re.compile(r"^\[(\S+)\] step +(\d+) +loss (\d+\.\d+)$", re.MULTILINE)


def torchrun(*args: str, ranks: int = 2) -> subprocess.CompletedProcess:
    # --standalone rendezvous on port 0: torchrun picks a free port itself.
    return run_python("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                      str(TRAIN), *args)


def explain(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-8000:]}"


# Every leg trains on "cupycoll"; the other string's routing is every leg's registration-forms
# test, so its training runs on one leg.
@pytest.mark.parametrize("backend", ["cupycoll", pytest.param("cpu:gloo,cuda:cupycoll", marks=pytest.mark.any_stack)])
def test_train_ddp_on_cpu_matches_gloo(backend):
    proc = torchrun("--device", "cpu", "--backend", backend, "--compare", "gloo", "--steps", "20")
    assert proc.returncode == 0, explain(proc)

    losses = {}
    for run, step, loss in LOSS.findall(proc.stdout):
        losses.setdefault(run, []).append((int(step), float(loss)))
    assert set(losses) == {backend, "gloo"}, explain(proc)
    assert [s for s, _ in losses[backend]] == [10, 20], explain(proc)
    assert losses[backend] == losses["gloo"], explain(proc)

    match = DIFF.search(proc.stdout)
    assert match, f"no parameter difference printed\n{explain(proc)}"
    first, second, diff, tolerance, verdict = match.groups()
    assert (first, second, verdict) == (backend, "gloo", "OK"), explain(proc)
    assert float(tolerance) == 1e-5
    assert float(diff) <= float(tolerance), explain(proc)


# The example's flow (DDP, checkpoint, a killed rank, shrink, restore) is the same on every
# stack; what differs between torch releases around a shrink (torch's destroy and init of
# the default group) tests/test_shrink.py runs on every leg.
@pytest.mark.any_stack
def test_shrink_ddp_survivors_of_a_killed_rank_end_as_a_job_of_two_from_the_checkpoint(tmp_path):
    # Three ranks, checkpoint every 5 steps, the last rank SIGKILLed in step 12: the two others
    # learn which rank died, shrink the default group, restore step 10 and train on. Their
    # final parameters are those of a plain job of two started from that checkpoint.
    shrunk, reference = tmp_path / "shrunk", tmp_path / "reference"
    proc = run_python(str(SHRINK), "--out", str(shrunk))
    assert proc.returncode == 0, explain(proc)  # the launcher checks: 0, 0 and SIGKILL
    assert proc.stdout.splitlines()[-2] == "shrink_ddp: OK", explain(proc)  # its verdict, then the folder
    plain = run_python(str(SHRINK), "--nproc", "2", "--from-checkpoint", str(shrunk / "checkpoint.pt"),
                       "--out", str(reference))
    assert plain.returncode == 0, explain(plain)
    for rank in (0, 1):
        got = json.loads((shrunk / f"rank{rank}.json").read_text())
        recovered = got["recovered"]
        assert recovered is not None, explain(proc)
        assert "PeerFailedError" in recovered["error"] and "rank 2 did not answer" in recovered["error"], recovered
        assert (recovered["failed_step"], recovered["restored_step"]) == (12, 10), recovered
        assert recovered["shrunk_size"] == got["world_size"] == 2, recovered
        expected = json.loads((reference / f"rank{rank}.json").read_text())
        assert expected["recovered"] is None and expected["world_size"] == 2
        assert got["params"] == expected["params"], rank


RECOVERY = re.compile(r"^\[(\w+)\] replica 1 was killed in step (\d+) .* both committed step (\d+) together "
                      r"([\d.]+) s after the death \(recovery time\); both reached step (\d+)$", re.MULTILINE)


@pytest.mark.skipif(importlib.util.find_spec("torchft") is None,
                    reason="torchft is not installed (CI's today leg installs it: Makefile TORCHFT_SPEC)")
def test_torchft_ddp_heals_a_killed_replica_on_cupycoll(tmp_path):
    # Two replicas under torchft's Manager; replica 1 SIGKILLed before its all_reduce in step
    # 10 and started again: replica 0 trains on alone, the new replica 1 heals from it and
    # both end with the same parameters. Where replica 0 meets the death depends on timing:
    # in its all_reduce (cupycoll's error, handed to the Manager) or in the next quorum.
    proc = run_python(str(TORCHFT_DDP), "--out", str(tmp_path))
    assert proc.returncode == 0, explain(proc)
    assert proc.stdout.splitlines()[-2] == "torchft_ddp: OK", explain(proc)  # its verdict, then the folder
    match = RECOVERY.search(proc.stdout)
    assert match, explain(proc)
    backend, killed, together, seconds, steps = match.groups()
    assert (backend, killed, steps) == ("cupycoll", "10", "60") and int(together) > 10, explain(proc)
    assert 0 < float(seconds) < 60, explain(proc)
    survivor = json.loads((tmp_path / "replica0.json").read_text())
    for failure in survivor["failures"]:
        assert failure["step"] >= 10 and "process group 'torchft_quorum_" in failure["error"], failure
    back = json.loads((tmp_path / "replica1.json").read_text())
    assert back["restarted"] and back["first_step"] > 10 and back["params"] == survivor["params"]


@pytest.mark.any_stack  # the launches and the saved parameters; the training is tested above
def test_train_ddp_in_processes_of_its_own_per_backend_ends_with_gloos_parameters(tmp_path):
    # What the GPU tier's compile part runs (cupycoll against torch's nccl there): one launch
    # per backend, side by side, each saving rank 0's final parameters with --params-out.
    runs = train_ddp_side_by_side(TIMEOUT, ("cupycoll", "gloo"), tmp_path, "--device", "cpu", "--steps", "5")
    for run in runs.values():
        assert run.proc.returncode == 0 and run.params is not None, run.explain()
        assert {name for name, _step, _loss in LOSS.findall(run.proc.stdout)} == {run.backend}, run.explain()
    assert [p.shape for p in runs["cupycoll"].params] == [p.shape for p in _load(TRAIN).make_model().parameters()]
    assert largest_difference(runs["cupycoll"].params, runs["gloo"].params) == 0


@pytest.mark.any_stack  # train_ddp.py's own comparison; the training itself is tested above
def test_train_ddp_compare_fails_beyond_tolerance():
    # Identical runs differ by 0, so a negative tolerance must fail: the exit status is the check.
    # One rank: the verdict and its exit status through torchrun need no second one.
    proc = torchrun("--device", "cpu", "--compare", "gloo", "--steps", "3", "--tolerance", "-1", ranks=1)
    assert proc.returncode != 0, explain(proc)
    assert "FAILED" in proc.stdout, explain(proc)


@pytest.mark.skipif(HAS_CUDA, reason="checks the message on a machine without CUDA")
def test_train_ddp_without_cuda_exits_2_with_a_message():
    proc = run_python(str(TRAIN), "--device", "cuda", timeout=60)
    assert proc.returncode == 2, explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)
    assert "--device cuda" in proc.stderr and "CUDA" in proc.stderr, explain(proc)
    assert "--device cpu" in proc.stderr, explain(proc)


@pytest.mark.skipif(HAS_CUDA, reason="checks the message on a machine without a GPU")
def test_demo_without_gpu_says_what_it_needs():
    proc = run_python(str(DEMO), timeout=60)
    assert proc.returncode == 1, explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)
    message = proc.stdout + proc.stderr
    assert "NVIDIA GPU" in message, explain(proc)
    assert _load(DEMO).install_hint(torch.version.cuda) in message, explain(proc)
    assert "CuPy" in message and "NCCL" in message, explain(proc)


def test_demo_install_hint_names_the_extra_of_torchs_cuda_major():
    hint = _load(DEMO).install_hint
    assert "-e '.[cuda13]'" in hint("13.0") and "cuda12" not in hint("13.0")
    assert "-e '.[cuda12]'" in hint("12.6") and "cuda13" not in hint("12.6")
    # a CPU build needs a CUDA torch first; the extra then follows that torch
    assert "CUDA build of torch" in hint(None) and "'.[cuda12]'" in hint(None) and "'.[cuda13]'" in hint(None)
    assert "cuda11" not in hint("11.8")  # no such extra


def test_demo_help_prints_usage_and_starts_nothing():
    proc = run_python(str(DEMO), "--help", timeout=60)
    assert proc.returncode == 0, explain(proc)
    assert proc.stdout.startswith("usage:") and "train_ddp.py" in proc.stdout, explain(proc)
    assert "torch.distributed.run" not in proc.stdout and proc.stderr == "", explain(proc)


def test_demo_passes_its_other_arguments_to_train_ddp():
    argv = ["--steps", "200", "--optimizer", "adam", "--tolerance", "-1", "--share-gpu"]
    assert _load(DEMO).parse_args(argv) == argv


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"{path.stem}_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_train_ddp():
    return _load(TRAIN)


def _shrink_report(rank, params, recovered=True):
    report = {"rank": rank, "params": params, "recovered": None}
    if recovered:
        report["recovered"] = {"failed_step": 12, "restored_step": 10, "shrunk_size": 2,
                               "seconds_death_to_shrunk_group": 4.0}
    return report


@pytest.mark.any_stack  # the script's own bookkeeping, no training
def test_shrink_ddp_says_ok_only_when_every_survivor_recovered_with_the_same_parameters(tmp_path, capsys):
    shrink = _load(SHRINK)
    args = shrink.parse_args(["--out", str(tmp_path)])

    def write(*reports):
        for report in reports:
            (tmp_path / f"rank{report['rank']}.json").write_text(json.dumps(report))

    write(_shrink_report(0, [1.0]), _shrink_report(1, [1.0]))
    assert shrink.verdict(args, [0, 0, -9]) == []
    assert "rank 2 was killed in step 12; ranks 0, 1 shrank the group to 2, restored step 10" in capsys.readouterr().out
    assert shrink.verdict(args, [0, 0, 0]) == ["exit codes [0, 0, 0], expected [0, 0, -9]"]
    write(_shrink_report(1, [2.0]))
    assert shrink.verdict(args, [0, 0, -9]) == ["the ranks ended with different parameters"]
    write(_shrink_report(1, [1.0], recovered=False))
    assert shrink.verdict(args, [0, 0, -9]) == ["rank 1 never saw rank 2 die"]


@pytest.mark.any_stack  # the script's own bookkeeping, no training
def test_shrink_ddp_deletes_its_temporary_folder_and_keeps_one_given_with_out(tmp_path, monkeypatch):
    shrink = _load(SHRINK)
    seen = []

    def launch(args, argv):  # the ranks' part: they write their results into args.out
        (Path(args.out) / "checkpoint.pt").write_text("")
        seen.append(Path(args.out))
        return 0

    monkeypatch.setattr(shrink, "launch", launch)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(shrink.tempfile, "tempdir", str(tmp_path))
    assert shrink.main([]) == 0
    assert seen[0].parent == tmp_path and not seen[0].exists()
    kept = tmp_path / "kept"
    assert shrink.main(["--out", str(kept)]) == 0
    assert (kept / "checkpoint.pt").exists()


def test_share_gpu_env_gives_each_rank_a_host_on_loopback_without_infiniband():
    train_ddp = _load_train_ddp()
    assert train_ddp.share_gpu_env(0, environ={}, nodename="box") == {
        "NCCL_HOSTID": "box-rank0", "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1", "GLOO_SOCKET_IFNAME": "lo"}
    assert train_ddp.share_gpu_env("1", environ={}, nodename="box")["NCCL_HOSTID"] == "box-rank1"
    # the user's interfaces and IB choice win; a host id shared by every rank would not work
    user = {"NCCL_SOCKET_IFNAME": "eth0", "NCCL_IB_DISABLE": "0", "GLOO_SOCKET_IFNAME": "eth0",
            "NCCL_HOSTID": "same-on-every-rank"}
    assert train_ddp.share_gpu_env(1, environ=user, nodename="box") == dict(user, NCCL_HOSTID="box-rank1")


class _StopAfterEnv(Exception):
    pass


def test_share_gpu_flag_puts_that_environment_in_place_before_the_device_is_picked(monkeypatch):
    train_ddp = _load_train_ddp()
    environ = {"RANK": "1", "NCCL_SOCKET_IFNAME": "ib0"}
    seen = {}

    def pick_device(args):
        seen.update(environ)
        raise _StopAfterEnv

    # os.environ replaced for main() only: what it sets must not leak into this process
    monkeypatch.setattr(os, "environ", environ)
    monkeypatch.setattr(train_ddp, "pick_device", pick_device)
    monkeypatch.setattr("sys.argv", ["train_ddp.py", "--share-gpu"])
    with pytest.raises(_StopAfterEnv):
        train_ddp.main()
    assert seen["NCCL_HOSTID"] == f"{os.uname().nodename}-rank1"
    assert seen["NCCL_IB_DISABLE"] == "1" and seen["GLOO_SOCKET_IFNAME"] == "lo"
    assert seen["NCCL_SOCKET_IFNAME"] == "ib0"  # set by the user: kept

    # without the flag, nothing of it is set
    environ.clear()
    seen.clear()
    environ["RANK"] = "0"
    monkeypatch.setattr("sys.argv", ["train_ddp.py"])
    with pytest.raises(_StopAfterEnv):
        train_ddp.main()
    assert seen["RANK"] == "0"
    assert not {"NCCL_HOSTID", "NCCL_IB_DISABLE", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"} & set(seen)
