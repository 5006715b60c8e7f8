"""Stand-in process groups for CPU tests of logic that normally runs on CUDA.

:class:`CpuAsCudaGroup` is the real ProcessGroupCupycoll with its routing seams replaced (no
inner gloo group; CPU tensors take the CUDA route, after the real type and mixing checks,
and never the CPU route's one-frame all_reduce)
and one backend seam: :class:`CpuAsCudaBackend`, the real CudaBackend for which every tensor
counts as being on ``cuda:0``. What happens after that (queueing, enqueue, faults) is the
real code unless a test's subclass of the backend replaces it. The GPU tier runs the same
paths for real. Three such groups, shared by several test modules, stop short of NCCL:
:class:`QueueGroup` records each batch the call queue issues, :class:`IssuingGroup` puts
each batch in flight on an event the test fires, and :func:`logic_group` launches each call
at once on a communicator that records the NCCL calls (the real device checks kept).
:func:`backend_shape` gives any of their cores the Backend shape.

Also the CUDA runtime as a stand-in, the device ledger (:class:`DeviceLedger`: a current device
per thread, the contexts made, the device of every object and call), with its events
(:class:`FakeEvent`, :class:`RecordedEvent`, :class:`DoneEvent`) and streams;
:func:`cuda_standins` installs one for the groups built meanwhile (conftest.py installs a
fresh one for every test, ``tools/call_path.py`` one of its own), and :func:`capture` says
whether a CUDA graph is being captured.
"""

from __future__ import annotations

import contextlib
import datetime
import threading

import torch

from cupycoll import _cuda
from cupycoll.backend import CudaBackend
from cupycoll.faults.watchdog import InFlight
from cupycoll.issue import Issuer
from cupycoll.process_group import ProcessGroupCupycoll

CUDA = torch.device("cuda", 0)


class CpuAsCudaBackend(CudaBackend):
    _tensors_are_cuda = False  # its CPU tensors stand in for CUDA ones
    stands_for = CUDA  # the device its CPU tensors stand for

    def _device_of(self, tensor):
        return self.stands_for if tensor.is_cpu else tensor.device  # a fake CUDA tensor's is its own

    def _adopt_device(self, device):
        super()._adopt_device(device)
        self._device_index = -1  # what a CPU tensor's get_device() says


class CpuAsCudaGroup(ProcessGroupCupycoll):
    backend_class = CpuAsCudaBackend
    _tensors_are_cuda = False  # its CPU tensors take the CUDA route

    def _build_cpu_group(self, store, rank, size, timeout):
        return None

    def _classify(self, tensors, op_name):
        super()._classify(tensors, op_name)  # the real mixing/type checks, CPU tensors stand in
        return True

    def _all_reduce_on_cpu(self, tensor, tensors, opts):
        return None  # a CPU tensor stands in for a CUDA one: never the CPU route


def backend_shape(core: type, issuer: type = Issuer) -> type:
    """:class:`CpuAsCudaGroup`'s twin in the Backend shape (torch 2.14+): the real
    CupycollBackend over the CUDA core ``core`` (and ``issuer``), with no gloo half, so that CPU tensors, which
    torch hands the group's CpuView, take the CUDA route too."""
    from cupycoll import py_backend  # only where torch has the trampoline

    class StandInShape(py_backend.CupycollBackend):
        backend_class = core
        issuer_class = issuer
        _tensors_are_cuda = False

        def _build_cpu_group(self, store, rank, size, timeout):
            return None

        def _classify(self, tensors, op_name):
            super()._classify(tensors, op_name)
            return True

        def _all_reduce_on_cpu(self, tensor, tensors, opts):
            return None
    return StandInShape


class FakeEvent:
    """A CUDA event stand-in (cupycoll._cuda.Event's): ``query()`` turns True when the test
    says the GPU is done; recording it, waiting on it and syncing it do nothing but tell the
    ledger that made it (:class:`DeviceLedger`), if one did, which device the call ran on."""

    ledger = None  # the DeviceLedger that made it
    device = None  # the device it was made on

    def __init__(self):
        self.fired = threading.Event()
        self.records = 0

    def _call(self, name):
        if self.ledger is not None:
            self.ledger.call(name, self)

    def query(self):
        self._call("cudaEventQuery")
        return self.fired.is_set()

    def record(self, stream=None):
        # Recorded again (a pooled event): not done until the GPU passes this new point.
        self._call("cudaEventRecord")
        self.records += 1
        self.fired.clear()

    def synchronize(self):
        self._call("cudaEventSynchronize")

    def wait_on(self, stream):
        self._call("cudaStreamWaitEvent")

    def destroy(self):
        self._call("cudaEventDestroy")


class RecordedEvent(FakeEvent):
    """The event the backend records when a test's CUDA stand-ins are in place: never done
    unless the test fires it."""


class DoneEvent(FakeEvent):
    """An event the GPU has always passed (the call path's stand-in)."""

    def query(self):
        self._call("cudaEventQuery")
        return True


class FakeStream:
    """A stream a :class:`DeviceLedger` made: its raw pointer and device."""

    def __init__(self, ptr=0, device=0, ledger=None):
        self.ptr, self.device, self._ledger = ptr, device, ledger

    def synchronize(self):
        if self._ledger is not None:
            self._ledger.call("cudaStreamSynchronize", self)


class FakeKernel:
    """A kernel a :class:`DeviceLedger` compiled: launching it computes nothing."""

    def __init__(self, name, device):
        self.name, self.device = name, device


class DeviceLedger(_cuda.Runtime):
    """The CUDA runtime on CPU (cupycoll._cuda.Runtime's stand-in), modelling what a node of
    several GPUs does:

    * a current device per thread, device 0 on a new thread;
    * the devices that have a context (:attr:`contexts`): setting a device makes its context,
      and so does any call that needs one on the device current when it is made (an event's
      or a stream's, a copy, a launch, a capture query, an NCCL call of :class:`LedgerLibrary`);
    * torch's device guard (:meth:`on_device`): its exit sets the previous device back only
      where that one has a context (else torch only remembers it, as its lazy target does);
    * the device every event, stream, scratch buffer and kernel is made on (:attr:`made`),
      and the thread and device of every call (:attr:`calls`).

    ``event``: the class of the events it makes (:class:`RecordedEvent`: done when the test
    fires them); ``capture``: every stream captures a CUDA graph. Its streams are numbers;
    ``current_stream(d)`` is 0, every device's default stream."""

    def __init__(self, event=RecordedEvent, devices: int = 8, keep_calls: bool = True):
        self.event_class = event
        self.keep_calls = keep_calls  # off: only the contexts and the objects made are kept
        self.devices = devices
        self.capture = False
        self.contexts: set = set()
        self.made: list = []  # (what, device)
        self.calls: list = []  # (thread name, call, device current)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._streams = 0x1000

    # -- the model --------------------------------------------------------------------
    def device_in_thread(self) -> int:
        """The CUDA runtime's current device on this thread (what NCCL saves and restores)."""
        return getattr(self._local, "device", 0)

    def set_device(self, index: int) -> None:
        """cudaSetDevice: current on this thread, with its context (made now if need be)."""
        self._local.device = index
        self._local.target = None
        with self._lock:
            self.contexts.add(index)

    def call(self, name: str, subject=None) -> int:
        """A call that needs a context, on the current device; that device."""
        device = self.device_in_thread()
        if device not in self.contexts:
            with self._lock:
                self.contexts.add(device)
        if self.keep_calls:
            self.calls.append((threading.current_thread().name, name, device))
        return device

    def _make(self, what: str, thing):
        device = self.call(what)
        thing.device = device
        with self._lock:
            self.made.append((what, device))
        return thing

    def devices_made_on(self) -> set:
        return {device for _, device in self.made}

    # -- the runtime --------------------------------------------------------------------
    def current_device(self) -> int:
        target = getattr(self._local, "target", None)
        return self.device_in_thread() if target is None else target

    def on_device(self, index):
        if index is None or index < 0 or self.current_device() == index:
            return contextlib.nullcontext()
        return self._guard(index)

    @contextlib.contextmanager
    def _guard(self, index):
        previous = self.current_device()
        self.set_device(index)
        try:
            yield
        finally:
            if previous in self.contexts:
                self.set_device(previous)
            else:  # torch's MaybeExchangeDevice: no context is made to go back
                self._local.target = previous

    def require_device(self, index: int) -> None:
        if not 0 <= index < self.devices:
            from cupycoll.errors import NoCudaDeviceError

            raise NoCudaDeviceError(f"CUDA device {index} does not exist ({self.devices} visible)")

    def current_stream(self, index: int) -> int:
        return 0

    def capturing(self, stream: int) -> bool:
        self.call("cudaStreamIsCapturing")
        return self.capture

    def new_stream(self, index: int):
        with self._lock:
            self._streams += 1
            ptr = self._streams
        return self._make("stream", FakeStream(ptr, ledger=self))

    def use_stream(self, stream: int, index: int):
        return contextlib.nullcontext()

    def future(self, outputs, index: int, after):
        self.call("future")
        future = torch.futures.Future()
        future.set_result(outputs)
        return future

    def new_event(self):
        event = self.event_class()
        event.ledger = self
        return self._make("event", event)

    @property
    def out_of_memory(self) -> type:
        return MemoryError

    def scratch(self, nbytes: int, index: int):
        scratch = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        with self._lock:
            self.made.append(("scratch", index))
        return scratch

    def copy(self, dst, src, nbytes, stream) -> None:
        self.call("cudaMemcpyAsync")

    def compile(self, index, source, options, names):
        return {kind: self._make("kernel", FakeKernel(kind, None)) for kind in names}

    def launch(self, kernel, grid, block, args, stream) -> None:
        self.call("cudaLaunchKernel")


class InstantRuntime(DeviceLedger):
    """A device ledger of one device, every thread on it, whose GPU is done at once and that
    keeps nothing per call: what ``tools/call_path.py`` times the package's own cost on (the
    ledger's bookkeeping would be most of the figure)."""

    def __init__(self):
        super().__init__(DoneEvent, keep_calls=False)
        self.contexts.add(0)

    def current_device(self) -> int:
        return 0

    def current_stream(self, index: int) -> int:
        return 0

    def capturing(self, stream: int) -> bool:
        return False

    def new_event(self):
        event = DoneEvent()
        event.device = 0
        return event


def cuda_standins(event=RecordedEvent, keep_calls: bool = True):
    """A :class:`DeviceLedger` making ``event`` events, installed (cupycoll._cuda.install) for the
    groups built while it is: use as ``with cuda_standins() as ledger:``."""
    return _cuda.install(DeviceLedger(event, keep_calls=keep_calls))


def capture(ledger: DeviceLedger, on: bool) -> None:
    """Every stream is (``on``) or is not capturing a CUDA graph."""
    ledger.capture = on


# -- a group on one GPU of a node of several ---------------------------------------------


class OnDeviceBackend(CpuAsCudaBackend):
    """The real CUDA core on ``stands_for`` (cuda:3 of a node), its communicators real ones
    made without the store gate (the NCCL library is the test's: tests/faulty.py's
    DeviceRestoringLibrary, which does with the current device what NCCL does)."""

    stands_for = torch.device("cuda", 3)

    def _connect(self, key, creator, size, rank, device):
        return self._create_comm(b"\1" * 128, rank, size, device)


class OnDeviceGroup(CpuAsCudaGroup):
    backend_class = OnDeviceBackend


# -- groups whose backend stops short of NCCL ----------------------------------------------


class QueueIssuer(Issuer):
    """_enqueue records each batch (its Works' op names) as one NCCL group would issue it,
    and marks the Works issued; nothing is in flight."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.batches = []

    def _enqueue(self, batch):
        self.batches.append([call.work.op_name for call in batch])
        for call in batch:
            call.work._issued(None, 0, True)


class QueueGroup(CpuAsCudaGroup):
    issuer_class = QueueIssuer

    @property
    def batches(self):
        return self._issuer.batches


class IssuingIssuer(Issuer):
    """_enqueue puts the batch in flight on a stand-in event (fired by the test: the kernel
    ended); ``before_tracking`` runs first, as another thread may meanwhile."""

    event = None
    before_tracking = None

    def _enqueue(self, batch):
        if self.before_tracking is not None:
            self.before_tracking()
        self.event = FakeEvent()
        watch = self._backend.watch
        watch._free.append(InFlight(self.event))
        slot = watch.issued(0, None, [call.keep for call in batch])
        for call in batch:
            call.work._issued(slot, 0, True)
            call.tracked = True


class IssuingGroup(CpuAsCudaGroup):
    issuer_class = IssuingIssuer


# The verb a RecordingComm records each NCCL function by (the Communicator's method name).
_VERBS = {"ncclAllReduce": "all_reduce", "ncclBroadcast": "broadcast", "ncclReduce": "reduce",
          "ncclAllGather": "all_gather", "ncclReduceScatter": "reduce_scatter", "ncclSend": "send",
          "ncclRecv": "recv"}


class RecordingComm:
    """A communicator that records each NCCL call made on it (its stream left out)."""

    def __init__(self):
        self.calls = []
        self.size = 2
        self.rank = 0
        self.state = "ok"  # healthy: a PREMUL_SUM launch destroys its op

    def __getattr__(self, verb):
        if verb == "destroy_op":
            return lambda op: self.calls.append((verb, op))
        if verb in ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "send", "recv"):
            # the last argument is the stream
            return lambda *args: self.calls.append((verb, *args[:-1]))
        if verb == "create_premul_sum":
            return lambda scalar, dtype, on_device: (self.calls.append((verb, scalar, dtype, on_device)), 99)[1]
        raise AttributeError(verb)

    def launch(self, calls, stream):
        for function, args in calls:
            self.calls.append((_VERBS[function], *args))

    def group(self):
        # an NCCL group through the communicator: no library is looked up, nothing recorded
        return contextlib.nullcontext()


class RecordingIssuer(Issuer):
    """Each described call launched at once on a recording communicator (its prepare first,
    as a batch's are, then its NCCL calls or run step, then its finish); nothing is issued."""

    def issue(self, call):
        backend = self._backend
        comm = RecordingComm()
        backend.phase = "prepare"
        if call.prepare is not None:
            call.prepare(comm)
        backend.prepared.append((call.op, list(comm.calls)))
        backend.phase = "launch"
        if call.calls is not None:
            comm.launch(call.calls, 1234)
        elif call.peer is None:
            call.run(comm, 1234)
        else:
            call.run(comm, 1234, call.peer)
        if call.finish is not None:
            call.finish()
        backend.submitted.append((call.op, comm.calls))
        backend.keepalives.append(call.keep)
        return comm.calls


class LogicGroup(CpuAsCudaGroup):
    """CPU tensors take the NCCL path; nothing reaches NCCL or gloo. The real device checks
    (a CPU tensor is on cpu)."""

    backend_class = CudaBackend
    issuer_class = RecordingIssuer


def logic_group(store=None) -> LogicGroup:
    """Rank 0 of 2 on a :class:`LogicGroup` (on ``store``: none unless a test needs one):
    ``group.submitted`` lists each call's (op name, NCCL calls), ``group._cuda.prepared``
    what its prepare step called."""
    group = LogicGroup(store, 0, 2, datetime.timedelta(seconds=5))
    group.submitted = group._cuda.submitted = []
    group._cuda.prepared, group._cuda.keepalives = [], []
    return group
