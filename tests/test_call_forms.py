"""torch's call forms of a ProcessGroup's methods on a cupycoll group (cupycoll.call_forms and
the shell's entry points), on one rank: every form torch binds is one cupycoll binds, under
torch's parameter names, and on each release the other way round (but for the timeouts torch
2.9 added, which cupycoll takes on every release); a short form builds the options torch
would; a call no form takes is a typed error naming its values, raised before anything is
recorded; a CPU reduce-scatter's Work hands out a future though gloo's has none, also on a
torch whose gloo has no list form. tests/multiproc/test_every_call_form.py calls every form on
2 ranks against gloo."""

from __future__ import annotations

import datetime
import inspect

import pytest
import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from cupycoll import CupycollTypeError, call_forms, compat
from cupycoll.process_group import ProcessGroupCupycoll
from cupycoll.shell import GroupShell
from torch_forms import forms, kind, overloads

R = c10d.ReduceOp


def _kind_name(kind_) -> str:
    return kind_.__name__ if isinstance(kind_, type) else kind_


def _covers(ours: call_forms.Form, theirs) -> bool:
    """Does cupycoll's form take every call torch's form takes, by the same names and kinds?
    (Parameters torch names arg0, arg1... are positional only: their count and kinds count.)
    cupycoll's form may add defaulted parameters at its end (a tag torch requires, a timeout
    an older torch lacks)."""
    mine = list(ours.params)
    if len(mine) < len(theirs.params):
        return False
    for (name, kind_, _), param in zip(mine, theirs.params):
        if (name != param.name and not param.positional_only) or _kind_name(kind_) != param.kind:
            return False
    return all(default is not call_forms.MISSING for _, _, default in mine[len(theirs.params):])


def _shell_members() -> dict:
    """What the shell's classes define (GroupShell and the ShellCalls it mixes in), by name."""
    return {name: member for cls in reversed(GroupShell.__mro__) if cls is not object
            for name, member in vars(cls).items()}


def _names_of_2_13() -> set:
    """The methods torch 2.13 bound under new names (compat.TENSOR_COLLECTIVES_RENAMED): those
    the shell's old names are aliases of."""
    return {member.__name__ for name, member in _shell_members().items()
            if name in call_forms.FORMS and member.__name__ != name}


def _added_by_2_9(method: str, form: call_forms.Form) -> bool:
    """Is ``form`` one torch 2.9 added (compat.SHORT_FORMS_TAKE_TIMEOUT): the options form
    with a timeout for its options (barrier's, all_to_all_single's)?"""
    return form.names == call_forms.FORMS[method][0].names[:-1] + ("timeout",)


def _forms_this_torch_binds():
    """(method, cupycoll's form) for each of cupycoll's forms this torch's own binding has too."""
    for method, ours in call_forms.FORMS.items():
        if method in _names_of_2_13() and not compat.TENSOR_COLLECTIVES_RENAMED:
            continue
        for form in ours:
            if compat.SHORT_FORMS_TAKE_TIMEOUT or not _added_by_2_9(method, form):
                yield method, form


def test_every_form_torch_binds_is_one_cupycoll_binds_under_the_same_names():
    seen = 0
    for method, ours in call_forms.FORMS.items():
        assert len(forms(method)) == overloads(method), method  # every form pybind lists was read
        for theirs in forms(method):
            assert not any(p.kind.startswith("unknown") for p in theirs.params), theirs
            assert any(_covers(form, theirs) for form in ours), f"cupycoll has no form {theirs}"
            seen += 1
    # this release's own count (35 forms on 2.13 and 2.15, 29 on 2.11, 27 on 2.7.1)
    assert seen == len(list(_forms_this_torch_binds()))


def test_every_form_cupycoll_binds_is_one_torch_binds_but_for_a_timeout_older_releases_lack():
    # with the test above: cupycoll's table is this release's, form for form
    for method, ours in _forms_this_torch_binds():
        missing = 0 if compat.SHORT_FORMS_TAKE_TIMEOUT or ours.names[-1] != "timeout" else 1
        assert any(_covers(ours, theirs) and len(ours.params) == len(theirs.params) + missing
                   for theirs in forms(method)), f"torch {torch.__version__} has no form {ours.describe(method)}"


def test_this_torch_binds_every_method_of_the_table_under_its_names():
    absent = {method for method in call_forms.FORMS if not overloads(method)}
    assert absent == (set() if compat.TENSOR_COLLECTIVES_RENAMED else _names_of_2_13())
    assert _names_of_2_13() == {"all_gather_single", "all_gather_single_coalesced", "reduce_scatter_single",
                                "reduce_scatter_single_coalesced", "all_to_all_single"}


def test_a_form_torch_would_add_is_found():
    # pybind's line for a form no table entry has: the coverage check above would fail on it
    line = ("allreduce(self: ProcessGroup, tensors: collections.abc.Sequence[torch.Tensor], "
            "root: typing.SupportsInt) -> c10d::Work")
    bound = type("Bound", (), {"__doc__": line})
    (form,) = forms("allreduce", type("Group", (), {"allreduce": bound}))
    assert [p.kind for p in form.params] == ["tensors", "int"]
    assert not any(_covers(ours, form) for ours in call_forms.FORMS["allreduce"])
    assert kind("typing.Optional[datetime.timedelta]") == "timeout"
    assert kind("List[List[torch.Tensor]]") == "tensor lists"


def test_every_collective_of_the_shell_that_torch_binds_has_its_forms():
    found = set()
    for name, member in _shell_members().items():
        takes_tensors = any(p.kind.startswith("tensor") for form in forms(name) for p in form.params)
        if callable(member) and takes_tensors:
            assert name in call_forms.FORMS, name
            found.add(name)
    # every collective of the table (all but barrier) under the names this release binds
    expected = {method for method, ours in call_forms.FORMS.items()
                if any(isinstance(k, str) and k.startswith("tensor") for form in ours for _, k, _ in form.params)}
    if not compat.TENSOR_COLLECTIVES_RENAMED:
        expected -= _names_of_2_13()
    assert found == expected and {"allreduce", "send", "alltoall_base", "_allgather_base"} <= found


@pytest.mark.parametrize("method", sorted(call_forms.FORMS))
def test_each_entry_point_names_its_parameters_as_torchs_options_form(method):
    # so that a keyword call of the options form binds as it does on torch
    parameters = list(inspect.signature(getattr(GroupShell, method)).parameters.values())[1:]
    named = [p.name for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert tuple(named) == call_forms.FORMS[method][0].names


@pytest.fixture
def group():
    made = ProcessGroupCupycoll(dist.HashStore(), 0, 1, datetime.timedelta(seconds=30))
    yield made
    made.shutdown()


def test_a_short_form_builds_the_options_torchs_binding_builds():
    t = torch.ones(2)
    tensors, opts = call_forms.bind("allreduce", (t, R.MAX), (datetime.timedelta(seconds=5),), {})
    assert tensors[0] is t and len(tensors) == 1
    assert opts.reduceOp == R.MAX and opts.timeout == datetime.timedelta(seconds=5)
    premul = dist._make_nccl_premul_sum(2.0)
    (_, opts) = call_forms.bind("allreduce", ([t], premul), (), {})
    assert compat.premul_factor(opts.reduceOp) == 2.0  # the op keeps its factor
    tensors, opts = call_forms.bind("reduce", (call_forms.MISSING, call_forms.MISSING), (),
                                    {"tensor": t, "root": torch.tensor(1), "op": R(R.MIN), "timeout": 2.5})
    assert (opts.rootRank, opts.reduceOp, opts.timeout) == (1, R.MIN, datetime.timedelta(seconds=2.5))
    outs, ins, opts = call_forms.bind("gather", ([], t, 1), (), {})
    assert outs == [] and ins[0] is t and opts.rootRank == 1  # a non-root gathers into nothing
    (opts,) = call_forms.bind("barrier", (None,), (), {})  # None: the defaults
    assert isinstance(opts, c10d.BarrierOptions)


def test_the_options_form_of_a_part_of_a_block_carries_the_blocks_options():
    block = c10d.AllreduceCoalescedOptions()
    block.reduceOp = R.MAX
    block.timeout = datetime.timedelta(seconds=3)
    part = call_forms.copied(c10d.AllreduceOptions, block)
    assert part.reduceOp == R.MAX and part.timeout == block.timeout and block.reduceOp == R.MAX
    assert call_forms.copied(type(block), block, reduceOp=R.SUM).reduceOp == R.SUM and block.reduceOp == R.MAX


@pytest.mark.parametrize("call, named", [
    (lambda g: g.broadcast([torch.ones(2)], 0), "broadcast([tensor(float32, (2,))], 0)"),
    (lambda g: g.allreduce([torch.ones(2)], "sum"), "'sum'"),
    (lambda g: g.allreduce([torch.ones(2)], c10d.AllreduceOptions(), datetime.timedelta(1)), "allreduce("),
    (lambda g: g.reduce(torch.ones(2), 0.5), "0.5"),
    (lambda g: g.barrier(bogus=1), "bogus=1"),
    (lambda g: g.send(torch.ones(1), 0, 0), "send(tensor(float32, (1,)), 0, 0)"),
])
def test_a_call_no_form_takes_is_a_typed_error_naming_its_values_before_anything_is_recorded(group, call, named):
    entries = len(group._trace.recorder.entries)
    with pytest.raises(CupycollTypeError, match="no form of torch's ProcessGroup") as raised:
        call(group)
    assert named in str(raised.value) and "its forms: " in str(raised.value)
    assert len(group._trace.recorder.entries) == entries
    x = torch.ones(3)  # the group still answers
    group.allreduce([x], R.MAX).wait()
    assert torch.equal(x, torch.ones(3))


@pytest.mark.parametrize("case", ["list", "tensor", "tensor AVG", "coalesced"])
def test_a_cpu_reduce_scatter_work_hands_a_completed_future_of_its_outputs(group, case):
    # gloo's reduce-scatter Works have none ("Work::getFuture not implemented")
    if case == "list":
        out = torch.zeros(3)
        work, outputs = group.reduce_scatter([out], [[torch.full((3,), 2.0)]]), [out]
    elif case == "tensor":
        out = torch.zeros(3)
        work, outputs = group.reduce_scatter_single(out, torch.full((3,), 2.0)), [out]
    elif case == "tensor AVG":
        out = torch.zeros(3, dtype=torch.int64)  # averaged by cupycoll, not by gloo
        opts = c10d.ReduceScatterOptions()
        opts.reduceOp = R.AVG
        work, outputs = group.reduce_scatter_single(out, torch.full((3,), 4, dtype=torch.int64), opts), [out]
    else:
        outs = [torch.zeros(2), torch.zeros(2)]
        work, outputs = group.reduce_scatter_single_coalesced(outs, [torch.ones(2), torch.full((2,), 5.0)]), outs
    future = work.get_future()
    assert future.done()
    value = future.wait()
    assert len(value) == len(outputs) and all(v is o for v, o in zip(value, outputs))
    assert all(torch.equal(o, torch.full_like(o, {"list": 2, "tensor": 2, "tensor AVG": 4}.get(case, 1)))
               for o in outputs[:1])
