"""One rank of a run: what it measures with, and how the ranks agree on what happened.

:class:`Rank` holds the settings, the rank's place in the world, its device (and whether
other ranks share it: :meth:`Rank.time_sliced`), the plain gloo group used only to
coordinate, the candidates, the timer and the progress bar; it sums and combines per-rank
numbers over that group and writes the result files (rank 0).

:meth:`Rank.agree` is the one protocol for failures, used by the sweep (runner) and the
scenarios alike: every rank passes what its step raised (or None), the ranks take the
worst outcome, and each gets the same answer: None when the step worked everywhere,
otherwise a status row ``{"status": "n/a" | "error", "note": ...}``. "n/a" means "this
candidate does not do that" (an unsupported dtype, op or form); "error" means it broke.
So no rank goes on timing a step another rank could not run.

Left out: what is measured (runner, scenarios), the clocks (timing), the groups and calls
(calls), the file formats (output).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from . import metrics, output
from .calls import Candidate
from .timing import Progress, Timer

# Exceptions that mean "this candidate does not do that" rather than "it broke" (cupycoll's
# CupycollValueError and CupycollTypeError are a ValueError and a TypeError).
_UNSUPPORTED = (NotImplementedError, TypeError, ValueError)
# torch's own ways of saying a backend lacks a feature (in a RuntimeError).
_UNSUPPORTED_PHRASES = ("does not implement", "not implemented for", "not supported", "unsupported",
                        "unconvertible")


@dataclasses.dataclass
class Rank:
    config: object
    rank: int
    world: int
    device: torch.device
    transport: str
    coord: object                 # plain gloo group: barriers and summaries
    candidates: List[Candidate]
    timer: Timer
    shared_gpu: bool = False      # several ranks on this GPU: small messages' GPU times are time-sliced
    progress: Optional[Progress] = None
    rows: List[Dict] = dataclasses.field(default_factory=list)
    meta: Dict = dataclasses.field(default_factory=dict)

    def time_sliced(self, size_bytes: int) -> bool:
        """Does a GPU time of calls of ``size_bytes`` here measure the GPU's time slices
        between the ranks sharing it (:func:`metrics.time_sliced`)?"""
        return metrics.time_sliced(self.shared_gpu, size_bytes)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def say(self, line: str) -> None:
        if self.leader:
            (self.progress.write if self.progress else print)(line)

    def barrier(self) -> None:
        dist.barrier(group=self.coord)

    def total(self, values: List[float]) -> List[float]:
        """Sum over ranks (float64, through gloo)."""
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, group=self.coord)
        return t.tolist()

    def combine(self, values: List[float], mode: int) -> List[float]:
        """Per-rank times combined as nccl-tests' -a: 0 rank 0's, 1 mean, 2 min, 3 max."""
        t = torch.tensor(values, dtype=torch.float64)
        if mode == 0:
            dist.broadcast(t, src=0, group=self.coord)
        elif mode == 1:
            dist.all_reduce(t, group=self.coord)
            t /= self.world
        else:
            op = dist.ReduceOp.MIN if mode == 2 else dist.ReduceOp.MAX
            dist.all_reduce(t, op=op, group=self.coord)
        return t.tolist()

    def most(self, values: List[float]) -> List[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.coord)
        return t.tolist()

    def agree(self, exc: Optional[BaseException]) -> Optional[Dict]:
        """Did the step fail on any rank? None when it worked everywhere, else the status
        row every rank reports: ``{"status": "n/a" | "error", "note": ...}``."""
        unsupported = exc is not None and _is_unsupported(exc)
        worst = self.most([0.0 if exc is None else (1.0 if unsupported else 2.0)])[0]
        if worst == 0:
            return None
        note = _first_line(exc) if exc is not None else "failed on another rank"
        return {"status": "n/a" if worst == 1 else "error", "note": note}

    def save(self) -> None:
        """Write the files asked for (rank 0); called after every collective and scenario,
        so a run that dies later still leaves what it measured."""
        if not self.leader:
            return
        if self.config.json:
            output.write_json(self.config.json, self.meta, self.rows)
        if self.config.csv:
            output.write_csv(self.config.csv, self.meta, self.rows)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:160]


def _is_unsupported(exc: BaseException) -> bool:
    if isinstance(exc, RuntimeError):
        text = str(exc).lower()
        return any(phrase in text for phrase in _UNSUPPORTED_PHRASES)
    return isinstance(exc, _UNSUPPORTED)
