"""Stand-ins of the fault path, shared by the tests of faults (tests/faults/), of the NCCL
layer (tests/nccl/) and of the backend: a communicator (:class:`FakeComm` and its variants
that hang, raise or block), events the test fires or counts, a group's watch with calls in
flight (:func:`issued_work`), a real :class:`~cupycoll.nccl.communicator.Communicator` over a
scripted NCCL library (:func:`polling_comm`, :func:`grouping_comm`, :class:`RecordingLibrary`),
and :func:`run_script`, which runs a scenario whose subject is the process's end in a process
of its own. Nothing here needs a GPU. The fixtures built on these are in conftest.py
(``no_device``, ``made``)."""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import subprocess
import textwrap
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from cupycoll.trace.recorder import Recorder
from cupycoll.errors import NcclError
from cupycoll.faults.watchdog import Finding, InFlight, Watch
from cupycoll.issue import Call
from cupycoll.nccl import bindings as nb
from cupycoll.nccl import header as nh
from cupycoll.nccl.communicator import Communicator
from cupycoll.nccl.communicators import Communicators
from cupycoll.work import CudaWork
import warm_python
from standins import CUDA, CpuAsCudaGroup, DeviceLedger, FakeEvent

TESTS = str(Path(__file__).resolve().parent)


# -- communicators and events ------------------------------------------------------------


class CountedEvent(FakeEvent):
    """An event whose ``done`` the test sets, counting its queries."""

    def __init__(self, done=True):
        super().__init__()
        self.done, self.queries = done, 0

    def query(self):
        self.queries += 1
        return self.done


class RaisingEvent(FakeEvent):
    """cudaEventQuery after a sticky CUDA error (an illegal address, an Xid)."""

    def query(self):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


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


class HangingComm(FakeComm):
    """ncclCommAbort that hangs until the test lets it go."""

    def __init__(self, release):
        super().__init__()
        self.release = release

    def abort(self, on_behalf_of=None):
        self.aborted.set()
        self.release.wait(30)
        super().abort()


class BlockingQueryComm(FakeComm):
    """The watchdog's query blocks (a communicator lock held by a hung ncclCommAbort)."""

    def stuck_call(self, after_s, now=None, child=None):
        threading.Event().wait()


class RaisingComm(FakeComm):
    def abort(self, on_behalf_of=None):
        super().abort()
        raise RuntimeError("cudaErrorIllegalAddress while aborting")


class GroupComm(FakeComm):
    """A communicator stand-in whose NCCL group records its launches; the backend's abort
    sees whether the Works still held their tensors (the kernels may run until then)."""

    rank = stream = 0

    def __init__(self, works=()):
        super().__init__()
        self.launched, self.works, self.kept_at_abort = [], list(works), None

    @contextlib.contextmanager
    def group(self):
        yield
        self.launched.append("ncclGroupEnd")

    def launch(self, calls, stream):
        self.launched.extend(function for function, _ in calls)

    def abort(self, on_behalf_of=None):
        self.kept_at_abort = [w._slot is not None and w._slot.keepalive is not None for w in self.works]
        super().abort()


def holding(*comms):
    """A group's Communicators holding ``comms`` as pair communicators (peers 1, 2, ...)."""
    held = Communicators()
    held.pairs = {peer: comm for peer, comm in enumerate(comms, start=1)}
    return held


# -- a group and its watch ---------------------------------------------------------------


def make_group(rank=0, size=2, timeout=5.0, store=None):
    """Rank ``rank`` of a ``size``-rank cupycoll group whose CPU tensors take the CUDA route
    (standins.CpuAsCudaGroup); no communicator yet."""
    return CpuAsCudaGroup(store if store is not None else dist.HashStore(), rank, size,
                          datetime.timedelta(seconds=timeout))


def recorder_entry(seq=1, op="all_reduce", shapes=((4,),), dtypes=(torch.float32,)):
    """A flight-recorder entry as the group records a call (cupycoll.trace.recorder)."""
    now = time.monotonic()
    return [seq, False, op, tuple(torch.Size(s) for s in shapes), tuple(dtypes), None, "nccl", "issued",
            now, now, None]


def make_watch(name="g", timeout=5.0, comms=None):
    """A group's watch as the backend makes it: batches named by their recorder entries."""
    return Watch(name, timeout, comms, Recorder(name, [0], 0))


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


def queued_call(watch, op="send", peer=None, run=None, prepare=None, finish=None, async_op=True, seq=1,
                keep=None, outputs=None) -> Call:
    """A described call with its Work, as the issuer holds it once queued: ``run`` its launch."""
    call = Call(op=op, device=CUDA, outputs=outputs if outputs is not None else [], keep=keep, async_op=async_op,
                entry=None, run=run, prepare=prepare,
                finish=finish, peer=peer)
    call.work = CudaWork(op, CUDA, call.outputs, watch, seq=seq)
    return call


def submit(group, op, run, keep=None, peer=None, finish=None, prepare=None, async_op=True, algorithm=None):
    """A described call of ``run`` (its only step) issued on ``group``: its Work."""
    return group._issuer.issue(Call(op=op, device=CUDA, outputs=[torch.ones(2)], keep=keep, async_op=async_op,
                                    entry=None, run=run, prepare=prepare,
                                    finish=finish, peer=peer, algorithm=algorithm))


def stuck_work(watch, seq=1):
    """A call in flight in ``watch`` whose event nobody fires: its Work."""
    work, event = issued_work(watch, seq=seq)
    return work


def poll(watch, now=None):
    """One pass of ``watch``, and what its group's lifetime does with a finding before the
    abort: the watch closes with the fault (every batch in flight failed). The fault, or None."""
    finding = watch.check(now)
    if finding is None:
        return None
    watch.close(finding.fault)
    return finding.fault


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


def fault_group(group, fault, batch=None, stuck=None, timeout=10.0):
    """``fault`` found in ``group`` (as the watchdog finds one): claimed, explained and ended
    on the fault thread; returns once the end is done."""
    assert group._cuda.life.claim(Finding(fault, batch, stuck))
    assert group._cuda.life.ended.wait(timeout)


def undiagnosed(*groups):
    """The timeouts of ``groups`` are not diagnosed: a diagnosis waits up to
    bounds.DIAGNOSIS_WAIT_S (4 s) for the records of peers, and these groups have none. For
    tests whose subject is what follows a timeout, not its explanation."""
    for group in groups:
        group._cuda.life._explain = None


def eventually(predicate, timeout=5.0):
    """Whether ``predicate()`` holds within ``timeout`` seconds (asked every 5 ms)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


# -- a real Communicator over a scripted NCCL -----------------------------------------------


class Unchecked:
    """A stand-in library's :attr:`~cupycoll.nccl.bindings.NcclLibrary.unchecked`: its NCCL
    functions by name (each returns its status, as the bare C function does)."""

    def __init__(self, library):
        self._library = library

    def __getitem__(self, name):
        return getattr(self._library, name)


class ScriptedLibrary:
    """ncclCommGetAsyncError answers from a script; abort is recorded."""

    def __init__(self, states):
        self.states = list(states)
        self.aborts = 0

    @property
    def unchecked(self):
        return Unchecked(self)

    def failure(self, function, status):
        return NcclError(status, function, self.error_string(status), self.last_error())

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
    comm.runtime = DeviceLedger()
    comm._init_guard()
    return comm


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

    comm = polling_comm([nh.ncclSuccess])
    comm._lib = GroupLibrary([nh.ncclSuccess])
    return comm, events


class RecordingLibrary(ScriptedLibrary):
    """An NCCL whose communicator calls are recorded: creation and children hand out new
    handles; ncclCommCount/UserRank answer ``child_size``/``child_rank``."""

    def __init__(self, shrink=True, abort_status=0, child_size=2, child_rank=1):
        super().__init__([nh.ncclSuccess])
        self.calls = []
        self.configs = []
        self.abort_status = abort_status
        self.child_size, self.child_rank = child_size, child_rank
        if not shrink:
            self.ncclCommShrink = None

    def _new_comm(self, ref):  # handles 0x5000, 0x5001, ... in the order made
        self.made = getattr(self, "made", 0x4fff) + 1
        ctypes.cast(ref, ctypes.POINTER(ctypes.c_void_p)).contents.value = self.made

    def _config(self, ref):
        self.configs.append(ctypes.cast(ref, ctypes.POINTER(nh.ncclConfig_t)).contents.blocking)

    unique_id_from_bytes = staticmethod(nb.NcclLibrary.unique_id_from_bytes)

    def has(self, name):
        return getattr(self, name, None) is not None

    def version(self):
        return 22609

    def ncclCommInitRankConfig(self, comm_ref, size, unique_id, rank, config_ref):
        self.calls.append(("ncclCommInitRankConfig", size, rank))
        self._new_comm(comm_ref)
        self._config(config_ref)
        return 0

    def ncclCommShrink(self, comm, excluded, count, new_ref, config_ref, flags):
        self.calls.append(("ncclCommShrink", comm, [excluded[i] for i in range(count)], flags))
        self._new_comm(new_ref)
        self._config(config_ref)
        return 0

    def ncclCommSplit(self, comm, color, key, new_ref, config_ref):
        self.calls.append(("ncclCommSplit", comm, color, key))
        self._new_comm(new_ref)
        self._config(config_ref)
        return 0

    def ncclCommCount(self, comm, ref):
        ctypes.cast(ref, ctypes.POINTER(ctypes.c_int)).contents.value = self.child_size
        return 0

    def ncclCommUserRank(self, comm, ref):
        ctypes.cast(ref, ctypes.POINTER(ctypes.c_int)).contents.value = self.child_rank
        return 0

    def ncclCommAbort(self, comm):
        self.calls.append(("ncclCommAbort", comm))
        if self.abort_status:
            raise NcclError(self.abort_status, "ncclCommAbort", "unhandled system error")
        return 0

    def ncclCommFinalize(self, comm):
        self.calls.append(("ncclCommFinalize", comm))
        return 0

    def ncclCommDestroy(self, comm):
        self.calls.append(("ncclCommDestroy", comm))
        return 0


class DeviceRestoringLibrary(RecordingLibrary):
    """A RecordingLibrary that does with the current device what NCCL does, on a device ledger
    (tests/standins.py's DeviceLedger): a communicator lives on the device current when it was
    made (ncclCommInitRankConfig) or on its parent's (a split, a shrink); every call on one,
    and every ncclGroupEnd, saves the device current on the calling thread, makes the
    communicator's current for the call (its context) and sets the saved one back after it
    (cudaSetDevice: that makes a context on the saved device if it had none). Every other
    NCCL function answers ncclSuccess."""

    def __init__(self, ledger, **kwargs):
        super().__init__(**kwargs)
        self.ledger = ledger
        self.devices = {}  # handle -> the device of its communicator
        self.launched = []  # (NCCL function, device current in it) per call on a communicator

    def _inside(self, function: str, device):
        ledger = self.ledger
        saved = ledger.device_in_thread()
        if device is not None:
            ledger.set_device(device)
        ledger.call(function)
        self.launched.append((function, ledger.device_in_thread()))
        return saved

    def _restore(self, saved):
        self.ledger.set_device(saved)

    def _made(self, ref, device):
        self.devices[ctypes.cast(ref, ctypes.POINTER(ctypes.c_void_p)).contents.value] = device

    def ncclCommInitRankConfig(self, comm_ref, size, unique_id, rank, config_ref):
        saved = self._inside("ncclCommInitRankConfig", None)
        try:
            status = super().ncclCommInitRankConfig(comm_ref, size, unique_id, rank, config_ref)
            self._made(comm_ref, saved)
            return status
        finally:
            self._restore(saved)

    def ncclCommSplit(self, comm, color, key, new_ref, config_ref):
        saved = self._inside("ncclCommSplit", self.devices.get(comm))
        try:
            status = super().ncclCommSplit(comm, color, key, new_ref, config_ref)
            self._made(new_ref, self.devices.get(comm))
            return status
        finally:
            self._restore(saved)

    def ncclCommShrink(self, comm, excluded, count, new_ref, config_ref, flags):
        saved = self._inside("ncclCommShrink", self.devices.get(comm))
        try:
            status = super().ncclCommShrink(comm, excluded, count, new_ref, config_ref, flags)
            self._made(new_ref, self.devices.get(comm))
            return status
        finally:
            self._restore(saved)

    def _on_comm(self, function, comm, call):
        saved = self._inside(function, self.devices.get(comm))
        try:
            return call()
        finally:
            self._restore(saved)

    def ncclCommAbort(self, comm):
        return self._on_comm("ncclCommAbort", comm, lambda: RecordingLibrary.ncclCommAbort(self, comm))

    def ncclCommFinalize(self, comm):
        return self._on_comm("ncclCommFinalize", comm, lambda: RecordingLibrary.ncclCommFinalize(self, comm))

    def ncclCommDestroy(self, comm):
        return self._on_comm("ncclCommDestroy", comm, lambda: RecordingLibrary.ncclCommDestroy(self, comm))

    def ncclGroupStart(self):
        return 0

    def ncclGroupEnd(self):
        # NCCL launches the group's calls on their communicators' devices, then sets back the
        # device current when it was called (the communicators of these tests share one).
        return self._on_comm("ncclGroupEnd", next(iter(self.devices), None), lambda: 0)

    def __getattr__(self, name):
        if not name.startswith("nccl"):
            raise AttributeError(name)

        def call(*args):
            # A collective or point-to-point call: (..., comm, stream).
            comm = args[-2] if len(args) >= 2 else None
            return self._on_comm(name, comm if comm in self.devices else None, lambda: 0)
        return call


# -- a scenario in a Python of its own ------------------------------------------------------


def run_script(body: str, timeout: float = 60, prelude: str = "") -> subprocess.CompletedProcess:
    """``prelude`` then ``body`` (each dedented) run as ``python -c`` would run them, in a
    process of their own forked from a Python that imported torch, cupycoll and these
    stand-ins once (tests/warm_python.py), tests/ on its path (the script imports the
    stand-ins as ``faulty`` and ``standins``); its output captured."""
    script = f"import sys; sys.path.insert(0, {TESTS!r})\n" + textwrap.dedent(prelude) + textwrap.dedent(body)
    return warm_python.run(script, timeout)
