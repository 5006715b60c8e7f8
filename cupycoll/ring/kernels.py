"""The ring kernels' catalogue: which (dtype, op) pairs exist, and the exact CUDA source,
compiler options and template instantiations each pair compiles to.

Both the runtime (:mod:`cupycoll.ring.algorithm`, through ``cupy.RawModule``) and the CPU tests
(straight through NVRTC, no GPU needed) build from :func:`module_spec`, so the tests
compile exactly what runs. The tests' numpy model of the kernels (tests/ring_simulator.py)
reads the same tables, so it computes what the kernels compute.

dtypes and ops are torch-style lower-case names (``"bfloat16"``, ``"premul_sum"``).
bool is reduced as bytes 0/1 with the byte kernels: SUM and MAX are OR (``max``),
PRODUCT and MIN are AND (``min``), BAND/BOR/BXOR are bitwise on 0/1.

Deliberately left out: CuPy at import time (only :func:`compile_ptx` imports it, lazily;
:func:`compile_module` compiles through the group's CUDA runtime), launching, and any notion
of torch.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import re
from typing import Dict, Tuple

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

def _kernel_dir_files() -> Dict[str, str]:
    """name -> text of every .cu/.cuh in the package's cuda/ folder.

    One place, read through importlib.resources: the folder is package data beside this
    module, in a checkout, an editable install and a wheel (zipped or not) alike."""
    root = importlib.resources.files(__package__).joinpath(KERNEL_DIR)
    if not root.is_dir():
        return {}
    return {entry.name: entry.read_text(encoding="utf-8")
            for entry in root.iterdir() if entry.name.endswith((".cu", ".cuh"))}


_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


@functools.lru_cache(maxsize=None)
def source() -> str:
    """ring_reduce.cu with its local ``#include "x.cuh"`` lines replaced by the headers'
    text: NVRTC then needs no include path, which a zipped install could not offer."""
    files = _kernel_dir_files()
    if KERNEL_SOURCE not in files:
        raise FileNotFoundError(
            f"{KERNEL_SOURCE} not found in {__package__.replace('.', '/')}/{KERNEL_DIR}/; the installation is "
            "incomplete")

    def inline(match, seen=()):
        name = match.group(1)
        if name not in files:
            raise FileNotFoundError(f"{name} (included by the ring kernels) is missing")
        if name in seen:
            return ""
        return _LOCAL_INCLUDE.sub(lambda m: inline(m, seen + (name,)), files[name])

    return _LOCAL_INCLUDE.sub(inline, files[KERNEL_SOURCE])


@dataclasses.dataclass(frozen=True)
class ModuleSpec:
    """Everything needed to compile one (dtype, op) pair's kernels."""

    source: str
    options: Tuple[str, ...]
    names: Dict[str, str]  # kind -> template name expression

    @property
    def name_expressions(self) -> Tuple[str, ...]:
        return tuple(self.names[kind] for kind in KINDS)


def name_expression(kind: str, dtype: str, op: str) -> str:
    return f"cupycoll::{kind}<cupycoll::{ELEMENTS[dtype].cxx}, cupycoll::{op_struct(dtype, op)}>"


@functools.lru_cache(maxsize=None)
def module_spec(dtype: str, op: str) -> ModuleSpec:
    """The source, options and name expressions of the (dtype, op) pair's kernels."""
    check(dtype, op)
    return ModuleSpec(source(), COMPILE_OPTIONS,
                      {kind: name_expression(kind, dtype, op) for kind in KINDS})


def all_pairs():
    """Every supported (dtype, op), in a stable order."""
    return [(dtype, op) for dtype in ELEMENTS for op in OPS if supports(dtype, op)]


# ----------------------------------------------------------------------------- compiling

def compile_module(runtime, device: int, dtype: str, op: str) -> Dict[str, object]:
    """kind -> kernel for the pair on ``device`` (current), through ``runtime``
    (:class:`cupycoll._cuda.Runtime`, which compiles once per process and device; CuPy's
    on-disk kernel cache serves later processes)."""
    spec = module_spec(dtype, op)
    return runtime.compile(device, spec.source, spec.options, spec.names)


def compile_ptx(spec: ModuleSpec, arch: str) -> Tuple[str, Dict[str, str]]:
    """Compile ``spec`` to PTX for ``arch`` (``"compute_80"``) with NVRTC alone: no GPU,
    no driver. Returns the PTX and each name expression's mangled name. For the tests."""
    from .. import _cuda

    nvrtc = _cuda.nvrtc_module()
    program = nvrtc.createProgram(spec.source, KERNEL_SOURCE, [], [])
    try:
        for expression in spec.name_expressions:
            nvrtc.addNameExpression(program, expression)
        # CuPy adds --device-as-default-execution-space to every NVRTC compile; match it.
        options = [*spec.options, f"--gpu-architecture={arch}",
                   "--device-as-default-execution-space"]
        try:
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(program)
            raise RuntimeError(f"NVRTC failed for {arch}: {exc}\n{log}") from exc
        lowered = {e: nvrtc.getLoweredName(program, e) for e in spec.name_expressions}
        ptx = nvrtc.getPTX(program)
        return (ptx.decode() if isinstance(ptx, bytes) else ptx), lowered
    finally:
        nvrtc.destroyProgram(program)
