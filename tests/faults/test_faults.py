"""Faults as pure logic on CPU, driven by real threads: the watchdog and Work state machine,
group abort (from another thread, during init), timeouts of communicator creation, and the
nonblocking polling loop. Stand-ins replace CUDA events and NCCL communicators; the GPU tier
(tests/gpu/test_gpu_faults.py) proves the same behaviour with real ones."""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import subprocess
import sys
import textwrap
import threading
import time
import types
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

import cupycoll
from cupycoll.nccl import bootstrap as bootstrap_module
from cupycoll.nccl import communicator as communicator_module
from cupycoll import config
from cupycoll.nccl import bindings as nb
from cupycoll.backend import CudaBackend
from cupycoll.nccl.bootstrap import StoreBootstrap
from cupycoll.nccl.communicator import Communicator
from cupycoll.errors import CollectiveTimeoutError, CommunicatorAbortedError, CupycollError, NcclError
from cupycoll.backend import describe_batch
from cupycoll.faults.watchdog import TERMINATE_EXIT_CODE, Finding, InFlight, Watch, Watchdog
from cupycoll.nccl.communicator import Communicators
from cupycoll.work import CudaWork
from standins import CUDA, CpuAsCudaGroup, FakeEvent


class CountedEvent(FakeEvent):
    """An event whose ``done`` the test sets, counting its queries."""

    def __init__(self, done=True):
        super().__init__()
        self.done, self.queries = done, 0

    def query(self):
        self.queries += 1
        return self.done


class FakeComm:
    """A communicator stand-in with what a group's watch and lifetime ask of one."""

    nonblocking = False
    stream = rank = 0

    def __init__(self):
        self.aborted = threading.Event()
        self.abort_done = threading.Event()
        self.error = None
        self.stuck = None  # (NCCL function, seconds) of a call stuck inside NCCL
        self.fences = 0
        self.state = "ok"

    def async_error(self):
        return self.error

    def stuck_call(self, after_s, now=None, child=None):
        if child is not None or self.ended:  # its abort ended any call inside it
            return None
        return self.stuck if self.stuck is not None and self.stuck[1] > after_s else None

    @property
    def ended(self):
        return self.state in ("aborted", "shut down")

    def abort_deferred(self):
        return False

    def blocked(self, after_s=None):
        return False

    def abort(self, on_behalf_of=None):
        self.state = "aborted"
        self.aborted.set()
        self.abort_done.set()

    def shutdown(self, timeout=None):
        self.state = "shut down"
        self.abort_done.set()


def holding(*comms):
    """A group's Communicators holding ``comms`` as pair communicators (peers 1, 2, ...)."""
    held = Communicators()
    held.pairs = {peer: comm for peer, comm in enumerate(comms, start=1)}
    return held


def recorder_entry(seq=1, op="all_reduce", shapes=((4,),), dtypes=(torch.float32,)):
    """A flight-recorder entry as the group records a call (cupycoll.trace.recorder)."""
    now = time.monotonic()
    return [seq, False, op, tuple(torch.Size(s) for s in shapes), tuple(dtypes), None, "nccl", "issued",
            now, now, None]


def make_watch(name="g", timeout=5.0, comms=None):
    """A group's watch as the backend makes it: batches named by their recorder entries."""
    return Watch(name, timeout, comms, describe=describe_batch)


def issued_work(watch, seq=1, shape=(4,), op="all_reduce", keepalive=None, event=None, stream=0):
    """A call issued as one batch in flight in ``watch`` on ``stream``, its event a stand-in
    the test fires: (its Work, the event). ``keepalive``: what it holds for the GPU (default:
    its tensor, as an asynchronous call)."""
    tensor = torch.ones(*shape)
    event = event if event is not None else FakeEvent()
    spare = InFlight(event)
    watch._free.append(spare)
    slot = watch.issued(stream, recorder_entry(seq, op, (shape,)), tensor if keepalive is None else keepalive)
    assert slot is spare
    work = CudaWork(op, CUDA, [tensor], watch, seq=seq)
    work._issued(slot, stream, True)
    return work, event


def poll(watch, now=None):
    """One pass of ``watch``, and what its group's lifetime does with a finding before the
    abort: the watch closes with the fault (every batch in flight failed). The fault, or None."""
    finding = watch.check(now)
    if finding is None:
        return None
    watch.close(finding.fault)
    return finding.fault


def fault_group(group, fault, batch=None, stuck=None, timeout=10.0):
    """``fault`` found in ``group`` (as the watchdog finds one): claimed, explained and ended
    on the fault thread; returns once the end is done."""
    assert group._cuda.life.claim(Finding(fault, batch, stuck))
    assert group._cuda.life.ended.wait(timeout)


def eventually(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


# -- the watch: one group's calls in flight ---------------------------------------------


def test_completed_works_leave_the_watch_and_release_their_tensors():
    watch = make_watch()
    works = [issued_work(watch, seq=i) for i in range(3)]
    works[0][1].fired.set()
    works[1][1].fired.set()
    assert poll(watch) is None
    assert watch.in_flight() == 1 and works[2][0]._in_flight() is not None
    tensor = weakref.ref(works[0][0]._outputs[0])
    del works[0]
    assert tensor() is None  # only the user's Work held it, and that is gone
    works[-1][1].fired.set()
    poll(watch)
    assert not watch.in_flight()


def test_a_stream_is_retired_by_its_newest_event_and_a_search_not_one_query_per_call():
    # Calls on one stream finish in order: a pass asks the newest event first, and only when
    # it has not fired searches for the last one that has (a few queries, not one per call).
    watch = make_watch()
    events = [CountedEvent(done=i < 50) for i in range(64)]
    for i, event in enumerate(events):
        issued_work(watch, seq=i, event=event)
    assert poll(watch) is None and watch.in_flight() == 14
    assert sum(e.queries for e in events) <= 8  # newest, then a binary search of 64
    for event in events:
        event.done = True
    poll(watch)
    assert watch.in_flight() == 0 and sum(e.queries for e in events) <= 9


def test_a_work_older_than_the_timeout_is_a_fault_naming_the_collective():
    watch = make_watch("trainers", timeout=0.05)
    done, done_event = issued_work(watch, seq=1)
    stuck, _ = issued_work(watch, seq=7, shape=(2, 3), op="reduce_scatter_tensor", stream=1)
    done_event.fired.set()
    issued_at = stuck._slot.issued_at
    # the clock is passed in: a stall of this thread must not age the Works early
    assert watch.check(now=issued_at + 0.04) is None  # not old yet
    finding = watch.check(now=issued_at + 0.06)
    fault = finding.fault
    assert isinstance(fault, CollectiveTimeoutError) and finding.batch is stuck._slot
    message = str(fault)
    assert "'trainers'" in message and "reduce_scatter_tensor #7" in message and "float32[2, 3]" in message
    watch.close(fault)
    # the stuck Work is failed: every way of looking at it shows the fault
    with pytest.raises(CollectiveTimeoutError, match="reduce_scatter_tensor #7"):
        stuck.wait()
    assert stuck.exception() is fault and stuck.is_completed() and not stuck.is_success()
    # the future fails as C++ callers (DDP's reducer) can see it: a RuntimeError with its text
    with pytest.raises(RuntimeError, match="CollectiveTimeoutError: .*reduce_scatter_tensor #7"):
        stuck.get_future().wait()
    with pytest.raises(CollectiveTimeoutError):
        stuck.result()
    assert done.is_success()  # done before the fault: a success
    watch.release()  # the abort returned: the tensors go
    assert stuck._slot.keepalive is None and not watch.in_flight()
    assert watch.check() is None  # a fault is reported once


def test_an_async_nccl_error_is_a_fault():
    comm = FakeComm()
    watch = make_watch(timeout=60, comms=holding(comm))
    work, _ = issued_work(watch)
    assert poll(watch) is None
    comm.error = NcclError(6, "ncclCommGetAsyncError", "", "peer closed the connection")
    fault = poll(watch)
    assert isinstance(fault, NcclError) and fault.status_name == "ncclRemoteError"
    assert "peer closed the connection" in str(fault)
    with pytest.raises(NcclError):
        work.wait()


def test_a_call_inside_nccl_past_the_timeout_is_a_timeout_fault_naming_the_call():
    comm = FakeComm()
    group = make_group()
    cuda = group._cuda
    cuda.comm = comm
    explained = []
    cuda.life._explain = lambda entry, timeout_s: explained.append(entry) or "all_reduce #3 timed out; rank 1 is behind"
    comm.stuck = ("ncclAllReduce", 4.0)  # not yet past the timeout (5 s)
    assert cuda.watch.check() is None
    comm.stuck = ("ncclAllReduce", 7.2)
    finding = cuda.watch.check()
    assert isinstance(finding.fault, CollectiveTimeoutError) and finding.batch is None
    cuda.life.claim(finding)
    assert cuda.life.ended.wait(5)
    assert explained == [None]  # no batch exists yet: the diagnosis explains the call being issued
    assert str(cuda.fault) == ("all_reduce #3 timed out; rank 1 is behind (ncclAllReduce has been inside NCCL for 7.2 s: "
                               "a peer has not made this call (a blocking communicator connects inside it, and a split "
                               "waits there for every rank), or the GPU's launch queue is full behind a stuck kernel)")


class Polled:
    """What the watchdog thread polls (a lifetime's face): a watch whose first finding is kept."""

    policy = "raise"

    def __init__(self, watch, interval=0.01):
        self.watch, self.interval, self.name = watch, interval, watch.name
        self.found = threading.Event()
        self.fault = None

    def poll(self, now):
        if self.fault is None:
            self.fault = poll(self.watch, now)
            if self.fault is not None:
                self.found.set()


def test_the_watchdog_thread_finds_a_stuck_work_and_then_exits():
    watchdog = Watchdog()
    watch = make_watch(timeout=0.1)
    polled = Polled(watch)
    start = time.monotonic()  # before the issue: the watchdog ages the batch from there
    work, _ = issued_work(watch)
    watchdog.watch(polled)
    assert polled.found.wait(5)
    assert 0.1 <= time.monotonic() - start < 2
    watchdog.unwatch(polled)
    assert eventually(lambda: not watchdog.running)  # nothing left to watch
    assert isinstance(work.exception(), CollectiveTimeoutError)


def test_watchdog_threads_do_not_accumulate():
    watchdog = Watchdog()
    before = threading.active_count()
    for _ in range(50):
        polled = Polled(make_watch(timeout=60), interval=0.001)
        watchdog.watch(polled)
        watchdog.unwatch(polled)
        del polled
    assert eventually(lambda: not watchdog.running)
    # the monitor lets go of its thread just before that thread returns
    assert eventually(lambda: threading.active_count() <= before)


def test_terminate_policy_ends_the_process(tmp_path):
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
        import standins
        from test_faults import FakeComm, issued_work, make_group
        from cupycoll import config
        import datetime
        group = standins.CpuAsCudaGroup(None, 0, 2, datetime.timedelta(seconds=0.05),
                                        config.Options(on_timeout="terminate", watchdog_interval=0.01))
        group._cuda.comm = FakeComm()
        issued_work(group._cuda.watch, seq=3)
        group._cuda.life.watching()
        time.sleep(10)
        print("still alive")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == TERMINATE_EXIT_CODE, result.stderr
    assert "terminating the process" in result.stderr and "all_reduce #3" in result.stderr
    assert "still alive" not in result.stdout


# -- the group: fault, abort, init timeouts -------------------------------------------


def make_group(rank=0, size=2, timeout=5.0, store=None):
    return CpuAsCudaGroup(store if store is not None else dist.HashStore(), rank, size,
                          datetime.timedelta(seconds=timeout))


def make_backend(rank=0, size=2, timeout=5.0, store=None):
    """A CUDA backend on its own: the bootstrap needs no ProcessGroup."""
    settings = config.resolve(None, datetime.timedelta(seconds=timeout))
    return CudaBackend(store if store is not None else dist.HashStore(), rank, size, settings,
                       name=lambda: "bootstrap")


def make_bootstrap(rank=0, timeout=5.0, store=None):
    return StoreBootstrap(store if store is not None else dist.HashStore(), rank, timeout)


def test_a_fault_aborts_the_communicators_and_every_later_call_raises():
    group = make_group()
    comm = FakeComm()
    group._cuda.comm = comm
    work, _ = issued_work(group._cuda.watch, seq=4)
    fault = CollectiveTimeoutError("all_reduce #4 did not complete")
    fault_group(group, fault)
    assert comm.aborted.is_set() and group._cuda.state == "aborted"
    assert work.exception() is fault
    with pytest.raises(CommunicatorAbortedError, match="was aborted: all_reduce #4 did not complete"):
        group.allreduce([torch.ones(2)], c10d.AllreduceOptions())
    with pytest.raises(CommunicatorAbortedError):
        group.barrier(c10d.BarrierOptions())


def test_abort_from_another_thread_fails_the_works_in_flight():
    group = make_group()
    comm = FakeComm()
    group._cuda.comm = comm
    work, _ = issued_work(group._cuda.watch)
    thread = threading.Thread(target=group.abort)
    thread.start()
    thread.join(5)
    assert comm.aborted.is_set()
    with pytest.raises(CommunicatorAbortedError, match="was aborted"):
        work.wait()


def test_abort_all_reaches_every_live_group():
    groups = [make_group(), make_group()]
    comms = [FakeComm(), FakeComm()]
    for group, comm in zip(groups, comms):
        group._cuda.comm = comm
    assert cupycoll.abort_all() >= 2
    assert all(c.aborted.is_set() for c in comms)
    assert all(g._cuda.state == "aborted" for g in groups)


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


def test_abort_ends_a_wait_for_peers_during_init():
    backend = make_backend(rank=1, timeout=60)
    errors = []

    def create():
        try:
            backend._bootstrap.unique_id("comm", creator=False, members=2)
        except CupycollError as exc:
            errors.append(exc)

    thread = threading.Thread(target=create)
    thread.start()
    time.sleep(0.2)
    start = time.monotonic()
    backend.abort()
    thread.join(5)
    assert not thread.is_alive() and time.monotonic() - start < 2
    assert isinstance(errors[0], CommunicatorAbortedError)


def test_abort_reaches_a_communicator_still_connecting(monkeypatch):
    class Connecting(FakeComm):
        def wait_ready(self):
            if not self.aborted.wait(30):
                raise AssertionError("never aborted")
            raise CommunicatorAbortedError("aborted while connecting")

    pending = Connecting()
    monkeypatch.setattr(Communicator, "begin", classmethod(lambda cls, *a, **k: pending))
    group = make_group()
    errors = []

    def create():
        try:
            group._cuda._create_comm(b"\0" * 128, 0, 2, 0)
        except CupycollError as exc:
            errors.append(exc)

    thread = threading.Thread(target=create)
    thread.start()
    assert eventually(lambda: group._cuda.comms.pending == [pending])
    group.abort()
    thread.join(5)
    assert pending.aborted.is_set() and isinstance(errors[0], CommunicatorAbortedError)
    assert group._cuda.comms.pending == []


# -- nonblocking polling (the communicator's loop, with a scripted NCCL) -----------------


class ScriptedLibrary:
    """ncclCommGetAsyncError answers from a script; abort is recorded."""

    def __init__(self, states):
        self.states = list(states)
        self.aborts = 0

    def ncclCommGetAsyncError(self, comm, status_ref):
        status = self.states.pop(0) if len(self.states) > 1 else self.states[0]
        ctypes.cast(status_ref, ctypes.POINTER(ctypes.c_int)).contents.value = status
        return 0

    def ncclCommAbort(self, comm):
        self.aborts += 1
        return 0

    def error_string(self, status):
        return "remote process exited"

    def last_error(self):
        return "socket closed"


def polling_comm(states, timeout=5.0):
    comm = Communicator.__new__(Communicator)
    comm._handle = 1234
    comm.nonblocking = True
    comm._lib = ScriptedLibrary(states)
    comm.device, comm.rank, comm.size = 0, 0, 2
    comm.timeout = timeout
    comm.state = "ok"
    comm._init_guard()
    return comm


@pytest.fixture
def no_device(monkeypatch):
    class Device:
        def __init__(self, index):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class Cuda:
        pass

    class FakeCupy:
        cuda = Cuda()

    FakeCupy.cuda.Device = Device
    monkeypatch.setattr(communicator_module._cuda, "cupy_module", lambda: FakeCupy)


def test_in_progress_is_polled_until_success():
    comm = polling_comm([nb.ncclInProgress] * 5 + [nb.ncclSuccess])
    comm._poll("ncclAllReduce")
    assert comm._lib.states == [nb.ncclSuccess] and comm.state == "ok"


def test_an_error_while_polling_raises_with_the_function_and_aborts(no_device):
    comm = polling_comm([nb.ncclInProgress, 6])
    with pytest.raises(NcclError, match="ncclAllReduce failed: ncclRemoteError") as info:
        comm._poll("ncclAllReduce")
    assert info.value.last_error == "socket closed" and comm._lib.aborts == 1 and comm.state == "aborted"


def test_polling_past_the_timeout_aborts(no_device):
    comm = polling_comm([nb.ncclInProgress], timeout=0.1)
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match="ncclCommInitRankConfig .* within 0.1 s"):
        comm._poll("ncclCommInitRankConfig")
    assert time.monotonic() - start < 2 and comm._lib.aborts == 1 and comm.state == "aborted"


def test_abort_from_another_thread_ends_polling(no_device):
    comm = polling_comm([nb.ncclInProgress], timeout=60)
    errors = []
    thread = threading.Thread(target=lambda: errors.append(pytest.raises(
        CommunicatorAbortedError, comm._poll, "ncclCommInitRankConfig")))
    thread.start()
    time.sleep(0.1)
    start = time.monotonic()
    assert comm.abort() == 0
    thread.join(5)
    assert not thread.is_alive() and time.monotonic() - start < 2 and errors
    assert comm.abort() is None  # idempotent: nothing left to abort


def test_calls_inside_a_group_are_polled_when_the_outermost_group_ends(monkeypatch):
    events = []

    class GroupLibrary:
        def ncclGroupStart(self):
            events.append("start")
            return 0

        def ncclGroupEnd(self):
            events.append("end")
            return nb.ncclInProgress

    first, second = polling_comm([nb.ncclSuccess]), polling_comm([nb.ncclSuccess])
    for comm in (first, second):
        comm._lib = GroupLibrary()
        comm._poll = lambda function, timeout=None, comm=comm: events.append(("poll", comm, function))
    with first.group():
        first._settle("ncclSend", nb.ncclSuccess)
        with second.group():
            second._settle("ncclRecv", nb.ncclSuccess)
            first._settle("ncclRecv", nb.ncclSuccess)
        assert events == ["start", "start", "end"]  # the inner end settles nothing
    assert events == ["start", "start", "end", "end",
                      ("poll", first, "ncclGroupEnd"), ("poll", second, "ncclGroupEnd")]
    # outside a group, a call that returned ncclInProgress is polled at once
    first._settle("ncclAllReduce", nb.ncclInProgress)
    assert events[-1] == ("poll", first, "ncclAllReduce")


def test_an_nccl_group_never_looks_the_library_up_again(monkeypatch):
    # A group is ncclGroupStart/End of the library the communicator already holds: finding
    # the library again (mapped libraries, the pip package, dlopen) costs ~200 us per group.
    pytest.importorskip("cupy.cuda.nccl")

    class Stream:
        ptr = 0

        def __init__(self, non_blocking=False):
            pass

    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(Device=lambda index: contextlib.nullcontext(),
                                                            Stream=Stream))
    monkeypatch.setattr(communicator_module._cuda, "cupy_module", lambda: cupy)
    comm = Communicator(0, 0, 1, handle=0, timeout=60.0)  # no NCCL comm is touched
    lookups = []

    def find_library(path=None):
        lookups.append(path)
        raise AssertionError("the NCCL library was looked up again")

    monkeypatch.setattr(nb, "find_library", find_library)
    for _ in range(3):
        with comm.group():  # ncclGroupStart/End need no GPU
            with comm.group():
                pass
    assert lookups == []
    assert nb.load(None) is comm._lib  # a path asked for before is not resolved again


# -- communicator faults reach the group ---------------------------------------------


def test_a_communicator_that_aborts_itself_faults_its_group(monkeypatch, no_device):
    # A nonblocking poll that times out aborts the communicator, and the group with it:
    # else the Works in flight would later "succeed" and the on_timeout policy never run.
    made = []

    def begin(cls, unique_id, rank, size, device, library, nonblocking, timeout, on_abort):
        comm = polling_comm([nb.ncclInProgress], timeout=0.05)
        comm.on_abort = on_abort
        made.append(comm)
        return comm
    monkeypatch.setattr(Communicator, "begin", classmethod(begin))
    group = make_group()
    group._cuda.comm = group._cuda._create_comm(b"\0" * 128, 0, 2, 0)
    work, _ = issued_work(group._cuda.watch, seq=3)
    with pytest.raises(CollectiveTimeoutError) as info:
        made[0]._poll("ncclAllReduce")
    assert work.exception() is info.value  # failed when the poll's error reached the group
    assert group._cuda.life.ended.wait(5)
    assert group._cuda.state == "aborted" and group._cuda.fault is info.value
    assert work.exception() is info.value and made[0]._lib.aborts == 1
    with pytest.raises(CommunicatorAbortedError, match="did not complete within 0.05 s"):
        group.allreduce([torch.ones(2)], c10d.AllreduceOptions())


@pytest.mark.parametrize("where", ["poll", "nccl group"])
def test_a_communicator_that_aborts_itself_fails_the_works_before_ncclcommabort(monkeypatch, no_device, where):
    # The kernels end at ncclCommAbort: a Work still "in flight" then would read as a success.
    seen_at_abort = []
    group = make_group()
    work, _ = issued_work(group._cuda.watch, seq=3)

    class Recording(ScriptedLibrary):
        def ncclCommAbort(self, comm):
            seen_at_abort.append((work.is_completed(), work.exception()))
            return super().ncclCommAbort(comm)

        def ncclGroupStart(self):
            return 0

        def ncclGroupEnd(self):
            return 0

    comm = polling_comm([nb.ncclInProgress], timeout=0.05)
    comm._lib = Recording([nb.ncclInProgress])
    comm.on_abort = group._cuda.life.fault_once
    group._cuda.comm = comm
    with pytest.raises((CollectiveTimeoutError, MemoryError)):
        if where == "poll":
            comm._poll("ncclAllReduce")
        else:
            with comm.group():
                comm._settle("ncclSend", nb.ncclSuccess)
                raise MemoryError("staging")
    assert group._cuda.life.ended.wait(5)
    assert len(seen_at_abort) == 1, seen_at_abort  # aborted once, by the group
    completed, error = seen_at_abort[0]
    assert completed and error is group._cuda.fault is not None
    assert comm.state == "aborted" and group._cuda.state == "aborted"
    assert not work.is_success()


def grouping_comm(at_group_end=None):
    """A communicator whose library records ``ncclGroupStart``/``End`` and ``ncclCommAbort``
    in order; (communicator, the list they are recorded in). ``at_group_end()`` runs inside
    ``ncclGroupEnd``, before it is recorded."""
    events = []

    class GroupLibrary(ScriptedLibrary):
        def ncclGroupStart(self):
            events.append("start")
            return 0

        def ncclGroupEnd(self):
            if at_group_end is not None:
                at_group_end()
            events.append("end")
            return 0

        def ncclCommAbort(self, comm):
            events.append("abort")
            return 0

    comm = polling_comm([nb.ncclSuccess])
    comm._lib = GroupLibrary([nb.ncclSuccess])
    return comm, events


def test_a_python_error_inside_an_nccl_group_aborts_its_communicators(no_device):
    # ncclGroupEnd launches the calls enqueued before the error, a batch the peers' full
    # one no longer matches: the communicator must be aborted and its owner told.
    told = []
    comm, events = grouping_comm()
    comm.on_abort = told.append
    staging = torch.ones(4)
    with pytest.raises(MemoryError):
        with comm.group():
            comm._settle("ncclSend", nb.ncclSuccess)
            with comm.group():
                raise MemoryError("staging")
    assert events == ["start", "start", "end", "end", "abort"]
    assert comm.state == "aborted" and isinstance(told[0], MemoryError) and staging.sum() == 4
    # a healthy group afterwards polls, aborts nothing
    other, other_events = grouping_comm()
    with other.group():
        other._settle("ncclSend", nb.ncclSuccess)
    assert other.state == "ok" and other_events == ["start", "end"]


def test_a_batch_that_raises_mid_group_faults_the_group(monkeypatch, no_device):
    group = make_group()
    comm = polling_comm([nb.ncclSuccess])
    comm._lib = type("Lib", (ScriptedLibrary,), {"ncclGroupStart": lambda self: 0,
                                                  "ncclGroupEnd": lambda self: 0})([nb.ncclSuccess])
    comm.on_abort = group._cuda.life.fault_once
    group._cuda.comm = comm
    group._cuda.device = CUDA

    def first(c, stream, peer):
        c._settle("ncclSend", nb.ncclSuccess)

    def second(c, stream, peer):
        raise torch.OutOfMemoryError("staging")
    from cupycoll.call_queue import Issue
    watch = group._cuda.watch
    issues = [Issue(CudaWork("send", CUDA, [], watch), first, None, None, True, peer=1),
              Issue(CudaWork("recv", CUDA, [], watch), second, None, None, True, peer=1)]
    with pytest.raises(torch.OutOfMemoryError):
        group._cuda._launch_all(issues, {1: comm}, 0)
    assert group._cuda.life.ended.wait(5)
    assert comm.state == "aborted" and group._cuda.state == "aborted"
    assert isinstance(group._cuda.fault, torch.OutOfMemoryError)


def test_calls_after_an_abort_name_the_abort(no_device):
    # The handle is gone after an abort, and NCCL would answer ncclInvalidArgument: the
    # call is refused first, naming the abort, in either mode.
    class Library(ScriptedLibrary):
        def ncclAllReduce(self, *args):
            raise AssertionError("reached NCCL")
    comm = polling_comm([nb.ncclSuccess])
    comm._lib, comm.nonblocking = Library([nb.ncclSuccess]), False
    comm.abort()
    assert comm.state == "aborted" and comm._lib.aborts == 1
    with pytest.raises(CommunicatorAbortedError, match="was aborted"):
        comm.all_reduce(1, 1, 1, 7, 0, 0)
    group = make_group()
    group.abort()
    opts = c10d.BarrierOptions()
    opts.device_ids = [0]
    with pytest.raises(CommunicatorAbortedError, match="was aborted"):
        group.barrier(opts)


def test_a_hung_abort_does_not_stall_async_error(no_device):
    # ncclCommAbort runs outside the communicator's lock: under it, a hung abort would
    # block the watchdog in async_error() on that lock, blinding every group it watches.
    release = threading.Event()

    class HangingAbort(ScriptedLibrary):
        def ncclCommAbort(self, comm):
            self.aborts += 1
            release.wait(10)
            return 0

    comm = polling_comm([nb.ncclSuccess])
    comm._lib = HangingAbort([nb.ncclSuccess])
    aborter = threading.Thread(target=comm.abort, daemon=True)
    aborter.start()
    try:
        assert eventually(lambda: comm._lib.aborts == 1)
        answers = []
        query = threading.Thread(target=lambda: answers.append(comm.async_error()), daemon=True)
        start = time.monotonic()
        query.start()
        query.join(2)
        assert not query.is_alive() and answers == [None] and time.monotonic() - start < 2
        assert comm.abort() is None and comm.state == "aborted"  # a second abort returns at once
    finally:
        release.set()
        aborter.join(5)


def test_a_batch_whose_prepare_raises_makes_no_nccl_call(no_device):
    # Fallible Python steps (staging, PREMUL_SUM ops) run as prepares before the NCCL
    # group opens; one that raises leaves NCCL untouched, fails the batch, faults nothing.
    from cupycoll.call_queue import Issue
    group = make_group()
    cuda = group._cuda
    comm, events = grouping_comm()
    comm.on_abort = cuda.life.fault_once
    cuda.comm, cuda.device = comm, CUDA
    cuda.calls._enqueue = lambda issues: cuda._launch_all(issues, {1: comm}, 0)

    def send(c, stream, peer):
        events.append(("send", c))

    def oom(c):
        raise torch.OutOfMemoryError("staging")

    def batch(second_prepare):
        return [Issue(CudaWork("send", CUDA, [], cuda.watch), send, None, None, True, peer=1,
                      prepare=lambda c: events.append(("prepare", c))),
                Issue(CudaWork("recv", CUDA, [], cuda.watch), send, None, None, True, peer=1,
                      prepare=second_prepare)]

    failed = batch(oom)
    cuda.calls.pending = list(failed)
    with pytest.raises(torch.OutOfMemoryError):
        cuda.calls.flush()
    assert events == [("prepare", comm)]  # the first prepare ran; no group, no NCCL call
    for issue in failed:  # both Works, never issued, with the error as the cause
        error = issue.work.exception()
        assert "never issued" in str(error) and isinstance(error.__cause__, torch.OutOfMemoryError)
    assert comm.state == "ok" and cuda.state == "ok" and cuda.calls.pending == []
    events.clear()
    cuda.calls.pending = batch(None)
    cuda.calls.flush()  # the group is still usable
    assert events == [("prepare", comm), "start", ("send", comm), ("send", comm), "end"]
    group.abort()  # while CuPy is still the stand-in


class StuckConnectLibrary(ScriptedLibrary):
    """ncclAllReduce (or an NCCL group's end) blocks, as a blocking communicator's connect to
    a peer that never makes the call does, until the test releases it; ncclCommAbort is
    recorded with what was inside NCCL then."""

    def __init__(self):
        super().__init__([nb.ncclSuccess])
        self.inside, self.release = threading.Event(), threading.Event()
        self.aborted_while_inside = []
        self.in_call = 0

    def _block(self):
        self.in_call += 1
        self.inside.set()
        try:
            assert self.release.wait(30), "never released"
        finally:
            self.in_call -= 1
        return nb.ncclSuccess

    def ncclAllReduce(self, *args):
        return self._block()

    def ncclCommAbort(self, comm):
        self.aborted_while_inside.append(self.in_call)
        return super().ncclCommAbort(comm)


@pytest.fixture
def terminations(monkeypatch):
    """The process's end, recorded instead (lifecycle's terminate): [(group, error)]."""
    from cupycoll.faults import lifecycle

    ended = []
    monkeypatch.setattr(lifecycle, "terminate", lambda group, error: ended.append((group, error)))
    return ended


def test_a_blocking_call_stuck_inside_nccl_is_timed_out_never_aborted_beside_and_ends_the_process(
        cuda_standins, no_device, terminations):
    # NCCL forbids a call on a communicator while another thread is inside one on it, and a
    # blocking call stuck in NCCL's connect returns only when the peer comes: its group's
    # timeout is found, explained and ended (Works failed), and since nothing can end the
    # call safely, the process ends with the timeout; ncclCommAbort never runs beside it.
    group = make_group(timeout=0.3)
    cuda = group._cuda
    comm = polling_comm([nb.ncclSuccess])
    comm.nonblocking, comm.stream = False, 0
    lib = comm._lib = StuckConnectLibrary()
    cuda.comm = comm
    # The diagnosis of a call being issued reads the flight recorder's stuck entry (no batch yet).
    cuda.life._explain = lambda entry, timeout_s: (
        f"{cuda.trace.recorder.stuck()[2]} #{cuda.trace.recorder.stuck()[0]} timed out; rank 1 is behind")
    caller = threading.Thread(target=lambda: group.allreduce([torch.ones(4)]), daemon=True)
    start = time.monotonic()
    caller.start()
    try:
        assert lib.inside.wait(5)
        assert eventually(lambda: terminations, timeout=10)
        assert time.monotonic() - start < 0.3 + 5.0  # the timeout + the watchdog's pass + the end
        life, error = terminations[0]  # terminate (recorded here, not exiting) may be asked again
        assert life is cuda.life and isinstance(error, CollectiveTimeoutError)
        assert "all_reduce #1 timed out; rank 1 is behind" in str(error)  # the call being issued
        assert "ncclAllReduce has been inside NCCL" in str(error) and "no abort can end it safely" in str(error)
        assert cuda.state == "aborted" and lib.aborts == 0  # never aborted beside the call
    finally:
        lib.release.set()
        caller.join(5)
    assert lib.aborted_while_inside == [0]  # the call ran ncclCommAbort on its way out


def test_a_stuck_nccl_group_over_two_communicators_frees_neither_while_its_thread_is_inside(
        cuda_standins, no_device, terminations):
    # A batch over two pair communicators stuck in ncclGroupEnd: each communicator has the
    # thread inside it until ncclGroupEnd returns; freeing one first would let NCCL write it
    # on the way out. Neither is aborted until the thread has left; the process ends.
    group = make_group(size=3, timeout=0.3)
    cuda = group._cuda
    cuda.device = CUDA
    cuda._adopt_device(CUDA)
    libs = []

    class StuckGroupLibrary(StuckConnectLibrary):
        def ncclGroupStart(self):
            return 0

        def ncclGroupEnd(self):
            return self._block()

        def ncclSend(self, *args):
            return 0

        def ncclRecv(self, *args):
            return 0

    shared = StuckGroupLibrary()
    for peer in (1, 2):
        comm = polling_comm([nb.ncclSuccess])
        comm.nonblocking, comm.stream = False, 0
        comm._lib = shared
        comm.on_abort = cuda.life.fault_once
        cuda.comms.pairs[peer] = comm
        libs.append(comm)
    sends = [group.send([torch.ones(2)], 1), group.recv([torch.ones(2)], 2)]
    flusher = threading.Thread(target=lambda: sends[0].wait(), daemon=True)
    flusher.start()
    try:
        assert shared.inside.wait(5)
        assert eventually(lambda: terminations, timeout=10)
        life, error = terminations[0]  # terminate (recorded here, not exiting) may be asked again
        assert "ncclGroupEnd has been inside NCCL" in str(error)
        assert shared.aborted_while_inside == []  # no member freed under the thread
        assert all(comm.state == "aborted" for comm in libs)  # refused to any new call
        assert all(comm.abort_deferred() for comm in libs)
    finally:
        shared.release.set()
        flusher.join(5)
    assert shared.aborted_while_inside == [0, 0]  # both aborted once the group had ended


def test_only_a_call_the_abort_ended_inside_nccl_takes_the_groups_timeout():
    group = make_group()
    life = group._cuda.life
    ended = CommunicatorAbortedError("ncclAllReduce: the NCCL communicator on cuda:0 was aborted during the call")
    ended.during_call = True
    assert life.timeout_that_cut(ended) is None  # no fault: a user's abort keeps its own words
    life.fault = CollectiveTimeoutError("all_reduce #3 timed out; rank 1 is behind")
    timed_out = life.timeout_that_cut(ended)
    assert isinstance(timed_out, CollectiveTimeoutError) and str(timed_out) == str(life.fault)
    assert timed_out is not life.fault  # each caller raises its own
    refused = CommunicatorAbortedError("process group '' was aborted")  # never entered NCCL
    assert life.timeout_that_cut(refused) is None
    assert life.timeout_that_cut(RuntimeError("a launch's own error")) is None
    life.fault = None


# -- every call that waits for a peer ends -------------------------------------------------


def test_a_blocking_creation_stuck_after_the_store_gate_is_timed_out_and_ends_the_process(
        monkeypatch, terminations):
    # A peer passed the store gate but never joins NCCL's bootstrap: ncclCommInitRankConfig
    # waits inside NCCL before any communicator exists. The watchdog sees the creation, and
    # as nothing can end it, the process ends with the group's timeout.
    release = threading.Event()
    monkeypatch.setattr(Communicator, "preflight", staticmethod(lambda *args: None))

    def begin(cls, *args, **kwargs):
        release.wait(30)
        return FakeComm()
    monkeypatch.setattr(Communicator, "begin", classmethod(begin))
    group = CpuAsCudaGroup(dist.HashStore(), 0, 2, datetime.timedelta(seconds=0.3),
                           config.Options(watchdog_interval=0.01))
    cuda = group._cuda
    cuda._bootstrap.unique_id = lambda key, creator, members: b"\0" * 128  # past the gate
    creator = threading.Thread(target=lambda: pytest.raises(CommunicatorAbortedError, cuda.comm_for, CUDA),
                               daemon=True)
    creator.start()
    try:
        assert eventually(lambda: terminations, timeout=10)
        life, error = terminations[0]  # terminate (recorded here, not exiting) may be asked again
        assert life is cuda.life and "ncclCommInitRankConfig has been inside NCCL" in str(error)
        assert cuda.state == "aborted"
    finally:
        release.set()
        creator.join(5)
    assert not creator.is_alive()


def test_abort_all_reentered_from_a_signal_handler_returns_at_once(monkeypatch):
    # Signals arriving while abort_all blocks run the handler again on the same thread:
    # each must return, not nest another abort_all until the stack overflows.
    from cupycoll.faults import lifecycle

    group = make_group()
    nested = []

    class HandlerComm(FakeComm):
        def abort(self, on_behalf_of=None):
            start = time.monotonic()
            # a signal's handler, on the thread inside abort_all (its joining thread here)
            nested.append((lifecycle.abort_all(timeout=5), time.monotonic() - start))
            super().abort()

    group._cuda.comm = HandlerComm()
    monkeypatch.setattr(lifecycle.threading, "Thread", _InlineThread)
    assert cupycoll.abort_all(timeout=5) >= 1
    assert len(nested) == 1 and nested[0][1] < 1.0
    assert group._cuda.state == "aborted"


class _InlineThread:
    """threading.Thread that runs its target on the caller's thread when started."""

    def __init__(self, target=None, args=(), name=None, daemon=None):
        self.target, self.args = target, args

    def start(self):
        self.target(*self.args)

    def join(self, timeout=None):
        pass

    def is_alive(self):
        return False


def test_abort_all_leaves_a_shut_down_group_alone():
    group = make_group()
    comm = group._cuda.comm = FakeComm()
    group.shutdown()
    assert group._cuda.state == "shut down" and comm.state == "shut down"
    assert cupycoll.abort_all() == 0 or group._cuda.state == "shut down"
    assert group._cuda.state == "shut down" and not comm.aborted.is_set()


def test_a_group_aborted_while_half_built_ends_what_exists_without_errors(monkeypatch):
    # abort_all from a signal handler may catch a group during its construction.
    import warnings
    from cupycoll.faults import lifecycle

    seen = []
    real_init = CpuAsCudaGroup._build

    def build_then_abort(self, *args, **kwargs):
        self._trace = None  # not yet: the group is half-built
        del self._trace
        lifecycle.abort_all()  # the signal
        seen.append("aborted before the group was built")
        return real_init(self, *args, **kwargs)

    monkeypatch.setattr(CpuAsCudaGroup, "_build", build_then_abort)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a step failing (AttributeError) would warn
        group = make_group()
    assert seen
    group.abort()
    assert group._cuda.state == "aborted"


def test_a_group_made_with_watch_calls_off_puts_no_call_in_flight(cuda_standins):
    group = CpuAsCudaGroup(dist.HashStore(), 0, 2, datetime.timedelta(seconds=5),
                           config.Options(watch_calls=False))
    cuda = group._cuda
    cuda.comm = FakeComm()
    cuda._launch_all = lambda issues, comms, stream, launched=None: None
    work = group.allreduce([torch.ones(2)], c10d.AllreduceOptions())
    assert cuda.watch.in_flight() == 0 and work._slot is None and work.is_completed()
    group.abort()


def test_a_failed_group_end_over_two_communicators_fails_earlier_work_before_it_can_read_as_done(no_device):
    # A failing ncclGroupEnd over several communicators sets every member's abort flag, and a
    # kernel issued earlier on one of them may end early: its event fires before the error
    # has even reached the group. The members stay fenced (nothing is retired) until the
    # group claimed the fault, so that kernel's Work reads as failed, never as a success.
    group = make_group(size=3)
    cuda = group._cuda
    earlier, event = issued_work(cuda.watch, seq=1)
    seen_in_group_end = []

    class FailingEnd(ScriptedLibrary):
        def ncclGroupStart(self):
            return 0

        def ncclGroupEnd(self):
            event.fired.set()  # NCCL's abort flags ended the earlier kernel
            seen_in_group_end.append(cuda.watch.check())  # a watchdog pass meanwhile
            raise NcclError(6, "ncclGroupEnd", "remote process exited")

    comms = []
    for peer in (1, 2):
        comm = polling_comm([nb.ncclSuccess])
        comm.nonblocking, comm._lib = False, FailingEnd([nb.ncclSuccess])
        comm.on_abort = cuda.life.fault_once
        cuda.comms.pairs[peer] = comm
        comms.append(comm)
    with pytest.raises(NcclError):
        with comms[0].group():
            for comm in comms:
                comm._settle("ncclSend", nb.ncclSuccess)
    assert seen_in_group_end == [None]  # the pass found nothing, and retired nothing while fenced
    assert not earlier.is_success() and isinstance(earlier.exception(), NcclError)
    assert cuda.life.ended.wait(5) and all(comm.state == "aborted" for comm in comms)
