"""The flight recorder, its dumps and ``python -m cupycoll.trace`` (CPU only)."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from cupycoll import config
from cupycoll.trace import dumps, recorder as rec_mod
from cupycoll.trace import analyze as trace
from cupycoll.errors import CupycollTypeError, CupycollValueError
from cupycoll.trace.recorder import E_SEQ, E_STATE, Recorder

from mp import run_python


@pytest.fixture(autouse=True)
def fresh_registry():
    rec_mod.reset()
    yield
    rec_mod.reset()


# -- the recorder -------------------------------------------------------------------------

def test_buffer_stays_bounded_over_many_calls():
    recorder = rec_mod.new_recorder("0", [0, 1], 0)
    t = torch.empty(3, 4)
    for _ in range(10_000):
        entry = recorder.record("all_reduce", (t.shape,), (t.dtype,))
        recorder.mark(entry, "completed")
    assert len(recorder.entries) == config.DEFAULT_TRACE_BUFFER == 2000
    assert [e[E_SEQ] for e in recorder.entries] == list(range(8001, 10_001))
    assert recorder.last_issued == recorder.last_completed == 10_000
    small = Recorder("1", [0], 0, size=5)
    for _ in range(100):
        small.record("barrier")
    assert [e[E_SEQ] for e in small.entries] == [96, 97, 98, 99, 100]


def test_states_sequence_numbers_and_p2p():
    recorder = Recorder("g", [4, 5, 6], 1)
    queued = recorder.record("all_gather", ((2,),), (torch.int64,), state="queued")
    assert queued[E_STATE] == "queued" and recorder.last_issued == 0
    recorder.mark(queued, "issued")
    assert recorder.last_issued == 1 and recorder.last_issued_entry is queued
    send = recorder.record_p2p("send", ((8,),), (torch.float32,), peer=2)
    assert send[E_SEQ] == 1  # numbered apart from collectives
    recorder.mark(send, "issued")
    recorder.mark(send, "completed")
    assert recorder.last_issued == 1 and recorder.last_completed == 0  # p2p counts apart
    second = recorder.record("broadcast", ((8,),), (torch.float32,), root=0, route="gloo")
    assert second[E_SEQ] == 2 and recorder.last_issued == 2
    recorder.mark(queued, "completed")
    recorder.mark(queued, "aborted")  # a late abort does not undo a completion
    assert queued[E_STATE] == "completed" and recorder.last_completed == 1
    assert recorder.stuck() is second
    assert recorder.mark_unfinished("aborted") == 1 and second[E_STATE] == "aborted"
    recorder.mark(None, "completed")  # no entry: ignored
    with pytest.raises(CupycollValueError, match="state='done'"):
        recorder.mark(second, "done")
    with pytest.raises(CupycollValueError, match="queued or issued"):
        recorder.record("all_reduce", state="completed")
    snap = recorder.snapshot()
    assert [e["op"] for e in snap] == ["all_gather", "send", "broadcast"]
    assert snap[0]["shapes"] == [[2]] and snap[0]["dtypes"] == ["int64"]
    assert snap[1]["peer"] == 2 and snap[1]["root"] is None and snap[1]["p2p"]
    assert snap[2]["root"] == 0 and snap[2]["route"] == "gloo" and snap[2]["state"] == "aborted"
    assert abs(snap[0]["recorded_at"] - time.time()) < 60
    assert snap[0]["issued_at"] >= snap[0]["recorded_at"]
    assert recorder.find(2) is second and recorder.find(99) is None
    assert recorder.info()["global_rank"] == 5


def test_buffer_size_zero_keeps_nothing_but_counts():
    recorder = Recorder("g", [0, 1], 0, size=0)
    entry = recorder.record("all_reduce", ((4,),), (torch.float32,))
    assert not recorder.enabled and len(recorder.entries) == 0 and recorder.snapshot() == []
    assert recorder.last_issued == 1 and recorder.stuck() is entry  # what diagnosis needs
    recorder.mark(entry, "completed")
    assert recorder.last_completed == 1 and recorder.stuck() is None


@pytest.mark.parametrize("kwargs, error", [
    (dict(size=-1), CupycollValueError), (dict(size=1.5), CupycollTypeError),
    (dict(size=True), CupycollTypeError), (dict(rank=3), CupycollValueError),
])
def test_recorder_rejects_bad_arguments(kwargs, error):
    args = dict(group="g", ranks=[0, 1], rank=0)
    args.update(kwargs)
    with pytest.raises(error):
        Recorder(**args)
    with pytest.raises(CupycollTypeError):
        Recorder(7, [0], 0)


def test_registry_retires_a_recreated_group_and_stays_bounded():
    first = rec_mod.new_recorder("0", [0, 1], 0)
    second = rec_mod.new_recorder("0", [0, 1], 0)
    assert (first.incarnation, second.incarnation) == (0, 1)
    assert rec_mod.get_recorder("0") is second and rec_mod.recorders() == [first, second]
    rec_mod.retire(second)
    assert rec_mod.get_recorder("0") is None and rec_mod.recorders() == [first, second]
    for _ in range(40):
        rec_mod.new_recorder("cycle", [0], 0)
    assert len(rec_mod.recorders()) == rec_mod.RETIRED_KEPT + 1


def test_describe():
    assert rec_mod.describe("all_reduce", 42, [torch.Size([1048576])], [torch.float32]) == \
        "all_reduce #42 (float32[1048576])"
    assert rec_mod.describe("barrier", 3) == "barrier #3"
    five = rec_mod.describe("all_gather", 1, [(2, 3)] * 5, ["int8"] * 5)
    assert five.endswith("int8[2, 3], ... 5 tensors)")


# -- dumps --------------------------------------------------------------------------------

def test_dump_and_load_round_trip(tmp_path):
    recorder = rec_mod.new_recorder("0", [0, 1], 1)
    entry = recorder.record("all_reduce", (torch.Size([4, 4]),), (torch.bfloat16,))
    recorder.mark(entry, "completed")
    recorder.record("broadcast", ((4,),), (torch.float32,), root=0)
    path = dumps.dump_trace(str(tmp_path), rank=1)
    assert os.path.basename(path) == "cupycoll_trace_rank1.json"
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    payload = dumps.load_dump(path)
    assert payload["rank"] == 1 and payload["pid"] == os.getpid() and payload["torch"]
    assert payload["reason"] == "on demand" and payload["cupycoll"]
    (group,) = payload["groups"]
    assert group["group"] == "0" and group["ranks"] == [0, 1] and group["rank"] == 1
    assert (group["last_issued"], group["last_completed"]) == (2, 1)
    times = ("recorded_at", "issued_at", "finished_at")

    def timeless(entries):
        return [{k: v for k, v in e.items() if k not in times} for e in entries]

    assert timeless(group["entries"]) == timeless(json.loads(json.dumps(recorder.snapshot())))
    for ours, theirs in zip(group["entries"], recorder.snapshot()):
        for key in times:
            assert (ours[key] is None) == (theirs[key] is None)
            assert ours[key] is None or abs(ours[key] - theirs[key]) < 0.01
    assert group["entries"][0]["shapes"] == [[4, 4]] and group["entries"][0]["dtypes"] == ["bfloat16"]
    explicit = dumps.dump_trace(str(tmp_path / "mine.json"))
    assert dumps.load_dump(explicit)["groups"][0]["entries"][1]["root"] == 0


def test_load_dump_rejects_what_is_not_a_trace(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(CupycollValueError, match="cannot read"):
        dumps.load_dump(str(bad))
    bad.write_text(json.dumps({"format": "other"}))
    with pytest.raises(CupycollValueError, match="not a cupycoll trace"):
        dumps.load_dump(str(bad))
    bad.write_text(json.dumps({"format": dumps.FORMAT, "version": 99}))
    with pytest.raises(CupycollValueError, match="version 99"):
        dumps.load_dump(str(bad))
    with pytest.raises(CupycollTypeError):
        dumps.dump_trace(None)


def test_dump_on_timeout_never_raises(tmp_path):
    rec_mod.new_recorder("0", [0], 0).record("barrier")
    assert dumps.dump_on_timeout(None) is None and dumps.dump_on_timeout("") is None
    written = dumps.dump_on_timeout(str(tmp_path / "new" / "dir"), rank=0, reason="timeout: x")
    assert dumps.load_dump(written)["reason"] == "timeout: x"
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert dumps.dump_on_timeout(str(blocker / "sub"), rank=0) is None


def test_bench_figures():
    figures = trace.bench(number=2000, repeat=2)
    print("\nrecorder per-call cost (µs):", {k: round(v, 3) for k, v in figures.items()})
    assert set(figures) >= {"record_us", "record_with_tensor_meta_us", "mark_completed_us"}
    assert all(v > 0 for v in figures.values())


# -- the analyzer -------------------------------------------------------------------------

def write_rank(directory, rank, world, calls, group="0", size=config.DEFAULT_TRACE_BUFFER, done=None):
    """Dump rank ``rank``'s recorder after ``calls``: (op, shape, dtype, root) tuples; the
    first ``done`` (default: all but the last) are completed."""
    rec_mod.reset()
    recorder = rec_mod.new_recorder(group, list(range(world)), rank, size=size)
    done = len(calls) - 1 if done is None else done
    for index, (op, shape, dtype, root) in enumerate(calls):
        entry = recorder.record(op, (shape,), (dtype,), root)
        if index < done:
            recorder.mark(entry, "completed")
    recorder.record_p2p("send", ((1,),), (torch.float32,), peer=(rank + 1) % world)
    return dumps.dump_trace(str(directory), rank=rank)


CALLS = [("all_reduce", (1024,), torch.float32, None)] * 40 + \
        [("broadcast", (8,), torch.float32, 0), ("all_reduce", (1048576,), torch.float32, None)]


def analyze_dir(directory):
    found, lines = trace.analyze(trace.load_dir(str(directory)))
    return found, "\n".join(lines)


def test_analyzer_agreeing_ranks(tmp_path):
    for rank in range(4):
        write_rank(tmp_path, rank, 4, CALLS)
    found, text = analyze_dir(tmp_path)
    assert not found, text
    assert "group '0': ranks 0-3 agree on collectives #1-#42" in text
    assert "the last, all_reduce #42 (float32[1048576]), is issued on ranks 0-3" in text
    assert trace.main([str(tmp_path)]) == trace.EXIT_AGREE


def test_analyzer_names_the_rank_that_never_reached_a_collective(tmp_path, capsys):
    for rank in range(4):
        write_rank(tmp_path, rank, 4, CALLS if rank != 2 else CALLS[:41], done=41)
    assert trace.main([str(tmp_path)]) == trace.EXIT_DISAGREE
    out = capsys.readouterr().out
    assert "first disagreement at all_reduce #42 (float32[1048576])" in out
    assert "rank 2 never reached it (its last collective was broadcast #41 (float32[8]), " \
           "completed)" in out


def test_analyzer_names_a_rank_that_never_reached_the_groups_first_collective(tmp_path, capsys):
    # the most common hang: one rank stuck in data loading or setup before collective #1
    for rank in range(3):
        write_rank(tmp_path, rank, 3, CALLS[:1] if rank != 1 else [], done=0)
    assert trace.main([str(tmp_path)]) == trace.EXIT_DISAGREE
    out = capsys.readouterr().out
    assert "group '0': first disagreement at all_reduce #1 (float32[1024]): issued on ranks 0,2; " \
           "rank 1 never reached it (it made no collective on this group)" in out, out
    assert "agree" not in out.replace("disagree", ""), out


def test_analyzer_compares_the_counters_of_ranks_that_kept_no_entries(tmp_path):
    # buffers of size 0 keep no entries but count: rank 1 stopped at #40, the others at #42
    for rank in range(3):
        write_rank(tmp_path, rank, 3, CALLS if rank != 1 else CALLS[:40], size=0)
    found, text = analyze_dir(tmp_path)
    assert found, text
    assert "group '0': first disagreement at #41: rank 1 never reached it (its last collective " \
           "was #40; its buffer kept no entries)" in text, text


def test_analyzer_says_a_single_rank_agrees(tmp_path):
    write_rank(tmp_path, 0, 1, CALLS[:2])
    found, text = analyze_dir(tmp_path)
    assert not found and "group '0': rank 0 agrees on collectives #1-#2" in text, text


def test_analyzer_prints_each_ranks_last_entries_when_asked(tmp_path, capsys):
    for rank in range(2):
        write_rank(tmp_path, rank, 2, CALLS)
    assert trace.main([str(tmp_path), "--last", "2"]) == trace.EXIT_AGREE
    out = capsys.readouterr().out
    for rank in range(2):
        block = out.split(f"group '0', rank {rank}: last 2 of 43 entries kept (last collective issued "
                          f"#42, completed #41)\n")[1].splitlines()[:2]
        assert block == ["  all_reduce #42 (float32[1048576]): issued (nccl)",
                         f"  send #1 (float32[1]) with rank {(rank + 1) % 2}: queued (nccl)"], block
    assert trace.main([str(tmp_path), "--last", "-1"]) == trace.EXIT_ERROR


@pytest.mark.parametrize("field, change, expected", [
    ("shape", ("all_reduce", (1024, 2), torch.float32, None),
     "all_reduce #7: rank 1 passed shape (1024, 2), ranks 0,2 passed (1024,)"),
    ("dtype", ("all_reduce", (1024,), torch.float16, None),
     "all_reduce #7: rank 1 passed dtype float16, ranks 0,2 passed float32"),
    ("op", ("broadcast", (1024,), torch.float32, 0),
     "collective #7: rank 1 called broadcast, ranks 0,2 called all_reduce"),
])
def test_analyzer_names_rank_and_field_that_differ(tmp_path, capsys, field, change, expected):
    for rank in range(3):
        calls = list(CALLS)
        if rank == 1:
            calls[6] = change
        write_rank(tmp_path, rank, 3, calls)
    assert trace.main([str(tmp_path)]) == trace.EXIT_DISAGREE
    out = capsys.readouterr().out
    assert f"group '0': first disagreement: {expected}" in out, out


def test_analyzer_missing_dump_and_truncated_buffers(tmp_path):
    write_rank(tmp_path, 0, 3, CALLS, size=5)  # keeps #39-#42 and the send only
    write_rank(tmp_path, 1, 3, CALLS)
    found, text = analyze_dir(tmp_path)
    assert found and "no trace from rank 2" in text
    assert "ranks 0,1 agree on collectives #39-#42" in text


def test_analyzer_errors(tmp_path, capsys):
    assert trace.main([str(tmp_path / "absent")]) == trace.EXIT_ERROR
    assert trace.main([str(tmp_path)]) == trace.EXIT_ERROR
    assert "no trace files" in capsys.readouterr().err
    (tmp_path / "cupycoll_trace_rank0.json").write_text("{")
    assert trace.main([str(tmp_path)]) == trace.EXIT_ERROR
    assert "cannot read a cupycoll trace" in capsys.readouterr().err
    assert trace.main([]) == trace.EXIT_ERROR
    os.remove(tmp_path / "cupycoll_trace_rank0.json")
    write_rank(tmp_path, 0, 2, CALLS)
    os.rename(tmp_path / "cupycoll_trace_rank0.json", tmp_path / "copy.json")
    write_rank(tmp_path, 0, 2, CALLS)
    assert trace.main([str(tmp_path)]) == trace.EXIT_ERROR
    assert "a second trace of rank 0" in capsys.readouterr().err


@pytest.mark.launches
@pytest.mark.any_stack  # the analyzer reads JSON dumps; the recorder itself is tested on every leg
def test_command_line(tmp_path):
    for rank in range(2):
        write_rank(tmp_path, rank, 2, CALLS if rank == 0 else CALLS[:41], done=41)
    result = run_python("-m", "cupycoll.trace", str(tmp_path), timeout=120)
    assert result.returncode == 1, result.stderr
    assert "rank 1 never reached it" in result.stdout
    result = run_python("-m", "cupycoll.trace", "--bench", timeout=120)
    assert result.returncode == 0, result.stderr
    from cupycoll.trace import analyze
    figures = result.stdout.splitlines()[1:]
    assert [line.split()[0] for line in figures] == [f"{name}:" for name in analyze.BENCH_FIGURES]
    for line, meaning in zip(figures, analyze.BENCH_FIGURES.values()):
        assert line.endswith(meaning)  # each figure says what it timed
