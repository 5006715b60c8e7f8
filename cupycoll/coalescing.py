"""The coalescing block of a group's issuer: torch's ``_start_coalescing`` opens it, every
CUDA call until ``_end_coalescing`` waits in it, and its end issues them as one NCCL group
with one Work (a block of one described call, which is what torch's manager makes of a block
of all_reduces, is that call, issued as any other).

torch's ``_coalescing_manager`` never calls ``_end_coalescing`` when its body raises. A
block left open that way is discarded (its Works fail, a RuntimeWarning says so) as soon as
that is known: when the manager's generator is closed or freed, or when the next block
opens. A thread has at most one open block, of one group (:data:`open_block_owner`); a call
on another group inside it is an error rather than a silent second batch.

:class:`CoalescingBlock` is the :class:`~cupycoll.issue.Issuer`'s part that handles the block;
the state it reads and writes (``block``, ``block_manager``, ``pending``) is the issuer's.
Deliberately left out: issuing (the issuer's), detecting torch's manager on the stack (the
group's hooks hand in ``manager_ref``, from :func:`cupycoll.compat.calling_coalescing_manager`),
and making a block thread-safe: a block is one thread's, opened and closed by it.
"""

from __future__ import annotations

import inspect
import threading
import warnings

import torch.distributed as dist

from .errors import CupycollError, CupycollValueError
from .work import CudaWork, empty_work

# The issuer whose block is open in this thread (at most one: a manager coalesces one group),
# as its attribute "issuer" (read through __dict__ on the hot path: no call).
open_block_owner = threading.local()


class CoalescingBlock:
    """The open coalescing block of an issuer (a part of :class:`~cupycoll.issue.Issuer`)."""

    def open_block(self, manager_ref=None) -> None:
        """Queue every call from now on until :meth:`close_block`; ``manager_ref``: a weak
        reference to the torch coalescing manager opening the block, if one is."""
        self._backend.life.check_usable()
        if self.block is not None:
            # the block left open by a manager whose body raised is dropped, never issued
            self.discard_raised_block(stacklevel=5)
        owner = open_block_owner.__dict__.get("issuer")
        if owner is not None and owner is not self:
            owner.check_block_scope("_start_coalescing", other=self)
        if self.pending or self._issuing:
            self.flush()
        self.block = []
        self.block_manager = manager_ref
        open_block_owner.issuer = self

    def close_block(self) -> dist.Work:
        """Issue the block's calls as one NCCL group; one Work covers them all. A block of
        one call (torch's manager makes one ``allreduce_coalesced`` of its all_reduces) is
        that call, issued as any other: in one frame where it can be, its Work the block's."""
        works = self.block
        self._release_block()
        if works is None:
            raise CupycollValueError("_end_coalescing without _start_coalescing")
        self._backend.life.check_usable()  # aborted inside the block: its Works failed, say so here too
        if not works:
            return empty_work()
        pending = self.pending
        if len(works) == 1 and len(pending) == 1 and pending[0].work is works[0] and pending[0].peer is None:
            call = pending.pop()
            inner, call.work = works[0], None
            try:
                work = self.issue(call)
            except BaseException as exc:
                inner._failed(exc)  # the Work handed out inside the block says it never ran
                raise
            # The caller inside the block holds ``inner``: it answers for the call as issued.
            inner._issued(work._slot, work._stream, work._async, work._join, work._unwatched)
            return inner
        self.flush()
        return CudaWork.covering(works, blocking_wait=self._blocking_wait)

    def _release_block(self) -> None:
        self.block = None
        self.block_manager = None
        if open_block_owner.__dict__.get("issuer") is self:
            del open_block_owner.issuer

    def abandon_block(self) -> None:
        """An exception inside a coalescing block: drop what it queued, stay usable."""
        queued = self.block or []
        self._release_block()
        dropped = {id(w) for w in queued}
        self.pending = [c for c in self.pending if id(c.work) not in dropped]
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

    def check_block_scope(self, op_name: str, other: "CoalescingBlock" = None) -> None:
        """Called when the thread has an open block: it must be this group's own."""
        owner = open_block_owner.__dict__.get("issuer")
        if owner is None:
            return
        if owner.drop_stale_block() or owner.block is None:
            if open_block_owner.__dict__.get("issuer") is owner:
                del open_block_owner.issuer
            return
        if owner is self:
            return
        target = other if other is not None else self
        raise CupycollValueError(
            f"{op_name} on group {target._name()!r} inside a coalescing block of group "
            f"{owner._name()!r}: a coalescing manager batches the calls of one group; "
            "close it first or use one manager per group")
