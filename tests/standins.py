"""Stand-in process groups for CPU tests of logic that normally runs on CUDA.

:class:`CpuAsCudaGroup` is the real ProcessGroupCupycoll with two routing seams replaced (no
inner gloo group; CPU tensors take the CUDA route, after the real type and mixing checks)
and one backend seam: :class:`CpuAsCudaBackend`, the real CudaBackend for which every tensor
counts as being on ``cuda:0``. What happens after that (queueing, enqueue, faults) is the
real code unless a test's subclass of the backend replaces it. The GPU tier runs the same
paths for real.

Also the CUDA objects of the issue path as stand-ins: :class:`FakeEvent`,
:class:`RecordedEvent`, :class:`FakeStream`; :func:`use_cuda_standins`, which puts them in
place of torch.cuda's (conftest.py's ``cuda_standins`` fixture, ``tools/call_path.py``), and
:func:`capture`, which says whether a CUDA graph is being captured.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from cupycoll import _cuda, compat
from cupycoll.backend import CudaBackend
from cupycoll.errors import CupycollValueError
from cupycoll.process_group import ProcessGroupCupycoll

CUDA = torch.device("cuda", 0)


class CpuAsCudaBackend(CudaBackend):
    def check_device(self, tensor, what):
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
