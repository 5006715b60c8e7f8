"""cupycoll.compat against the installed torch and CuPy: each version difference it handles
is asserted as this version behaves, so every CI leg (torch 2.7 to 2.15, CuPy 13 and 14)
checks its own side of each difference."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch
import torch.distributed as dist

import cupycoll
from cupycoll import _args, compat, config
from cupycoll.errors import CupycollValueError
from installed import cupycoll_entry_points
from mp import run_ranks
from shapes import backend_shape, cupycoll_group_type, shell_of
from torch_forms import forms
from workers import gloo_compat_worker
from workers.gloo_compat_worker import rank_input

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_torch_release_parsing():
    assert compat._release("2.15.0+cu132") == (2, 15)
    assert compat._release("2.7.1") == (2, 7)
    assert compat._release("2.16.0a0+git1234") == (2, 16)
    assert compat.TORCH == compat._release(torch.__version__) >= (2, 7)


# ------------------------------------------------------------------ PREMUL_SUM factor


def test_premul_factor_number_and_tensor():
    assert compat.premul_factor(dist._make_nccl_premul_sum(0.5)) == 0.5
    factor = torch.tensor([3.0])
    assert compat.premul_factor(dist._make_nccl_premul_sum(factor)) is factor
    # what torch hands the group: the options object's reduceOp
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist._make_nccl_premul_sum(2.0)
    assert compat.premul_factor(opts.reduceOp) == 2.0


def test_premul_factor_absent():
    assert compat.premul_factor(dist.ReduceOp(dist.ReduceOp.SUM)) is None
    assert compat.premul_factor(dist.ReduceOp.PREMUL_SUM) is None  # a bare RedOpType
    with pytest.raises(CupycollValueError, match="_make_nccl_premul_sum"):
        _args.reduction(torch.float32, dist.ReduceOp.PREMUL_SUM, False)


def test_premul_factor_reaches_the_nccl_mapping():
    # The torch 2.11 failure: a valid op was rejected as "without a factor".
    red = _args.reduction(torch.float32, dist._make_nccl_premul_sum(0.5), False)
    assert red.premul_factor == 0.5


def test_reduce_op_factor_attribute_is_version_dependent():
    op = dist._make_nccl_premul_sum(0.5)
    if compat.TORCH >= (2, 13):
        assert op.factor == 0.5
    else:
        assert not hasattr(op, "factor")


# ------------------------------------------------------------------------- asyncOp


def test_async_requested():
    opts = dist.BroadcastOptions()  # one of the four with asyncOp on every supported torch
    opts.asyncOp = False
    assert compat.async_requested(opts) is False
    opts.asyncOp = True
    assert compat.async_requested(opts) is True
    plain = dist.AllreduceOptions()
    if compat.TORCH >= (2, 11):
        assert hasattr(plain, "asyncOp")
    elif compat.TORCH < (2, 8):  # 2.7: broadcast, all-gather, scatter, reduce-scatter only
        assert not hasattr(plain, "asyncOp")
    if not hasattr(plain, "asyncOp"):
        assert compat.async_requested(plain) is True  # torch waits on the Work itself


# ------------------------------------------------------------------- gloo alltoall


@pytest.fixture(scope="module")
def gloo_cases(tmp_path_factory, once_per_run):
    """What each rank of a two-process gloo pair got in each case of
    tests/workers/gloo_compat_worker.py: ``case -> [rank 0's, rank 1's]``."""
    def launch():
        out = tmp_path_factory.mktemp("gloo-compat")
        run_ranks("gloo_compat_worker.py", 2, args=[str(out)], timeout=180)
        per_rank = [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in range(2)]
        return {name: [per_rank[rank][name] for rank in range(2)] for name in per_rank[0]}
    return once_per_run("gloo-compat", launch)


def _values(gloo_cases, case):
    got = gloo_cases[case]
    errors = [r["error"] for r in got if "error" in r]
    assert not errors, f"{case}: {errors}"
    return [r["value"] for r in got]


def _check_exchange(results, uneven):
    for rank, outputs in enumerate(results):
        for peer, out in enumerate(outputs):
            assert torch.equal(out, torch.full((rank + 1 if uneven else 2, 2), float(peer * 10 + rank)))


@pytest.mark.launches
def test_gloo_alltoall(gloo_cases):
    _check_exchange(_values(gloo_cases, "alltoall"), uneven=False)


@pytest.mark.parametrize("uneven", [False, True])
def test_gloo_alltoall_fallback(gloo_cases, uneven):
    # the alltoall_base route, exercised on every torch (it is the only route before 2.12);
    # unlike gloo's own alltoall (2.12+) it also takes tensors of different sizes, as NCCL does
    case = "alltoall_fallback_uneven" if uneven else "alltoall_fallback_even"
    _check_exchange(_values(gloo_cases, case), uneven)


def test_gloo_lacks_alltoall_before_2_12(gloo_cases):
    errors = _values(gloo_cases, "plain_alltoall")
    if compat.GLOO_HAS_ALLTOALL:
        assert errors == [None, None]
    else:
        assert all("does not support alltoall" in e for e in errors)


# ------------------------------------------------------ gloo reduce_scatter_tensor

OPS = {"SUM": torch.add, "MAX": torch.maximum, "MIN": torch.minimum, "PRODUCT": torch.mul}


def _expected(op, rank):
    return OPS[op](rank_input(0), rank_input(1))[rank * 3:(rank + 1) * 3]


def test_gloo_cases_cover_every_op():
    assert set(OPS) == set(gloo_compat_worker.OPS)


@pytest.mark.parametrize("fallback", [False, True])
@pytest.mark.parametrize("op", list(OPS))
def test_gloo_reduce_scatter_tensor_honours_the_op(gloo_cases, op, fallback):
    # the fallback (the all-reduce route) is exercised on every torch
    results = _values(gloo_cases, f"reduce_scatter_{'fallback_' if fallback else ''}{op}")
    for rank in range(2):
        assert torch.equal(results[rank], _expected(op, rank)), (op, rank, results[rank])


def test_gloo_reduce_scatter_tensor_fallback_averages(gloo_cases):
    # gloo's all-reduce has no AVG: the fallback sums and divides
    results = _values(gloo_cases, "reduce_scatter_fallback_AVG")
    for rank in range(2):
        assert torch.equal(results[rank], _expected("SUM", rank) / 2), (rank, results[rank])


def test_gloo_averages_floats_from_2_13_and_never_integers(gloo_cases):
    # where compat says gloo averages floating tensors, cupycoll.cpu_average leaves them to it
    floats = gloo_cases["average_float32"]
    if compat.GLOO_AVERAGES_FLOATS:
        assert all(torch.equal(r["value"], torch.tensor([1.5, 5.5])) for r in floats), floats
    # integers: gloo fails on every release (2.7.1: no AVG at all), so cupycoll averages them
    assert all("error" in r for r in gloo_cases["average_int64"]), gloo_cases["average_int64"]


@pytest.mark.parametrize("fallback", [False, True])
@pytest.mark.parametrize("op", list(OPS))
def test_gloo_reduce_scatter_list_honours_the_op(gloo_cases, op, fallback):
    # the fallback (torch 2.7.1's route: the inputs joined, reduce_scatter_tensor's all-reduce
    # route) is exercised on every torch; the default is gloo's own list form from 2.11
    results = _values(gloo_cases, f"reduce_scatter_list_{'fallback_' if fallback else ''}{op}")
    for rank in range(2):
        assert results[rank].shape == (1, 3)
        assert torch.equal(results[rank].reshape(-1), _expected(op, rank)), (op, rank, results[rank])


def test_gloo_reduce_scatter_list_fallback_takes_scalars(gloo_cases):
    results = _values(gloo_cases, "reduce_scatter_list_fallback_scalar_SUM")
    for rank in range(2):
        assert results[rank].shape == () and results[rank] == (rank_input(0) + rank_input(1))[rank]


def test_gloo_has_its_list_reduce_scatter_from_2_11_and_not_on_2_7(gloo_cases):
    errors = _values(gloo_cases, "plain_reduce_scatter")
    if compat.GLOO_HAS_REDUCE_SCATTER:
        assert errors == [None, None]
    elif compat.TORCH < (2, 8):  # pytorch#149869 added it; 2.8 - 2.10 are not run
        assert all("does not support reduce_scatter" in e for e in errors), errors


@pytest.mark.parametrize("case, named", list(gloo_compat_worker.LIST_REFUSED_NAMED.items()))
def test_the_list_reduce_scatter_fallback_refuses_what_gloo_refuses_by_name(gloo_cases, case, named):
    got = gloo_cases[f"refused_list_{case}"]
    assert all(r.get("error", "").startswith("CupycollValueError: reduce_scatter on CPU tensors") for r in got), got
    assert all(named in r["error"] for r in got), (named, got)


@pytest.mark.parametrize("op", ["SUM", "MAX"])
@pytest.mark.parametrize("case", list(gloo_compat_worker.TENSOR_REFUSED))
def test_the_reduce_scatter_tensor_fallback_refuses_what_gloo_would_crash_on(gloo_cases, case, op):
    # before 2.11 gloo's own checks of these abort the process (2.7.1), and a 0-d tensor crashes
    # it on every release: the fallback checks first, each rank alike (so neither waits)
    got = gloo_cases[f"refused_tensor_{case}_{op}"]
    assert all(r.get("error", "").startswith("CupycollValueError: reduce_scatter_tensor on CPU tensors: input")
               for r in got), got


class _FailingGloo:
    """A gloo group whose every call fails as a timed-out one does: its Work's future
    completes with the error."""

    def size(self):
        return 2

    def rank(self):
        return 0

    def _failed(self, *_args):
        future = torch.futures.Future()
        future.set_exception(RuntimeError("gloo: timed out waiting for peer 1"))
        return types.SimpleNamespace(get_future=lambda: future)  # what the fallbacks use of a Work

    alltoall_base = allreduce = _failed


def test_gloo_fallbacks_fail_when_gloo_fails(monkeypatch):
    monkeypatch.setattr(compat.gloo, "GLOO_HAS_ALLTOALL", False)
    monkeypatch.setattr(compat.gloo, "GLOO_REDUCE_SCATTER_HONOURS_OP", False)
    outputs = [torch.zeros(1), torch.zeros(1)]
    work = compat.gloo_alltoall(_FailingGloo(), outputs, [torch.ones(1), torch.ones(1)],
                                dist.AllToAllOptions())
    with pytest.raises(RuntimeError, match="timed out waiting for peer 1"):
        work.wait()
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    work = compat.gloo_reduce_scatter_tensor(_FailingGloo(), torch.zeros(1), torch.ones(2), opts)
    with pytest.raises(RuntimeError, match="timed out waiting for peer 1"):
        work.wait()
    monkeypatch.setattr(compat.gloo, "GLOO_HAS_REDUCE_SCATTER", False)
    work = compat.gloo_reduce_scatter(_FailingGloo(), [torch.zeros(1)], [[torch.ones(1), torch.ones(1)]], opts)
    with pytest.raises(RuntimeError, match="timed out waiting for peer 1"):
        work.wait()


def test_gloo_reduce_scatter_base_by_version(gloo_cases):
    got = _values(gloo_cases, "reduce_scatter_base_MAX")
    if compat.GLOO_REDUCE_SCATTER_HONOURS_OP:
        assert all(torch.equal(got[r], _expected("MAX", r)) for r in range(2))
    elif compat.TORCH < (2, 8):  # seen on 2.7.1: a sum, whatever the op
        assert all(torch.equal(got[r], _expected("SUM", r)) for r in range(2))


# ------------------------------------------------------- group construction and init


def test_set_default_backend():
    group = dist.ProcessGroup(dist.HashStore(), 0, 1)
    gloo = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=10))
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    assert group._get_backend_name() == "undefined"
    compat.set_default_backend(group, dist.ProcessGroup.BackendType.GLOO)
    assert group._get_backend_name() == "gloo"
    compat.shutdown(gloo)


# ProcessGroup's methods by their names from torch 2.13 on, and before
_RENAMED_METHODS = {"all_gather_single": "_allgather_base",
                    "all_gather_single_coalesced": "allgather_into_tensor_coalesced",
                    "reduce_scatter_single": "_reduce_scatter_base",
                    "reduce_scatter_single_coalesced": "reduce_scatter_tensor_coalesced",
                    "all_to_all_single": "alltoall_base"}


def test_tensor_collective_names_by_version(recwarn):
    # torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to the *_single names
    renamed = compat.TENSOR_COLLECTIVES_RENAMED
    assert renamed == (compat.TORCH >= (2, 13))
    assert hasattr(dist, "all_gather_single") == hasattr(dist, "reduce_scatter_single") == renamed
    for new, old in _RENAMED_METHODS.items():  # and bound ProcessGroup's methods under both names
        assert hasattr(dist.ProcessGroup, new) == renamed, new
        assert hasattr(dist.ProcessGroup, old), old
    expected = ((dist.all_gather_single, dist.reduce_scatter_single) if renamed
                else (dist.all_gather_into_tensor, dist.reduce_scatter_tensor))
    assert (compat.all_gather_single, compat.reduce_scatter_single) == expected
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        out = torch.zeros(2)
        compat.all_gather_single(out, torch.ones(2))
        compat.reduce_scatter_single(out, torch.full((2,), 3.0))
        assert torch.equal(out, torch.full((2,), 3.0))
    finally:
        dist.destroy_process_group()
    assert not [w for w in recwarn if "deprecated" in str(w.message)]  # what the rename is for


def test_short_forms_take_a_timeout_from_2_9():
    # read from torch's own binding: the short forms, and the two forms 2.9 added
    short = [(method, form) for method in ("allreduce", "broadcast", "reduce", "allgather", "gather", "scatter",
                                           "reduce_scatter")
             for form in forms(method) if not form.params[-1].kind.endswith("Options")]
    assert len(short) == 8  # allreduce has two
    assert all((form.params[-1].name == "timeout") == compat.SHORT_FORMS_TAKE_TIMEOUT for _, form in short), short
    added = [form.names for method in ("alltoall_base", "barrier") for form in forms(method)
             if form.names[-1:] == ("timeout",)]
    assert added == ([("output", "input", "output_split_sizes", "input_split_sizes", "timeout"), ("timeout",)]
                     if compat.SHORT_FORMS_TAKE_TIMEOUT else [])


def test_shutdown_is_safe_on_every_version():
    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=10))
    compat.shutdown(group)
    compat.shutdown(group)  # twice: still no error


@pytest.fixture
def world_of_one():
    dist.init_process_group("cupycoll", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_init_sets_a_default_backend(world_of_one):
    # torch 2.15 attaches a flight-recorder hook to every new group, which needs the
    # group's default backend: init failed with "Could not find the default backend type 0".
    pg = world_of_one
    assert type(pg).__name__ == cupycoll_group_type()
    hooks = getattr(dist.distributed_c10d._world, "pg_flight_recorder_hooks", None)
    if compat.TORCH >= (2, 15):
        assert pg in hooks
    else:
        assert hooks is None or pg not in hooks
    assert pg._get_backend(torch.device("cpu")) is not None
    t = torch.ones(3)
    dist.all_reduce(t)  # and the group works
    assert torch.equal(t, torch.ones(3))


def test_split_source_offered_only_to_cupycoll_groups(world_of_one):
    """Which backend a bound default group lends its communicator to, for splitting."""
    import inspect

    source = dist.distributed_c10d._get_split_source
    pg, cuda0 = world_of_one, torch.device("cuda", 0)
    pg.bound_device_id = cuda0  # as init_process_group(device_id=...) does; no GPU needed here
    try:
        if len(inspect.signature(source).parameters) == 2:
            # torch 2.15 compares the backend names itself: a new "nccl" group (nccl2 by
            # default in 2.15) never gets cupycoll's handle to split from.
            assert compat.TORCH >= (2, 15)
            assert source(pg, "nccl") is None
            assert source(pg, "cupycoll") is pg._get_backend(cuda0)
        else:
            # Older torch (2.13 run here; 2.14.1's distributed_c10d.py too) asks the handle
            # alone; it answers "yes" only while torch builds a cupycoll group (its frame
            # check), and here, outside any build, it does.
            assert compat.TORCH <= (2, 14)
            assert source(pg) is pg._get_backend(cuda0)
    finally:
        pg.bound_device_id = None


def test_the_group_creator_runs_inside_torchs_helper_that_names_the_cuda_backend(monkeypatch):
    # CudaBackend.supports_splitting tells a new cupycoll group from any other by this frame.
    from cupycoll import shell

    seen = []
    read_arguments = shell.group_arguments

    def recording(*args):
        seen.append(compat.cuda_backend_being_created())
        return read_arguments(*args)

    monkeypatch.setattr(shell, "group_arguments", recording)  # each shape's creator reads them
    if compat.PY_BACKEND:
        from cupycoll import py_backend
        monkeypatch.setattr(py_backend, "group_arguments", recording)
    dist.init_process_group("cpu:gloo,cuda:cupycoll", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert type(dist.group.WORLD).__name__ == cupycoll_group_type()
    finally:
        dist.destroy_process_group()
    assert seen == ["cupycoll"]
    assert compat.cuda_backend_being_created() is None  # outside any creation


class _ManagedGroup:
    """What torch's _coalescing_manager calls on a group with a device: start, end."""

    def __init__(self):
        self.managers = []
        self.freed = []

    def _start_coalescing(self, device):
        self.managers.append(compat.calling_coalescing_manager(self.on_freed))

    def _end_coalescing(self, device):
        return None

    def on_freed(self, ref):
        self.freed.append(ref)


def test_a_raising_coalescing_body_is_seen_only_through_torchs_generator():
    group = _ManagedGroup()
    with pytest.raises(KeyError):
        with dist._coalescing_manager(group=group, device=torch.device("cpu")):
            raise KeyError("the body raised")
    compat.forget_coalescing_manager(group)
    [manager] = group.managers
    assert manager is not None and group.freed == [manager]  # freed: the with statement is over
    assert compat.calling_coalescing_manager() is None  # not called from a manager


def test_torch_keeps_its_record_of_a_raising_coalescing_manager_until_it_is_forgotten():
    group = _ManagedGroup()
    state = dist.distributed_c10d._world.pg_coalesce_state
    with pytest.raises(KeyError):
        with dist._coalescing_manager(group=group, device=torch.device("cpu")):
            raise KeyError("the body raised")
    try:
        assert group in state  # torch 2.7.1 - 2.15 pop it only after a body that returned
    finally:
        compat.forget_coalescing_manager(group)
    assert group not in state
    compat.forget_coalescing_manager(group)  # nothing left to forget: no error


def test_pg_options_reach_the_group_settings():
    """``pg_options=cupycoll.Options(...)`` given to init_process_group with a per-device
    backend string, and to new_group, reaches the group cupycoll builds: torch hands it to
    the creator on every supported version."""
    dist.init_process_group("cpu:gloo,cuda:cupycoll", store=dist.HashStore(), rank=0,
                            world_size=1, pg_options=cupycoll.Options(timeout=42, algorithm="ring"))
    try:
        world = shell_of(dist.group.WORLD)
        assert type(dist.group.WORLD).__name__ == cupycoll_group_type()
        assert world.settings.timeout == datetime.timedelta(seconds=42)
        assert world.settings.algorithm == "ring"
        # the shell's gloo half runs with the same timeout (in the Backend shape, torch's own
        # gloo serves "cpu:gloo" calls with init_process_group's timeout: docs/usage.md, "Two shapes")
        assert world._cpu._get_backend(torch.device("cpu")).options._timeout == datetime.timedelta(seconds=42)
        sub = dist.new_group([0], pg_options=cupycoll.Options(timeout=17, check_collectives=True))
        plain = dist.new_group([0])
        assert all(type(g).__name__ == cupycoll_group_type() for g in (sub, plain))
        sub_shell, plain_shell = shell_of(sub), shell_of(plain)
        assert sub_shell.settings.timeout == datetime.timedelta(seconds=17)
        assert sub_shell.settings.check_collectives and sub_shell.settings.algorithm == "auto"
        # without options a subgroup gets the defaults, not the default group's options
        assert plain_shell.settings == config.resolve(None, None)
        t = torch.ones(2)
        dist.all_reduce(t, group=sub)
        assert torch.equal(t, torch.ones(2))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(compat.TORCH < (2, 15),
                    reason="torch < 2.15 attaches no flight-recorder hook to a new group")
def test_torch_flight_recorder_hook_on_a_cupycoll_group(monkeypatch):
    """What torch 2.15's auto-attached flight-recorder hook records for a cupycoll group: the
    hook itself nothing (cupycoll's Python methods replace the C++ ones it wraps), so torch's
    dump holds each CPU call once, as gloo's own entry. In the ProcessGroup shape that is the
    inner gloo, which has no group name (as on 2.11 and 2.13 without a hook); in the Backend
    shape torch's own gloo in torch's ProcessGroup, filed under the group's name."""
    import json

    from torch._C import _distributed_c10d as c10d

    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE", raising=False)  # 0 would attach no hook
    monkeypatch.delenv("TORCH_NCCL_TRACE_BUFFER_SIZE", raising=False)
    dist.init_process_group("cpu:gloo,cuda:cupycoll", store=dist.HashStore(), rank=0, world_size=1)
    try:
        pg = dist.group.WORLD
        assert pg in dist.distributed_c10d._world.pg_flight_recorder_hooks
        c10d._reset_fr_trace()  # the recorder is per process: drop other tests' entries
        t = torch.ones(3)
        dist.all_reduce(t)
        dist.broadcast(t, 0)
        dist.all_reduce(torch.ones(5))
        entries = json.loads(c10d._dump_fr_trace_json()).get("entries", [])
        name = [pg.group_name, "default_pg"] if backend_shape() else ["", ""]
        # exactly gloo's three entries: the hook filed none of its own
        assert [(e["collective_seq_id"], e["profiling_name"], e["input_sizes"], e["process_group"])
                for e in entries] == [(1, "gloo:all_reduce", [[3]], name),
                                      (2, "gloo:broadcast", [[3]], name),
                                      (3, "gloo:all_reduce", [[5]], name)]
    finally:
        dist.destroy_process_group()


def test_the_cpu_route_hands_gloo_the_callers_tensors(world_of_one):
    tensor = torch.arange(3.0)
    work = dist.all_reduce(tensor, async_op=True)
    handed = work.get_future().wait()[0]  # torch's Work in the Backend shape has no result()
    assert handed is tensor and torch.equal(handed, torch.arange(3.0))


def test_pg_options_do_not_shadow_torch(world_of_one):
    # cupycoll's options take a name of their own, never one of torch's ProcessGroup.
    pg = world_of_one
    assert isinstance(shell_of(pg).pg_options, cupycoll.Options)
    if "options" in dir(dist.ProcessGroup):
        assert not isinstance(pg.options, cupycoll.Options)


def test_lazy_backend_entry_point():
    """torch 2.14+ loads the ``torch.distributed.backends`` entry point named like the
    backend string when init_process_group meets an unknown name; cupycoll declares one,
    so it works with the import-time ``torch.backends`` autoload switched off."""
    assert hasattr(dist.Backend, "_ensure_backend_registered") == compat.TORCH_LAZY_BACKEND_ENTRY_POINTS
    if not compat.TORCH_LAZY_BACKEND_ENTRY_POINTS:
        pytest.skip(f"torch {torch.__version__} has no lazy backend entry points (2.14 added them)")
    if not cupycoll_entry_points("torch.distributed.backends"):
        pytest.skip("cupycoll is not pip-installed here, so its entry points are absent")
    code = ("import torch.distributed as dist, sys\n"
            "assert 'cupycoll' not in sys.modules\n"
            "dist.init_process_group('cupycoll', store=dist.HashStore(), rank=0, world_size=1)\n"
            "print(type(dist.group.WORLD).__name__)\n"
            "dist.destroy_process_group()\n")
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == cupycoll_group_type()


# ----------------------------------------------------------------------------- CuPy


def test_installed_cupy_matches_its_version():
    cupy = pytest.importorskip("cupy")
    major = compat.cupy_major(cupy)
    assert major >= 13
    # CuPy 14 added Stream.from_external; 13 has none.
    assert hasattr(cupy.cuda.Stream, "from_external") == (major >= 14)


def test_external_stream_by_version():
    made = []
    stream_cls = types.SimpleNamespace(from_external=lambda handle: made.append(("from", handle)) or "S14")
    cuda = types.SimpleNamespace(Stream=stream_cls,
                                 ExternalStream=lambda ptr, dev: made.append(("ext", ptr, dev)) or "S13")
    handle = object()
    new = types.SimpleNamespace(__version__="14.2.0", cuda=cuda)
    old = types.SimpleNamespace(__version__="13.6.0", cuda=cuda)
    assert compat.external_stream(new, handle, 1234, 0) == "S14"
    assert compat.external_stream(old, handle, 1234, 1) == "S13"
    assert made == [("from", handle), ("ext", 1234, 1)]


def test_pip_nvrtc_is_loaded_for_cupy_13():
    cupy = pytest.importorskip("cupy")
    from cupycoll import _cuda

    loaded = compat.load_pip_nvrtc(cupy)
    if compat.cupy_major(cupy) >= 14:
        assert loaded is None  # CuPy 14 finds it itself
    else:
        assert loaded is not None and "nvidia/cuda_nvrtc/lib/libnvrtc.so." in loaded
    # either way the ring kernels can compile: the extras install nvidia-cuda-nvrtc
    assert _cuda.nvrtc_module().getVersion() >= (12, 0)


def test_run_eagerly_under_compile_wraps_only_what_overrides_torchs_process_group():
    import torch._dynamo  # noqa: F401 - imported: the methods are wrapped at once

    class Group(dist.ProcessGroup):
        def allreduce(self, tensors, opts=None):
            return "allreduce"

        def _allgather_base(self, output, input, opts=None):
            return "allgather"

        def helper(self):
            return "helper"

    compat.run_eagerly_under_compile(Group)
    members = vars(Group)
    assert members["allreduce"].__wrapped__ and members["_allgather_base"].__wrapped__
    assert not hasattr(members["helper"], "__wrapped__")
    assert Group.allreduce(None, []) == "allreduce"  # still the method, called through the wrapper


@pytest.mark.launches
def test_a_group_made_without_dynamo_does_not_import_it_and_is_wrapped_when_it_comes():
    # torch.compiler.disable imports Dynamo (seconds); nothing compiles before Dynamo is
    # imported, so the methods are wrapped as it is, not at init_process_group.
    script = textwrap.dedent("""
        import sys
        import torch, torch.distributed as dist
        import cupycoll
        dist.init_process_group("cupycoll", store=dist.HashStore(), rank=0, world_size=1)
        from cupycoll import shell
        group = type(dist.group.WORLD)
        print("dynamo at init", "torch._dynamo" in sys.modules)
        import torch._dynamo
        shell_class = shell.GroupShell
        wrapped = [cls.__name__ for cls in shell_class.__subclasses__()
                   if getattr(vars(cls).get("allreduce"), "__wrapped__", None) is not None]
        print("wrapped after dynamo", sorted(wrapped))
        dist.destroy_process_group()
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "dynamo at init False" in result.stdout, result.stdout
    wrapped = result.stdout.split("wrapped after dynamo")[1]
    assert "ProcessGroupCupycoll" in wrapped or "CupycollBackend" in wrapped, result.stdout


def test_gloos_rendezvous_keys_tell_which_ranks_never_came():
    # compat.gloo_ranks_absent reads gloo's rendezvous keys as this torch lays them out
    store = dist.HashStore()
    with pytest.raises(dist.DistStoreError):
        dist.ProcessGroupGloo(dist.PrefixStore("g/", store), 1, 3, datetime.timedelta(seconds=0.5))
    assert compat.gloo_ranks_absent(dist.PrefixStore("g/", store), 1, 3) == [0, 2]
    assert compat.gloo_ranks_absent(dist.PrefixStore("other/", store), 1, 3) is None  # not its store


# ------------------------------------------------------------------ store clones, lazy gloo


def test_stores_can_be_cloned_from_2_8():
    master = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    clone = compat.clone_store(master)
    if not compat.STORE_CLONE:
        assert clone is None and not hasattr(dist.Store, "clone")
        return
    assert clone is not master and clone.port == master.port
    master.set("seen", "1")
    assert clone.get("seen") == b"1"  # one server, a client of its own


def test_the_root_store_is_beneath_every_prefix_and_many_keys_set_in_one_call():
    root = dist.HashStore()
    assert compat.root_store(dist.PrefixStore("a/", dist.PrefixStore("b/", root))) is root
    prefixed = dist.PrefixStore("c", root)
    compat.store_set_many(prefixed, ["x", "y"], [b"1", b"2"])
    assert root.check(["c/x", "c/y"]) and prefixed.get("x") == b"1" and prefixed.get("y") == b"2"

    class NoMultiSet:  # a store of Python's own that implements set alone
        def __init__(self):
            self.values = {}

        def set(self, key, value):
            self.values[key] = value
    plain = NoMultiSet()
    compat.store_set_many(plain, ["x"], [b"1"])
    assert plain.values == {"x": b"1"}


def _sockets() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return count


@pytest.mark.parametrize("lazy", ["1", None])
def test_gloo_connects_lazily_from_2_8_where_the_job_asks_torch(monkeypatch, lazy):
    # Two ranks of one gloo group in this process: made lazily where TORCH_GLOO_LAZY_INIT
    # asks it, no pair connects before its first call (eagerly, every pair connects at
    # creation and a call opens nothing).
    import threading

    if lazy is None:
        monkeypatch.delenv("TORCH_GLOO_LAZY_INIT", raising=False)
    else:
        monkeypatch.setenv("TORCH_GLOO_LAZY_INIT", lazy)
    store = dist.HashStore()
    made = {}
    threads = [threading.Thread(target=lambda r=r: made.setdefault(
        r, compat.new_gloo(dist.PrefixStore("lazy/", store), r, 2, datetime.timedelta(seconds=30))))
        for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    before = _sockets()
    tensors = {r: torch.full((2,), float(r + 1)) for r in (0, 1)}
    works = [made[r].allreduce([tensors[r]]) for r in (0, 1)]
    for work in works:
        work.wait()
    assert tensors[0].tolist() == tensors[1].tolist() == [3.0, 3.0]
    opened = _sockets() - before
    assert (opened > 0) == (compat.GLOO_LAZY_INIT and lazy is not None), opened
    has_lazy = "lazy_init" in (dist.ProcessGroupGloo.create_default_device.__doc__ or "")
    assert has_lazy == compat.GLOO_LAZY_INIT
