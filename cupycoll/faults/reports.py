"""What is told of a group's fault once its lifetime has claimed it: a timeout explained (which
rank is behind: the group's ``explain``, the flight recorder's diagnosis, bounded by
:data:`cupycoll.bounds.DIAGNOSIS_WAIT_S`), and the fault published to the group's other
ranks, written to the trace folder and logged. Those three may block (a store, a folder, a
logging handler), so each runs on a thread of its own
(:func:`cupycoll.faults.last_words.bounded_call`), waited for at most
:data:`cupycoll.bounds.PUBLISH_WAIT_S` (the publish, beside the end) or
:data:`cupycoll.bounds.DUMP_WAIT_S`: none can hold back the abort, nor the exit.

Deliberately left out: deciding anything (which reports a fault gets, and whether the
explained timeout becomes the group's fault: the lifetime's, :mod:`cupycoll.faults.lifecycle`),
and what the diagnosis asks the peers (:mod:`cupycoll.trace`).
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

from .. import bounds
from ..errors import CollectiveTimeoutError
from .last_words import bounded_call
from .watchdog import Finding, entries

logger = logging.getLogger(__name__)  # a child of "cupycoll"


def explained(finding: Finding, explain: Optional[Callable], timeout: float,
              name: Callable[[], str]) -> Optional[CollectiveTimeoutError]:
    """``finding``'s timeout explained by ``explain(entry, timeout)`` (``entry``: the timed-out
    batch's first flight-recorder entry, None for the call being issued), or None: no
    ``explain``, no timeout of a batch or of a call inside NCCL (a call's own error names
    itself), or an explanation that says nothing or fails (logged). ``name()``: the group's
    name, asked only for a message."""
    fault = finding.fault
    batch = finding.batch
    if explain is None or not finding.is_timeout or (batch is None and finding.stuck is None):
        return None
    entry = None
    if batch is not None:
        found = entries(batch.records)
        entry = found[0] if found else None
    try:
        message = explain(entry, timeout)
    except Exception:  # noqa: BLE001 - the plain message still describes the fault
        logger.exception("explaining the timeout of group %r failed", name())
        return None
    if not (isinstance(message, str) and message):
        return None
    told = CollectiveTimeoutError(message + (f" ({finding.stuck})" if finding.stuck else ""))
    told.__cause__ = fault.__cause__
    return told


def publish(publish: Callable[[BaseException], None], fault: BaseException):
    """Start ``publish(fault)``: what the caller joins, for at most PUBLISH_WAIT_S, once the
    group's end has run beside it."""
    return bounded_call(publish, (fault,), "cupycoll-publish")


def dump(dump: Callable[[str], object], fault: BaseException) -> None:
    """``dump(reason)``: the flight recorder written for ``fault``, waited for at most DUMP_WAIT_S."""
    bounded_call(dump, (f"{fault}",), "cupycoll-dump").join(bounds.DUMP_WAIT_S)


def log(fault: BaseException) -> None:
    """``fault`` logged once, at ERROR, as torch's nccl watchdog does; waited for at most DUMP_WAIT_S."""
    bounded_call(logger.error, ("%s; aborting the group's NCCL communicators", fault),
                 "cupycoll-log").join(bounds.DUMP_WAIT_S)
