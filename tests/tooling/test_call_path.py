"""tools/call_path.py: the traced all_reduce runs the real path from the group down to the
communicator and the figures it prints are those of its trace; the trace, the callers and
the upward-call detector follow their rules on call lists built here."""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the checkout's tools/ and bench/, also under a bare `pytest`

from cupycoll import compat  # noqa: E402
from tools.call_path import Call, callers, cross_module, main, trace_calls, upward_calls, watch_cost  # noqa: E402


def _section(lines, header):
    """The indented lines under ``header``."""
    section = []
    for line in lines[lines.index(header) + 1:]:
        if not line.startswith("  "):
            break
        section.append(line)
    return section


# The budget of one synchronous all_reduce + wait (described, issued in one frame, waited):
# calls and modules entered on the caller's thread, upward calls. Not a time: a count the
# code sets. The module count: the group's shell, its trace and recorder, the collective that
# describes the call, the issuer, the communicator and its guard, the watch and the Work.
# Before torch 2.11 an all_reduce's options lack asyncOp, and compat reads it in a call.
ALL_REDUCE_CALLS = 15 + (not compat.EVERY_OPTIONS_HAS_ASYNC_OP)
ALL_REDUCE_MODULES = 9 + (not compat.EVERY_OPTIONS_HAS_ASYNC_OP)  # (compat, as above)
# The other hot calls (FSDP's all_gather_into_tensor and reduce_scatter_tensor, DDP's
# broadcast), and the all_reduce whose plan is made at every call (an algorithm override).
# Before torch 2.11 an options object may lack asyncOp, and compat reads it in a call.
HOT_CALLS = 16 + (not compat.EVERY_OPTIONS_HAS_ASYNC_OP)
GENERAL_CALLS = 22
# A coalescing block's calls besides two per part (start, the coalesced call, end, wait).
BLOCK_CALLS = 20


def test_the_traced_all_reduce_goes_from_the_group_through_its_issuer_to_the_communicator(tmp_path, capsys):
    assert main(["--calls", "20", "--json", str(tmp_path / "figures.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    figures = json.loads((tmp_path / "figures.json").read_text(encoding="utf-8"))
    tree = _section(lines, "call tree (module.function, indented by depth):")
    names = [line.strip() for line in tree]
    path = [(c["module"], c["function"].split(".")[-1]) for c in figures["trace"]]
    # in this order, not necessarily adjacent
    expected = iter([("shell", "allreduce"), ("collectives", "all_reduce"), ("issue", "issue"),
                     ("nccl.communicator", "launch"), ("faults.watchdog", "issued"), ("work", "wait")])
    step = next(expected)
    for entry in path:
        if entry == step:
            step = next(expected, None)
    assert step is None, f"{step} missing from {path}"
    assert path[0] == ("shell", "allreduce") and tree[0].startswith("  shell.")
    # the counts printed are those of the list printed
    assert f"calls: {len(tree)}" in lines and figures["calls"] == len(tree) == len(figures["trace"])
    assert names == [f"{c['module']}.{c['function']}" for c in figures["trace"]]
    modules = {c["module"] for c in figures["trace"]}
    assert any(line.startswith(f"modules: {len(modules)} (") for line in lines)
    crossings = _section(lines, f"cross-module calls: {figures['cross_module_calls']}")
    assert len(crossings) == len(figures["cross_module"]) and sum(int(line.rsplit(": ", 1)[1]) for line in crossings) == figures["cross_module_calls"] > 0
    upward = [line for line in lines if line.startswith("upward calls (")]
    assert upward and upward[0].endswith(f": {len(figures['upward_calls'])}")
    assert figures["timed_calls"] == 20 and figures["host_us_per_call"] > 0
    assert sum(figures["gc_collections"].values()) >= 0 and figures["gc_calls"] > 0


def test_the_synchronous_all_reduce_stays_within_its_budget(tmp_path):
    # After its first call (which makes the communicator and learns the plan), a synchronous
    # all_reduce is described and launched in one frame: a few calls in a few modules, none
    # upward; with its plan made at every call, a few more.
    assert main(["--calls", "20", "--json", str(tmp_path / "figures.json")]) == 0
    figures = json.loads((tmp_path / "figures.json").read_text(encoding="utf-8"))
    assert figures["calls"] <= ALL_REDUCE_CALLS, figures["trace"]
    assert figures["modules"] <= ALL_REDUCE_MODULES, figures["module_names"]
    assert figures["upward_calls"] == []
    assert figures["general_calls"] <= GENERAL_CALLS and figures["general_upward_calls"] == []


def test_the_other_hot_calls_stay_within_their_budget(tmp_path):
    # FSDP's all_gather_into_tensor and reduce_scatter_tensor, and DDP's broadcast, take the
    # one-frame launch as the all_reduce does.
    assert main(["--calls", "20", "--json", str(tmp_path / "figures.json")]) == 0
    figures = json.loads((tmp_path / "figures.json").read_text(encoding="utf-8"))
    assert set(figures["other_hot_calls"]) == {"all_gather_into_tensor", "reduce_scatter_tensor", "broadcast"}
    for name, measured in figures["other_hot_calls"].items():
        assert measured["calls"] <= HOT_CALLS and measured["thread_cpu_us"] > 0, (name, measured)


def test_the_cpu_route_and_torchs_dispatch_are_timed_and_the_process_runs_where_it_did(tmp_path):
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    assert main(["--calls", "20", "--cpu-route", "--through-dist", "--json", str(tmp_path / "figures.json")]) == 0
    figures = json.loads((tmp_path / "figures.json").read_text(encoding="utf-8"))
    route = figures["cpu_route"]
    assert route["gloo"] > 0 and route["recorded_floor"] > 0 and route["cupycoll"] > 0
    assert isinstance(route["cupycoll_share"], float)
    assert route["one_cpu"] == (allowed is not None)
    assert figures["through_dist"]["process_group"] > 0
    if allowed is not None:  # pinned to one CPU for the measurement only
        assert os.sched_getaffinity(0) == allowed


def test_a_coalescing_blocks_calls_grow_by_at_most_two_a_part_and_none_goes_up(tmp_path):
    # The parts of a block are checked, recorded, marked and launched in loops inside one
    # frame each: a part adds no Python call of its own.
    assert main(["--calls", "64", "--json", str(tmp_path / "figures.json")]) == 0
    figures = json.loads((tmp_path / "figures.json").read_text(encoding="utf-8"))
    assert figures["block_parts"] == 64 and figures["block_thread_cpu_us_per_part"] > 0
    assert figures["block_calls"] <= 2 * figures["block_parts"] + BLOCK_CALLS, figures["block_calls"]
    assert figures["block_upward_calls"] == []


def test_an_upward_call_goes_into_a_higher_layer_and_unlisted_modules_are_not_judged():
    layers = [("top",), ("mid", "mid2"), ("low",)]
    calls = [Call(0, "top", "entry"),
             Call(1, "mid", "f"),
             Call(2, "low", "g"),
             Call(3, "mid", "callback"),   # low -> mid: upward
             Call(4, "mid2", "same"),      # one layer: not upward
             Call(3, "low", "h"),
             Call(2, "other", "x"),
             Call(3, "top", "y"),          # from a module outside the layers: not judged
             Call(1, "low", "z"),
             Call(0, "low", "outside")]    # called from outside the package: no caller
    found = upward_calls(calls, layers)
    assert [(a.function, b.function) for a, b in found] == [("g", "callback")]
    assert upward_calls(calls, [("low",), ("mid", "mid2"), ("top",)]) == [
        (calls[0], calls[1]), (calls[1], calls[2]), (calls[0], calls[8])]


def test_a_call_is_made_by_the_nearest_shallower_call_before_it():
    calls = [Call(0, "a", "f"), Call(1, "b", "g"), Call(2, "b", "h"), Call(1, "a", "i"), Call(0, "c", "j"),
             Call(1, "b", "k")]
    assert callers(calls) == [None, calls[0], calls[1], calls[0], None, calls[4]]
    assert cross_module(calls) == {("a", "b"): 1, ("c", "b"): 1}


def test_only_the_package_s_calls_are_traced_and_a_resumed_generator_is_not_a_new_call(tmp_path, monkeypatch):
    package = tmp_path / "tracedpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "inner.py").write_text("def leaf():\n    return 1\n\n\ndef numbers():\n    yield leaf()\n    yield 2\n")
    (tmp_path / "outside.py").write_text(
        "from tracedpkg import inner\n\n\ndef through():\n    return sum(inner.numbers())\n")
    (package / "outer.py").write_text("import outside\n\n\ndef entry():\n    return outside.through()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    outer = importlib.import_module("tracedpkg.outer")
    calls = trace_calls(outer.entry, package)
    # outside.through is not the package's: numbers sits one below entry, its resumptions uncounted
    assert calls == [Call(0, "outer", "entry"), Call(1, "inner", "numbers"), Call(2, "inner", "leaf")]


def test_the_timeout_walk_follows_a_stuck_call_to_the_callers_error_across_its_threads(tmp_path, capsys):
    # The caller's thread issues, the watchdog's finds (and names the batch through the
    # group's recorder, never the backend), the fault thread ends the group, and only the
    # close of the group's CPU half goes up the house.
    assert main(["--timeout", "--json", str(tmp_path / "walk.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    walk = json.loads((tmp_path / "walk.json").read_text(encoding="utf-8"))
    threads = walk["threads"]
    assert walk["raised"] == "CollectiveTimeoutError"
    assert {"MainThread", "cupycoll-watchdog", "cupycoll-fault-default"} <= set(threads)
    assert threads["MainThread"]["callbacks"] == []
    assert "backend" not in threads["cupycoll-watchdog"]["modules"]
    assert "faults.lifecycle" in threads["cupycoll-fault-default"]["modules"]
    # (Python before 3.11 names a function without its class: shell._cpu_shutdown)
    last = [c["to"] for c in threads["cupycoll-fault-default"]["callbacks"]][-1]
    assert last.startswith("shell.") and last.endswith("._cpu_shutdown"), last
    assert any(line.startswith("one CUDA timeout, walked") and f"{len(threads)} threads" in line for line in lines)


def test_the_watchs_cost_is_a_watched_group_less_an_unwatched_one_with_its_spread():
    cost = watch_cost(timed_calls=50, rounds=3)
    assert cost["rounds"] == 3 and cost["timed_calls"] == 50
    low, high = cost["range_us"]
    assert low <= cost["iqr_us"][0] <= cost["median_us"] <= cost["iqr_us"][1] <= high
