"""Work objects for collectives issued on CUDA streams.

A :class:`CudaWork` is returned for every CUDA collective. It follows ProcessGroupNCCL:
``wait()`` makes the caller's current stream wait for the collective and does not block
the CPU (unless the collective is a barrier or a CPU timeout is given), ``is_completed()``
asks whether the GPU is done, and ``get_future()`` returns a CUDA-aware
``torch.futures.Future`` holding the outputs, usable by DDP communication hooks.

A Work holds no state of its own about how its collective went: it asks its group's watch
(:mod:`cupycoll.faults.watchdog`) by its batch's number. The watch keeps what the GPU still
uses (the batch's event and an asynchronous call's tensors) and fails every batch in flight
when the group's lifetime closes it (a timeout, an NCCL error, an abort): ``wait()`` then
raises that error, ``exception()`` returns it, ``is_completed()`` is True and a future not
yet handed out carries it. A Work whose caller saw it complete before stays a success. A
future obtained *before* a fault completes in stream order, as ProcessGroupNCCL's does.
A synchronous Work dies with its caller's reference: nothing of it is kept for the watchdog.

A Work may be *pending*: its NCCL call is queued (batched point-to-point, or inside a
coalescing block) and not yet issued. Such a Work is built with ``flush``, the queue's way
to issue; touching the Work (wait, is_completed, get_future) calls it first, so a waited
Work never hangs on an unissued call. A pending Work of a group that has ended has failed.

Deliberately left out: the fault detection itself (the watchdog) and any retry.
"""

from __future__ import annotations

import copy
import datetime
import time
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from .errors import CollectiveTimeoutError, CupycollError


class CudaWork(dist.Work):
    """The handle of one collective (or one coalesced batch) on a CUDA device."""

    __slots__ = ("op_name", "seq", "device", "_outputs", "_flush", "_blocking_wait", "_watch",
                 "_slot", "_batch", "_stream", "_async", "_seen", "_error", "_future", "_join",
                 "_unwatched")

    def __init__(self, op_name: str, device: torch.device, outputs: List[torch.Tensor], watch,
                 flush: Optional[Callable[[], None]] = None, blocking_wait: bool = False, seq: int = 0,
                 slot=None, stream: int = 0, async_op: bool = True, unwatched: bool = False):
        """``slot``, ``stream``, ``async_op``, ``unwatched``: where a Work made once its call
        is issued is (see :meth:`_issued`); a queued call's Work learns it later."""
        super().__init__()
        self.op_name = op_name
        self.seq = seq
        self.device = device
        self._outputs = outputs
        self._flush = flush  # set while queued; issues the queue
        self._blocking_wait = blocking_wait
        self._watch = watch  # the group's (cupycoll.faults.watchdog.Watch)
        self._slot = slot  # its batch's place in the watch (an InFlight), once issued
        # its batch's number there (the slot is reused once it is retired)
        self._batch = slot.seq if slot is not None else 0
        self._stream = stream  # the raw stream it was issued on
        self._async = async_op
        self._seen = False  # its caller saw it complete while the group was healthy
        self._error: Optional[BaseException] = None  # its own: it was never issued
        self._future: Optional[torch.futures.Future] = None
        # An asynchronous call captured into a CUDA graph: the event recorded after it on the
        # internal stream, which wait() joins back into the capture (None otherwise).
        self._join = None
        self._unwatched = unwatched and slot is None  # issued with Options.watch_calls off: no slot

    @classmethod
    def covering(cls, works: List["CudaWork"], blocking_wait: bool = False) -> "CudaWork":
        """One Work for the issued Works of a coalescing block (one NCCL group, one stream
        and event): its outputs are theirs, in order."""
        first, outputs, error = works[0], [], None
        for part in works:
            outputs.extend(part._outputs)
            if error is None:
                error = part._error
        work = cls("coalesced", first.device, outputs, first._watch, seq=works[-1].seq, blocking_wait=blocking_wait)
        work._issued(first._slot, first._stream, first._async, first._join, first._unwatched)
        work._error = error
        return work

    # -- called by the backend -------------------------------------------------------
    def _issued(self, slot, stream: int, async_op: bool, join=None, unwatched: bool = False) -> None:
        """The batch was enqueued on ``stream`` and is in flight in the watch as ``slot``
        (None: not watched, as a call captured into a CUDA graph, or ``unwatched``: issued
        with ``Options.watch_calls`` off, which fails once the watch closes, unless its caller
        saw it complete before: nothing tells whether an abort ended its kernel; ``join``: the
        event an asynchronous captured one's capture is joined back by)."""
        self._flush = None
        self._slot = slot
        self._batch = slot.seq if slot is not None else 0
        self._stream = stream
        self._async = async_op
        self._join = join
        self._unwatched = unwatched and slot is None

    def _failed(self, error: BaseException) -> None:
        """Issuing the queue this Work was in raised: it will never run."""
        self._flush = None
        if self._error is None:
            failure = _never_issued(self.op_name, error)
            failure.__cause__ = error
            self._error = failure
            self._future = None

    def _fail(self, error: BaseException) -> None:
        """This Work will never run (its queue was dropped): it has failed with ``error``."""
        self._flush = None
        if self._error is None:
            self._error = error
            self._future = None

    # -- its outcome, asked of the watch ---------------------------------------------
    def _failure(self) -> Optional[BaseException]:
        """The error this Work has failed with, or None (done, running, or queued)."""
        error = self._error
        if error is not None or self._seen:
            return error
        watch = self._watch
        closed = watch.closed
        if closed is None:
            return None
        if self._flush is not None or self._unwatched:  # queued, or never watched: the group ended first
            return closed
        return watch.failed(self._batch) if self._batch else None

    def _in_flight(self):
        """Its batch's slot while the watch still holds it, else None (retired: done)."""
        slot = self._slot
        return slot if slot is not None and slot.seq == self._batch else None

    def _done(self) -> bool:
        """Has the GPU finished it? (Without the fault check: see is_completed.) Asked with
        the group's device current: a query from a thread that never chose a device would
        make a context on cuda:0."""
        slot = self._in_flight()
        if slot is None:
            return True
        if not slot.sealed:  # a synchronous call's batch still open: its event recorded now
            self._watch.seal(slot)
        with self._watch.runtime.on_device(self.device.index):
            return slot.event.query()

    def describe(self) -> str:
        """op, sequence number, shapes and dtypes: what a timeout message names."""
        shapes = ", ".join(f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"
                           for t in self._outputs[:4])
        if len(self._outputs) > 4:
            shapes += f", ... ({len(self._outputs)} tensors)"
        return f"{self.op_name} #{self.seq} [{shapes}] on {self.device}"

    # -- torch's Work interface -----------------------------------------------------
    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        if self._watch.closed is not None or self._error is not None:  # the usual call skips this
            error = self._failure()
            if error is not None:
                raise error
        if self._flush is not None:
            self._flush()
        if timeout or self._blocking_wait:  # a timedelta of 0 is false: the usual call skips this
            self._wait_on_host(timeout)
        if self._flush is not None or timeout or self._blocking_wait:
            error = self._failure()
            if error is not None:
                raise error
        slot = self._slot
        if slot is not None and slot.seq == self._batch:  # still in flight
            runtime = self._watch.runtime
            index = self.device.index
            current = runtime.current_stream(index)
            # A synchronous call ran on the caller's stream: still current, it is ordered already.
            if self._async or current != self._stream:
                if not slot.sealed:
                    self._watch.seal(slot)
                if runtime.current_device() == index:
                    slot.event.wait_on(current)
                else:  # the wait is a CUDA call: made on the group's device, no other
                    with runtime.on_device(index):
                        slot.event.wait_on(current)
        elif self._join is not None:
            self._join_capture()
        return True

    def _join_capture(self) -> None:
        """An asynchronous call captured into a CUDA graph: while the caller's stream still
        captures, make it wait for the call (the capture's join, as ProcessGroupNCCL's
        wait() makes); outside the capture there is nothing to wait for."""
        runtime, index = self._watch.runtime, self.device.index
        with runtime.on_device(index):
            current = runtime.current_stream(index)
            if runtime.capturing(current):
                self._join.wait_on(current)

    def _wait_on_host(self, timeout) -> None:
        """Block the CPU: until done within ``timeout`` (raising CollectiveTimeoutError past
        it), or, with blocking wait, until the GPU is done or an abort ends the kernel."""
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout or 0)
        if seconds > 0:
            deadline = time.monotonic() + seconds
            while not self.is_completed():
                if time.monotonic() > deadline:
                    raise CollectiveTimeoutError(f"{self.describe()} did not finish within {seconds:g} s")
                time.sleep(0.0005)
        elif self._blocking_wait:
            slot = self._in_flight()
            if slot is not None:
                self._watch.seal(slot)
                with self._watch.runtime.on_device(self.device.index):
                    slot.event.synchronize()
            self._saw(True)

    def synchronize(self) -> None:
        self.wait()

    def _saw(self, done: bool) -> bool:
        """The caller learnt the GPU is ``done``: a success from now on, unless the group's
        watch had closed (an abort may have ended the kernel: the batch failed)."""
        if done and self._watch.closed is None:
            self._seen = True
        return done

    def is_completed(self) -> bool:
        if self._failure() is not None or self._seen:
            return True
        if self._flush is not None:
            self._flush()
            if self._failure() is not None:
                return True
        return self._saw(self._done())

    def is_success(self) -> bool:
        return self.is_completed() and self._failure() is None

    def exception(self):
        return self._failure()

    def source_rank(self) -> int:
        raise CupycollError(f"{self.op_name}: source_rank() is only defined for recv from any source")

    def result(self) -> List[torch.Tensor]:
        error = self._failure()
        if error is not None:
            raise error
        return self._outputs

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            error = self._failure()
            if error is None and self._flush is not None:
                self._flush()
                error = self._failure()
            if error is not None:
                self._future = failed_future(error)
                return self._future
            runtime, index = self._watch.runtime, self.device.index
            slot = self._in_flight()
            if slot is not None:
                self._watch.seal(slot)
            after = slot.event if slot is not None else None
            with runtime.on_device(index):
                if after is None and self._join is not None and runtime.capturing(runtime.current_stream(index)):
                    after = self._join  # captured: the future's stream joins the capture after the call
                self._future = runtime.future(self._outputs, index, after)
        return self._future

    def get_future_result(self):
        return self.get_future()


def _never_issued(op_name: str, error: BaseException) -> CupycollError:
    """The error of a Work whose queue failed to issue: "<op> was never issued: <error>", of
    ``error``'s own class when that is cupycoll's, so that ``except dist.DistBackendError``
    and an NcclError's ``status``/``function`` still work (each Work gets its own copy)."""
    message = f"{op_name} was never issued: {error}"
    if isinstance(error, CupycollError):
        try:
            typed = copy.copy(error)  # NcclError rebuilds from its status; others keep __dict__
            typed.args = (message,)
            return typed
        except Exception:  # noqa: BLE001 - a subclass that cannot be copied: the base class
            pass
    return CupycollError(message)


def failed_future(error: BaseException) -> torch.futures.Future:
    """A future that has failed with ``error``, for C++ callers too (DDP's reducer consumes
    a Work's future): a Python future can hand C++ an error only through a callback that
    raises, and C++ then sees a RuntimeError with the error's text ("Got the following error
    when running the callback: CollectiveTimeoutError: ..."). ``set_exception`` would store
    the error as the future's value, which C++ reads as a result."""
    def fail(_):
        raise error
    start = torch.futures.Future()
    failed = start.then(fail)
    # Raising ``error`` gives it a traceback through this frame and its callers (a Work, its
    # group); torch before 2.14 leaves that on the error, which the group holds too, so the
    # group and its gloo threads would outlive their last user until a full garbage
    # collection. The error keeps the traceback it came with.
    traceback = error.__traceback__
    try:
        start.set_result(None)
    finally:
        error.__traceback__ = traceback
    return failed


def empty_work() -> dist.Work:
    """A completed Work with no outputs (an empty coalescing block)."""
    future = torch.futures.Future()
    future.set_result([])
    return torch._C._distributed_c10d._create_work_from_future(future)
