"""Recovery when the ranks learn of a fault at different times: a fault one rank finds reaches
every rank (published through the store, claimed by each group's lifetime), one diagnosis
answers every Work failing with the same fault, a shrink's survivors wait for each other as
long as the last may take to learn of it, every exit 70 leaves its dump and torchrun's error
file, and nothing a logging handler or a folder does holds the abort or the exit back.

The multi-process scenarios run on the CPU route (tests/workers/recovery_worker.py); the
rest on the CPU stand-ins of the fault path (tests/faulty.py).
"""

from __future__ import annotations

import datetime
import json
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

import cupycoll
from cupycoll import bounds, compat, config
from cupycoll.errors import CollectiveTimeoutError, CommunicatorAbortedError, NcclError, PeerFailedError
from cupycoll.faults.last_words import TERMINATE_EXIT_CODE
from cupycoll.trace import news
from cupycoll.trace.gloo_work import TracedWork
from faulty import FakeComm, fault_group, make_group, run_script, stuck_work, undiagnosed
from mp import run_ranks

# -- a fault one rank finds reaches every rank ----------------------------------------------


def _pair(store, timeout=30.0, **options):
    """Ranks 0 and 1 of one group, both in this process (CPU stand-ins), on ``store``; each
    the group's first incarnation, as in processes of their own."""
    from cupycoll.trace import recorder

    pair = []
    for rank in (0, 1):
        recorder._incarnations.pop("pair", None)
        pair.append(cupycoll_stand_in(store, rank, timeout, **options))
    return pair


def cupycoll_stand_in(store, rank, timeout, **options):
    import standins

    return standins.CpuAsCudaGroup(store, rank, 2, datetime.timedelta(seconds=timeout),
                                   config.Options(watchdog_interval=0.01, **options), group_id="pair")


def test_a_peers_published_fault_fails_the_pending_works_with_its_error():
    store = dist.HashStore()
    found, told = _pair(store)
    try:
        for group in (found, told):
            group._cuda.comm = FakeComm()
        undiagnosed(found)
        waiting = stuck_work(told._cuda.watch)
        fault_group(found, NcclError(3, "ncclAllReduce", "asynchronous error on process group 'pair'",
                                     "remote process exited"))
        # rank 1's listener wakes on its bell and its lifetime claims the same fault at once
        assert told._cuda.life.ended.wait(5)
        error = waiting.exception()
        assert isinstance(error, PeerFailedError) and "(rank 0 found it)" in str(error), error
        assert "asynchronous error on process group 'pair'" in str(error)
        assert told._cuda.comm.aborted.is_set() and told._cuda.state == "aborted"
        with pytest.raises(CommunicatorAbortedError, match="rank 0 found it"):
            told._cuda.check_usable()
    finally:
        for group in (found, told):
            group.shutdown()


def test_a_fault_published_with_publishing_off_is_left_alone():
    store = dist.HashStore()
    found, told = _pair(store, publish_faults=False)
    try:
        for group in (found, told):
            group._cuda.comm = FakeComm()
        undiagnosed(found)
        waiting = stuck_work(told._cuda.watch)
        fault_group(found, CollectiveTimeoutError("all_reduce #1 did not complete"))
        time.sleep(0.5)
        assert told._cuda.state == "ok" and waiting.exception() is None
        assert not store.check([f"{news.key_prefix('pair', 0)}/news"])  # nothing was published
    finally:
        for group in (found, told):
            group.shutdown()


def test_a_timeout_explained_once_is_the_groups_verdict_on_both_routes():
    # The CUDA route's lifetime explains its timeout; a CPU Work of the group failing with
    # the same fault afterwards reuses it at once, asking nobody.
    group = make_group(timeout=30)
    group._cuda.comm = FakeComm()
    asked = []
    group._trace._diagnose = lambda *args, **kwargs: asked.append(args) or "rank 1 is behind"
    fault_group(group, CollectiveTimeoutError("all_reduce #5 did not complete"), batch=None,
                stuck="ncclAllReduce has been inside NCCL")
    assert len(asked) == 1
    timeout = RuntimeError("[gloo/transport/tcp/pair.cc:534] Timed out waiting 30000ms for recv operation")
    error = group._trace.failure(None, timeout)
    assert isinstance(error, CollectiveTimeoutError) and "rank 1 is behind" in str(error)
    assert len(asked) == 1


def test_the_cuda_routes_explanation_reuses_the_groups_verdict():
    group = make_group(timeout=30)
    trace = group._trace
    trace._diagnose = lambda *args, **kwargs: pytest.fail("asked the ranks again")
    trace._set_verdict(PeerFailedError("all_reduce #3 failed; rank 2 did not answer"))
    assert trace.explain_timeout(None, 30) == "all_reduce #3 failed; rank 2 did not answer"


class _GlooWork:
    """A gloo Work whose wait raises gloo's timeout (gloo failed it already)."""

    def __init__(self, error):
        self.error = error

    def wait(self, timeout=None):
        raise self.error

    def is_completed(self):
        return True

    def get_future(self):
        raise RuntimeError("no future")


def test_four_unfinished_works_get_one_diagnosis():
    # A hung peer and four asynchronous all_reduces: each Work's wait meets gloo's timeout,
    # and the first diagnosis (0.3 s here) answers all four, one after another or side by side.
    group = make_group(timeout=30)
    trace = group._trace
    asked = []

    def diagnose(*args, **kwargs):
        asked.append(args)
        time.sleep(0.3)
        return "process group 'g': all_reduce #1 timed out after 30 s on rank 0; rank 1 did not answer"
    trace._diagnose = diagnose
    timeout = RuntimeError("[gloo] Timed out waiting 30000ms for recv operation to complete")
    works = [TracedWork(_GlooWork(timeout), trace.recorder.record("all_reduce", ((4,),), (torch.float32,)), trace)
             for _ in range(4)]
    errors = []

    def wait(work):
        try:
            work.wait()
        except Exception as exc:  # noqa: BLE001 - collected
            errors.append(exc)
    started = time.monotonic()
    threads = [threading.Thread(target=wait, args=(w,)) for w in works[:2]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    for work in works[2:]:
        wait(work)
    assert len(asked) == 1 and time.monotonic() - started < 0.3 * 2
    assert len(errors) == 4 and all(type(e) is CollectiveTimeoutError for e in errors)
    assert len({str(e) for e in errors}) == 1 and "rank 1 did not answer" in str(errors[0])
    assert len({id(e) for e in errors}) == 4  # each Work its own error object
    assert group._cuda.life.ended.wait(5) and group._cuda.state == "aborted"  # the group's fault


# -- a CPU Work a peer's fault ends fails at once -------------------------------------------


class _PendingGlooWork:
    """A gloo Work that never finishes: its wait(timeout) runs out as c10d's does."""

    def __init__(self):
        self.waits = 0

    def wait(self, timeout=None):
        self.waits += 1
        time.sleep(timeout.total_seconds() if timeout else 600)
        raise RuntimeError("Operation timed out!")

    def is_completed(self):
        return False


def test_a_cpu_work_being_waited_on_fails_when_the_group_ends():
    group = make_group(timeout=30)
    trace = group._trace
    work = TracedWork(_PendingGlooWork(), trace.recorder.record("all_reduce", ((4,),), (torch.float32,)), trace)
    raised = []
    waiter = threading.Thread(target=lambda: raised.append(pytest.raises(Exception, work.wait).value))
    waiter.start()
    time.sleep(0.2)
    fault = PeerFailedError("all_reduce #1 failed; rank 3 did not answer (rank 2 found it)")
    group._cuda.life.peer_fault(fault)
    waiter.join(bounds.CPU_WAIT_SLICE_S + 3)
    assert not waiter.is_alive()
    assert type(raised[0]) is PeerFailedError and str(raised[0]) == str(fault)


# -- watch_calls off: an aborted collective never reads success -----------------------------


def test_an_aborted_collective_never_reads_success_with_watch_calls_off():
    from cupycoll.work import CudaWork
    from standins import CUDA

    group = make_group()
    watch = group._cuda.watch
    work = CudaWork("all_reduce", CUDA, [torch.ones(4)], watch, seq=1)
    work._issued(None, 0, True, unwatched=True)  # what a call issued with watch_calls off gets
    group.abort()
    assert not work.is_success() and isinstance(work.exception(), CommunicatorAbortedError)
    with pytest.raises(CommunicatorAbortedError):
        work.wait()
    seen = CudaWork("all_reduce", CUDA, [torch.ones(4)], make_group()._cuda.watch, seq=1)
    seen._issued(None, 0, True, unwatched=True)
    assert seen.is_completed() and seen.is_success()  # its caller saw it done before any abort


# -- the slot pool: an issuer beside release() ----------------------------------------------


class _DestroyedEvent:
    def __init__(self):
        self.destroyed = False
        self.recorded_destroyed = False

    def record(self, stream=None):
        if self.destroyed:
            self.recorded_destroyed = True

    def destroy(self):
        self.destroyed = True

    def query(self):
        return True


def test_a_slot_taken_while_release_empties_the_pool_is_never_a_destroyed_event(monkeypatch):
    from cupycoll.faults import watchdog
    from faulty import make_watch

    watch = make_watch()
    popping, released = threading.Event(), threading.Event()

    class SlowPool(list):  # an issuer paused between taking the pool and popping from it
        def pop(self, *args):
            popping.set()
            released.wait(5)
            return super().pop(*args)
    events = [_DestroyedEvent() for _ in range(3)]
    watch._free = SlowPool(watchdog.InFlight(e) for e in events)
    monkeypatch.setattr(watchdog.Watch, "_new_slot", lambda self: watchdog.InFlight(_DestroyedEvent()))
    watch.close(CommunicatorAbortedError("aborted"))
    issuer = threading.Thread(target=lambda: watch.issued(0, None))
    issuer.start()
    assert popping.wait(5)
    releaser = threading.Thread(target=watch.release)
    releaser.start()
    time.sleep(0.1)
    released.set()
    issuer.join(5)
    releaser.join(5)
    assert not any(e.recorded_destroyed for e in events)


# -- the dump folder cannot be turned against the rank --------------------------------------


def test_a_dump_never_follows_a_planted_symlink(tmp_path):
    from cupycoll.trace import dumps

    folder = tmp_path / "shared"
    victim = tmp_path / "victim"
    victim.write_text("mine")
    assert dumps.dump_on_timeout(str(folder), 0, "test") == str(folder / "cupycoll_trace_rank0.json")
    assert (os.stat(folder).st_mode & 0o777) == 0o700
    assert (os.stat(folder / "cupycoll_trace_rank0.json").st_mode & 0o777) == 0o600
    # another user plants the temporary name a dump once used, and the final name
    os.symlink(victim, folder / f"cupycoll_trace_rank0.json.{os.getpid()}.tmp")
    os.remove(folder / "cupycoll_trace_rank0.json")
    os.symlink(victim, folder / "cupycoll_trace_rank0.json")
    assert dumps.dump_on_timeout(str(folder), 0, "test") is None  # refused, warned
    assert victim.read_text() == "mine"
    with pytest.raises(cupycoll.CupycollValueError, match="symbolic link"):
        dumps.dump_trace(str(folder / "cupycoll_trace_rank0.json"))


# -- every exit 70 leaves its dump and torchrun's error file ---------------------------------

_TERMINATING = """
    import datetime, json, os, threading, time
    import standins
    from cupycoll import bounds, config
    from cupycoll.errors import CupycollError, NcclError
    from cupycoll.faults import heartbeat
    from cupycoll.faults.last_words import terminate
    from cupycoll.faults.watchdog import Finding
    from faulty import FakeComm, RaisingEvent, issued_work
    group = standins.CpuAsCudaGroup(None, 0, 2, datetime.timedelta(seconds=60),
                                    config.Options(on_timeout="terminate", watchdog_interval=0.01))
    group._cuda.comm = FakeComm()
    life = group._cuda.life
"""

_EXITS = {
    "nccl async error": "group._cuda.comm.error = type('E', (), {'status': 3, 'function': 'ncclAllReduce', "
                        "'last_error': 'remote process exited'})(); life.watching()",
    "sticky cuda error": "issued_work(group._cuda.watch, event=RaisingEvent()); life.watching()",
    "heartbeat": "terminate(life, CupycollError('the cupycoll watchdog is stuck'))",
    "deadline": "life.fault = CupycollError('ncclCommAbort hangs'); life._deadline = 0.0; "
                "life._check_deadline(time.monotonic())",
}


@pytest.mark.parametrize("how", sorted(_EXITS))
def test_every_exit_70_leaves_a_dump_and_the_error_file(tmp_path, how, monkeypatch):
    error_file = tmp_path / "error.json"
    body = (f"    import os\n    os.environ['CUPYCOLL_TRACE_DIR'] = {str(tmp_path / 'trace')!r}\n"
            f"    os.environ['TORCHELASTIC_ERROR_FILE'] = {str(error_file)!r}\n" + _TERMINATING.lstrip("\n"))
    result = run_script(prelude=body, body=f"""
    {_EXITS[how]}
    time.sleep(20); print("still alive")
    """)
    assert result.returncode == TERMINATE_EXIT_CODE, result.stderr
    assert os.listdir(tmp_path / "trace") == ["cupycoll_trace_rank0.json"], result.stderr
    dump = json.loads((tmp_path / "trace" / "cupycoll_trace_rank0.json").read_text())
    assert dump["reason"].startswith("exit 70: ")
    data = json.loads(error_file.read_text())
    message = data["message"]["message"]
    assert message.split(":")[0] in ("NcclError", "CommunicatorAbortedError", "CupycollError"), data
    assert int(data["message"]["extraInfo"]["timestamp"]) > 0
    assert "terminating the process" in result.stderr and "still alive" not in result.stdout


def test_the_error_file_is_what_torchruns_agent_reads(tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
    from cupycoll.faults.last_words import write_error_file

    path = tmp_path / "error.json"
    write_error_file(str(path), PeerFailedError("all_reduce #3 failed; rank 2 did not answer"))
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=TERMINATE_EXIT_CODE, error_file=str(path))
    assert failure.message["message"] == "PeerFailedError: all_reduce #3 failed; rank 2 did not answer"
    assert failure.timestamp > 0


# -- a logging handler cannot stop the abort or the exit ------------------------------------


@pytest.mark.parametrize("policy", ["raise", "terminate"])
def test_a_logging_handler_that_blocks_stops_neither_the_abort_nor_the_exit(policy):
    result = run_script(prelude=_TERMINATING.replace('on_timeout="terminate"', f'on_timeout={policy!r}'), body="""
    import logging
    class Stuck(logging.Handler):
        def emit(self, record):
            threading.Event().wait()  # a stalled pipe, a hung network handler
    logging.getLogger("cupycoll").addHandler(Stuck())
    life._explain = None
    issued_work(group._cuda.watch, seq=4)
    group._cuda.watch.timeout = 0.05
    life.watching()
    assert group._cuda.comm.aborted.wait(10), "the abort never ran"
    assert life.ended.wait(10)
    print("aborted", group._cuda.state, flush=True)
    if life.policy == "raise":
        os._exit(0)  # (Python's own logging.shutdown at exit waits for the stuck handler's lock)
    time.sleep(20); print("still alive", flush=True)
    """, timeout=60)
    assert "aborted aborted" in result.stdout, result.stderr
    if policy == "terminate":
        assert result.returncode == TERMINATE_EXIT_CODE and "still alive" not in result.stdout, result.stderr
        assert "terminating the process" in result.stderr


# -- multi-process: the CPU route, real gloo, a real store -----------------------------------

def _run(tmp_path, scenario, world, timeout_s, env=None, limit=120):
    out = tmp_path / scenario
    out.mkdir(exist_ok=True)
    run_ranks("recovery_worker.py", world, args=[str(out), scenario, str(timeout_s)], timeout=limit,
              fail_fast=False, env=env, expect_success=scenario != "hung")
    return {rank: json.loads((out / f"rank{rank}.json").read_text(encoding="utf-8"))
            for rank in range(world) if (out / f"rank{rank}.json").exists()}


@pytest.mark.launches
def test_a_fault_one_rank_finds_fails_every_ranks_pending_work_at_once(tmp_path):
    # 4 ranks, timeout 20 s, rank 3 leaves: its gloo neighbours see it at once; rank 1 would
    # see it only after 20 s and the diagnosis, but gets it from them within seconds.
    reports = _run(tmp_path, "death", 4, 20)
    death = reports[3]["death"]
    for rank in (0, 1, 2):
        error = reports[rank]["error"]
        assert error["type"] == "PeerFailedError" and "rank 3" in error["text"], reports[rank]
        assert error["at"] - death < 8, (rank, error["at"] - death, error)


@pytest.mark.launches
@pytest.mark.parametrize("published", ["1", "0"])
def test_survivors_that_learn_of_a_death_at_different_times_all_shrink(tmp_path, published):
    # With publishing off, a rank learns of rank 3's death at its own timeout, or at once
    # where gloo shows it the closed connection; rank 1 also acts on it 2 s late. The others
    # wait for it in the shrink's gathering, and every shrink succeeds.
    late = "2" if published == "0" else "0"
    reports = _run(tmp_path, "shrink", 4, 2, env={"CUPYCOLL_PUBLISH_FAULTS": published, "RECOVERY_LATE_S": late})
    for rank in (0, 1, 2):
        report = reports[rank]
        assert "shrink_error" not in report, report
        assert report["after"] == [3.0] * 4 and report["size"] == 3, report
    began = [reports[rank]["shrink_at"] for rank in (0, 1, 2)]
    if published == "0":
        assert max(began) - min(began) > 1.5, began  # staggered indeed


@pytest.mark.launches
def test_a_hung_peers_four_unfinished_works_fail_after_one_diagnosis(tmp_path):
    reports = _run(tmp_path, "hung", 2, 5)
    hang, errors = reports[1]["hang"], reports[0]["errors"]
    assert all(e is not None and e["type"] == "CollectiveTimeoutError" for e in errors), errors
    assert len({e["text"] for e in errors}) == 1
    # the hang, the 5 s timeout and one 4 s diagnosis; not one diagnosis after another
    assert max(e["at"] for e in errors) - hang < 5 + bounds.DIAGNOSIS_WAIT_S + 3, errors


@pytest.mark.launches
@pytest.mark.skipif(not hasattr(dist, "shrink_group"), reason="torch before 2.11 has no dist.shrink_group")
@pytest.mark.skipif(compat.PY_BACKEND and config.shape(compat.BACKEND_SHAPE_BY_DEFAULT) == "backend",
                    reason="the Backend shape serves torch's shrink_group")
def test_torchs_shrink_group_on_a_cupycoll_group_names_cupycolls(tmp_path):
    reports = _run(tmp_path, "torch_shrink", 2, 20)
    raised = reports[0]["raised"]
    assert raised["type"] == "CupycollTypeError" and "TypeError" in raised["mro"], raised
    assert "call cupycoll.shrink_group([1], group)" in raised["text"], raised
    assert reports[0]["after"] == reports[1]["after"] == [2.0, 2.0]  # the group is as it was
