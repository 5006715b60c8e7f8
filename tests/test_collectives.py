"""Each collective's CUDA body (cupycoll.collectives) and its argument checks
(cupycoll._args): bad input gets a typed error before anything is enqueued; good input maps
to the right NCCL calls, and a PREMUL_SUM's op and factor tensor live as long as the call
needs them. Pure logic on CPU: a stand-in group sends CPU tensors down the NCCL path and a
recording communicator stands in for NCCL (the GPU tier runs the same calls for real)."""

from __future__ import annotations

import dataclasses
import datetime
import sys
import types

import pytest
import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

import cupycoll
from cupycoll import _args, _cuda, collectives
from cupycoll.nccl import bindings as nb
from cupycoll.nccl import header as nh
from cupycoll.errors import (CommunicatorAbortedError, CupycollError, CupycollTypeError,
                             CupycollValueError, MissingDependencyError, NcclError, NoCudaDeviceError)
from cupycoll.process_group import ProcessGroupCupycoll
from standins import LogicGroup, logic_group

R = dist.ReduceOp


@pytest.fixture
def group(monkeypatch):
    monkeypatch.setattr(_args, "fp8_supported", lambda: True)  # asked for fp8 tensors only
    return logic_group()


def t(*shape, dtype=torch.float32):
    return torch.ones(*shape, dtype=dtype)


def ar_opts(op=R.SUM):
    o = dist.AllreduceOptions()
    o.reduceOp = op if not isinstance(op, R.RedOpType) else R(op)
    return o


def expect(group, exc_type, match, fn):
    with pytest.raises(exc_type, match=match):
        fn()
    assert group.submitted == [], "nothing may be enqueued after a rejected call"
    # the group stays usable
    group.allreduce([t(3)], ar_opts())
    assert group.submitted[-1][0] == "all_reduce"
    group.submitted.clear()


# ---- good input maps to the right NCCL calls ------------------------------------------
def test_all_reduce_codes(group):
    x = t(10)
    calls = group.allreduce([x], ar_opts())
    assert calls == [("all_reduce", x.data_ptr(), x.data_ptr(), 10, nh.ncclFloat32, nh.ncclSum)]


@pytest.mark.parametrize("dtype,op,nccl_dtype,nccl_op,count", [
    (torch.bool, R.SUM, nh.ncclUint8, nh.ncclMax, 6),
    (torch.bool, R.PRODUCT, nh.ncclUint8, nh.ncclMin, 6),
    (torch.complex64, R.SUM, nh.ncclFloat32, nh.ncclSum, 12),
    (torch.complex128, R.AVG, nh.ncclFloat64, nh.ncclAvg, 12),
    (torch.bfloat16, R.MIN, nh.ncclBfloat16, nh.ncclMin, 6),
    (torch.float16, R.PRODUCT, nh.ncclFloat16, nh.ncclProd, 6),
    (torch.int8, R.MAX, nh.ncclInt8, nh.ncclMax, 6),
    (torch.uint8, R.AVG, nh.ncclUint8, nh.ncclAvg, 6),
    (torch.float8_e4m3fn, R.SUM, nh.ncclFloat8e4m3, nh.ncclSum, 6),
    (torch.float8_e5m2, R.MAX, nh.ncclFloat8e5m2, nh.ncclMax, 6),
])
def test_reduction_mapping(group, dtype, op, nccl_dtype, nccl_op, count):
    x = torch.zeros(6, dtype=dtype)
    (call,) = group.allreduce([x], ar_opts(op))
    assert call[3:] == (count, nccl_dtype, nccl_op)


def test_premul_sum_creates_and_destroys_op(group):
    x = t(4, dtype=torch.float16)
    calls = group.allreduce([x], ar_opts(dist._make_nccl_premul_sum(0.5)))
    assert calls[0][0] == "create_premul_sum"
    assert calls[0][1] == torch.tensor([0.5], dtype=torch.float16).view(torch.uint8).numpy().tobytes()
    assert calls[0][2:] == (nh.ncclFloat16, False)
    assert calls[1] == ("all_reduce", x.data_ptr(), x.data_ptr(), 4, nh.ncclFloat16, 99)
    assert calls[2] == ("destroy_op", 99)


def test_fallible_steps_run_in_prepare_before_the_nccl_group(group, monkeypatch):
    # Staging allocations and PREMUL_SUM op creation can raise (OOM, old NCCL); inside an
    # open NCCL group that would launch a partial batch, so they run in prepare(), not launch.
    allocated = []
    real_empty, real_cat = torch.empty, torch.cat
    cuda = group._cuda
    monkeypatch.setattr(torch, "empty", lambda *a, **k: allocated.append(cuda.phase) or real_empty(*a, **k))
    monkeypatch.setattr(torch, "cat", lambda *a, **k: allocated.append(cuda.phase) or real_cat(*a, **k))
    group.allreduce([t(4)], ar_opts(dist._make_nccl_premul_sum(0.5)))
    group.allgather([[torch.zeros(3), torch.zeros(3)]], [t(3)], c10d.AllgatherOptions())
    rs = dist.ReduceScatterOptions()
    rs.reduceOp = dist._make_nccl_premul_sum(2.0)
    group.reduce_scatter([t(3)], [[t(3), t(3)]], rs)
    prepared = cuda.prepared
    assert [p[1][0][0] if p[1] else None for p in prepared] == ["create_premul_sum", None, "create_premul_sum"]
    assert allocated == ["prepare", "prepare"]  # the gather's staging, the reduce-scatter's cat
    # launch made exactly one NCCL call after what prepare did, then destroyed the op
    for (_, before), (_, after) in zip(prepared, group.submitted):
        assert after[:len(before)] == before
        assert all(c[0] != "create_premul_sum" for c in after[len(before):])


def test_data_movers_send_bytes(group):
    x = torch.zeros(5, dtype=torch.int16)  # no NCCL reduction type, fine to move
    o = dist.BroadcastOptions()
    o.rootRank = 1
    assert group.broadcast([x], o) == [("broadcast", x.data_ptr(), x.data_ptr(), 10, nh.ncclUint8, 1)]


def test_all_to_all_single_uneven_offsets(group):
    inp = torch.zeros(5, 3)  # rows of 12 bytes; send 2 rows to rank 0, 3 rows to rank 1
    out = torch.zeros(4, 3)  # receive 1 row from rank 0, 3 rows from rank 1
    calls = group.all_to_all_single(out, inp, [1, 3], [2, 3], dist.AllToAllOptions())
    i, o = inp.data_ptr(), out.data_ptr()
    assert calls == [("send", i, 24, nh.ncclUint8, 0), ("recv", o, 12, nh.ncclUint8, 0),
                     ("send", i + 24, 36, nh.ncclUint8, 1), ("recv", o + 12, 36, nh.ncclUint8, 1)]


def test_all_gather_list_stages_and_copies_out(group):
    outs = [torch.zeros(3), torch.zeros(3)]
    calls = group.allgather([outs], [t(3)], c10d.AllgatherOptions())
    assert calls[0][0] == "all_gather" and calls[0][3:] == (12, nh.ncclUint8)
    assert calls[0][2] not in (outs[0].data_ptr(), outs[1].data_ptr())  # staged


def test_all_gather_adjacent_views_direct(group):
    flat = torch.zeros(6)
    calls = group.allgather([list(flat.chunk(2))], [t(3)], c10d.AllgatherOptions())
    assert calls[0][2] == flat.data_ptr()


def test_gather_root_receives_from_all(group):
    o = dist.GatherOptions()
    o.rootRank = 0
    outs = [torch.zeros(2), torch.zeros(2)]
    x = t(2)
    calls = group.gather([outs], [x], o)
    assert calls == [("recv", outs[0].data_ptr(), 8, 1, 0), ("recv", outs[1].data_ptr(), 8, 1, 1),
                     ("send", x.data_ptr(), 8, 1, 0)]


def test_grouped_calls_need_neither_cupy_nor_a_library_lookup(group, monkeypatch):
    # all_to_all, gather and scatter run as one NCCL group of the communicator's own library
    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.setattr(nb, "find_library", lambda path=None: pytest.fail("NCCL was looked up"))
    o = dist.ScatterOptions()
    o.rootRank = 1
    x = t(2)
    assert group.scatter([x], [], o) == [("recv", x.data_ptr(), 8, 1, 1)]
    calls = group.alltoall([t(1), t(1)], [t(1), t(1)], dist.AllToAllOptions())
    assert [c[0] for c in calls] == ["send", "recv", "send", "recv"]


# ---- bad input ------------------------------------------------------------------------
def test_non_contiguous(group):
    x = torch.zeros(4, 4).t()
    expect(group, CupycollValueError, "not contiguous", lambda: group.allreduce([x], ar_opts()))


def test_other_device(group):
    group._cuda.device = torch.device("cuda", 1)
    with pytest.raises(CupycollValueError, match=r"is on cpu but this group's communicator is on cuda:1"):
        group.allreduce([t(2)], ar_opts())
    assert group.submitted == []


def test_mixed_device_types(group):
    out = torch.zeros(4, device="meta")
    expect(group, CupycollValueError, "different device types",
           lambda: group.all_gather_single(out, t(2), c10d.AllgatherOptions()))


def test_wrong_output_size(group):
    expect(group, CupycollValueError, r"all_gather_into_tensor output has 5 elements .* expected 4",
           lambda: group.all_gather_single(t(5), t(2), c10d.AllgatherOptions()))
    expect(group, CupycollValueError, r"reduce_scatter_tensor input has 7 elements .* expected 6",
           lambda: group.reduce_scatter_single(t(3), t(7), dist.ReduceScatterOptions()))


def test_one_tensor_forms_name_the_tensor_whose_dtype_differs(group):
    expect(group, CupycollTypeError, r"all_gather_into_tensor output: dtype torch.float64 differs",
           lambda: group.all_gather_single(t(4).double(), t(2), c10d.AllgatherOptions()))
    expect(group, CupycollTypeError, r"reduce_scatter_tensor input: dtype torch.float64 differs",
           lambda: group.reduce_scatter_single(t(3), t(6).double(), dist.ReduceScatterOptions()))


def test_list_length(group):
    expect(group, CupycollValueError, "has 3 tensors; the group has 2 ranks",
           lambda: group.allgather([[t(2), t(2), t(2)]], [t(2)], c10d.AllgatherOptions()))
    expect(group, CupycollValueError, "has 1 tensors",
           lambda: group.alltoall([t(2)], [t(2), t(2)], dist.AllToAllOptions()))


@pytest.mark.parametrize("root", [2, -1, 7])
def test_root_out_of_range(group, root):
    o = dist.BroadcastOptions()
    o.rootRank = root
    expect(group, CupycollValueError, f"root {root} is out of range", lambda: group.broadcast([t(2)], o))


def test_peer_out_of_range_or_self(group):
    expect(group, CupycollValueError, "peer rank 5 is out of range", lambda: group.send([t(2)], 5, 0))
    expect(group, CupycollValueError, "own rank", lambda: group.recv([t(2)], 0, 0))


def test_unsupported_dtype(group):
    expect(group, CupycollTypeError, r"torch.int16 cannot be reduced by NCCL \(ReduceOp.SUM\)",
           lambda: group.allreduce([t(2, dtype=torch.int16)], ar_opts()))


@pytest.mark.parametrize("op", [R.BAND, R.BOR, R.BXOR])
def test_bitwise_ops_rejected_by_nccl(group, op):
    with cupycoll.algorithm("nccl"):
        expect(group, CupycollValueError, f"ReduceOp.{op.name} is not supported by NCCL \\(dtype torch.int32\\)",
               lambda: group.allreduce([t(2, dtype=torch.int32)], ar_opts(op)))


class RecordingRing:
    def __init__(self, calls, prepared, backend):
        self.calls, self.prepared, self.backend = calls, prepared, backend

    def prepare(self, kind, count, dtype, op):
        self.prepared.append((self.backend.phase, kind, count, dtype, op))

    def __getattr__(self, method):
        return lambda *args, **kwargs: self.calls.append((method, *args[3:5], kwargs))


@pytest.fixture
def ring_group(group):
    group.ring_calls, group.ring_prepared = [], []
    group._cuda.runner = lambda algorithm, comm: RecordingRing(group.ring_calls, group.ring_prepared, group._cuda)
    return group


def test_a_ring_call_compiles_its_kernels_before_anything_launches(ring_group):
    with cupycoll.algorithm("ring"):
        ring_group.allreduce([t(3, dtype=torch.bfloat16)], ar_opts(R.SUM))
        rs = c10d.ReduceScatterOptions()
        ring_group.reduce_scatter_single(t(2), t(4), rs)
        ring_group.reduce_scatter([t(2)], [[t(2), t(2)]], rs)
    assert ring_group.ring_prepared == [("prepare", "all_reduce", 3, "bfloat16", "sum"),
                                        ("prepare", "reduce_scatter", 2, "float32", "sum"),
                                        ("prepare", "reduce_scatter", 2, "float32", "sum")]
    assert [c[0] for c in ring_group.ring_calls] == ["all_reduce", "reduce_scatter", "reduce_scatter"]


def test_a_ring_whose_kernels_fail_to_compile_launches_nothing(ring_group):
    def fail(kind, count, dtype, op):
        raise CupycollError(f"NVRTC could not compile the {dtype} {op} ring kernels")

    ring_group._cuda.runner = lambda algorithm, comm: types.SimpleNamespace(prepare=fail, all_reduce=ring_group.ring_calls.append)
    with cupycoll.algorithm("ring"), pytest.raises(CupycollError, match="could not compile"):
        ring_group.allreduce([t(2, dtype=torch.int32)], ar_opts(R.BXOR))
    assert ring_group.ring_calls == [] and ring_group.submitted == []


@pytest.mark.parametrize("op", [R.BAND, R.BOR, R.BXOR])
def test_auto_sends_bitwise_ops_to_the_ring(ring_group, op):
    ring_group.allreduce([t(2, dtype=torch.int32)], ar_opts(op))
    assert ring_group.ring_calls == [("all_reduce", "int32", op.name.lower(),
                                      {"premul": None, "premul_ptr": None})]
    assert ring_group.submitted[-1] == ("all_reduce", [])  # no NCCL reduction call


def test_auto_keeps_nccl_for_what_nccl_can_do(ring_group):
    ring_group.allreduce([t(2, dtype=torch.float16)], ar_opts(R.SUM))
    assert ring_group.ring_calls == [] and ring_group.submitted[-1][1][0][0] == "all_reduce"


def test_ring_by_option_and_by_context(ring_group):
    with cupycoll.algorithm("ring"):
        ring_group.allreduce([t(2, dtype=torch.bfloat16)], ar_opts(R.SUM))
        out, inp = t(1, dtype=torch.float16), t(2, dtype=torch.float16)
        rs = c10d.ReduceScatterOptions()
        rs.reduceOp = R(R.AVG)
        ring_group.reduce_scatter_single(out, inp, rs)
        ring_group.allreduce([t(2)], ar_opts(dist._make_nccl_premul_sum(0.5)))
    assert [c[:3] for c in ring_group.ring_calls] == [
        ("all_reduce", "bfloat16", "sum"), ("reduce_scatter", "float16", "avg"),
        ("all_reduce", "float32", "premul_sum")]
    assert ring_group.ring_calls[-1][3] == {"premul": 0.5, "premul_ptr": None}
    ring_group._cuda.settings = dataclasses.replace(ring_group._cuda.settings, algorithm="ring")
    ring_group.allreduce([t(2, dtype=torch.int8)], ar_opts(R.MAX))
    assert ring_group.ring_calls[-1][:3] == ("all_reduce", "int8", "max")
    with cupycoll.algorithm("nccl"):  # the per-call override beats the group's option
        ring_group.allreduce([t(2, dtype=torch.int8)], ar_opts(R.MAX))
    assert len(ring_group.ring_calls) == 4


def test_pairs_the_ring_cannot_do_name_dtype_and_op(ring_group):
    expect(ring_group, CupycollValueError, "cannot reduce dtype float32 with op bxor",
           lambda: ring_group.allreduce([t(2)], ar_opts(R.BXOR)))
    with cupycoll.algorithm("ring"):
        with pytest.raises(CupycollValueError, match="cannot reduce dtype complex64 with op sum"):
            ring_group.allreduce([t(2, dtype=torch.complex64)], ar_opts(R.SUM))
        with pytest.raises(CupycollValueError, match="cannot reduce dtype bool with op avg"):
            ring_group.allreduce([t(2, dtype=torch.bool)], ar_opts(R.AVG))
    assert ring_group.ring_calls == []


def test_unknown_algorithm_is_rejected():
    with pytest.raises(CupycollValueError, match="algorithm='fastest': expected one of auto, nccl, ring"):
        with cupycoll.algorithm("fastest"):
            pass


def test_undefined_op_dtype_pairs(group):
    expect(group, CupycollValueError, "ReduceOp.MAX is not defined for dtype torch.complex64",
           lambda: group.allreduce([t(2, dtype=torch.complex64)], ar_opts(R.MAX)))
    expect(group, CupycollValueError, "ReduceOp.AVG is not defined for dtype torch.bool",
           lambda: group.allreduce([t(2, dtype=torch.bool)], ar_opts(R.AVG)))
    expect(group, CupycollValueError, "PREMUL_SUM needs a floating dtype, got torch.int64",
           lambda: group.allreduce([t(2, dtype=torch.int64)], ar_opts(dist._make_nccl_premul_sum(2.0))))


def test_premul_factor_tensor_checked(group):
    factor = torch.tensor([2.0], dtype=torch.float64)  # the data is float32
    expect(group, CupycollValueError, "factor tensor must be one element of torch.float32",
           lambda: group.allreduce([t(2)], ar_opts(dist._make_nccl_premul_sum(factor))))


def test_not_a_tensor_and_multi_tensor(group):
    expect(group, CupycollTypeError, "must be a torch.Tensor, got str",
           lambda: group.allreduce(["x"], ar_opts()))
    expect(group, CupycollValueError, "exactly one tensor per process, got 2",
           lambda: group.allreduce([t(2), t(2)], ar_opts()))


def test_uneven_split_sizes(group):
    expect(group, CupycollValueError, r"split sizes \[1, 1\] do not add up to dim 0 \(3\)",
           lambda: group.all_to_all_single(t(3), t(3), [1, 1], [1, 2], dist.AllToAllOptions()))
    expect(group, CupycollValueError, "not divisible by the group size",
           lambda: group.all_to_all_single(t(3), t(3), [], [], dist.AllToAllOptions()))


def test_recv_anysource_rejected(group):
    expect(group, CupycollValueError, "any source", lambda: group.recv_anysource([t(2)], 0))


def test_errors_are_one_family():
    for exc in (CupycollValueError, CupycollTypeError, MissingDependencyError, NoCudaDeviceError):
        assert issubclass(exc, CupycollError)
    assert issubclass(CupycollValueError, ValueError) and issubclass(CupycollTypeError, TypeError)


# ---- PREMUL_SUM: the op's lifetime and the factor tensor's ----------------------------
class PremulComm:
    """A communicator whose all_reduce meets ``error``; ``abort`` says whether an abort
    happened first (then its comm_ptr is 0 and ncclRedOpDestroy fails)."""

    def __init__(self, error, abort):
        self.state, self.error, self.abort, self.destroyed = "ok", error, abort, []

    def create_premul_sum(self, scalar, dtype, on_device):
        return 7

    def all_reduce(self, *args):
        if self.abort:
            self.state = "aborted"
        raise self.error

    def destroy_op(self, op):
        if self.state != "ok":
            raise NcclError(4, "ncclRedOpDestroy", "invalid argument (NULL communicator)")
        self.destroyed.append(op)


def _premul_launch():
    red = _args.reduction_plan(torch.ones(4), dist._make_nccl_premul_sum(0.5), "nccl", 2)
    return collectives._premul_launch(red, torch.float32,
                                      lambda comm, op, s: comm.all_reduce(1, 1, 4, red.dtype, op, s))


def test_premul_sum_on_an_aborted_communicator_raises_the_abort():
    # The op goes with the aborted communicator: destroying it would raise NCCL's invalid
    # argument in place of the abort's error.
    launch, prepare = _premul_launch()
    comm = PremulComm(CommunicatorAbortedError("the NCCL communicator on cuda:0 was aborted"), abort=True)
    prepare(comm)
    with pytest.raises(CommunicatorAbortedError, match="was aborted"):
        launch(comm, 0)
    assert comm.destroyed == []  # it went with the communicator


def test_premul_sum_failing_on_a_healthy_communicator_still_destroys_its_op():
    launch, prepare = _premul_launch()
    comm = PremulComm(NcclError(5, "ncclAllReduce", "invalid usage"), abort=False)
    prepare(comm)
    with pytest.raises(NcclError, match="ncclAllReduce"):
        launch(comm, 0)
    assert comm.destroyed == [7]


def _tensors(kept):
    if isinstance(kept, torch.Tensor):
        return [kept]
    if isinstance(kept, (list, tuple)):
        return [t for item in kept for t in _tensors(item)]
    return []


@pytest.fixture(params=["nccl", "ring"])
def keep_group(request):
    group = LogicGroup(None, 0, 2, datetime.timedelta(seconds=5))
    group.submitted = group._cuda.submitted = []
    group._cuda.prepared, group._cuda.keepalives, group.ring_calls = [], [], []
    group._cuda.runner = lambda algorithm, comm: RecordingRing(group.ring_calls, [], group._cuda)
    group._cuda.settings = dataclasses.replace(group._cuda.settings, algorithm=request.param)
    return group


def _premul(factor, options):
    options.reduceOp = dist._make_nccl_premul_sum(factor)
    return options


PREMUL_CALLS = {
    "all_reduce": lambda g, f: g.allreduce([torch.ones(4)], _premul(f, dist.AllreduceOptions())),
    "reduce": lambda g, f: g.reduce([torch.ones(4)], _premul(f, dist.ReduceOptions())),
    "reduce_scatter": lambda g, f: g.reduce_scatter([torch.ones(2)], [[torch.ones(2), torch.ones(2)]],
                                                    _premul(f, dist.ReduceScatterOptions())),
    "reduce_scatter_tensor": lambda g, f: g._reduce_scatter_base(torch.ones(2), torch.ones(4),
                                                                 _premul(f, c10d.ReduceScatterOptions())),
}


@pytest.mark.parametrize("call", sorted(PREMUL_CALLS))
def test_the_premul_sum_factor_tensor_is_in_the_calls_keepalive(keep_group, call):
    if call == "reduce" and keep_group._cuda.settings.algorithm == "ring":
        pytest.skip("the ring has no reduce: it runs on NCCL")
    factor = torch.tensor([0.5])
    PREMUL_CALLS[call](keep_group, factor)
    kept = _tensors(keep_group._cuda.keepalives[-1])
    assert any(t.data_ptr() == factor.data_ptr() for t in kept)  # not just the data


def test_a_number_premul_factor_keeps_nothing_extra():
    plan = _args.reduction_plan(torch.ones(2), ar_opts(dist._make_nccl_premul_sum(0.5)).reduceOp, "ring", 2)
    assert _args.factor_tensor(plan) is None and plan.premul == 0.5


# ---- the real group on this machine ---------------------------------------------------
@pytest.fixture
def real_group():
    """A group on the process's real CUDA runtime (no stand-in), which finds no device here."""
    from cupycoll import _cuda

    store = dist.HashStore()
    with _cuda.install(_cuda.CUDA):
        return ProcessGroupCupycoll(store, 0, 1, datetime.timedelta(seconds=10))


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")
@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr"])
def test_a_sparse_tensor_on_the_cuda_route_gets_a_typed_error_naming_its_layout(real_group, layout):
    dense = torch.eye(3)
    sparse = dense.to_sparse() if layout == "sparse_coo" else dense.to_sparse_csr()
    with pytest.raises(CupycollTypeError, match=f"all_reduce tensor is a torch.{layout} tensor"):
        real_group._cuda.check_device(sparse, "all_reduce tensor")
    assert real_group._cuda.check_device(dense, "all_reduce tensor") == dense.device


def test_no_cuda_device(real_group):
    pytest.importorskip("cupy")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(NoCudaDeviceError, match="no CUDA device"):
        real_group._cuda.comm_for(torch.device("cuda", 0))
    x = torch.ones(3)  # CPU work still goes through
    real_group.allreduce([x], ar_opts()).wait()
    assert torch.equal(x, torch.ones(3))


def test_missing_cupy_names_the_extra(monkeypatch):
    _cuda.nccl_module.cache_clear()
    monkeypatch.setitem(sys.modules, "cupy", None)
    try:
        with pytest.raises(MissingDependencyError, match=r"cupycoll\[cuda12\].*cupycoll\[cuda13\]"):
            _cuda.nccl_module()
    finally:
        _cuda.nccl_module.cache_clear()


def test_missing_cupy_names_the_checkout_install(monkeypatch):
    _cuda.nccl_module.cache_clear()
    monkeypatch.setitem(sys.modules, "cupy", None)
    try:
        with pytest.raises(MissingDependencyError) as raised:
            _cuda.nccl_module()
    finally:
        _cuda.nccl_module.cache_clear()
    # a user of a checkout (not of the PyPI name) gets the command that works there
    assert "pip install -e '.[cuda12]'" in str(raised.value)
    assert "-e '.[cuda13]'" in str(raised.value)


def test_missing_nccl_names_the_extra(monkeypatch):
    cupy_nccl = pytest.importorskip("cupy.cuda.nccl")
    _cuda.nccl_module.cache_clear()
    monkeypatch.setattr(cupy_nccl, "available", False)
    try:
        with pytest.raises(MissingDependencyError, match=r"no NCCL library.*cupycoll\[cuda12\]"):
            _cuda.nccl_module()
    finally:
        _cuda.nccl_module.cache_clear()


def test_bad_pg_options():
    with pytest.raises(CupycollValueError, match="cupycoll.Options"):
        ProcessGroupCupycoll(dist.HashStore(), 0, 1, datetime.timedelta(seconds=5), options={"timeout": 3})
