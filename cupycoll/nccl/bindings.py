"""Raw ctypes bindings to ``libnccl.so.2``: the library found, loaded once per file, and every
function of :data:`cupycoll.nccl.header.FUNCTIONS` bound to it.

CuPy's ``cupy.cuda.nccl`` cannot make a nonblocking communicator, finalize one, shrink one,
create PreMulSum reduction ops or read ``ncclGetLastError``, and it declares abort and
destroy ``void``; so cupycoll creates and drives every ``ncclComm_t`` through these bindings
(CuPy keeps streams, memory and kernels). Every function that returns ``ncclResult_t`` is
wrapped: ``ncclSuccess`` (0) and ``ncclInProgress`` (7, a nonblocking communicator is still
working: poll ``ncclCommGetAsyncError``) are returned, any other status raises
:class:`cupycoll.errors.NcclError`.

The library is looked up so that one NCCL serves CuPy, torch and these bindings: an
explicit path (``CUPYCOLL_NCCL_LIBRARY``), else what ``cuda-pathfinder`` (a CuPy 14
dependency) gives, which is the ``libnccl.so.2`` already loaded (CuPy's) when there is one;
without cuda-pathfinder (CuPy 13), the already loaded library, the ``nvidia-nccl-cu1x`` pip
package, then the dynamic loader.

Deliberately left out: NCCL's declarations (types, constants, the prototypes:
:mod:`cupycoll.nccl.header`), anything that needs CuPy or torch (this module imports neither;
the error classes derive from torch's when torch is present), buffer/stream/dtype
conversion, NCCL functions CuPy already binds well and cupycoll does not call through ctypes
(``ncclCommInitAll``, ``ncclBcast``), and newer APIs cupycoll does not use (windows,
``ncclMemAlloc``, one-sided operations, revoke and grow).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
from typing import Optional

from ..errors import CupycollTypeError, CupycollValueError, MissingDependencyError, NcclError
from .header import (FUNCTIONS, NCCL_UNIQUE_ID_BYTES, ncclInProgress, ncclResult_t, ncclSuccess, ncclUniqueId,
                     split_version)

# ------------------------------------------------------------------ library location

_INSTALL_HINT = (
    "install NCCL with pip install 'cupycoll[cuda12]' (or 'cupycoll[cuda13]'; from a "
    "checkout: pip install -e '.[cuda12]' or -e '.[cuda13]'), "
    "or set CUPYCOLL_NCCL_LIBRARY to the path of libnccl.so.2"
)


def _pathfinder_library() -> Optional[str]:
    """cuda-pathfinder's libnccl: the ``libnccl.so.2`` already loaded (CuPy >= 14 loads NCCL
    through it, cached, so both get one file), else the first found in site-packages, conda
    or the system. None without cuda-pathfinder (CuPy 13 does not need it) or a match."""
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib
    except ImportError:
        return None
    try:
        return load_nvidia_dynamic_lib("nccl").abs_path
    except Exception:  # noqa: BLE001 - not found, or an older catalog without "nccl"
        return None


def _loaded_library() -> Optional[str]:
    """``libnccl.so.2`` if the process has it already; the loader matches it by soname."""
    try:
        ctypes.CDLL("libnccl.so.2", mode=os.RTLD_NOLOAD)
    except OSError:
        return None
    return "libnccl.so.2"


def _pip_library() -> Optional[str]:
    """``nvidia/nccl/lib/libnccl.so.2`` from the nvidia-nccl-cu12/-cu13 package, if installed."""
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(location, "lib", "libnccl.so.2")
        if os.path.isfile(path):
            return path
    return None


def find_library(path: Optional[str] = None) -> str:
    """The first NCCL library that loads: ``path`` (``CUPYCOLL_NCCL_LIBRARY``), cuda-pathfinder's,
    the loaded ``libnccl.so.2``, the pip package's file, the loader's ``libnccl.so.2``.
    An explicit ``path`` that does not load is an error, not a reason to look elsewhere."""
    if path:
        candidates = [path]
    else:
        candidates = [c for c in (_pathfinder_library(), _loaded_library(), _pip_library()) if c]
        candidates = list(dict.fromkeys(candidates + ["libnccl.so.2"]))
    failures = []
    for candidate in candidates:
        try:
            ctypes.CDLL(candidate)
        except OSError as exc:
            failures.append(f"{candidate}: {exc}")
            continue
        return candidate
    raise MissingDependencyError(f"cannot load NCCL ({'; '.join(failures)}); {_INSTALL_HINT}")


# ------------------------------------------------------------------------- library


def _checked(library: "NcclLibrary", name: str, function):
    """Wrap a ctypes function returning ncclResult_t: return 0 or 7, raise on anything else."""

    def call(*args):
        status = function(*args)
        if status in (ncclSuccess, ncclInProgress):
            return status
        raise library.failure(name, status)

    call.__name__ = call.__qualname__ = name
    return call


class NcclLibrary:
    """One loaded libnccl. Each :data:`~cupycoll.nccl.header.FUNCTIONS` entry is an attribute
    of the same C name (``None`` when an optional one is missing; its name is then in
    :attr:`missing`), which raises :class:`~cupycoll.errors.NcclError` on a failed status; :attr:`unchecked` holds the
    bare C functions by name, for a caller that checks a batch of statuses itself (no Python
    frame around each call: see :meth:`cupycoll.nccl.communicator.Communicator.launch`)."""

    def __init__(self, path: str):
        try:
            self._cdll = ctypes.CDLL(path)
        except OSError as exc:
            raise MissingDependencyError(f"cannot load NCCL from {path}: {exc}; {_INSTALL_HINT}") from exc
        self.path = path
        self.missing: list = []
        self.unchecked: dict = {}
        for entry in FUNCTIONS:
            try:
                function = getattr(self._cdll, entry.name)
            except AttributeError:
                if not entry.optional:
                    raise MissingDependencyError(
                        f"{path} has no {entry.name}: it is not a usable NCCL (2.18 or newer "
                        f"needed); {_INSTALL_HINT}"
                    ) from None
                self.missing.append(entry.name)
                setattr(self, entry.name, None)
                continue
            function.restype = entry.restype
            function.argtypes = entry.argtypes
            if entry.restype is ncclResult_t:
                self.unchecked[entry.name] = function
                function = _checked(self, entry.name, function)
            setattr(self, entry.name, function)

    def __repr__(self) -> str:
        return f"NcclLibrary({self.path!r}, version={self.version()})"

    def has(self, name: str) -> bool:
        """Whether the table function ``name`` was found in this library."""
        return getattr(self, name, None) is not None and any(f.name == name for f in FUNCTIONS)

    def version(self) -> int:
        """``ncclGetVersion``'s code, e.g. 23203 for 2.32.3."""
        code = ctypes.c_int()
        self.ncclGetVersion(ctypes.byref(code))
        return code.value

    def version_tuple(self) -> tuple:
        """``(major, minor, patch)``."""
        return split_version(self.version())

    def failure(self, function: str, status: int) -> NcclError:
        """The error of ``function`` returning ``status`` (neither success nor in progress)."""
        return NcclError(status, function, self.error_string(status), self.last_error())

    def error_string(self, status: int) -> str:
        """``ncclGetErrorString(status)``."""
        return (self.ncclGetErrorString(status) or b"").decode(errors="replace")

    def last_error(self) -> str:
        """``ncclGetLastError(NULL)`` (the comm argument is ignored), "" when unavailable."""
        if self.ncclGetLastError is None:
            return ""
        return (self.ncclGetLastError(None) or b"").decode(errors="replace")

    def unique_id(self) -> bytes:
        """A fresh ``ncclUniqueId`` as its 128 raw bytes."""
        uid = ncclUniqueId()
        self.ncclGetUniqueId(ctypes.byref(uid))
        return bytes(uid)  # not uid.internal: a c_char array stops at the first NUL

    @staticmethod
    def unique_id_from_bytes(data) -> ncclUniqueId:
        """The ``ncclUniqueId`` whose raw bytes are ``data`` (128 bytes)."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise CupycollTypeError(f"a unique id is {NCCL_UNIQUE_ID_BYTES} bytes, got {type(data).__name__}")
        if len(data) != NCCL_UNIQUE_ID_BYTES:
            raise CupycollValueError(f"a unique id is {NCCL_UNIQUE_ID_BYTES} bytes, got {len(data)}")
        return ncclUniqueId.from_buffer_copy(data)


_libraries: dict = {}  # resolved path -> NcclLibrary: one per file, however it was named
_requested: dict = {}  # path as asked for (None: the default) -> NcclLibrary
_lock = threading.Lock()


def load(path: Optional[str] = None) -> NcclLibrary:
    """The process-wide :class:`NcclLibrary` for ``find_library(path)``. A path asked for
    before (``None`` included) is not resolved again: resolving reads the process's mapped
    libraries and the pip package, hundreds of microseconds each time."""
    library = _requested.get(path)
    if library is not None:
        return library
    with _lock:
        resolved = find_library(path)
        library = _libraries.get(resolved)
        if library is None:
            library = _libraries[resolved] = NcclLibrary(resolved)
        _requested[path] = library
        return library
