"""CPU tier: how bench/fault_bench.py measures what the watchdog costs a call.

The figure is the calling thread's CPU time per call, over alternated rounds of a watched
and an unwatched group, summed up as the median of the rounds' differences with their
spread. Its arithmetic runs here on a fake clock (exact figures), its clock on the real
one (time spent draining the queue is left out), and the whole part once on the CPU route,
where both groups run the same path.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import fault_bench  # noqa: E402
from mp import run_python  # noqa: E402

pytestmark = pytest.mark.any_stack  # its subject is the same on every stack: one CI leg runs it


class FakeClock:
    """A nanosecond clock that moves only when told to."""

    def __init__(self):
        self.now = 0

    def __call__(self):
        return self.now

    def spend(self, ns):
        self.now += ns


def test_a_calls_figure_leaves_out_the_draining_between_chunks():
    clock = FakeClock()
    drains = []

    def settle():
        drains.append(clock())
        clock.spend(10 ** 9)  # a second of synchronize: none of it may count

    per_call = fault_bench.thread_cpu_per_call(lambda: clock.spend(2500), 600, settle, chunk=256, clock=clock)
    assert per_call == pytest.approx(2.5)
    assert len(drains) == 3  # after 256, 512 and 600 calls


def test_the_real_clock_is_this_threads_cpu_time_not_the_wall():
    # a millisecond's sleep after every call costs this thread no CPU: the wall clock would
    # read over 1000 µs a call
    per_call = fault_bench.thread_cpu_per_call(lambda: None, 20, lambda: time.sleep(0.001), chunk=1)
    assert per_call < 200


def test_rounds_alternate_which_group_goes_first():
    clock, order = FakeClock(), []

    def call(name, ns):
        def run():
            order.append(name)
            clock.spend(ns)
        return run

    figures = fault_bench.alternated_rounds({"tracked": call("tracked", 3000), "untracked": call("untracked", 2000)},
                                            rounds=4, per_round=2, settle=lambda: None, clock=clock)
    assert figures == {"tracked": [3.0] * 4, "untracked": [2.0] * 4}
    firsts = [order[i] for i in range(0, len(order), 4)]  # each round: 2 calls of each group
    assert firsts == ["tracked", "untracked", "tracked", "untracked"]


def test_the_cost_is_the_median_of_paired_differences_so_drift_between_rounds_cancels():
    # the machine slows down and speeds up by up to 20 µs between rounds; within a round the
    # watched call costs 0.6 ± 0.2 µs more
    drift = [0.0, 20.0, 5.0, 18.0, 1.0, 12.0, 3.0, 19.0, 7.0, 15.0, 2.0, 11.0, 6.0, 17.0, 9.0]
    gap = [0.6, 0.4, 0.8, 0.6, 0.5, 0.7, 0.6, 0.4, 0.8, 0.6, 0.5, 0.7, 0.6, 0.6, 0.6]
    untracked = [25.0 + d for d in drift]
    tracked = [u + g for u, g in zip(untracked, gap)]
    cost = fault_bench.watchdog_cost({"tracked": tracked, "untracked": untracked})
    assert cost["watchdog_us"] == pytest.approx(0.6) and cost["rounds"] == 15
    assert cost["differences_us"] == pytest.approx(gap)
    s = cost["spread_us"]
    assert (s["min"], s["max"], s["n"]) == (pytest.approx(0.4), pytest.approx(0.8), 15)
    assert s["q1"] == pytest.approx(0.55) and s["q3"] == pytest.approx(0.65)
    assert cost["tracked_us"] == statistics.median(tracked) and cost["untracked_us"] == statistics.median(untracked)
    line = fault_bench.describe_watchdog("sync", cost)
    assert "watchdog +0.60 us (median of 15 rounds' differences; interquartile +0.55 to +0.65" in line
    assert "target <= 1 us a synchronous call" in line
    assert "no target" in fault_bench.describe_watchdog("async", cost)


@pytest.mark.parametrize("argv, fragment", [
    (["--rounds", "14"], "--rounds must be at least 15"),
    (["--iterations", "10"], "--iterations must be at least --rounds"),
    (["--device", "cpu"], "--device cpu runs the watchdog part alone"),
])
def test_fault_bench_refuses_what_cannot_give_a_figure(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exc:
        fault_bench.main(argv)
    assert exc.value.code == 2 and fragment in capsys.readouterr().err


@pytest.mark.launches
def test_the_watchdog_part_runs_on_the_cpu_route(tmp_path):
    path = tmp_path / "faults.json"
    proc = run_python("-m", "bench.fault_bench", "--device", "cpu", "--parts", "watchdog", "--iterations", "1500",
                      "--json", str(path), timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(path.read_text(encoding="utf-8"))
    assert report["gpu"] == "cpu" and not report["errors"] and report["watchdog_overhead"]["device"] == "cpu"
    for label in ("sync", "async"):
        o = report["watchdog_overhead"][label]
        s = o["spread_us"]
        assert o["rounds"] == len(o["differences_us"]) == s["n"] == 15 and o["calls_per_round"] == 100
        assert s["min"] <= s["q1"] <= o["watchdog_us"] == s["median"] <= s["q3"] <= s["max"]
        assert o["tracked_us"] > 0 and o["untracked_us"] > 0 and "thread" in o["clock"]
    assert proc.stdout.count("median of 15 rounds' differences") == 2
