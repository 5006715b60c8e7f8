"""The torch ProcessGroup adapter: torch.distributed calls in, NCCL calls out.

:class:`ProcessGroupCupycoll` is a Python subclass of ``torch.distributed.ProcessGroup``.
torch makes such an object the *whole* group (see docs/design.md), so it routes:

* CPU tensors, CPU barriers and (through them) the object collectives to an inner
  gloo ``ProcessGroup`` built on the same store: they behave exactly as ``"cpu:gloo"``;
* CUDA tensors to one NCCL :class:`~cupycoll.communicator.Communicator` per device,
  created lazily at the first CUDA collective, or eagerly when ``init_process_group`` is
  given ``device_id``.

Streams follow recent ProcessGroupNCCL: a synchronous call (``async_op=False``) is issued
on the caller's current stream with no side stream and no event; an asynchronous one on
the communicator's internal stream after it waits for the current stream, and the tensors
stay referenced until the GPU is done with them.

Point-to-point calls on CUDA are queued and issued together, as one NCCL group, when one of
their Works is touched or any other CUDA call is made on the group. torch (2.7+) hands a
Python group the ops of ``batch_isend_irecv`` one by one, and issued one by one NCCL
send/recv deadlock in patterns like a ring exchange. ``_start_coalescing`` /
``_end_coalescing`` queue every CUDA call in between into one NCCL group the same way.

Faults: every issued Work is tracked by the process's watchdog (:mod:`cupycoll.watchdog`).
A collective that outlives the timeout, or an NCCL async error, aborts the group's
communicators and fails its Works; every later call raises CommunicatorAbortedError.
``abort()`` works from any thread, also while a communicator is being created (the store
waits poll, and nonblocking communicators can be aborted mid-init); ``shutdown()``
finalizes and destroys when healthy and aborts when not.

Deliberately left out: input validation beyond what is needed to fail before enqueueing,
and recovery (a faulted group stays dead; build a new one, see docs/design.md).
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import itertools
import sys
import threading
import time
import warnings
import weakref
import zlib
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d
from torch.distributed import PrefixStore, ProcessGroup

from . import _types, compat, config
from .communicator import Communicator, new_unique_id, nccl_group
from .errors import (CollectiveTimeoutError, CommunicatorAbortedError, CupycollError, CupycollTypeError,
                     CupycollValueError, NcclError)
from .watchdog import WATCHDOG, Watch
from .work import CudaWork

BACKEND_NAME = "cupycoll"

# Every live group, for abort_all(); weak, so that destroyed groups can go.
_LIVE_GROUPS: "weakref.WeakSet[ProcessGroupCupycoll]" = weakref.WeakSet()
# The coalescing block open in this thread (at most one: a manager coalesces one group).
_open_block_owner = threading.local()
# Store waits poll in slices of this length, so that abort() can end them.
_STORE_POLL_S = 0.05

_GLOO = ProcessGroup.BackendType.GLOO
_CPU = torch.device("cpu")


# ------------------------------------------------------------------------------------------
# guard helpers: raise before anything is enqueued, naming the offending value


def _check_tensor(tensor, what: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise CupycollTypeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    return tensor


def _single(tensors, what: str) -> torch.Tensor:
    if not isinstance(tensors, (list, tuple)) or len(tensors) != 1:
        count = len(tensors) if isinstance(tensors, (list, tuple)) else type(tensors).__name__
        raise CupycollValueError(f"{what}: cupycoll takes exactly one tensor per process, got {count}")
    return _check_tensor(tensors[0], what)


def _check_list(tensors, what: str, length: int) -> List[torch.Tensor]:
    if not isinstance(tensors, (list, tuple)):
        raise CupycollTypeError(f"{what} must be a list of tensors, got {type(tensors).__name__}")
    if len(tensors) != length:
        raise CupycollValueError(f"{what} has {len(tensors)} tensors; the group has {length} ranks")
    for index, tensor in enumerate(tensors):
        _check_tensor(tensor, f"{what}[{index}]")
    return list(tensors)


def _check_numel(tensor: torch.Tensor, expected: int, what: str) -> None:
    if tensor.numel() != expected:
        raise CupycollValueError(
            f"{what} has {tensor.numel()} elements (shape {tuple(tensor.shape)}); expected {expected}"
        )


def _check_same_dtype(tensors: Sequence[torch.Tensor], reference: torch.Tensor, what: str) -> None:
    for tensor in tensors:
        if tensor.dtype != reference.dtype:
            raise CupycollTypeError(f"{what}: dtype {tensor.dtype} differs from {reference.dtype}")


def _flat(tensors) -> List[torch.Tensor]:
    out = []
    for item in tensors:
        if isinstance(item, (list, tuple)):
            out.extend(_flat(item))
        else:
            out.append(item)
    return out


_async_requested = compat.async_requested


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _split_color(ranks: Sequence[int]) -> int:
    # Identical on every member, distinct (with high probability) across groups.
    return zlib.crc32(",".join(map(str, sorted(ranks))).encode()) & 0x7FFFFFFF


class _Issue:
    """One NCCL call (or a few, e.g. an all-to-all) waiting to be enqueued."""

    __slots__ = ("work", "launch", "finish", "keepalive", "async_op", "peer", "own_group")

    def __init__(self, work, launch, finish, keepalive, async_op, peer=None, own_group=False):
        self.work = work
        self.launch = launch  # launch(comm_for_peer, stream_ptr): the NCCL calls
        self.finish = finish  # finish(): copies that must follow the NCCL group, or None
        self.keepalive = keepalive
        self.async_op = async_op
        self.peer = peer  # point-to-point peer (group rank), None for collectives
        # The ring algorithm: NCCL groups of its own plus kernels, so never inside another group.
        self.own_group = own_group


class _CudaBackendHandle:
    """What ``pg._get_backend(cuda)`` gives torch: eager connect and no-color split."""

    supports_coalescing = False
    supports_time_estimate = False

    def __init__(self, group: "ProcessGroupCupycoll"):
        # A weak reference: a cycle would keep destroyed groups (and their gloo threads)
        # alive until interpreter exit, where tearing gloo down aborts the process.
        self._group = weakref.ref(group)

    @property
    def supports_splitting(self) -> bool:
        # torch asks this while creating *any* subgroup of a bound default group, whatever
        # the new group's backend: splitting must only be offered for cupycoll groups, or a
        # new_group(backend="nccl") would get this handle as ProcessGroupNCCL's split_from,
        # and its non-members would split our communicator while its members never do.
        return _creating_cupycoll_cuda_group()

    def eager_connect_single_device(self, device) -> None:
        self._group()._bind_device(torch.device(device))

    def perform_nocolor_split(self, device) -> None:
        self._group()._nocolor_split(torch.device(device))

    def name(self) -> str:
        return BACKEND_NAME


class ProcessGroupCupycoll(ProcessGroup):
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
    ):
        super().__init__(rank, size)
        self.settings = config.resolve(options, timeout)
        # Not ``self.options``: torch 2.4 has a read-only ProcessGroup.options (2.11 none).
        self.pg_options = options if options is not None else config.Options()
        self._store = store
        self._rank = rank
        self._size = size
        self._global_ranks = list(global_ranks or range(size))
        self._group_id = group_id
        self._group_name = group_id
        self._group_desc = ""
        self._cpu = self._build_cpu_group(store, rank, size, self.settings.timeout)

        self._device: Optional[torch.device] = None
        self._comm: Optional[Communicator] = None
        self._comm_stream = None  # torch view of the communicator's internal stream
        self._p2p_comms: Dict[int, Communicator] = {}  # peer -> two-rank communicator
        self._queue: List[_Issue] = []  # calls not yet issued (P2P batches, coalescing)
        self._coalescing: Optional[List[CudaWork]] = None
        self._coalescing_manager = None  # weakref to the manager generator of the open block
        self._state = "ok"
        self._fault: Optional[BaseException] = None
        self._seq = 0
        self._pending_comms: List[Communicator] = []  # being created: abort() must reach them
        self._rings: Dict[int, object] = {}  # id(communicator) -> cupycoll.ring.Ring
        self._fp8: Optional[bool] = None
        self._handle = _CudaBackendHandle(self)
        # The watch refers back weakly: a cycle would keep destroyed groups alive (see above).
        this = weakref.ref(self)
        self._watch = Watch(group_id or "default", self.settings.timeout.total_seconds(),
                            self.settings.watchdog_interval,
                            lambda: this()._communicators() if this() is not None else [],
                            lambda fault: this() is not None and this()._on_fault(fault),
                            self.settings.on_timeout)
        self._watched = False
        _LIVE_GROUPS.add(self)

        parent = self._split_parent()
        if parent is not None:
            self._comm = parent._comm.split(_split_color(self._global_ranks), rank)
            self._adopt_device(parent._device)

    # -- construction helpers ---------------------------------------------------------
    def _build_cpu_group(self, store, rank, size, timeout) -> ProcessGroup:
        cpu_store = PrefixStore("cupycoll-cpu/", store)
        gloo = dist.ProcessGroupGloo(cpu_store, rank, size, timeout)
        compat.keep_gloo_until_exit(gloo)
        inner = compat.plain_process_group(cpu_store, rank, size)
        compat.set_default_backend(inner, _GLOO)
        inner._register_backend(_CPU, _GLOO, gloo)
        # C++ callers asking this group for its CPU backend get the same gloo, also as its
        # default backend (which torch 2.15's flight-recorder hook looks up at init).
        self._register_backend(_CPU, _GLOO, gloo)
        compat.set_default_backend(self, _GLOO)
        return inner

    def _split_parent(self) -> Optional["ProcessGroupCupycoll"]:
        """The default group when torch splits subgroups from it (it was bound to a device)."""
        if not self._global_ranks or not dist.is_initialized():
            return None
        parent = dist.distributed_c10d._get_default_group()
        if not isinstance(parent, ProcessGroupCupycoll) or parent is self:
            return None
        if not parent._splits_children():
            return None
        return parent

    def _splits_children(self) -> bool:
        return (self.settings.comm_split and self._comm is not None
                and getattr(self, "bound_device_id", None) is not None and Communicator.can_split())

    def _nocolor_split(self, device: torch.device) -> None:
        # torch calls this on ranks left out of a new subgroup; it must mirror the
        # members' split exactly, so it follows the same predicate.
        if self._splits_children():
            self._comm.split(-1, self._rank)

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
            return self._handle
        return super()._get_backend(device)

    def __repr__(self) -> str:
        return (f"ProcessGroupCupycoll(rank={self._rank}, size={self._size}, "
                f"device={self._device}, name={self._group_name!r})")

    # -- device and communicators -----------------------------------------------------
    def _adopt_device(self, device: torch.device) -> None:
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self._device = device

    def _bind_device(self, device: torch.device) -> None:
        """Eager init (``device_id``): bind the group to ``device`` and connect now."""
        self.bound_device_id = device
        self._comm_for(device)

    def _check_usable(self) -> None:
        if self._state != "ok":
            reason = f": {self._fault}" if self._fault is not None else ""
            raise CommunicatorAbortedError(
                f"process group {self._group_name!r} was {self._state}{reason}") from self._fault

    def _check_device(self, tensor: torch.Tensor, what: str) -> torch.device:
        device = tensor.device
        if self._device is not None and device != self._device:
            raise CupycollValueError(
                f"{what} is on {device} but this group's communicator is on {self._device}"
            )
        if not tensor.is_contiguous():
            raise CupycollValueError(
                f"{what} is not contiguous (shape {tuple(tensor.shape)}, strides {tensor.stride()})"
            )
        return device

    def _comm_for(self, device: torch.device) -> Communicator:
        self._check_usable()
        if self._comm is None:
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            try:
                unique_id = self._exchange_unique_id("comm", self._rank == 0, self._size)
                self._comm = self._create_comm(unique_id, self._rank, self._size, device.index)
            except (CollectiveTimeoutError, NcclError) as exc:
                self._creation_failed(exc)
                raise
            self._adopt_device(device)
        return self._comm

    def _creation_failed(self, exc: BaseException) -> None:
        """A communicator that could not be created faults the group, as a timed-out
        collective does. A retry cannot work: the store's arrival count now sits between
        two incarnations, so each rank would number the retry differently (and in blocking
        mode one would wait in ncclCommInitRank, unabortable, for peers that never come)."""
        if self._state == "ok":
            self._on_fault(exc)

    def _create_comm(self, unique_id: bytes, rank: int, size: int, device: int) -> Communicator:
        """Create a communicator where abort() can reach it while it connects."""
        comm = Communicator.begin(unique_id, rank, size, device, self.settings.nccl_library,
                                  self.settings.nonblocking, self.settings.timeout.total_seconds())
        self._pending_comms.append(comm)
        try:
            if self._state != "ok":  # aborted while NCCL was starting
                comm.abort()
            self._check_usable()
            comm.wait_ready()
        finally:
            self._pending_comms.remove(comm)
        return comm

    def _p2p_comm(self, peer: int) -> Communicator:
        """The communicator for a point-to-point call with ``peer``: the group's own when it
        exists, otherwise one of just the two ranks (so a send between two ranks never needs
        the others), created on first use."""
        if self._comm is not None:
            return self._comm
        comm = self._p2p_comms.get(peer)
        if comm is None:
            low, high = sorted((self._rank, peer))
            try:
                unique_id = self._exchange_unique_id(f"p2p/{low}-{high}", self._rank == low, 2)
                comm = self._create_comm(unique_id, int(self._rank == high), 2, self._device.index)
            except (CollectiveTimeoutError, NcclError) as exc:
                self._creation_failed(exc)
                raise
            self._p2p_comms[peer] = comm
        return comm

    def _exchange_unique_id(self, key: str, creator: bool, members: int) -> bytes:
        """Share a fresh ncclUniqueId through the store among ``members`` ranks.

        The store may outlive this group (destroy_process_group then init again on torchrun's
        store, same group name), so each creation gets its own key: every member counts itself
        in, and ``(count - 1) // members`` numbers the incarnation the same on all of them,
        since the previous incarnation's members had all joined before this one starts."""
        joined_key = f"cupycoll/{key}/joined"
        joined = self._store.add(joined_key, 1)
        incarnation = (joined - 1) // members
        uid_key = f"cupycoll/{key}/{incarnation}/uid"
        deadline = time.monotonic() + self.settings.timeout.total_seconds()
        if creator:
            self._store.set(uid_key, new_unique_id())
        else:
            self._wait_for_store(lambda: self._store.check([uid_key]), deadline,
                                 f"the ncclUniqueId of {key!r} from its creator rank")
        # Every member must have arrived before NCCL init, which (blocking) cannot be
        # interrupted: a rank that never joins fails here after the timeout instead.
        everyone = (incarnation + 1) * members
        self._wait_for_store(lambda: self._store.add(joined_key, 0) >= everyone, deadline,
                             f"all {members} ranks to join communicator {key!r}",
                             lambda: f"{self._store.add(joined_key, 0) - incarnation * members} arrived")
        return self._store.get(uid_key)

    def _wait_for_store(self, ready: Callable[[], bool], deadline: float, what: str,
                        progress: Callable[[], str] = lambda: "") -> None:
        """Poll ``ready`` until it holds, the deadline passes or the group is aborted."""
        pause = 0.001
        while not ready():
            self._check_usable()
            if time.monotonic() > deadline:
                detail = progress()
                raise CollectiveTimeoutError(
                    f"process group {self._group_name!r} rank {self._rank}: timed out after "
                    f"{self.settings.timeout.total_seconds():g} s waiting for {what}"
                    + (f" ({detail})" if detail else ""))
            time.sleep(pause)
            pause = min(pause * 2, _STORE_POLL_S)

    def _fp8_available(self) -> bool:
        if self._fp8 is None:
            from . import _cuda, nccl_bindings

            self._fp8 = nccl_bindings.fp8_supported(_cuda.nccl_module().get_version())
        return self._fp8

    # -- enqueueing -------------------------------------------------------------------
    def _submit(self, op_name, device, outputs, launch, finish=None, keepalive=(), async_op=True,
                peer=None, blocking_wait=False, own_group=False) -> CudaWork:
        """Issue (or queue) one CUDA call and return its Work. Everything is validated."""
        if self._device is None:
            self._device = device  # the first CUDA call picks the group's device
        if _open_block_owner.__dict__.get("group") is not None:
            self._check_coalescing_scope(op_name)
        self._seq += 1
        work = CudaWork(op_name, device, outputs, seq=self._seq,
                        blocking_wait=blocking_wait or self.settings.blocking_wait,
                        peers=None if peer is None else [self._global_ranks[peer]])
        issue = _Issue(work, launch, finish, keepalive, async_op, peer, own_group)
        if self._coalescing is not None or peer is not None:
            work._flush = self._flush
            self._queue.append(issue)
            if self._coalescing is not None:
                self._coalescing.append(work)
            return work
        self._flush()
        self._enqueue([issue])
        return work

    def _flush(self) -> None:
        """Issue every queued call as one NCCL group (not while a coalescing block is open:
        its calls wait for ``_end_coalescing``, as torch's own collectives do inside one)."""
        if self._coalescing is not None:
            self._drop_stale_block()
        if not self._queue or self._coalescing is not None:
            return
        queue, self._queue = self._queue, []
        try:
            self._enqueue(queue)
        except BaseException as exc:
            for issue in queue:
                issue.work._failed(exc)
            raise

    def _enqueue(self, issues: List[_Issue]) -> None:
        device = self._device
        if len(issues) == 1 and issues[0].peer is None:  # the hot path: one collective
            comms = None
            if self._comm is None:
                self._comm_for(device)
        else:
            if any(i.peer is None for i in issues):
                self._comm_for(device)
            # Pair communicators are created in one global order (by peer), so creating
            # them can never wait in a cycle.
            comms = {peer: self._p2p_comm(peer) for peer in sorted({i.peer for i in issues} - {None})}
        current = torch.cuda.current_stream(device)
        async_op = any(i.async_op for i in issues)
        if async_op:
            stream = self._internal_stream(self._comm or comms[min(comms)])
            stream.wait_stream(current)
        else:
            stream = current
        if async_op or current.device_index != torch.cuda.current_device():
            # Make ``stream`` (and its device) current for what launch/finish allocate.
            with torch.cuda.stream(stream):
                self._launch_all(issues, comms, stream.cuda_stream)
        else:
            self._launch_all(issues, comms, stream.cuda_stream)
        self._track(issues, stream, async_op)

    def _launch_all(self, issues: List[_Issue], comms, stream_ptr: int) -> None:
        if len(issues) == 1:
            self._launch(issues[0], comms, stream_ptr)
        else:
            with nccl_group(self.settings.nccl_library):
                for issue in issues:
                    if not issue.own_group:
                        self._launch(issue, comms, stream_ptr)
            # Ring calls follow the group on the same stream, in the same order on every rank.
            for issue in issues:
                if issue.own_group:
                    self._launch(issue, comms, stream_ptr)
        for issue in issues:
            if issue.finish is not None:
                issue.finish()

    def _track(self, issues: List[_Issue], stream, async_op: bool) -> None:
        """Give the issued calls a completion event and hand them to the watchdog (which only
        queries the event, never syncs). Async calls keep their tensors until it fires."""
        event = torch.cuda.Event()
        event.record(stream)
        if not self._watched:
            WATCHDOG.watch(self._watch)
            self._watched = True
        track = self._watch.track
        for issue in issues:
            issue.work._issued(stream, event, issue.keepalive if async_op else None)
            track(issue.work)

    def _launch(self, issue: _Issue, comms, stream_ptr: int) -> None:
        if issue.peer is None:
            issue.launch(self._comm, stream_ptr)
            return
        comm = comms[issue.peer]
        # On a two-rank pair communicator the peer is whichever of the two we are not.
        issue.launch(comm, stream_ptr, issue.peer if comm is self._comm else 1 - comm.rank)

    def _internal_stream(self, comm: Communicator):
        if self._comm_stream is None:
            self._comm_stream = torch.cuda.ExternalStream(comm.stream, device=self._device)
        return self._comm_stream

    # -- routing ----------------------------------------------------------------------
    def _is_cuda(self, tensors, op_name: str) -> bool:
        """True when the call goes to NCCL, False for gloo."""
        if self._classify(tensors, op_name):
            return True
        if self._coalescing is not None and not self._drop_stale_block():
            raise CupycollValueError(
                f"{op_name} on CPU tensors inside a coalescing block of CUDA calls on group "
                f"{self._group_name!r}: a block coalesces one device's calls; use a separate "
                "_coalescing_manager(device=torch.device('cpu')) for CPU tensors")
        self._flush()  # a queued CUDA send/recv must not wait behind unrelated CPU work
        return False

    def _classify(self, tensors, op_name: str) -> bool:
        """Is this a CUDA call? Rejects calls that mix device types or CUDA devices."""
        if self._state != "ok":
            self._check_usable()
        flat = _flat(tensors)
        # Fast path (the hot one): all tensors, all on CUDA, one device; or all on CPU.
        try:
            cuda = sum(t.is_cuda for t in flat)
        except AttributeError:
            cuda = -1  # not all tensors: the checks below name the culprit
        if cuda == len(flat) and cuda:
            if cuda == 1:
                return True
            first = flat[0].device
            if all(t.device == first for t in flat):
                return True
        elif cuda == 0 and all(t.is_cpu for t in flat):
            return False
        return self._classify_slowly(flat, op_name)

    def _classify_slowly(self, flat: List, op_name: str) -> bool:
        for index, tensor in enumerate(flat):
            _check_tensor(tensor, f"{op_name}: tensor {index}")
        kinds = {t.device.type for t in flat}
        if len(kinds) > 1:
            raise CupycollValueError(f"{op_name}: tensors on different device types {sorted(kinds)}")
        if not kinds or kinds == {"cpu"}:
            return False
        if kinds != {"cuda"}:
            raise CupycollValueError(f"{op_name}: tensors on {kinds.pop()} are not supported")
        devices = {t.device for t in flat}
        if len(devices) > 1:
            raise CupycollValueError(f"{op_name}: tensors on several devices {sorted(map(str, devices))}")
        return True

    def _check_root(self, root: int, what: str = "root") -> int:
        if not isinstance(root, int) or not 0 <= root < self._size:
            raise CupycollValueError(f"{what} {root!r} is out of range for a group of {self._size} ranks")
        return root

    def _check_peer(self, peer: int) -> int:
        self._check_root(peer, "peer rank")
        if peer == self._rank:
            raise CupycollValueError(f"peer rank {peer} is this process's own rank")
        return peer

    def _reduction(self, tensor: torch.Tensor, reduce_op, what: str) -> _types.Reduction:
        red = _types.for_group_size(_types.reduction(tensor.dtype, reduce_op, self._fp8_available()),
                                    tensor.dtype, self._size)
        if red.premul_factor is not None and isinstance(red.premul_factor, torch.Tensor):
            _types.check_premul_tensor(red.premul_factor, tensor.dtype, tensor.device)
        return red

    def _ring_call(self, tensor: torch.Tensor, reduce_op) -> Optional[Callable]:
        """None when NCCL serves this reduction; else call(ring_method, send, recv, count,
        stream) running it on cupycoll's ring with the dtype, op and PREMUL factor bound.
        ``auto`` picks the ring only for what NCCL lacks (bitwise ops); ``ring`` always,
        raising for a pair the ring cannot do."""
        choice = config.algorithm_override() or self.settings.algorithm
        if choice == "nccl":
            return None
        kind = _types.op_type(reduce_op)
        if choice == "auto" and kind.value not in _types.BITWISE_VALUES:
            return None
        from . import ring  # CuPy-free at import, but only the ring path needs it

        dtype, op = _types.ring_names(tensor.dtype, kind)
        ring.check(dtype, op)
        premul = premul_ptr = None
        if op == "premul_sum":
            factor = _types.premul_factor(reduce_op)
            if isinstance(factor, torch.Tensor):
                _types.check_premul_tensor(factor, tensor.dtype, tensor.device)
                premul_ptr = factor.data_ptr()
            else:
                premul = float(factor)

        def call(method, sendbuf, recvbuf, count, stream):
            method(sendbuf, recvbuf, count, dtype, op, stream, premul=premul, premul_ptr=premul_ptr)
        return call

    def _ring(self, comm: Communicator):
        """The ring (scratch memory, side stream) of ``comm``, made on first use."""
        ring = self._rings.get(id(comm))
        if ring is None:
            from .ring import Ring

            ring = self._rings[id(comm)] = Ring(comm, self.settings.ring_scratch_bytes)
        return ring

    def _reduce_launch(self, red: _types.Reduction, dtype: torch.dtype, call: Callable) -> Callable:
        """A launch(comm, stream) that runs ``call(comm, nccl_op, stream)`` with the NCCL op,
        creating and destroying the PREMUL_SUM op around it when needed."""
        if red.premul_factor is None:
            return lambda comm, stream: call(comm, red.op, stream)
        factor = red.premul_factor

        def launch(comm, stream):
            if isinstance(factor, torch.Tensor):
                op = comm.create_premul_sum(factor.data_ptr(), red.dtype, on_device=True)
            else:
                op = comm.create_premul_sum(_types.premul_scalar_bytes(factor, dtype), red.dtype, on_device=False)
            try:
                call(comm, op, stream)
            finally:
                comm.destroy_op(op)
        return launch

    # -- collectives ------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        opts = opts if opts is not None else c10d.AllreduceOptions()
        if not self._is_cuda(tensors, "all_reduce"):
            return self._cpu.allreduce(tensors, opts)
        tensor = _single(tensors, "all_reduce")
        device = self._check_device(tensor, "all_reduce tensor")
        ring_call = self._ring_call(tensor, opts.reduceOp)
        if ring_call is not None:
            ptr, count = tensor.data_ptr(), tensor.numel()
            return self._submit(
                "all_reduce", device, [tensor],
                lambda comm, s: ring_call(self._ring(comm).all_reduce, ptr, ptr, count, s),
                keepalive=tensor, async_op=_async_requested(opts), own_group=True)
        red = self._reduction(tensor, opts.reduceOp, "all_reduce")
        ptr, count = tensor.data_ptr(), tensor.numel() * red.count_scale
        launch = self._reduce_launch(red, tensor.dtype,
                                     lambda comm, op, s: comm.all_reduce(ptr, ptr, count, red.dtype, op, s))
        return self._submit("all_reduce", device, [tensor], launch, keepalive=tensor,
                            async_op=_async_requested(opts))

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts if opts is not None else c10d.AllreduceCoalescedOptions()
        if not self._is_cuda(tensors, "all_reduce_coalesced"):
            return self._cpu.allreduce_coalesced(tensors, opts)
        return self._coalesced(lambda: [self.allreduce([t], opts) for t in tensors])

    def broadcast(self, tensors, opts=None):
        opts = opts if opts is not None else c10d.BroadcastOptions()
        if not self._is_cuda(tensors, "broadcast"):
            return self._cpu.broadcast(tensors, opts)
        tensor = _single(tensors, "broadcast")
        device = self._check_device(tensor, "broadcast tensor")
        root = self._check_root(opts.rootRank)
        ptr, nbytes = tensor.data_ptr(), _nbytes(tensor)
        return self._submit(
            "broadcast", device, [tensor],
            lambda comm, s: comm.broadcast(ptr, ptr, nbytes, _types.NCCL_BYTE, root, s),
            keepalive=tensor, async_op=_async_requested(opts))

    def reduce(self, tensors, opts=None):
        opts = opts if opts is not None else c10d.ReduceOptions()
        if not self._is_cuda(tensors, "reduce"):
            return self._cpu.reduce(tensors, opts)
        tensor = _single(tensors, "reduce")
        device = self._check_device(tensor, "reduce tensor")
        root = self._check_root(opts.rootRank)
        red = self._reduction(tensor, opts.reduceOp, "reduce")
        ptr, count = tensor.data_ptr(), tensor.numel() * red.count_scale
        launch = self._reduce_launch(
            red, tensor.dtype, lambda comm, op, s: comm.reduce(ptr, ptr, count, red.dtype, op, root, s))
        return self._submit("reduce", device, [tensor], launch, keepalive=tensor,
                            async_op=_async_requested(opts))

    def allgather(self, output_tensors, input_tensors, opts=None):
        opts = opts if opts is not None else c10d.AllgatherOptions()
        if not self._is_cuda([output_tensors, input_tensors], "all_gather"):
            return self._cpu.allgather(output_tensors, input_tensors, opts)
        tensor = _single(input_tensors, "all_gather input")
        outputs = _check_list(_single_list(output_tensors, "all_gather output"), "all_gather output", self._size)
        device = self._check_device(tensor, "all_gather input")
        for index, out in enumerate(outputs):
            self._check_device(out, f"all_gather output[{index}]")
            _check_numel(out, tensor.numel(), f"all_gather output[{index}]")
        _check_same_dtype(outputs, tensor, "all_gather output")
        return self._gather_into(tensor, outputs, device, "all_gather", _async_requested(opts))

    def _gather_into(self, tensor, outputs, device, op_name, async_op):
        nbytes = _nbytes(tensor)
        direct = _adjacent(outputs, nbytes)
        if direct:
            flat_ptr = outputs[0].data_ptr()
            launch = lambda comm, s: comm.all_gather(tensor.data_ptr(), flat_ptr, nbytes, _types.NCCL_BYTE, s)
            return self._submit(op_name, device, outputs, launch, keepalive=(tensor, outputs),
                                async_op=async_op)
        staging = []

        def launch(comm, s):
            flat = torch.empty(self._size * tensor.numel(), dtype=tensor.dtype, device=device)
            staging.append(flat)
            comm.all_gather(tensor.data_ptr(), flat.data_ptr(), nbytes, _types.NCCL_BYTE, s)

        def finish():
            flat = staging.pop()
            for index, out in enumerate(outputs):
                out.copy_(flat[index * tensor.numel():(index + 1) * tensor.numel()].view_as(out))
        return self._submit(op_name, device, outputs, launch, finish, keepalive=(tensor, outputs),
                            async_op=async_op)

    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        opts = opts if opts is not None else c10d.AllgatherOptions()
        if not self._is_cuda([output_lists, input_tensors], "all_gather_coalesced"):
            return self._cpu.allgather_coalesced(output_lists, input_tensors, opts)
        if len(output_lists) != len(input_tensors):
            raise CupycollValueError(
                f"all_gather_coalesced: {len(output_lists)} output lists for {len(input_tensors)} inputs")
        return self._coalesced(
            lambda: [self.allgather([outs], [t], opts) for outs, t in zip(output_lists, input_tensors)])

    def all_gather_single(self, output, input, opts=None):
        opts = opts if opts is not None else c10d.AllgatherOptions()
        if not self._is_cuda([output, input], "all_gather_into_tensor"):
            return self._cpu._allgather_base(output, input, opts)
        device = self._check_device(input, "all_gather_into_tensor input")
        self._check_device(output, "all_gather_into_tensor output")
        _check_numel(output, input.numel() * self._size, "all_gather_into_tensor output")
        _check_same_dtype([output], input, "all_gather_into_tensor output")
        nbytes = _nbytes(input)
        in_ptr, out_ptr = input.data_ptr(), output.data_ptr()
        return self._submit(
            "all_gather_into_tensor", device, [output],
            lambda comm, s: comm.all_gather(in_ptr, out_ptr, nbytes, _types.NCCL_BYTE, s),
            keepalive=(input, output), async_op=_async_requested(opts))

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else c10d.AllgatherOptions()
        if not self._is_cuda([outputs, inputs], "all_gather_into_tensor_coalesced"):
            return self._cpu.allgather_into_tensor_coalesced(outputs, inputs, opts)
        return self._coalesced(lambda: [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)])

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts if opts is not None else c10d.ReduceScatterOptions()
        if not self._is_cuda([output_tensors, input_tensors], "reduce_scatter"):
            return self._cpu.reduce_scatter(output_tensors, input_tensors, opts)
        output = _single(output_tensors, "reduce_scatter output")
        inputs = _check_list(_single_list(input_tensors, "reduce_scatter input"), "reduce_scatter input", self._size)
        device = self._check_device(output, "reduce_scatter output")
        for index, tensor in enumerate(inputs):
            self._check_device(tensor, f"reduce_scatter input[{index}]")
            _check_numel(tensor, output.numel(), f"reduce_scatter input[{index}]")
        _check_same_dtype(inputs, output, "reduce_scatter input")
        ring_call = self._ring_call(output, opts.reduceOp)
        if ring_call is not None:
            staged = [None]

            def launch(comm, s):
                staged[0] = torch.cat([t.reshape(-1) for t in inputs])
                ring_call(self._ring(comm).reduce_scatter, staged[0].data_ptr(), output.data_ptr(),
                          output.numel(), s)
            return self._submit("reduce_scatter", device, [output], launch,
                                keepalive=(output, inputs, staged), async_op=_async_requested(opts),
                                own_group=True)
        red = self._reduction(output, opts.reduceOp, "reduce_scatter")
        count = output.numel() * red.count_scale
        out_ptr = output.data_ptr()
        flat = [None]

        def call(comm, op, s):
            flat[0] = torch.cat([t.reshape(-1) for t in inputs])
            comm.reduce_scatter(flat[0].data_ptr(), out_ptr, count, red.dtype, op, s)
        return self._submit("reduce_scatter", device, [output], self._reduce_launch(red, output.dtype, call),
                            keepalive=(output, inputs, flat), async_op=_async_requested(opts))

    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts if opts is not None else c10d.ReduceScatterOptions()
        if not self._is_cuda([output, input], "reduce_scatter_tensor"):
            return compat.gloo_reduce_scatter_tensor(self._cpu, output, input, opts)
        device = self._check_device(output, "reduce_scatter_tensor output")
        self._check_device(input, "reduce_scatter_tensor input")
        _check_numel(input, output.numel() * self._size, "reduce_scatter_tensor input")
        _check_same_dtype([input], output, "reduce_scatter_tensor input")
        ring_call = self._ring_call(output, opts.reduceOp)
        if ring_call is not None:
            in_ptr, out_ptr, count = input.data_ptr(), output.data_ptr(), output.numel()
            return self._submit(
                "reduce_scatter_tensor", device, [output],
                lambda comm, s: ring_call(self._ring(comm).reduce_scatter, in_ptr, out_ptr, count, s),
                keepalive=(input, output), async_op=_async_requested(opts), own_group=True)
        red = self._reduction(output, opts.reduceOp, "reduce_scatter_tensor")
        count = output.numel() * red.count_scale
        in_ptr, out_ptr = input.data_ptr(), output.data_ptr()
        launch = self._reduce_launch(
            red, output.dtype, lambda comm, op, s: comm.reduce_scatter(in_ptr, out_ptr, count, red.dtype, op, s))
        return self._submit("reduce_scatter_tensor", device, [output], launch, keepalive=(input, output),
                            async_op=_async_requested(opts))

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else c10d.ReduceScatterOptions()
        if not self._is_cuda([outputs, inputs], "reduce_scatter_tensor_coalesced"):
            return self._cpu.reduce_scatter_tensor_coalesced(outputs, inputs, opts)
        return self._coalesced(lambda: [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)])

    def alltoall(self, output_tensors, input_tensors, opts=None):
        opts = opts if opts is not None else c10d.AllToAllOptions()
        if not self._is_cuda([output_tensors, input_tensors], "all_to_all"):
            return compat.gloo_alltoall(self._cpu, output_tensors, input_tensors, opts)
        outputs = _check_list(output_tensors, "all_to_all output", self._size)
        inputs = _check_list(input_tensors, "all_to_all input", self._size)
        device = self._check_device(inputs[0], "all_to_all input[0]")
        for name, tensors in (("output", outputs), ("input", inputs)):
            for index, tensor in enumerate(tensors):
                self._check_device(tensor, f"all_to_all {name}[{index}]")
        _check_same_dtype(outputs + inputs, inputs[0], "all_to_all")
        chunks = [(i.data_ptr(), _nbytes(i), o.data_ptr(), _nbytes(o)) for i, o in zip(inputs, outputs)]

        def launch(comm, s):
            for peer, (send_ptr, send_bytes, recv_ptr, recv_bytes) in enumerate(chunks):
                comm.send(send_ptr, send_bytes, _types.NCCL_BYTE, peer, s)
                comm.recv(recv_ptr, recv_bytes, _types.NCCL_BYTE, peer, s)
        return self._submit("all_to_all", device, outputs, _grouped(launch),
                            keepalive=(inputs, outputs), async_op=_async_requested(opts))

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        opts = opts if opts is not None else c10d.AllToAllOptions()
        if not self._is_cuda([output, input], "all_to_all_single"):
            return self._cpu.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)
        device = self._check_device(input, "all_to_all_single input")
        self._check_device(output, "all_to_all_single output")
        _check_same_dtype([output], input, "all_to_all_single output")
        send = _split_bytes(input, input_split_sizes, self._size, "input")
        recv = _split_bytes(output, output_split_sizes, self._size, "output")
        in_ptr, out_ptr = input.data_ptr(), output.data_ptr()

        def launch(comm, s):
            for peer in range(self._size):
                comm.send(in_ptr + send[peer][0], send[peer][1], _types.NCCL_BYTE, peer, s)
                comm.recv(out_ptr + recv[peer][0], recv[peer][1], _types.NCCL_BYTE, peer, s)
        return self._submit("all_to_all_single", device, [output], _grouped(launch),
                            keepalive=(input, output), async_op=_async_requested(opts))

    def gather(self, output_tensors, input_tensors, opts=None):
        opts = opts if opts is not None else c10d.GatherOptions()
        if not self._is_cuda([output_tensors, input_tensors], "gather"):
            return self._cpu.gather(output_tensors, input_tensors, opts)
        root = self._check_root(opts.rootRank)
        tensor = _single(input_tensors, "gather input")
        device = self._check_device(tensor, "gather input")
        if self._rank == root:
            outputs = _check_list(_single_list(output_tensors, "gather output"), "gather output", self._size)
            for index, out in enumerate(outputs):
                self._check_device(out, f"gather output[{index}]")
                _check_numel(out, tensor.numel(), f"gather output[{index}]")
            _check_same_dtype(outputs, tensor, "gather output")
            recv = [(o.data_ptr(), _nbytes(o)) for o in outputs]
        else:
            if output_tensors and any(len(lst) for lst in output_tensors):
                raise CupycollValueError(f"gather: rank {self._rank} is not the root ({root}) and must pass no outputs")
            outputs, recv = [], []
        send_ptr, nbytes = tensor.data_ptr(), _nbytes(tensor)
        rank = self._rank

        def launch(comm, s):
            if rank == root:
                for peer, (ptr, size) in enumerate(recv):
                    comm.recv(ptr, size, _types.NCCL_BYTE, peer, s)
            comm.send(send_ptr, nbytes, _types.NCCL_BYTE, root, s)
        return self._submit("gather", device, outputs, _grouped(launch), keepalive=(tensor, outputs),
                            async_op=_async_requested(opts))

    def scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts if opts is not None else c10d.ScatterOptions()
        if not self._is_cuda([output_tensors, input_tensors], "scatter"):
            return self._cpu.scatter(output_tensors, input_tensors, opts)
        root = self._check_root(opts.rootRank)
        tensor = _single(output_tensors, "scatter output")
        device = self._check_device(tensor, "scatter output")
        if self._rank == root:
            inputs = _check_list(_single_list(input_tensors, "scatter input"), "scatter input", self._size)
            for index, inp in enumerate(inputs):
                self._check_device(inp, f"scatter input[{index}]")
                _check_numel(inp, tensor.numel(), f"scatter input[{index}]")
            _check_same_dtype(inputs, tensor, "scatter input")
            send = [(i.data_ptr(), _nbytes(i)) for i in inputs]
        else:
            if input_tensors and any(len(lst) for lst in input_tensors):
                raise CupycollValueError(f"scatter: rank {self._rank} is not the root ({root}) and must pass no inputs")
            inputs, send = [], []
        recv_ptr, nbytes = tensor.data_ptr(), _nbytes(tensor)
        rank = self._rank

        def launch(comm, s):
            if rank == root:
                for peer, (ptr, size) in enumerate(send):
                    comm.send(ptr, size, _types.NCCL_BYTE, peer, s)
            comm.recv(recv_ptr, nbytes, _types.NCCL_BYTE, root, s)
        return self._submit("scatter", device, [tensor], _grouped(launch), keepalive=(tensor, inputs),
                            async_op=_async_requested(opts))

    def send(self, tensors, dst_rank, tag=0):
        if not self._is_cuda(tensors, "send"):
            return self._cpu.send(tensors, dst_rank, tag)
        return self._point_to_point("send", tensors, dst_rank)

    def recv(self, tensors, src_rank, tag=0):
        if not self._is_cuda(tensors, "recv"):
            return self._cpu.recv(tensors, src_rank, tag)
        return self._point_to_point("recv", tensors, src_rank)

    def _point_to_point(self, op_name, tensors, peer):
        tensor = _single(tensors, op_name)
        device = self._check_device(tensor, f"{op_name} tensor")
        peer = self._check_peer(peer)
        ptr, nbytes = tensor.data_ptr(), _nbytes(tensor)
        if op_name == "send":
            launch = lambda comm, s, comm_peer: comm.send(ptr, nbytes, _types.NCCL_BYTE, comm_peer, s)
        else:
            launch = lambda comm, s, comm_peer: comm.recv(ptr, nbytes, _types.NCCL_BYTE, comm_peer, s)
        return self._submit(op_name, device, [tensor], launch, keepalive=tensor, peer=peer, async_op=True)

    def recv_anysource(self, tensors, tag=0):
        if not self._is_cuda(tensors, "recv_anysource"):
            return self._cpu.recv_anysource(tensors, tag)
        raise CupycollValueError("recv from any source is not supported by NCCL; name the source rank")

    def barrier(self, opts=None):
        opts = opts if opts is not None else c10d.BarrierOptions()
        device = _barrier_device(opts)
        if device is None:
            self._check_usable()
            return self._cpu.barrier(opts)
        device = self._device or device
        token = torch.zeros(1, dtype=torch.uint8, device=device)
        ptr = token.data_ptr()
        # Like ProcessGroupNCCL: a one-byte all-reduce whose wait() blocks the CPU.
        return self._submit("barrier", device, [token],
                            lambda comm, s: comm.all_reduce(ptr, ptr, 1, _types.NCCL_BYTE, 0, s),
                            keepalive=token, async_op=True, blocking_wait=True)

    # -- coalescing -------------------------------------------------------------------
    def _coalesced(self, body: Callable[[], list]) -> Optional[CudaWork]:
        """Run ``body`` (which submits CUDA calls) as one NCCL group; one Work for all.
        Inside an open coalescing block the calls join it and the block's Work covers them."""
        if self._coalescing is not None:
            body()
            return None
        self._open_block()
        try:
            body()
        except BaseException:
            self._abandon_coalescing()
            raise
        return self._close_block()

    def _start_coalescing(self, device=None):
        if _is_cpu(device):
            return self._cpu._start_coalescing(device)
        self._open_block()

    def _end_coalescing(self, device=None):
        if _is_cpu(device):
            return self._cpu._end_coalescing(device)
        return self._close_block()

    def _open_block(self) -> None:
        self._check_usable()
        if self._coalescing is not None:
            # torch's _coalescing_manager never calls _end_coalescing when its body raises;
            # the block left open by such an exception is dropped here, never issued.
            self._discard_raised_block(stacklevel=4)
        owner = _open_block_owner.__dict__.get("group")
        if owner is not None and owner is not self:
            owner._check_coalescing_scope("_start_coalescing", other=self)
        self._flush()
        self._coalescing = []
        self._coalescing_manager = _calling_manager(self._manager_gone)
        _open_block_owner.group = self

    def _close_block(self) -> dist.Work:
        works = self._coalescing
        self._release_block()
        if works is None:
            raise CupycollValueError("_end_coalescing without _start_coalescing")
        if not works:
            return _empty_work()
        self._flush()
        first = works[0]
        work = CudaWork("coalesced", first.device, [t for w in works for t in w.result()],
                        seq=works[-1].seq, blocking_wait=self.settings.blocking_wait)
        work._issued(first._stream, first._event, [w._keepalive for w in works])
        self._watch.track(work)
        return work

    def _release_block(self) -> None:
        self._coalescing = None
        self._coalescing_manager = None
        if _open_block_owner.__dict__.get("group") is self:
            _open_block_owner.group = None

    def _abandon_coalescing(self) -> None:
        """An exception inside a coalescing block: drop what it queued, stay usable."""
        queued = self._coalescing or []
        self._release_block()
        dropped = {id(w) for w in queued}
        self._queue = [i for i in self._queue if id(i.work) not in dropped]
        error = CupycollError("its coalescing block was abandoned (the manager's body raised)")
        for work in queued:
            work._fail(error)

    def _block_is_stale(self) -> bool:
        """Did the ``_coalescing_manager`` that opened our block end without closing it?"""
        if self._coalescing is None or self._coalescing_manager is None:
            return False
        generator = self._coalescing_manager()
        return generator is None or inspect.getgeneratorstate(generator) == inspect.GEN_CLOSED

    def _manager_gone(self, manager_ref) -> None:
        """The generator of a ``_coalescing_manager`` that opened a block was freed (the
        ``with`` statement is over). If our block is still open, its body raised: drop the
        block, and also torch's own record of the manager, which torch leaves behind (so the
        group's next all_reduce would otherwise be captured into a dead manager forever)."""
        if self._coalescing_manager is not manager_ref or self._coalescing is None:
            return
        self._discard_raised_block(stacklevel=3)
        world = getattr(dist.distributed_c10d, "_world", None)
        pending = getattr(world, "pg_coalesce_state", None)
        if isinstance(pending, dict):
            pending.pop(self, None)

    def _drop_stale_block(self) -> bool:
        if not self._block_is_stale():
            return False
        self._discard_raised_block(stacklevel=5)
        return True

    def _discard_raised_block(self, stacklevel: int) -> None:
        warnings.warn("cupycoll: a coalescing block left open (the manager's body raised) was "
                      "discarded; the calls it had queued were never issued", RuntimeWarning,
                      stacklevel=stacklevel)
        self._abandon_coalescing()

    def _check_coalescing_scope(self, op_name: str, other: "ProcessGroupCupycoll" = None) -> None:
        """Called when the thread has an open block: it must be this group's own."""
        owner = _open_block_owner.__dict__.get("group")
        if owner is None:
            return
        if owner._drop_stale_block() or owner._coalescing is None:
            if _open_block_owner.__dict__.get("group") is owner:
                _open_block_owner.group = None
            return
        if owner is self:
            return
        target = other if other is not None else self
        raise CupycollValueError(
            f"{op_name} on group {target._group_name!r} inside a coalescing block of group "
            f"{owner._group_name!r}: a coalescing manager batches the calls of one group; "
            "close it first or use one manager per group")

    # -- lifetime ---------------------------------------------------------------------
    def _communicators(self) -> List[Communicator]:
        comms = list(self._p2p_comms.values())
        if self._comm is not None:
            comms.append(self._comm)
        return comms

    def shutdown(self) -> None:
        """Finalize and destroy the NCCL communicators once their work is done (healthy),
        or abort them when the group has faulted or its work does not finish within the
        timeout. The group is unusable afterwards."""
        if self._state != "ok":
            return
        try:
            self._flush()
        except CupycollError:
            pass  # the Works of that batch carry the error; shut down regardless
        if not self._drain(self.settings.timeout.total_seconds()):
            self.abort()
            return
        self._state = "shut down"
        self._stop_watching()
        self._close_rings()
        timeout = self.settings.timeout.total_seconds()
        for comm in self._communicators():
            try:
                comm.shutdown(timeout)
            except CupycollError as exc:
                warnings.warn(f"cupycoll: shutting down {comm} failed ({exc}); it was aborted",
                              RuntimeWarning, stacklevel=2)
                comm.abort()
        self._cpu_shutdown()

    def _drain(self, timeout: float) -> bool:
        """Wait (polling, no sync) until every tracked Work is done; False on a fault or timeout."""
        deadline = time.monotonic() + timeout
        inflight = self._watch.inflight
        while inflight:
            if self._watch.fault is not None:
                return False
            if inflight[0]._query_done():
                inflight.popleft()
                continue
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return self._watch.fault is None

    def abort(self) -> None:
        """Abort the NCCL communicators at once, without waiting for peers or the GPU: a
        collective stuck on the GPU is ended, and so is a communicator still connecting.
        Callable from any thread; never waits on peers."""
        self._abort(CommunicatorAbortedError(f"process group {self._group_name!r} was aborted"))

    def _abort(self, reason: BaseException) -> None:
        if self._state == "aborted":
            return
        self._state = "aborted"
        self._queue = []
        self._stop_watching()
        for comm in list(self._pending_comms) + self._communicators():
            try:
                comm.abort()
            except CupycollError as exc:
                warnings.warn(f"cupycoll: aborting {comm} failed: {exc}", RuntimeWarning, stacklevel=3)
        # Only now, with the kernels ended, may the Works' tensors and scratch be released.
        self._watch.fail_all(reason)
        self._close_rings()
        self._cpu_shutdown()

    def _close_rings(self) -> None:
        rings, self._rings = list(self._rings.values()), {}
        for ring in rings:
            try:
                ring.close()
            except Exception as exc:  # noqa: BLE001 - teardown goes on
                warnings.warn(f"cupycoll: closing a ring failed: {exc}", RuntimeWarning, stacklevel=3)

    def _on_fault(self, fault: BaseException) -> None:
        """The watchdog found a timeout or an async NCCL error (runs on its thread)."""
        self._fault = fault
        self._abort(fault)

    def _stop_watching(self) -> None:
        if self._watched:
            WATCHDOG.unwatch(self._watch)
            self._watched = False

    def _cpu_shutdown(self) -> None:
        compat.shutdown(self._cpu)

    # -- torch method names that changed between versions ------------------------------
    _allgather_base = all_gather_single
    _reduce_scatter_base = reduce_scatter_single
    alltoall_base = all_to_all_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced


def _creating_cupycoll_cuda_group() -> bool:
    """Is torch's ``_new_process_group_helper`` (up the stack) building a group whose CUDA
    backend is cupycoll? True when called from anywhere else."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_new_process_group_helper":
            backend = frame.f_locals.get("backend")
            try:
                mapping = dist.distributed_c10d.BackendConfig(backend).get_device_backend_map()
            except Exception:  # noqa: BLE001 - an unparsable backend is not ours
                return False
            return str(mapping.get("cuda", "")).lower() == BACKEND_NAME
        frame = frame.f_back
    return True


def abort_all() -> int:
    """Abort every live cupycoll group of this process (from any thread); how many were."""
    groups = [g for g in list(_LIVE_GROUPS) if g._state != "aborted"]
    for group in groups:
        group.abort()
    return len(groups)


def _calling_manager(on_freed: Optional[Callable] = None):
    """A weak reference to the ``torch.distributed._coalescing_manager`` generator that is
    calling ``_start_coalescing`` (None when called some other way). When the manager's
    body raises, torch never calls ``_end_coalescing``; the closed (or freed, then
    ``on_freed(ref)`` runs) generator tells us."""
    frame = sys._getframe(3)
    for _ in range(4):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        generator = getattr(owner, "gen", None)
        if inspect.isgenerator(generator) and generator.gi_code.co_name == "_coalescing_manager":
            if on_freed is None:
                return weakref.ref(generator)
            method = weakref.WeakMethod(on_freed)  # the ref must not keep the group alive
            return weakref.ref(generator, lambda ref: method() and method()(ref))
        frame = frame.f_back
    return None


def _is_cpu(device) -> bool:
    return device is not None and torch.device(device).type == "cpu"


def _barrier_device(opts) -> Optional[torch.device]:
    """The CUDA device a barrier should run on, or None for a CPU (gloo) barrier."""
    device = getattr(opts, "device", None)
    device_ids = list(getattr(opts, "device_ids", None) or [])
    if device is not None and device.type == "cuda":
        if device.index is None:
            return torch.device("cuda", device_ids[0] if device_ids else torch.cuda.current_device())
        return device
    if device_ids and (device is None or device.type != "cpu"):
        return torch.device("cuda", device_ids[0])
    return None


def _single_list(lists, what: str):
    if not isinstance(lists, (list, tuple)) or len(lists) != 1:
        raise CupycollValueError(f"{what}: cupycoll takes one list of tensors per process")
    return lists[0]


def _adjacent(tensors: Sequence[torch.Tensor], nbytes: int) -> bool:
    """Are the tensors consecutive slices of one buffer, in order?"""
    base = tensors[0].data_ptr()
    return all(t.data_ptr() == base + i * nbytes for i, t in enumerate(tensors))


def _split_bytes(tensor: torch.Tensor, split_sizes, world: int, what: str) -> List[Tuple[int, int]]:
    """(byte offset, byte count) per peer for all_to_all_single's dim-0 splits."""
    rows = tensor.shape[0] if tensor.dim() > 0 else 1
    row_bytes = (_nbytes(tensor) // rows) if rows else 0
    sizes = list(split_sizes or [])
    if not sizes:
        if rows % world:
            raise CupycollValueError(
                f"all_to_all_single {what}: dim 0 ({rows}) is not divisible by the group size ({world}); "
                "pass split sizes")
        sizes = [rows // world] * world
    if len(sizes) != world:
        raise CupycollValueError(f"all_to_all_single {what} split sizes {sizes} have {len(sizes)} entries; "
                                 f"the group has {world} ranks")
    if any(s < 0 for s in sizes) or sum(sizes) != rows:
        raise CupycollValueError(f"all_to_all_single {what} split sizes {sizes} do not add up to dim 0 ({rows})")
    offsets = list(itertools.accumulate([0] + sizes[:-1]))
    return [(o * row_bytes, s * row_bytes) for o, s in zip(offsets, sizes)]


def _grouped(launch):
    """Several NCCL calls that must run as one NCCL group even when issued alone."""
    def grouped(comm, stream):
        with nccl_group():
            launch(comm, stream)
    return grouped


def _empty_work() -> dist.Work:
    future = torch.futures.Future()
    future.set_result([])
    return torch._C._distributed_c10d._create_work_from_future(future)
