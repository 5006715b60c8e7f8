"""A group's watch: what is in flight on its streams, and what is stuck or failed there.

A :class:`Watch` per group holds the calls the group issued and the GPU has not finished,
as plain data: per stream, in issue order, an :class:`InFlight` slot (a batch number, a
pooled CUDA event recorded after the batch, the issue time, the batch's flight-recorder
entries, and its tensors for an asynchronous call). The hot path takes a slot, records its
event and appends it (:meth:`Watch.issued`); nothing else of the call outlives its caller.
Calls on one stream finish in issue order, so a pass queries the newest event of each stream
and retires everything before it at once: O(streams), not O(calls).

:meth:`Watch.check` *finds*, and never handles:

* a batch not done ``timeout`` after it was issued is a timeout;
* a call (or NCCL group, or communicator creation) inside NCCL, in the host, for longer than
  ``timeout`` is a timeout too: a blocking communicator connects inside the first call that
  needs a connection, before any event exists (:meth:`cupycoll.nccl.communicators.Communicators.stuck_call`);
* ``ncclCommGetAsyncError`` reporting an error on a communicator is an async fault;
* an exception from an event query or the async error (a sticky CUDA error) is a fault too,
  except a query refused because another thread captures a CUDA graph: not done yet.

What a finding means for the group is its lifetime's to decide (:mod:`cupycoll.faults.lifecycle`).
Once the lifetime :meth:`closes <Watch.close>` the watch (a fault was claimed, or an abort
begins), every batch still in flight has failed with the watch's :attr:`~Watch.reason`, and
so has one issued later: a Work asks the watch for its batch's outcome by number and never
reports success for it (unless its caller saw it complete before the close). Nothing is
retired while closed: the abort may end kernels whose tensors must stay held until it returns
(:meth:`Watch.release`).

The watchdog thread has each group check its watch every interval
(:mod:`cupycoll.faults.watchdog_thread`). Events are queried with the group's device current
(:meth:`Watch.on_device`); that thread queries them in thread-local capture mode
(:mod:`cupycoll.faults.watchdog_cuda`).

Deliberately left out: any device synchronisation (events are only queried), the thread that
polls, handling a finding (the lifetime's), and retries. A Python watchdog cannot detect a
thread that hangs while holding the GIL (its monitor needs the GIL too).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import List, Optional

from . import watchdog_cuda
from .. import _cuda
from ..bounds import SEAL_S
from ..errors import CollectiveTimeoutError, CommunicatorAbortedError, CupycollError, NcclError

logger = logging.getLogger(__name__)  # a child of "cupycoll"

_monotonic = time.monotonic

# A stream with this many batches in flight and no free slot: the issuing thread retires the
# finished ones itself (one event query, or a few), so that between the watchdog's passes the
# pool, not the garbage collector, serves a busy caller.
RETIRE_ON_ISSUE = 64


class InFlight:
    """One issued batch: a slot of its watch's pool, reused once retired (its event with it)."""

    __slots__ = ("seq", "event", "stream", "issued_at", "keepalive", "records", "sealed")

    def __init__(self, event):
        self.seq = 0  # the batch's number in its watch; 0 while the slot is free
        self.event = event
        # Its event is recorded after its calls. An open slot (False) is the newest of its
        # stream, synchronous calls still join it, and its event is not to be queried yet.
        self.sealed = True
        self.stream = 0
        self.issued_at = 0.0
        self.keepalive = None  # an asynchronous call's tensors, until the GPU is done
        self.records = None  # its flight-recorder entry (a list), a tuple of them, or Joined


class Finding:
    """What :meth:`Watch.check` found: the fault, and the batch or call behind it; or a fault
    found elsewhere (``source``): published by a peer, or raised to a caller of the CPU route."""

    __slots__ = ("fault", "batch", "stuck", "source")

    FOUND, PEER, CALLER = "found", "peer", "caller"

    def __init__(self, fault: CupycollError, batch: Optional[InFlight] = None, stuck: Optional[str] = None,
                 source: str = FOUND):
        self.fault = fault
        self.batch = batch  # the batch that timed out, if one did
        self.stuck = stuck  # what holds a call stuck inside NCCL, if one is
        self.source = source

    @property
    def is_timeout(self) -> bool:
        return isinstance(self.fault, CollectiveTimeoutError)


class Joined(list):
    """The flight-recorder entries of the synchronous calls that joined one open slot,
    appended in place: a burst of calls costs one append each, not a copy of the burst."""

    __slots__ = ()


def entries(records):
    """A slot's flight-recorder entries as a sequence (a single entry is stored bare, a
    batch's as a tuple, the calls that joined an open slot as :class:`Joined`)."""
    if records is None:
        return ()
    kind = type(records)
    return records if kind is tuple or kind is Joined else (records,)


def stuck_text(function: str, seconds: float) -> str:
    return (f"{function} has been inside NCCL for {seconds:.1f} s: a peer has not made this call "
            f"(a blocking communicator connects inside it, and a split waits there for every "
            f"rank), or the GPU's launch queue is full behind a stuck kernel")


class Watch:
    """The watchdog's view of one group: its calls in flight, and what is wrong with them."""

    def __init__(self, name: str, timeout: float, communicators=None, recorder=None, device=None,
                 runtime: Optional[_cuda.Runtime] = None):
        self.name = name
        self.timeout = float(timeout)
        # The group's communicators (cupycoll.nccl.communicators.Communicators): its calls
        # under way and async errors; None for a watch of Works alone.
        self.communicators = communicators
        # The group's flight recorder: retired batches are marked completed in it.
        self.recorder = recorder
        # The group's CUDA device index, current while events are made, queried and freed;
        # None until known. ``runtime``: the CUDA runtime its events come from (cupycoll._cuda).
        self.device = device
        self.runtime = runtime if runtime is not None else _cuda.current()
        # describe(records) -> the text a timeout message names the batch by: the recorder's.
        self._describe = recorder.describe_batch if recorder is not None else _describe_records
        self._streams: dict = {}  # stream -> deque of InFlight, oldest first
        self._free: List[InFlight] = []  # retired slots, their events kept for reuse
        self._joins: dict = {}  # stream -> the event its captured asynchronous batches end with
        self._seq = 0
        # The lifetime's: set once (close), read lock-free by Works and the hot path.
        self.closed: Optional[BaseException] = None
        self._failed: set = set()  # batches in flight at the close, or issued after it
        self._released = False  # the abort returned and released what was in flight
        self._lock = threading.Lock()  # one popper at a time; the close's snapshot

    # -- the hot path ------------------------------------------------------------------------
    def issued(self, stream: int, records, keepalive=None, sparse: bool = False) -> InFlight:
        """A batch was launched on ``stream`` (a raw pointer): record a pooled event after it
        and keep it in flight. ``records``: its flight-recorder entry (or a tuple of them);
        ``keepalive``: what the GPU still reads or writes (an asynchronous call's tensors).

        ``sparse``: a synchronous call's batch (no keepalive), which joins the stream's open
        slot when that one is younger than ``bounds.SEAL_S``, or opens one whose event is
        recorded later (:meth:`seal`): one event then covers a burst of calls."""
        now = _monotonic()
        queue = self._streams.get(stream)
        if queue:
            last = queue[-1]
            if not last.sealed:
                if sparse and now - last.issued_at < SEAL_S:
                    with self._lock:  # against a seal or a close beside it
                        if last.seq and not last.sealed and self.closed is None:
                            if records is not None:
                                held = last.records
                                if type(held) is not Joined:
                                    last.records = Joined((*entries(held), *entries(records)))
                                elif type(records) is tuple:
                                    held.extend(records)
                                else:
                                    held.append(records)
                            return last
                self.seal(last)
        free = self._free
        if not free and queue is not None and len(queue) >= RETIRE_ON_ISSUE:
            self._retire_stream(queue)  # the caller reclaims slots between the watchdog's passes
        slot = free.pop() if free else None
        # release() swaps the pool for an empty one and destroys the old one's events (after an
        # abort, while a call may still issue): a slot taken from the old pool may be among them.
        if slot is None or self._free is not free:
            slot = self._new_slot()
        if sparse:
            slot.sealed = False
        else:
            slot.event.record(stream)
        self._seq += 1
        slot.seq = self._seq
        slot.stream = stream
        slot.issued_at = now
        slot.keepalive = keepalive
        slot.records = records
        if queue is None:
            queue = self._streams[stream] = collections.deque()
        queue.append(slot)
        if self.closed is not None:  # after the append: the close saw it, or we see the close
            self._failed.add(slot.seq)
            if self._released:  # the abort has returned: nothing of it runs any more
                with self._lock:
                    if queue and queue[-1] is slot:
                        queue.pop()
                slot.keepalive = slot.records = None  # the slot stays its Work's: not reused
        return slot

    def seal(self, slot: InFlight) -> None:
        """Record an open slot's event (after every call that joined it; nothing for a sealed
        or freed slot), with the group's device current."""
        with self._lock:
            if slot.sealed or not slot.seq:
                return
            with self.runtime.on_device(self.device):
                slot.event.record(slot.stream)
            slot.sealed = True

    def _seal_open(self, now: float) -> None:
        """The watchdog's part: seal every open slot older than ``bounds.SEAL_S`` whose stream
        is not capturing a CUDA graph (an event recorded there would join the capture), so a
        burst's last calls complete, and time out, without a later call."""
        for queue in list(self._streams.values()):
            last = queue[-1] if queue else None
            if last is not None and not last.sealed and now - last.issued_at >= SEAL_S \
                    and not self.runtime.capturing(last.stream):
                self.seal(last)

    def _new_slot(self) -> InFlight:
        """A slot around a new pooled event, made on the group's device: CUDA records an event
        only on streams of the device it was made on, whichever device the caller has current."""
        with self.on_device():
            return InFlight(self.runtime.new_event())

    def join_event(self, stream: int):
        """The event an asynchronous batch captured into a CUDA graph on ``stream`` is recorded
        after, for its Works to join the capture back (one per stream, freed with the pool:
        calls on one stream end in order, so a wait on its newest record orders after every
        earlier batch too). The group's device current."""
        event = self._joins.get(stream)
        if event is None:
            event = self._joins[stream] = self.runtime.new_event()
        return event

    def on_device(self):
        """A context with the group's device current (nothing while it has none): where its
        events are made, queried and freed, and where the group's end runs."""
        return self.runtime.on_device(self.device)

    # -- what a Work asks ----------------------------------------------------------------
    def failed(self, seq: int) -> Optional[BaseException]:
        """The error of batch ``seq`` when it failed (it was in flight at the close), else None."""
        if self.closed is not None and seq in self._failed:
            return self.closed
        return None

    # -- closing (the lifetime's) ------------------------------------------------------------
    def close(self, reason: BaseException) -> bool:
        """Every batch in flight has failed with ``reason``, and so will any issued from now on.
        False when the watch was closed already (the first reason stays; see :meth:`explain`)."""
        with self._lock:
            if self.closed is not None:
                return False
            self.closed = reason
            for queue in list(self._streams.values()):
                self._failed.update(slot.seq for slot in list(queue))
        return True

    def explain(self, reason: BaseException) -> None:
        """The closed watch's reason, explained: what its failed Works raise from now on."""
        if self.closed is not None:
            self.closed = reason

    def release(self) -> None:
        """The abort has ended the kernels: drop every failed batch's tensors, free its slot."""
        with self._lock:
            slots = [slot for queue in self._streams.values() for slot in queue]
            self._streams = {}
            self._released = self.closed is not None
        for slot in slots:
            self._free_slot(slot, completed=False)
        if self._released:  # nothing is issued any more: the pooled events go (not on the watchdog's thread)
            free, self._free = self._free, []
            joins, self._joins = list(self._joins.values()), {}
            with self.on_device():
                for event in [slot.event for slot in free] + joins:
                    event.destroy()

    def _free_slot(self, slot: InFlight, completed: bool) -> None:
        records, slot.records, slot.keepalive = slot.records, None, None
        slot.seq = 0
        slot.sealed = True
        if completed and self.recorder is not None:
            mark = self.recorder.mark
            if type(records) is list:
                mark(records, "completed")
            else:
                for entry in entries(records):
                    mark(entry, "completed")
        self._free.append(slot)

    # -- finding completed batches ----------------------------------------------------------
    def retire(self) -> None:
        """Retire the batches the GPU has finished, per stream: the newest event first (calls
        on one stream finish in order), else a binary search for the last finished one.
        Raises what an event query raises (but a refusal during a graph capture)."""
        if self.closed is not None:
            return
        comms = self.communicators
        if comms is not None and comms.fenced():  # a multi-communicator launch may fail yet
            return
        for queue in list(self._streams.values()):
            if queue:
                self._retire_stream(queue)

    def _retire_stream(self, queue) -> None:
        finished = self._finished(queue)
        if not finished:
            return
        taken = []
        with self._lock:
            if self.closed is not None:
                return
            # Only what is still at the head as it was queried: another popper may have taken
            # some meanwhile (and a slot retired there may be in flight again, under a new number).
            for slot, seq in finished:
                if not queue or queue[0] is not slot or slot.seq != seq:
                    break
                taken.append(queue.popleft())
        for slot in taken:
            self._free_slot(slot, completed=True)

    @staticmethod
    def _finished(queue) -> list:
        """(slot, its number) of ``queue``'s oldest batches the GPU has finished (a stream's
        events fire in order): the newest event first, else a binary search."""
        slots = [(slot, slot.seq) for slot in list(queue)]
        if slots and not slots[-1][0].sealed:  # open: nothing to ask its event yet
            slots.pop()
        if not slots:
            return []
        if watchdog_cuda.query(slots[-1][0].event):
            return slots
        low, high = 0, len(slots) - 1  # slots[high] is not done; find the first that is not
        while low < high:
            middle = (low + high) // 2
            if watchdog_cuda.query(slots[middle][0].event):
                low = middle + 1
            else:
                high = middle
        return slots[:low]

    def in_flight(self) -> int:
        return sum(len(queue) for queue in list(self._streams.values()))

    def drain(self, timeout: float) -> bool:
        """Wait (polling events, never syncing) until every batch is done; False when the
        watch closes, an event query fails, or ``timeout`` seconds pass first."""
        deadline = _monotonic() + timeout
        while True:
            if self.closed is not None:
                return False
            try:
                with self.on_device():
                    self._seal_open(float("inf"))
                    self.retire()
            except Exception as exc:  # noqa: BLE001 - a sticky CUDA error: not drained
                logger.error("draining group %r failed: %r", self.name, exc)
                return False
            if not self.in_flight():
                return self.closed is None
            if _monotonic() > deadline:
                return False
            time.sleep(0.001)

    # -- finding a fault ---------------------------------------------------------------------
    def check(self, now: Optional[float] = None) -> Optional[Finding]:
        """One pass: retire what finished, then find (never handle) a fault, or None."""
        if self.closed is not None:
            return None
        now = _monotonic() if now is None else now
        try:
            with self.on_device():
                return self._check(now)
        except Exception as exc:  # noqa: BLE001 - e.g. cudaEventQuery after an illegal address
            fault = CommunicatorAbortedError(
                f"process group {self.name!r}: checking its work in flight failed ({exc!r}); "
                f"the GPU or a communicator is in an error state")
            fault.__cause__ = exc
            return Finding(fault)

    def _check(self, now: float) -> Optional[Finding]:
        self.retire()
        for queue in list(self._streams.values()):
            if not queue:
                continue
            head = queue[0]
            if head.sealed and now - head.issued_at > self.timeout and not watchdog_cuda.query(head.event):
                return Finding(CollectiveTimeoutError(
                    f"process group {self.name!r}: {self._describe(entries(head.records))} did not complete "
                    f"within {self.timeout:g} s; a peer may have hung, died or skipped it"), head)
        # After the timeouts: a slot sealed now is judged by the next pass, never against its
        # own fresh record.
        self._seal_open(now)
        comms = self.communicators
        if comms is None:
            return None
        stuck = comms.stuck_call(self.timeout, now)
        if stuck is not None:
            where = stuck_text(*stuck)
            return Finding(CollectiveTimeoutError(
                f"process group {self.name!r}: the call being issued did not complete within "
                f"{self.timeout:g} s; {where}"), stuck=where)
        for comm in comms.all():
            if self.closed is not None:  # closed meanwhile: its communicators are not ours to poll
                return None
            error = comm.async_error()
            if error is not None:
                return Finding(NcclError(error.status, error.function,
                                         f"asynchronous error on process group {self.name!r}",
                                         error.last_error))
        return None


def _describe_records(found) -> str:
    return f"a batch of {len(found)} calls" if len(found) != 1 else "a collective"
