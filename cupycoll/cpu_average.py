"""ReduceOp.AVG on the CPU route, where gloo cannot average.

gloo runs AVG as a sum that it then divides in place by the group size. On integer tensors
that division fails at ``wait()`` ("result type Float can't be cast to the desired output
type Long", torch 2.13 and 2.15 run here), and torch 2.7 refuses AVG on any dtype ("Cannot
use ReduceOp.AVG with Gloo"). Callers send it anyway: Lightning averages an int64 count
with ``ReduceOp.AVG`` on any backend not named "gloo", and NCCL (the CUDA route) averages
integers. So the CPU route asks gloo for a sum and divides here, once gloo has finished:
floating and complex tensors by true division, as gloo's own AVG does (the same bits), and
integer tensors toward zero, as NCCL's ``ncclAvg`` does (it divides the integer sum).

A reduction with AVG takes this path unless gloo averages its dtype itself (floating
tensors from torch 2.13: :data:`cupycoll.compat.GLOO_AVERAGES_FLOATS`; the two give the same
bits). bool tensors are left to gloo (it refuses them, as NCCL does).

Deliberately left out: the other ops (gloo's own), and the CUDA route (NCCL averages).
"""

from __future__ import annotations

import datetime
import threading
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from .call_forms import copied
from .compat import GLOO_AVERAGES_FLOATS

_AVG = ReduceOp.AVG


def wanted(opts, outputs: Sequence[torch.Tensor]) -> bool:
    """Does the call whose options are ``opts`` average, into ``outputs``, what gloo cannot
    (:data:`cupycoll.compat.GLOO_AVERAGES_FLOATS`)?"""
    # Every CPU reduction asks: a floating tensor, where gloo averages it, is answered without
    # reading the options (a third of a microsecond through pybind).
    if GLOO_AVERAGES_FLOATS and len(outputs) == 1 and outputs[0].is_floating_point():
        return False
    return opts.reduceOp == _AVG and not any(t.dtype == torch.bool for t in outputs)


def as_sum(opts):
    """A copy of ``opts`` (one of torch's c10d options objects) asking for ReduceOp.SUM: the
    caller's object is left as it was."""
    return copied(type(opts), opts, reduceOp=ReduceOp.SUM)


def divide(tensor: torch.Tensor, size: int) -> None:
    """``tensor`` divided by ``size`` in place: toward zero for integers (NCCL's ncclAvg),
    true division otherwise (gloo's AVG)."""
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.div_(size)
    else:
        tensor.div_(size, rounding_mode="trunc")


def summed_then_divided(call, args: Sequence, outputs: Sequence[torch.Tensor], size: int) -> dist.Work:
    """``call(*args)`` (a gloo reduction; its options last in ``args``) as a SUM, whose
    ``outputs`` are divided by ``size`` once gloo has finished (:class:`AveragedWork`)."""
    return AveragedWork(call(*args[:-1], as_sum(args[-1])), outputs, size)


class AveragedWork(dist.Work):
    """gloo's Work of a sum whose outputs are divided the first time the sum is seen
    finished: by ``wait()``, ``is_completed()``, ``is_success()``, ``result()``, or gloo's
    future where gloo gives one (its reduce-scatters give none, so the division cannot
    simply follow a future). Failures are gloo's, unchanged."""

    def __init__(self, work: dist.Work, outputs: Sequence[torch.Tensor], size: int):
        super().__init__()
        self._work, self._outputs, self._size = work, list(outputs), size
        self._divided = False
        self._dividing = threading.Lock()  # the caller's thread and gloo's (the future) may both see it

    def _divide_once(self) -> None:
        with self._dividing:
            if not self._divided:
                for tensor in self._outputs:
                    divide(tensor, self._size)
                self._divided = True

    def _saw_success(self) -> bool:
        """gloo finished the sum: divided, True; failed or unfinished: False. A finished
        Work's ``wait()`` returns at once or raises its error (gloo's ``is_success`` warns
        of its deprecation from torch 2.13 on)."""
        if not self._work.is_completed():
            return False
        try:
            self._work.wait()
        except Exception:  # noqa: BLE001 - the error is gloo's, raised by wait()
            return False
        self._divide_once()
        return True

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        done = self._work.wait(timeout) if timeout else self._work.wait()
        if done:
            self._divide_once()
        return done

    def is_completed(self) -> bool:
        if self._divided:
            return True
        done = self._work.is_completed()
        if done:
            self._saw_success()
        return done

    def is_success(self) -> bool:
        return self._divided or self._saw_success()

    def exception(self):
        return self._work.exception()

    def result(self):
        self._saw_success()
        return self._work.result()

    def source_rank(self) -> int:
        return self._work.source_rank()

    def synchronize(self) -> None:
        self.wait()

    def get_future(self) -> torch.futures.Future:
        # The callback holds the tensors, never a group: it runs on a gloo thread, which must
        # not end up holding a group's last reference.
        def divided(done):
            value = done.wait()  # gloo's error (a timeout, a dead peer) fails this future too
            self._divide_once()
            return value
        return self._work.get_future().then(divided)  # raises as gloo's does where it has none
