"""Timeout diagnosis (cupycoll.trace.diagnosis) and the collective mismatch check
(cupycoll.trace.mismatch): pure message builders, a real TCPStore in-process, dead stores, the
responder that answers for a rank busy elsewhere (never over the rank's own record), and
real processes on gloo (tests/workers/trace_worker.py)."""

from __future__ import annotations

import datetime
import json
import logging
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from cupycoll.trace import diagnosis, exchange, gloo_work, listener, news, records
from cupycoll.trace import mismatch
from cupycoll.trace import analyze as trace
from cupycoll.trace import recorder as rec_mod

from mp import run_ranks
from faulty import eventually

STUCK = {"seq": 42, "op": "all_reduce", "desc": "all_reduce #42 (float32[1048576])"}
IN_42 = {"seq": 42, "op": "all_reduce"}


def rec(last, op, stuck=None, completed=None, state="completed"):
    return {"last_issued": last, "last_issued_op": op, "last_issued_state": state,
            "last_completed": last if completed is None else completed, "stuck": stuck}


def at_42():
    return rec(42, "all_reduce", IN_42, 41, "issued")


def message(records, world=4, **kwargs):
    return diagnosis.build_message(STUCK, 30, records, list(range(world)), **kwargs)


# -- the message (pure) -------------------------------------------------------------------

def test_one_rank_behind():
    records = {0: at_42(), 1: at_42(), 2: rec(41, "broadcast"), 3: at_42()}
    assert message(records) == (
        "all_reduce #42 (float32[1048576]) timed out after 30 s on ranks 0,1,3; rank 2 is "
        "behind: its last collective was #41 (broadcast) — it never reached #42")


def test_several_behind_at_one_or_several_places():
    same = {0: at_42(), 1: rec(41, "broadcast"), 2: rec(41, "broadcast"), 3: at_42()}
    assert message(same).endswith("ranks 1,2 are behind: their last collective was #41 "
                                  "(broadcast) — they never reached #42")
    apart = {0: at_42(), 1: rec(39, "all_gather", {"seq": 39, "op": "all_gather"}, 38, "issued"),
             2: rec(41, "broadcast"), 3: rec(0, None)}
    assert message(apart).endswith(
        "on rank 0; ranks 1-3 are behind: their last collectives were #41 (broadcast) on "
        "rank 2, #39 (all_gather, not completed) on rank 1 and none on rank 3 — they never "
        "reached #42")
    first = {0: at_42(), 1: rec(0, None)}
    assert message(first, world=2).endswith(
        "rank 1 is behind: it has made no collective on this group yet — it never reached #42")


def test_ranks_not_answering_and_a_dead_store():
    records = {0: at_42(), 1: None, 2: rec(41, "broadcast")}
    text = message(records)
    assert text.endswith("rank 2 is behind: its last collective was #41 (broadcast) — it "
                         "never reached #42; ranks 1,3 did not answer within 4 s (dead, or "
                         "stuck outside cupycoll)")
    dead = message({0: at_42()}, wait_s=2, store_error="no reply", group="pg")
    assert dead == ("process group 'pg': all_reduce #42 (float32[1048576]) timed out after "
                    "30 s on rank 0; the store did not answer within 2 s (no reply), so no "
                    "other rank could be asked")


def test_all_ranks_at_the_same_collective():
    text = message({r: at_42() for r in range(4)})
    assert text.startswith("all_reduce #42 (float32[1048576]) timed out after 30 s on all "
                           "ranks; no rank is behind: all reached #42")


def test_ranks_ahead_in_another_op_and_global_ranks():
    records = {0: at_42(), 1: rec(45, "all_gather", {"seq": 45, "op": "all_gather"}, 44, "issued"),
               2: rec(42, "broadcast", {"seq": 42, "op": "broadcast"}, 41, "issued"),
               3: rec(50, "barrier", None, 50)}
    text = diagnosis.build_message(STUCK, 30, records, [8, 9, 10, 11])
    assert "on rank 8;" in text
    assert "rank 10 is in #42 as broadcast, not all_reduce" in text
    assert "rank 9 completed #42 and went on to #45 (all_gather)" in text
    assert "rank 11 completed #42 and went on to #50 (barrier)" in text


def test_ranks_text():
    assert diagnosis.ranks_text([2]) == "rank 2"
    assert diagnosis.ranks_text([3, 1, 0]) == "ranks 0,1,3"
    assert diagnosis.ranks_text(list(range(64)) + [65, 66]) == "ranks 0-63,65,66"


def test_progress_of_a_recorder():
    recorder = rec_mod.Recorder("g", [5, 6], 1, size=0)
    done = recorder.record("broadcast", ((8,),), (torch.float32,), root=0)
    recorder.mark(done, "completed")
    stuck = recorder.record("all_reduce", ((4,),), (torch.float32,))
    mine = records.progress(recorder)
    assert mine["stuck"] == {"seq": 2, "op": "all_reduce", "desc": "all_reduce #2 (float32[4])"}
    assert (mine["last_issued"], mine["last_completed"], mine["global_rank"]) == (2, 1, 6)
    assert mine["last_issued_state"] == "issued" and stuck is recorder.last_issued_entry


# -- the exchange through a store ---------------------------------------------------------

@pytest.fixture
def stores():
    master = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))
    clients = [dist.TCPStore("127.0.0.1", master.port, 1, False) for _ in range(3)]
    yield clients
    del clients, master


def recorders(world, behind=2, group="0"):
    out = []
    for rank in range(world):
        recorder = rec_mod.Recorder(group, list(range(world)), rank)
        for seq in range(1, 42):
            recorder.mark(recorder.record("broadcast" if seq == 41 else "all_reduce"), "completed")
        if rank != behind:
            recorder.record("all_reduce", ((1048576,),), (torch.float32,))
        out.append(recorder)
    return out


def ranks_0_and_1_time_out_while_rank_2_answers(stores, recs, dump_dir=None) -> dict:
    """Ranks 0 and 1 diagnose their timeout side by side; rank 2's responder answers for it.
    Their reports, by rank."""
    listener.serve(stores[2], recs[2], dump_dir, interval=0.05)
    reports = {}

    def run(rank):
        reports[rank] = exchange.diagnose_timeout(stores[rank], recs[rank], timeout_s=30,
                                                  wait_s=5.0)
    try:
        threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
    finally:
        listener.unserve(recs[2])
    return reports


def test_diagnose_through_a_real_store(stores, tmp_path):
    recs = recorders(3)
    reports = ranks_0_and_1_time_out_while_rank_2_answers(stores, recs, str(tmp_path))
    for rank in (0, 1):
        report = reports[rank]
        assert report.message == (
            "process group '0': all_reduce #42 (float32[1048576]) timed out after 30 s on "
            "ranks 0,1; rank 2 is behind: its last collective was #41 (broadcast) — it never "
            "reached #42")
        # every rank answered, so it returned before its 5 s wait ran out
        assert sorted(report.records) == [0, 1, 2] and report.elapsed_s < 5
    # The responder dumped rank 2's recorder (nothing registered: an empty process trace).
    # (it writes a temporary file and renames it: wait for the rename)
    deadline = time.monotonic() + 5
    while os.listdir(tmp_path) != ["cupycoll_trace_rank2.json"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert os.listdir(tmp_path) == ["cupycoll_trace_rank2.json"]

    # A later timeout in the same group never reads the records of the first one.
    recs[0].record("all_reduce", ((4,),), (torch.float32,))
    started = time.monotonic()
    later = exchange.diagnose(stores[0], "0", 0, 3, records.progress(recs[0], recs[0].find(43)),
                              30, wait_s=1.0)
    assert 0.9 < time.monotonic() - started < 1 + 3
    assert sorted(later.records) == [0] and later.store_error is None
    assert later.message.endswith("ranks 1,2 did not answer within 1 s (dead, or stuck "
                                  "outside cupycoll)")


def test_a_known_gone_peer_is_named_as_soon_as_every_other_rank_answered(stores):
    # gloo saw a connection close: rank 2 is gone; once rank 1 has answered (its responder),
    # rank 0 names rank 2 at once instead of waiting out the 4 s
    # (a group name of its own: this process claimed group '0''s record keys in other tests)
    recs = recorders(3, group="gone")
    listener.serve(stores[1], recs[1], interval=0.05)
    try:
        started = time.monotonic()
        report = exchange.diagnose(stores[0], "gone", 0, 3, records.progress(recs[0], recs[0].find(42)),
                                   None, what="failed (Connection closed by peer)", one_gone=True)
    finally:
        listener.unserve(recs[1])
    assert time.monotonic() - started < 3 and sorted(report.records) == [0, 1]
    assert report.message.endswith("rank 2 did not answer and every other rank did: it is the peer "
                                   "whose connection closed (dead, or it ended the group)"), report.message
    # a group of two: nobody else to ask
    two = recorders(2, group="two")
    started = time.monotonic()
    report = exchange.diagnose(stores[0], "two", 0, 2, records.progress(two[0], two[0].find(42)),
                               None, what="failed", one_gone=True)
    assert time.monotonic() - started < 1 and "rank 1 did not answer and every other rank did" in report.message


def test_the_last_rank_out_deletes_the_groups_diagnosis_keys(stores):
    recs = recorders(3)
    baseline = stores[0].num_keys()
    ranks_0_and_1_time_out_while_rank_2_answers(stores, recs)
    assert stores[0].num_keys() > baseline  # the records, the requests and their counters
    for rank in (0, 1):
        news.forget(stores[rank], recs[rank])
        assert stores[0].num_keys() > baseline  # a rank still in the group may read them
    news.forget(stores[2], recs[2])
    assert stores[0].num_keys() == baseline


def test_a_group_that_never_diagnosed_leaves_no_key(stores):
    recs = recorders(2)
    baseline = stores[0].num_keys()
    for rank in (0, 1):
        listener.serve(stores[rank], recs[rank], interval=0.01)
    time.sleep(0.2)  # the responder polls the group several times
    for rank in (0, 1):
        listener.unserve(recs[rank])
    assert stores[0].num_keys() == baseline
    for rank in (0, 1):
        news.forget(stores[rank], recs[rank])
    assert stores[0].num_keys() == baseline


def test_forgetting_a_group_returns_within_its_wait_on_a_dead_store():
    store = BlockingStore()
    started = time.monotonic()
    news.forget(store, recorders(2)[0], wait_s=0.3)
    assert time.monotonic() - started < 0.3 + 2
    store.release.set()


class BlockingStore:
    """A store whose every call blocks, like torch's against a dead server."""

    def __init__(self):
        self.release = threading.Event()

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.release.wait()


class RaisingStore:
    def __getattr__(self, name):
        def fail(*args, **kwargs):
            raise RuntimeError("Connection reset by peer\nmore text")
        return fail


def test_a_dead_store_cannot_hang_the_diagnosis():
    recorder = recorders(2)[0]
    store = BlockingStore()
    started = time.monotonic()
    report = exchange.diagnose_timeout(store, recorder, timeout_s=30, wait_s=0.5)
    assert time.monotonic() - started < 0.5 + 3  # not the blocked store's (endless) wait
    assert report.store_error == "no reply"
    assert "the store did not answer within 0.5 s (no reply)" in report.message
    store.release.set()
    report = exchange.diagnose_timeout(RaisingStore(), recorder, timeout_s=30, wait_s=20)
    assert report.elapsed_s < 10  # the first error ends it, not the 20 s wait
    assert "(RuntimeError: Connection reset by peer)" in report.message


def test_the_responder_drops_a_dead_store_and_ends():
    responder = listener.Responder()
    responder.serve(RaisingStore(), recorders(2)[1], interval=0.01)
    deadline = time.monotonic() + 5
    while responder.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not responder.running


def test_a_store_error_that_ends_serving_a_group_is_a_warning(caplog):
    responder = listener.Responder()
    with caplog.at_level(logging.WARNING, logger="cupycoll"):
        responder.serve(RaisingStore(), recorders(2)[1], interval=0.01)
        assert eventually(lambda: not responder.running)
    assert any(r.levelno == logging.WARNING and "no longer answering" in r.getMessage()
               for r in caplog.records)


def test_looks_like_timeout():
    assert gloo_work.looks_like_timeout(RuntimeError("[gloo] Timed out waiting 1000ms for recv"))
    assert gloo_work.looks_like_timeout(TimeoutError())
    assert not gloo_work.looks_like_timeout(RuntimeError("Connection closed by peer"))


# -- the listener: a rank's own record, and its answers for a peer ------------------------


def timed_out_in_the_first_collective(group):
    # a group name of its own per test: the store keys are per group, incarnation and
    # collective, and these recorders are all incarnation 0
    recorder = rec_mod.Recorder(group, [0, 1], 1)
    entry = recorder.record("all_reduce", ((4,),), (torch.float32,))
    mine = records.progress(recorder)  # it timed out in #1 and publishes that
    recorder.mark(entry, "failed")  # the gloo route then marks the entry failed
    return recorder, mine, news.key_prefix(group, recorder.incarnation)


def publish_own_record(store, recorder, mine):
    # the rank's own diagnosis (rank 0 stays silent: it returns after its short wait)
    return exchange.diagnose(store, recorder.group, 1, 2, mine, 30, wait_s=0.3,
                             incarnation=recorder.incarnation)


def ask(store, prefix, seq, by=0):
    """Rank ``by``'s request for #``seq`` in the group's news."""
    store.append(f"{prefix}/news", json.dumps({"kind": "ask", "seq": seq, "from": by}) + "\n")


def read_records(store, prefix, seq, size=2):
    return records.parse_records(store.get(f"{prefix}/{seq}/records"), size)


def test_the_responder_keeps_its_ranks_own_record():
    store = dist.HashStore()
    recorder, mine, prefix = timed_out_in_the_first_collective("own record kept")
    publish_own_record(store, recorder, mine)
    ask(store, prefix, 1)  # rank 0 asks for #1 too
    listener._Served(store, recorder, None, None).poll()
    assert read_records(store, prefix, 1)[1] == records.valid_record(mine)
    assert store.add(f"{prefix}/1/count", 0) == 1


def test_the_own_record_outlasts_an_answer_being_written_at_that_moment():
    # Ranks 0 and 1 time out together: rank 0's request wakes rank 1's listener while rank 1
    # publishes its own record. Whatever order they land in, the own record is the one read,
    # and the rank is counted once.
    store = dist.HashStore()
    recorder, mine, prefix = timed_out_in_the_first_collective("own record outlasts")
    ask(store, prefix, 1)
    writing, release = threading.Event(), threading.Event()

    class PausedOnce:  # the rank's store: its first append (the listener's answer) waits for the test
        def __getattr__(self, name):
            return getattr(store, name)

        def append(self, key, value):
            if not writing.is_set():
                writing.set()
                release.wait(5)
            store.append(key, value)
    paused = PausedOnce()
    answering = threading.Thread(target=listener._Served(paused, recorder, None, None).poll)
    answering.start()
    assert writing.wait(5)  # the listener decided to answer and is writing
    own = threading.Thread(target=publish_own_record, args=(paused, recorder, mine))
    own.start()
    time.sleep(0.2)
    release.set()
    answering.join(5)
    own.join(5)
    assert eventually(lambda: read_records(store, prefix, 1).get(1) == records.valid_record(mine))
    assert store.add(f"{prefix}/1/count", 0) == 1


def test_a_peers_request_is_still_answered():
    store = dist.HashStore()
    recorder = rec_mod.Recorder("g", [0, 1], 1)
    recorder.record("broadcast", ((4,),), (torch.float32,))
    prefix = news.key_prefix("g", recorder.incarnation)
    ask(store, prefix, 2)  # rank 0 timed out in #2
    listener._Served(store, recorder, None, None).poll()
    assert read_records(store, prefix, 2)[1]["last_issued"] == 1
    assert store.add(f"{prefix}/2/count", 0) == 1


# -- the store is input, not trust ----------------------------------------------------------

JUNK = [[1, 2], "rank 2", {"stuck": "x"}, {"last_issued": "abc"}, float("inf"),
        {"last_issued": 41, "stuck": {"seq": "42", "op": "all_reduce"}}, {"last_issued_state": 7}]


@pytest.mark.parametrize("junk", JUNK, ids=range(len(JUNK)))
def test_a_malformed_record_counts_as_not_answering(junk):
    text = message({0: at_42(), 1: junk, 2: rec(41, "broadcast"), 3: at_42()})
    assert text.endswith("rank 2 is behind: its last collective was #41 (broadcast) — it never reached "
                         "#42; rank 1 did not answer within 4 s (dead, or stuck outside cupycoll)"), text


def test_diagnose_never_raises_on_what_peers_wrote():
    store = dist.HashStore()
    prefix = news.key_prefix("junk", 0)
    for line in ["not json", "[1, 2]", '{"rank": "1"}', "Infinity", '{"rank": 9, "last_issued": 3}',
                 json.dumps({"rank": 1, "last_issued": {"a": 1}})]:
        store.append(f"{prefix}/42/records", line + "\n")
    store.add(f"{prefix}/42/count", 5)  # a count that says more than the group has
    store.set(f"{prefix}/42/verdict", "{not json")
    mine = dict(at_42(), rank=0)
    report = exchange.diagnose(store, "junk", 0, 2, mine, 30, wait_s=0.5)
    assert report.message.endswith("rank 1 did not answer within 0.5 s (dead, or stuck outside cupycoll)")
    report = exchange.diagnose(store, "junk", 0, 2, "not a record", 30, wait_s=0.5)
    assert "the diagnosis failed" in report.message


def test_a_bad_request_is_skipped_and_the_next_one_answered():
    store = dist.HashStore()
    recorder = rec_mod.Recorder("bad requests", [0, 1], 1)
    recorder.record("broadcast", ((4,),), (torch.float32,))
    prefix = news.key_prefix(recorder.group, recorder.incarnation)
    for line in ["zzz", '{"kind": "ask", "seq": "2", "from": 0}', '{"kind": "ask", "seq": -1, "from": 0}',
                 '{"kind": "fault", "from": 0, "error": "SystemExit", "message": "x"}', "[]"]:
        store.append(f"{prefix}/news", line + "\n")
    served = listener._Served(store, recorder, None, None)
    served.poll()  # nothing raised: every bad item skipped
    ask(store, prefix, 3)
    served.poll()
    assert read_records(store, prefix, 3)[1]["last_issued"] == 1


def test_peer_text_is_escaped_before_it_reaches_a_message():
    forged = "broadcast\nERROR cupycoll: rank 0 is fine\x1b[2J"
    text = message({0: at_42(), 1: rec(41, forged), 2: at_42(), 3: at_42()})
    assert "\n" not in text and "\x1b" not in text
    assert "#41 (broadcast\\nERROR cupycoll: rank 0 is fine\\x1b[2J)" in text
    assert records.valid_item({"kind": "fault", "from": 1, "error": "PeerFailedError",
                               "message": "gone\r\nforged"})["message"] == "gone\\r\\nforged"


def test_an_idle_listener_makes_no_store_call_whatever_the_number_of_groups():
    # One listener per rank, however many groups it serves; idle, it waits for its bell
    # (one call, served by the store) where torch can clone a store, else looks at it every
    # RESPONDER_INTERVAL_S: never a call per group.
    import collections

    lock, tally = threading.Lock(), collections.Counter()
    store = Counting(dist.HashStore(), tally, lock)
    groups = [rec_mod.Recorder(f"idle {g}", [0, 1], 1) for g in range(4)]
    for recorder in groups:
        listener.serve(store, recorder)
    try:
        time.sleep(1.5)
        listeners = [t for t in threading.enumerate() if t.name == "cupycoll-listener-1"]
        assert len(listeners) == 1
        assert sum(tally.values()) <= 2, tally
    finally:
        for recorder in groups:
            listener.unserve(recorder)
    assert eventually(lambda: not any(t.name == "cupycoll-listener-1" for t in threading.enumerate()))


# -- what the exchange costs the store -------------------------------------------------------

class Counting:
    """A store that counts its calls (and its clones'), by name."""

    def __init__(self, inner, tally, lock):
        self.inner, self.tally, self.lock = inner, tally, lock

    def __getattr__(self, name):
        def call(*args, **kwargs):
            with self.lock:
                self.tally[name] += 1
            return getattr(self.inner, name)(*args, **kwargs)
        return call

    def clone(self):
        return Counting(self.inner.clone(), self.tally, self.lock)


def calls_per_rank(world):
    """Every rank but the last times out in #42 side by side; the last one, behind, answers
    through its listener. Each rank's store calls from the first asker to the last report."""
    import collections

    lock, store = threading.Lock(), dist.HashStore()
    tallies = [collections.Counter() for _ in range(world)]
    stores = [Counting(store, tallies[r], lock) for r in range(world)]
    recs = recorders(world, behind=world - 1, group=f"cost{world}")
    for rank in range(world):
        listener.serve(stores[rank], recs[rank])
    time.sleep(0.3)
    for tally in tallies:
        tally.clear()
    reports = {}

    def run(rank):
        reports[rank] = exchange.diagnose_timeout(stores[rank], recs[rank], timeout_s=30).message
    threads = [threading.Thread(target=run, args=(r,)) for r in range(world - 1)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(15)
        time.sleep(0.3)
        counts = [sum(t.values()) for t in tallies]
    finally:
        for recorder in recs:
            listener.unserve(recorder)
    assert len(reports) == world - 1
    assert all(f"rank {world - 1} is behind" in text for text in reports.values()), reports
    return counts


def test_a_diagnosis_costs_each_rank_the_same_store_calls_whatever_the_world_size():
    small, large = calls_per_rank(4), calls_per_rank(16)
    # an append, an add, a wait and a get or two per rank, and its listener's wake-up; the
    # diagnoser's ring of every bell is one call: nothing grows with the number of ranks
    assert max(small) <= 12 and max(large) <= 12, (small, large)
    assert sum(large) / len(large) <= sum(small) / len(small) + 1.5, (small, large)


def test_the_exchange_thread_stops_when_the_diagnosis_gives_up():
    # A slow store (10 ms a call) and 29 peers answering: once the diagnosis has returned,
    # its thread makes no more store calls (it does not go on reading the peers' records).
    import collections

    class Slow(Counting):
        def __getattr__(self, name):
            call = super().__getattr__(name)

            def slow(*args, **kwargs):
                time.sleep(0.01)
                return call(*args, **kwargs)
            return slow

    lock, store = threading.Lock(), dist.HashStore()
    world = 30
    tallies = [collections.Counter() for _ in range(world)]
    stores = [Slow(store, tallies[r], lock) for r in range(world)]
    recs = recorders(world, behind=-1, group="slow store")
    for rank in range(1, world):
        listener.serve(stores[rank], recs[rank])
    try:
        report = exchange.diagnose_timeout(stores[0], recs[0], timeout_s=30, wait_s=1.0)
        made = sum(tallies[0].values())
        time.sleep(1.5)
        assert sum(tallies[0].values()) - made <= 1, tallies[0]
    finally:
        for recorder in recs:
            listener.unserve(recorder)
    assert report.message.startswith("process group 'slow store': all_reduce #42"), report.message
    assert not any(t.name == "cupycoll-diagnosis" for t in threading.enumerate())


# -- the mismatch check -------------------------------------------------------------------

def sig(seq=7, op="all_reduce", shape=(4, 4), dtype="float32", root=None, reduce_op=None):
    return mismatch.signature(seq, op, [shape], [dtype], root, reduce_op)


def test_compare_names_rank_and_field():
    assert mismatch.compare({0: sig(), 1: sig(), 2: sig()}) is None
    assert mismatch.compare({0: sig(), 1: sig(shape=(4, 3))}) == \
        "all_reduce #7: rank 1 passed shape (4, 3), rank 0 passed (4, 4)"
    assert mismatch.compare({0: sig(), 1: sig(dtype="torch.float16"), 2: sig()}) == \
        "all_reduce #7: rank 1 passed dtype float16, ranks 0,2 passed float32"
    assert mismatch.compare({0: sig(op="broadcast", root=0), 1: sig(), 2: sig()}) == \
        "collective #7: rank 0 called broadcast, ranks 1,2 called all_reduce"
    assert mismatch.compare({0: sig(op="broadcast", root=0), 1: sig(op="broadcast", root=1)},
                            ranks=[4, 6]) == "broadcast #7: rank 6 passed root 1, rank 4 passed 0"
    assert mismatch.compare({0: sig(8), 1: sig(7), 2: sig(8)}).endswith(
        "rank 1 is at #7, ranks 0,2 are at #8")
    assert mismatch.compare({0: sig(reduce_op=dist.ReduceOp.SUM),
                             1: sig(reduce_op=dist.ReduceOp.MAX)}) == \
        "all_reduce #7: rank 1 passed reduce op MAX, rank 0 passed SUM"
    several = {0: mismatch.signature(1, "all_gather", [(2,), (3,)], ["int8", "int8"]),
               1: mismatch.signature(1, "all_gather", [(2,), (4,)], ["int8", "int8"])}
    assert mismatch.compare(several) == \
        "all_gather #1: rank 1 passed shapes [(2,), (4,)], rank 0 passed [(2,), (3,)]"
    a2a = {r: mismatch.signature(1, "all_to_all_single", [(r + 1,)], ["int8"]) for r in range(3)}
    assert mismatch.compare(a2a) is None  # split sizes may differ by design
    assert mismatch.digest(sig()) == mismatch.digest(sig()) != mismatch.digest(sig(shape=(4, 3)))


@pytest.mark.launches
def test_mismatch_check_across_processes(tmp_path):
    run_ranks("trace_worker.py", 3, ["mismatch", str(tmp_path)], timeout=120)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text(encoding="utf-8")) for r in range(3)]
    expected = {
        "shape": "all_reduce #4: rank 1 passed shape (4, 3), ranks 0,2 passed (4, 4)",
        "dtype": "all_reduce #5: rank 1 passed dtype float16, ranks 0,2 passed float32",
        "op": "collective #6: rank 1 called broadcast, ranks 0,2 called all_reduce",
        "root": "broadcast #7: rank 1 passed root 1, ranks 0,2 passed 0",
        "reduce_op": "all_reduce #8: rank 1 passed reduce op MAX, ranks 0,2 passed SUM",
        "seq": "rank 1 is at #10, ranks 0,2 are at #9",
    }
    for rank, result in enumerate(results):
        assert result["agreed"] == 5  # calls that agree (all_to_all included) never raise
        for case, text in expected.items():
            raised = result["raised"][case]
            assert raised is not None and raised.startswith("process group '0': collective "
                                                            "mismatch, "), (rank, case, raised)
            assert raised.endswith(text), (rank, case, raised)
    print(f"\nmismatch check per call (3 ranks, gloo): {results[0]['check_us']:.0f} µs")


@pytest.mark.launches
def test_diagnosis_across_processes(tmp_path):
    run_ranks("trace_worker.py", 4, ["diagnose", str(tmp_path)], timeout=120)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text(encoding="utf-8"))
        assert result["message"] == (
            "process group '0': all_reduce #42 (float32[1048576]) timed out after 30 s on ranks 0,1; rank 2 is "
            "behind: its last collective was #41 (broadcast) — it never reached #42; rank 3 "
            "did not answer within 4 s (dead, or stuck outside cupycoll)")
        assert result["answered"] == [0, 1, 2] and result["elapsed_s"] < 4 + 3
    traces = tmp_path / "traces"
    assert sorted(os.listdir(traces)) == [f"cupycoll_trace_rank{r}.json" for r in range(3)]
    found, lines = trace.analyze(trace.load_dir(str(traces)))
    text = "\n".join(lines)
    assert found and "no trace from rank 3" in text
    assert "rank 2 never reached it (its last collective was broadcast #41 (float32[1024]), " \
           "completed)" in text
