"""The children of a communicator: new communicators made from one by a collective over it,
``ncclCommSplit`` and ``ncclCommShrink``.

:class:`ChildMaking` is a part of :class:`cupycoll.nccl.communicator.Communicator`. Its rules:

1. a child is made as every communicator is: through the ctypes bindings, with an
   ``ncclConfig_t`` in its parent's mode (blocking or not), every status read;
2. the call runs on the parent, guarded (:mod:`cupycoll.nccl.call_guard`) and noted as the
   child's: a blocking one that does not return is the child group's to time out, and a
   nonblocking one is polled for at most the child's timeout; either way a child that
   fails is the child group's fault, not its parent's;
3. a rank NCCL gives no child (a split's ``color < 0``) gets None;
4. the parent stays as it was, to be destroyed or aborted by its owner.

What the class needs of its host: ``_lib``, ``_nccl_library``, ``runtime``, ``device``,
``nonblocking``, ``timeout``, ``_guarded``, ``_poll``, and a constructor taking
``(device, rank, size, nccl_library, *, handle, nonblocking, timeout, on_abort, runtime)``
whose object has ``wait_ready()`` (the child is of the parent's class).

Deliberately left out: which ranks a child has and when one is made (the backend's), and
any agreement among the ranks beyond NCCL's own collective (the store's:
:mod:`cupycoll.nccl.bootstrap`).
"""

from __future__ import annotations

import ctypes
from typing import Callable, Optional, Sequence

from . import header as nccl_header
from ..errors import CupycollValueError


class ChildMaking:
    """The split and shrink of one communicator (see the module)."""

    def can_split(self) -> bool:
        """Whether the library this communicator holds has ncclCommSplit."""
        return self._lib.has("ncclCommSplit")

    def can_shrink(self) -> bool:
        """Whether the library this communicator holds has ncclCommShrink (NCCL 2.27)."""
        return self._lib.has("ncclCommShrink")

    def split(self, color: int, key: int, on_abort: Optional[Callable[[BaseException], None]] = None,
              child: object = None, timeout: Optional[float] = None) -> Optional["ChildMaking"]:
        """ncclCommSplit: collective over this communicator. ``color < 0`` takes no part.
        ``on_abort``, ``child`` and ``timeout``: the child group's (its timeout bounds the
        split, and a split that times out is the child's fault, not this parent's)."""
        color = color if color >= 0 else nccl_header.NCCL_SPLIT_NOCOLOR
        return self._child("ncclCommSplit", lambda parent, handle, config: self._lib.ncclCommSplit(
            parent, color, key, handle, config), on_abort, child, timeout)

    def shrink(self, exclude: Sequence[int], abort_first: bool,
               on_abort: Optional[Callable[[BaseException], None]] = None, child: object = None,
               timeout: Optional[float] = None) -> "ChildMaking":
        """ncclCommShrink: a communicator of this one's ranks but ``exclude``, collective over
        those. ``abort_first`` (NCCL_SHRINK_ABORT): what is in flight on this communicator
        is aborted before NCCL shrinks it. This communicator stays, to be destroyed or
        aborted by its owner."""
        if not self.can_shrink():
            raise CupycollValueError(
                f"shrinking a communicator needs NCCL >= 2.27 (ncclCommShrink); this process "
                f"loaded NCCL {nccl_header.version_text(self._lib.version())}")
        excluded = (ctypes.c_int * len(exclude))(*exclude)
        flags = nccl_header.NCCL_SHRINK_ABORT if abort_first else nccl_header.NCCL_SHRINK_DEFAULT
        return self._child("ncclCommShrink", lambda parent, handle, config: self._lib.ncclCommShrink(
            parent, excluded, len(exclude), handle, config, flags), on_abort, child, timeout)

    def _child(self, function: str, make, on_abort, child_name: object,
               timeout: Optional[float]) -> Optional["ChildMaking"]:
        """A communicator made from this one by ``make(parent, newcomm_ref, config_ref)`` (a
        collective over this one), in this one's mode; None when NCCL gives this rank none.
        The call is noted on this communicator as the child's: the child's watch times a
        blocking one out; a nonblocking one is polled for at most the child's ``timeout``."""
        timeout = self.timeout if timeout is None else timeout
        handle = nccl_header.ncclComm_t()
        config = nccl_header.make_config(blocking=not self.nonblocking)
        with self.runtime.on_device(self.device):
            self._guarded(function, lambda parent: make(parent, ctypes.byref(handle), ctypes.byref(config)),
                          for_child=child_name)
            self._poll(function, timeout)
        if not handle.value:
            return None
        child = type(self)(self.device, 0, 0, self._nccl_library, handle=handle.value,
                           nonblocking=self.nonblocking, timeout=timeout, on_abort=on_abort,
                           runtime=self.runtime)
        child.wait_ready()
        count, rank = ctypes.c_int(), ctypes.c_int()
        self._lib.ncclCommCount(handle, ctypes.byref(count))
        self._lib.ncclCommUserRank(handle, ctypes.byref(rank))
        child.size, child.rank = count.value, rank.value
        return child
