"""The routing shell of a cupycoll group, shared by both shapes torch may hold it in.

:class:`GroupShell` is what a cupycoll group does with each call torch hands it:

* CPU tensors, CPU barriers and (through them) the object collectives go to the group's
  gloo half (a gloo group built on the same store: :mod:`cupycoll.cpu_half`): they behave
  exactly as ``"cpu:gloo"``, but for ReduceOp.AVG, which gloo cannot do on integers and
  cupycoll averages (:mod:`cupycoll.cpu_average`), as the CUDA route does, and what an older
  gloo lacks or gets wrong (the list forms of alltoall and reduce_scatter,
  reduce_scatter_tensor's op), which :mod:`cupycoll.compat` builds from what it has;
* CUDA tensors go to the group's :class:`~cupycoll.backend.CudaBackend`, through the
  collective's body in :mod:`cupycoll.collectives`;
* every call is recorded first in the group's flight recorder (:mod:`cupycoll.trace.group`),
  so a timeout on either route is explained by which rank is behind;
* each entry point takes torch's options form (``allreduce(tensors, opts)``) as its first
  branch, and any other form torch's ProcessGroup accepts (a bare op, a root, one tensor, a
  timeout, keywords) is bound to it by :mod:`cupycoll.call_forms`.

This module holds the group's construction, its routing, the hot calls (``allreduce``,
``broadcast``, ``all_gather_single``, ``reduce_scatter_single``: what DDP and FSDP call each
step, beside the route they take, so that each reads in one module) and the group's
lifetime (shutting down or aborting both halves). The other entry points, point-to-point,
the coalesced forms and torch's coalescing protocol are mixed in from
:class:`~cupycoll.shell_calls.ShellCalls`.

Two classes mix it in, one per shape (:mod:`cupycoll._registration` picks one):
:class:`~cupycoll.process_group.ProcessGroupCupycoll`, a torch ``ProcessGroup`` that is the
whole group, and :class:`~cupycoll.py_backend.CupycollBackend`, a c10d ``Backend`` that
torch's own ProcessGroup dispatches to (torch 2.14+). They differ only in how torch finds
them; each supplies ``_build_cpu_group``, ``_split_parent``, ``_bind``, ``getGroupName``
and ``_torch_group``.

A group made inside :func:`shrinking` (on the same thread) is the survivors' group of a
shrink (:mod:`cupycoll.shrink`): its communicator comes from the parent's instead of a new
bootstrap, and the parent ends there.

Deliberately left out: anything below routing (argument checks live in
:mod:`cupycoll._args` and :mod:`cupycoll.collectives`; streams, queueing, faults and
communicators in :mod:`cupycoll.backend`), building the gloo half (:mod:`cupycoll.cpu_half`),
and the torch side of a shrink (validation, which torch call makes the new group:
:mod:`cupycoll.shrink`).
"""

from __future__ import annotations

import contextlib
import datetime
import threading
from typing import Callable, Iterator, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d
from torch.distributed import ProcessGroup

from . import _args, call_forms, collectives, compat, config, cpu_average, cpu_half, logs
from .call_forms import MISSING
from .backend import CudaBackend
from .issue import Issuer
from .errors import CupycollValueError
from .shell_calls import ShellCalls
from .trace.group import GroupTrace
from .faults.lifecycle import GroupState
from .work import CudaWork

_OK = GroupState.OK

_CPU = torch.device("cpu")
# Ops whose tensors differ by rank outside one argument: [outputs, inputs] -> the alike one.
_ROOT_ONLY = {"gather": 1, "scatter": 0}
_ROOTED = frozenset({"broadcast", "reduce", "gather", "scatter"})
# The options classes the entry points test their options form by (one lookup, no attribute).
_ALLREDUCE, _BROADCAST = c10d.AllreduceOptions, c10d.BroadcastOptions
_ALLGATHER, _REDUCE_SCATTER = c10d.AllgatherOptions, c10d.ReduceScatterOptions


# The shrink the group being made on this thread comes from: (parent shell, excluded
# parent ranks, abort_first), set by shrinking() and taken by the group it makes.
_SHRINKING = threading.local()


@contextlib.contextmanager
def shrinking(parent: "GroupShell", exclude: Sequence[int], abort_first: bool) -> Iterator[None]:
    """The cupycoll group made on this thread inside the block (by torch, or by the shrink of a
    default group itself) is ``parent`` without its ranks ``exclude``: it takes its
    communicator from the parent's (and ends the parent; see
    :meth:`~cupycoll.backend.CudaBackend.shrink_from`)."""
    _SHRINKING.source = (parent, list(exclude), abort_first)
    try:
        yield
    finally:
        _SHRINKING.source = None


def shell_of(group: ProcessGroup) -> "GroupShell":
    """cupycoll's object behind ``group``, in either shape: the group itself (ProcessGroup
    shape), or the cupycoll backend torch registered in it (Backend shape)."""
    if isinstance(group, GroupShell):
        return group
    for device in (torch.device("cuda"), _CPU):
        try:
            backend = group._get_backend(device)
        except RuntimeError:  # none for this device
            continue
        backend = getattr(backend, "_owner", backend)  # a CPU view answers for its owner
        if isinstance(backend, GroupShell):
            return backend
    raise CupycollValueError(f"{group!r} is not a cupycoll group (it has no cupycoll backend)")


def group_fault(group: Optional[ProcessGroup] = None) -> Optional[BaseException]:
    """:attr:`GroupShell.fault` of a cupycoll group in either shape (the default group when
    ``group`` is None): what ended it, None while it is healthy."""
    return shell_of(group if group is not None else compat.default_group()).fault


def group_arguments(dist_backend_opts, pg_options) -> Tuple[tuple, dict]:
    """A shape's constructor arguments from torch's creator call (extended API)."""
    opts = dist_backend_opts
    return ((opts.store, opts.group_rank, opts.group_size, opts.timeout, pg_options),
            {"global_ranks": list(opts.global_ranks_in_group), "group_id": str(opts.group_id)})


class GroupShell(ShellCalls):
    """Construction, routing, the hot calls and lifetime of one cupycoll group, with the other
    entry points of :class:`~cupycoll.shell_calls.ShellCalls` (a mixin: see the module)."""

    # The CUDA half and its issuer; tests replace them (tests/standins.py), nothing else does.
    backend_class = CudaBackend
    issuer_class = Issuer

    def _build(self, store, rank: int, size: int, timeout: Optional[datetime.timedelta],
               options: Optional[config.Options], global_ranks: Optional[Sequence[int]],
               group_id: str, split_from: Optional["GroupShell"] = None) -> None:
        """``split_from``: the group torch makes this one from by a split (its communicator
        is then split from that group's, when that one's can be)."""
        self.settings = config.resolve(options, timeout)
        self._store = store  # a shrink's new group lives on it, under a prefix of its own
        # ``pg_options``, as init_process_group names it: apart from torch's own ``options``
        # (its backends' options objects, which torch reads).
        self.pg_options = options if options is not None else config.Options()
        self._rank = rank
        self._size = size
        self._global_ranks = list(global_ranks or range(size))
        self._group_id = group_id
        self._group_name = group_id
        self._group_desc = ""
        # The CPU half, then its gloo backend's own Python object (a shape's _build_cpu_group
        # sets ``_gloo_backend``), in this order in this object's __dict__: see _keep_gloo_last.
        self._cpu = None
        self._gloo_backend = None
        try:
            self._cpu = self._build_cpu_group(store, rank, size, self.settings.timeout)
        except dist.DistStoreError as exc:  # gloo's rendezvous timed out: a rank never came
            raise cpu_half.never_joined(store, rank, size, self._global_ranks, self._group_name,
                                        self.settings.timeout) from exc
        self._trace = GroupTrace(store, group_id, self._global_ranks, rank, self.settings)
        # The backend holds these callbacks weakly: torch may keep it, never the group through it.
        self._cuda = self.backend_class(store, rank, size, self.settings, self._global_ranks, group_id,
                                        name=self.getGroupName, on_abort=self._cpu_shutdown,
                                        on_bind=self._bind, trace=self._trace)
        # Where every CUDA call is issued (cupycoll.issue); the backend holds what they run on.
        self._issuer = self.issuer_class(self._cuda, self._trace.recorder, self._cuda._name,
                                         self.settings.blocking_wait)
        # How this group's communicator was made from another's: "ncclCommShrink", "new"
        # (a shrink that made it anew) or None (a group of its own, or split).
        self.shrunk_by: Optional[str] = None

        try:
            shrink = getattr(_SHRINKING, "source", None)
            if shrink is not None:
                _SHRINKING.source = None  # one group per shrink
                source, exclude, abort_first = shrink
                self.shrunk_by = self._cuda.shrink_from(source._cuda, exclude, abort_first)
            else:
                parent = self._split_parent(split_from)
                if parent is not None:
                    self._cuda.split_from(parent._cuda)
        except BaseException:
            self._trace.close("failed")  # no half-built group left answering its peers
            raise
        logs.log_group(group_id, rank, size, "backend" if isinstance(self, c10d.Backend) else "process_group",
                       self.settings)

    def _keep_gloo_last(self, gloo: ProcessGroup) -> None:
        """Hold ``gloo``'s Python object: where torch frees a ProcessGroup holding the GIL
        (:data:`cupycoll.compat.PROCESS_GROUP_FREED_WITHOUT_GIL`), that object, which torch
        frees without it, must drop the last reference to the gloo backend, never a
        ProcessGroup. There this group does not register gloo in its own C++ part, and a
        freed group drops its __dict__ in insertion order (whether freed at once or by the
        garbage collector): the CPU half, ``_cpu``, then ``_gloo_backend``."""
        self._gloo_backend = gloo

    def _torch_group(self) -> Optional[ProcessGroup]:
        """The ProcessGroup torch holds for this group (its coalescing state is keyed by it)."""
        raise NotImplementedError

    # -- routing ----------------------------------------------------------------------
    # What ``is_cuda`` says of a tensor of the CUDA route (the CPU tests' stand-in, whose CPU
    # tensors stand in for CUDA ones, says False).
    _tensors_are_cuda = True

    def _route(self, tensors, op_name: str, opts=None, peer=None) -> Tuple[bool, Optional[list]]:
        """(whether the call goes to NCCL (else gloo), its flight-recorder entry). Records the
        call (see :mod:`cupycoll.trace.group`); a CUDA call's parts of a ``*_coalesced`` call
        are recorded one by one, the whole not. The common CUDA calls (one tensor; FSDP's two,
        on one device) are told in a few attribute reads, on a healthy group."""
        if type(tensors) is list and tensors and self._cuda.life.state is _OK:
            first, last, cuda = tensors[0], tensors[-1], self._tensors_are_cuda
            if len(tensors) <= 2:
                if (isinstance(first, torch.Tensor) and isinstance(last, torch.Tensor) and first.is_cuda is cuda
                        and last.is_cuda is cuda and (first is last or first.device == last.device)):
                    if op_name.endswith("_coalesced"):
                        return True, None
                    return True, self._trace.call(op_name, tensors, opts.rootRank if op_name in _ROOTED else peer,
                                                  opts, "nccl", self._cpu)
            elif op_name.endswith("_coalesced") and isinstance(first, torch.Tensor) and first.is_cuda is cuda:
                index = first.get_device()  # a block's tensors: one pass, no call per tensor
                for tensor in tensors:
                    if not (isinstance(tensor, torch.Tensor) and tensor.is_cuda is cuda
                            and tensor.get_device() == index):
                        break
                else:
                    return True, None
        flat = _args.flat(tensors)
        if self._classify(flat, op_name):
            if op_name.endswith("_coalesced"):
                return True, None
            return True, self._record(tensors, flat, op_name, opts, peer, "nccl")
        calls = self._issuer
        if calls.block is not None and not calls.drop_stale_block():
            raise CupycollValueError(
                f"{op_name} on CPU tensors inside a coalescing block of CUDA calls on group "
                f"{self._group_name!r}: a block coalesces one device's calls; use a separate "
                "_coalescing_manager(device=torch.device('cpu')) for CPU tensors")
        calls.flush()  # a queued CUDA send/recv must not wait behind unrelated CPU work
        return False, self._record(tensors, flat, op_name, opts, peer, "gloo")

    def _record(self, tensors, flat, op_name, opts, peer, route) -> Optional[list]:
        """Record the call of ``tensors`` (``flat``: them as one list); its entry."""
        root = peer
        if op_name in _ROOTED:
            root = opts.rootRank
            # gather's outputs and scatter's inputs exist on the root only: record what all pass
            if op_name in _ROOT_ONLY:
                flat = _args.flat(tensors[_ROOT_ONLY[op_name]])
        return self._trace.call(op_name, flat, root, opts, route, self._cpu)

    def _issue(self, entry: Optional[list], collective: Callable, *args) -> CudaWork:
        """``collective(backend, *args, entry=entry)`` (the call described), issued. A call
        that raises on the way (bad input, NCCL) is marked failed in the flight recorder."""
        try:
            return self._issuer.issue(collective(self._cuda, *args, entry=entry))
        except BaseException:
            self._trace.recorder.mark(entry, "failed")
            raise

    def _gloo(self, entry: Optional[list], call, *args, outputs: Optional[list] = None) -> dist.Work:
        """``call(*args)`` on the gloo half, its Work traced with ``entry`` (and ``outputs``, what
        its future holds where gloo's Work has none: see TracedWork.get_future)."""
        try:
            work = call(*args)
        except BaseException:
            self._trace.recorder.mark(entry, "failed")
            raise
        return self._trace.gloo(work, entry, outputs)

    def _gloo_reduction(self, entry: Optional[list], call, outputs, *args) -> dist.Work:
        """``call(*args)`` (options last) on the gloo half, a reduction into ``outputs``: AVG,
        which gloo cannot do on every dtype, as a sum divided here (:mod:`cupycoll.cpu_average`)."""
        if cpu_average.wanted(args[-1], outputs):
            return self._gloo(entry, cpu_average.summed_then_divided, call, args, outputs, self._size,
                              outputs=outputs)
        return self._gloo(entry, call, *args, outputs=outputs)

    def _all_reduce_on_cpu(self, tensor: torch.Tensor, tensors: list, opts) -> Optional[dist.Work]:
        """The CPU route's common call in one frame: an all_reduce of one CPU tensor straight to
        the gloo half, recorded and traced as the general path does; None when it needs the
        general path: the group is not ``ok``, CUDA calls are queued or a coalescing block
        is open (the general path issues or refuses them), the mismatch check is on, or an
        AVG gloo cannot do (:mod:`cupycoll.cpu_average`).

        A synchronous call (``async_op=False``: torch waits on the Work at once) is waited
        on here and gets gloo's finished Work back, with no Work of cupycoll's own: a Python
        Work costs more than the rest of the route together. Its failure raises here,
        explained as a :class:`~cupycoll.trace.gloo_work.TracedWork`'s ``wait()`` explains it."""
        cuda, trace = self._cuda, self._trace
        calls = self._issuer
        if (cuda.life.state is not GroupState.OK or calls.block is not None or calls.pending or trace.check
                or cpu_average.wanted(opts, tensors)):
            return None
        entry = trace.recorder.record("all_reduce", (tensor.shape,), (tensor.dtype,), None, "gloo", "issued")
        if compat.async_requested(opts):
            return self._gloo(entry, self._cpu.allreduce, tensors, opts)
        return trace.gloo_waited(entry, self._cpu.allreduce, tensors, opts)

    def _classify(self, flat, op_name: str) -> bool:
        """Is the call of the tensors ``flat`` a CUDA call? Rejects calls that mix device
        types or CUDA devices."""
        if self._cuda.life.state is not GroupState.OK:
            self._cuda.check_usable()
        # Fast paths (the hot ones): one tensor; all tensors, all on CUDA, one device; or all on CPU.
        if len(flat) == 1 and isinstance(flat[0], torch.Tensor):
            if flat[0].is_cuda:
                return True
            if flat[0].is_cpu:
                return False
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
        return _args.classify_slowly(flat, op_name)

    # -- the hot collectives: CPU to gloo, CUDA to cupycoll.collectives -------------------
    # Each entry point takes torch's options form first; any other form torch's ProcessGroup
    # accepts (a bare op, a root, one tensor, a timeout) is bound to it by cupycoll.call_forms.
    # The other entry points are ShellCalls' (cupycoll.shell_calls).
    def allreduce(self, tensors=MISSING, opts=MISSING, *rest, **named):
        if type(opts) is not _ALLREDUCE or rest or named:
            tensors, opts = call_forms.bind("allreduce", (tensors, opts), rest, named)
        if type(tensors) is list and len(tensors) == 1 and isinstance(tensors[0], torch.Tensor) \
                and tensors[0].is_cpu and self._tensors_are_cuda:
            work = self._all_reduce_on_cpu(tensors[0], tensors, opts)
            if work is not None:
                return work
        cuda, entry = self._route(tensors, "all_reduce", opts)
        if not cuda:
            return self._gloo_reduction(entry, self._cpu.allreduce, tensors, tensors, opts)
        try:  # _issue, written out: the commonest call of all
            return self._issuer.issue(collectives.all_reduce(self._cuda, tensors, opts, entry))
        except BaseException:
            self._trace.recorder.mark(entry, "failed")
            raise

    def broadcast(self, tensors=MISSING, opts=MISSING, *rest, **named):
        if type(opts) is not _BROADCAST or rest or named:
            tensors, opts = call_forms.bind("broadcast", (tensors, opts), rest, named)
        cuda, entry = self._route(tensors, "broadcast", opts)
        if not cuda:
            return self._gloo(entry, self._cpu.broadcast, tensors, opts)
        return self._issue(entry, collectives.broadcast, tensors, opts)

    def all_gather_single(self, output=MISSING, input=MISSING, opts=MISSING, *rest, **named):
        if type(opts) is not _ALLGATHER or rest or named:
            output, input, opts = call_forms.bind("all_gather_single", (output, input, opts), rest, named)
        cuda, entry = self._route([output, input], "all_gather_into_tensor", opts)
        if not cuda:
            return self._gloo(entry, self._cpu._allgather_base, output, input, opts)
        return self._issue(entry, collectives.all_gather_into_tensor, output, input, opts)

    def reduce_scatter_single(self, outputTensor=MISSING, inputTensor=MISSING, opts=MISSING, *rest, **named):
        output, input = outputTensor, inputTensor
        if type(opts) is not _REDUCE_SCATTER or rest or named:
            output, input, opts = call_forms.bind("reduce_scatter_single", (output, input, opts), rest, named)
        cuda, entry = self._route([output, input], "reduce_scatter_tensor", opts)
        if not cuda:
            return self._gloo_reduction(entry, compat.gloo_reduce_scatter_tensor, [output], self._cpu, output,
                                        input, opts)
        return self._issue(entry, collectives.reduce_scatter_tensor, output, input, opts)

    # -- lifetime ---------------------------------------------------------------------
    @property
    def fault(self) -> Optional[BaseException]:
        """What ended this group: a timeout, an NCCL error, or the reason it was aborted (by
        its user, by a shrink that replaced it); None while it is healthy and after a clean
        shutdown. Asked of the group's lifetime (:mod:`cupycoll.faults.lifecycle`) each time.
        A CPU collective that failed raises from its Work and leaves the group as it was."""
        return self._cuda.life.ended_by

    def shutdown(self) -> None:
        """Finalize and destroy the NCCL communicators once their work is done (healthy),
        or abort them when the group has faulted or its work does not finish within the
        timeout; then shut the gloo half down. The group is unusable afterwards."""
        if self._cuda.state not in (GroupState.OK, GroupState.ABORTING):  # aborting: the shutdown aborts now
            return
        try:
            self._issuer.flush()  # what is queued goes first, as its Works promise
        except Exception:  # noqa: BLE001 - the Works of that batch carry the error
            pass
        self._cuda.shutdown()  # an abort instead shuts gloo down through on_abort
        if self._cuda.state is GroupState.SHUT_DOWN:
            self._cpu_shutdown()

    def abort(self) -> None:
        """Abort the NCCL communicators at once, without waiting for peers or the GPU: a
        collective stuck on the GPU is ended, and so is a communicator still connecting.
        Callable from any thread; never waits on peers."""
        self._cuda.abort()

    def _cpu_shutdown(self) -> None:
        # Both ends of the group come here: shutdown, and abort through the backend's on_abort
        # (also of a group a signal's abort_all caught half-built: what exists is closed).
        trace, cuda = getattr(self, "_trace", None), getattr(self, "_cuda", None)
        if trace is not None:
            trace.close(cuda.state if cuda is not None else "aborted", cuda.fault if cuda is not None else None)
        compat.shutdown(getattr(self, "_cpu", None))

    # -- torch method names that changed between versions ------------------------------
    _allgather_base = all_gather_single
    _reduce_scatter_base = reduce_scatter_single
