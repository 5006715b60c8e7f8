"""The CUDA half of a cupycoll group: what ``pg._get_backend(torch.device("cuda"))`` returns.

A :class:`CudaBackend` owns everything a group needs to run NCCL:

* **communicators**: one per group on one device, created lazily at the first CUDA call
  (or eagerly, when torch calls :meth:`~CudaBackend.eager_connect_single_device` for
  ``init_process_group(device_id=...)``), from a unique id shared through the store
  (:mod:`cupycoll.nccl.bootstrap`) or split from a bound parent's; two-rank pair communicators
  for point-to-point calls, unless the group's own was made at init (see :meth:`~CudaBackend.p2p_comm`);
* **the queue**: point-to-point calls wait in it and are issued together, as one NCCL
  group, when one of their Works is touched or any other CUDA call is made. torch
  hands a Python group the ops of ``batch_isend_irecv`` one by one, and issued one by one
  NCCL send/recv deadlock in patterns like a ring exchange. An open coalescing block queues
  every CUDA call until it closes, the same way;
* **streams**, as recent ProcessGroupNCCL: a synchronous call (``async_op=False``) runs on
  the caller's current stream with no side stream and no event; an asynchronous one on the
  communicator's internal stream after it waits for the current stream, and its tensors
  stay referenced until the GPU is done with them;
* **faults**: every issued Work is tracked by the process's watchdog
  (:mod:`cupycoll.faults.watchdog`), through the group's lifetime (:mod:`cupycoll.faults.lifecycle`, which
  also owns the group's state, abort and shutdown). A collective that outlives the timeout, or an NCCL async
  error, aborts the communicators and fails the Works; every later call raises
  CommunicatorAbortedError. :meth:`~CudaBackend.abort` works from any thread, also while a
  communicator is being created (store waits poll; nonblocking communicators can be
  aborted mid-init); :meth:`~CudaBackend.shutdown` finalizes when healthy, aborts when not;
* **runners**: of cupycoll's algorithms (:mod:`cupycoll.algorithms`, such as the ring), one per
  algorithm and communicator, made on first use.

The backend knows its group only through callbacks it holds weakly (``name`` for messages,
``on_abort`` to shut the group's gloo half down, ``on_bind`` to set its ``bound_device_id``),
so torch may keep this object without keeping the group alive, and no reference cycle forms.

Deliberately left out: torch's routing and its coalescing-manager protocol (the group's,
:mod:`cupycoll.process_group`), what each collective launches (:mod:`cupycoll.collectives`),
and recovery (a faulted group is shrunk to its survivors or replaced: docs/faults.md).
"""

from __future__ import annotations

import inspect
import warnings
import weakref
import zlib
from typing import Callable, Dict, List, Optional, Sequence

import torch

from . import algorithms, compat, config
from .faults import lifecycle
from .nccl.bootstrap import StoreBootstrap
from .nccl.communicator import Communicator
from .errors import CollectiveTimeoutError, CommunicatorAbortedError, CupycollValueError, NcclError
from .call_queue import CallQueue, Issue
from .faults.watchdog import Watch
from .trace.recorder import E_ROUTE
from .work import CudaWork


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
    """Communicators, queue, streams and algorithm runners of one group; its state and ending are its lifetime's."""

    supports_coalescing = False
    supports_time_estimate = False

    def __init__(self, store, rank: int, size: int, settings: config.Settings,
                 global_ranks: Optional[Sequence[int]] = None, group_id: str = "",
                 name: Callable[[], str] = lambda: "", on_abort: Callable[[], None] = _nothing,
                 on_bind: Callable[[torch.device], None] = lambda device: None):
        self.rank = rank
        self.size = size
        self.settings = settings
        self.global_ranks = list(global_ranks or range(size))
        self._name = _weak(name)
        self._on_abort = _weak(on_abort)
        self._on_bind = _weak(on_bind)
        self.device: Optional[torch.device] = None
        self.comm: Optional[Communicator] = None
        self._comm_stream = None  # torch view of the communicator's internal stream
        self._p2p_comms: Dict[int, Communicator] = {}  # peer -> two-rank communicator
        self._p2p_on_group = False  # the group's communicator was made at init: P2P uses it
        self._pending_comms: List[Communicator] = []  # being created: abort() must reach them
        self._runners: Dict[tuple, object] = {}  # (algorithm, id(communicator)) -> its runner
        self.trace = None  # the group's flight recorder (cupycoll.trace.group), if any
        self._submitting: Optional[list] = None  # its entry for the call being submitted
        self._launching: Optional[list] = None  # the entry of the batch being launched
        timeout = settings.timeout.total_seconds()
        # Callbacks into this object are weak: a cycle would keep destroyed groups (and their
        # gloo threads) alive until interpreter exit, where tearing gloo down aborts the process.
        this = weakref.ref(self)
        self._bootstrap = StoreBootstrap(store, rank, timeout, self._name, _weak(self.check_usable))
        watch = Watch(group_id or "default", timeout, settings.watchdog_interval,
                      lambda: this().communicators() if this() is not None else [],
                      lambda fault: this() is not None and this().life.on_fault(fault),
                      settings.on_timeout)
        self.life = lifecycle.GroupLifetime(self, watch)
        self.calls = CallQueue(lambda issues: this()._enqueue(issues), _weak(self.check_usable),
                               self.life.track_work, self._name, self.global_ranks,
                               settings.blocking_wait)

    def use_trace(self, trace) -> None:
        """Keep ``trace`` (the group's :class:`~cupycoll.trace.group.GroupTrace`): calls are
        marked issued here, completed by the watchdog, and a timeout is explained by it."""
        self.trace = trace
        mark = trace.recorder.mark
        this = weakref.ref(self)
        self._watch.on_done = lambda work: mark(work.trace_entry, "completed")
        # No Work (a call stuck inside NCCL): the batch being launched is the one behind.
        self._watch.explain_timeout = lambda work, timeout_s: trace.explain_timeout(
            work.trace_entry if work is not None else getattr(this(), "_launching", None), timeout_s)

    # The group's state, fault and watch are its lifetime's (cupycoll.faults.lifecycle).
    @property
    def state(self) -> lifecycle.GroupState:
        return self.life.state

    @property
    def fault(self) -> Optional[BaseException]:
        return self.life.fault

    @property
    def _watch(self) -> Watch:
        return self.life.watch

    def check_usable(self) -> None:
        self.life.check_usable()

    # -- torch's Backend face ----------------------------------------------------------
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

    def perform_nocolor_split(self, device) -> None:
        # torch calls this on ranks left out of a new subgroup, with the default group's
        # bound device; it must mirror the members' split exactly: the same predicate.
        if self.splits_children(device):
            self.comm.split(-1, self.rank)

    def name(self) -> str:
        return config.BACKEND_NAME

    # -- device --------------------------------------------------------------------------
    def check_device(self, tensor: torch.Tensor, what: str) -> torch.device:
        device = tensor.device
        if self.device is not None and device != self.device:
            raise CupycollValueError(
                f"{what} is on {device} but this group's communicator is on {self.device}")
        if not tensor.is_contiguous():
            raise CupycollValueError(
                f"{what} is not contiguous (shape {tuple(tensor.shape)}, strides {tensor.stride()})")
        return device

    def _adopt_device(self, device: torch.device) -> None:
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._watch.device = device  # its events are queried with it current (not cuda:0)
        # Watched from now: a call can be stuck inside NCCL before its Work exists.
        self.life.watching()

    # -- communicators -----------------------------------------------------------------
    def splits_children(self, bound_device) -> bool:
        """Do subgroups get their communicators by splitting this one? Only when the group
        is bound to a device (``bound_device``: torch's ``pg.bound_device_id``)."""
        return (self.settings.comm_split and self.comm is not None and bound_device is not None
                and self.comm.can_split())

    def split_from(self, parent: "CudaBackend") -> None:
        """This group's communicator, split from ``parent``'s (collective over the parent)."""
        self.comm = parent.comm.split(split_color(self.global_ranks), self.rank, self.life.fault_once)
        self._adopt_device(parent.device)
        self._p2p_on_group = self.comm is not None  # made at construction on every member

    def shrink_from(self, parent: "CudaBackend", exclude: Sequence[int], abort_first: bool) -> str:
        """This group's communicator from ``parent``'s without the parent's ranks ``exclude``
        (collective over the survivors, who all call it), and the parent's end: its Works in
        flight fail first, then its communicators are aborted. Returns how the communicator
        was made: ``"ncclCommShrink"`` when every survivor's parent communicator is healthy
        and its NCCL has it (``NCCL_SHRINK_ABORT`` when ``abort_first`` or work is in
        flight), else ``"new"``: made anew on this group's store, at once when the parent
        had a device, on first use when it had none."""
        comm = parent.comm
        live = (comm is not None and parent.life.usable and comm.state == "ok" and comm.can_shrink())
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
        parent.life.replace(reason, before_kernels_end=lambda: made.append(
            comm.shrink(exclude, abort_first, self.life.fault_once)))
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
                device = torch.device("cuda", torch.cuda.current_device())
            self.comm = self._connect("comm", self.rank == 0, self.size, self.rank, device.index)
            self._recheck(self.comm)
            self._adopt_device(device)
        return self.comm

    def p2p_comm(self, peer: int) -> Communicator:
        """The communicator for a point-to-point call with ``peer``: the group's own when it
        was made at init (eager ``device_id``, or split from a bound parent), otherwise always
        one of just the two ranks, created on first use (a send between two ranks never needs
        the others). Never "the group's own once it exists": when that happens differs by
        rank (rank 0 may have made its first collective before a send that rank 1 receives
        before its own), and both ends of a send/recv must use the same communicator."""
        if self._p2p_on_group:
            return self.comm
        comm = self._p2p_comms.get(peer)
        if comm is None:
            low, high = sorted((self.rank, peer))
            comm = self._connect(f"p2p/{low}-{high}", self.rank == low, 2, int(self.rank == high),
                                 self.device.index)
            self._p2p_comms[peer] = comm
            self._recheck(comm)
        return comm

    def _connect(self, key: str, creator: bool, size: int, rank: int, device: int) -> Communicator:
        """Local checks first (a rank failing after the store gate would leave its peers in
        blocking ncclCommInitRank for good), then the gate and NCCL."""
        Communicator.preflight(device, self.settings.nccl_library, self.settings.nonblocking)
        try:
            return self._create_comm(self._bootstrap.unique_id(key, creator, size), rank, size, device)
        except (CollectiveTimeoutError, NcclError) as exc:
            self.life.fault_once(exc)
            raise

    def _recheck(self, comm: Communicator) -> None:
        # abort() marks the state before it collects the communicators: one attached after
        # that collection is seen here, and aborted.
        if not self.life.usable:
            comm.abort()
            self.check_usable()

    def _create_comm(self, unique_id: bytes, rank: int, size: int, device: int) -> Communicator:
        """Create a communicator where abort() can reach it while it connects."""
        comm = Communicator.begin(unique_id, rank, size, device, self.settings.nccl_library,
                                  self.settings.nonblocking, self.settings.timeout.total_seconds(),
                                  self.life.fault_once)
        self._pending_comms.append(comm)
        try:
            if not self.life.usable:  # aborted while NCCL was starting
                comm.abort()
            self.check_usable()
            comm.wait_ready()
        finally:
            self._pending_comms.remove(comm)
        return comm

    def communicators(self) -> List[Communicator]:
        comms = list(self._p2p_comms.values())
        if self.comm is not None:
            comms.append(self.comm)
        return comms

    def all_communicators(self) -> List[Communicator]:
        """Those being created too: what an abort must reach."""
        return list(self._pending_comms) + self.communicators()

    def runner(self, algorithm: str, comm: Communicator):
        """The runner of ``algorithm`` on ``comm`` (its scratch memory, side stream...), made
        on first use."""
        runner = self._runners.get((algorithm, id(comm)))
        if runner is None:
            runner = self._runners[algorithm, id(comm)] = algorithms.get(algorithm).make_runner(comm, self.settings)
        return runner

    # -- issuing -------------------------------------------------------------------------
    def submit(self, op_name, device, outputs, launch, finish=None, keepalive=(), async_op=True,
               peer=None, blocking_wait=False, algorithm=None, prepare=None) -> CudaWork:
        """Issue (or queue) one CUDA call and return its Work. Everything is validated.
        ``launch(comm, stream_ptr)`` (``launch(comm, stream_ptr, comm_peer)`` for a
        point-to-point call) makes the NCCL calls; ``prepare(comm)`` precedes its NCCL group,
        ``finish()`` follows it. ``algorithm``: the name of the algorithm the call runs
        (NCCL groups of its own: never inside a batch's), recorded as its route."""
        own_group = algorithm is not None
        # One issuer at a time: NCCL forbids concurrent calls on one communicator.
        with self.calls.lock:
            if self.device is None:
                self._adopt_device(device)  # the first CUDA call picks the group's device
            entry = self.trace.take() if self.trace is not None else None  # the group recorded it
            if entry is not None and own_group:
                entry[E_ROUTE] = algorithm
            self._submitting = entry  # _enqueue gives it to this call's Work if it launches now
            try:
                work, now = self.calls.submit(op_name, device, outputs, launch, finish, keepalive, async_op,
                                              peer, blocking_wait or self.settings.blocking_wait, own_group,
                                              prepare)
                if now is not None:
                    self._enqueue([now])
            finally:
                self._submitting = None
            if entry is not None and work.trace_entry is None:
                work.trace_entry = entry  # queued: marked issued when its batch launches
        return work

    def flush(self) -> None:
        """Issue the queued calls now (unless a coalescing block is open)."""
        self.calls.flush()

    def _enqueue(self, issues: List[Issue]) -> None:
        device = self.device
        if len(issues) == 1 and issues[0].peer is None:  # the hot path: one collective
            comms = None
            if self.comm is None:
                self.comm_for(device)
        else:
            if any(i.peer is None for i in issues):
                self.comm_for(device)
            # Pair communicators are created in one global order (by peer), so creating
            # them can never wait in a cycle.
            comms = {peer: self.p2p_comm(peer) for peer in sorted({i.peer for i in issues} - {None})}
        current = torch.cuda.current_stream(device)
        async_op = issues[0].async_op if len(issues) == 1 else any(i.async_op for i in issues)
        if async_op:
            stream = self._internal_stream(self.comm or comms[min(comms)])
            stream.wait_stream(current)
        else:
            stream = current
        launched = []  # not empty once part of the batch may be on the stream
        first = issues[0].work.trace_entry  # a queued batch's; None: the call submitted now
        self._launching = first if first is not None else self._submitting
        try:
            if async_op or current.device_index != torch.cuda.current_device():
                # Make ``stream`` (and its device) current for what launch/finish allocate.
                with torch.cuda.stream(stream):
                    self._launch_all(issues, comms, stream.cuda_stream, launched)
            else:
                self._launch_all(issues, comms, stream.cuda_stream, launched)
        except BaseException as exc:
            if launched:  # it runs (its tensors stay kept) and the peers wait for the rest
                try:
                    self._track(issues, stream, async_op)
                except Exception:  # noqa: BLE001 - untracked, the queue fails them after the abort
                    pass
                self.life.fault_once(exc if isinstance(exc, Exception) else lifecycle.interrupted(exc))
            timed_out = self.life.timeout_that_cut(exc)
            if timed_out is not None:
                raise timed_out from exc
            raise
        finally:
            self._launching = None
        self._track(issues, stream, async_op)

    def _track(self, issues: List[Issue], stream, async_op: bool) -> None:
        recorder = self.trace.recorder if self.trace is not None else None
        self.life.track(issues, stream, async_op, recorder, self._submitting)

    def _launch_all(self, issues: List[Issue], comms, stream_ptr: int, launched=None) -> None:
        # Every prepare of the batch runs before its NCCL group opens, as ncclGroupEnd
        # would launch a partial batch. One that raises makes no NCCL call; flush fails the
        # Works. From the first launch on (``launched``), a failure faults the group instead.
        launched = [] if launched is None else launched
        if len(issues) == 1:
            issue = issues[0]
            if issue.prepare is not None:
                issue.prepare(self.comm if issue.peer is None else comms[issue.peer])
            if issue.own_group:  # an algorithm: several steps, any of them may fail
                launched.append(issue)
            if issue.peer is None:  # the hot path: one collective on the group's communicator
                issue.launch(self.comm, stream_ptr)
            else:
                self._launch(issue, comms, stream_ptr)
            launched.append(issue)  # its one NCCL call (or own NCCL group) did not raise
        else:
            for issue in issues:
                if issue.prepare is not None:
                    issue.prepare(self.comm if issue.peer is None else comms[issue.peer])
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

    def _launch(self, issue: Issue, comms, stream_ptr: int) -> None:
        if issue.peer is None:
            issue.launch(self.comm, stream_ptr)
            return
        comm = comms[issue.peer]
        # On a two-rank pair communicator the peer is whichever of the two we are not.
        issue.launch(comm, stream_ptr, issue.peer if comm is self.comm else 1 - comm.rank)

    def _internal_stream(self, comm: Communicator):
        if self._comm_stream is None:
            self._comm_stream = torch.cuda.ExternalStream(comm.stream, device=self.device)
        return self._comm_stream

    # -- lifetime (the rules and their order: cupycoll.faults.lifecycle) ---------------------
    def shutdown(self) -> None:
        """Finalize and destroy the communicators once their work is done (healthy), or
        abort them when the group has faulted, its work does not finish within
        ``lifecycle.SHUTDOWN_GRACE`` seconds, or anything fails. Never raises; unusable
        afterwards."""
        self.life.shutdown(self.settings.timeout.total_seconds())

    def abort(self, reason: Optional[BaseException] = None) -> None:
        """Abort the communicators at once, without waiting for peers or the GPU: a
        collective stuck on the GPU is ended, and so is a communicator still connecting.
        The group's state and every Work in flight are failed with ``reason`` *before*
        ncclCommAbort, their tensors released after it; then the group's ``on_abort``.
        Callable from any thread; never waits on peers; every step runs whatever fails."""
        self.life.abort(reason)

    def on_abort(self) -> None:
        """The abort has ended the kernels: the group's CPU half shuts down too."""
        self._on_abort()

    def close_runners(self) -> None:
        runners, self._runners = list(self._runners.items()), {}
        for (algorithm, _), runner in runners:
            try:
                runner.close()
            except BaseException as exc:  # noqa: BLE001 - teardown goes on
                warnings.warn(f"cupycoll: closing the {algorithm} algorithm's runner failed: {exc}",
                              RuntimeWarning, stacklevel=3)

