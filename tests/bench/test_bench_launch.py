"""CPU tier: the benchmark's launcher (bench/launch.py) with real processes.

The ranks here are a stand-in package whose behaviour the test picks through the
environment, so that what the launcher promises is checked directly: every rank gets its
own environment (a distinct NCCL_HOSTID when GPUs are shared) and a rendezvous store, a
failing rank stops the others and its stderr is shown, --run_timeout ends a hung run, and a
killed launcher takes its ranks with it. Also the port helper of launchers whose rank 0
hosts the store (free_port).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import launch  # noqa: E402
from mp import process_alive  # noqa: E402

pytestmark = [pytest.mark.any_stack, pytest.mark.launches]  # its subject is the same on every stack: one CI leg runs it

RANK_MAIN = '''
import json, os, sys, time
from datetime import timedelta
from bench import launch
launch.bind_to_launcher()  # what bench/cli.py does in every rank it was started for
rank = int(os.environ["RANK"])
mode = os.environ["FAKE_MODE"]
with open(os.path.join(os.environ["FAKE_OUT"], f"pid{rank}"), "w") as f:
    f.write(str(os.getpid()))
if mode == "env":
    import torch.distributed as dist
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(seconds=30))
    store.set(f"rank{rank}", "here")
    store.wait([f"rank{1 - rank}"])
    keys = ("NCCL_HOSTID", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE", "LOCAL_RANK", "WORLD_SIZE",
            launch.SHARED_ENV)
    with open(os.path.join(os.environ["FAKE_OUT"], f"{rank}.json"), "w") as f:
        json.dump({k: os.environ.get(k) for k in keys} | {"argv": sys.argv[1:]}, f)
elif mode == "fail" and rank == 1:
    print("rank 1 gives up: boom", file=sys.stderr)
    sys.exit(3)
elif mode in ("fail", "hang"):
    if mode == "hang" and rank == 1:
        print("rank 1 is stuck in all_reduce", file=sys.stderr, flush=True)
    time.sleep(120)
'''


@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    package = tmp_path / "fakebench"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "__main__.py").write_text(RANK_MAIN)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("FAKE_OUT", str(tmp_path))
    return tmp_path


def test_ranks_sharing_a_gpu_get_their_own_hostid_and_a_store(fake_package, monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "env")
    plan = launch.Plan(2, [0, 0], True, "NCCL_HOSTID ranks sharing 1 GPU(s)")
    assert launch.spawn(plan, ["all_reduce", "-b", "8"], "fakebench") == 0
    seen = [json.loads((fake_package / f"{rank}.json").read_text(encoding="utf-8")) for rank in (0, 1)]
    assert [s["NCCL_HOSTID"] for s in seen] == ["cupycoll-bench-0", "cupycoll-bench-1"]
    assert all(s["NCCL_SOCKET_IFNAME"] == "lo" and s["NCCL_IB_DISABLE"] == "1" for s in seen)
    assert [s["LOCAL_RANK"] for s in seen] == ["0", "1"] and seen[0]["argv"] == ["all_reduce", "-b", "8"]
    assert [s[launch.SHARED_ENV] for s in seen] == ["1", "1"]  # their small messages' GPU times are time-sliced


def test_ranks_on_gpus_of_their_own_are_told_they_share_none():
    env = launch.rank_env(launch.Plan(2, [0, 1], False, "real GPUs"), 1, 29500, {})
    assert env[launch.SHARED_ENV] == "0" and "NCCL_HOSTID" not in env


def test_the_launcher_gives_back_the_callers_signal_handlers(fake_package, monkeypatch):
    # torch's start_processes turns these signals into its SignalException and never undoes it:
    # a later Ctrl-C, or the SIGTERM that ends a test worker, would print its traceback
    import signal

    signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    before = {sig: signal.getsignal(sig) for sig in signals}
    monkeypatch.setenv("FAKE_MODE", "env")
    assert launch.spawn(launch.Plan(2, [], False, "test"), [], "fakebench") == 0
    assert {sig: signal.getsignal(sig) for sig in signals} == before


def test_a_failing_rank_stops_the_others_and_shows_its_stderr(fake_package, monkeypatch, capfd):
    monkeypatch.setenv("FAKE_MODE", "fail")
    plan = launch.Plan(2, [], False, "test")
    start = time.monotonic()
    assert launch.spawn(plan, [], "fakebench") == 3
    assert time.monotonic() - start < 60  # rank 0 (sleeping 120 s) was stopped
    err = capfd.readouterr().err
    assert "rank 1 exited with status 3" in err and "rank 1 gives up: boom" in err
    assert "exitcode" not in err and "Traceback" not in err  # no report from the elastic machinery


def test_deadline_stops_a_hung_run(fake_package, monkeypatch, capfd):
    monkeypatch.setenv("FAKE_MODE", "hang")
    start = time.monotonic()
    assert launch.spawn(launch.Plan(2, [], False, "test"), [], "fakebench", deadline=8.0) == 124
    assert time.monotonic() - start < 60
    err = capfd.readouterr().err
    assert "--run_timeout 8 s" in err
    assert "rank 1 is stuck in all_reduce" in err  # the other ranks' logs are shown, not lost


def test_killing_the_launcher_ends_the_ranks(fake_package, monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "hang")
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from bench import launch; "
            "launch.spawn(launch.Plan(2, [], False, 'test'), [], 'fakebench')")
    launcher = subprocess.Popen([sys.executable, "-c", code, str(ROOT)])
    try:
        pids = []
        for _ in range(600):
            if all((fake_package / f"pid{r}").exists() for r in (0, 1)):
                pids = [int((fake_package / f"pid{r}").read_text(encoding="utf-8")) for r in (0, 1)]
                break
            time.sleep(0.1)
        assert len(pids) == 2, "the ranks never started"
    finally:
        launcher.kill()  # SIGKILL: no clean-up code of the launcher runs
        launcher.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(process_alive(pid) for pid in pids):
        time.sleep(0.1)
    assert not any(process_alive(pid) for pid in pids)


def test_free_ports_lie_below_the_kernels_ephemeral_range():
    # outgoing connections draw from that range: one could take the port before rank 0 binds it
    low = launch._ephemeral_low()
    if low <= 20000:
        pytest.skip(f"no usable ephemeral range here (lowest port {low})")
    ports = [launch.free_port() for _ in range(20)]
    assert all(low - 10000 <= port < low for port in ports) and len(set(ports)) > 1, ports
