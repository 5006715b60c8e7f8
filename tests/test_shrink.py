"""cupycoll.shrink (recovery in place): a group shrunk to its survivors works as a group of
their size, every bad argument is refused with its typed error before anything changes, and
the CUDA half takes the survivors' communicator from the parent's (ncclCommShrink, the
parent's Works failed first) or makes it anew when a survivor's is gone.

The multi-process tests run the CPU route (3 ranks, the last one leaves); the CUDA half's
logic runs here on a scripted NCCL (tests/nccl/test_communicator.py's); the GPU tier runs it on
NCCL itself.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from cupycoll import bounds, compat, config
from cupycoll.backend import CudaBackend
from cupycoll.errors import CommunicatorAbortedError
from cupycoll.faults.lifecycle import GroupState
from mp import run_ranks
from shapes import TORCHS_GLOO, backend_shape, cupycoll_group_type

def _run(tmp_path, backend, scenario, env=None):
    out = tmp_path / scenario
    out.mkdir()
    run_ranks("shrink_worker.py", 3, args=[str(out), backend, scenario], timeout=120,
              fail_fast=False, env=env)
    return {rank: json.loads((out / f"rank{rank}.json").read_text(encoding="utf-8"))
            for rank in range(3) if (out / f"rank{rank}.json").exists()}


def _check_survivors(reports, group_type):
    for rank in (0, 1):
        report = reports[rank]
        assert report["before"] == [3.0] * 4  # the bad arguments changed nothing
        assert (report["size"], report["rank"]) == (2, rank), report
        # "new": a CPU route has no communicator to shrink
        assert report["type"] == group_type and report["shrunk_by"] == "new", report
        assert report["cuda_backend"] in ("CudaBackend", "CupycollBackend"), report  # by shape
        assert report["after"] == [3.0] * 3 and report["gathered"] == [0.0, 1.0], report
        if report["parent_error"] != TORCHS_GLOO:
            assert report["parent_error"] is not None, report  # torch knows the old group no more
        error = report["parent_call_error"]
        assert error["type"] == "CommunicatorAbortedError", error
        assert "was shrunk (ranks [2] left out); use the group shrink_group returned" in error["text"], error


@pytest.mark.launches
def test_shrinking_the_default_group_makes_the_survivors_world(tmp_path):
    reports = _run(tmp_path, "cupycoll", "default")
    assert 2 not in reports  # it left without a word
    _check_survivors(reports, cupycoll_group_type())
    for rank in (0, 1):
        report = reports[rank]
        assert report["is_default"] and report["world_size"] == 2, report
        assert not report["other_registered"], report  # torch's rule: every other group goes


@pytest.mark.launches
@pytest.mark.skipif(not compat.PY_BACKEND, reason="torch before 2.14 has the ProcessGroup shape alone, "
                                                   "which the default group's test runs")
def test_shrinking_the_default_group_in_the_shape_that_is_not_the_default(tmp_path):
    # Backend shape: cupycoll.shrink_group hands over to dist.shrink_group, which calls
    # CupycollBackend.shrink; ProcessGroup shape: cupycoll's own shrink
    shape = "process_group" if backend_shape() else "backend"
    reports = _run(tmp_path, "cupycoll", "default", env={"CUPYCOLL_SHAPE": shape})
    _check_survivors(reports, cupycoll_group_type({"CUPYCOLL_SHAPE": shape}))
    for rank in (0, 1):
        assert reports[rank]["is_default"] and reports[rank]["world_size"] == 2, reports[rank]


@pytest.mark.launches
def test_shrinking_a_subgroup_leaves_the_default_group_whole_and_bad_arguments_change_nothing(tmp_path):
    # "cpu:gloo,cuda:cupycoll": the other backend string (the default group's test has "cupycoll")
    reports = _run(tmp_path, "cpu:gloo,cuda:cupycoll", "subgroup")
    _check_survivors(reports, cupycoll_group_type())  # "before": the all_reduce of all three after the bad calls
    for rank in (0, 1):
        report = reports[rank]
        assert not report["is_default"] and report["world_size"] == 3 and report["other_registered"], report
    for rank in (0, 1, 2):
        assert reports[rank]["default_after"] == [3.0], reports[rank]
    expected = {
        "not a list": ("TypeError", "ranks_to_exclude must be a list"),
        "empty": ("ValueError", "ranks_to_exclude is empty"),
        "out of range": ("ValueError", "ranks_to_exclude[0] = 3 is not a rank"),
        "duplicate": ("ValueError", "names rank 2 twice"),
        "every rank": ("ValueError", "leaves none of the 3 ranks"),
        "bad flags": ("ValueError", "shrink_flags=5"),
        "not a rank": ("TypeError", "ranks_to_exclude[0] is str '2'"),
        "bad options": ("TypeError", "pg_options must be cupycoll.Options"),
        "gloo group": ("TypeError", "is not a cupycoll group"),
    }
    for rank in (0, 1):
        bad = reports[rank]["bad"]
        for name, (kind, words) in dict(expected, **{
                "excluded caller": ("RuntimeError", f"rank {rank} is in ranks_to_exclude")}).items():
            error = bad[name]
            assert error is not None and kind in error["mro"] and words in error["text"], (name, error)


SHAPES = ["process_group"] + (["backend"] if compat.PY_BACKEND else [])


@pytest.mark.launches
@pytest.mark.parametrize("shape", SHAPES)
def test_a_second_fault_during_a_shrink_is_named_ends_on_abort_and_leaves_the_group_to_shrink_again(
        tmp_path, shape):
    report = _run(tmp_path, "cupycoll", "second_fault", env={"CUPYCOLL_SHAPE": shape})[0]
    # abort_all() ends a shrink whose survivors are not all there, at once (timeout 20 s)
    aborted = report["aborted"]
    assert aborted is not None and aborted["type"] == "CommunicatorAbortedError", report
    assert "ended: the group was aborted while its survivors gathered" in aborted["text"], report
    assert report["aborted_s"] < 10, report
    # a survivor that is gone: the typed error names it, after the group's timeout (3 s) ...
    missing = report["missing"]
    assert missing is not None and missing["type"] == "CollectiveTimeoutError", report
    assert "DistBackendError" in missing["mro"] and "TimeoutError" in missing["mro"], report
    # (the survivors wait for each other until the last may have learnt of the fault itself)
    gathering = bounds.shrink_gathering(3, config.DEFAULT_WATCHDOG_INTERVAL)
    assert f"rank 1 of the survivors did not join it within {gathering:g} s" in missing["text"], report
    assert "shrink it again without it" in missing["text"], report
    assert report["missing_s"] < gathering + 10, report
    # ... and the world stands, with nothing of the failed shrink in the store
    assert report["world_kept"] and report["prefix_keys"] == [], report
    # so the shrink without it works
    assert (report["size"], report["world_size"], report["is_default"]) == (1, 1, True), report
    assert report["after"] == [5.0] * 3, report


# -- the CUDA half: CudaBackend.shrink_from on a scripted NCCL ---------------------------


def _backend(store, rank, size):
    settings = config.resolve(config.Options(), datetime.timedelta(seconds=5))
    return CudaBackend(store, rank, size, settings)


def _parent_with(comm):
    parent = _backend(dist.HashStore(), 0, 3)
    parent.comm = comm
    parent.device = torch.device("cuda", 0)
    return parent


@pytest.mark.parametrize("in_flight", [False, True])
def test_shrink_from_takes_the_communicator_from_a_healthy_parent(made, monkeypatch, in_flight):
    comm = made(child_size=1, child_rank=0)
    events = comm._lib.calls
    parent = _parent_with(comm)
    if in_flight:  # a Work in flight on the parent: its kernel has not finished
        from faulty import issued_work

        work, _ = issued_work(parent.watch)
        shrink_call = comm._lib.ncclCommShrink

        def shrink_seeing_the_work(*args):
            events.append(("failed", str(work.exception())))
            return shrink_call(*args)
        comm._lib.ncclCommShrink = shrink_seeing_the_work
    child = _backend(dist.HashStore(), 0, 1)
    assert child.shrink_from(parent, [1, 2], abort_first=False) == "ncclCommShrink"
    shrink = [c for c in events if c[0] == "ncclCommShrink"]
    assert shrink == [("ncclCommShrink", 0x5000, [1, 2], int(in_flight))]  # NCCL_SHRINK_ABORT if in flight
    if in_flight:  # failed, with the reason, before NCCL ended its kernel
        failed = events.index(next(e for e in events if e[0] == "failed"))
        assert failed < events.index(shrink[0]) and "was shrunk (ranks [1, 2] left out)" in events[failed][1]
    assert events.index(("ncclCommAbort", 0x5000)) > events.index(shrink[0])  # the parent, after
    assert parent.state is GroupState.ABORTED and comm.state == "aborted"
    assert child.comm.comm_ptr == 0x5001 and (child.comm.rank, child.comm.size) == (0, 1)
    assert child.device == torch.device("cuda", 0) and child.state is GroupState.OK
    with pytest.raises(CommunicatorAbortedError, match="was shrunk"):
        parent.check_usable()
    child.abort()


def test_shrink_from_a_faulted_parent_makes_the_communicator_anew(made, monkeypatch):
    comm = made()
    parent = _parent_with(comm)
    parent.abort(CommunicatorAbortedError("a peer died"))  # the watchdog's abort, say
    connected = []
    monkeypatch.setattr(CudaBackend, "comm_for", lambda self, device: connected.append(device))
    child = _backend(dist.HashStore(), 0, 1)
    assert child.shrink_from(parent, [1, 2], abort_first=True) == "new"
    assert connected == [torch.device("cuda", 0)]  # at once: the parent had a device
    assert not [c for c in comm._lib.calls if c[0] == "ncclCommShrink"]
    child.abort()


def test_a_survivor_without_ncclcommshrink_makes_every_survivor_start_anew(made, monkeypatch):
    # The route is agreed: one survivor whose NCCL lacks ncclCommShrink sends all to a new one.
    comm = made(shrink=False)
    parent = _parent_with(comm)
    monkeypatch.setattr(CudaBackend, "comm_for", lambda self, device: None)
    store = dist.HashStore()
    store.add("cupycoll/shrink/yes", 1)  # the other survivor could shrink
    store.add("cupycoll/shrink/told", 1)
    child = _backend(store, 1, 2)
    assert child.shrink_from(parent, [2], abort_first=False) == "new"
    assert parent.state is GroupState.ABORTED
    child.abort()


def test_fifty_shrinks_leave_threads_fds_and_store_keys_flat(made):
    store = dist.HashStore()  # the survivors' store, shared by every shrink

    def cycle():
        parent = _parent_with(made(child_size=1, child_rank=0))
        child = _backend(store, 0, 1)
        assert child.shrink_from(parent, [1, 2], abort_first=False) == "ncclCommShrink"
        child.abort()
        assert parent.state is GroupState.ABORTED and child.state is GroupState.ABORTED

    cycle()  # the process-wide helpers (the watchdog thread) start once
    gc.collect()
    threads, fds = threading.active_count(), len(os.listdir("/proc/self/fd"))
    for _ in range(50):
        cycle()
    gc.collect()
    # the watchdog's threads end on their own once nothing is watched: give them a moment
    deadline = time.monotonic() + 5
    while threading.active_count() > threads and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() <= threads
    assert len(os.listdir("/proc/self/fd")) <= fds
    assert store.num_keys() == 0  # each agreement's keys were deleted by its last reader


def test_survivors_agree_on_one_fresh_prefix_whatever_each_shrank_before():
    # Each survivor may have shrunk other groups before (a process-wide count would differ);
    # the prefix is drawn once per shrink and is the same on every survivor.
    from cupycoll.shrink import survivors_prefix
    store = dist.HashStore()
    first = [survivors_prefix(store, 2) for _survivor in range(2)]
    assert first[0] == first[1] and first[0].startswith("cupycoll-shrink/")
    assert store.num_keys() == 0  # the last survivor to read it deleted it
    again = [survivors_prefix(store, 3) for _survivor in range(3)]
    assert again[0] == again[1] == again[2] != first[0]  # a later shrink on the same store draws anew


def _recorded_terminations(monkeypatch) -> list:
    """The process's end, recorded instead (the lifetime's terminate): [(group, error)]."""
    from cupycoll.faults import lifecycle

    ended = []
    monkeypatch.setattr(lifecycle, "terminate", lambda group, error: ended.append((group, error)))
    return ended


def _first(ended, seconds=10.0):
    """The first recorded end (a recorded terminate does not exit: it may be asked again)."""
    deadline = time.monotonic() + seconds
    while not ended and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ended, "the process was never ended"
    return ended[0]


def test_a_blocking_shrink_stuck_on_a_survivor_is_timed_out_on_the_new_groups_terms(made, monkeypatch):
    # A survivor that never makes the shrink (a second failure after the survivors agreed):
    # the call waits inside NCCL on the parent, whose group is ending. The new group's watch
    # times it out (its own timeout); no abort may run beside it, so the process ends.
    ended = _recorded_terminations(monkeypatch)
    comm = made(child_size=2, child_rank=0)
    release = threading.Event()
    shrink_call = comm._lib.ncclCommShrink

    def shrink_waiting_for_a_survivor(*args):
        release.wait(30)
        return shrink_call(*args)
    comm._lib.ncclCommShrink = shrink_waiting_for_a_survivor
    parent = _parent_with(comm)
    child = CudaBackend(dist.HashStore(), 0, 2, config.resolve(
        config.Options(watchdog_interval=0.01), datetime.timedelta(seconds=0.3)))
    child._bootstrap.all_agree = lambda key, mine, members: True  # the survivors agreed
    shrinker = threading.Thread(target=child.shrink_from, args=(parent, [2], False), daemon=True)
    shrinker.start()
    try:
        life, error = _first(ended)
        assert life is child.life and "ncclCommShrink has been inside NCCL" in str(error)
        assert parent.state is GroupState.ABORTED  # ended, its Works failed; its abort left to the call
        assert ("ncclCommAbort", 0x5000) not in comm._lib.calls  # never beside the shrink
    finally:
        release.set()
        shrinker.join(5)
    assert ("ncclCommAbort", 0x5000) in comm._lib.calls  # once the shrink came out


def test_a_split_a_peer_is_late_for_times_out_the_new_group_not_its_parent(made, monkeypatch):
    ended = _recorded_terminations(monkeypatch)
    comm = made()
    release = threading.Event()
    split_call = comm._lib.ncclCommSplit

    def split_waiting_for_a_member(*args):
        release.wait(30)
        return split_call(*args)
    comm._lib.ncclCommSplit = split_waiting_for_a_member
    parent = _parent_with(comm)
    parent.life.watching()
    child = CudaBackend(dist.HashStore(), 0, 2, config.resolve(
        config.Options(watchdog_interval=0.01), datetime.timedelta(seconds=0.3)))
    splitter = threading.Thread(target=child.split_from, args=(parent,), daemon=True)
    splitter.start()
    try:
        life, error = _first(ended)
        assert life is child.life and "ncclCommSplit has been inside NCCL" in str(error)
        assert parent.state is GroupState.OK and parent.watch.check() is None  # not the parent's fault
    finally:
        release.set()
        splitter.join(5)
    parent.abort()
