"""cupycoll as a c10d Backend: the shape of a cupycoll group on torch 2.14 and later when
``CUPYCOLL_SHAPE=backend`` asks for it (the ProcessGroup shape is the default: see below).

From torch 2.14 a Python subclass of ``torch._C._distributed_c10d.Backend`` is dispatched to
through torch's PyBackend trampoline, so torch builds the group's ProcessGroup itself and
registers cupycoll's backend in it, as it does its own:

* :class:`CupycollBackend` is the CUDA backend (``pg._get_backend(torch.device("cuda"))``):
  the same routing shell as the adapter (:class:`~cupycoll.shell.GroupShell`), the same
  :class:`~cupycoll.backend.CudaBackend` core, flight recorder and diagnosis;
* when the backend string names no CPU backend (``"cupycoll"``, ``"cuda:cupycoll"``), the
  group's CPU backend is a :class:`CpuView` of it: CPU calls then reach the shell too and
  go to its gloo half, recorded and diagnosed like CUDA calls. With ``"cpu:gloo,cuda:cupycoll"``
  torch's own gloo serves CPU tensors.

What differs from the adapter, because torch's ProcessGroup stands in front: a Work reaches
the caller wrapped in torch's holder, which forwards ``wait`` and ``get_future`` only: its
``is_completed`` stays False, ``is_success``/``exception`` say success whatever happened and
``result`` raises; no Work a backend returns changes that (:data:`cupycoll.compat.BACKEND_SHAPE_BY_DEFAULT`),
which is why this shape is not the default. ``type(group)`` is torch's ``ProcessGroup``.
docs/usage.md ("Two shapes") lists what each shape gives.

Deliberately left out: everything the shell does and below; reconfigure, merge, windows
and tensor allocation, which torch's trampoline offers and cupycoll does not implement
(torch's base Backend answers them).
"""

from __future__ import annotations

import datetime
import weakref
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d
from torch.distributed import PrefixStore, ProcessGroup

from . import _args, compat, config
from .config import BACKEND_NAME
from .errors import CollectiveTimeoutError, CupycollValueError, PeerFailedError
from .cpu_half import build_gloo_half
from .shell import GroupShell, group_arguments, shrinking
from .shrink import SHRINK_ABORT, check_options, survivors_arrive

_CPU = torch.device("cpu")
_GLOO = ProcessGroup.BackendType.GLOO
_CUSTOM = ProcessGroup.BackendType.CUSTOM
_ErrorType = c10d.ErrorType

# The calls torch's trampoline dispatches by the names the shell already answers to.
CALLS = ("allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather",
         "allgather_coalesced", "all_gather_single", "all_gather_single_coalesced", "gather",
         "scatter", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_single_coalesced",
         "alltoall", "all_to_all_single", "send", "recv", "recv_anysource", "barrier")


class _Capabilities:
    """What torch asks a backend it may split, coalesce, shrink...: answered in Python. The
    trampoline reads each of these by attribute, and a subclass that leaves one to the C++
    base property sends torch back into the trampoline (endless recursion), so all are here."""

    supports_splitting = False
    supports_coalescing = False
    supports_shrinking = False
    supports_reconfigure = False
    supports_window = False
    _supports_time_estimate = False


class CupycollBackend(_Capabilities, GroupShell, c10d.Backend):
    """A cupycoll group as the CUDA backend of a ProcessGroup torch built."""

    def __init__(self, store, rank: int, size: int, timeout: Optional[datetime.timedelta] = None,
                 options: Optional[config.Options] = None, global_ranks: Optional[Sequence[int]] = None,
                 group_id: str = "", process_group: Optional[ProcessGroup] = None,
                 split_from: Optional["CupycollBackend"] = None):
        c10d.Backend.__init__(self, rank, size)
        # Weak: torch's ProcessGroup owns this backend, never the other way round.
        self._group = weakref.ref(process_group) if process_group is not None else None
        self._splits = 0  # splits of this group so far (every rank of the group makes each)
        # The new group of the split under way, made where torch split the CPU backend first
        # (CpuView.split), until torch splits this one: torch makes one group by two calls.
        self._split_made: Optional["CupycollBackend"] = None
        self._build(store, rank, size, timeout, options, global_ranks, group_id, split_from)

    # -- what the shell asks of its shape ---------------------------------------------
    def _build_cpu_group(self, store, rank, size, timeout) -> ProcessGroup:
        # The shell's gloo half, as the adapter's: CPU calls routed here, and the group's
        # argument cross-checks, run on it whether or not torch has a gloo of its own.
        inner, gloo = build_gloo_half(store, rank, size, timeout)
        self._keep_gloo_last(gloo)
        return inner

    def _bind(self, device: torch.device) -> None:
        pass  # torch bound its own ProcessGroup before the eager connect

    def _split_parent(self, split_from) -> Optional["CupycollBackend"]:
        """The backend torch splits this group from (``split_from``, which torch offers only
        when the default group is bound), if its communicator can be split."""
        if not isinstance(split_from, CupycollBackend) or not dist.is_initialized():
            return None
        bound = getattr(dist.group.WORLD, "bound_device_id", None)
        return split_from if split_from._cuda.splits_children(bound) else None

    def _torch_group(self) -> Optional[ProcessGroup]:
        return self._group() if self._group is not None else None

    def getGroupName(self) -> str:
        return self._group_name

    # -- torch's Backend face ----------------------------------------------------------
    def getBackendName(self) -> str:
        return BACKEND_NAME

    def _set_group_uid(self, name: str) -> None:
        self._group_name = name
        # torch's ProcessGroup answers group_name from its backends' own record, which
        # functional collectives resolve the group by.
        c10d.Backend._set_group_uid(self, name)

    @property
    def supports_splitting(self) -> bool:
        return self._cuda.supports_splitting

    supports_coalescing = True
    supports_shrinking = True

    def shrink(self, ranks_to_exclude, shrink_flags: int = 0, opts=None) -> "CupycollBackend":
        """torch's ``dist.shrink_group``, which checked the ranks and calls this on the ranks
        that stay: the survivors' backend, its communicator taken from this one's (see
        :func:`cupycoll.shell.shrinking`), on this group's store under a prefix of its own.
        torch then destroys this group and registers the new backend in a ProcessGroup of
        its own making (under the bound device, else the CPU)."""
        check_options(opts)
        exclude = sorted(ranks_to_exclude)
        survivors = [r for r in range(self._size) if r not in exclude]
        store = PrefixStore(f"cupycoll-shrink/{','.join(map(str, survivors))}/", self._store)
        survivors_arrive(self, exclude, store, survivors.index(self._rank), len(survivors),
                         self.settings.timeout.total_seconds())
        with shrinking(self, exclude, shrink_flags == SHRINK_ABORT):
            return CupycollBackend(store, survivors.index(self._rank), len(survivors), self.settings.timeout,
                                   opts if opts is not None else self.pg_options,
                                   global_ranks=[self._global_ranks[r] for r in survivors],
                                   group_id=f"{self._group_name}:shrunk")

    @staticmethod
    def register_shrunk(group: ProcessGroup) -> ProcessGroup:
        """Register the survivors' backend in the ProcessGroup ``dist.shrink_group`` built for
        them as :func:`create` registers one: for CUDA as a custom backend (the group's
        default), its :class:`CpuView` for the CPU. torch (2.14.1, 2.15) registers it under
        the one device it finds (the bound one, else the CPU) with its own type for that
        device (NCCL, GLOO): the other device then has no backend, and torch code that trusts
        the type crashes (DDP's logger takes a "gloo" group's backend for torch's
        ProcessGroupGloo)."""
        bound = getattr(group, "bound_device_id", None)
        return _registered(group, group._get_backend(bound if bound is not None else _CPU))

    @property
    def options(self) -> c10d.Backend.Options:
        """torch's options object of this backend (its name and timeout), which torch's
        ``split_group`` reads and hands back to :meth:`split` (the new group runs with this
        group's :class:`cupycoll.Options`, which that object cannot carry)."""
        return c10d.Backend.Options(BACKEND_NAME, self.settings.timeout)

    def _set_sequence_number_for_group(self) -> None:
        """torch's start of a group's collective count, asked after a split: cupycoll's
        flight recorder numbers a group's calls itself."""

    def split(self, store, ranks, opts=None) -> Optional["CupycollBackend"]:
        """torch's ``split_group`` on this group's ProcessGroup (``dist.split_group``,
        ``init_device_mesh`` on a bound default group): the CUDA backend of the group of this
        group's ``ranks`` (the sub-list of this rank; a rank in none gets another's), or None
        on a rank not among them, which takes part in the members' ``ncclCommSplit`` with
        NCCL_SPLIT_NOCOLOR. torch splits a group's CPU backend first: where that is this
        group's :class:`CpuView`, the new group was made there and is taken here."""
        child, self._split_made = self._split_made, None
        if child is None:
            child = self._split_child(ranks)
        if child is None:
            return self._in_no_split(ranks)
        return child

    def _in_no_split(self, ranks) -> None:
        """This rank is in none of a split's sub-lists: it takes part in the members'
        ``ncclCommSplit`` (NCCL_SPLIT_NOCOLOR), then has no group. Where torch's trampoline
        cannot take "no group" back (:data:`cupycoll.compat.PY_BACKEND_SPLIT_CAN_DECLINE`),
        the call raises here, once the members' split is done."""
        self._cuda.perform_nocolor_split(getattr(dist.group.WORLD, "bound_device_id", None))
        if compat.PY_BACKEND_SPLIT_CAN_DECLINE:
            return None
        raise CupycollValueError(
            f"split_group: rank {self._rank} of process group {self._group_name!r} is in none of the "
            f"sub-lists (this rank's was taken as {sorted(ranks)}); in the c10d Backend shape torch "
            f"{torch.__version__} cannot hand a rank no group back (its trampoline crashes): name "
            "every rank in split_ranks, or use the ProcessGroup shape (CUPYCOLL_SHAPE=process_group)")

    def _split_child(self, ranks) -> Optional["CupycollBackend"]:
        """The new group of a split (see :meth:`split`), on this group's store under the
        split's number and its ranks (the same on every member, where torch's name for it is
        not: that counts the groups each rank has registered), with this group's Options."""
        members = _args.split_ranks(list(ranks), self._size)
        self._splits += 1
        if self._rank not in members:
            return None
        store = PrefixStore(f"cupycoll-split/{self._splits}/{','.join(map(str, members))}/", self._store)
        return CupycollBackend(store, members.index(self._rank), len(members), self.settings.timeout,
                               self._cuda.options, global_ranks=[self._global_ranks[r] for r in members],
                               group_id=f"{self._group_name}:split:{self._splits}", split_from=self)

    def eager_connect_single_device(self, device) -> None:
        self._cuda.eager_connect_single_device(device)

    def perform_nocolor_split(self, device) -> None:
        self._cuda.perform_nocolor_split(device)

    def start_coalescing(self) -> None:
        self._open_block()

    def end_coalescing(self):
        return self._issuer.close_block()

    def barrier(self, opts=None):
        # torch sends a barrier here only when it chose CUDA for it, and the options it
        # dispatches may name no device: then the group's (or the current) one.
        runtime = self._cuda.runtime
        device = _args.barrier_device(opts, runtime.current_device) if opts is not None else None
        if device is None:
            device = self._cuda.device or torch.device("cuda", runtime.current_device())
        return self._cuda_barrier(device)

    def get_error(self):
        """torch's ErrorType of the group's fault: TIMEOUT, REMOTE_ERROR (a peer failed),
        COMM_ERROR (anything else, an abort included), SUCCESS while healthy or shut down."""
        fault = self.fault
        if fault is None:
            return _ErrorType.SUCCESS
        if isinstance(fault, CollectiveTimeoutError):
            return _ErrorType.TIMEOUT
        if isinstance(fault, PeerFailedError):
            return _ErrorType.REMOTE_ERROR
        return _ErrorType.COMM_ERROR

    def __repr__(self) -> str:
        return (f"CupycollBackend(rank={self._rank}, size={self._size}, "
                f"device={self._cuda.device}, name={self._group_name!r})")


class CpuView(_Capabilities, c10d.Backend):
    """The CPU backend of a group whose backend string names none: each call goes to the
    shell of the group's :class:`CupycollBackend`, which routes CPU tensors to its gloo
    half. Shutdown and abort are the owner's (torch calls them on the CUDA backend too)."""

    def __init__(self, owner: CupycollBackend):
        c10d.Backend.__init__(self, owner._rank, owner._size)
        self._owner = owner

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def start_coalescing(self) -> None:
        self._owner._start_coalescing(_CPU)

    def end_coalescing(self):
        return self._owner._end_coalescing(_CPU)

    def shutdown(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def get_error(self):
        return self._owner.get_error()

    @property
    def options(self) -> c10d.Backend.Options:
        return self._owner.options

    def split(self, store, ranks, opts=None) -> Optional["CpuView"]:
        """torch splits a group's CPU backend before its CUDA one: the new group is made here
        (:meth:`CupycollBackend.split` takes it), and this is its CPU view."""
        owner = self._owner
        child = owner._split_made = owner._split_child(ranks)
        if child is None:
            return owner._in_no_split(ranks)  # torch splits the CUDA backend only if this returns
        return CpuView(child)


def _forward(name: str):
    shell_call = getattr(GroupShell, name)  # the shell's, not the CUDA backend's overrides

    def call(self, *args):
        return shell_call(self._owner, *args)
    call.__name__ = name
    call.__doc__ = f"The group's shell's ``{name}``."
    return call


for _name in CALLS:
    setattr(CpuView, _name, _forward(_name))

compat.run_eagerly_under_compile(CupycollBackend, c10d.Backend)
compat.run_eagerly_under_compile(CpuView, c10d.Backend)


def _registered(group: ProcessGroup, backend: CupycollBackend) -> ProcessGroup:
    """``group`` with ``backend`` registered as a ProcessGroup torch built for "cupycoll"
    holds it: for CUDA as a custom backend (the group's default), its CpuView for the CPU."""
    group._register_backend(torch.device("cuda"), _CUSTOM, backend)
    group._register_backend(_CPU, _GLOO, CpuView(backend))
    group._set_default_backend(_CUSTOM)
    return group


def standalone(store, rank: int, size: int, timeout: Optional[datetime.timedelta] = None,
               options: Optional[config.Options] = None, global_ranks: Optional[Sequence[int]] = None,
               group_id: str = "") -> ProcessGroup:
    """A cupycoll group in this shape made outside ``init_process_group`` (a torchft quorum's,
    :mod:`cupycoll.torchft`): torch's ProcessGroup on ``store`` holding a new backend, as
    torch's creator call would leave it; torch's registry of groups does not know it."""
    group = ProcessGroup(store, rank, size)
    backend = CupycollBackend(store, rank, size, timeout, options, global_ranks=global_ranks, group_id=group_id,
                              process_group=group)
    backend._set_group_uid(group_id)
    return _registered(group, backend)


def create(dist_backend_opts, pg_options, cls: type = None) -> CupycollBackend:
    """torch's creator call (extended API): the group's CUDA backend (``cls``, tests pass a
    stand-in), split from the parent torch names when it can be, and its :class:`CpuView`
    as the group's CPU backend when torch has none for it yet."""
    group = dist_backend_opts.process_group
    args, kwargs = group_arguments(dist_backend_opts, pg_options)
    backend = (cls or CupycollBackend)(*args, **kwargs, process_group=group,
                                       split_from=dist_backend_opts.split_from)
    if group is not None and not compat.has_backend(group, _CPU):
        # As the gloo type: torch keys a group's backends by type, and the CUDA backend,
        # registered after this, takes the custom one.
        group._register_backend(_CPU, _GLOO, CpuView(backend))
    return backend
