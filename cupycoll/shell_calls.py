"""torch's entry points of a cupycoll group besides the hot ones: reduce, the list forms of
all-gather and reduce-scatter, all-to-all (both forms), gather, scatter, point-to-point,
barrier, the ``*_coalesced`` forms and torch's coalescing protocol (``_start_coalescing`` /
``_end_coalescing``, and the ``_coalescing_manager`` that skips the end when its body raises).

:class:`ShellCalls` is a mixin of :class:`~cupycoll.shell.GroupShell`, whose routing it
calls (``_route``, ``_issue``, ``_gloo``, ``_gloo_reduction``) and whose hot calls
(``allreduce``, ``broadcast``, ``all_gather_single``, ``reduce_scatter_single``) a coalesced
form runs part by part. Each entry point takes torch's options form first; any other form
torch's ProcessGroup accepts is bound to it by :mod:`cupycoll.call_forms`.

Deliberately left out: the hot calls themselves, which stay in :mod:`cupycoll.shell` beside
the route they take, so that each reads in one module; routing, construction and lifetime
(the shell's); the CUDA side of a block (:mod:`cupycoll.issue`, :mod:`cupycoll.coalescing`).
"""

from __future__ import annotations

from typing import Callable, Optional

from torch._C import _distributed_c10d as c10d

from . import _args, call_forms, collectives, compat
from .call_forms import MISSING
from .errors import CupycollValueError
from .work import CudaWork

# The options classes the entry points test their options form by (one lookup, no attribute).
_ALLREDUCE, _ALLGATHER = c10d.AllreduceOptions, c10d.AllgatherOptions
_REDUCE_SCATTER, _ALL_TO_ALL = c10d.ReduceScatterOptions, c10d.AllToAllOptions


class ShellCalls:
    """The entry points of a group but the hot ones, and torch's coalescing protocol: a mixin
    of GroupShell, whose routing and hot calls they call (see the module)."""

    # -- the other collectives: CPU to gloo, CUDA to cupycoll.collectives -----------------
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

    def reduce_scatter(self, output_tensors=MISSING, input_tensors=MISSING, opts=MISSING, *rest, **named):
        if type(opts) is not _REDUCE_SCATTER or rest or named:
            output_tensors, input_tensors, opts = call_forms.bind(
                "reduce_scatter", (output_tensors, input_tensors, opts), rest, named)
        cuda, entry = self._route([output_tensors, input_tensors], "reduce_scatter", opts)
        if not cuda:
            return self._gloo_reduction(entry, compat.gloo_reduce_scatter, output_tensors, self._cpu,
                                        output_tensors, input_tensors, opts)
        return self._issue(entry, collectives.reduce_scatter, output_tensors, input_tensors, opts)

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

    # -- point-to-point and barrier ----------------------------------------------------
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

    # -- the coalesced forms and torch's coalescing protocol ---------------------------
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

    def all_gather_single_coalesced(self, outputs=MISSING, inputs=MISSING, opts=MISSING, *rest, **named):
        if type(opts) is not _ALLGATHER or rest or named:
            outputs, inputs, opts = call_forms.bind(
                "all_gather_single_coalesced", (outputs, inputs, opts), rest, named)
        cuda, entry = self._route([outputs, inputs], "all_gather_into_tensor_coalesced", opts)
        if not cuda:
            return self._gloo(entry, self._cpu.allgather_into_tensor_coalesced, outputs, inputs, opts)
        return self._coalesced(lambda: [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)])

    def reduce_scatter_single_coalesced(self, outputs=MISSING, inputs=MISSING, opts=MISSING, *rest, **named):
        if type(opts) is not _REDUCE_SCATTER or rest or named:
            outputs, inputs, opts = call_forms.bind(
                "reduce_scatter_single_coalesced", (outputs, inputs, opts), rest, named)
        cuda, entry = self._route([outputs, inputs], "reduce_scatter_tensor_coalesced", opts)
        if not cuda:
            return self._gloo_reduction(entry, self._cpu.reduce_scatter_tensor_coalesced, outputs, outputs,
                                        inputs, opts)
        return self._coalesced(lambda: [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)])

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

    # -- torch method names that changed between versions ------------------------------
    alltoall_base = all_to_all_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced
