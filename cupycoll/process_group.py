"""The torch ProcessGroup adapter: the default shape of a cupycoll group on every torch.

:class:`ProcessGroupCupycoll` is a Python subclass of ``torch.distributed.ProcessGroup``.
torch makes such an object the *whole* group (see docs/design.md), so it routes every call
itself (:class:`~cupycoll.shell.GroupShell`): CPU tensors to an inner gloo group built on the
same store, CUDA tensors to the group's :class:`~cupycoll.backend.CudaBackend` (what
``pg._get_backend(torch.device("cuda"))`` returns). This module adds what the whole group
must answer for itself: its identity (names, rank, size), the gloo half registered as its
CPU backend, and the parent it splits its communicator from.

From torch 2.14 torch can dispatch to a Python c10d Backend instead, and cupycoll can be
that (:mod:`cupycoll.py_backend`, ``CUPYCOLL_SHAPE=backend``); the adapter stays the default
there because the Works it returns reach the caller unwrapped and answer every method truly.

Deliberately left out: everything the shell does (routing, coalescing, lifetime) and below.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, ProcessGroup

from . import _args, compat, config
from .faults import all_groups
from .config import BACKEND_NAME  # noqa: F401 - re-exported: cupycoll.process_group.BACKEND_NAME
from .cpu_half import build_gloo_half
from .shell import GroupShell

_GLOO = ProcessGroup.BackendType.GLOO
_CPU = torch.device("cpu")


class ProcessGroupCupycoll(GroupShell, ProcessGroup):
    """A torch ProcessGroup whose CUDA collectives run on NCCL through CuPy."""

    def __init__(
        self,
        store,
        rank: int,
        size: int,
        timeout: Optional[datetime.timedelta] = None,
        options: Optional[config.Options] = None,
        global_ranks: Optional[Sequence[int]] = None,
        group_id: str = "",
        split_from: Optional["ProcessGroupCupycoll"] = None,
    ):
        super().__init__(rank, size)
        # The device init_process_group(device_id=...) bound the group to (None: lazy); torch
        # sees it as bound_device_id where its split_group can split this group
        # (compat.SPLIT_GROUP_REACHES_PYTHON_GROUPS).
        self.bound_device: Optional[torch.device] = None
        self._splits = 0  # split_group calls so far (every rank of the group makes each)
        self._build(store, rank, size, timeout, options, global_ranks, group_id, split_from)

    # -- construction helpers ---------------------------------------------------------
    def _build_cpu_group(self, store, rank, size, timeout) -> ProcessGroup:
        inner, gloo = build_gloo_half(store, rank, size, timeout)
        self._keep_gloo_last(gloo)
        if compat.PROCESS_GROUP_FREED_WITHOUT_GIL:
            # C++ callers asking this group for its CPU backend get the same gloo, also as
            # its default backend (which torch 2.15's flight-recorder hook looks up at init).
            self._register_backend(_CPU, _GLOO, gloo)
            compat.set_default_backend(self, _GLOO)
        return inner

    def _bind(self, device: Optional[torch.device]) -> None:
        # Eager init: torch bound the ProcessGroup it built, which our creator replaced.
        self.bound_device = device
        if compat.SPLIT_GROUP_REACHES_PYTHON_GROUPS and device is not None:
            self.bound_device_id = device

    def _split_parent(self, split_from) -> Optional["ProcessGroupCupycoll"]:
        """The group this one's communicator is split from: ``split_from`` (:meth:`split_group`),
        else the default group when torch makes subgroups of it (it was bound to a device);
        None when that group's communicator is not split (:meth:`CudaBackend.splits_children`,
        which every rank of the parent answers alike)."""
        parent = split_from
        if parent is None:
            if not self._global_ranks or not dist.is_initialized():
                return None
            parent = dist.group.WORLD
        if not isinstance(parent, ProcessGroupCupycoll) or parent is self:
            return None
        if not parent._cuda.splits_children(parent.bound_device):
            return None
        return parent

    def split_group(self, ranks, timeout: Optional[datetime.timedelta] = None, opts=None,
                    group_name: Optional[str] = None, group_desc: Optional[str] = None, **torch_extras):
        """torch's ``ProcessGroup.split_group``, which ``dist.split_group`` (and so
        ``init_device_mesh`` on a bound default group) calls on every rank of this group, each
        with its own sub-list of this group's ranks (a rank in none with another's): a
        cupycoll group of those ranks, or None on a rank not among them. Its communicator is
        one ``ncclCommSplit`` of this group's, with a color per sub-list (``NCCL_SPLIT_NOCOLOR``
        for a rank in none), when this group's is split (bound to a device, as torch requires
        here); else made anew at its first call. Its CPU half is a gloo group of its ranks.
        ``opts``: its :class:`cupycoll.Options` (torch hands back the ``options`` of this
        group's CUDA backend: this group's settings, timeout, nonblocking and algorithm
        included). torch's other arguments (2.15's ``device_types``) change nothing: a
        cupycoll group routes both devices itself."""
        members = _args.split_ranks(ranks, self._size)
        # The new group's keys live under this group's store, by the split's number and its
        # ranks: the same on every member. (torch's name for it is not: it counts the groups
        # each rank has registered, and a rank left out of an earlier split registered fewer.)
        self._splits += 1
        store = PrefixStore(f"cupycoll-split/{self._splits}/{','.join(map(str, members))}/", self._store)
        if self._rank not in members:
            # the members' split is collective over this group: a rank in none mirrors it
            self._cuda.perform_nocolor_split(self.bound_device)
            return None
        options = opts if isinstance(opts, config.Options) else self._cuda.options
        if timeout is not None and timeout not in config.torch_default_timeouts():
            options = dataclasses.replace(options, timeout=timeout)  # given: it wins
        if group_name is None:
            group_name = f"{self._group_name}:split:{','.join(map(str, members))}"
        child = type(self)(store, members.index(self._rank), len(members), timeout, options,
                           global_ranks=[self._global_ranks[r] for r in members], group_id=group_name,
                           split_from=self)
        child._set_group_name(group_name)
        if group_desc is not None:
            child._set_group_desc(group_desc)
        child._bind(self.bound_device)
        return child

    def get_group_store(self):
        """The store this group was made on (torch registers a split group with it)."""
        return self._store

    # -- identity ---------------------------------------------------------------------
    def getBackendName(self) -> str:
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    def _get_backend_name(self) -> str:
        return BACKEND_NAME

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupDesc(self) -> str:
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def _set_group_name(self, name: str) -> None:
        self._group_name = name
        super()._set_group_name(name)

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc
        super()._set_group_desc(desc)

    def _get_backend(self, device):
        device = torch.device(device)
        if device.type == "cuda":
            return self._cuda
        if device.type == "cpu" and not compat.PROCESS_GROUP_FREED_WITHOUT_GIL:
            return self._gloo_backend  # not registered in the C++ part: see _keep_gloo_last
        return super()._get_backend(device)

    def __repr__(self) -> str:
        return (f"ProcessGroupCupycoll(rank={self._rank}, size={self._size}, "
                f"device={self._cuda.device}, name={self._group_name!r})")

    def _torch_group(self) -> ProcessGroup:
        return self


compat.run_eagerly_under_compile(ProcessGroupCupycoll)


# Every live group's abort, side by side (cupycoll.faults.all_groups holds the registry of groups).
abort_all = all_groups.abort_all
