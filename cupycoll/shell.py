"""The routing shell of a cupycoll group, shared by both shapes torch may hold it in.

:class:`GroupShell` is what a cupycoll group does with each call torch hands it:

* CPU tensors, CPU barriers and (through them) the object collectives go to the group's
  gloo half (a gloo group built on the same store): they behave exactly as ``"cpu:gloo"``,
  but for ReduceOp.AVG, which gloo cannot do on integers and cupycoll averages
  (:mod:`cupycoll.cpu_average`), as the CUDA route does, and what an older gloo lacks or gets
  wrong (the list forms of alltoall and reduce_scatter, reduce_scatter_tensor's op), which
  :mod:`cupycoll.compat` builds from what it has;
* CUDA tensors go to the group's :class:`~cupycoll.backend.CudaBackend`, through the
  collective's body in :mod:`cupycoll.collectives`;
* every call is recorded first in the group's flight recorder (:mod:`cupycoll.trace.group`),
  so a timeout on either route is explained by which rank is behind;
* each entry point takes torch's options form (``allreduce(tensors, opts)``) as its first
  branch, and any other form torch's ProcessGroup accepts (a bare op, a root, one tensor, a
  timeout, keywords) is bound to it by :mod:`cupycoll.call_forms`.

It also speaks torch's coalescing protocol (``_start_coalescing`` / ``_end_coalescing``, and
the ``_coalescing_manager`` that skips the end when its body raises) and shuts down or aborts
both halves.

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
communicators in :mod:`cupycoll.backend`), and the torch side of a shrink (validation, which
torch call makes the new group: :mod:`cupycoll.shrink`).
"""

from __future__ import annotations

import contextlib
import datetime
import threading
from typing import Callable, Iterator, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d
from torch.distributed import PrefixStore, ProcessGroup

from . import _args, call_forms, collectives, compat, config, cpu_average, logs
from .call_forms import MISSING
from .backend import CudaBackend
from .issue import Issuer
from .nccl.bootstrap import delete_keys, is_store_timeout
from .errors import CollectiveTimeoutError, CupycollValueError
from .trace.diagnosis import ranks_text
from .trace.group import GroupTrace
from .faults.lifecycle import GroupState
from .work import CudaWork

_OK = GroupState.OK

_GLOO = ProcessGroup.BackendType.GLOO
_CPU = torch.device("cpu")
# Ops whose tensors differ by rank outside one argument: [outputs, inputs] -> the alike one.
_ROOT_ONLY = {"gather": 1, "scatter": 0}
_ROOTED = frozenset({"broadcast", "reduce", "gather", "scatter"})
# The options classes the entry points test their options form by (one lookup, no attribute).
_ALLREDUCE, _BROADCAST, _ALLGATHER = c10d.AllreduceOptions, c10d.BroadcastOptions, c10d.AllgatherOptions
_REDUCE_SCATTER, _ALL_TO_ALL = c10d.ReduceScatterOptions, c10d.AllToAllOptions


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


# The prefix of a group's gloo half in the group's store.
_CPU_PREFIX = "cupycoll-cpu/"


def build_gloo_half(store, rank: int, size: int, timeout) -> Tuple[ProcessGroup, ProcessGroup]:
    """A group's gloo half on ``store`` (its own prefix): the plain ProcessGroup the shell
    routes CPU calls to, and the gloo backend registered in it. torch's own gloo: its pairs
    connect at creation, or on first use where the job asks torch for it
    (``TORCH_GLOO_LAZY_INIT``, torch 2.8+: :data:`cupycoll.compat.GLOO_LAZY_INIT`). A lazy
    gloo waits for no peer at creation, so then every rank counts itself in
    (:func:`_all_made`): the creation still fails, as an eager gloo's rendezvous does, when a
    rank never makes the group."""
    cpu_store = PrefixStore(_CPU_PREFIX, store)
    lazy = compat.GLOO_LAZY_INIT and config.gloo_lazy_init()
    gloo = compat.new_gloo(cpu_store, rank, size, timeout)
    if lazy:
        _all_made(cpu_store, size, timeout)
    inner = ProcessGroup(cpu_store, rank, size)
    compat.set_default_backend(inner, _GLOO)
    inner._register_backend(_CPU, _GLOO, gloo)
    return inner, gloo


# The CPU half's arrival keys in its store (beside gloo's own address keys, "0/<rank>").
_MADE, _MADE_ALL, _MADE_LEFT = "cupycoll-made/count", "cupycoll-made/all", "cupycoll-made/left"


def _all_made(cpu_store, size: int, timeout) -> None:
    """Return once all ``size`` ranks have made their lazy gloo on ``cpu_store``: each adds
    itself to one count, the one that completes it publishes that all are there, the others
    wait for that in the store (one call, served by it, for at most ``timeout``); then each
    counts itself out, the last deleting the three keys. 3 store calls a rank whatever the
    world size (an eager gloo's rendezvous reads every peer's address). A store wait that
    times out raises torch's DistStoreError, as an eager gloo's rendezvous does: the shell
    names the ranks whose gloo address is not in the store. A count a failed creation left
    under the same name lets the next one through early (its ranks are then found missing at
    their first CPU call): never a wait for nobody."""
    if size <= 1:
        return
    if cpu_store.add(_MADE, 1) >= size:
        cpu_store.set(_MADE_ALL, b"1")
    else:
        try:
            cpu_store.wait([_MADE_ALL], timeout)
        except dist.DistStoreError:
            raise
        except RuntimeError as exc:  # a FileStore says "timeout" in a plain RuntimeError
            if not is_store_timeout(exc):
                raise
            raise dist.DistStoreError(str(exc)) from exc
    if cpu_store.add(_MADE_LEFT, 1) == size:  # every rank is past the wait: nobody reads them again
        delete_keys(cpu_store, [_MADE, _MADE_ALL, _MADE_LEFT])


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


class GroupShell:
    """Routing, coalescing and lifetime of one cupycoll group (a mixin: see the module)."""

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
            raise self._gloo_never_joined(store) from exc
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

    def _gloo_never_joined(self, store) -> CollectiveTimeoutError:
        """gloo's rendezvous on ``store`` timed out (gloo's error names a store key, never a
        rank): the error naming the ranks that never joined."""
        absent = compat.gloo_ranks_absent(PrefixStore(_CPU_PREFIX, store), self._rank, self._size)
        who = (f"{ranks_text([self._global_ranks[r] for r in absent])} never joined it"
               if absent else "not every rank joined it")
        return CollectiveTimeoutError(
            f"process group {self._group_name!r}: creating its CPU half (gloo) timed out after "
            f"{self.settings.timeout.total_seconds():g} s on rank {self._global_ranks[self._rank]}: "
            f"{who} (dead, or not creating this group)")

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
        explained as a :class:`~cupycoll.trace.group.TracedWork`'s ``wait()`` explains it."""
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

    # -- collectives: CPU to gloo, CUDA to cupycoll.collectives ----------------------------
    # Each entry point takes torch's options form first; any other form torch's ProcessGroup
    # accepts (a bare op, a root, one tensor, a timeout) is bound to it by cupycoll.call_forms.
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

    def allreduce_coalesced(self, tensors=MISSING, opts=MISSING, *rest, **named):
        if type(opts) is not c10d.AllreduceCoalescedOptions or rest or named:
            tensors, opts = call_forms.bind("allreduce_coalesced", (tensors, opts), rest, named)
        cuda, entry = self._route(tensors, "all_reduce_coalesced", opts)
        if not cuda:
            return self._gloo_reduction(entry, self._cpu.allreduce_coalesced, tensors, tensors, opts)
        call = collectives.all_reduce_coalesced(self._cuda, tensors, opts) if not self._trace.check else None
        if call is not None:  # one call of its parts' NCCL calls
            call.entry = self._trace.recorder.record_parts("all_reduce", tensors)
            try:
                work = self._issuer.issue(call)
            except BaseException:
                self._trace.recorder.mark_all(call.entry, "failed")
                raise
            return work if self._issuer.block is None else None  # inside an open block, the block's Work covers it
        part = call_forms.copied(_ALLREDUCE, opts)  # each part an all_reduce with the block's options
        return self._coalesced(lambda: [self.allreduce([t], part) for t in tensors])

    def broadcast(self, tensors=MISSING, opts=MISSING, *rest, **named):
        if type(opts) is not _BROADCAST or rest or named:
            tensors, opts = call_forms.bind("broadcast", (tensors, opts), rest, named)
        cuda, entry = self._route(tensors, "broadcast", opts)
        if not cuda:
            return self._gloo(entry, self._cpu.broadcast, tensors, opts)
        return self._issue(entry, collectives.broadcast, tensors, opts)

    def reduce(self, tensors=MISSING, opts=MISSING, *rest, **named):
        if type(opts) is not c10d.ReduceOptions or rest or named:
            tensors, opts = call_forms.bind("reduce", (tensors, opts), rest, named)
        cuda, entry = self._route(tensors, "reduce", opts)
        if not cuda:
            return self._gloo_reduction(entry, self._cpu.reduce, tensors, tensors, opts)
        return self._issue(entry, collectives.reduce, tensors, opts)

    def allgather(self, output_tensors=MISSING, input_tensors=MISSING, opts=MISSING, *rest, **named):
        if type(opts) is not _ALLGATHER or rest or named:
            output_tensors, input_tensors, opts = call_forms.bind(
                "allgather", (output_tensors, input_tensors, opts), rest, named)
        cuda, entry = self._route([output_tensors, input_tensors], "all_gather", opts)
        if not cuda:
            return self._gloo(entry, self._cpu.allgather, output_tensors, input_tensors, opts)
        return self._issue(entry, collectives.all_gather, output_tensors, input_tensors, opts)

    def allgather_coalesced(self, output_lists=MISSING, input_list=MISSING, opts=MISSING, *rest, **named):
        if type(opts) is not _ALLGATHER or rest or named:
            output_lists, input_list, opts = call_forms.bind(
                "allgather_coalesced", (output_lists, input_list, opts), rest, named)
        cuda, entry = self._route([output_lists, input_list], "all_gather_coalesced", opts)
        if not cuda:
            return self._gloo(entry, self._cpu.allgather_coalesced, output_lists, input_list, opts)
        if len(output_lists) != len(input_list):
            raise CupycollValueError(
                f"all_gather_coalesced: {len(output_lists)} output lists for {len(input_list)} inputs")
        return self._coalesced(
            lambda: [self.allgather([outs], [t], opts) for outs, t in zip(output_lists, input_list)])

    def all_gather_single(self, output=MISSING, input=MISSING, opts=MISSING, *rest, **named):
        if type(opts) is not _ALLGATHER or rest or named:
            output, input, opts = call_forms.bind("all_gather_single", (output, input, opts), rest, named)
        cuda, entry = self._route([output, input], "all_gather_into_tensor", opts)
        if not cuda:
            return self._gloo(entry, self._cpu._allgather_base, output, input, opts)
        return self._issue(entry, collectives.all_gather_into_tensor, output, input, opts)

    def all_gather_single_coalesced(self, outputs=MISSING, inputs=MISSING, opts=MISSING, *rest, **named):
        if type(opts) is not _ALLGATHER or rest or named:
            outputs, inputs, opts = call_forms.bind(
                "all_gather_single_coalesced", (outputs, inputs, opts), rest, named)
        cuda, entry = self._route([outputs, inputs], "all_gather_into_tensor_coalesced", opts)
        if not cuda:
            return self._gloo(entry, self._cpu.allgather_into_tensor_coalesced, outputs, inputs, opts)
        return self._coalesced(lambda: [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)])

    def reduce_scatter(self, output_tensors=MISSING, input_tensors=MISSING, opts=MISSING, *rest, **named):
        if type(opts) is not _REDUCE_SCATTER or rest or named:
            output_tensors, input_tensors, opts = call_forms.bind(
                "reduce_scatter", (output_tensors, input_tensors, opts), rest, named)
        cuda, entry = self._route([output_tensors, input_tensors], "reduce_scatter", opts)
        if not cuda:
            return self._gloo_reduction(entry, compat.gloo_reduce_scatter, output_tensors, self._cpu,
                                        output_tensors, input_tensors, opts)
        return self._issue(entry, collectives.reduce_scatter, output_tensors, input_tensors, opts)

    def reduce_scatter_single(self, outputTensor=MISSING, inputTensor=MISSING, opts=MISSING, *rest, **named):
        output, input = outputTensor, inputTensor
        if type(opts) is not _REDUCE_SCATTER or rest or named:
            output, input, opts = call_forms.bind("reduce_scatter_single", (output, input, opts), rest, named)
        cuda, entry = self._route([output, input], "reduce_scatter_tensor", opts)
        if not cuda:
            return self._gloo_reduction(entry, compat.gloo_reduce_scatter_tensor, [output], self._cpu, output,
                                        input, opts)
        return self._issue(entry, collectives.reduce_scatter_tensor, output, input, opts)

    def reduce_scatter_single_coalesced(self, outputs=MISSING, inputs=MISSING, opts=MISSING, *rest, **named):
        if type(opts) is not _REDUCE_SCATTER or rest or named:
            outputs, inputs, opts = call_forms.bind(
                "reduce_scatter_single_coalesced", (outputs, inputs, opts), rest, named)
        cuda, entry = self._route([outputs, inputs], "reduce_scatter_tensor_coalesced", opts)
        if not cuda:
            return self._gloo_reduction(entry, self._cpu.reduce_scatter_tensor_coalesced, outputs, outputs,
                                        inputs, opts)
        return self._coalesced(lambda: [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)])

    def alltoall(self, output_tensors=MISSING, input_tensors=MISSING, opts=MISSING, *rest, **named):
        if type(opts) is not _ALL_TO_ALL or rest or named:
            output_tensors, input_tensors, opts = call_forms.bind(
                "alltoall", (output_tensors, input_tensors, opts), rest, named)
        cuda, entry = self._route([output_tensors, input_tensors], "all_to_all", opts)
        if not cuda:
            return self._gloo(entry, compat.gloo_alltoall, self._cpu, output_tensors, input_tensors, opts)
        return self._issue(entry, collectives.all_to_all, output_tensors, input_tensors, opts)

    def all_to_all_single(self, output=MISSING, input=MISSING, output_split_sizes=MISSING,
                          input_split_sizes=MISSING, opts=MISSING, *rest, **named):
        if type(opts) is not _ALL_TO_ALL or rest or named:
            output, input, output_split_sizes, input_split_sizes, opts = call_forms.bind(
                "all_to_all_single", (output, input, output_split_sizes, input_split_sizes, opts), rest, named)
        cuda, entry = self._route([output, input], "all_to_all_single", opts)
        if not cuda:
            return self._gloo(entry, self._cpu.alltoall_base, output, input, output_split_sizes,
                              input_split_sizes, opts)
        return self._issue(entry, collectives.all_to_all_single, output, input, output_split_sizes,
                           input_split_sizes, opts)

    def gather(self, output_tensors=MISSING, input_tensors=MISSING, opts=MISSING, *rest, **named):
        if type(opts) is not c10d.GatherOptions or rest or named:
            output_tensors, input_tensors, opts = call_forms.bind(
                "gather", (output_tensors, input_tensors, opts), rest, named)
        cuda, entry = self._route([output_tensors, input_tensors], "gather", opts)
        if not cuda:
            return self._gloo(entry, self._cpu.gather, output_tensors, input_tensors, opts)
        return self._issue(entry, collectives.gather, output_tensors, input_tensors, opts)

    def scatter(self, output_tensors=MISSING, input_tensors=MISSING, opts=MISSING, *rest, **named):
        if type(opts) is not c10d.ScatterOptions or rest or named:
            output_tensors, input_tensors, opts = call_forms.bind(
                "scatter", (output_tensors, input_tensors, opts), rest, named)
        cuda, entry = self._route([output_tensors, input_tensors], "scatter", opts)
        if not cuda:
            return self._gloo(entry, self._cpu.scatter, output_tensors, input_tensors, opts)
        return self._issue(entry, collectives.scatter, output_tensors, input_tensors, opts)

    def send(self, tensors=MISSING, dstRank=MISSING, tag=0, *rest, **named):
        if type(tensors) is not list or type(dstRank) is not int or type(tag) is not int or rest or named:
            tensors, dstRank, tag = call_forms.bind("send", (tensors, dstRank, tag), rest, named)
        cuda, entry = self._route(tensors, "send", peer=dstRank)
        if not cuda:
            return self._cpu.send(tensors, dstRank, tag)
        return self._issue(entry, collectives.point_to_point, "send", tensors, dstRank,
                           compat.calling_batch_isend_irecv())

    def recv(self, tensors=MISSING, srcRank=MISSING, tag=0, *rest, **named):
        if type(tensors) is not list or type(srcRank) is not int or type(tag) is not int or rest or named:
            tensors, srcRank, tag = call_forms.bind("recv", (tensors, srcRank, tag), rest, named)
        cuda, entry = self._route(tensors, "recv", peer=srcRank)
        if not cuda:
            return self._cpu.recv(tensors, srcRank, tag)
        return self._issue(entry, collectives.point_to_point, "recv", tensors, srcRank,
                           compat.calling_batch_isend_irecv())

    def recv_anysource(self, tensors=MISSING, tag=0, *rest, **named):
        if type(tensors) is not list or type(tag) is not int or rest or named:
            tensors, tag = call_forms.bind("recv_anysource", (tensors, tag), rest, named)
        cuda, entry = self._route(tensors, "recv_anysource")
        if not cuda:
            return self._cpu.recv_anysource(tensors, tag)
        self._trace.recorder.mark(entry, "failed")
        raise CupycollValueError("recv from any source is not supported by NCCL; name the source rank")

    def barrier(self, opts=MISSING, *rest, **named):
        if type(opts) is not c10d.BarrierOptions or rest or named:
            opts, = call_forms.bind("barrier", (opts,), rest, named)
        device = _args.barrier_device(opts, self._cuda.runtime.current_device)
        if device is None:
            self._cuda.check_usable()
            entry = self._trace.call("barrier", (), route="gloo", cpu_group=self._cpu)
            return self._gloo(entry, self._cpu.barrier, opts)
        return self._cuda_barrier(device)

    def _cuda_barrier(self, device) -> CudaWork:
        entry = self._trace.call("barrier", (), cpu_group=self._cpu)
        return self._issue(entry, collectives.barrier, device)

    # -- torch's coalescing protocol ----------------------------------------------------
    def _coalesced(self, body: Callable[[], list]) -> Optional[CudaWork]:
        """Run ``body`` (which submits CUDA calls) as one NCCL group; one Work for all.
        Inside an open coalescing block the calls join it and the block's Work covers them."""
        calls = self._issuer
        if calls.block is not None:
            body()
            return None
        self._open_block()
        try:
            body()
        except BaseException:
            calls.abandon_block()
            raise
        return calls.close_block()

    def _start_coalescing(self, device=None):
        if _args.is_cpu(device):
            return self._cpu._start_coalescing(device)
        self._open_block()

    def _end_coalescing(self, device=None):
        if _args.is_cpu(device):
            return self._cpu._end_coalescing(device)
        return self._issuer.close_block()

    def _open_block(self) -> None:
        self._issuer.open_block(compat.calling_coalescing_manager(self._manager_gone))

    def _manager_gone(self, manager_ref) -> None:
        """The generator of a ``_coalescing_manager`` that opened a block was freed (the
        ``with`` statement is over). If our block is still open, its body raised: drop the
        block, and also torch's own record of the manager, which torch leaves behind (so the
        group's next all_reduce would otherwise be captured into a dead manager forever)."""
        calls = self._issuer
        if calls.block_manager is not manager_ref or calls.block is None:
            return
        calls.discard_raised_block(stacklevel=3)
        compat.forget_coalescing_manager(self._torch_group())

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
    alltoall_base = all_to_all_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced
