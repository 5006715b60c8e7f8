"""torch's call forms of a process group's methods, bound to the one form the shell runs.

torch binds each method of its ``ProcessGroup`` with several overloads (pybind lists them in
``ProcessGroup.allreduce.__doc__`` and its siblings): the options form that
``torch.distributed``'s functions call, ``allreduce(tensors, opts)``, and short forms that
build the options object from plainer arguments: a bare ``ReduceOp`` or ``RedOpType``, an
int root, one tensor where the options form takes a list, a timeout. Callers use them
directly (torchft, and torch's own tests): ``pg.allreduce([t], ReduceOp.SUM)``,
``pg.broadcast(t, 0)``, ``pg.reduce(t, 0, ReduceOp.MAX)``, ``pg.allgather(outs, t)``.

:data:`FORMS` holds every form per method name, in torch's order, each with the parameter
names torch gives it (so a keyword call binds as it does on torch) and what it means in the
options form. The shell's entry points take the options form as their first branch and hand
any other call to :func:`bind`, which binds it to the first form whose parameters and kinds
fit, as pybind picks an overload, and returns the options form's arguments. A call no form
takes is a :class:`~cupycoll.errors.CupycollTypeError` naming its values and the forms,
before anything is recorded or enqueued. ``None`` for an options object means its defaults,
as torchft's process-group wrapper passes ``barrier(None)``; on torch that binds to the
timeout form, with the same meaning.

Deliberately left out: checking the tensors an options form carries (the shell's routing
and :mod:`cupycoll.collectives` do), ``monitored_barrier`` (gloo's own, which a cupycoll
group leaves to torch's C++ ProcessGroup), and the Backend shape's calls: there torch's own
ProcessGroup binds the forms before it dispatches the options form to cupycoll's backend.
"""

from __future__ import annotations

import datetime
import inspect
import operator
from typing import Callable, Dict, NamedTuple, Sequence, Tuple

import torch
from torch._C import _distributed_c10d as c10d

from .errors import CupycollTypeError

ReduceOp = c10d.ReduceOp

# A parameter the caller did not pass (the shell's entry points default to it).
MISSING = type("Missing", (), {"__repr__": lambda self: "MISSING", "__slots__": ()})()


# -- the kinds of torch's parameters, as pybind's casters accept them -----------------------
def _tensor(value) -> bool:
    return isinstance(value, torch.Tensor)


def _tensors(value) -> bool:  # a sequence of tensors (pybind's std::vector caster: not a str)
    return isinstance(value, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in value)


def _tensor_lists(value) -> bool:
    return isinstance(value, (list, tuple)) and all(_tensors(v) for v in value)


def _op(value) -> bool:
    return isinstance(value, (ReduceOp, ReduceOp.RedOpType))


def _int(value) -> bool:  # an int, or what has __index__ (pybind's int caster), never a float
    if isinstance(value, int):
        return True
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _ints(value) -> bool:
    return isinstance(value, (list, tuple)) and all(_int(v) for v in value)


def _timeout(value) -> bool:  # pybind's chrono caster takes a timedelta or float seconds
    return value is None or isinstance(value, (datetime.timedelta, float))


_KINDS = {"tensor": _tensor, "tensors": _tensors, "tensor lists": _tensor_lists, "op": _op, "int": _int,
          "ints": _ints, "timeout": _timeout}


def fits(kind, value) -> bool:
    """Is ``value`` of ``kind``: a name of :data:`_KINDS`, or an options class (None: its defaults)?"""
    if isinstance(kind, type):
        return value is None or isinstance(value, kind)
    return _KINDS[kind](value)


# -- building the options form ----------------------------------------------------------------
def _given(opts, cls):
    """The caller's options object, or ``cls``'s defaults for None."""
    return cls() if opts is None else opts


def options(cls, timeout=None, **fields):
    """A ``cls`` options object with ``fields`` set, and its timeout when one is given."""
    opts = cls()
    for name, value in fields.items():
        setattr(opts, name, value)
    if timeout is not None:
        opts.timeout = timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=timeout)
    return opts


def copied(cls, opts, **fields):
    """A ``cls`` options object holding every field of ``opts`` (another options object) that
    both have and Python may set (which exist differs by release: ``asyncOp`` is 2.11's on
    most), then ``fields``: the caller's object is left as it was."""
    made = cls()
    for name in dir(opts):
        if name.startswith("_") or name in fields or not hasattr(made, name):
            continue
        value = getattr(opts, name)
        if callable(value):
            continue
        try:
            setattr(made, name, value)
        except AttributeError:  # read-only
            pass
    for name, value in fields.items():
        setattr(made, name, value)
    return made


def _reduce_op(op) -> ReduceOp:
    return op if isinstance(op, ReduceOp) else ReduceOp(op)


class Form(NamedTuple):
    """One of torch's forms of a method: its parameters ``(name, kind, default)`` in order
    (``kind``: see :func:`fits`; ``default`` is :data:`MISSING` when the parameter is
    required) and ``build``, which takes them by name and returns the options form's arguments."""

    params: Tuple[Tuple[str, object, object], ...]
    build: Callable[..., tuple]

    @property
    def names(self) -> Tuple[str, ...]:
        return tuple(p[0] for p in self.params)

    def describe(self, method: str) -> str:
        shown = [name if default is MISSING else f"{name}={_shown_default(default, kind)}"
                 for name, kind, default in self.params]
        return f"{method}({', '.join(shown)})"


def _shown_default(default, kind) -> str:
    if isinstance(kind, type):
        return f"{kind.__name__}()"
    return "SUM" if default is ReduceOp.SUM else repr(default)


def _form(build: Callable[..., tuple], **kinds) -> Form:
    """A :class:`Form` whose parameters are ``build``'s own (names, order, defaults), each of
    the kind ``kinds`` names for it (see :func:`fits`)."""
    params = []
    for name, parameter in inspect.signature(build).parameters.items():
        default = MISSING if parameter.default is inspect.Parameter.empty else parameter.default
        params.append((name, kinds[name], default))
    return Form(tuple(params), build)


def _options_form(cls, *params: Tuple[str, str]) -> Form:
    """The options form ``method(*names, opts=cls())`` of ``params`` ``(name, kind)``, taken as
    it is (``opts`` None: the defaults)."""
    names = [name for name, _ in params]

    def build(**values) -> tuple:
        return (*(values[name] for name in names), _given(values["opts"], cls))
    return Form(tuple((name, kind, MISSING) for name, kind in params) + (("opts", cls, None),), build)


_SUM = ReduceOp.SUM
_ALLREDUCE, _BROADCAST, _REDUCE = c10d.AllreduceOptions, c10d.BroadcastOptions, c10d.ReduceOptions
_ALLGATHER, _GATHER, _SCATTER = c10d.AllgatherOptions, c10d.GatherOptions, c10d.ScatterOptions
_REDUCE_SCATTER, _ALL_TO_ALL, _BARRIER = c10d.ReduceScatterOptions, c10d.AllToAllOptions, c10d.BarrierOptions

_ALL_GATHER_SINGLE = (_options_form(_ALLGATHER, ("output", "tensor"), ("input", "tensor")),)
_ALL_GATHER_COALESCED = (_options_form(_ALLGATHER, ("outputs", "tensors"), ("inputs", "tensors")),)
_REDUCE_SCATTER_SINGLE = (_options_form(_REDUCE_SCATTER, ("outputTensor", "tensor"), ("inputTensor", "tensor")),)
_REDUCE_SCATTER_COALESCED = (_options_form(_REDUCE_SCATTER, ("outputs", "tensors"), ("inputs", "tensors")),)
_ALL_TO_ALL_SINGLE = (
    _options_form(_ALL_TO_ALL, ("output", "tensor"), ("input", "tensor"), ("output_split_sizes", "ints"),
                  ("input_split_sizes", "ints")),
    _form(lambda output, input, output_split_sizes, input_split_sizes, timeout=None:
          (output, input, output_split_sizes, input_split_sizes, options(_ALL_TO_ALL, timeout)),
          output="tensor", input="tensor", output_split_sizes="ints", input_split_sizes="ints", timeout="timeout"),
)

# Every form of torch's ProcessGroup methods a cupycoll group answers, by method name (the
# names before torch 2.13 and after: see the shell's aliases), in the order torch tries them.
# The same table on every release: the short forms' timeouts, and the timeout forms of
# all_to_all_single and barrier, are torch 2.9's (compat.SHORT_FORMS_TAKE_TIMEOUT), taken here
# on 2.7.1 too, where torch's binding refuses such a call and binds no other form to it.
FORMS: Dict[str, Tuple[Form, ...]] = {
    "allreduce": (
        _options_form(_ALLREDUCE, ("tensors", "tensors")),
        _form(lambda tensors, op=_SUM, timeout=None:
              (tensors, options(_ALLREDUCE, timeout, reduceOp=_reduce_op(op))),
              tensors="tensors", op="op", timeout="timeout"),
        _form(lambda tensor, op=_SUM, timeout=None:
              ([tensor], options(_ALLREDUCE, timeout, reduceOp=_reduce_op(op))),
              tensor="tensor", op="op", timeout="timeout"),
    ),
    "allreduce_coalesced": (_options_form(c10d.AllreduceCoalescedOptions, ("tensors", "tensors")),),
    "broadcast": (
        _options_form(_BROADCAST, ("tensors", "tensors")),
        _form(lambda tensor, root, timeout=None:
              ([tensor], options(_BROADCAST, timeout, rootRank=operator.index(root))),
              tensor="tensor", root="int", timeout="timeout"),
    ),
    "reduce": (
        _options_form(_REDUCE, ("tensors", "tensors")),
        _form(lambda tensor, root, op=_SUM, timeout=None:
              ([tensor], options(_REDUCE, timeout, rootRank=operator.index(root), reduceOp=_reduce_op(op))),
              tensor="tensor", root="int", op="op", timeout="timeout"),
    ),
    "allgather": (
        _options_form(_ALLGATHER, ("output_tensors", "tensor lists"), ("input_tensors", "tensors")),
        _form(lambda output_tensors, input_tensor, timeout=None:
              ([output_tensors], [input_tensor], options(_ALLGATHER, timeout)),
              output_tensors="tensors", input_tensor="tensor", timeout="timeout"),
    ),
    "allgather_coalesced": (
        _options_form(_ALLGATHER, ("output_lists", "tensor lists"), ("input_list", "tensors")),),
    "all_gather_single": _ALL_GATHER_SINGLE,
    "_allgather_base": _ALL_GATHER_SINGLE,
    "all_gather_single_coalesced": _ALL_GATHER_COALESCED,
    "allgather_into_tensor_coalesced": _ALL_GATHER_COALESCED,
    "gather": (
        _options_form(_GATHER, ("output_tensors", "tensor lists"), ("input_tensors", "tensors")),
        _form(lambda output_tensors, input_tensor, root, timeout=None:
              ([output_tensors] if output_tensors else [], [input_tensor],  # a non-root passes none
               options(_GATHER, timeout, rootRank=operator.index(root))),
              output_tensors="tensors", input_tensor="tensor", root="int", timeout="timeout"),
    ),
    "scatter": (
        _options_form(_SCATTER, ("output_tensors", "tensors"), ("input_tensors", "tensor lists")),
        _form(lambda output_tensor, input_tensors, root, timeout=None:
              ([output_tensor], [input_tensors] if input_tensors else [],  # a non-root passes none
               options(_SCATTER, timeout, rootRank=operator.index(root))),
              output_tensor="tensor", input_tensors="tensors", root="int", timeout="timeout"),
    ),
    "reduce_scatter": (
        _options_form(_REDUCE_SCATTER, ("output_tensors", "tensors"), ("input_tensors", "tensor lists")),
        _form(lambda output, input, op=_SUM, timeout=None:
              ([output], [input], options(_REDUCE_SCATTER, timeout, reduceOp=_reduce_op(op))),
              output="tensor", input="tensors", op="op", timeout="timeout"),
    ),
    "reduce_scatter_single": _REDUCE_SCATTER_SINGLE,
    "_reduce_scatter_base": _REDUCE_SCATTER_SINGLE,
    "reduce_scatter_single_coalesced": _REDUCE_SCATTER_COALESCED,
    "reduce_scatter_tensor_coalesced": _REDUCE_SCATTER_COALESCED,
    "alltoall": (_options_form(_ALL_TO_ALL, ("output_tensors", "tensors"), ("input_tensors", "tensors")),),
    "all_to_all_single": _ALL_TO_ALL_SINGLE,
    "alltoall_base": _ALL_TO_ALL_SINGLE,
    # torch requires the tag; cupycoll's default, 0, is what torch.distributed passes.
    "send": (_form(lambda tensors, dstRank, tag=0: (tensors, operator.index(dstRank), operator.index(tag)),
                   tensors="tensors", dstRank="int", tag="int"),),
    "recv": (_form(lambda tensors, srcRank, tag=0: (tensors, operator.index(srcRank), operator.index(tag)),
                   tensors="tensors", srcRank="int", tag="int"),),
    # torch's binding names these arg0 and arg1: positional only there.
    "recv_anysource": (_form(lambda tensors, tag=0: (tensors, operator.index(tag)),
                             tensors="tensors", tag="int"),),
    "barrier": (
        _options_form(_BARRIER),
        _form(lambda timeout=None: (options(_BARRIER, timeout),), timeout="timeout"),
    ),
}


def _bound(form: Form, args: Sequence, named: Dict[str, object]):
    """``form``'s parameters bound to the call, by name, or None when the form does not take it."""
    params = form.params
    if len(args) > len(params):
        return None
    values = {params[i][0]: value for i, value in enumerate(args)}
    for name, value in named.items():
        if name in values or not any(p[0] == name for p in params):
            return None
        values[name] = value
    for name, kind, default in params:
        if name not in values:
            if default is MISSING:
                return None
            values[name] = default
        elif not fits(kind, values[name]):
            return None
    return values


def bind(method: str, leading: Sequence, rest: Sequence, named: Dict[str, object]) -> tuple:
    """The options form's arguments of a call of the shell's ``method``: ``leading``, the values
    of the entry point's own parameters (the options form's, the first of :data:`FORMS`;
    :data:`MISSING` where not passed), then ``rest`` and ``named``, its further positional and
    keyword arguments. Raises CupycollTypeError when no form of :data:`FORMS` takes the call."""
    args = []
    named = dict(named)
    for index, (name, value) in enumerate(zip(FORMS[method][0].names, leading)):
        if value is MISSING:
            continue
        if len(args) == index:  # positional so far (or passed by its own name)
            args.append(value)
        else:
            named[name] = value
    args.extend(rest)
    for form in FORMS[method]:
        values = _bound(form, args, named)
        if values is not None:
            return form.build(**values)
    shown = [_described(a) for a in args] + [f"{k}={_described(v)}" for k, v in named.items()]
    forms = "; ".join(form.describe(method) for form in FORMS[method])
    raise CupycollTypeError(f"{method}({', '.join(shown)}): no form of torch's ProcessGroup.{method} takes "
                            f"these arguments; its forms: {forms}")


def _described(value) -> str:
    """A call's argument in a message: tensors by dtype and shape, the rest by repr (cut)."""
    if isinstance(value, torch.Tensor):
        return f"tensor({str(value.dtype).replace('torch.', '')}, {tuple(value.shape)})"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_described(v) for v in value[:3]) + (", ..." if len(value) > 3 else "")
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
