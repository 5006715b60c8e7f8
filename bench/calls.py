"""What the benchmark calls: the candidates' groups, the buffers, one collective call.

A candidate is a group plus a scope (``cupycoll.algorithm("ring")``, or nothing); buffers
follow nccl-tests' layouts (:mod:`metrics`), in place or out of place; :func:`make_call`
returns a no-argument function issuing one synchronous torch.distributed call.
:class:`FrontOnlyGroup` is a group whose calls do nothing: torch's own Python front (its
``dist.*`` functions, ``_coalescing_manager`` and the ``_CollOp`` records it collects) timed
alone, the share of a call that every backend pays.

Left out: timing and checking them (runner, checks), names (catalog).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
from typing import Callable, List

import torch
import torch.distributed as dist

import cupycoll
from cupycoll import compat
from cupycoll.ring import algorithm as ring

from . import catalog, metrics

# Where the torch.distributed call has each form; the others have no such call.
PLACEMENTS = {
    "all_reduce": ("in-place",), "broadcast": ("in-place",), "reduce": ("in-place",),
    "all_gather": ("out-of-place", "in-place"), "reduce_scatter": ("out-of-place", "in-place"),
    "all_to_all": ("out-of-place",), "sendrecv": ("out-of-place",),
}
DEFAULT_TIMEOUT_S = 1800.0  # every group's timeout when -T is 0
# The cupycoll group's own algorithm (``Options.algorithm``). The candidate of that
# algorithm runs with no scope, as a user's group does, so its figures are those of the
# path users get (the fast path learns a reduction only without an override in force);
# the other algorithms run under ``cupycoll.algorithm(...)``.
GROUP_ALGORITHM = "nccl"


# -- candidates -------------------------------------------------------------------------
@dataclasses.dataclass
class Candidate:
    spec: catalog.CandidateSpec
    group: object
    scope: Callable[[], contextlib.AbstractContextManager]

    @property
    def name(self) -> str:
        return self.spec.name


class DoneWork(dist.Work):
    """A Work that is finished when it is made."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True


class FrontOnlyGroup(dist.ProcessGroup):
    """A group whose all_reduce, coalesced all_reduce and coalescing block do nothing and
    return a finished Work. ``dist.all_reduce`` and ``dist._coalescing_manager`` call these
    methods from Python, so timing them on this group times torch's front and nothing else
    (not even counting what arrives, or making a Work per call: that would be time of the
    group's own)."""

    def __init__(self, rank: int, size: int):
        super().__init__(rank, size)
        self._done = DoneWork()

    def getBackendName(self) -> str:
        return "front-only"

    def allreduce(self, tensors, opts=None):
        return self._done

    def allreduce_coalesced(self, tensors, opts=None):
        return self._done

    def _start_coalescing(self, device) -> None:
        pass

    def _end_coalescing(self, device):
        return self._done


def reduce_op(name: str):
    if name == "mulsum":  # NCCL's PreMulSum, as torch spells it
        return dist._make_nccl_premul_sum(catalog.MULSUM_FACTOR)
    return {
        "sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN, "avg": dist.ReduceOp.AVG, "band": dist.ReduceOp.BAND,
        "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR,
    }[name]


def torch_dtype(name: str) -> torch.dtype:
    attr = catalog.DTYPES[name][0]
    dtype = getattr(torch, attr, None)
    if dtype is None:
        raise TypeError(f"this torch ({torch.__version__}) has no torch.{attr}")
    return dtype


def build_candidates(names: List[str], timeout=None) -> List[Candidate]:
    """Create the groups in one fixed order (every rank must create the same groups).
    cupycoll's algorithms share the default group: its own (:data:`GROUP_ALGORITHM`) as it
    is, each other under ``cupycoll.algorithm(...)``."""
    picked = []
    for name in names:
        spec = catalog.CANDIDATES[name]
        if spec.library == "cupycoll":
            group = dist.group.WORLD
            scope = (contextlib.nullcontext if spec.algorithm == GROUP_ALGORITHM
                     else (lambda alg=spec.algorithm: cupycoll.algorithm(alg)))
        else:
            group = dist.new_group(backend=spec.algorithm, timeout=timeout)
            scope = contextlib.nullcontext
        picked.append(Candidate(spec, group, scope))
    return picked


def ring_unsupported(candidate: str, dtype_name: str, op: str) -> str:
    """Why the ring cannot reduce this pair ("" if it can).

    Asked up front because under ``algorithm("ring")`` an unsupported pair might quietly
    run on NCCL, and the table would then credit the ring with NCCL's numbers."""
    if candidate != "cupycoll:ring":
        return ""
    name = catalog.DTYPES[dtype_name][0]
    ring_op = {"prod": "product"}.get(op, op)
    if ring.supports(name, ring_op):
        return ""
    return f"the ring does not reduce {dtype_name} with {op}"


# -- buffers and calls ----------------------------------------------------------------
@dataclasses.dataclass
class Buffers:
    send: torch.Tensor
    recv: torch.Tensor
    count: int          # nccl-tests' count (per rank for the split collectives)
    in_place: bool


def make_buffers(collective: str, lay: metrics.Layout, dtype: torch.dtype, device, placement: str,
                 rank: int) -> Buffers:
    in_place = placement == "in-place"
    c = lay.count
    if collective in ("all_reduce", "broadcast", "reduce"):
        buf = torch.empty(lay.send_count, dtype=dtype, device=device)
        return Buffers(buf, buf, c, True)
    if in_place and collective == "all_gather":
        recv = torch.empty(lay.recv_count, dtype=dtype, device=device)
        return Buffers(recv[rank * c:(rank + 1) * c], recv, c, True)
    if in_place and collective == "reduce_scatter":
        send = torch.empty(lay.send_count, dtype=dtype, device=device)
        return Buffers(send, send[rank * c:(rank + 1) * c], c, True)
    send = torch.empty(lay.send_count, dtype=dtype, device=device)
    recv = torch.empty(lay.recv_count, dtype=dtype, device=device)
    return Buffers(send, recv, c, False)


def make_call(collective: str, bufs: Buffers, group, op: str, root: int, rank: int, world: int):
    """A no-argument function issuing the collective once (synchronous form)."""
    red = reduce_op(op) if collective in catalog.REDUCING else None
    if collective == "all_reduce":
        return lambda: dist.all_reduce(bufs.recv, op=red, group=group)
    if collective == "broadcast":
        return lambda: dist.broadcast(bufs.recv, src=root, group=group)
    if collective == "reduce":
        return lambda: dist.reduce(bufs.recv, dst=root, op=red, group=group)
    if collective == "all_gather":
        return lambda: compat.all_gather_single(bufs.recv, bufs.send, group=group)
    if collective == "reduce_scatter":
        return lambda: compat.reduce_scatter_single(bufs.recv, bufs.send, op=red, group=group)
    if collective == "all_to_all":
        return lambda: dist.all_to_all_single(bufs.recv, bufs.send, group=group)
    if collective == "sendrecv":
        nxt, prv = (rank + 1) % world, (rank - 1) % world

        def ring_exchange():
            ops = [dist.P2POp(dist.isend, bufs.send, nxt, group), dist.P2POp(dist.irecv, bufs.recv, prv, group)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return ring_exchange
    raise ValueError(collective)


def group_timeout(cfg) -> datetime.timedelta:
    """-T: every group's timeout, so a collective that hangs fails the run (0: 30 min)."""
    return datetime.timedelta(seconds=cfg.coll_timeout or DEFAULT_TIMEOUT_S)
