"""Work objects for collectives issued on CUDA streams.

A :class:`CudaWork` is returned for every CUDA collective. It follows ProcessGroupNCCL:
``wait()`` makes the caller's current stream wait for the collective and does not block
the CPU (unless the collective is a barrier or a CPU timeout is given), ``is_completed()``
queries a CUDA event, and ``get_future()`` returns a CUDA-aware ``torch.futures.Future``
holding the outputs, usable by DDP communication hooks.

A Work may be *pending*: its NCCL call is queued (batched point-to-point, or inside a
coalescing block) and not yet issued. Such a Work is built with ``flush``, the backend's
way to issue its queue; touching the Work (wait, is_completed, get_future) calls it first,
so a waited Work never hangs on an unissued call.

Every issued Work carries a completion event and is tracked by its group's watchdog
(:mod:`cupycoll.faults.watchdog`), which fails it with the fault (timeout, NCCL async error,
abort) if one happens first: ``wait()`` then raises the fault, ``exception()`` returns it,
``is_completed()`` is True and a future not yet handed out carries it. A future obtained
*before* the fault completes in stream order, as ProcessGroupNCCL's does.

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

    def __init__(self, op_name: str, device: torch.device, outputs: List[torch.Tensor],
                 flush: Optional[Callable[[], None]] = None, blocking_wait: bool = False,
                 seq: int = 0, peers: Optional[List[int]] = None):
        super().__init__()
        self.op_name = op_name
        self.seq = seq
        self.peers = peers  # global ranks taking part (None: the whole group)
        self.trace_entry = None  # its flight-recorder entry, when the group records
        self.watch_handle = None  # its place in the group's watch, once tracked (a WatchHandle)
        self.device = device
        self._outputs = outputs
        self._flush = flush  # set while queued; issues the queue
        self._blocking_wait = blocking_wait
        self._stream: Optional[torch.cuda.Stream] = None
        self._event: Optional[torch.cuda.Event] = None
        self._future: Optional[torch.futures.Future] = None
        self._keepalive = None
        self._error: Optional[BaseException] = None

    @classmethod
    def covering(cls, works: List["CudaWork"], blocking_wait: bool = False) -> "CudaWork":
        """One Work for the issued Works of a coalescing block (one NCCL group, one stream
        and event): its outputs are theirs, in order, and it keeps their tensors."""
        first = works[0]
        work = cls("coalesced", first.device, [t for w in works for t in w.result()],
                   seq=works[-1].seq, blocking_wait=blocking_wait)
        work._issued(first._stream, first._event, [w._keepalive for w in works])
        return work

    # -- called by the backend -------------------------------------------------------
    def _issued(self, stream, event, keepalive=None) -> None:
        """The NCCL call was enqueued on ``stream``; ``event`` (may be None) follows it."""
        self._flush = None
        self._stream = stream
        self._event = event
        self._keepalive = keepalive

    def _failed(self, error: BaseException) -> None:
        """Issuing the queue this Work was in raised: it will never run."""
        self._flush = None
        self._fail(_never_issued(self.op_name, error), cause=error)

    def _fail(self, error: BaseException, cause: Optional[BaseException] = None) -> None:
        """The watchdog (or a failed issue) ends this Work with ``error``; tensors are released."""
        self.mark_failed(error, cause)
        self.release()

    # -- what the watch asks of it (cupycoll.faults.watchdog.Watched) ------------------
    def mark_failed(self, error: BaseException, cause: Optional[BaseException] = None) -> None:
        """Record ``error`` (the first one wins) but keep the tensors: an abort marks its
        Works failed *before* ncclCommAbort, so that a caller woken by the ended kernel
        already sees the fault, and releases them only once the abort has returned."""
        if self._error is not None:
            return
        if cause is not None:
            error.__cause__ = cause
        self._error = error
        if self._future is None:
            self._future = failed_future(error)

    def release(self) -> None:
        """Drop the tensors this Work kept alive for the GPU (it is done with them)."""
        self._keepalive = None

    def query_done(self) -> bool:
        """Has the GPU finished this Work (or has it failed)? Never synchronises."""
        if self._error is not None:
            return True
        event = self._event
        return event is not None and event.query()

    def _saw_completion(self) -> None:
        """Its event fired, seen by the caller: the tensors are free, and the watch needs
        no query of its own."""
        self._keepalive = None
        handle = self.watch_handle
        if handle is not None:
            handle.cancel()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _ensure_issued(self) -> None:
        if self._flush is not None:
            self._flush()
        self._raise_if_failed()

    def _completion_event(self) -> torch.cuda.Event:
        if self._event is None:  # only a Work built by hand lacks one
            self._event = torch.cuda.Event()
            self._event.record(self._stream)
        return self._event

    def describe(self) -> str:
        """op, sequence number, shapes and dtypes, peers: what a timeout message names."""
        shapes = ", ".join(f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"
                           for t in self._outputs[:4])
        if len(self._outputs) > 4:
            shapes += f", ... ({len(self._outputs)} tensors)"
        peers = "all ranks of the group" if self.peers is None else f"ranks {self.peers}"
        return f"{self.op_name} #{self.seq} [{shapes}] on {self.device} with {peers}"
    # -- torch's Work interface -----------------------------------------------------
    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        if self._flush is not None:
            self._flush()
        if self._error is not None:
            raise self._error
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout or 0)
        if seconds > 0:
            event = self._completion_event()
            deadline = time.monotonic() + seconds
            while not event.query():
                self._raise_if_failed()
                if time.monotonic() > deadline:
                    raise CollectiveTimeoutError(
                        f"{self.describe()} did not finish within {seconds:g} s"
                    )
                time.sleep(0.0005)
        elif self._blocking_wait:
            # Returns when the GPU is done, or when an abort ends the stuck kernel.
            self._completion_event().synchronize()
            if self._error is None:
                self._saw_completion()
        if self._error is not None:
            raise self._error
        if self._event is not None:
            torch.cuda.current_stream(self.device).wait_event(self._event)
        elif self._stream is not None and self._stream != torch.cuda.current_stream(self.device):
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
        return True

    def synchronize(self) -> None:
        self.wait()

    def is_completed(self) -> bool:
        if self._error is not None:
            return True
        self._ensure_issued()
        done = self._completion_event().query()
        if done:
            self._saw_completion()
        return done

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self):
        return self._error

    def source_rank(self) -> int:
        raise CupycollError(f"{self.op_name}: source_rank() is only defined for recv from any source")

    def result(self) -> List[torch.Tensor]:
        self._raise_if_failed()
        return self._outputs

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            self._ensure_issued()
            future = torch.futures.Future(devices=[self.device])
            # set_result records an event on the current stream: make that stream one
            # that is ordered right after this collective and nothing later.
            if self._event is not None:
                stream = torch.cuda.Stream(self.device)
                stream.wait_event(self._event)
            else:
                stream = self._stream
            with torch.cuda.stream(stream):
                future.set_result(self._outputs)
            self._future = future
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


class FutureWork(dist.Work):
    """A CPU Work over a ``torch.futures.Future``, for results cupycoll computes from a gloo
    call (see :mod:`cupycoll.compat`). Unlike ``_create_work_from_future``, whose ``wait()``
    returns True even when the future failed (torch 2.7.1 to 2.15), ``wait()`` raises the
    future's error, so a gloo timeout or a dead peer is not reported as success."""

    def __init__(self, future: torch.futures.Future) -> None:
        super().__init__()
        self._future = future

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        self._future.wait()
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        return self.exception() is None

    def exception(self):
        if not self._future.done():
            return None
        try:
            self._future.wait()
        except Exception as exc:  # noqa: BLE001 - the future's own error, handed back
            return exc
        return None

    def result(self) -> List[torch.Tensor]:
        return self._future.wait()

    def get_future(self) -> torch.futures.Future:
        return self._future
