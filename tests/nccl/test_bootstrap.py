"""Communicator creation through the store (cupycoll.nccl.bootstrap and the backend's use of it):
the unique id made only once everyone has arrived, or a wait for it that times out;
generations that stay in step across failed creations; and local checks before the gate.
CPU only; the real libnccl where it loads."""

from __future__ import annotations

import collections
import datetime
import gc
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

import cupycoll
from cupycoll.nccl import bootstrap as bootstrap_module
from cupycoll import bounds, config
from cupycoll.backend import CudaBackend
from cupycoll.nccl.bootstrap import ABANDONED, StoreBootstrap
from cupycoll.nccl.communicator import Communicator
from cupycoll.errors import (CollectiveTimeoutError, CommunicatorAbortedError, MissingDependencyError,
                             NoCudaDeviceError)
from workers.fault_worker import NEVER_JOINED_WORDS

CUDA = torch.device("cuda", 0)


@pytest.fixture
def counted_ids(monkeypatch):
    """new_unique_id stand-in: numbered ids, and how many were made."""
    made = []

    def new_unique_id():
        made.append(len(made))
        return bytes([len(made)]) * 128
    monkeypatch.setattr(bootstrap_module, "new_unique_id", new_unique_id)
    return made


def run_ranks(store, ranks, members, timeout):
    """Each rank (a thread) asks for the id of 'comm'; rank 0 creates. rank -> id or error."""
    results = {}

    def one(rank):
        try:
            results[rank] = StoreBootstrap(store, rank, timeout).unique_id("comm", rank == 0, members)
        except CollectiveTimeoutError as exc:
            results[rank] = exc
    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return results


def make_bootstrap(rank=0, timeout=5.0, store=None):
    """One rank's bootstrap over ``store`` (a fresh HashStore by default)."""
    return StoreBootstrap(store if store is not None else dist.HashStore(), rank, timeout)


def test_a_rank_that_never_sends_the_unique_id_times_out():
    bootstrap = make_bootstrap(rank=1, timeout=0.3)
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match="ncclUniqueId of 'comm'"):
        bootstrap.unique_id("comm", creator=False, members=2)
    assert time.monotonic() - start < 3


def test_a_rank_that_never_joins_makes_creation_time_out(monkeypatch):
    monkeypatch.setattr(bootstrap_module, "new_unique_id", lambda: b"\1" * 128)
    bootstrap = make_bootstrap(rank=0, timeout=0.3)
    with pytest.raises(CollectiveTimeoutError, match=r"all 3 ranks to join .* \(1 arrived\)"):
        bootstrap.unique_id("comm", creator=True, members=3)


def test_ranks_that_all_join_get_the_same_unique_id(monkeypatch):
    monkeypatch.setattr(bootstrap_module, "new_unique_id", lambda: b"\7" * 128)
    store = dist.HashStore()
    bootstraps = {r: make_bootstrap(rank=r, store=store) for r in range(3)}
    results = {}
    threads = [threading.Thread(target=lambda r=r, b=b: results.setdefault(
        r, b.unique_id("comm", r == 0, 3))) for r, b in bootstraps.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert results == {0: b"\7" * 128, 1: b"\7" * 128, 2: b"\7" * 128}


@pytest.mark.parametrize("present", [[0, 1], [1, 2], [0]])
def test_after_a_failed_creation_every_rank_gets_the_same_id(counted_ids, present):
    # The ranks must number the next incarnation alike, whichever of them arrived before.
    store = dist.HashStore()
    failed = run_ranks(store, present, members=3, timeout=0.3)
    assert all(isinstance(v, CollectiveTimeoutError) for v in failed.values())
    full = run_ranks(store, [0, 1, 2], members=3, timeout=10)
    assert len(set(full.values())) == 1 and isinstance(full[0], bytes) and len(full[0]) == 128
    again = run_ranks(store, [0, 1, 2], members=3, timeout=10)  # and the one after that
    assert len(set(again.values())) == 1 and again[0] != full[0]


def test_the_id_is_made_only_once_everyone_arrived(counted_ids):
    # A creation nobody joins makes no id (ncclGetUniqueId starts a thread that would leak).
    store = dist.HashStore()
    for _ in range(3):
        with pytest.raises(CollectiveTimeoutError, match=r"all 2 ranks to join .* \(1 arrived\)"):
            StoreBootstrap(store, 0, 0.1).unique_id("comm", True, 2)
    assert counted_ids == []
    assert len(set(run_ranks(store, [0, 1], members=2, timeout=10).values())) == 1
    assert counted_ids == [0]


@pytest.mark.parametrize("run", range(3))
def test_a_rank_that_never_joins_fails_the_others_in_words_the_gpu_tier_expects(counted_ids, run):
    # ranks 0 and 1 of 3; rank 2 never comes (tests/gpu/test_gpu_faults.py, never_joins)
    results = run_ranks(dist.HashStore(), [0, 1], members=3, timeout=0.3)
    for rank in (0, 1):
        error = results[rank]
        assert isinstance(error, CollectiveTimeoutError) and isinstance(error, dist.DistBackendError), error
        assert any(words in str(error) for words in NEVER_JOINED_WORDS), error
    assert counted_ids == []


def test_a_rank_that_gives_up_fails_the_whole_generation(counted_ids):
    store = dist.HashStore()
    # rank 1 arrives and gives up before the creator comes: the creator must not publish
    # an id (in blocking mode it would wait in ncclCommInitRank for rank 1 forever)
    assert isinstance(run_ranks(store, [1], members=2, timeout=0.2)[1], CollectiveTimeoutError)
    with pytest.raises(CollectiveTimeoutError):  # waiting for rank 1, which left
        StoreBootstrap(store, 0, 0.5).unique_id("comm", True, 2)
    assert counted_ids == []
    assert len(set(run_ranks(store, [0, 1], members=2, timeout=10).values())) == 1


class Wrapped:
    """A store that delegates to a HashStore; tests override one method to stage a race."""

    def __init__(self):
        self.inner = dist.HashStore()

    def __getattr__(self, name):
        return getattr(self.inner, name)


UID0 = "cupycoll/comm/0/uid"


def test_a_rank_giving_up_after_the_id_was_published_joins():
    # The wait really times out; the creator's id lands just before the rank gives up.
    store = Wrapped()

    def compare_set(key, expected, desired):
        if key == UID0 and desired == ABANDONED:
            store.inner.set(UID0, b"\5" * 128)  # published just before the rank gives up
        return store.inner.compare_set(key, expected, desired)
    store.compare_set = compare_set
    start = time.monotonic()
    assert StoreBootstrap(store, 1, 0.2).unique_id("comm", False, 2) == b"\5" * 128
    assert time.monotonic() - start >= 0.2  # it went through the timeout, then joined


@pytest.mark.parametrize("error", [CommunicatorAbortedError("aborted"), KeyboardInterrupt()])
def test_an_abort_never_joins_even_when_the_id_was_published(error):
    # Only a timeout may fall through to "join": an abort or ^C must reach the caller.
    store = Wrapped()
    store.inner.set(UID0, b"\5" * 128)
    store.check = lambda keys: False if keys == [UID0] else store.inner.check(keys)

    def check():
        raise error
    with pytest.raises(type(error)):
        StoreBootstrap(store, 1, 5, check=check).unique_id("comm", False, 2)


def test_a_lost_generation_bump_never_reuses_the_old_id(counted_ids):
    # The creator published the id of generation 0 and died before moving the generation.
    store = dist.HashStore()
    store.set(UID0, b"\5" * 128)
    store.add("cupycoll/comm/0/arrived", 2)
    got = run_ranks(store, [0, 1], members=2, timeout=10)
    assert got[0] == got[1] == bytes([1]) * 128 and counted_ids == [0]


def test_losing_the_decision_to_a_rank_that_gave_up_makes_no_id(counted_ids):
    # A member writes ABANDONED between the creator's arrival wait and its decision.
    store = Wrapped()
    store.add("cupycoll/comm/0/arrived", 1)  # the member arrived

    def compare_set(key, expected, desired):
        if key == UID0 and desired != ABANDONED:
            store.inner.compare_set(UID0, "", ABANDONED)
        return store.inner.compare_set(key, expected, desired)
    store.compare_set = compare_set
    with pytest.raises(CollectiveTimeoutError, match="another rank gave up"):
        StoreBootstrap(store, 0, 5).unique_id("comm", True, 2)
    assert counted_ids == []


def test_a_creation_leaves_no_key_in_the_store(counted_ids):
    store = dist.HashStore()
    made = []
    for _ in range(8):
        ids = set(run_ranks(store, [0, 1], members=2, timeout=10).values())
        assert len(ids) == 1 and ids.isdisjoint(made)  # each creation its own id
        made.extend(ids)
        assert store.num_keys() == 0  # the last rank to read the id deleted every key
    failed = run_ranks(store, [0], members=2, timeout=0.2)  # a failed creation leaves its keys ...
    assert isinstance(failed[0], CollectiveTimeoutError) and store.num_keys() > 0
    assert len(set(run_ranks(store, [0, 1], members=2, timeout=10).values())) == 1
    assert store.num_keys() == 0  # ... which the next one deletes


def _arrive(store, ranks, members, timeout=10, check=lambda: None):
    """Each of ``ranks`` (a thread) arrives at "shrink"; rank -> None or the error raised."""
    outcome = {}

    def one(rank):
        try:
            StoreBootstrap(store, rank, timeout, lambda: "g", check).all_arrive(
                "shrink", members, lambda missing: f"missing {missing}")
            outcome[rank] = None
        except Exception as exc:  # noqa: BLE001 - returned
            outcome[rank] = exc
    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return outcome


def test_all_arrive_returns_once_all_are_there_and_leaves_no_keys():
    store = dist.HashStore()
    assert _arrive(store, [0, 1, 2], 3) == {0: None, 1: None, 2: None}
    assert store.num_keys() == 0


def test_all_arrive_names_the_ranks_that_never_came_and_leaves_none_of_its_keys():
    store = dist.HashStore()
    started = time.monotonic()
    outcome = _arrive(store, [0, 2], 4, timeout=0.3)
    assert time.monotonic() - started < 5
    for rank in (0, 2):
        assert isinstance(outcome[rank], CollectiveTimeoutError), outcome
        assert "timed out after 0.3 s waiting for all 4 ranks at 'shrink' (missing [1, 3])" in str(outcome[rank])
    assert store.num_keys() == 0  # a later gathering under the same name starts afresh
    assert _arrive(store, [0, 1], 2) == {0: None, 1: None}


def test_all_arrive_ends_when_its_owner_is_aborted():
    aborted = threading.Event()

    def check():
        if aborted.is_set():
            raise CommunicatorAbortedError("process group 'g' was aborted")
    threading.Timer(0.2, aborted.set).start()
    started = time.monotonic()
    outcome = _arrive(dist.HashStore(), [0], 2, timeout=30, check=check)
    assert isinstance(outcome[0], CommunicatorAbortedError) and time.monotonic() - started < 5


def _agree(store, answers, key, timeout=10):
    """Each rank (a thread) tells ``answers[rank]`` to the question ``key``; rank -> verdict."""
    verdicts = {}

    def one(rank):
        verdicts[rank] = StoreBootstrap(store, rank, timeout).all_agree(key, answers[rank], len(answers))
    threads = [threading.Thread(target=one, args=(r,)) for r in range(len(answers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return verdicts


def test_all_agree_is_yes_only_when_every_rank_says_yes_and_leaves_no_keys():
    store = dist.HashStore()
    assert _agree(store, [True, True, True], "q0") == {0: True, 1: True, 2: True}
    assert _agree(store, [True, False, True], "q1") == {0: False, 1: False, 2: False}
    for question in range(2, 52):  # a long job's many shrinks: the store does not grow
        _agree(store, [True, True], f"q{question}")
    assert store.num_keys() == 0


def test_all_agree_times_out_when_a_rank_never_tells():
    with pytest.raises(CollectiveTimeoutError, match="all 3 ranks to answer 'q'"):
        StoreBootstrap(dist.HashStore(), 0, 0.3).all_agree("q", True, 3)


def test_failed_creations_leave_threads_and_fds_flat():
    # The same with the real NCCL: each ncclGetUniqueId starts a bootstrap-root thread and socket.
    from cupycoll import _cuda
    from cupycoll.errors import MissingDependencyError

    try:
        _cuda.nccl_module()
    except MissingDependencyError as exc:
        pytest.skip(str(exc))

    def counts():
        return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))
    store = dist.HashStore()
    gc.collect()  # what earlier tests left for the collector must not close mid-count
    before = counts()
    for _ in range(5):
        with pytest.raises(CollectiveTimeoutError):
            StoreBootstrap(store, 0, 0.05).unique_id("comm", True, 2)
    gc.collect()
    after = counts()
    # a leak only adds (5 creations: 5 threads and sockets); another test's daemon thread
    # ending meanwhile may take one away
    assert after[0] <= before[0] and after[1] <= before[1], (before, after)


def test_local_failures_raise_before_the_store_gate(monkeypatch, cuda_standins):
    # Local checks come first: a rank that failed after arriving would leave its peers inside
    # blocking ncclCommInitRank.
    cuda_standins.devices = 0  # no CUDA device is visible
    monkeypatch.setattr(Communicator, "begin", classmethod(lambda cls, *a, **k: pytest.fail("began")))
    store = dist.HashStore()
    backend = CudaBackend(store, 1, 2, config.resolve(None, datetime.timedelta(seconds=5)))
    with pytest.raises(NoCudaDeviceError):
        backend.comm_for(CUDA)
    backend.device = CUDA
    with pytest.raises(NoCudaDeviceError):
        backend.p2p_comm(0)
    assert not store.check(["cupycoll/comm/0/arrived"]) and not store.check(["cupycoll/p2p/0-1/0/arrived"])
    assert backend.state == "ok"  # nothing was shared: no peer is stuck on this rank


@pytest.mark.parametrize("nonblocking", [False, True])
def test_an_nccl_library_that_cannot_load_fails_before_the_gate_in_both_modes(monkeypatch, tmp_path, nonblocking):
    monkeypatch.setattr(Communicator, "begin", classmethod(lambda cls, *a, **k: pytest.fail("began")))
    store = dist.HashStore()
    missing = str(tmp_path / "libnccl.so.2")
    settings = config.resolve(cupycoll.Options(nonblocking=nonblocking), datetime.timedelta(seconds=5),
                              {"CUPYCOLL_NCCL_LIBRARY": missing})
    backend = CudaBackend(store, 1, 2, settings)
    with pytest.raises(MissingDependencyError, match="libnccl.so.2"):
        backend.comm_for(CUDA)
    assert not store.check(["cupycoll/comm/0/arrived"]) and backend.state == "ok"


def test_nccl_comm_blocking_is_checked_before_the_gate(monkeypatch):
    monkeypatch.setenv("NCCL_COMM_BLOCKING", "0")
    with pytest.raises(ValueError, match="NCCL_COMM_BLOCKING=0"):
        Communicator.preflight(0, None, nonblocking=False)


def test_a_creation_that_times_out_faults_the_group(monkeypatch):
    store = dist.HashStore()
    backend = CudaBackend(store, 1, 2, config.resolve(None, datetime.timedelta(seconds=0.2)))
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError):
        backend.comm_for(CUDA)
    assert backend.life.ended.wait(3)
    assert backend.state == "aborted" and time.monotonic() - start < 3


class Counting:
    """A store that counts its calls by name (one Counter per rank using it)."""

    def __init__(self, inner, tally):
        self.inner, self.tally = inner, tally

    def __getattr__(self, name):
        def call(*args, **kwargs):
            self.tally[name] += 1
            return getattr(self.inner, name)(*args, **kwargs)
        return call


def _counted_creation(members, delays):
    """Each rank (a thread) creates 'comm' after its delay; per rank, its store calls by name."""
    store = dist.HashStore()
    tallies = [collections.Counter() for _ in range(members)]
    ids = {}

    def one(rank):
        time.sleep(delays[rank])
        ids[rank] = StoreBootstrap(Counting(store, tallies[rank]), rank, 30).unique_id("comm", rank == 0, members)
    threads = [threading.Thread(target=one, args=(r,)) for r in range(members)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(set(ids.values())) == 1 and len(ids) == members
    assert store.num_keys() == 0
    return tallies


@pytest.mark.parametrize("late", ["creator", "another rank"])
def test_a_communicator_costs_each_rank_at_most_four_store_calls_whatever_the_skew(counted_ids, late):
    # The waits are the store's (one call per slice), never a poll: a rank waiting 2.5 s for
    # the last one makes a call per second it waits, and every rank makes at most 4 others
    # (the last one out deletes the 3 keys besides).
    members, slow = 16, 0 if late == "creator" else 11
    tallies = _counted_creation(members, [2.5 if r == slow else 0.0 for r in range(members)])
    for rank, tally in enumerate(tallies):
        others = sum(n for name, n in tally.items() if name not in ("wait", "delete_key"))
        assert others <= 4, (rank, tally)
        assert tally["wait"] <= 2.5 / bounds.STORE_WAIT_S + 1, (rank, tally)
    assert sum(t["delete_key"] for t in tallies) == 3
    # Arriving within one slice of each other, no rank makes more than 4 calls in all.
    tallies = _counted_creation(members, [0.05 * (r % 5) for r in range(members)])
    assert max(sum(n for name, n in t.items() if name != "delete_key") for t in tallies) <= 4, tallies


def test_a_generation_the_store_holds_as_junk_is_a_typed_error_naming_it():
    store = dist.HashStore()
    store.add("cupycoll/comm/0/arrived", 5)  # generation 0 was taken: the rank looks up the next
    store.set("cupycoll/comm/generation", "x9")
    with pytest.raises(cupycoll.CupycollValueError, match=r"'cupycoll/comm/generation' holds 'x9'"):
        StoreBootstrap(store, 1, 1).unique_id("comm", False, 2)
