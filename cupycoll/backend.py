"""The CUDA half of a cupycoll group: what ``pg._get_backend(torch.device("cuda"))`` returns.

A :class:`CudaBackend` holds what a group's CUDA calls run on:

* **torch's Backend face**: eager connect (``init_process_group(device_id=...)``), the
  no-color split of a rank left out of a subgroup, ``supports_splitting``, ``options``;
* **the device**: chosen by the first CUDA call (or ``device_id``), checked for every tensor
  (:meth:`~CudaBackend.check_device`), and the CUDA runtime every CUDA call goes through
  (:mod:`cupycoll._cuda`);
* **communicators** (:class:`~cupycoll.nccl.communicators.Communicators`, shared with the
  group's lifetime): one per group on one device, created lazily at the first CUDA call
  (or eagerly), from a unique id shared through the store (:mod:`cupycoll.nccl.bootstrap`),
  split from a bound parent's or shrunk from a parent's; two-rank pair communicators for
  lone point-to-point calls (see :meth:`~CudaBackend.p2p_comm`);
* **the plans** of its reductions (by dtype and op), and the **runners** of cupycoll's
  algorithms (:mod:`cupycoll.algorithms`, such as the ring), one per algorithm and
  communicator, made on first use (with the group's store, under the algorithm's prefix,
  for one that needs it);
* **the watch and the lifetime** (:mod:`cupycoll.faults`): what is in flight, and how the
  group ends.

The backend knows its group only through callbacks it holds weakly (``name`` for messages,
``on_abort`` to shut the group's gloo half down, ``on_bind`` to set its bound device), so
torch may keep this object without keeping the group alive, and no reference cycle forms.

Deliberately left out: torch's routing and its coalescing-manager protocol (the group's,
:mod:`cupycoll.shell`), what each collective launches (:mod:`cupycoll.collectives`), when
and on which stream a call is issued (:mod:`cupycoll.issue`), and the group's state and end
(its lifetime's; a faulted group is shrunk to its survivors or replaced: docs/faults.md).
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
import zlib
from typing import Callable, List, Optional, Sequence

import torch
from torch.distributed import PrefixStore

from . import _cuda, algorithms, compat, config
from .errors import (CollectiveTimeoutError, CommunicatorAbortedError, CupycollTypeError, CupycollValueError,
                     NcclError)
from .faults import all_groups, lifecycle
from .faults.lifecycle import GroupState
from .faults.watchdog import Watch
from .nccl.bootstrap import StoreBootstrap
from .nccl.communicator import Communicator
from .nccl.communicators import Communicators


def _nothing() -> None:
    return None


def _weak(callback: Callable) -> Callable:
    """``callback`` without a strong reference to its object when it is a bound method
    (after the object is gone, calling it does nothing)."""
    if not inspect.ismethod(callback):
        return callback
    ref = weakref.WeakMethod(callback)

    def call(*args):
        method = ref()
        return None if method is None else method(*args)
    return call


def split_color(ranks: Sequence[int]) -> int:
    """The ncclCommSplit color of the subgroup of ``ranks``: identical on every member,
    distinct (with high probability) across groups."""
    return zlib.crc32(",".join(map(str, sorted(ranks))).encode()) & 0x7FFFFFFF


class CudaBackend:
    """Device, communicators, plans and algorithm runners of one group; its state and end are its lifetime's."""

    supports_coalescing = False
    supports_time_estimate = False

    def __init__(self, store, rank: int, size: int, settings: config.Settings,
                 global_ranks: Optional[Sequence[int]] = None, group_id: str = "",
                 name: Callable[[], str] = lambda: "", on_abort: Callable[[], None] = _nothing,
                 on_bind: Callable[[torch.device], None] = lambda device: None, trace=None):
        self.rank = rank
        self.size = size
        self.settings = settings
        self.global_ranks = list(global_ranks or range(size))
        self._name = _weak(name)
        self._on_bind = _weak(on_bind)
        self.device: Optional[torch.device] = None
        # The device's index once chosen (-1: none): ``_index`` is where its streams and guard
        # are, ``_device_index`` what ``get_device()`` says of a tensor there (the issuer's
        # one-frame test; the CPU tests' stand-in, whose CPU tensors stand in, says -1).
        self._index = -1
        self._device_index = -1
        # The CUDA runtime every CUDA call of the group's goes through (cupycoll._cuda): the
        # one in force when the group was built.
        self.runtime = _cuda.current()
        self.comms = Communicators()
        self._p2p_on_group = False  # the group's communicator was made at init: P2P uses it
        # The group's flight recorder (cupycoll.trace.group.GroupTrace), if any.
        self.trace = trace
        recorder = trace.recorder if trace is not None else None
        self._recorder = recorder
        timeout = settings.timeout.total_seconds()
        self._store = store  # the group's: its communicators' unique ids, the algorithms that need one
        self._bootstrap = StoreBootstrap(store, rank, timeout, self._name, _weak(self.check_usable))
        self.watch = Watch(group_id or "default", timeout, self.comms, recorder, runtime=self.runtime)
        self.life = lifecycle.GroupLifetime(
            self._name, self.watch, self.comms, settings.watchdog_interval, settings.on_timeout,
            explain=trace.explain_timeout if trace is not None else None, close_cpu=_weak(on_abort),
            publish=trace.publish_fault if trace is not None else None,
            dump=trace.dump_fault if trace is not None else None)
        all_groups.LIVE.add(self.life)  # what abort_all and the exit hook abort while the group lives
        if trace is not None:  # the faults the trace finds, and those a peer publishes, are the lifetime's
            trace.attach(_weak(self.life.caller_fault), _weak(self.life.peer_fault))
        # The plans of its reductions, by (dtype, torch's ReduceOp), under the group's own
        # algorithm (cupycoll.collectives looks them up; PREMUL_SUM, whose factor is per call, never).
        self.plans: dict = {}
        # A call was captured into a CUDA graph: NCCL's finalize then waits for every such
        # graph to be destroyed, so the group's shutdown aborts instead (bounded).
        self.captured = False

    # What ``is_cuda`` says of a tensor on the group's device, beside its device index
    # (get_device() gives any accelerator's index: an XPU tensor's 0 is not cuda:0's). The CPU
    # tests' backend, whose CPU tensors stand in for CUDA ones, says False.
    _tensors_are_cuda = True

    # The group's state and fault are its lifetime's (cupycoll.faults.lifecycle).
    @property
    def state(self) -> GroupState:
        return self.life.state

    @property
    def fault(self) -> Optional[BaseException]:
        return self.life.fault

    def check_usable(self) -> None:
        self.life.check_usable()

    @property
    def comm(self) -> Optional[Communicator]:
        """The group's own communicator (None until made)."""
        return self.comms.group

    @comm.setter
    def comm(self, comm: Optional[Communicator]) -> None:
        self.comms.group = comm

    # -- torch's Backend face ----------------------------------------------------------
    # torch's dist.shrink_group asks the backend it finds for the group's device (this one,
    # on the ProcessGroup shape) and would refuse with its own TypeError; a group of that
    # shape is shrunk as a whole, by cupycoll.shrink_group, which shrink() names.
    supports_shrinking = True

    def shrink(self, ranks_to_exclude, shrink_flags=0, pg_options=None):
        raise CupycollTypeError(
            f"process group {self.name!r} is a cupycoll group, which torch.distributed.shrink_group "
            f"cannot shrink in this shape: call cupycoll.shrink_group({list(ranks_to_exclude)!r}, group) "
            "with the same arguments (it takes torch's signature); nothing was changed")

    @property
    def supports_splitting(self) -> bool:
        # torch asks this while creating *any* subgroup of a bound default group, whatever
        # the new group's backend: splitting must only be offered for cupycoll groups, or a
        # new_group(backend="nccl") would get this backend as ProcessGroupNCCL's split_from,
        # and its non-members would split our communicator while its members never do.
        # Asked outside group creation, it is offered.
        creating = compat.cuda_backend_being_created()
        return creating is None or creating == config.BACKEND_NAME

    def eager_connect_single_device(self, device) -> None:
        """Eager init (``device_id``): bind the group to ``device`` and connect now. torch
        set ``bound_device_id`` on the ProcessGroup it built before our creator replaced it,
        so the group torch keeps is bound here (``on_bind``)."""
        device = torch.device(device)
        self._on_bind(device)
        self.comm_for(device)
        self._p2p_on_group = True  # made at init, on every rank: see p2p_comm

    @property
    def options(self) -> config.Options:
        """The group's settings as :class:`cupycoll.Options`: what torch's ``split_group``
        copies from the parent's backend and hands back for the new group."""
        return self.settings.as_options()

    def _set_sequence_number_for_group(self) -> None:
        """torch's start of a group's collective count, asked after a split: cupycoll's flight
        recorder numbers a group's calls itself."""

    def perform_nocolor_split(self, device) -> None:
        # torch calls this on ranks left out of a new subgroup, with the default group's
        # bound device; it must mirror the members' split exactly: the same predicate.
        if self.splits_children(device):
            self.comm.split(-1, self.rank)

    def name(self) -> str:
        return config.BACKEND_NAME

    # -- device --------------------------------------------------------------------------
    def check_device(self, tensor: torch.Tensor, what: str) -> torch.device:
        if tensor.layout is not torch.strided:  # sparse tensors have no strides to check or send
            raise CupycollTypeError(f"{what} is a {tensor.layout} tensor: the CUDA route has no sparse "
                                    "collectives (pass tensor.to_dense())")
        device = self._device_of(tensor)
        if self.device is not None and device != self.device:
            raise CupycollValueError(
                f"{what} is on {device} but this group's communicator is on {self.device}")
        if not tensor.is_contiguous():
            raise CupycollValueError(
                f"{what} is not contiguous (shape {tuple(tensor.shape)}, strides {tensor.stride()})")
        return device

    @staticmethod
    def _device_of(tensor: torch.Tensor) -> torch.device:
        """The device ``tensor`` is on (the CPU tests' stand-in names the one its CPU tensors
        stand for)."""
        return tensor.device

    def _adopt_device(self, device: torch.device) -> None:
        if device.index is None:
            device = torch.device("cuda", self.runtime.current_device())
        self.device = device
        self._index = self._device_index = device.index
        self.watch.device = device.index  # its events are queried with it current (not cuda:0)
        # Watched from now: a call can be stuck inside NCCL before any event exists.
        self.life.watching()

    # -- communicators -----------------------------------------------------------------
    def splits_children(self, bound_device) -> bool:
        """Do subgroups get their communicators by splitting this one? Only when the group
        is bound to a device (``bound_device``: torch's ``pg.bound_device_id``)."""
        return (self.settings.comm_split and self.comm is not None and bound_device is not None
                and self.comm.can_split())

    def split_from(self, parent: "CudaBackend") -> None:
        """This group's communicator, split from ``parent``'s (collective over the parent).
        The split is this group's call: its watch times it out, not the parent's."""
        self.comms.parent = parent.comm
        self.life.watching()
        try:
            self.comm = parent.comm.split(split_color(self.global_ranks), self.rank, self.life.fault_once,
                                          child=self.comms, timeout=self.settings.timeout.total_seconds())
        finally:
            self.comms.parent = None
        self._adopt_device(parent.device)
        self._p2p_on_group = self.comm is not None  # made at construction on every member

    def shrink_from(self, parent: "CudaBackend", exclude: Sequence[int], abort_first: bool) -> str:
        """This group's communicator from ``parent``'s without the parent's ranks ``exclude``
        (collective over the survivors, who all call it), and the parent's end: its Works in
        flight fail first, then its communicators are aborted. Returns how the communicator
        was made: ``"ncclCommShrink"`` when every survivor's parent communicator is healthy
        and its NCCL has it (``NCCL_SHRINK_ABORT`` when ``abort_first`` or work is in
        flight), else ``"new"``: made anew on this group's store, at once when the parent
        had a device, on first use when it had none. The shrink is this group's call: its
        watch times it out."""
        comm = parent.comm
        live = comm is not None and parent.life.usable and comm.state == "ok" and comm.can_shrink()
        reason = CommunicatorAbortedError(
            f"process group {parent._name()!r} was shrunk (ranks {sorted(exclude)} left out); "
            "use the group shrink_group returned")
        if not self._bootstrap.all_agree("shrink", live, self.size):
            parent.life.replace(reason)
            if parent.device is not None:
                self.comm_for(parent.device)
                self._p2p_on_group = True  # made now, on every member
            return "new"
        abort_first = abort_first or parent.life.work_in_flight()
        made: List[Communicator] = []
        self.comms.parent = comm
        self.life.watching()
        try:
            parent.life.replace(reason, before_kernels_end=lambda: made.append(comm.shrink(
                exclude, abort_first, self.life.fault_once, child=self.comms,
                timeout=self.settings.timeout.total_seconds())))
        finally:
            self.comms.parent = None
        self.comm = made[0]
        self._adopt_device(parent.device)
        self._p2p_on_group = True
        return "ncclCommShrink"

    def comm_for(self, device: torch.device) -> Communicator:
        """The group's communicator, created on ``device`` on first use.

        A creation that fails after the store gate faults the group, as a timed-out
        collective does (its peers failed or are stuck in the same creation)."""
        self.check_usable()
        if self.comm is None:
            if device.index is None:
                device = torch.device("cuda", self.runtime.current_device())
            self.life.watching()  # a blocking creation waits for every peer inside NCCL
            comm = self._connect("comm", self.rank == 0, self.size, self.rank, device.index)
            self.comm = comm
            self._recheck(comm)
            self._adopt_device(device)
        return self.comm

    def p2p_comm(self, peer: int) -> Communicator:
        """The communicator for a point-to-point call with ``peer``: the group's own when it
        was made at init (eager ``device_id``, or split from a bound parent), otherwise always
        one of just the two ranks, created on first use (a send between two ranks never needs
        the others). Never "the group's own once it exists": when that happens differs by
        rank (rank 0 may have made its first collective before a send that rank 1 receives
        before its own), and both ends of a send/recv must use the same communicator.

        A call of a batch torch made (``batch_isend_irecv``, or inside a coalescing block) runs
        on the group's communicator instead, made now if need be, as ProcessGroupNCCL runs
        it: torch asks every member of the group to take part in such a batch when it is the
        group's first call, so both ends choose alike. A batch to k peers then costs no
        communicator of its own, where lone calls cost one pair communicator per peer."""
        if self._p2p_on_group:
            return self.comm
        comm = self.comms.pairs.get(peer)
        if comm is None:
            low, high = sorted((self.rank, peer))
            comm = self._connect(f"p2p/{low}-{high}", self.rank == low, 2, int(self.rank == high),
                                 self.device.index)
            self.comms.pairs[peer] = comm
            self._recheck(comm)
        return comm

    def _connect(self, key: str, creator: bool, size: int, rank: int, device: int) -> Communicator:
        """Local checks first (a rank failing after the store gate would leave its peers in
        blocking ncclCommInitRank for good), then the gate and NCCL."""
        Communicator.preflight(device, self.settings.nccl_library, self.settings.nonblocking, self.runtime)
        try:
            return self._create_comm(self._bootstrap.unique_id(key, creator, size), rank, size, device)
        except (CollectiveTimeoutError, NcclError) as exc:
            self.life.fault_once(exc)
            raise

    def _recheck(self, comm: Communicator) -> None:
        # An abort marks the state before it collects the communicators: one attached after
        # that collection is seen here, and aborted.
        if not self.life.usable:
            comm.abort()
            self.check_usable()

    def _create_comm(self, unique_id: bytes, rank: int, size: int, device: int) -> Communicator:
        """Create a communicator where an abort can reach it while it connects (nonblocking),
        or where the watchdog sees the creation waiting inside NCCL (blocking)."""
        settings = self.settings
        with self.comms.creation("ncclCommInitRankConfig") if not settings.nonblocking else contextlib.nullcontext():
            comm = Communicator.begin(unique_id, rank, size, device, settings.nccl_library, settings.nonblocking,
                                      timeout=settings.timeout.total_seconds(), on_abort=self.life.fault_once,
                                      runtime=self.runtime)
        self.comms.pending.append(comm)
        try:
            if not self.life.usable:  # aborted while NCCL was starting
                comm.abort()
            self.check_usable()
            comm.wait_ready()
        finally:
            self.comms.pending.remove(comm)
        return comm

    def communicators(self) -> List[Communicator]:
        return self.comms.all()

    def runner(self, algorithm: str, comm: Communicator):
        """The runner of ``algorithm`` on ``comm`` (its scratch memory, side stream...), made
        on first use."""
        runner = self.comms.runners.get((algorithm, id(comm)))
        if runner is None:
            found = algorithms.get(algorithm)
            made = (comm, self.settings)
            if found.needs_store:
                made += (PrefixStore(f"cupycoll-algorithm/{found.name}", self._store),)
            runner = self.comms.runners[algorithm, id(comm)] = found.make_runner(*made)
        return runner

    # -- its end (the rules and their order: cupycoll.faults.lifecycle) ----------------------
    def shutdown(self) -> None:
        """Finalize and destroy the communicators once their work is done (healthy), or
        abort them when the group has faulted, its work does not finish within
        ``bounds.SHUTDOWN_GRACE`` seconds, or anything fails. Never raises; unusable
        afterwards."""
        self.life.shutdown(self.settings.timeout.total_seconds(), captured=self.captured)

    def abort(self, reason: Optional[BaseException] = None) -> None:
        """Abort the communicators at once, without waiting for peers or the GPU: a
        collective stuck on the GPU is ended, and so is a communicator still connecting.
        Every Work in flight fails with ``reason`` *before* ncclCommAbort, its tensors are
        released after it; then the group's CPU half shuts down. Callable from any thread;
        never waits on peers; every step runs whatever fails."""
        self.life.abort(reason)

