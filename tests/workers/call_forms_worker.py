"""One rank of the call-forms suite: every form torch binds for a ProcessGroup method, on the
cupycoll group and on a plain gloo group of the same ranks, compared.

The forms are read from the installed torch (tests/torch_forms.py: pybind's docstrings), so a
form a later torch adds is called here too. Each is called in every way Python allows it:
all arguments positional, all by keyword (not where torch names them arg0, arg1...), the
defaults left out, the first positional and the rest by keyword; on both groups with the same
fresh inputs. Then each call's Work is waited on and asked for its future. A case agrees when
both raised (a TypeError on torch's side is a CupycollTypeError on cupycoll's), or neither
did and the outputs and the futures' values are equal; where gloo's Work has no future,
cupycoll's must hold the outputs. Bad forms (an extra argument, an unknown keyword, a str
where a tensor goes) must raise a TypeError on both, after which the group still answers an
all_reduce as gloo does. In the ProcessGroup shape cupycoll binds the forms itself and its
TypeError is a CupycollTypeError; in the Backend shape torch's own ProcessGroup binds them.

Usage: call_forms_worker.py --out DIR (the group's shape from CUPYCOLL_SHAPE)
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

import cupycoll
from cupycoll import call_forms, compat
from cupycoll.shell import GroupShell

try:  # run as a script (tests/ and tests/workers on sys.path)
    from epilogue import write_json
except ImportError:
    from workers.epilogue import write_json
from torch_forms import forms

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
R = c10d.ReduceOp
TIMEOUT = datetime.timedelta(seconds=60)
ROOT = 1  # every root a case names: not the default, so a root that is lost shows
STYLES = ("positional", "keyword", "defaults", "mixed")
POINT_TO_POINT = ("send", "recv", "recv_anysource")


def value(rank: int, salt: int = 0) -> torch.Tensor:
    """Distinct per rank and salt; small integers, so products and sums are exact."""
    return (torch.arange(4, dtype=torch.float32) + 1) * (rank + 2) + salt


def empty(n: int = 4) -> torch.Tensor:
    return torch.full((n,), -1.0)


def tensor_args(method: str, names, rank: int, root: int):
    """(the tensor arguments of a call of ``method`` by parameter name, the tensors whose
    contents the call decides)."""
    v = lambda salt=0: value(rank, salt)  # noqa: E731
    every = lambda salt=0: [v(salt + i) for i in range(WORLD)]  # noqa: E731
    if method in ("allreduce", "broadcast", "reduce"):
        t = v()
        return ({"tensor": t} if "tensor" in names else {"tensors": [t]}), [t]
    if method == "allreduce_coalesced":
        ts = [v(), v(1)]
        return {"tensors": ts}, ts
    if method == "allgather":
        outs = [empty() for _ in range(WORLD)]
        if "input_tensor" in names:
            return {"output_tensors": outs, "input_tensor": v()}, outs
        return {"output_tensors": [outs], "input_tensors": [v()]}, outs
    if method == "allgather_coalesced":
        outs = [[empty() for _ in range(WORLD)] for _ in range(2)]
        return {"output_lists": outs, "input_list": [v(), v(1)]}, [t for o in outs for t in o]
    if method in ("all_gather_single", "_allgather_base"):
        out = empty(4 * WORLD)
        return {"output": out, "input": v()}, [out]
    if method in ("all_gather_single_coalesced", "allgather_into_tensor_coalesced"):
        outs = [empty(4 * WORLD), empty(4 * WORLD)]
        return {"outputs": outs, "inputs": [v(), v(1)]}, outs
    if method == "gather":
        outs = [empty() for _ in range(WORLD)] if rank == root else []
        if "input_tensor" in names:
            return {"output_tensors": outs, "input_tensor": v()}, outs
        return {"output_tensors": [outs] if outs else [], "input_tensors": [v()]}, outs
    if method == "scatter":
        out, ins = empty(), every() if rank == root else []
        if "output_tensor" in names:
            return {"output_tensor": out, "input_tensors": ins}, [out]
        return {"output_tensors": [out], "input_tensors": [ins] if ins else []}, [out]
    if method == "reduce_scatter":
        out = empty()
        if "output" in names:
            return {"output": out, "input": every()}, [out]
        return {"output_tensors": [out], "input_tensors": [every()]}, [out]
    if method in ("reduce_scatter_single", "_reduce_scatter_base"):
        out = empty()
        return {"outputTensor": out, "inputTensor": torch.cat(every())}, [out]
    if method in ("reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced"):
        outs = [empty(), empty()]
        return {"outputs": outs, "inputs": [torch.cat(every()), torch.cat(every(5))]}, outs
    if method == "alltoall":
        outs = [empty() for _ in range(WORLD)]
        return {"output_tensors": outs, "input_tensors": every()}, outs
    if method in ("all_to_all_single", "alltoall_base"):
        out = empty(4 * WORLD)
        return {"output": out, "input": torch.cat(every()), "output_split_sizes": [4] * WORLD,
                "input_split_sizes": [4] * WORLD}, [out]
    if method == "barrier":
        return {}, []
    raise AssertionError(f"no inputs for {method}: teach this worker (and cupycoll.call_forms) its form")


def other_args(param, style: str):
    """The value of a non-tensor parameter: ops differ by style (a bare RedOpType, a ReduceOp)."""
    if param.kind == "op":
        return {"positional": R.MAX, "keyword": R(R.MIN), "mixed": R.PRODUCT}[style]
    if param.kind == "timeout":
        return TIMEOUT if style != "keyword" else TIMEOUT.total_seconds()  # pybind takes float seconds
    if param.kind == "int" and param.name == "root":
        return ROOT
    if param.kind.endswith("Options"):
        opts = getattr(c10d, param.kind)()
        for field, wanted in (("reduceOp", R.MAX), ("rootRank", ROOT), ("timeout", TIMEOUT)):
            if hasattr(opts, field):
                setattr(opts, field, wanted)
        return opts
    raise AssertionError(f"no value for {param}: teach this worker its kind")


def call_plan(form, style: str):
    """(the parameters passed, how: 'args' or 'kwargs' per parameter) or None where the style
    does not apply to the form (or repeats another)."""
    params = list(form.params)
    positional_only = any(p.positional_only for p in params)
    if style == "keyword" and (positional_only or not params):
        return None
    if style == "defaults":
        if not any(p.has_default for p in params):
            return None
        params = [p for p in params if not p.has_default]
    if style == "mixed" and (positional_only or len(params) < 2):
        return None
    how = {"positional": "args", "keyword": "kwargs", "defaults": "args"}.get(style)
    return params, [how or ("args" if i == 0 else "kwargs") for i in range(len(params))]


def build(method: str, form, style: str):
    """(args, kwargs, outputs) of one case on this rank, fresh tensors each time."""
    params, hows = call_plan(form, style)
    names = [p.name for p in params]
    passes_root = "root" in names or any(p.kind in ("GatherOptions", "ScatterOptions", "ReduceOptions",
                                                      "BroadcastOptions") for p in params)
    tensors, outputs = tensor_args(method, form.names, RANK, ROOT if passes_root else 0)
    args, kwargs = [], {}
    for param, how in zip(params, hows):
        given = tensors[param.name] if param.name in tensors else other_args(param, style)
        if how == "args":
            args.append(given)
        else:
            kwargs[param.name] = given
    return args, kwargs, outputs


def flat(value):
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for v in (value or []) for t in flat(v)]


class Disagreed(Exception):
    """A call raised on some ranks only: the others' calls are under way, and the group's
    later calls would pair with them, so the suite stops here."""


def agreed(control, raised: bool) -> bool:
    """Did the call raise on every rank or on none? (Asked on ``control``, a group of its own.)"""
    flag = torch.tensor([1.0 if raised else 0.0])
    control.allreduce([flag]).wait()
    return flag.item() in (0.0, float(WORLD))


def described(exc: BaseException) -> dict:
    return {"raised": type(exc).__name__, "type_error": isinstance(exc, TypeError),
            "typed": isinstance(exc, cupycoll.CupycollError), "message": str(exc).splitlines()[0][:300]}


def run(group, method: str, args, kwargs, outputs, control, alone: bool = False,
        may_disagree: bool = False) -> dict:
    """Call ``method`` on ``group``; its outputs and future, or what it raised. ``alone``: the
    call involves no other rank (it raises before it reaches one), so no agreement is asked;
    ``may_disagree``: a call that raised on some ranks only is an answer (the others' calls
    are left under way, and the group with them), not the end of the suite."""
    try:
        work = getattr(group, method)(*args, **kwargs)
        error = None
    except Exception as exc:  # noqa: BLE001 - compared with the other group's
        work, error = None, described(exc)
    if not alone and not agreed(control, error is not None):
        if may_disagree:
            return {"raised": "on some ranks only", "disagreed": True, "type_error": False, "typed": False,
                    "message": (error or {}).get("message", "")}
        raise Disagreed(f"{method}: raised on some ranks only ({error})")
    if error is not None:
        return error
    try:
        work.wait()
    except Exception as exc:  # noqa: BLE001 - compared with the other group's
        return described(exc)
    try:
        future = [t.clone() for t in flat(work.get_future().wait())]
    except Exception as exc:  # noqa: BLE001 - gloo's reduce-scatters give none
        future = f"no future: {str(exc).splitlines()[0][:200]}"
    return {"outputs": [t.clone() for t in outputs], "future": future}


def gloo_gap(method: str, style: str, form, theirs: dict) -> bool:
    """A case gloo gets wrong or refuses on this torch and cupycoll's CPU route does right
    (cupycoll.compat names each)."""
    if not compat.GLOO_HAS_ALLTOALL and method == "alltoall":
        return "does not support alltoall" in theirs.get("message", "")
    if not compat.GLOO_HAS_REDUCE_SCATTER and method == "reduce_scatter":
        return "does not support reduce_scatter" in theirs.get("message", "")
    ops = [p for p in form.params if p.kind in ("op", "ReduceScatterOptions")]
    if not compat.GLOO_REDUCE_SCATTER_HONOURS_OP and method in ("reduce_scatter_single", "_reduce_scatter_base"):
        return bool(ops) and style != "defaults"  # gloo sums whatever the op
    return False


def case_op(args, kwargs):
    """The reduction op a case passes, bare or in its options object; SUM where it passes none."""
    for given in [*args, *kwargs.values()]:
        if isinstance(given, (R, R.RedOpType)):
            return given
        if hasattr(given, "reduceOp"):
            return given.reduceOp
    return R.SUM


def filled(method: str, args, kwargs):
    """What a case of a gloo_gap must leave in its outputs on this rank, from every rank's
    inputs (tensor_args: rank q's i-th input is value(q, i)); None where none is known."""
    if method == "alltoall":
        return [value(peer, RANK) for peer in range(WORLD)]
    if method in ("reduce_scatter", "reduce_scatter_single", "_reduce_scatter_base"):
        op = case_op(args, kwargs)
        fold = next(f for o, f in ((R.SUM, torch.add), (R.MAX, torch.maximum), (R.MIN, torch.minimum),
                                   (R.PRODUCT, torch.mul)) if op == o)
        result = value(0, RANK)
        for peer in range(1, WORLD):
            result = fold(result, value(peer, RANK))
        return [result]
    return None


def rooted_short_form(method: str, form) -> bool:
    """gather's and scatter's short forms: a torch whose binding hands gloo a non-root's empty
    list as one list (torch 2.13's binding passes none) has gloo refuse it on the non-roots
    alone, while the root's call is under way; cupycoll binds the form as torch 2.13 does."""
    return method in ("gather", "scatter") and "root" in form.names


def same(ours: list, theirs: list) -> bool:
    return len(ours) == len(theirs) and all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(ours, theirs))


def compare(case: str, ours: dict, theirs: dict, gap: bool, binds: bool, reference=None):
    """What differs, or None (``binds``: cupycoll binds the forms, its TypeErrors are typed;
    ``reference``: what a gap's outputs must be, see filled)."""
    if gap and reference is not None:  # gloo refuses or gets it wrong here: cupycoll must not
        if "raised" in ours:
            return f"{case}: cupycoll {ours['raised']} where gloo falls short: {ours['message']}"
        if not same(ours["outputs"], reference):
            return f"{case}: outputs differ from what every rank's inputs give: {ours['outputs']} != {reference}"
        if isinstance(ours["future"], str) or not same(ours["future"], ours["outputs"]):
            return f"{case}: cupycoll's future is not its outputs: {ours['future']}"
        return None
    if "raised" in theirs and (gap or theirs.get("disagreed")) and "raised" not in ours:
        return None  # see gloo_gap and rooted_short_form
    if "raised" in ours or "raised" in theirs:
        if "raised" not in ours or "raised" not in theirs:
            return f"{case}: cupycoll {ours.get('raised', 'succeeded')}, gloo {theirs.get('raised', 'succeeded')}: " \
                   f"{ours.get('message') or theirs.get('message')}"
        if theirs["type_error"] and not (ours["type_error"] and (ours["typed"] or not binds)):
            return f"{case}: gloo raised TypeError, cupycoll {ours['raised']}: {ours['message']}"
        return None
    if gap:
        return None
    if not same(ours["outputs"], theirs["outputs"]):
        return f"{case}: outputs differ: {ours['outputs']} != {theirs['outputs']}"
    if isinstance(ours["future"], str):
        return f"{case}: cupycoll's Work has {ours['future']}"
    expected = theirs["future"] if not isinstance(theirs["future"], str) else ours["outputs"]
    if not same(ours["future"], expected):
        return f"{case}: futures differ: {ours['future']} != {expected}"
    return None


def point_to_point(group, method: str, form, style: str, control):
    """A send, recv or recv_anysource case between ranks 0 and 1: the form under test on its
    side, the plain options-form call on the other, made once the form's call was made (it
    is skipped where that raised). Returns run()'s answer (on the receiving side, the
    received tensor)."""
    params, hows = call_plan(form, style)
    sender = method == "send"
    mine = (RANK == 0) == sender  # the rank whose call is the form under test
    t = value(0, 7) if RANK == 0 else torch.zeros(4)
    if not mine:
        if not agreed(control, False):  # the form's call raised: nothing to pair with
            return {"raised": "the peer's call raised"}
        work = group.send([t], 1, 3) if RANK == 0 else group.recv([t], 0, 3)
        work.wait()
        return {"outputs": [t.clone()], "future": []}
    values = {"tensors": [t], "arg0": [t], "dstRank": 1, "srcRank": 0, "tag": 3, "arg1": 3}
    args = [values[p.name] for p, how in zip(params, hows) if how == "args"]
    kwargs = {p.name: values[p.name] for p, how in zip(params, hows) if how == "kwargs"}
    try:
        work = getattr(group, method)(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - compared with the other group's
        agreed(control, True)
        return described(exc)
    agreed(control, False)
    work.wait()
    return {"outputs": [t.clone()], "future": []}  # gloo's send and recv Works have no future


def bad_forms(method: str, form) -> list:
    """(name, args, kwargs) of calls no form takes, for the positional call of ``form``."""
    if method in POINT_TO_POINT:
        return []
    args, kwargs, _ = build(method, form, "positional")
    cases = [("an extra argument", args + [object()], kwargs)]
    if not any(p.positional_only for p in form.params):
        cases.append(("an unknown keyword", args, {**kwargs, "bogus": 1}))
    if args and form.params[0].kind.startswith("tensor"):
        cases.append(("a str for a tensor", ["x"] + args[1:], kwargs))
    return cases


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = parser.parse_args().out
    dist.init_process_group("cupycoll", rank=RANK, world_size=WORLD, timeout=TIMEOUT)
    ours = dist.group.WORLD
    gloo = dist.new_group(backend="gloo", timeout=TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=TIMEOUT)
    cases, differences, seen_forms = 0, [], []
    try:
        cases = suite(ours, gloo, control, differences, seen_forms)
    except Disagreed as exc:
        differences.append(str(exc))
    write(out, cases, differences, seen_forms, ours)
    # Freeing the plain gloo group can hang this torch (workers/epilogue.py); after a
    # difference a call may still be pending.
    if not compat.PROCESS_GROUP_FREED_WITHOUT_GIL or differences:
        os._exit(0)
    dist.destroy_process_group()
    return 0


def suite(ours, gloo, control, differences: list, seen_forms: list) -> int:
    """Every case; the number run."""
    cases, binds = 0, isinstance(ours, GroupShell)
    for method in [m for m in sorted(call_forms.FORMS) if forms(m)]:
        for form in forms(method):
            seen_forms.append(str(form))
            for style in STYLES:
                if call_plan(form, style) is None:
                    continue
                case = f"{form} {style}"
                if method in POINT_TO_POINT:
                    reference = None
                    mine = point_to_point(ours, method, form, style, control)
                    theirs = point_to_point(gloo, method, form, style, control)
                else:
                    a, k, o = build(method, form, style)
                    reference = filled(method, a, k)
                    mine = run(ours, method, a, k, o, control)
                    a, k, o = build(method, form, style)
                    theirs = run(gloo, method, a, k, o, control,
                                 may_disagree=rooted_short_form(method, form))
                    if theirs.get("disagreed"):  # the root's call is left under way: a new gloo group
                        gloo = dist.new_group(backend="gloo", timeout=TIMEOUT)
                cases += 1
                difference = compare(case, mine, theirs, gloo_gap(method, style, form, theirs), binds, reference)
                if difference:
                    differences.append(difference)
            for what, args, kwargs in bad_forms(method, form):
                case = f"{form} with {what}"
                mine = run(ours, method, args, kwargs, [], control, alone=True)
                theirs = run(gloo, method, args, kwargs, [], control, alone=True)
                cases += 1
                if not (mine.get("type_error") and (mine.get("typed") or not binds) and theirs.get("type_error")):
                    differences.append(f"{case}: cupycoll {mine.get('raised', 'succeeded')} "
                                       f"({mine.get('message')}), gloo {theirs.get('raised', 'succeeded')}")
    # after every bad form the group still answers as gloo does
    x, y = value(RANK), value(RANK)
    ours.allreduce([x]).wait()
    gloo.allreduce([y]).wait()
    if not torch.equal(x, y):
        differences.append(f"all_reduce after the bad forms: {x} != {y}")
    return cases


def write(out: str, cases: int, differences: list, seen_forms: list, ours) -> None:
    os.makedirs(out, exist_ok=True)
    write_json(out, f"rank{RANK}.json", {"cases": cases, "differences": differences, "forms": seen_forms,
                                         "group_type": type(ours).__name__})
    print(f"rank {RANK}: {cases} cases, {len(differences)} differences")
    for difference in differences[:40]:
        print("DIFFERS", difference, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()


if __name__ == "__main__":
    sys.exit(main())
