"""CPU tier: every ring kernel instantiation compiles with NVRTC, without a GPU.

The tests compile exactly what :mod:`cupycoll.ring.algorithm` compiles at run time (same source,
options and name expressions, from :func:`cupycoll.ring.kernels.module_spec`), to PTX for
compute_80 and compute_90 (:func:`cupycoll.kernels.compile_ptx`). NVRTC needs no driver, so
this runs on any CI machine that has the cuda12 extra installed.
"""

from __future__ import annotations

import fnmatch
import importlib.resources
import re
from pathlib import Path

import pytest

from cupycoll import kernels
from cupycoll.ring import kernels as _kernels
from cupycoll.ring import algorithm as ring
from cupycoll.errors import CupycollValueError


def _nvrtc_available() -> bool:
    try:
        from cupycoll import _cuda

        _cuda.nvrtc_module().getVersion()
        return True
    except Exception:  # noqa: BLE001 - any failure means: cannot compile here
        return False


needs_nvrtc = pytest.mark.skipif(not _nvrtc_available(), reason="NVRTC (cupy + nvidia-cuda-nvrtc) not available")

ARCHS = ("compute_80", "compute_90")


def test_every_documented_pair_is_in_the_catalogue():
    pairs = _kernels.all_pairs()
    assert len(pairs) == len(set(pairs))
    floats = ("float16", "bfloat16", "float32", "float64")
    ints = ("int8", "uint8", "int32", "int64")
    for dtype in floats:
        for op in ("sum", "avg", "product", "min", "max", "premul_sum"):
            assert (dtype, op) in pairs
    for dtype in ints:
        for op in ("sum", "avg", "product", "min", "max", "band", "bor", "bxor"):
            assert (dtype, op) in pairs
    for op in ("sum", "product", "min", "max", "band", "bor", "bxor"):
        assert ("bool", op) in pairs


@needs_nvrtc
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype,op", _kernels.all_pairs())
def test_pair_compiles_to_ptx(dtype, op, arch):
    spec = _kernels.module_spec(dtype, op)
    assert set(spec.names) == set(_kernels.KINDS)
    ptx, lowered = kernels.compile_ptx(spec, arch)
    target = arch.split("_")[1]
    assert re.search(rf"\.target\s+sm_{target}\b", ptx)
    for expression in spec.name_expressions:
        assert f".entry {lowered[expression]}(" in ptx, expression
    # --fmad=false: the premul product and the sum round separately, as the simulator does
    assert "fma.rn.f32" not in ptx and "fma.rn.f64" not in ptx


@needs_nvrtc
def test_wide_accesses_are_generated():
    ptx, lowered = kernels.compile_ptx(_kernels.module_spec("float16", "sum"), "compute_80")
    body = ptx.split(f".entry {lowered[_kernels.name_expression('ring_reduce', 'float16', 'sum')]}(")[1]
    body = body.split(".entry")[0]
    assert "ld.global.v4.f32" in body and "ld.global.v4.u16" in body and "st.global.v4.f32" in body


@needs_nvrtc
def test_compile_errors_carry_the_log():
    spec = kernels.ModuleSpec("this is not C++", _kernels.COMPILE_OPTIONS, {k: "nothing" for k in _kernels.KINDS})
    with pytest.raises(RuntimeError, match="NVRTC failed"):
        kernels.compile_ptx(spec, "compute_80")


@pytest.mark.parametrize("dtype,op", [
    ("float32", "bxor"), ("float16", "band"), ("bfloat16", "bor"), ("float64", "bxor"),
    ("bool", "avg"), ("bool", "premul_sum"), ("int32", "premul_sum"), ("uint8", "premul_sum"),
    ("complex64", "sum"), ("float32", "xor"), ("float8_e4m3fn", "max"),
])
def test_unsupported_pairs_raise_naming_dtype_and_op(dtype, op):
    assert not ring.supports(dtype, op)
    with pytest.raises(CupycollValueError) as info:
        ring.check(dtype, op)
    assert dtype in str(info.value) and op in str(info.value)
    with pytest.raises(CupycollValueError):
        _kernels.module_spec(dtype, op)


def test_supported_pairs_pass_check():
    for dtype, op in _kernels.all_pairs():
        assert ring.supports(dtype, op)
        ring.check(dtype, op)


def test_sources_are_read_from_the_packages_cuda_folder():
    folder = importlib.resources.files("cupycoll.ring").joinpath("cuda")
    names = {entry.name for entry in folder.iterdir()}
    assert {"ring_reduce.cu", "ring_common.cuh"} <= names
    assert folder.joinpath("ring_common.cuh").read_text(encoding="utf-8") in _kernels.source()


def test_every_kernel_source_is_declared_package_data():
    # A source the wheel leaves out compiles in a checkout and fails once installed.
    tomllib = pytest.importorskip("tomllib")
    root = Path(_kernels.__file__).resolve().parent  # cupycoll/ring
    checkout = root.parent.parent
    if not (checkout / "pyproject.toml").is_file():
        pytest.skip("cupycoll is imported from an installation, not from a checkout")
    with open(checkout / "pyproject.toml", "rb") as f:
        globs = tomllib.load(f)["tool"]["setuptools"]["package-data"]["cupycoll.ring"]
    sources = [p.relative_to(root).as_posix() for p in (root / "cuda").iterdir()
               if p.suffix in (".cu", ".cuh")]
    assert sources
    for name in sources:
        assert any(fnmatch.fnmatch(name, glob) for glob in globs), name


def test_source_is_self_contained():
    source = _kernels.source()
    assert '#include "' not in source  # local headers are inlined
    assert "#include <" not in source  # no CUDA/system headers: NVRTC may not find them
    assert "namespace cupycoll" in source and "ring_reduce_final" in source


def test_a_missing_kernel_folder_names_the_incomplete_installation(monkeypatch):
    monkeypatch.setattr(_kernels, "KERNEL_DIR", "no_such_folder")
    with pytest.raises(FileNotFoundError, match=r"cupycoll/ring/no_such_folder/.*incomplete"):
        _kernels.source()


def test_import_cupycoll_ring_does_not_import_cupy():
    import subprocess
    import sys

    code = "import sys, cupycoll.ring.algorithm, cupycoll.ring.schedule; print('cupy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
