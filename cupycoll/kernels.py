"""Compiling an algorithm's CUDA C++ into CuPy kernels, the same way for every algorithm.

An algorithm keeps its CUDA C++ in a data folder of its own package (the ring's:
``cupycoll/ring/cuda/``) and describes each module it compiles as a :class:`ModuleSpec`: one
source (:func:`source`, its local headers inlined), the compiler options, and its kernels by
kind, each a C++ name expression. Then:

* :func:`compile_spec` compiles a spec on a device through the group's CUDA runtime
  (:meth:`cupycoll._cuda.Runtime.compile`, a ``cupy.RawModule``: once per process and device;
  CuPy's on-disk kernel cache serves later processes);
* :func:`compile_ptx` compiles it to PTX with NVRTC alone, no GPU and no driver, so that the
  CPU tests compile exactly what runs.

Deliberately left out: which kernels an algorithm has and how it launches them (its own
catalogue, e.g. :mod:`cupycoll.ring.kernels`; :meth:`cupycoll._cuda.Runtime.launch`), and CuPy at
import time (only :func:`compile_ptx` and the runtime import it, when called).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import re
from typing import Dict, Tuple

SUFFIXES = (".cu", ".cuh")  # what counts as CUDA C++ in a kernel folder


@dataclasses.dataclass(frozen=True)
class ModuleSpec:
    """Everything needed to compile one module of kernels: its source, the compiler options
    (the device's arch is added by CuPy, or by :func:`compile_ptx`), ``names`` (kind -> C++
    name expression, in the order they are declared) and the file name NVRTC reports it as."""

    source: str
    options: Tuple[str, ...]
    names: Dict[str, str]
    filename: str = "kernels.cu"

    @property
    def name_expressions(self) -> Tuple[str, ...]:
        return tuple(self.names.values())


def kernel_files(package: str, folder: str) -> Dict[str, str]:
    """name -> text of every .cu/.cuh in ``folder``, a data folder of ``package``.

    Read through importlib.resources: the folder is package data beside the package's
    modules, in a checkout, an editable install and a wheel (zipped or not) alike."""
    root = importlib.resources.files(package).joinpath(folder)
    if not root.is_dir():
        return {}
    return {entry.name: entry.read_text(encoding="utf-8")
            for entry in root.iterdir() if entry.name.endswith(SUFFIXES)}


_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


@functools.lru_cache(maxsize=None)
def source(package: str, folder: str, main: str) -> str:
    """``main`` of ``package``'s kernel ``folder`` with its local ``#include "x.cuh"`` lines
    replaced by the headers' text (each header once): NVRTC then needs no include path,
    which a zipped install could not offer. Read once per process."""
    files = kernel_files(package, folder)
    if main not in files:
        raise FileNotFoundError(
            f"{main} not found in {package.replace('.', '/')}/{folder}/; the installation is incomplete")

    def inline(match, seen=()):
        name = match.group(1)
        if name not in files:
            raise FileNotFoundError(f"{name} (included by {main}) is missing")
        if name in seen:
            return ""
        return _LOCAL_INCLUDE.sub(lambda m: inline(m, seen + (name,)), files[name])

    return _LOCAL_INCLUDE.sub(inline, files[main])


def compile_spec(runtime, device: int, spec: ModuleSpec) -> Dict[str, object]:
    """kind -> kernel of ``spec`` on ``device`` (current), through ``runtime``
    (:class:`cupycoll._cuda.Runtime`, which compiles once per process and device)."""
    return runtime.compile(device, spec.source, spec.options, spec.names)


def compile_ptx(spec: ModuleSpec, arch: str) -> Tuple[str, Dict[str, str]]:
    """Compile ``spec`` to PTX for ``arch`` (``"compute_80"``) with NVRTC alone: no GPU,
    no driver. Returns the PTX and each name expression's mangled name. For the tests."""
    from . import _cuda

    nvrtc = _cuda.nvrtc_module()
    program = nvrtc.createProgram(spec.source, spec.filename, [], [])
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
