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

Also the CUDA objects of the issue path as stand-ins: :class:`FakeEvent`,
:class:`RecordedEvent`, :class:`FakeStream`; :func:`use_cuda_standins`, which puts them in
place of torch.cuda's (conftest.py's ``cuda_standins`` fixture, ``tools/call_path.py``), and
:func:`capture`, which says whether a CUDA graph is being captured.
"""

from __future__ import annotations

import contextlib
import datetime
import threading

import torch

from cupycoll import _cuda, compat
from cupycoll.backend import CudaBackend
from cupycoll.errors import CupycollValueError
from cupycoll.faults.watchdog import InFlight
from cupycoll.process_group import ProcessGroupCupycoll

CUDA = torch.device("cuda", 0)


class CpuAsCudaBackend(CudaBackend):
    _fast_is_cuda = False  # its CPU tensors stand in for CUDA ones on the fast path too

    def check_device(self, tensor, what):
        if tensor.layout is not torch.strided:
            return super().check_device(tensor, what)  # the real check names the layout first
        if not tensor.is_contiguous():
            raise CupycollValueError(f"{what} is not contiguous")
        return CUDA

    def _adopt_device(self, device):
        super()._adopt_device(device)
        self._device_index = -1  # what a CPU tensor's get_device() says: the fast path's test


class CpuAsCudaGroup(ProcessGroupCupycoll):
    backend_class = CpuAsCudaBackend

    def _build_cpu_group(self, store, rank, size, timeout):
        return None

    def _classify(self, tensors, op_name):
        super()._classify(tensors, op_name)  # the real mixing/type checks, CPU tensors stand in
        return True

    def _all_reduce_on_cpu(self, tensor, tensors, opts):
        return None  # a CPU tensor stands in for a CUDA one: never the CPU route


def backend_shape(core: type) -> type:
    """:class:`CpuAsCudaGroup`'s twin in the Backend shape (torch 2.14+): the real
    CupycollBackend over the CUDA core ``core``, with no gloo half, so that CPU tensors, which
    torch hands the group's CpuView, take the CUDA route too."""
    from cupycoll import py_backend  # only where torch has the trampoline

    class StandInShape(py_backend.CupycollBackend):
        backend_class = core

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
    says the GPU is done; recording it, waiting on it and syncing it do nothing."""

    def __init__(self):
        self.fired = threading.Event()
        self.records = 0

    def query(self):
        return self.fired.is_set()

    def record(self, stream=None):
        # Recorded again (a pooled event): not done until the GPU passes this new point.
        self.records += 1
        self.fired.clear()

    def synchronize(self):
        pass

    def wait_on(self, stream):
        pass

    def destroy(self):
        pass


class RecordedEvent(FakeEvent):
    """The event the backend records when a test's CUDA stand-ins are in place: never done
    unless the test fires it."""


class DoneEvent(FakeEvent):
    """An event the GPU has always passed (the call path's stand-in)."""

    def query(self):
        return True


class FakeStream:
    device_index = 0
    cuda_stream = 0

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass


def capture(monkeypatch, on: bool) -> None:
    """Every stream is (``on``) or is not capturing a CUDA graph."""
    monkeypatch.setattr(_cuda, "capturing", lambda stream: on)


def use_cuda_standins(setattr, event=RecordedEvent) -> None:
    """The few CUDA calls of the issue path, answered on CPU. ``setattr(obj, name, value)``
    puts each in place and is what undoes it (pytest's ``monkeypatch.setattr``); ``event``:
    the class that stands in for cupycoll's pooled CUDA event."""
    setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    setattr(torch.cuda, "current_device", lambda: 0)
    setattr(torch.cuda, "ExternalStream", lambda ptr, device=None: FakeStream())
    setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    setattr(_cuda, "new_event", event)
    setattr(_cuda, "capturing", lambda stream: False)
    setattr(compat, "current_raw_stream", lambda device_index: FakeStream.cuda_stream)


# -- groups whose backend stops short of NCCL ----------------------------------------------


class QueueBackend(CpuAsCudaBackend):
    """_enqueue records each batch (its Works' op names) as one NCCL group would issue it,
    and marks the Works issued; nothing is in flight."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.batches = []

    def _enqueue(self, issues):
        self.batches.append([i.work.op_name for i in issues])
        for issue in issues:
            issue.work._issued(None, 0, True)


class QueueGroup(CpuAsCudaGroup):
    backend_class = QueueBackend

    @property
    def batches(self):
        return self._cuda.batches


class IssuingBackend(CpuAsCudaBackend):
    """_enqueue puts the batch in flight on a stand-in event (fired by the test: the kernel
    ended); ``before_tracking`` runs first, as another thread may meanwhile."""

    event = None
    before_tracking = None

    def _enqueue(self, issues):
        if self.before_tracking is not None:
            self.before_tracking()
        self.event = FakeEvent()
        self.watch._free.append(InFlight(self.event))
        slot = self.watch.issued(0, None, [issue.keepalive for issue in issues])
        for issue in issues:
            issue.work._issued(slot, 0, True)
            issue.tracked = True


class IssuingGroup(CpuAsCudaGroup):
    backend_class = IssuingBackend


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

    def group(self):
        # an NCCL group through the communicator: no library is looked up, nothing recorded
        return contextlib.nullcontext()


class RecordingBackend(CudaBackend):
    """The real device checks (a CPU tensor is on cpu); each submitted call is launched at
    once on a recording communicator instead of being issued."""

    def submit(self, op_name, device, outputs, launch, finish=None, keepalive=(), async_op=True,
               peer=None, blocking_wait=False, algorithm=None, prepare=None, entry=None):
        comm = RecordingComm()
        self.phase = "prepare"
        if prepare is not None:  # before the NCCL group, as _launch_all runs it
            prepare(comm)
        self.prepared.append((op_name, list(comm.calls)))
        self.phase = "launch"
        if peer is None:
            launch(comm, 1234)
        else:
            launch(comm, 1234, peer)
        if finish is not None:
            finish()
        self.submitted.append((op_name, comm.calls))
        return comm.calls


class LogicGroup(CpuAsCudaGroup):
    """CPU tensors take the NCCL path; nothing reaches NCCL or gloo."""

    backend_class = RecordingBackend


def logic_group() -> LogicGroup:
    """Rank 0 of 2 on a :class:`LogicGroup`: ``group.submitted`` lists each call's
    (op name, NCCL calls), ``group._cuda.prepared`` what its prepare step called."""
    group = LogicGroup(None, 0, 2, datetime.timedelta(seconds=5))
    group.submitted = group._cuda.submitted = []
    group._cuda.prepared = []
    return group
