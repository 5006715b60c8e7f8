"""cupycoll.nccl.bindings and the declarations they bind (cupycoll.nccl.header) against the
real libnccl and nccl.h of the nvidia-nccl pip package.

No GPU needed: only calls that fail or succeed before NCCL touches a device are made.
The struct layout and the enum values are checked against the installed header by
compiling a small C program with gcc.
"""

from __future__ import annotations

import ast
import ctypes
import os
import re
import shutil
import subprocess
import sys

import pytest

from cupycoll import errors
from cupycoll.nccl import bindings as nb
from cupycoll.nccl import header as nh
from cupycoll.errors import MissingDependencyError, NcclError

PIP_LIBRARY = nb._pip_library()
pytestmark = pytest.mark.skipif(
    PIP_LIBRARY is None, reason="nvidia-nccl-cu12/-cu13 is not installed (no nvidia/nccl/lib/libnccl.so.2)"
)


@pytest.fixture(scope="module")
def lib():
    return nb.load(PIP_LIBRARY)


# ----------------------------------------------------------------- header fixtures


def _include_dir(package: str, header: str):
    if PIP_LIBRARY is None:
        return None
    nvidia = os.path.dirname(os.path.dirname(os.path.dirname(PIP_LIBRARY)))
    directory = os.path.join(nvidia, package, "include")
    return directory if os.path.isfile(os.path.join(directory, header)) else None


def _enum_names(header_text: str, type_name: str) -> list:
    body = re.search(r"typedef enum\s*\{([^{}]*)\}\s*" + type_name + r"\s*;", header_text)
    assert body, f"typedef enum ... {type_name} not found in nccl.h"
    text = re.sub(r"/\*.*?\*/", "", body.group(1), flags=re.S)
    return re.findall(r"\b(nccl\w+)\s*=", text)


ENUMS = ("ncclResult_t", "ncclDataType_t", "ncclRedOp_t", "ncclScalarResidence_t")


@pytest.fixture(scope="module")
def header(tmp_path_factory):
    """Facts from the installed nccl.h: struct fields and offsets, enum values, macros."""
    nccl_inc = _include_dir("nccl", "nccl.h")
    if nccl_inc is None:
        pytest.skip("nccl.h not installed (the nvidia-nccl pip package's include dir)")
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc not found: cannot compile the nccl.h layout probe")
    with open(os.path.join(nccl_inc, "nccl.h")) as f:
        text = f.read()
    struct = re.search(r"typedef struct ncclConfig_v\d+\s*\{(.*?)\}\s*ncclConfig_t\s*;", text, re.S)
    assert struct, "ncclConfig_t definition not found in nccl.h"
    body = re.sub(r"/\*.*?\*/", "", struct.group(1), flags=re.S)
    fields = re.findall(r"(\w+)\s*;", body)
    enums = {name: _enum_names(text, name) for name in ENUMS}

    lines = ['printf("sizeof %zu\\n", sizeof(ncclConfig_t));']
    lines += [f'printf("field {n} %zu\\n", offsetof(ncclConfig_t, {n}));' for n in fields]
    lines += [f'printf("fieldsize {n} %zu\\n", sizeof(((ncclConfig_t*)0)->{n}));' for n in fields]
    lines += [f'printf("enum {n} %d\\n", (int){n});' for names in enums.values() for n in names]
    for macro in ("NCCL_VERSION(2, 30, 0)", "NCCL_VERSION(2, 24, 0)", "NCCL_VERSION_CODE",
                  "NCCL_CONFIG_UNDEF_INT", "NCCL_SPLIT_NOCOLOR"):
        lines.append(f'printf("macro {macro.replace(" ", "")} %lld\\n", (long long)({macro}));')
    # The magic NCCL checks, as NCCL_CONFIG_INITIALIZER sets it: 2.28's header writes the
    # literal there (it has no NCCL_API_MAGIC macro), later headers use the macro.
    lines.append("{ ncclConfig_t initial = NCCL_CONFIG_INITIALIZER;")
    lines.append('printf("initializer magic %lld\\n", (long long)initial.magic); }')
    work = tmp_path_factory.mktemp("ncclh")
    source = work / "probe.c"
    source.write_text(
        "#include <stddef.h>\n#include <stdio.h>\n#include <nccl.h>\n"
        "int main(void) {\n" + "\n".join(lines) + "\nreturn 0;\n}\n"
    )
    exe = work / "probe"
    # nccl.h includes cuda_runtime.h only for two handle types (cudaStream_t, cudaEvent_t),
    # used by neither ncclConfig_t nor the enums; stand-ins keep the probe free of a CUDA
    # toolkit (the runtime wheel's cuda_runtime.h needs crt/*.h, which only nvcc ships).
    stubs = work / "cuda_stubs"
    stubs.mkdir()
    (stubs / "cuda_runtime.h").write_text(
        "#define CUDART_VERSION 12000\n"
        "typedef struct CUstream_st* cudaStream_t;\ntypedef struct CUevent_st* cudaEvent_t;\n"
    )
    (stubs / "cuda_fp16.h").write_text("")
    # NCCL 2.26's nccl.h includes it in C too (later ones in C++ only), and uses no type of it
    (stubs / "cuda_fp8.h").write_text("")
    # as the real cuda_bf16.h does: NCCL before 2.24 declares ncclBfloat16 only then
    (stubs / "cuda_bf16.h").write_text("#define __CUDA_BF16_TYPES_EXIST__\n")
    compiled = subprocess.run([gcc, "-I", nccl_inc, "-I", str(stubs), str(source), "-o", str(exe)],
                              capture_output=True, text=True, timeout=60)
    assert compiled.returncode == 0, compiled.stderr
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True, timeout=30).stdout
    facts = {"fields": {}, "fieldsize": {}, "enum": {}, "macro": {}, "initializer": {}}
    for line in out.splitlines():
        kind, *rest = line.split()
        if kind == "sizeof":
            facts["sizeof"] = int(rest[0])
        else:
            facts["fields" if kind == "field" else kind][rest[0]] = int(rest[1])
    facts["field_order"] = fields
    facts["enum_names"] = enums
    return facts


# -------------------------------------------------------------------------- version


def test_version_matches_cupy(lib):
    nccl = pytest.importorskip("cupy.cuda.nccl")
    if not nccl.available:
        pytest.skip("CuPy was built without NCCL")
    assert lib.version() == nccl.get_version()
    assert lib.version() >= 21800


def test_version_text():
    # one decoder for every version code cupycoll prints (bench metadata, verify-gpu)
    assert nh.version_text(22809) == "2.28.9"
    assert nh.version_text(2708) == "2.7.8"  # NCCL <= 2.8 encoded X*1000 + Y*100 + Z
    assert nh.version_text((2, 28, 9)) == "2.28.9"  # torch.cuda.nccl.version()


def test_version_tuple(lib):
    major, minor, patch = lib.version_tuple()
    assert major == 2 and minor >= 18
    assert lib.version() == major * 10000 + minor * 100 + patch


def test_fp8_supported():
    assert nh.fp8_supported(22400)
    assert nh.fp8_supported(23203)
    assert not nh.fp8_supported(22399)
    assert not nh.fp8_supported(2804)  # 2.8.4, old encoding


def test_fp8_supported_matches_header(header, lib):
    assert header["macro"]["NCCL_VERSION(2,24,0)"] == 22400
    assert nh.fp8_supported(lib.version()) == ("ncclFloat8e4m3" in header["enum"])


# ---------------------------------------------------------------------- the table


def test_every_table_function_resolved(lib):
    for entry in nh.FUNCTIONS:
        if not entry.optional:
            assert callable(getattr(lib, entry.name)), entry.name
            assert lib.has(entry.name)
    # Each optional entry exists from the release its table entry names.
    if lib.version_tuple() >= (2, 18, 1):
        newer = [entry.name for entry in nh.FUNCTIONS if entry.since > lib.version_tuple()]
        assert lib.missing == newer
        assert all(lib.has(entry.name) for entry in nh.FUNCTIONS if entry.name not in newer)
    assert not lib.has("version")  # a helper, not a table function
    assert not lib.has("ncclNoSuchFunction")
    assert len({entry.name for entry in nh.FUNCTIONS}) == len(nh.FUNCTIONS)


def test_missing_required_symbol_is_reported(monkeypatch, lib):
    bogus = nh.Function("ncclNoSuchFunction", nh.ncclResult_t, ())
    monkeypatch.setattr(nb, "FUNCTIONS", nh.FUNCTIONS + (bogus,))
    with pytest.raises(MissingDependencyError, match="ncclNoSuchFunction"):
        nb.NcclLibrary(PIP_LIBRARY)
    monkeypatch.setattr(nb, "FUNCTIONS", nh.FUNCTIONS[:-1] + (bogus._replace(optional=True),))
    partial = nb.NcclLibrary(PIP_LIBRARY)
    assert partial.missing[-1:] == ["ncclNoSuchFunction"]
    assert partial.ncclNoSuchFunction is None and not partial.has("ncclNoSuchFunction")


def test_load_is_cached(lib):
    assert nb.load(PIP_LIBRARY) is lib


# ------------------------------------------------------------------------- errors


def test_error_strings(lib):
    strings = [lib.error_string(status) for status in range(7)]
    assert all(strings), strings
    assert len(set(strings)) == 7, strings


def test_failed_call_raises_nccl_error(lib):
    count = ctypes.c_int(-1)
    with pytest.raises(NcclError) as info:
        lib.ncclCommCount(None, ctypes.byref(count))
    exc = info.value
    assert exc.status == 4 and exc.status_name == "ncclInvalidArgument"
    assert exc.function == "ncclCommCount"
    assert "ncclCommCount" in str(exc)
    assert lib.error_string(4) in str(exc)
    assert count.value == -1
    if lib.has("ncclGetLastError"):
        assert exc.last_error  # NCCL explains which argument was bad

    with pytest.raises(NcclError) as info:
        lib.ncclGetUniqueId(None)
    assert info.value.status == 4 and info.value.function == "ncclGetUniqueId"


def test_success_returns_zero(lib):
    version = ctypes.c_int()
    assert lib.ncclGetVersion(ctypes.byref(version)) == 0
    assert version.value == lib.version()


def test_checked_wrapper_status_handling(lib):
    # Status 7 and 8 cannot be provoked without a GPU: drive the wrapper with fake C functions.
    def fake(status):
        return ctypes.CFUNCTYPE(ctypes.c_int)(lambda: status)

    assert nb._checked(lib, "ncclGroupEnd", fake(7))() == nh.ncclInProgress
    assert nb._checked(lib, "ncclGroupEnd", fake(0))() == 0
    with pytest.raises(NcclError) as info:
        nb._checked(lib, "ncclGroupEnd", fake(8))()
    assert (info.value.status, info.value.status_name, info.value.function) == (8, "ncclTimeout", "ncclGroupEnd")


# --------------------------------------------------------------------- unique ids


def test_unique_id(lib):
    first, second = lib.unique_id(), lib.unique_id()
    assert isinstance(first, bytes) and len(first) == 128 == len(second)
    assert first != second
    uid = lib.unique_id_from_bytes(first)
    assert isinstance(uid, nh.ncclUniqueId)
    assert bytes(uid) == first
    assert ctypes.sizeof(nh.ncclUniqueId) == 128
    with pytest.raises(errors.CupycollValueError):
        lib.unique_id_from_bytes(first[:-1])
    with pytest.raises(errors.CupycollTypeError):
        lib.unique_id_from_bytes(list(first))


# ------------------------------------------------------------- header comparisons


def test_config_layout_matches_header(header):
    ours = [name for name, _ in nh.ncclConfig_t._fields_]
    theirs = header["field_order"]
    # One struct is a prefix of the other, field by field at the same offsets: NCCL copies
    # min(config.size, its own sizeof) bytes, so both sides read the fields they share.
    common = min(len(ours), len(theirs))
    assert common >= 9 and theirs[:common] == ours[:common]  # up to splitShare (2.18)
    for name in ours[:common]:
        assert getattr(nh.ncclConfig_t, name).offset == header["fields"][name], name
        assert getattr(nh.ncclConfig_t, name).size == header["fieldsize"][name], name
    if theirs == ours:
        assert ctypes.sizeof(nh.ncclConfig_t) == header["sizeof"]
    elif len(theirs) > len(ours):  # a newer NCCL
        assert ctypes.sizeof(nh.ncclConfig_t) <= header["sizeof"]
        # A newer field may sit in our tail padding; NCCL_CONFIG_VERSION makes NCCL ignore it.
        assert nh.NCCL_CONFIG_VERSION < header["macro"]["NCCL_VERSION_CODE"]
    else:  # an older NCCL (2.20, 2.28) knows a prefix of our fields and reads only that
        assert header["sizeof"] < ctypes.sizeof(nh.ncclConfig_t)
        assert header["macro"]["NCCL_VERSION_CODE"] < nh.NCCL_CONFIG_VERSION
    assert ctypes.sizeof(nh.ncclConfig_t) == 96  # x86-64, NCCL 2.30.0 layout


def test_config_constants_match_header(header):
    assert nh.NCCL_CONFIG_VERSION == header["macro"]["NCCL_VERSION(2,30,0)"] == 23000
    assert nh.NCCL_API_MAGIC == header["initializer"]["magic"]
    assert nh.NCCL_CONFIG_UNDEF_INT == header["macro"]["NCCL_CONFIG_UNDEF_INT"]
    assert nh.NCCL_SPLIT_NOCOLOR == header["macro"]["NCCL_SPLIT_NOCOLOR"]


OUR_ENUM_NAMES = {
    "ncclDataType_t": ["ncclInt8", "ncclUint8", "ncclInt32", "ncclUint32", "ncclInt64", "ncclUint64",
                       "ncclFloat16", "ncclFloat32", "ncclFloat64", "ncclBfloat16",
                       "ncclFloat8e4m3", "ncclFloat8e5m2"],
    "ncclRedOp_t": ["ncclSum", "ncclProd", "ncclMax", "ncclMin", "ncclAvg"],
    "ncclScalarResidence_t": ["ncclScalarDevice", "ncclScalarHostImmediate"],
    "ncclResult_t": ["ncclSuccess", "ncclInProgress"],
}


def test_enum_constants_match_header(header):
    for enum, names in OUR_ENUM_NAMES.items():
        for name in names:
            if name.startswith("ncclFloat8") and not nh.fp8_supported(header["macro"]["NCCL_VERSION_CODE"]):
                assert name not in header["enum_names"][enum]  # 2.24 added them
                continue
            assert name in header["enum_names"][enum], f"{name} not in the header's {enum}"
            assert getattr(nh, name) == header["enum"][name], name


def test_status_names_match_header(header):
    expected = {header["enum"][n]: n for n in header["enum_names"]["ncclResult_t"] if n != "ncclNumResults"}
    # Every status this header has is named alike; ours may go on with newer ones (2.28's
    # header ends before ncclTimeout), numbered after the header's last.
    assert {k: v for k, v in errors.NCCL_STATUS_NAMES.items() if k in expected} == expected
    assert all(k > max(expected) for k in errors.NCCL_STATUS_NAMES if k not in expected)


def test_make_config():
    for blocking in (False, True):
        config = nh.make_config(blocking)
        assert config.size == ctypes.sizeof(nh.ncclConfig_t) == 96
        assert config.magic == 0xCAFEBEEF
        assert config.version == 23000
        assert config.blocking == int(blocking)
        ints = [name for name, ctype in nh.ncclConfig_t._fields_[3:] if ctype is ctypes.c_int]
        assert len(ints) == 15
        assert all(getattr(config, name) == -(2**31) for name in ints if name != "blocking")
        assert config.netName is None and config.commName is None
    assert nh.make_config(False, split_share=True).splitShare == 1
    assert nh.make_config(False, split_share=False).splitShare == 0
    raw = bytes(nh.make_config(False))
    assert raw[92:96] == b"\0\0\0\0"  # tail padding: where 2.30.5+ puts graphStreamOrdering


# -------------------------------------------------------------------- find_library


def test_find_library_explicit_path_wins(tmp_path):
    link = tmp_path / "libnccl.so.2"
    link.symlink_to(PIP_LIBRARY)
    assert nb.find_library(str(link)) == str(link)


def test_find_library_default_finds_an_nccl():
    found = nb.find_library()
    if os.path.isabs(found):
        assert os.path.basename(found).startswith("libnccl.so")
    assert nb.load().version() >= 21800


def test_find_library_prefers_the_nccl_already_loaded(tmp_path):
    """CuPy loads libnccl first; the bindings must bind that very file, not another copy.
    Here a link in a temporary folder stands for "the library CuPy loaded"."""
    link = tmp_path / "libnccl.so.2"
    link.symlink_to(PIP_LIBRARY)
    code = ("import ctypes, sys; ctypes.CDLL(sys.argv[1]); "
            "from cupycoll.nccl import bindings as nb; print(nb.find_library()); print(nb.load().path); "
            "print(*sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libnccl.so' in l}))")
    out = subprocess.run([sys.executable, "-c", code, str(link)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    found, bound, *mapped = out.stdout.split()
    try:
        import cuda.pathfinder  # noqa: F401 - CuPy 14's loader: names the loaded file
        assert found == bound == str(link)
    except ImportError:  # CuPy 13: the loader's soname, which resolves to the loaded file
        assert found == bound == "libnccl.so.2"
    assert mapped == [os.path.realpath(link)]  # one NCCL in the process: the one loaded first


def test_find_library_uses_cuda_pathfinder(monkeypatch):
    pathfinder = pytest.importorskip("cuda.pathfinder")
    calls = []

    class Loaded:
        abs_path = PIP_LIBRARY

    def fake(name):
        calls.append(name)
        return Loaded()

    monkeypatch.setattr(pathfinder, "load_nvidia_dynamic_lib", fake)
    assert nb.find_library() == PIP_LIBRARY and calls == ["nccl"]


def test_find_library_without_cuda_pathfinder(monkeypatch):
    # CuPy 13 does not depend on cuda-pathfinder: the fallback must still find NCCL.
    monkeypatch.setitem(sys.modules, "cuda.pathfinder", None)
    assert nb._pathfinder_library() is None
    found = nb.find_library()
    assert found in ("libnccl.so.2", PIP_LIBRARY)
    assert nb.NcclLibrary(found).version() >= 21800


def test_find_library_bogus_path(tmp_path):
    bogus = str(tmp_path / "no-such-libnccl.so.2")
    with pytest.raises(MissingDependencyError) as info:
        nb.find_library(bogus)
    message = str(info.value)
    assert "cuda12" in message and "CUPYCOLL_NCCL_LIBRARY" in message and bogus in message
    with pytest.raises(MissingDependencyError, match="cuda12"):
        nb.load(bogus)


def test_missing_nccl_names_the_extra_and_the_checkout_install(tmp_path):
    with pytest.raises(MissingDependencyError) as raised:
        nb.find_library(str(tmp_path / "libnccl.so.2"))  # a path that does not exist
    text = str(raised.value)
    assert "pip install 'cupycoll[cuda12]'" in text and "'cupycoll[cuda13]'" in text
    assert "pip install -e '.[cuda12]'" in text and "-e '.[cuda13]'" in text
    assert "CUPYCOLL_NCCL_LIBRARY" in text


@pytest.mark.parametrize("module", [nb, nh], ids=["bindings", "header"])
def test_module_imports_neither_torch_nor_cupy(module):
    with open(module.__file__) as f:
        tree = ast.parse(f.read())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            imported.add(node.module.split(".")[0])
    assert imported.isdisjoint({"torch", "cupy", "cupy_backends"}), imported
