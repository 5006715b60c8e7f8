"""Work objects for collectives issued on CUDA streams.

A :class:`CudaWork` is returned for every CUDA collective. It follows ProcessGroupNCCL:
``wait()`` makes the caller's current stream wait for the collective and does not block
the CPU (unless the collective is a barrier or a CPU timeout is given), ``is_completed()``
queries a CUDA event, and ``get_future()`` returns a CUDA-aware ``torch.futures.Future``
holding the outputs, usable by DDP communication hooks.

A Work may be *pending*: its NCCL call is queued (batched point-to-point, or inside a
coalescing block) and not yet issued. Touching it (wait, is_completed, get_future) asks the
group to issue the queue first, so a waited Work never hangs on an unissued call.

Deliberately left out: the watchdog and async-error checks (a later layer).
"""

from __future__ import annotations

import datetime
import time
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from .errors import CupycollError


class CollectiveTimeoutError(CupycollError, TimeoutError):
    """``Work.wait(timeout)`` expired before the collective finished on the GPU."""


class CudaWork(dist.Work):
    """The handle of one collective (or one coalesced batch) on a CUDA device."""

    def __init__(self, op_name: str, device: torch.device, outputs: List[torch.Tensor],
                 flush: Optional[Callable[[], None]] = None, blocking_wait: bool = False):
        super().__init__()
        self.op_name = op_name
        self.device = device
        self._outputs = outputs
        self._flush = flush  # set while queued; issues the queue
        self._blocking_wait = blocking_wait
        self._stream: Optional[torch.cuda.Stream] = None
        self._event: Optional[torch.cuda.Event] = None
        self._future: Optional[torch.futures.Future] = None
        self._keepalive = None
        self._error: Optional[BaseException] = None

    # -- called by the group ---------------------------------------------------------
    def _issued(self, stream, event, keepalive=None) -> None:
        """The NCCL call was enqueued on ``stream``; ``event`` (may be None) follows it."""
        self._flush = None
        self._stream = stream
        self._event = event
        self._keepalive = keepalive

    def _failed(self, error: BaseException) -> None:
        """Issuing the queue this Work was in raised: it will never run."""
        self._flush = None
        self._error = error
        self._outputs = []

    def _ensure_issued(self) -> None:
        if self._flush is not None:
            self._flush()
        if self._error is not None:
            raise CupycollError(f"{self.op_name} was never issued: {self._error}") from self._error

    def _completion_event(self) -> torch.cuda.Event:
        # Synchronous collectives record no event on the hot path; make one on demand.
        if self._event is None:
            self._event = torch.cuda.Event()
            self._event.record(self._stream)
        return self._event

    # -- torch's Work interface -----------------------------------------------------
    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        self._ensure_issued()
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout or 0)
        if seconds > 0:
            event = self._completion_event()
            deadline = time.monotonic() + seconds
            while not event.query():
                if time.monotonic() > deadline:
                    raise CollectiveTimeoutError(
                        f"{self.op_name} on {self.device} did not finish within {seconds:g} s"
                    )
                time.sleep(0.0005)
        elif self._blocking_wait:
            self._completion_event().synchronize()
        if self._event is not None:
            torch.cuda.current_stream(self.device).wait_event(self._event)
        elif self._stream is not None and self._stream != torch.cuda.current_stream(self.device):
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
        return True

    def synchronize(self) -> None:
        self.wait()

    def is_completed(self) -> bool:
        self._ensure_issued()
        done = self._completion_event().query()
        if done:
            self._keepalive = None
        return done

    def is_success(self) -> bool:
        return self.is_completed()

    def exception(self):
        return self._error

    def source_rank(self) -> int:
        raise CupycollError(f"{self.op_name}: source_rank() is only defined for recv from any source")

    def result(self) -> List[torch.Tensor]:
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
