"""The CUDA calls of one group that are not issued yet, and its open coalescing block.

A :class:`CallQueue` decides *when* calls reach NCCL, never *how* (its owner,
:class:`~cupycoll.backend.CudaBackend`, enqueues a batch given to its ``enqueue``
callback as one NCCL group):

* a collective is issued at once, after whatever is queued: :meth:`~CallQueue.submit`
  hands it back, and the backend enqueues it itself (no callback on the hot path);
* a point-to-point call waits, and its Work carries the queue's :meth:`~CallQueue.flush`,
  so touching the Work (or making any other call) issues the batch;
* between ``_start_coalescing`` and ``_end_coalescing`` every call waits for the block's
  end, and one Work covers the block.

torch's ``_coalescing_manager`` never calls ``_end_coalescing`` when its body raises. A
block left open that way is discarded (its Works fail, a RuntimeWarning says so) as soon
as that is known: when the manager's generator is closed or freed (``manager_ref``), or when
the next block opens. A thread has at most one open block, of one group; a call on another
group inside it is an error rather than a silent second batch.

Calls are queued and issued under :attr:`CallQueue.lock`, one thread at a time; a flush
with nothing to issue returns without it (see :meth:`CallQueue.flush`), so a CPU call never
waits behind another thread's CUDA setup or blocking NCCL call.

Deliberately left out: communicators, streams and events (the backend's), detecting
torch's manager on the stack (the group's hooks hand in ``manager_ref``, from
:func:`cupycoll.compat.calling_coalescing_manager`), and making the
coalescing block thread-safe: a block is one thread's, opened and closed by it.
"""

from __future__ import annotations

import inspect
import threading
import warnings
from typing import Callable, List, Optional, Sequence, Tuple

import torch.distributed as dist

from .errors import CommunicatorAbortedError, CupycollError, CupycollValueError
from .work import CudaWork, empty_work

# The queue whose block is open in this thread (at most one: a manager coalesces one group),
# as its attribute "queue" (the fast path reads its __dict__: no call).
open_block_owner = threading.local()


def _block_owner() -> Optional["CallQueue"]:
    return open_block_owner.__dict__.get("queue")


class Issue:
    """One NCCL call (or a few, e.g. an all-to-all) waiting to be enqueued."""

    __slots__ = ("work", "launch", "finish", "keepalive", "async_op", "peer", "own_group", "prepare",
                 "tracked", "entry", "on_group")

    def __init__(self, work, launch, finish, keepalive, async_op, peer=None, own_group=False, prepare=None,
                 entry=None, on_group=False):
        self.work = work
        # its flight-recorder entry, a tuple of them (the parts of one coalesced call), or
        # None (the group records nothing)
        self.entry = entry
        self.launch = launch  # launch(comm_for_peer, stream_ptr): the NCCL calls
        # prepare(comm_for_peer), or None: the call's fallible Python steps (allocations,
        # staging, op creation), run for the whole batch before its NCCL group opens.
        self.prepare = prepare
        self.finish = finish  # finish(): copies that must follow the NCCL group, or None
        self.keepalive = keepalive
        self.async_op = async_op
        self.peer = peer  # point-to-point peer (group rank), None for collectives
        # A point-to-point call of a batch torch made (batch_isend_irecv, a coalescing block):
        # on the group's communicator, as every member's batch is, not a pair communicator.
        self.on_group = on_group
        # The ring algorithm: NCCL groups of its own plus kernels, so never inside another group.
        self.own_group = own_group
        # Set by the backend once the Work is the watchdog's (it launched; see _flush).
        self.tracked = False


class CallQueue:
    """Queued calls and the open coalescing block of one group."""

    def __init__(self, enqueue: Callable[[List[Issue]], None], check_usable: Callable[[], None],
                 watch, name: Callable[[], str], global_ranks: Sequence[int], blocking_wait: bool = False):
        self._enqueue = enqueue  # issue a batch as one NCCL group
        self._check_usable = check_usable
        self._watch = watch  # the group's: its Works ask it how their batch went
        self._name = name
        self._global_ranks = list(global_ranks)
        self._blocking_wait = blocking_wait
        # Held while calls are queued or issued (reentrant: a Work touched inside an issue
        # flushes), so two threads never make concurrent NCCL calls on one communicator.
        # drop() (the abort path) takes none: an abort must reach an issuer stuck in NCCL.
        self.lock = threading.RLock()
        self.pending: List[Issue] = []
        self.block: Optional[List[CudaWork]] = None  # Works of the open block
        self.block_manager = None  # weakref to the manager generator of the open block
        self._seq = 0
        self._issuing = 0  # batches taken out of ``pending`` and not yet issued or failed

    # -- calls -------------------------------------------------------------------------
    def submit(self, op_name, device, outputs, launch, finish, keepalive, async_op, peer,
               blocking_wait, own_group, prepare=None, entry=None,
               on_group: bool = False) -> Tuple[CudaWork, Optional[Issue]]:
        """Queue one call, or, for a collective outside a block, issue what is queued and
        hand the call back: ``(its Work, the Issue to enqueue now or None)``. The caller
        holds :attr:`lock` (CudaBackend.submit does) and enqueues that Issue itself.
        ``entry``: the call's flight-recorder entry."""
        if open_block_owner.__dict__.get("queue") is not None:
            self.check_block_scope(op_name)
        self._seq += 1
        queued = self.block is not None or peer is not None
        work = CudaWork(op_name, device, outputs, self._watch, flush=self.flush if queued else None,
                        seq=self._seq, blocking_wait=blocking_wait)
        issue = Issue(work, launch, finish, keepalive, async_op, peer, own_group, prepare, entry,
                      on_group or (peer is not None and self.block is not None))
        if queued:
            self.pending.append(issue)
            if self.block is not None:
                self.block.append(work)
            return work, None
        if self.pending:
            self._flush()
        return work, issue

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
                # A call the backend tracked launched: the watchdog and the group's fault
                # fail and release it once its kernels ended. The others never ran.
                for issue in queue:
                    if not issue.tracked:
                        issue.work._failed(exc)
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
        works = {id(i.work): i.work for i in queued}
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
        self.pending = [i for i in self.pending if id(i.work) not in works]

    # -- the coalescing block ------------------------------------------------------------
    def open_block(self, manager_ref=None) -> None:
        """Queue every call from now on until :meth:`close_block`; ``manager_ref``: a weak
        reference to the torch coalescing manager opening the block, if one is."""
        self._check_usable()
        if self.block is not None:
            # the block left open by a manager whose body raised is dropped, never issued
            self.discard_raised_block(stacklevel=5)
        owner = _block_owner()
        if owner is not None and owner is not self:
            owner.check_block_scope("_start_coalescing", other=self)
        self.flush()
        self.block = []
        self.block_manager = manager_ref
        open_block_owner.queue = self

    def close_block(self) -> dist.Work:
        """Issue the block's calls as one NCCL group; one Work covers them all."""
        works = self.block
        self._release_block()
        if works is None:
            raise CupycollValueError("_end_coalescing without _start_coalescing")
        self._check_usable()  # aborted inside the block: its Works failed, say so here too
        if not works:
            return empty_work()
        self.flush()
        return CudaWork.covering(works, blocking_wait=self._blocking_wait)

    def _release_block(self) -> None:
        self.block = None
        self.block_manager = None
        if _block_owner() is self:
            open_block_owner.queue = None

    def abandon_block(self) -> None:
        """An exception inside a coalescing block: drop what it queued, stay usable."""
        queued = self.block or []
        self._release_block()
        dropped = {id(w) for w in queued}
        self.pending = [i for i in self.pending if id(i.work) not in dropped]
        error = CupycollError("its coalescing block was abandoned (the manager's body raised)")
        for work in queued:
            work._fail(error)

    def block_is_stale(self) -> bool:
        """Did the ``_coalescing_manager`` that opened our block end without closing it?"""
        if self.block is None or self.block_manager is None:
            return False
        generator = self.block_manager()
        return generator is None or inspect.getgeneratorstate(generator) == inspect.GEN_CLOSED

    def drop_stale_block(self) -> bool:
        if not self.block_is_stale():
            return False
        self.discard_raised_block(stacklevel=5)
        return True

    def discard_raised_block(self, stacklevel: int) -> None:
        warnings.warn("cupycoll: a coalescing block left open (the manager's body raised) was "
                      "discarded; the calls it had queued were never issued", RuntimeWarning,
                      stacklevel=stacklevel)
        self.abandon_block()

    def check_block_scope(self, op_name: str, other: "CallQueue" = None) -> None:
        """Called when the thread has an open block: it must be this group's own."""
        owner = _block_owner()
        if owner is None:
            return
        if owner.drop_stale_block() or owner.block is None:
            if _block_owner() is owner:
                open_block_owner.queue = None
            return
        if owner is self:
            return
        target = other if other is not None else self
        raise CupycollValueError(
            f"{op_name} on group {target._name()!r} inside a coalescing block of group "
            f"{owner._name()!r}: a coalescing manager batches the calls of one group; "
            "close it first or use one manager per group")
