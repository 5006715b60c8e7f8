"""One issuer per group: every CUDA call a collective describes reaches NCCL here, by one
decision.

A collective (:mod:`cupycoll.collectives`) describes its call as a :class:`Call`: the op, its
device, outputs and what to keep alive, the flight-recorder entry, and what it launches: the
NCCL calls themselves (``calls``: C function and arguments, launched under one guard by
:meth:`cupycoll.nccl.communicator.Communicator.launch`), or a ``run(comm, stream)`` step
for a call of several steps (gather, scatter, all-to-all, PREMUL_SUM, an algorithm), with
the fallible Python ``prepare(comm)`` that precedes its NCCL group and the ``finish()`` that
follows it. The :class:`Issuer` then decides, once per call:

* **now, in one frame**: a call of NCCL calls alone, nothing queued, no coalescing block
  open, the group healthy, its communicator made, its device current and the stream not
  capturing a CUDA graph: launched at once on the caller's stream (synchronous) or the
  communicator's (asynchronous, after the caller's), watched, its Work returned. Blocking
  and nonblocking communicators alike, checked groups alike;
* **queued**: a point-to-point call, or any call inside a coalescing block, waits; its Work
  carries :meth:`Issuer.flush`, so touching the Work (or making any other call) issues the
  batch;
* **as one NCCL group**: everything else, after what is queued, with the batch's stream
  chosen, ordered after the caller's, its prepares first, its NCCL calls in one group (an
  algorithm's after it, on the same stream), then tracked in the watch.

The open coalescing block is handled by the issuer's :class:`~cupycoll.coalescing.CoalescingBlock`
part (:mod:`cupycoll.coalescing`).

Calls are queued and issued under :attr:`Issuer.lock`, one thread at a time; a flush with
nothing to issue returns without it (see :meth:`Issuer.flush`).

Deliberately left out: describing a call and checking its arguments (the collectives'),
routing (the group's shell), and the group's communicators, device and end (its backend's and
its lifetime's): the issuer asks its backend for the communicator a batch runs on.
"""

from __future__ import annotations

import threading
import types
from typing import Callable, List, Optional

from .coalescing import CoalescingBlock, open_block_owner
from .errors import CommunicatorAbortedError
from .faults.lifecycle import GroupState
from .faults.watchdog import entries
from .work import CudaWork

_OK = GroupState.OK


def _interrupted(exc: BaseException) -> CommunicatorAbortedError:
    """The group's fault for a KeyboardInterrupt (or exit) after part of a batch launched: a
    typed error every later call can raise (torch's futures reject a BaseException)."""
    fault = CommunicatorAbortedError(f"interrupted ({type(exc).__name__}) after part of a batch "
                                     "was launched; the peers wait for the rest")
    fault.__cause__ = exc
    return fault


class Call(types.SimpleNamespace):
    """One collective as its collective describes it (see the module), and, once issued or
    queued, its Work. Made with keywords, C-fast (no Python frame): always ``op``,
    ``device``, ``outputs``, ``keep`` (what the GPU reads or writes, held until done when
    asynchronous), ``async_op`` and ``entry`` (its flight-recorder entry, a tuple of them for
    the parts of one coalesced call, or None); then what it launches, one of:

    * ``calls``: its NCCL calls, each ``(C function, arguments before the communicator and
      stream)``;
    * ``run(comm, stream)``, or ``run(comm, stream, peer)`` for a point-to-point call
      (``peer``: the group rank of the other end);

    and where needed ``prepare(comm)`` (fallible Python steps, before the NCCL group),
    ``finish()`` (copies that must follow it), ``algorithm`` (an algorithm's name: NCCL
    groups of its own plus kernels, so never inside another group), ``blocking_wait`` and
    ``on_group`` (a point-to-point call of a batch torch made: on the group's communicator).
    The issuer sets ``work`` and ``tracked`` (its batch launched and the watch has it)."""

    calls = run = prepare = finish = peer = algorithm = work = None
    blocking_wait = on_group = tracked = False


class Issuer(CoalescingBlock):
    """The calls of one group on their way to NCCL (see the module). ``backend``: the group's
    :class:`~cupycoll.backend.CudaBackend` (communicators, device, runtime, watch, lifetime);
    ``recorder``: its flight recorder, or None."""

    def __init__(self, backend, recorder, name: Callable[[], str], blocking_wait: bool = False):
        self._backend = backend
        self._recorder = recorder
        self._watch = backend.watch
        self._name = name
        self._blocking_wait = blocking_wait
        self._watch_calls = backend.settings.watch_calls
        # Held while calls are queued or issued (reentrant: a Work touched inside an issue
        # flushes), so two threads never make concurrent NCCL calls on one communicator.
        # drop() (the abort path) takes none: an abort must reach an issuer stuck in NCCL.
        self.lock = threading.RLock()
        self.pending: List[Call] = []
        self.block: Optional[List[CudaWork]] = None  # Works of the open block
        self.block_manager = None  # weakref to the manager generator of the open block
        self._seq = 0
        self._issuing = 0  # batches taken out of ``pending`` and not yet issued or failed
        self._order_event = None  # orders the internal stream after the caller's

    # -- the decision ------------------------------------------------------------------
    def issue(self, call: Call) -> CudaWork:
        """Launch ``call`` now in one frame, queue it, or issue it as one NCCL group; its Work.

        Now: a call of NCCL calls alone, nothing queued, no block open on this thread, the
        group healthy, its communicator made, its device current, the stream not capturing
        (each checked again under the lock where another thread can change it)."""
        backend = self._backend
        calls = call.calls
        if calls is None or call.peer is not None or self.block is not None or self.pending \
                or open_block_owner.__dict__:
            return self._later(call)
        comm = backend.comms.group
        runtime, index = backend.runtime, backend._index
        if comm is None or backend.life.state is not _OK or runtime.current_device() != index:
            return self._later(call)
        current = runtime.current_stream(index)
        if runtime.capturing(current):
            return self._later(call)
        with self.lock:
            if self.pending or self.block is not None or backend.life.state is not _OK:
                return self._later(call)
            async_op = call.async_op
            if async_op:
                stream, keep = comm.stream, call.keep
                self._order_after(current, stream)
            else:
                stream, keep = current, None
            entry, recorder = call.entry, self._recorder
            if type(entry) is list:
                recorder.mark(entry, "issued")
            elif entry is not None:
                recorder.mark_all(entry, "issued")
            try:
                if len(calls) == 1:
                    comm.launch(calls, stream)
                else:
                    with comm.group():
                        comm.launch(calls, stream)
            except BaseException as exc:
                if entry is not None:
                    recorder.mark_all(entry, "failed")
                timed_out = backend.life.timeout_that_cut(exc)
                if timed_out is not None:
                    raise timed_out from exc
                raise
            try:
                slot = self._watch.issued(stream, entry, keep, not async_op) if self._watch_calls else None
            except BaseException as exc:  # launched, not watched: the group's fault, not a silent loss
                backend.life.fault_once(exc if isinstance(exc, Exception) else _interrupted(exc))
                raise
            self._seq += 1
            return CudaWork(call.op, call.device, call.outputs, self._watch, seq=self._seq,
                            blocking_wait=call.blocking_wait or self._blocking_wait, slot=slot, stream=stream,
                            async_op=async_op, unwatched=not self._watch_calls)

    def _later(self, call: Call) -> CudaWork:
        """Queue ``call``, or issue it after what is queued, as one NCCL group."""
        backend = self._backend
        with self.lock:
            if backend.device is None:
                backend._adopt_device(call.device)  # the first CUDA call picks the group's device
            if open_block_owner.__dict__.get("issuer") is not None:
                self.check_block_scope(call.op)
            self._seq += 1
            queued = self.block is not None or call.peer is not None
            work = call.work = CudaWork(call.op, call.device, call.outputs, self._watch,
                                        flush=self.flush if queued else None, seq=self._seq,
                                        blocking_wait=call.blocking_wait or self._blocking_wait)
            if queued:
                if call.peer is not None and self.block is not None:
                    call.on_group = True  # a coalescing block's point-to-point: the group's communicator
                self.pending.append(call)
                if self.block is not None:
                    self.block.append(work)
                return work
            if self.pending:
                self._flush()
            self._enqueue([call])
        return work

    # -- the queue ---------------------------------------------------------------------
    def flush(self) -> None:
        """Issue every queued call as one NCCL group (not while a coalescing block is open:
        its calls wait for the block's end, as torch's own collectives do inside one).

        With nothing queued, no block open and no batch being issued, it returns without the
        lock. That is safe: a Work that can be touched was queued (appended to ``pending``,
        under the lock) before it was returned, so seeing ``pending`` empty means its batch
        was taken out, and ``_flush`` counts ``_issuing`` up *before* it takes a batch out
        and down only *after* its Works are issued or failed. Reading ``pending`` first,
        then ``_issuing`` (each read is atomic, and seen in program order, under the GIL),
        a flush thus either finds work to wait for, or finds its Work settled. A batch that
        another thread is still building (not yet appended) is that thread's to issue."""
        if not self.pending and self.block is None and not self._issuing:
            return
        with self.lock:
            self._flush()

    def _flush(self) -> None:  # the caller holds the lock
        closed = self._watch.closed
        if closed is not None:  # the group ended: nothing queued will ever be issued
            self.drop(closed)
            return
        if self.block is not None:
            self.drop_stale_block()
        if not self.pending or self.block is not None:
            return
        self._issuing += 1  # before the batch leaves ``pending``: see flush()
        try:
            queue, self.pending = self.pending, []
            try:
                self._enqueue(queue)
            except BaseException as exc:
                # A call the watch has launched: the watchdog and the group's fault fail and
                # release it once its kernels ended. The others never ran.
                for call in queue:
                    if not call.tracked:
                        call.work._failed(exc)
                raise
        finally:
            self._issuing -= 1

    def drop(self, reason: Optional[BaseException] = None) -> None:
        """The group ended: every queued call is forgotten and its Work (and every Work of
        the open block) fails with ``reason``, never issued. (A Work touched after the end
        sees it failed before it flushes: see CudaWork; this lets go of the tensors.)"""
        if reason is None:
            reason = CommunicatorAbortedError(f"process group {self._name()!r} was aborted")
        queued = list(self.pending)
        works = {id(c.work): c.work for c in queued}
        for work in self.block or []:
            works.setdefault(id(work), work)
        # The block stays open (so _end_coalescing finds it and raises the abort, instead of
        # "without _start_coalescing"), but empty: nothing of it may be issued.
        if self.block is not None:
            self.block = []
        # Failed before they leave ``pending``: a flush that then finds it empty and returns
        # without the lock (see flush()) finds its Work failed, never silently "done".
        for work in works.values():
            work._flush = None
            work._fail(reason)
        self.pending = [c for c in self.pending if id(c.work) not in works]

    # -- issuing a batch -----------------------------------------------------------------
    def _enqueue(self, batch: List[Call]) -> None:
        """Issue ``batch`` as one NCCL group, with the group's device current: NCCL sets back
        the device current when it was called, and an event or stream call with another one
        current makes a context there (a rank on cuda:3 whose thread never chose a device
        would hold one on cuda:0)."""
        backend = self._backend
        with backend.runtime.on_device(backend.device.index):
            self._enqueue_here(batch)

    def _enqueue_here(self, batch: List[Call]) -> None:
        backend = self._backend
        device, runtime = backend.device, backend.runtime
        if len(batch) == 1 and batch[0].peer is None:  # one collective
            comms = None
            if backend.comm is None:
                backend.comm_for(device)
        else:
            if any(c.peer is None or c.on_group for c in batch):
                backend.comm_for(device)
            # Pair communicators are created in one global order (by peer), so creating
            # them can never wait in a cycle.
            comms = {peer: backend.p2p_comm(peer)
                     for peer in sorted({c.peer for c in batch if not c.on_group} - {None})}
        current = runtime.current_stream(device.index)
        async_op = batch[0].async_op if len(batch) == 1 else any(c.async_op for c in batch)
        if async_op:
            stream = (backend.comm or comms[min(comms)]).stream
            self._order_after(current, stream)
        else:
            stream = current
        # Marked issued before the launch: a launch stuck inside NCCL (a blocking connect) is
        # then the call the flight recorder and the diagnosis name.
        recorder = self._recorder
        if recorder is not None:
            for call in batch:
                recorder.mark_all(call.entry, "issued")
        launched = []  # not empty once part of the batch may be on the stream
        try:
            if async_op:
                # The internal stream current for what launch/finish allocate and copy.
                with runtime.use_stream(stream, device.index):
                    self._launch_all(batch, comms, stream, launched)
            else:
                self._launch_all(batch, comms, stream, launched)
        except BaseException as exc:
            if launched:  # it runs (its tensors stay kept) and the peers wait for the rest
                try:
                    self._track(batch, stream, current, async_op)
                except Exception:  # noqa: BLE001 - untracked: the queue fails them
                    pass
                backend.life.fault_once(exc if isinstance(exc, Exception) else _interrupted(exc))
            elif recorder is not None:
                for call in batch:
                    recorder.mark_all(call.entry, "failed")
            timed_out = backend.life.timeout_that_cut(exc)
            if timed_out is not None:
                raise timed_out from exc
            raise
        self._track(batch, stream, current, async_op)

    def _order_after(self, current: int, stream: int) -> None:
        """Make ``stream`` wait for what the caller enqueued on ``current`` so far (the group's
        device current)."""
        event = self._order_event
        if event is None:
            event = self._order_event = self._backend.runtime.new_event()  # of the group's device
        event.record(current)
        event.wait_on(stream)

    def _track(self, batch: List[Call], stream: int, current: int, async_op: bool) -> None:
        """Put the launched batch in flight in the watch (not a call captured into a CUDA
        graph, as ProcessGroupNCCL: it runs nothing until replayed, and the watchdog's event
        queries would invalidate the capture; nor any with ``Options.watch_calls`` off), and
        tell its Works where it is. An asynchronous batch captured into a graph from
        ``current`` forked the internal stream off it: its Works keep an event recorded after
        the batch, which ``wait()`` joins back into the capture."""
        join = None
        backend = self._backend
        if backend.runtime.capturing(stream):
            slot = None
            backend.captured = True
            if async_op:
                join = self._watch.join_event(stream)
                join.record(stream)
        elif not self._watch_calls:
            slot = None
        else:
            if len(batch) == 1:
                records, keepalive = batch[0].entry, [batch[0].keep] if async_op else None
            else:
                found, keepalive = [], [] if async_op else None
                for call in batch:
                    found.extend(entries(call.entry))
                    if async_op:
                        keepalive.append(call.keep)
                records = found[0] if len(found) == 1 else tuple(found) if found else None
            slot = self._watch.issued(stream, records, keepalive, not async_op)
        for call in batch:
            call.work._issued(slot, stream, async_op, join, unwatched=not self._watch_calls)
            call.tracked = True

    def _launch_all(self, batch: List[Call], comms, stream: int, launched=None) -> None:
        # Every prepare of the batch runs before its NCCL group opens, as ncclGroupEnd
        # would launch a partial batch. One that raises makes no NCCL call; flush fails the
        # Works. From the first launch on (``launched``), a failure faults the group instead.
        launched = [] if launched is None else launched
        backend = self._backend
        if len(batch) == 1:
            call = batch[0]
            if call.prepare is not None:
                call.prepare(self._comm_of(call, comms))
            if call.algorithm is not None:  # an algorithm: several steps, any of them may fail
                launched.append(call)
            if call.peer is None and call.calls is not None:
                comm = backend.comm
                if len(call.calls) == 1:
                    comm.launch(call.calls, stream)
                else:
                    with comm.group():
                        comm.launch(call.calls, stream)
            else:
                self._launch(call, comms, stream)
            launched.append(call)  # its NCCL calls (or own NCCL groups) did not raise
        else:
            for call in batch:
                if call.prepare is not None:
                    call.prepare(self._comm_of(call, comms))
            launched.append(batch)  # ncclGroupEnd launches whatever the group got, even on error
            # One NCCL group for the batch; every communicator of the group has the same library.
            with (backend.comm or comms[min(comms)]).group():
                for call in batch:
                    if call.algorithm is None:
                        self._launch(call, comms, stream)
            # Algorithms' calls follow the group on the same stream, in the same order on every rank.
            for call in batch:
                if call.algorithm is not None:
                    self._launch(call, comms, stream)
        for call in batch:
            if call.finish is not None:
                call.finish()

    def _comm_of(self, call: Call, comms):
        """The communicator ``call`` runs on: the group's, or its peer's pair communicator."""
        return self._backend.comm if call.peer is None or call.on_group else comms[call.peer]

    def _launch(self, call: Call, comms, stream: int) -> None:
        if call.peer is None:
            if call.calls is not None:
                self._backend.comm.launch(call.calls, stream)
            else:
                call.run(self._backend.comm, stream)
            return
        comm = self._comm_of(call, comms)
        # On a two-rank pair communicator the peer is whichever of the two we are not.
        call.run(comm, stream, call.peer if comm is self._backend.comm else 1 - comm.rank)
