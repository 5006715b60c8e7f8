"""The CUDA half of a cupycoll group: what ``pg._get_backend(torch.device("cuda"))`` returns.

A :class:`CudaBackend` issues a group's CUDA calls:

* **communicators** (:class:`~cupycoll.nccl.communicator.Communicators`, shared with the
  group's lifetime): one per group on one device, created lazily at the first CUDA call
  (or eagerly, when torch calls :meth:`~CudaBackend.eager_connect_single_device` for
  ``init_process_group(device_id=...)``), from a unique id shared through the store
  (:mod:`cupycoll.nccl.bootstrap`) or split from a bound parent's; two-rank pair
  communicators for point-to-point calls, unless the group's own was made at init (see
  :meth:`~CudaBackend.p2p_comm`);
* **the queue**: point-to-point calls wait in it and are issued together, as one NCCL
  group, when one of their Works is touched or any other CUDA call is made. torch hands a
  Python group the ops of ``batch_isend_irecv`` one by one, and issued one by one NCCL
  send/recv deadlock in patterns like a ring exchange. An open coalescing block queues every
  CUDA call until it closes, the same way;
* **streams**, as recent ProcessGroupNCCL: a synchronous call (``async_op=False``) runs on
  the caller's current stream; an asynchronous one on the communicator's internal stream
  after it waits for the current stream, and its tensors stay held until the GPU is done;
* **the watch**: every issued batch is put in flight in the group's watch
  (:mod:`cupycoll.faults.watchdog`) with a pooled CUDA event, unless the stream is capturing a
  CUDA graph; its Works ask the watch how it went. How the group ends is its lifetime's
  (:mod:`cupycoll.faults.lifecycle`);
* **the fast path**: an all_reduce or a broadcast of one tensor, an all_gather_into_tensor or
  a reduce_scatter_tensor (DDP's and FSDP's calls) on a healthy group with nothing queued goes
  from the group's method to NCCL in two frames (:meth:`~CudaBackend.all_reduce_fast` and
  its siblings, then :meth:`~CudaBackend._call_now`); everything else takes the general path
  (:meth:`~CudaBackend.submit`);
* **runners**: of cupycoll's algorithms (:mod:`cupycoll.algorithms`, such as the ring), one
  per algorithm and communicator, made on first use.

The backend knows its group only through callbacks it holds weakly (``name`` for messages,
``on_abort`` to shut the group's gloo half down, ``on_bind`` to set its ``bound_device_id``),
so torch may keep this object without keeping the group alive, and no reference cycle forms.

Deliberately left out: torch's routing and its coalescing-manager protocol (the group's,
:mod:`cupycoll.shell`), what each collective launches (:mod:`cupycoll.collectives`), and the
group's state and end (its lifetime's; a faulted group is shrunk to its survivors or replaced:
docs/faults.md).
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
import zlib
from typing import Callable, List, Optional, Sequence

import torch

from . import _cuda, algorithms, compat, config
from .call_queue import CallQueue, Issue, open_block_owner
from .errors import (CollectiveTimeoutError, CommunicatorAbortedError, CupycollTypeError, CupycollValueError,
                     NcclError)
from .faults import lifecycle
from .faults.lifecycle import GroupState
from .faults.watchdog import Watch, entries
from .nccl import bindings as nb
from .nccl.bootstrap import StoreBootstrap
from .nccl.communicator import Communicator, Communicators
from .trace.recorder import E_ROUTE, describe_entry
from .work import CudaWork

_OK = GroupState.OK
# The algorithm override in force (config.algorithm(), process-wide): a non-empty list
# sends every reduction to the general path, which reads it.
_OVERRIDES = config._algorithm_override
_async_requested = compat.async_requested


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


def describe_batch(records) -> str:
    """What a timeout message names a batch by: its first call, and how many more it had."""
    found = entries(records)
    if not found:
        return "a collective"
    text = describe_entry(found[0])
    return text if len(found) == 1 else f"{text} (and {len(found) - 1} more calls of its batch)"


class CudaBackend:
    """Communicators, queue, streams and algorithm runners of one group; its state and end are its lifetime's."""

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
        # are, ``_device_index`` what ``get_device()`` says of a tensor there (the fast path's
        # test; the CPU tests' stand-in, whose CPU tensors stand in, says -1).
        self._index = -1
        self._device_index = -1
        # The CUDA runtime every CUDA call of the group's goes through (cupycoll._cuda): the
        # one in force when the group was built.
        self.runtime = _cuda.current()
        self.comms = Communicators()
        self._order_event = None  # a pooled event that orders the internal stream after the caller's
        self._p2p_on_group = False  # the group's communicator was made at init: P2P uses it
        # The group's flight recorder (cupycoll.trace.group.GroupTrace), if any.
        self.trace = trace
        recorder = trace.recorder if trace is not None else None
        self._recorder = recorder
        timeout = settings.timeout.total_seconds()
        self._bootstrap = StoreBootstrap(store, rank, timeout, self._name, _weak(self.check_usable))
        self.watch = Watch(group_id or "default", timeout, self.comms, recorder, describe=describe_batch,
                           runtime=self.runtime)
        self.life = lifecycle.GroupLifetime(
            self._name, self.watch, self.comms, settings.watchdog_interval, settings.on_timeout,
            explain=trace.explain_timeout if trace is not None else None, close_cpu=_weak(on_abort),
            publish=trace.publish_fault if trace is not None else None,
            dump=trace.dump_fault if trace is not None else None)
        if trace is not None:  # the faults the trace finds, and those a peer publishes, are the lifetime's
            trace.attach(_weak(self.life.caller_fault), _weak(self.life.peer_fault))
        # Callbacks into this object are weak: a cycle would keep destroyed groups (and their
        # gloo threads) alive until interpreter exit, where tearing gloo down aborts the process.
        this = weakref.ref(self)
        self.calls = CallQueue(lambda issues: this()._enqueue(issues), _weak(self.check_usable), self.watch,
                               self._name, self.global_ranks, settings.blocking_wait)
        # The fast path's plans: (dtype, RedOpType) -> (NCCL datatype, NCCL op, count scale),
        # learnt from the general path's first call of each pair (learn_plan).
        self._plans: dict = {}
        # Whether a call may take the fast path at all (what changes rarely: see _refresh_fast).
        self.fast = False
        # Issued calls are watched (Options.watch_calls: off only to measure what that costs).
        self._watch_calls = settings.watch_calls
        # A call was captured into a CUDA graph: NCCL's finalize then waits for every such
        # graph to be destroyed, so the group's shutdown aborts instead (bounded).
        self.captured = False

    # The fast path's device test is a tensor's is_cuda besides its device index (get_device()
    # gives any accelerator's index: an XPU tensor's 0 is not cuda:0's). The CPU tests'
    # backend, whose CPU tensors stand in for CUDA ones, says False.
    _fast_is_cuda = True

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
        self._refresh_fast()

    def _refresh_fast(self) -> None:
        """The fast path's flag, from what changes rarely: a blocking communicator made, and
        settings that need the general path (the mismatch check, blocking wait, an algorithm
        besides NCCL for every call). What changes per call (the group's state, queued calls,
        an algorithm override, a capture, the tensor) is read at each call."""
        comm = self.comms.group
        settings = self.settings
        self.fast = (comm is not None and not getattr(comm, "nonblocking", True)
                     and self._recorder is not None and not settings.check_collectives
                     and not settings.blocking_wait and settings.algorithm != "ring")

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
            runner = self.comms.runners[algorithm, id(comm)] = algorithms.get(algorithm).make_runner(
                comm, self.settings)
        return runner

    # -- the fast path -----------------------------------------------------------------
    def learn_plan(self, dtype: torch.dtype, op, plan) -> None:
        """Keep ``plan`` (a NCCL reduction without a PREMUL factor, chosen under the group's
        own algorithm setting) for the fast path's calls of (``dtype``, ``op``)."""
        if plan.premul_factor is None:
            self._plans[dtype, op] = (plan.dtype, plan.op, plan.count_scale)

    def all_reduce_fast(self, tensor: torch.Tensor, opts) -> Optional[CudaWork]:
        """An all_reduce of ``tensor`` on NCCL at once (:meth:`_call_now`), or None when the
        call needs the general path: the tensor is not contiguous or on another device, no
        plan is learnt for its dtype and op, or an algorithm override is in force (and what
        :meth:`_call_now` refuses). What it does is what the general path would do
        (tests/test_fast_path.py)."""
        try:
            if (tensor.is_cuda is not self._fast_is_cuda or tensor.get_device() != self._device_index
                    or not tensor.is_contiguous()):
                return None
        except RuntimeError:  # a layout without strides: the general path names it
            return None
        plan = self._plans.get((tensor.dtype, opts.reduceOp.op))
        if plan is None or _OVERRIDES:
            return None
        dtype, op, scale = plan
        ptr = tensor.data_ptr()
        return self._call_now("all_reduce", tensor, tensor, (tensor.shape,), (tensor.dtype,), opts,
                              "ncclAllReduce", (ptr, ptr, tensor.numel() * scale, dtype, op))

    def all_gather_fast(self, output: torch.Tensor, input: torch.Tensor, opts) -> Optional[CudaWork]:
        """An all_gather_into_tensor (FSDP's unsharding) on NCCL at once, or None when the
        call needs the general path (which checks what this refuses, and raises on bad
        input): a tensor not contiguous or on another device, ``output`` not one ``input``
        per rank in its dtype (and what :meth:`_call_now` refuses)."""
        if not self._fast_pair(input, output):
            return None
        return self._call_now("all_gather_into_tensor", output, (input, output), (output.shape, input.shape),
                              (output.dtype, input.dtype), opts, "ncclAllGather",
                              (input.data_ptr(), output.data_ptr(), input.numel() * input.element_size(),
                               nb.ncclUint8))

    def reduce_scatter_fast(self, output: torch.Tensor, input: torch.Tensor, opts) -> Optional[CudaWork]:
        """A reduce_scatter_tensor (FSDP's gradient reduction) on NCCL at once, or None when
        the call needs the general path: as :meth:`all_gather_fast` with the roles of the
        tensors swapped, and as :meth:`all_reduce_fast` for the plan."""
        if not self._fast_pair(output, input):
            return None
        plan = self._plans.get((output.dtype, opts.reduceOp.op))
        if plan is None or _OVERRIDES:
            return None
        dtype, op, scale = plan
        return self._call_now("reduce_scatter_tensor", output, (input, output), (output.shape, input.shape),
                              (output.dtype, input.dtype), opts, "ncclReduceScatter",
                              (input.data_ptr(), output.data_ptr(), output.numel() * scale, dtype, op))

    def _fast_pair(self, shard: torch.Tensor, whole: torch.Tensor) -> bool:
        """May FSDP's pair of tensors take the fast path: both CUDA tensors on the group's
        device, contiguous, in one dtype, ``whole`` one ``shard`` per rank?"""
        index, cuda = self._device_index, self._fast_is_cuda
        try:
            return (shard.is_cuda is cuda and whole.is_cuda is cuda and shard.get_device() == index
                    and whole.get_device() == index and shard.is_contiguous() and whole.is_contiguous()
                    and whole.dtype == shard.dtype and whole.numel() == shard.numel() * self.size)
        except RuntimeError:  # a layout without strides: the general path names it
            return False

    def broadcast_fast(self, tensor: torch.Tensor, opts) -> Optional[CudaWork]:
        """A broadcast of ``tensor`` (DDP's buffers, at every forward) on NCCL at once, or None
        when the call needs the general path: the tensor is not contiguous or on another
        device, or the root is not a rank of the group (and what :meth:`_call_now` refuses)."""
        root = opts.rootRank
        try:
            if (tensor.is_cuda is not self._fast_is_cuda or tensor.get_device() != self._device_index
                    or not tensor.is_contiguous() or not 0 <= root < self.size):
                return None
        except RuntimeError:  # a layout without strides: the general path names it
            return None
        ptr = tensor.data_ptr()
        return self._call_now("broadcast", tensor, tensor, (tensor.shape,), (tensor.dtype,), opts, "ncclBroadcast",
                              (ptr, ptr, tensor.numel() * tensor.element_size(), nb.ncclUint8, root), root)

    def _call_now(self, op_name: str, output: torch.Tensor, keep, shapes: tuple, dtypes: tuple, opts,
                  function: str, args: tuple, root: Optional[int] = None) -> Optional[CudaWork]:
        """The fast path's launch: ``function(*args, comm, stream)`` on the group's blocking
        communicator now, recorded in the flight recorder as ``op_name`` of ``shapes`` and
        ``dtypes`` (and ``root``, as the group records the call), watched, its Work returned; None when
        the call needs the general path: the current stream captures a CUDA graph, the
        group is not ``ok``, calls are queued, or a coalescing block is open (this group's,
        or any group's in this thread: the general path refuses a call of another group
        inside it, or drops it when stale). The caller checked the fast flag (see
        :meth:`_refresh_fast`). A synchronous call runs on the caller's stream; an
        asynchronous one on the communicator's stream after the caller's, holding ``keep``
        until the GPU is done, as the general path's."""
        runtime, index = self.runtime, self._index
        if runtime.current_device() != index:  # the general path switches to the group's device
            return None
        current = runtime.current_stream(index)
        if runtime.capturing(current):
            return None
        async_op = _async_requested(opts)
        calls = self.calls
        with calls.lock:
            if (self.life.state is not _OK or calls.block is not None or calls.pending
                    or open_block_owner.__dict__.get("queue") is not None):  # any group's, in this thread
                return None
            comm = self.comms.group
            if async_op:
                stream, keepalive = comm.stream, keep
                self._order_after(current, stream)
            else:
                stream, keepalive = current, None
            entry = self._recorder.record(op_name, shapes, dtypes, root, "nccl", "issued")
            try:
                comm.call_now(function, args, stream)
            except BaseException as exc:
                self._recorder.mark(entry, "failed")
                timed_out = self.life.timeout_that_cut(exc)
                if timed_out is not None:
                    raise timed_out from exc
                raise
            try:
                slot = self.watch.issued(stream, entry, keepalive) if self._watch_calls else None
            except BaseException as exc:  # launched, but neither watched nor handed back: the peers wait for it
                self.life.fault_once(exc if isinstance(exc, Exception) else lifecycle.interrupted(exc))
                raise
            calls._seq += 1
            work = CudaWork(op_name, self.device, [output], self.watch, seq=calls._seq)
            work._issued(slot, stream, async_op, unwatched=not self._watch_calls)
        return work

    def all_reduce_parts(self, tensors: Sequence[torch.Tensor], opts) -> Optional[CudaWork]:
        """The all_reduces of one ``allreduce_coalesced`` (the call torch's coalescing manager
        makes of a block of all_reduces) as one call: one launch making their ncclAllReduce
        calls in one NCCL group (:meth:`Communicator.all_reduces`), one Work and one watch
        slot, each part recorded in the flight recorder as the general path records it.
        None when a part needs the general path (as for :meth:`all_reduce_fast`: another
        device, not contiguous, no plan learnt for its dtype and op, an algorithm override);
        the caller checked the fast flag. An open coalescing block or queued calls take it
        as they take any call (:meth:`submit`)."""
        index, plans, kind = self._device_index, self._plans, opts.reduceOp.op
        parts = []
        for tensor in tensors:
            try:
                if tensor.is_cuda is not self._fast_is_cuda or tensor.get_device() != index or not tensor.is_contiguous():
                    return None
            except RuntimeError:  # a layout without strides: the general path names it
                return None
            plan = plans.get((tensor.dtype, kind))
            if plan is None:
                return None
            dtype, op, scale = plan
            parts.append((tensor.data_ptr(), tensor.numel() * scale, dtype, op))
        if not parts or _OVERRIDES:
            return None
        record = self._recorder.record
        recorded = tuple(record("all_reduce", (t.shape,), (t.dtype,), None, "nccl", "queued") for t in tensors)
        return self.submit("all_reduce_coalesced", self.device, list(tensors),
                           lambda comm, stream: comm.all_reduces(parts, stream), keepalive=tuple(tensors),
                           async_op=_async_requested(opts), entry=recorded)

    # -- issuing -------------------------------------------------------------------------
    def submit(self, op_name, device, outputs, launch, finish=None, keepalive=(), async_op=True,
               peer=None, blocking_wait=False, algorithm=None, prepare=None, entry=None,
               batched: bool = False) -> CudaWork:
        """Issue (or queue) one CUDA call and return its Work. Everything is validated.
        ``launch(comm, stream_ptr)`` (``launch(comm, stream_ptr, comm_peer)`` for a
        point-to-point call) makes the NCCL calls; ``prepare(comm)`` precedes its NCCL group,
        ``finish()`` follows it. ``algorithm``: the name of the algorithm the call runs
        (NCCL groups of its own: never inside a batch's), recorded as its route. ``entry``:
        the call's flight-recorder entry (the group recorded it). ``batched``: a point-to-point
        call of a batch torch made (``batch_isend_irecv``), which runs on the group's
        communicator, as one inside a coalescing block does (see :meth:`p2p_comm`)."""
        own_group = algorithm is not None
        if entry is not None and own_group:
            entry[E_ROUTE] = algorithm
        # One issuer at a time: NCCL forbids concurrent calls on one communicator.
        with self.calls.lock:
            if self.device is None:
                self._adopt_device(device)  # the first CUDA call picks the group's device
            work, now = self.calls.submit(op_name, device, outputs, launch, finish, keepalive, async_op,
                                          peer, blocking_wait or self.settings.blocking_wait, own_group,
                                          prepare, entry, batched)
            if now is not None:
                self._enqueue([now])
        return work

    def flush(self) -> None:
        """Issue the queued calls now (unless a coalescing block is open)."""
        self.calls.flush()

    def _enqueue(self, issues: List[Issue]) -> None:
        """Issue ``issues`` as one batch, with the group's device current: NCCL sets back the
        device current when it was called, and an event or stream call with another one
        current makes a context there (a rank on cuda:3 whose thread never chose a device
        would hold one on cuda:0)."""
        with self.runtime.on_device(self.device.index):
            self._enqueue_here(issues)

    def _enqueue_here(self, issues: List[Issue]) -> None:
        device, runtime = self.device, self.runtime
        if len(issues) == 1 and issues[0].peer is None:  # one collective
            comms = None
            if self.comm is None:
                self.comm_for(device)
        else:
            if any(i.peer is None or i.on_group for i in issues):
                self.comm_for(device)
            # Pair communicators are created in one global order (by peer), so creating
            # them can never wait in a cycle.
            comms = {peer: self.p2p_comm(peer) for peer in sorted({i.peer for i in issues if not i.on_group} - {None})}
        current = runtime.current_stream(device.index)
        async_op = issues[0].async_op if len(issues) == 1 else any(i.async_op for i in issues)
        if async_op:
            stream = (self.comm or comms[min(comms)]).stream
            self._order_after(current, stream)
        else:
            stream = current
        # Marked issued before the launch: a launch stuck inside NCCL (a blocking connect) is
        # then the call the flight recorder and the diagnosis name.
        recorder = self._recorder
        if recorder is not None:
            for issue in issues:
                for entry in entries(issue.entry):
                    recorder.mark(entry, "issued")
        launched = []  # not empty once part of the batch may be on the stream
        try:
            if async_op:
                # The internal stream current for what launch/finish allocate and copy.
                with runtime.use_stream(stream, device.index):
                    self._launch_all(issues, comms, stream, launched)
            else:
                self._launch_all(issues, comms, stream, launched)
        except BaseException as exc:
            if launched:  # it runs (its tensors stay kept) and the peers wait for the rest
                try:
                    self._track(issues, stream, current, async_op)
                except Exception:  # noqa: BLE001 - untracked: the queue fails them
                    pass
                self.life.fault_once(exc if isinstance(exc, Exception) else lifecycle.interrupted(exc))
            elif recorder is not None:
                for issue in issues:
                    for entry in entries(issue.entry):
                        recorder.mark(entry, "failed")
            timed_out = self.life.timeout_that_cut(exc)
            if timed_out is not None:
                raise timed_out from exc
            raise
        self._track(issues, stream, current, async_op)

    def _order_after(self, current: int, stream: int) -> None:
        """Make ``stream`` wait for what the caller enqueued on ``current`` so far (the group's
        device current)."""
        event = self._order_event
        if event is None:
            event = self._order_event = self.runtime.new_event()  # of the group's device: recorded on its streams
        event.record(current)
        event.wait_on(stream)

    def _track(self, issues: List[Issue], stream: int, current: int, async_op: bool) -> None:
        """Put the launched batch in flight in the watch (not a call captured into a CUDA
        graph, as ProcessGroupNCCL: it runs nothing until replayed, and the watchdog's event
        queries would invalidate the capture; nor any with ``Options.watch_calls`` off), and
        tell its Works where it is. An asynchronous batch captured into a graph from
        ``current`` forked the internal stream off it: its Works keep an event recorded after
        the batch, which ``wait()`` joins back into the capture."""
        join = None
        if self.runtime.capturing(stream):
            slot = None
            self.captured = True
            if async_op:
                join = self.watch.join_event(stream)
                join.record(stream)
        elif not self._watch_calls:
            slot = None
        else:
            records = [entry for issue in issues for entry in entries(issue.entry)]
            keepalive = [issue.keepalive for issue in issues] if async_op else None
            slot = self.watch.issued(stream, records[0] if len(records) == 1 else tuple(records), keepalive)
        for issue in issues:
            issue.work._issued(slot, stream, async_op, join, unwatched=not self._watch_calls)
            issue.tracked = True

    def _launch_all(self, issues: List[Issue], comms, stream_ptr: int, launched=None) -> None:
        # Every prepare of the batch runs before its NCCL group opens, as ncclGroupEnd
        # would launch a partial batch. One that raises makes no NCCL call; flush fails the
        # Works. From the first launch on (``launched``), a failure faults the group instead.
        launched = [] if launched is None else launched
        if len(issues) == 1:
            issue = issues[0]
            if issue.prepare is not None:
                issue.prepare(self._comm_of(issue, comms))
            if issue.own_group:  # an algorithm: several steps, any of them may fail
                launched.append(issue)
            if issue.peer is None:  # one collective on the group's communicator
                issue.launch(self.comm, stream_ptr)
            else:
                self._launch(issue, comms, stream_ptr)
            launched.append(issue)  # its one NCCL call (or own NCCL group) did not raise
        else:
            for issue in issues:
                if issue.prepare is not None:
                    issue.prepare(self._comm_of(issue, comms))
            launched.append(issues)  # ncclGroupEnd launches whatever the group got, even on error
            # One NCCL group for the batch; every communicator of the group has the same library.
            with (self.comm or comms[min(comms)]).group():
                for issue in issues:
                    if not issue.own_group:
                        self._launch(issue, comms, stream_ptr)
            # Algorithms' calls follow the group on the same stream, in the same order on every rank.
            for issue in issues:
                if issue.own_group:
                    self._launch(issue, comms, stream_ptr)
        for issue in issues:
            if issue.finish is not None:
                issue.finish()

    def _comm_of(self, issue: Issue, comms) -> Communicator:
        """The communicator ``issue`` runs on: the group's, or its peer's pair communicator."""
        return self.comm if issue.peer is None or issue.on_group else comms[issue.peer]

    def _launch(self, issue: Issue, comms, stream_ptr: int) -> None:
        if issue.peer is None:
            issue.launch(self.comm, stream_ptr)
            return
        comm = self._comm_of(issue, comms)
        # On a two-rank pair communicator the peer is whichever of the two we are not.
        issue.launch(comm, stream_ptr, issue.peer if comm is self.comm else 1 - comm.rank)

    # -- its end (the rules and their order: cupycoll.faults.lifecycle) ----------------------
    def shutdown(self) -> None:
        """Finalize and destroy the communicators once their work is done (healthy), or
        abort them when the group has faulted, its work does not finish within
        ``bounds.SHUTDOWN_GRACE`` seconds, or anything fails. Never raises; unusable
        afterwards."""
        try:
            self.calls.flush()
        except Exception:  # noqa: BLE001 - the Works of that batch carry the error
            pass
        self.life.shutdown(self.settings.timeout.total_seconds(), captured=self.captured)

    def abort(self, reason: Optional[BaseException] = None) -> None:
        """Abort the communicators at once, without waiting for peers or the GPU: a
        collective stuck on the GPU is ended, and so is a communicator still connecting.
        Every Work in flight fails with ``reason`` *before* ncclCommAbort, its tensors are
        released after it; then the group's CPU half shuts down. Callable from any thread;
        never waits on peers; every step runs whatever fails."""
        self.life.abort(reason)

