"""The ring kernels' catalogue: which (dtype, op) pairs exist, and the exact CUDA source,
compiler options and template instantiations each pair compiles to.

Both the runtime (:mod:`cupycoll.ring.algorithm`, through :func:`compile_module`) and the CPU
tests (:func:`cupycoll.kernels.compile_ptx`: NVRTC, no GPU needed) build from
:func:`module_spec`, so the tests compile exactly what runs. The tests' numpy model of the
kernels (tests/ring_simulator.py) reads the same tables, so it computes what the kernels
compute.

dtypes and ops are torch-style lower-case names (``"bfloat16"``, ``"premul_sum"``).
bool is reduced as bytes 0/1 with the byte kernels: SUM and MAX are OR (``max``),
PRODUCT and MIN are AND (``min``), BAND/BOR/BXOR are bitwise on 0/1.

Deliberately left out: reading, inlining and compiling CUDA C++, which every algorithm does
the same way (:mod:`cupycoll.kernels`), CuPy at import time, launching, and any notion of
torch.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Dict, Tuple

from .. import kernels as shared
from ..errors import CupycollValueError

KERNEL_DIR = "cuda"  # the CUDA C++ sources: a data folder of this package
KERNEL_SOURCE = "ring_reduce.cu"

# Compiled with the caller's arch added by CuPy (or by the tests). --fmad=false keeps the
# PREMUL_SUM multiply and the add rounded separately, as the numpy simulator rounds them.
COMPILE_OPTIONS: Tuple[str, ...] = ("--std=c++17", "--fmad=false")

KINDS = ("ring_stage", "ring_reduce", "ring_reduce_final", "ring_final")


@dataclasses.dataclass(frozen=True)
class Element:
    """How one dtype is stored and accumulated."""

    cxx: str  # the element kind in ring_common.cuh
    itemsize: int
    acc_itemsize: int
    storage: str  # numpy dtype name of the stored element (bf16: its bit pattern)
    acc: str  # numpy dtype name of the accumulator
    family: str  # "float", "int" or "bool": which ops apply


ELEMENTS: Dict[str, Element] = {
    "float16": Element("F16", 2, 4, "float16", "float32", "float"),
    "bfloat16": Element("BF16", 2, 4, "uint16", "float32", "float"),
    "float32": Element("F32", 4, 4, "float32", "float32", "float"),
    "float64": Element("F64", 8, 8, "float64", "float64", "float"),
    "int8": Element("I8", 1, 1, "int8", "int8", "int"),
    "uint8": Element("U8", 1, 1, "uint8", "uint8", "int"),
    "int32": Element("I32", 4, 4, "int32", "int32", "int"),
    "int64": Element("I64", 8, 8, "int64", "int64", "int"),
    "bool": Element("U8", 1, 1, "uint8", "uint8", "bool"),
}

OPS = ("sum", "avg", "product", "min", "max", "premul_sum", "band", "bor", "bxor")

# op name -> the C++ op struct, per dtype family. A pair missing here is unsupported.
_OP_STRUCTS: Dict[str, Dict[str, str]] = {
    "float": {"sum": "OpSum", "avg": "OpAvg", "product": "OpProd", "min": "OpMin",
              "max": "OpMax", "premul_sum": "OpPremulSum"},
    "int": {"sum": "OpSum", "avg": "OpAvg", "product": "OpProd", "min": "OpMin",
            "max": "OpMax", "band": "OpBand", "bor": "OpBor", "bxor": "OpBxor"},
    "bool": {"sum": "OpMax", "product": "OpMin", "min": "OpMin", "max": "OpMax",
             "band": "OpBand", "bor": "OpBor", "bxor": "OpBxor"},
}


def supports(dtype: str, op: str) -> bool:
    """Whether the ring kernels can reduce ``dtype`` with ``op`` (names, lower case)."""
    element = ELEMENTS.get(dtype)
    return element is not None and op in _OP_STRUCTS[element.family]


def check(dtype: str, op: str) -> None:
    """Raise :class:`CupycollValueError` naming both unless the pair is supported."""
    if supports(dtype, op):
        return
    if dtype not in ELEMENTS:
        reason = f"dtype {dtype!r} is not one of {', '.join(ELEMENTS)}"
    elif op not in OPS:
        reason = f"op {op!r} is not one of {', '.join(OPS)}"
    else:
        allowed = ", ".join(_OP_STRUCTS[ELEMENTS[dtype].family])
        reason = f"for {dtype} the ring supports {allowed}"
    raise CupycollValueError(
        f"the ring algorithm cannot reduce dtype {dtype} with op {op}: {reason}")


def op_struct(dtype: str, op: str) -> str:
    check(dtype, op)
    return _OP_STRUCTS[ELEMENTS[dtype].family][op]


def stages_first_contribution(dtype: str, op: str) -> bool:
    """Whether a rank's own data must be converted before it can travel: it must when the
    accumulator is wider than the element (fp16/bf16) or PREMUL_SUM scales it; otherwise
    the first send goes straight from the caller's buffer."""
    element = ELEMENTS[dtype]
    return element.acc_itemsize != element.itemsize or op == "premul_sum"


# ----------------------------------------------------------------------------- sources

def source() -> str:
    """ring_reduce.cu with its local headers inlined (:func:`cupycoll.kernels.source`)."""
    return shared.source(__package__, KERNEL_DIR, KERNEL_SOURCE)


def name_expression(kind: str, dtype: str, op: str) -> str:
    return f"cupycoll::{kind}<cupycoll::{ELEMENTS[dtype].cxx}, cupycoll::{op_struct(dtype, op)}>"


@functools.lru_cache(maxsize=None)
def module_spec(dtype: str, op: str) -> shared.ModuleSpec:
    """The source, options and name expressions (in :data:`KINDS` order) of the (dtype, op)
    pair's kernels."""
    check(dtype, op)
    return shared.ModuleSpec(source(), COMPILE_OPTIONS,
                             {kind: name_expression(kind, dtype, op) for kind in KINDS}, KERNEL_SOURCE)


def all_pairs():
    """Every supported (dtype, op), in a stable order."""
    return [(dtype, op) for dtype in ELEMENTS for op in OPS if supports(dtype, op)]


def compile_module(runtime, device: int, dtype: str, op: str) -> Dict[str, object]:
    """kind -> kernel for the pair on ``device`` (current), through ``runtime``
    (:func:`cupycoll.kernels.compile_spec`: once per process and device)."""
    return shared.compile_spec(runtime, device, module_spec(dtype, op))
