"""torch's own call forms of its ProcessGroup methods, read from the installed torch.

pybind writes every overload of a bound method into its docstring, one numbered line each
(``1. allreduce(self: ..., tensors: collections.abc.Sequence[torch.Tensor], opts: ... =
<...>) -> c10d::Work``), or, for a method with one form, that line alone. :func:`forms` reads
them, so a test that walks them meets a form a later torch adds without being told of it.
A parameter's type is reduced to a kind (:func:`kind`), whatever spelling the release's
pybind uses (``collections.abc.Sequence[torch.Tensor]``, ``List[torch.Tensor]``).

Left out: what a form does (the tests call it and compare with gloo's answer).
"""

from __future__ import annotations

import re
from typing import List, NamedTuple, Optional, Tuple

from torch._C import _distributed_c10d as c10d


class Param(NamedTuple):
    name: str
    kind: str  # see kind()
    has_default: bool

    @property
    def positional_only(self) -> bool:
        """pybind names the parameters it was given no name for arg0, arg1...: no keywords."""
        return re.fullmatch(r"arg\d+", self.name) is not None


class TorchForm(NamedTuple):
    method: str
    params: Tuple[Param, ...]

    @property
    def names(self) -> Tuple[str, ...]:
        return tuple(p.name for p in self.params)

    def __str__(self) -> str:
        return f"{self.method}({', '.join(p.name + ('=...' if p.has_default else '') for p in self.params)})"


def _split_top(text: str) -> List[str]:
    """``text`` split at the commas outside brackets and ``<...>`` default reprs."""
    parts, depth, current = [], 0, ""
    for char in text:
        if char in "[(<":
            depth += 1
        elif char in "])>":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += char
    if current.strip():
        parts.append(current.strip())
    return parts


def kind(annotation: str) -> str:
    """A parameter's kind from pybind's type text: ``tensor``, ``tensors``, ``tensor lists``,
    ``op``, ``int``, ``ints``, ``timeout``, an options class's name, or ``unknown: TEXT``."""
    text = re.sub(r"\b(?:collections\.abc|typing|torch\._C\._distributed_c10d|torch|datetime)\.", "", annotation)
    text = text.replace(" ", "")
    sequence = r"(?:Sequence|List|list)"
    integer = r"(?:int|SupportsInt\|SupportsIndex|SupportsInt|SupportsIndex)"
    if text == "Tensor":
        return "tensor"
    if re.fullmatch(rf"{sequence}\[Tensor\]", text):
        return "tensors"
    if re.fullmatch(rf"{sequence}\[{sequence}\[Tensor\]\]", text):
        return "tensor lists"
    if text in ("ReduceOp", "ReduceOp.RedOpType"):
        return "op"
    if re.fullmatch(integer, text):
        return "int"
    if re.fullmatch(rf"{sequence}\[{integer}\]", text):
        return "ints"
    if re.fullmatch(r"(?:timedelta\|None|Optional\[timedelta\]|timedelta)", text):
        return "timeout"
    if text.endswith("Options") and hasattr(c10d, text):
        return text
    return f"unknown: {annotation}"


def _form(method: str, line: str) -> Optional[TorchForm]:
    match = re.match(rf"(?:\d+\.\s+)?{re.escape(method)}\((.*)\)\s*->", line.strip())
    if not match:
        return None
    params = []
    for part in _split_top(match.group(1)):
        name, _, rest = part.partition(":")
        name = name.strip()
        if name == "self":
            continue
        annotation, has_default, _ = rest.partition(" = ")
        params.append(Param(name, kind(annotation.strip()), bool(has_default)))
    return TorchForm(method, tuple(params))


def overloads(method: str, cls=c10d.ProcessGroup) -> int:
    """How many forms pybind says ``cls.method`` has, counted apart from :func:`forms`' reading
    of them: its numbered lines after "Overloaded function.", or 1 for a lone signature; 0
    where the release has no such method."""
    function = getattr(cls, method, None)
    if function is None:
        return 0
    doc = function.__doc__ or ""
    if "Overloaded function." not in doc:
        return 1
    return len(re.findall(r"^\d+\. ", doc, flags=re.MULTILINE))


def forms(method: str, cls=c10d.ProcessGroup) -> List[TorchForm]:
    """Every form of ``cls.method`` the installed torch binds, in its order; [] where the
    release has no such method."""
    function = getattr(cls, method, None)
    if function is None or not function.__doc__:
        return []
    found = [_form(method, line) for line in function.__doc__.splitlines()]
    return [f for f in found if f is not None]
