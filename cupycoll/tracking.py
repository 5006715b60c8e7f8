"""Which of a CUDA group's issued Works the watchdog watches (the rules behind
``CudaBackend._track``, ``_track_work`` and ``_stop_watching``).

* An issued call gets one completion event per batch, recorded on the batch's stream, and
  is marked ``issued`` in the group's flight recorder; an async call's Work keeps its
  tensors until the event fires (the watchdog releases them).
* It is handed to the group's :class:`~cupycoll.watchdog.Watch` unless this thread's
  current stream is capturing a CUDA graph, as ProcessGroupNCCL does: a captured call runs
  nothing until the graph is replayed, and the watchdog's event queries would invalidate the
  capture. A Work handed over is marked ``tracked`` on its Issue: from then on its failure
  and release are the watch's (see ``CallQueue._flush``).
* The group is registered with the process's watchdog when it first tracks a Work, and again
  whenever the watchdog has no thread (one that died of an error starts anew this way).

Deliberately left out: the watchdog itself (:mod:`cupycoll.watchdog`) and issuing
(:mod:`cupycoll.backend`).
"""

from __future__ import annotations

from typing import List

import torch

from .watchdog import WATCHDOG


def capturing() -> bool:
    """Is this thread's current stream capturing a CUDA graph? (Never initializes CUDA.)"""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def watching(backend) -> bool:
    """Should the Works ``backend`` issues now be watched? Registers its watch (again) when
    they should and the watchdog has no thread."""
    if capturing():
        return False
    if not backend._watched or not WATCHDOG.running:
        WATCHDOG.watch(backend._watch)
        backend._watched = True
    return True


def track(backend, issues: List, stream, async_op: bool) -> None:
    """``CudaBackend._track``: the batch ``issues`` was launched on ``stream``."""
    event = torch.cuda.Event()
    event.record(stream)
    watched = watching(backend)
    for issue in issues:
        work = issue.work
        entry = getattr(work, "_trace_entry", None)
        if entry is None and backend._submitting is not None:  # the call being submitted now
            entry = work._trace_entry = backend._submitting
        if entry is not None:
            backend.trace.recorder.mark(entry, "issued")
        work._issued(stream, event, issue.keepalive if async_op else None)
        if watched:
            backend._watch.track(work)
            issue.tracked = True


def track_work(backend, work) -> None:
    """The queue's ``track``: a coalescing block's covering Work."""
    if watching(backend):
        backend._watch.track(work)


def stop_watching(backend) -> None:
    if backend._watched:
        WATCHDOG.unwatch(backend._watch)
        backend._watched = False
