"""One rank of the API suite: every torch.distributed call, checked against references.

Every rank can compute every other rank's inputs (they are a function of the rank), so each
case is checked against a reference computed locally with plain torch ops on the CPU. The
outputs are also saved (``--out``; large ones as digests) so a test can compare two backends
case by case. Which cases a reference backend skips, and how exactly each reduction is
checked, is decided in api_plan.py (tested on CPU). The cases come in families, one
``check_*`` function each, run in the order of FAMILIES.

Usage: api_worker.py --backend cupycoll --device cpu --suite quick --out DIR [--device-id]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

try:  # run as a script (tests/workers on sys.path), or imported by the CPU tier
    from api_plan import (LARGE, kept, reduce_check, reduce_ops_for, reference_lacks,
                          self_p2p_cases_apply)
    from epilogue import end_suite, plain_gloo_teardown_can_hang
except ImportError:
    from workers.api_plan import (LARGE, kept, reduce_check, reduce_ops_for, reference_lacks,
                                  self_p2p_cases_apply)
    from workers.epilogue import end_suite, plain_gloo_teardown_can_hang

# Defaults let the CPU tier import the checking code without a launcher.
RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
R = dist.ReduceOp


def value(rank: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Small positive integers (1..5): sums and products stay exact in every dtype but fp8."""
    base = (torch.arange(n, dtype=torch.int64) * 7 + rank * 3 + salt) % 5 + 1
    if dtype == torch.bool:
        return base % 2 == 0
    if dtype.is_complex:
        return torch.complex(base.double(), (2 * base).double()).to(dtype)
    if dtype.is_floating_point and dtype.itemsize == 1:  # fp8
        return base.float().to(dtype)
    return base.to(dtype)


def as_ref(t: torch.Tensor) -> torch.Tensor:
    """CPU tensor in a dtype torch can do arithmetic in."""
    t = t.detach().cpu()
    if t.dtype.is_floating_point and t.dtype.itemsize == 1:
        return t.float()
    return t


def reduce_ref(tensors, op):
    ts = [as_ref(t) for t in tensors]
    if ts[0].dtype == torch.bool:
        if op in (R.SUM, R.MAX):
            return functools.reduce(torch.logical_or, ts)
        return functools.reduce(torch.logical_and, ts)
    if op == R.SUM:
        return functools.reduce(torch.add, ts)
    if op == R.PRODUCT:
        return functools.reduce(torch.mul, ts)
    if op == R.MIN:
        return functools.reduce(torch.minimum, ts)
    if op == R.MAX:
        return functools.reduce(torch.maximum, ts)
    if op == R.AVG:
        # in the widest type of the same kind: .double() would drop a complex's imaginary part
        wide = torch.complex128 if ts[0].is_complex() else torch.float64
        return functools.reduce(torch.add, [t.to(wide) for t in ts]) / len(ts)
    raise ValueError(op)


class Suite:
    def __init__(self, device, out, backend=""):
        self.device = device
        self.out = out
        self.backend = backend
        self.results = {}
        self.failures = []
        self.errors = {}  # cases whose backend raised, by design (compared across backends)
        self.skipped = {}  # cases this backend cannot run as a reference, with the reason
        self.cases = 0

    def check(self, name, got, expected, exact=True, rtol=1e-2, atol=1e-2):
        self.cases += 1
        got_cpu = [as_ref(g) for g in got] if isinstance(got, (list, tuple)) else as_ref(got)
        self.results[name] = kept(got_cpu)
        gl = got_cpu if isinstance(got_cpu, list) else [got_cpu]
        el = expected if isinstance(expected, (list, tuple)) else [expected]
        if len(gl) != len(el):
            self.failures.append(f"{name}: {len(gl)} outputs, expected {len(el)}")
            return
        for index, (g, e) in enumerate(zip(gl, el)):
            e = as_ref(e)
            if g.shape != e.shape:
                self.failures.append(f"{name}[{index}]: shape {tuple(g.shape)} != {tuple(e.shape)}")
            elif exact and not torch.equal(g, e.to(g.dtype)):
                self.failures.append(f"{name}[{index}]: got {g.flatten()[:8].tolist()} expected {e.flatten()[:8].tolist()}")
            elif not exact and not torch.allclose(g.double() if not g.is_complex() else g, e.to(g.dtype).double() if not g.is_complex() else e.to(g.dtype), rtol=rtol, atol=atol):
                self.failures.append(f"{name}[{index}]: got {g.flatten()[:8].tolist()} expected {e.flatten()[:8].tolist()}")

    def run(self, name, fn, family=None, dtype=None):
        """Run one case; ``family`` (and ``dtype``) let a reference backend with known gaps
        skip it, recorded with the reason."""
        reason = reference_lacks(self.backend, family or name, dtype)
        if reason:
            self.skipped[name] = reason
            return
        try:
            fn(name)
        except Exception as exc:  # noqa: BLE001 - recorded, reported by the test
            self.failures.append(f"{name}: raised {type(exc).__name__}: {exc}")
            traceback.print_exc()

    def run_recording_errors(self, name, fn):
        """For forms a backend may reject (gloo has no startCoalescing): record which."""
        try:
            fn(name)
        except Exception as exc:  # noqa: BLE001
            self.errors[name] = type(exc).__name__
            # torch leaves the group in its coalescing state when _start_coalescing raises
            # (any backend): later collectives would be captured and never run.
            dist.distributed_c10d._world.pg_coalesce_state.pop(dist.group.WORLD, None)

    def t(self, rank, n, dtype, salt=0):
        return value(rank, n, dtype, salt).to(self.device)


def finish(work, async_op):
    if async_op:
        work.wait()
        if torch.cuda.is_available() and work.__class__.__name__ == "CudaWork":
            work.get_future().wait()  # gloo's Works do not all implement get_future


@dataclasses.dataclass
class Coverage:
    """The dtypes, reduce ops and sizes the cases run over."""

    gloo_like: bool  # on CPU the group routes to gloo: gloo's op/dtype coverage applies
    dtypes: list
    bdtypes: list  # what broadcast and the gathers move: also int16 and uint16 in the full suite
    ops: list
    sizes: list


def check_all_reduce(s: Suite, cover: Coverage) -> None:
    """all_reduce over every dtype, reduce op and size, sync and async; PREMUL_SUM
    (a scalar factor and a tensor one) where the route is NCCL's."""
    dtypes, ops, sizes = cover.dtypes, cover.ops, cover.sizes
    device, gloo_like = s.device, cover.gloo_like
    for dtype in dtypes:
        for op in ops:
            if dtype.is_complex and op not in (R.SUM, R.AVG):
                continue
            if dtype == torch.bool and op == R.AVG:
                continue
            for n in sizes:
                if n > 4096 and dtype not in (torch.float32, torch.bfloat16):
                    continue
                for async_op in (False, True):
                    def case(name, dtype=dtype, op=op, n=n, async_op=async_op):
                        t = s.t(RANK, n, dtype)
                        w = dist.all_reduce(t, op=op, async_op=async_op)
                        finish(w, async_op)
                        exp = reduce_ref([value(r, n, dtype) for r in range(WORLD)], op)
                        s.check(name, t, exp, **reduce_check(dtype, op, WORLD))
                    s.run(f"all_reduce/{dtype}/{op}/{n}/{'async' if async_op else 'sync'}", case)
    if not gloo_like:
        for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            for factor in (2.0, "tensor"):
                def case(name, dtype=dtype, factor=factor):
                    t = s.t(RANK, 1001, dtype)
                    f = torch.tensor([2.0], dtype=dtype, device=device) if factor == "tensor" else factor
                    dist.all_reduce(t, op=dist._make_nccl_premul_sum(f))
                    exp = 2 * reduce_ref([value(r, 1001, dtype) for r in range(WORLD)], R.SUM)
                    s.check(name, t, exp, exact=True)
                s.run(f"all_reduce/{dtype}/premul_sum/{factor}", case)


def check_broadcast_and_reduce(s: Suite, cover: Coverage) -> None:
    """broadcast from every root over every dtype it moves, sync and async; reduce to
    every root with each dtype's reduce ops."""
    dtypes, bdtypes = cover.dtypes, cover.bdtypes
    for root in range(WORLD):
        for dtype in bdtypes:
            for async_op in (False, True):
                def case(name, root=root, dtype=dtype, async_op=async_op):
                    t = s.t(RANK, 1001, dtype)
                    finish(dist.broadcast(t, src=root, async_op=async_op), async_op)
                    s.check(name, t, value(root, 1001, dtype))
                s.run(f"broadcast/{dtype}/root{root}/{'async' if async_op else 'sync'}", case,
                      "broadcast", dtype)
        for dtype in dtypes:
            for op in reduce_ops_for(dtype):
                def case(name, root=root, dtype=dtype, op=op):
                    t = s.t(RANK, 1001, dtype)
                    dist.reduce(t, dst=root, op=op)
                    if RANK == root:
                        s.check(name, t, reduce_ref([value(r, 1001, dtype) for r in range(WORLD)], op),
                                **reduce_check(dtype, op, WORLD))
                    else:
                        s.cases += 1
                s.run(f"reduce/{dtype}/{op}/root{root}", case, "reduce", dtype)


def check_all_gather(s: Suite, cover: Coverage) -> None:
    """all_gather and all_gather_into_tensor over every dtype they move and every size,
    sync and async; all_gather into adjacent views of one buffer."""
    bdtypes, sizes = cover.bdtypes, cover.sizes
    device = s.device
    for dtype in bdtypes:
        for n in sizes:
            if n > 4096 and dtype != torch.float32:
                continue
            for async_op in (False, True):
                mode = "async" if async_op else "sync"

                def case(name, dtype=dtype, n=n, async_op=async_op):
                    outs = [torch.zeros(n, dtype=dtype, device=device) for _ in range(WORLD)]
                    finish(dist.all_gather(outs, s.t(RANK, n, dtype), async_op=async_op), async_op)
                    s.check(name, outs, [value(r, n, dtype) for r in range(WORLD)])
                s.run(f"all_gather/{dtype}/{n}/{mode}", case, "all_gather", dtype)

                def case(name, dtype=dtype, n=n, async_op=async_op):
                    out = torch.zeros(WORLD * n, dtype=dtype, device=device)
                    finish(dist.all_gather_into_tensor(out, s.t(RANK, n, dtype), async_op=async_op), async_op)
                    s.check(name, out, torch.cat([value(r, n, dtype) for r in range(WORLD)]))
                s.run(f"all_gather_into_tensor/{dtype}/{n}/{mode}", case, "all_gather_into_tensor", dtype)

    # a view of one buffer: the direct (no staging) path
    def case(name):
        flat = torch.zeros(WORLD * 5, device=device)
        dist.all_gather(list(flat.chunk(WORLD)), s.t(RANK, 5, torch.float32))
        s.check(name, flat, torch.cat([value(r, 5, torch.float32) for r in range(WORLD)]))
    s.run("all_gather/adjacent_views", case)


def check_reduce_scatter(s: Suite, cover: Coverage) -> None:
    """reduce_scatter_tensor, and the list reduce_scatter where the route is NCCL's,
    over the dtypes and ops that reduce-scatter supports and every size, sync and async."""
    dtypes, sizes = cover.dtypes, cover.sizes
    device, gloo_like = s.device, cover.gloo_like
    rs_ops = [R.SUM, R.MAX] + ([R.AVG] if not gloo_like else [])
    for dtype in dtypes:
        if dtype == torch.bool or dtype.is_complex:
            continue
        for op in rs_ops:
            for n in sizes:
                if n > 4096:
                    continue
                for async_op in (False, True):
                    mode = "async" if async_op else "sync"
                    how = reduce_check(dtype, op, WORLD)

                    def case(name, dtype=dtype, op=op, n=n, async_op=async_op, how=how):
                        out = torch.zeros(n, dtype=dtype, device=device)
                        inp = s.t(RANK, WORLD * n, dtype)
                        finish(dist.reduce_scatter_tensor(out, inp, op=op, async_op=async_op), async_op)
                        full_ref = reduce_ref([value(r, WORLD * n, dtype) for r in range(WORLD)], op)
                        s.check(name, out, full_ref[RANK * n:(RANK + 1) * n], **how)
                    s.run(f"reduce_scatter_tensor/{dtype}/{op}/{n}/{mode}", case)

                    if gloo_like:
                        continue  # gloo has no list reduce_scatter

                    def case(name, dtype=dtype, op=op, n=n, async_op=async_op, how=how):
                        out = torch.zeros(n, dtype=dtype, device=device)
                        ins = list(s.t(RANK, WORLD * n, dtype).chunk(WORLD)) if n else [s.t(RANK, 0, dtype) for _ in range(WORLD)]
                        ins = [i.clone() for i in ins]
                        finish(dist.reduce_scatter(out, ins, op=op, async_op=async_op), async_op)
                        full_ref = reduce_ref([value(r, WORLD * n, dtype) for r in range(WORLD)], op)
                        s.check(name, out, full_ref[RANK * n:(RANK + 1) * n], **how)
                    s.run(f"reduce_scatter/{dtype}/{op}/{n}/{mode}", case)


def check_all_to_all(s: Suite, cover: Coverage) -> None:
    """all_to_all and all_to_all_single (even splits, uneven ones, one with a zero-sized
    split) over every dtype."""
    dtypes, device = cover.dtypes, s.device
    for dtype in dtypes:
        def case(name, dtype=dtype):
            ins = [s.t(RANK, 3, dtype, salt=p) for p in range(WORLD)]
            outs = [torch.zeros(3, dtype=dtype, device=device) for _ in range(WORLD)]
            dist.all_to_all(outs, ins)
            s.check(name, outs, [value(p, 3, dtype, salt=RANK) for p in range(WORLD)])
        s.run(f"all_to_all/{dtype}", case)

        def case(name, dtype=dtype):
            inp = torch.cat([value(RANK, 4, dtype, salt=p) for p in range(WORLD)]).to(device)
            out = torch.zeros(WORLD * 4, dtype=dtype, device=device)
            dist.all_to_all_single(out, inp)
            s.check(name, out, torch.cat([value(p, 4, dtype, salt=RANK) for p in range(WORLD)]))
        s.run(f"all_to_all_single/even/{dtype}", case)

        def case(name, dtype=dtype):
            # rank r sends (r + p) % 3 + 1 rows of width 2 to peer p (including zero-sized? no: >= 1)
            send_rows = [(RANK + p) % 3 + 1 for p in range(WORLD)]
            recv_rows = [(p + RANK) % 3 + 1 for p in range(WORLD)]
            inp = torch.cat([value(RANK, rows * 2, dtype, salt=p).view(rows, 2) for p, rows in enumerate(send_rows)]).to(device)
            out = torch.zeros(sum(recv_rows), 2, dtype=dtype, device=device)
            dist.all_to_all_single(out, inp, output_split_sizes=recv_rows, input_split_sizes=send_rows)
            exp = torch.cat([value(p, rows * 2, dtype, salt=RANK).view(rows, 2) for p, rows in enumerate(recv_rows)])
            s.check(name, out, exp)
        s.run(f"all_to_all_single/uneven/{dtype}", case)

    def case(name):
        # uneven with a zero-sized split: rank r sends nothing to rank (r + 1) % WORLD
        send_rows = [0 if p == (RANK + 1) % WORLD else 2 for p in range(WORLD)]
        recv_rows = [0 if RANK == (p + 1) % WORLD else 2 for p in range(WORLD)]
        inp = torch.cat([value(RANK, rows, torch.float32, salt=p) for p, rows in enumerate(send_rows)]).to(device)
        out = torch.zeros(sum(recv_rows), device=device)
        dist.all_to_all_single(out, inp, output_split_sizes=recv_rows, input_split_sizes=send_rows)
        s.check(name, out, torch.cat([value(p, rows, torch.float32, salt=RANK) for p, rows in enumerate(recv_rows)]))
    s.run("all_to_all_single/uneven_with_zero", case)


def check_gather_and_scatter(s: Suite, cover: Coverage) -> None:
    """gather to and scatter from every root."""
    device = s.device
    for root in range(WORLD):
        def case(name, root=root):
            outs = [torch.zeros(7, device=device) for _ in range(WORLD)] if RANK == root else None
            dist.gather(s.t(RANK, 7, torch.float32), outs, dst=root)
            if RANK == root:
                s.check(name, outs, [value(r, 7, torch.float32) for r in range(WORLD)])
            else:
                s.cases += 1
        s.run(f"gather/root{root}", case)

        def case(name, root=root):
            out = torch.zeros(7, device=device)
            ins = [s.t(r, 7, torch.float32, salt=root) for r in range(WORLD)] if RANK == root else None
            dist.scatter(out, ins, src=root)
            s.check(name, out, value(RANK, 7, torch.float32, salt=root))
        s.run(f"scatter/root{root}", case)


def check_point_to_point(s: Suite, cover: Coverage) -> None:
    """send/recv (a star of blocking calls), isend/irecv and batch_isend_irecv: a ring, a
    pairwise swap, all-to-one and one-to-all."""
    device = s.device
    def case(name):
        # rank 0 sends to every other rank, then each answers (blocking calls)
        if RANK == 0:
            got = []
            for peer in range(1, WORLD):
                dist.send(s.t(0, 9, torch.float32, salt=peer), dst=peer)
                t = torch.zeros(9, device=device)
                dist.recv(t, src=peer)
                got.append(t)
            s.check(name, got, [value(p, 9, torch.float32, salt=100) for p in range(1, WORLD)])
        else:
            t = torch.zeros(9, device=device)
            dist.recv(t, src=0)
            s.check(name, t, value(0, 9, torch.float32, salt=RANK))
            dist.send(s.t(RANK, 9, torch.float32, salt=100), dst=0)
    s.run("send_recv/star", case)

    def case(name):
        # ring exchange with isend/irecv: everyone sends right and receives from the left
        right, left = (RANK + 1) % WORLD, (RANK - 1) % WORLD
        out = torch.zeros(11, device=device)
        reqs = [dist.isend(s.t(RANK, 11, torch.float32), dst=right), dist.irecv(out, src=left)]
        for r in reqs:
            r.wait()
        s.check(name, out, value(left, 11, torch.float32))
    if self_p2p_cases_apply(WORLD):
        s.run("isend_irecv/ring", case)

    def case(name):
        right, left = (RANK + 1) % WORLD, (RANK - 1) % WORLD
        out = torch.zeros(13, device=device)
        ops = [dist.P2POp(dist.isend, s.t(RANK, 13, torch.float32), right),
               dist.P2POp(dist.irecv, out, left)]
        for r in dist.batch_isend_irecv(ops):
            r.wait()
        s.check(name, out, value(left, 13, torch.float32))
    if self_p2p_cases_apply(WORLD):
        s.run("batch_isend_irecv/ring", case)

    def case(name):
        # pairwise swap: 0<->1, 2<->3, ...; an odd last rank sits out
        peer = RANK ^ 1
        out = torch.zeros(7, device=device)
        if peer < WORLD:
            ops = [dist.P2POp(dist.irecv, out, peer), dist.P2POp(dist.isend, s.t(RANK, 7, torch.float32), peer)]
            for r in dist.batch_isend_irecv(ops):
                r.wait()
            s.check(name, out, value(peer, 7, torch.float32))
    s.run("batch_isend_irecv/pairwise_swap", case)

    def case(name):
        # all-to-one: everyone sends to rank 0, which receives from all in one batch
        if RANK == 0:
            outs = [torch.zeros(5, device=device) for _ in range(1, WORLD)]
            ops = [dist.P2POp(dist.irecv, o, p) for p, o in zip(range(1, WORLD), outs)]
            if ops:
                for r in dist.batch_isend_irecv(ops):
                    r.wait()
            s.check(name, outs, [value(p, 5, torch.float32, salt=3) for p in range(1, WORLD)])
        else:
            for r in dist.batch_isend_irecv([dist.P2POp(dist.isend, s.t(RANK, 5, torch.float32, salt=3), 0)]):
                r.wait()
    s.run("batch_isend_irecv/all_to_one", case)

    def case(name):
        # one-to-all: the last rank sends a distinct tensor to every other rank in one batch
        root = WORLD - 1
        if RANK == root:
            ops = [dist.P2POp(dist.isend, s.t(p, 6, torch.float32, salt=4), p) for p in range(WORLD - 1)]
            if ops:
                for r in dist.batch_isend_irecv(ops):
                    r.wait()
        else:
            out = torch.zeros(6, device=device)
            for r in dist.batch_isend_irecv([dist.P2POp(dist.irecv, out, root)]):
                r.wait()
            s.check(name, out, value(RANK, 6, torch.float32, salt=4))
    s.run("batch_isend_irecv/one_to_all", case)


def check_coalescing(s: Suite, cover: Coverage) -> None:
    """Every _coalescing_manager form (plain, async, device=, device= async) around
    all_reduce, all_gather_into_tensor and reduce_scatter_tensor, recording the forms a
    backend rejects; on CUDA, a block mixing collectives with send/recv, and a block whose
    body raises followed by a collective that works."""
    device = s.device
    for form in ("plain", "async", "device", "device_async"):
        cm_device = device if form.startswith("device") else None
        async_ops = form.endswith("async")

        def case(name, cm_device=cm_device, async_ops=async_ops):
            ts = [s.t(RANK, 5 + i, torch.float32, salt=i) for i in range(4)]
            with dist._coalescing_manager(device=cm_device, async_ops=async_ops) as cm:
                for t in ts:
                    dist.all_reduce(t)
            if async_ops:
                cm.wait()
            s.check(name, ts, [reduce_ref([value(r, 5 + i, torch.float32, salt=i) for r in range(WORLD)], R.SUM)
                               for i in range(4)])
        s.run_recording_errors(f"coalesced/all_reduce/{form}", case)

        def case(name, cm_device=cm_device, async_ops=async_ops):
            outs = [torch.zeros(WORLD * (3 + i), device=device) for i in range(3)]
            with dist._coalescing_manager(device=cm_device, async_ops=async_ops) as cm:
                for i, o in enumerate(outs):
                    dist.all_gather_into_tensor(o, s.t(RANK, 3 + i, torch.float32, salt=i))
            if async_ops:
                cm.wait()
            s.check(name, outs, [torch.cat([value(r, 3 + i, torch.float32, salt=i) for r in range(WORLD)])
                                 for i in range(3)])
        s.run_recording_errors(f"coalesced/all_gather_into_tensor/{form}", case)

        def case(name, cm_device=cm_device, async_ops=async_ops):
            outs = [torch.zeros(2 + i, device=device) for i in range(3)]
            with dist._coalescing_manager(device=cm_device, async_ops=async_ops) as cm:
                for i, o in enumerate(outs):
                    dist.reduce_scatter_tensor(o, s.t(RANK, WORLD * (2 + i), torch.float32, salt=i))
            if async_ops:
                cm.wait()
            exp = []
            for i in range(3):
                full = reduce_ref([value(r, WORLD * (2 + i), torch.float32, salt=i) for r in range(WORLD)], R.SUM)
                exp.append(full[RANK * (2 + i):(RANK + 1) * (2 + i)])
            s.check(name, outs, exp)
        s.run_recording_errors(f"coalesced/reduce_scatter_tensor/{form}", case)

    if device.type == "cuda":
        def case(name):
            # one device block mixing collectives and P2P: one NCCL group, one Work
            right, left = (RANK + 1) % WORLD, (RANK - 1) % WORLD
            a, b = s.t(RANK, 4, torch.float32), torch.zeros(4, device=device)
            got = torch.zeros(3, device=device)
            with dist._coalescing_manager(device=device, async_ops=True) as cm:
                dist.broadcast(a, src=0)
                dist.all_reduce(s.t(RANK, 2, torch.float32))  # captured by torch's fast path
                if WORLD > 1:
                    dist.send(s.t(RANK, 3, torch.float32, salt=9), dst=right)
                    dist.recv(got, src=left)
            cm.wait()
            b.copy_(a)
            expected_got = value(left, 3, torch.float32, salt=9) if WORLD > 1 else torch.zeros(3)
            s.check(name, [b, got], [value(0, 4, torch.float32), expected_got])
        s.run("coalesced/mixed_collectives_and_p2p", case)

        def case(name):
            # an exception inside the manager: nothing hangs, the next collective works
            try:
                with dist._coalescing_manager(device=device):
                    dist.broadcast(s.t(RANK, 4, torch.float32), src=0)
                    raise KeyError("user error inside the manager")
            except KeyError:
                pass
            t = s.t(RANK, 8, torch.float32)
            dist.all_reduce(t)
            s.check(name, t, reduce_ref([value(r, 8, torch.float32) for r in range(WORLD)], R.SUM))
        s.run("coalesced/exception_then_collective", case)


def check_barrier(s: Suite, cover: Coverage) -> None:
    """barrier, and on CUDA barrier(device_ids=...)."""
    device = s.device
    def case(name):
        dist.barrier()
        if device.type == "cuda":
            dist.barrier(device_ids=[device.index])
        s.cases += 1
    s.run("barrier", case)


def check_object_collectives(s: Suite, cover: Coverage) -> None:
    """all_gather_object, broadcast_object_list, gather_object and scatter_object_list."""
    def case(name):
        objs = [None] * WORLD
        dist.all_gather_object(objs, {"rank": RANK, "sq": RANK * RANK})
        s.cases += 1
        if objs != [{"rank": r, "sq": r * r} for r in range(WORLD)]:
            s.failures.append(f"{name}: {objs}")
    s.run("all_gather_object", case)

    def case(name):
        objs = [f"hello {RANK}", RANK] if RANK == WORLD - 1 else [None, None]
        dist.broadcast_object_list(objs, src=WORLD - 1)
        s.cases += 1
        if objs != [f"hello {WORLD - 1}", WORLD - 1]:
            s.failures.append(f"{name}: {objs}")
    s.run("broadcast_object_list", case)

    def case(name):
        out = [None] * WORLD if RANK == 0 else None
        dist.gather_object(("r", RANK), out, dst=0)
        s.cases += 1
        if RANK == 0 and out != [("r", r) for r in range(WORLD)]:
            s.failures.append(f"{name}: {out}")
    s.run("gather_object", case)

    def case(name):
        out = [None]
        dist.scatter_object_list(out, [{"to": r} for r in range(WORLD)] if RANK == 0 else None, src=0)
        s.cases += 1
        if out != [{"to": RANK}]:
            s.failures.append(f"{name}: {out}")
    s.run("scatter_object_list", case)


def check_subgroups(s: Suite, cover: Coverage) -> None:
    """new_group: all_reduce and broadcast on a subgroup, all_reduce on the ranks left
    out, and the world group still working afterwards."""
    def case(name):
        members = [0, WORLD - 1] if WORLD > 1 else [0]
        sub = dist.new_group(members)
        others = dist.new_group([r for r in range(WORLD) if r not in members] or [0])
        s.cases += 1
        if RANK in members:
            t = s.t(RANK, 5, torch.float32)
            dist.all_reduce(t, group=sub)
            s.check(name, t, reduce_ref([value(r, 5, torch.float32) for r in members], R.SUM))
            t = s.t(RANK, 5, torch.float32)
            dist.broadcast(t, src=WORLD - 1, group=sub)
            s.check(name + "/broadcast", t, value(WORLD - 1, 5, torch.float32))
        elif others is not None and dist.get_rank(others) >= 0:
            t = s.t(RANK, 5, torch.float32)
            dist.all_reduce(t, group=others)
            rest = [r for r in range(WORLD) if r not in members]
            s.check(name + "/others", t, reduce_ref([value(r, 5, torch.float32) for r in rest], R.SUM))
        # the world group still works after subgroups were made
        t = s.t(RANK, 3, torch.float32)
        dist.all_reduce(t)
        s.check(name + "/world_after", t, reduce_ref([value(r, 3, torch.float32) for r in range(WORLD)], R.SUM))
        # a destroyed subgroup is freed as the case returns; torch keeps one not destroyed
        if RANK in members and not plain_gloo_teardown_can_hang(s.backend):
            dist.destroy_process_group(sub)
    s.run("new_group", case)


def coverage(args, device: torch.device) -> Coverage:
    """What the cases run over, by suite (quick, full) and device."""
    full = args.suite == "full"
    cpu = device.type == "cpu"
    gloo_like = cpu  # on CPU the group routes to gloo: gloo's op/dtype coverage applies

    dtypes = [torch.float32, torch.int64]
    if full:
        dtypes = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8,
                  torch.uint8, torch.int32, torch.int64, torch.bool]
        if not cpu:
            from cupycoll.nccl import header as nccl_header
            import cupy.cuda.nccl as cnccl  # noqa: F401
            if nccl_header.fp8_supported(cnccl.get_version()) and "cupycoll" in args.backend:
                dtypes += [torch.float8_e4m3fn, torch.float8_e5m2]
            dtypes += [torch.complex64, torch.complex128]
    ops = [R.SUM, R.PRODUCT, R.MIN, R.MAX] + ([] if gloo_like else [R.AVG])
    sizes = [0, 1, 1001] + ([LARGE] if full and not cpu else [])
    bdtypes = dtypes + ([torch.int16, torch.uint16] if full else [])
    return Coverage(gloo_like, dtypes, bdtypes, ops, sizes)


def connect(args) -> torch.device:
    """Initialise the default group as the arguments say; the device the cases use."""
    if "cupycoll" in args.backend and not args.no_import:
        import cupycoll  # noqa: F401

    if args.device == "cuda":
        local = RANK % torch.cuda.device_count()
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    kwargs = dict(backend=args.backend, timeout=timedelta(seconds=60))
    if args.device_id:
        kwargs["device_id"] = device
    dist.init_process_group(**kwargs)
    return device


def communicator_mode(backend: str):
    """How the default group's NCCL communicator was made, "blocking" or "nonblocking" (None:
    not cupycoll's group, or no communicator made yet)."""
    if "cupycoll" not in backend:
        return None
    from shapes import shell_of

    try:  # a report, not a case: it must not cost the rank its results
        comm = shell_of(dist.group.WORLD)._cuda.comm
    except Exception as exc:  # noqa: BLE001 - recorded instead
        return f"unknown ({type(exc).__name__}: {exc})"
    return None if comm is None else ("nonblocking" if comm.nonblocking else "blocking")


FAMILIES = (check_all_reduce, check_broadcast_and_reduce, check_all_gather, check_reduce_scatter,
            check_all_to_all, check_gather_and_scatter, check_point_to_point, check_coalescing,
            check_barrier, check_object_collectives, check_subgroups)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--suite", default="quick", choices=["quick", "full"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device-id", action="store_true")
    ap.add_argument("--no-import", action="store_true", help="rely on the torch.backends entry point")
    args = ap.parse_args()

    device = connect(args)
    s = Suite(device, args.out, args.backend)
    cover = coverage(args, device)
    for family in FAMILIES:
        family(s, cover)

    os.makedirs(args.out, exist_ok=True)
    torch.save(s.results, os.path.join(args.out, f"rank{RANK}.pt"))
    return end_suite(args.out, RANK, {"cases": s.cases, "failures": s.failures, "errors": s.errors,
                                      "skipped": s.skipped, "group_type": type(dist.group.WORLD).__name__,
                                      "communicator": communicator_mode(args.backend)})


if __name__ == "__main__":
    sys.exit(main())
