"""Which rank hangs, end to end on the CPU route: three real ranks on ``"cuda:cupycoll"``
(tests/workers/hang_worker.py; that string names no CPU backend, so its CPU calls take
cupycoll's route in both shapes) where one rank does not make a collective the others make,
or makes it with another shape."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch.distributed as dist

from cupycoll import compat, config
from cupycoll.errors import CupycollTypeError, CupycollValueError
from cupycoll.trace import analyze
from mp import run_ranks
from shapes import cupycoll_group_type, shell_of

pytestmark = pytest.mark.launches


def _run(tmp_path, scenario, env=None):
    out = tmp_path / scenario
    out.mkdir()
    env = {"CUPYCOLL_TRACE_DIR": str(out / "trace"), **(env or {})}
    results = run_ranks("hang_worker.py", 3, args=[str(out), scenario], timeout=60, env=env,
                        expect_success=scenario != "kill")
    reports = {}
    for rank in range(3):
        path = out / f"rank{rank}.json"
        if path.exists():
            reports[rank] = json.loads(path.read_text(encoding="utf-8"))
    return reports, out, results


def _analyze(trace_dir, capsys):
    """``python -m cupycoll.trace DIR``'s exit status and output, run here (its command line
    is tests/trace/test_trace.py's)."""
    capsys.readouterr()
    status = analyze.main([str(trace_dir)])
    return status, capsys.readouterr().out


def _diagnosis(report):
    return report["error"]


# The Backend shape too where torch has it: the timeout then travels through torch's own
# ProcessGroup and the group's CpuView before the diagnosis names the rank behind.
SHAPES = ["process_group"] + (["backend"] if compat.PY_BACKEND else [])


@pytest.mark.parametrize("shape", SHAPES)
def test_a_skipped_collective_names_the_rank_behind(tmp_path, capsys, shape):
    reports, out, _ = _run(tmp_path, "skip", env={"CUPYCOLL_SHAPE": shape})
    for rank in (0, 1):
        report = reports[rank]
        assert report["group"] == cupycoll_group_type({"CUPYCOLL_SHAPE": shape})
        # gloo's timeout (5 s), then at most the diagnosis' 5 s (with margin for a busy box)
        assert report["elapsed_s"] < 5 + 10, report
        assert report["timeout"], report
        error = _diagnosis(report)
        assert "all_reduce #5 (float32[1024]) timed out after 5 s on ranks 0,1" in error, error
        assert "rank 2 is behind: its last collective was #4 (broadcast)" in error, error
        assert "never reached #5" in error, error
        # what torch's own DistributedTest matches a timeout's message with
        assert re.search(r"(Timed out|closed|timeout) ", error), error
    dumps = sorted(os.listdir(out / "trace"))
    assert dumps == [f"cupycoll_trace_rank{r}.json" for r in range(3)], dumps
    status, analysis = _analyze(out / "trace", capsys)
    assert status == 1, analysis
    assert "all_reduce #5" in analysis and "rank 2 never reached it" in analysis, analysis


def test_a_killed_rank_is_named_as_not_answering(tmp_path):
    reports, _, _ = _run(tmp_path, "kill")
    assert 2 not in reports  # it died before writing
    for rank in (0, 1):
        report = reports[rank]
        assert report["elapsed_s"] < 5 + 10, report
        assert report["timeout"] or report["peer_failed"], report
        assert "all_reduce #5 (float32[1024])" in _diagnosis(report), report
        if report["peer_failed"]:
            # gloo saw the connection close at once: the report comes as soon as the other
            # live rank has answered (its responder polls each second), not after the whole wait
            assert "rank 2 did not answer and every other rank did: it is the peer whose " \
                   "connection closed" in _diagnosis(report), report
            assert report["elapsed_s"] < 3.5, report
        else:
            assert "rank 2 did not answer within 4 s" in _diagnosis(report), report


def test_the_mismatch_check_names_the_rank_and_the_shapes(tmp_path):
    reports, _, _ = _run(tmp_path, "mismatch", {"CUPYCOLL_CHECK_COLLECTIVES": "1"})
    for rank in range(3):
        report = reports[rank]
        assert report["value_error"], report
        assert "all_reduce #5: rank 1 passed shape (8,), ranks 0,2 passed (4,)" in report["error"], report
        assert report["after"] == [3.0, 3.0]  # 0 + 1 + 2: the group still works


def test_an_argument_gloo_refuses_raises_its_own_error_without_asking_the_other_ranks(tmp_path):
    reports, _, _ = _run(tmp_path, "bad_input")
    for rank in range(3):
        report = reports[rank]
        assert set(report["errors"]) == {"uint32", "band on float", "avg on bool"}, report
        for name, error in report["errors"].items():
            assert error is not None, (rank, name)  # gloo refuses each
            assert not error["cupycoll"] and "behind" not in error["text"], (rank, name, error)
        assert report["log"] == [], report  # no diagnosis, no ERROR
        assert report["after"] == [3.0, 3.0]  # 0 + 1 + 2: the group still works


def test_gloos_errors_are_told_apart_by_what_they_say():
    from cupycoll.trace import gloo_work
    between = ["[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:7057",
               "Connection reset by peer", "[enforce fail at pair.cc:446] op.preamble.length <= op.nbytes. "
               "Broken pipe"]
    own = ["Invalid scalar type", "Cannot use ReduceOp.BAND with non-integral dtype",
           "Cannot use ReduceOp.AVG with Gloo"]
    assert all(gloo_work.looks_like_peer_failure(RuntimeError(text)) for text in between)
    assert not any(gloo_work.looks_like_peer_failure(RuntimeError(text)) for text in own)
    assert not any(gloo_work.looks_like_timeout(RuntimeError(text)) for text in own)


def test_trace_settings_resolve_with_torch_fallbacks(tmp_path):
    assert config.resolve(None, None, {}).trace_buffer == config.DEFAULT_TRACE_BUFFER
    assert config.resolve(None, None, {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}).trace_buffer == 0
    env = {"CUPYCOLL_TRACE_BUFFER": "7", "TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}
    assert config.resolve(None, None, env).trace_buffer == 7
    assert config.resolve(config.Options(trace_buffer=3), None, env).trace_buffer == 3
    assert config.resolve(None, None, {}).trace_dir is None
    dump = {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(tmp_path / "fr_")}
    assert config.resolve(None, None, dump).trace_dir == str(tmp_path)
    assert config.resolve(None, None, {**dump, "CUPYCOLL_TRACE_DIR": "/x"}).trace_dir == "/x"
    assert config.resolve(None, None, {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}).check_collectives
    assert not config.resolve(None, None, {"TORCH_DISTRIBUTED_DEBUG": "INFO"}).check_collectives
    assert not config.resolve(None, None, {"TORCH_DISTRIBUTED_DEBUG": "DETAIL",
                                           "CUPYCOLL_CHECK_COLLECTIVES": "0"}).check_collectives


@pytest.mark.parametrize("value", ["-1", "1.5", "many", str(10 ** 12)])
def test_a_bad_trace_buffer_names_the_value(value):
    with pytest.raises(CupycollValueError, match=f"CUPYCOLL_TRACE_BUFFER={value!r}"):
        config.resolve(None, None, {"CUPYCOLL_TRACE_BUFFER": value})


def test_a_bad_trace_dir_is_a_typed_error():
    with pytest.raises(CupycollTypeError, match="Options.trace_dir=3"):
        config.Options(trace_dir=3)
    with pytest.raises(CupycollValueError, match="Options.trace_dir=' '"):
        config.Options(trace_dir=" ")
    with pytest.raises(CupycollValueError, match="NUL"):
        config.resolve(None, None, {"CUPYCOLL_TRACE_DIR": "/tmp/a\0b"})


def test_calls_of_a_group_are_recorded_on_both_routes(tmp_path):
    # world of one, CPU route: each call is numbered and completed in the group's recorder
    from cupycoll.trace import recorder
    import torch

    dist.init_process_group("cupycoll", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        t = torch.ones(3)
        dist.all_reduce(t)
        dist.broadcast(t, 0)
        dist.barrier()
        rec = shell_of(group)._trace.recorder
        entries = rec.snapshot()
        assert [(e["seq"], e["op"], e["state"], e["route"]) for e in entries] == [
            (1, "all_reduce", "completed", "gloo"), (2, "broadcast", "completed", "gloo"),
            (3, "barrier", "completed", "gloo")]
        assert entries[0]["shapes"] == [[3]] and entries[0]["dtypes"] == ["float32"]
        assert recorder.get_recorder(rec.group) is rec
    finally:
        dist.destroy_process_group()
    assert recorder.get_recorder(rec.group) is None  # retired, still in dumps
    assert rec in recorder.recorders()


def test_the_cuda_route_marks_and_explains_through_the_watchdog(monkeypatch, cuda_standins):
    # CPU stand-ins for CUDA tensors (tests/standins.py) and an event the GPU "finishes" when
    # the test says: the entry the group records goes down the call and into the watch
    # (issued), the real watchdog thread marks it completed, and a timeout of its batch is
    # explained with it.
    import time

    import torch
    from standins import CpuAsCudaGroup, FakeEvent
    from torch._C import _distributed_c10d as c10d

    from cupycoll.errors import CollectiveTimeoutError
    from cupycoll.faults.watchdog import Finding

    event = FakeEvent()
    cuda_standins.event_class = lambda: event
    group = CpuAsCudaGroup(None, 0, 1)
    cuda = group._cuda
    issuer = group._issuer
    monkeypatch.setattr(issuer, "_enqueue", lambda batch: issuer._track(batch, 0, 0, False))
    work = group.allreduce([torch.ones(2)], c10d.AllreduceOptions())
    rec = group._trace.recorder
    entry = work._slot.records
    assert entry is not None and entry[2] == "all_reduce" and entry[7] == "queued"  # _enqueue marks issued
    rec.mark(entry, "issued")
    assert rec.last_issued == 1 and rec.last_completed == 0
    asked = []
    cuda.life._explain = lambda e, t: asked.append((e, t)) or "why"
    slot = work._slot
    cuda.watch.seal(slot)  # a synchronous call's event, recorded
    event.fired.set()
    deadline = time.monotonic() + 10
    while entry[7] != "completed" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert entry[7] == "completed" and rec.last_completed == 1
    slot.records = entry  # as if still in flight: its batch's timeout is explained with its entry
    assert cuda.life._explained(Finding(CollectiveTimeoutError("late"), slot)).args[0] == "why"
    assert asked == [(entry, cuda.watch.timeout)]
    group.abort()

def test_a_call_that_raises_before_reaching_gloo_is_not_left_issued():
    # a bad root raises inside gloo's call (no Work): the entry must not read as "stuck"
    import torch

    dist.init_process_group("cupycoll", store=dist.HashStore(), rank=0, world_size=1)
    try:
        rec = shell_of(dist.group.WORLD)._trace.recorder
        with pytest.raises(RuntimeError):  # gloo's "invalid root rank"
            dist.group.WORLD.broadcast([torch.ones(2)], _broadcast_options(root=3))
        t = torch.ones(1)
        dist.all_reduce(t)
        states = [(e["seq"], e["op"], e["state"]) for e in rec.snapshot()]
        assert states == [(1, "broadcast", "failed"), (2, "all_reduce", "completed")], states
        assert rec.stuck() is None
    finally:
        dist.destroy_process_group()


def _broadcast_options(root):
    from torch._C import _distributed_c10d as c10d

    opts = c10d.BroadcastOptions()
    opts.rootRank = root
    return opts


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("backend", ["cupycoll", "cuda:cupycoll", "cpu:gloo,cuda:cupycoll"])
def test_which_backend_strings_give_cpu_calls_the_recorder_and_diagnosis_in_each_shape(monkeypatch, shape, backend):
    # The README's promise, string by string: CPU calls are recorded (so a hang is diagnosed)
    # in the ProcessGroup shape whatever the string, and in the Backend shape unless the
    # string names a CPU backend, which torch then builds and hands CPU tensors to itself.
    import torch

    monkeypatch.setenv("CUPYCOLL_SHAPE", shape)
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        dist.all_reduce(torch.ones(2))
        recorded = [(e["op"], e["route"]) for e in shell_of(group)._trace.recorder.snapshot()]
        torchs_gloo = shape == "backend" and backend.startswith("cpu:gloo")
        assert recorded == ([] if torchs_gloo else [("all_reduce", "gloo")]), (shape, backend, recorded)
        if shape == "backend":  # torch's own gloo, or the view of cupycoll's backend
            cpu_backend = type(group._get_backend(torch.device("cpu"))).__name__
            assert cpu_backend == ("ProcessGroupGloo" if torchs_gloo else "CpuView"), cpu_backend
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("lazy", [None, "1"])
@pytest.mark.parametrize("shape", SHAPES)
def test_a_rank_that_never_joins_a_new_group_is_named(monkeypatch, shape, lazy):
    # gloo's own error names a store key (".../cuda//cupycoll-cpu//0/1", a "cuda" key even in a
    # CPU-only job); cupycoll's names the rank, with the group and the timeout. A lazy gloo
    # (TORCH_GLOO_LAZY_INIT, torch 2.8+) waits for nobody: the shell's count of the ranks does.
    import datetime

    from cupycoll.errors import CollectiveTimeoutError

    monkeypatch.setenv("CUPYCOLL_SHAPE", shape)
    if lazy is None:
        monkeypatch.delenv("TORCH_GLOO_LAZY_INIT", raising=False)
    else:
        monkeypatch.setenv("TORCH_GLOO_LAZY_INIT", lazy)
    with pytest.raises(CollectiveTimeoutError) as raised:
        dist.init_process_group("cupycoll", store=dist.HashStore(), rank=0, world_size=3,
                                timeout=datetime.timedelta(seconds=1))
    text = str(raised.value)
    assert "creating its CPU half (gloo) timed out after 1 s on rank 0: ranks 1,2 never joined it " \
           "(dead, or not creating this group)" in text, text
    assert isinstance(raised.value.__cause__, dist.DistStoreError)
    assert not dist.is_initialized()



@pytest.mark.parametrize("lazy", [None, "1"])
def test_a_cpu_half_is_made_once_every_rank_made_it_and_leaves_no_key_of_its_own(monkeypatch, lazy):
    # A lazy gloo (TORCH_GLOO_LAZY_INIT, torch 2.8+) waits for no peer at creation: the shell
    # counts the ranks in (3 store calls each); a creation that succeeded, lazy or not, leaves
    # only gloo's own keys.
    import datetime
    import threading
    import time

    import torch

    from cupycoll import cpu_half

    if lazy is None:
        monkeypatch.delenv("TORCH_GLOO_LAZY_INIT", raising=False)
    else:
        monkeypatch.setenv("TORCH_GLOO_LAZY_INIT", lazy)
    store = dist.HashStore()
    made, started = {}, time.monotonic()

    def make(rank, delay):
        time.sleep(delay)
        made[rank] = cpu_half.build_gloo_half(store, rank, 2, datetime.timedelta(seconds=30))
    threads = [threading.Thread(target=make, args=(0, 0.0)), threading.Thread(target=make, args=(1, 0.5))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(made) == [0, 1]
    assert time.monotonic() - started >= 0.5  # rank 0 waited for rank 1, in gloo or in the count
    cpu = dist.PrefixStore(cpu_half._CPU_PREFIX, store)
    assert not any(cpu.check([key]) for key in (cpu_half._MADE, cpu_half._MADE_ALL, cpu_half._MADE_LEFT))
    tensors = {r: torch.full((2,), float(r + 1)) for r in (0, 1)}
    works = [made[r][1].allreduce([tensors[r]]) for r in (0, 1)]
    for work in works:
        work.wait()
    assert tensors[0].tolist() == tensors[1].tolist() == [3.0, 3.0]
