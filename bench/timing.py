"""Clocks and the progress bar of a rank.

:class:`Timer` measures GPU time with CUDA events (wall time in the CPU development mode)
and host time with ``perf_counter``; :class:`Progress` is a tqdm bar on rank 0's stderr,
or nothing without tqdm or a terminal.

Left out: what is timed (runner, scenarios).
"""

from __future__ import annotations

import sys
import time
from typing import Callable, List, Optional

import torch

class Timer:
    """GPU time with CUDA events (cuda), wall time around synchronous calls (cpu)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.description = ("GPU time per call (CUDA events around the -n calls, mean of ranks)"
                            if self.cuda else "wall time per call (CPU development mode)")

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def per_call(self, fn: Callable[[], None], iters: int) -> float:
        """Microseconds per call over ``iters`` back-to-back calls."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) * 1e3 / iters
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) * 1e6 / iters

    def each(self, fn: Callable[[], None], iters: int) -> List[float]:
        """Microseconds of each of ``iters`` back-to-back calls (one event pair per call)."""
        if not self.cuda:
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
            return times
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(iters)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        events[-1][1].synchronize()
        return [start.elapsed_time(end) * 1e3 for start, end in events]

    @staticmethod
    def host(fn: Callable[[], object], calls: int, sync_each: Optional[Callable[[], None]] = None) -> List[float]:
        """Host microseconds of each call: perf_counter around the call only."""
        times = []
        for _ in range(calls):
            if sync_each is not None:
                sync_each()
            t0 = time.perf_counter_ns()
            fn()
            times.append((time.perf_counter_ns() - t0) / 1e3)
        return times


class Progress:
    """A tqdm bar on stderr on rank 0 (none elsewhere, or without tqdm)."""

    def __init__(self, enabled: Optional[bool], total: int, active: bool):
        self.bar = None
        if not active or enabled is False or total <= 0:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        # disable=None: tqdm shows the bar only on a terminal, unless --progress forces it.
        self.bar = tqdm(total=total, file=sys.stderr, unit="pt", dynamic_ncols=True, leave=False,
                        disable=None if enabled is None else False)

    def update(self, text: str = "") -> None:
        if self.bar is not None:
            if text:
                self.bar.set_description_str(text, refresh=False)
            self.bar.update(1)

    def write(self, line: str) -> None:
        if self.bar is not None and not self.bar.disable:
            self.bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
