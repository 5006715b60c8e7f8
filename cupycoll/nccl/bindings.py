"""Raw ctypes bindings to ``libnccl.so.2``: every NCCL call cupycoll makes on a communicator.

CuPy's ``cupy.cuda.nccl`` cannot make a nonblocking communicator, finalize one, shrink one,
create PreMulSum reduction ops or read ``ncclGetLastError``, and it declares abort and
destroy ``void``; so cupycoll creates and drives every ``ncclComm_t`` through this table
(CuPy keeps streams, memory and kernels). Names are NCCL's C names. Every function that
returns ``ncclResult_t`` is wrapped: ``ncclSuccess`` (0) and ``ncclInProgress`` (7, a
nonblocking communicator is still working: poll ``ncclCommGetAsyncError``) are returned,
any other status raises :class:`cupycoll.errors.NcclError`.

The library is looked up so that one NCCL serves CuPy, torch and these bindings: an
explicit path (``CUPYCOLL_NCCL_LIBRARY``), else what ``cuda-pathfinder`` (a CuPy 14
dependency) gives, which is the ``libnccl.so.2`` already loaded (CuPy's) when there is one;
without cuda-pathfinder (CuPy 13), the already loaded library, the ``nvidia-nccl-cu1x`` pip
package, then the dynamic loader.

Deliberately left out: anything that needs CuPy or torch (this module imports neither;
the error classes derive from torch's when torch is present),
buffer/stream/dtype conversion, NCCL functions CuPy already binds well and cupycoll does
not call through ctypes (``ncclCommInitAll``, ``ncclBcast``), and newer APIs cupycoll
does not use (windows, ``ncclMemAlloc``, one-sided operations, revoke and grow).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
from typing import NamedTuple, Optional

from ..errors import CupycollTypeError, CupycollValueError, MissingDependencyError, NcclError

# ---------------------------------------------------------------------------- types

ncclResult_t = ctypes.c_int
ncclComm_t = ctypes.c_void_p
ncclDataType_t = ctypes.c_int
ncclRedOp_t = ctypes.c_int
ncclScalarResidence_t = ctypes.c_int
cudaStream_t = ctypes.c_void_p
buffer_t = ctypes.c_void_p

NCCL_UNIQUE_ID_BYTES = 128


class ncclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * NCCL_UNIQUE_ID_BYTES)]


class ncclConfig_t(ctypes.Structure):
    """``ncclConfig_t`` as NCCL 2.30.0-2.30.4 declares it (x86-64: 96 bytes)."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("blocking", ctypes.c_int),  # 2.14
        ("cgaClusterSize", ctypes.c_int),  # 2.17
        ("minCTAs", ctypes.c_int),
        ("maxCTAs", ctypes.c_int),
        ("netName", ctypes.c_char_p),
        ("splitShare", ctypes.c_int),  # 2.18
        ("trafficClass", ctypes.c_int),  # 2.26 (parsed from 2.25)
        ("commName", ctypes.c_char_p),  # 2.27
        ("collnetEnable", ctypes.c_int),
        ("CTAPolicy", ctypes.c_int),
        ("shrinkShare", ctypes.c_int),
        ("nvlsCTAs", ctypes.c_int),
        ("nChannelsPerNetPeer", ctypes.c_int),  # 2.28
        ("nvlinkCentricSched", ctypes.c_int),
        ("graphUsageMode", ctypes.c_int),  # 2.29
        ("numRmaCtx", ctypes.c_int),
        ("maxP2pPeers", ctypes.c_int),  # 2.30.0
    ]


NCCL_API_MAGIC = 0xCAFEBEEF
NCCL_CONFIG_UNDEF_INT = -(2**31)  # INT_MIN
# The version stamped into ncclConfig_t: NCCL_VERSION(2, 30, 0), the release whose layout
# the class above copies. NCCL's parseCommConfig copies min(config.size, its own sizeof)
# bytes over its defaults, rejects only a wrong magic (there is no upper bound on version),
# and then resets to its default every field introduced after config.version. So an older
# library reads the prefix it knows, and a newer one ignores what it would otherwise read
# from our tail padding: 2.30.5 put graphStreamOrdering at offset 92, inside the 4 padding
# bytes (zero) of this 96-byte struct, and resets it because 23000 < NCCL_VERSION(2,30,5).
# Stamping the installed header's NCCL_VERSION_CODE instead would pass that 0 as a setting.
NCCL_CONFIG_VERSION = 23000


def make_config(blocking: bool, split_share: Optional[bool] = None) -> ncclConfig_t:
    """An ``ncclConfig_t`` equal to ``NCCL_CONFIG_INITIALIZER`` except for the given fields."""
    config = ncclConfig_t()  # pointers NULL
    for name, ctype in ncclConfig_t._fields_[3:]:
        if ctype is ctypes.c_int:
            setattr(config, name, NCCL_CONFIG_UNDEF_INT)
    config.size = ctypes.sizeof(ncclConfig_t)
    config.magic = NCCL_API_MAGIC
    config.version = NCCL_CONFIG_VERSION
    config.blocking = int(bool(blocking))
    if split_share is not None:
        config.splitShare = int(bool(split_share))
    return config


# ------------------------------------------------------------------------ constants

ncclSuccess = 0
ncclInProgress = 7
NCCL_SPLIT_NOCOLOR = -1
# ncclCommShrink's shrinkFlags (2.27)
NCCL_SHRINK_DEFAULT = 0
NCCL_SHRINK_ABORT = 1  # abort what is in flight on the parent first

# ncclDataType_t
ncclInt8 = 0
ncclUint8 = 1
ncclInt32 = 2
ncclUint32 = 3
ncclInt64 = 4
ncclUint64 = 5
ncclFloat16 = 6
ncclFloat32 = 7
ncclFloat64 = 8
ncclBfloat16 = 9
ncclFloat8e4m3 = 10  # NCCL >= 2.24
ncclFloat8e5m2 = 11  # NCCL >= 2.24

# ncclRedOp_t (built-in; ncclRedOpCreatePreMulSum returns values >= 5)
ncclSum = 0
ncclProd = 1
ncclMax = 2
ncclMin = 3
ncclAvg = 4

# ncclScalarResidence_t
ncclScalarDevice = 0
ncclScalarHostImmediate = 1


def _split_version(code: int) -> tuple:
    # NCCL_VERSION(X,Y,Z) is X*1000 + Y*100 + Z up to 2.8 and X*10000 + Y*100 + Z from 2.9.
    if code >= 10000:
        return code // 10000, code % 10000 // 100, code % 100
    return code // 1000, code % 1000 // 100, code % 100


def version_text(version) -> str:
    """``"2.28.9"`` from an NCCL version code (``ncclGetVersion``, CuPy's ``get_version``) or
    from a ``(2, 28, 9)`` tuple (``torch.cuda.nccl.version()``)."""
    parts = version if isinstance(version, tuple) else _split_version(int(version))
    return ".".join(map(str, parts))


def fp8_supported(version_code: int) -> bool:
    """Whether an NCCL of this version code has ``ncclFloat8e4m3``/``ncclFloat8e5m2`` (2.24+)."""
    return _split_version(version_code) >= (2, 24, 0)


# -------------------------------------------------------------------- function table


class Function(NamedTuple):
    name: str
    restype: object
    argtypes: tuple
    optional: bool = False  # may be absent from a library cupycoll supports (NCCL >= 2.18)
    since: tuple = (2, 18, 1)  # the first NCCL release that has it (those before: in 2.18.1)


_p = ctypes.POINTER

# Every entry below exists in NCCL 2.18.1 and later but ncclCommShrink (2.27); the optional
# ones are the extras cupycoll can work without (a feature then refused with the NCCL it
# needs), so that an older, stripped or vendor build lacking them still loads.
FUNCTIONS = (
    # ncclResult_t ncclGetVersion(int *version);
    Function("ncclGetVersion", ncclResult_t, (_p(ctypes.c_int),)),
    # const char* ncclGetErrorString(ncclResult_t result);
    Function("ncclGetErrorString", ctypes.c_char_p, (ncclResult_t,)),
    # const char* ncclGetLastError(ncclComm_t comm);   (2.13)
    Function("ncclGetLastError", ctypes.c_char_p, (ncclComm_t,), optional=True),
    # ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId);
    Function("ncclGetUniqueId", ncclResult_t, (_p(ncclUniqueId),)),
    # ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank);
    Function("ncclCommInitRank", ncclResult_t, (_p(ncclComm_t), ctypes.c_int, ncclUniqueId, ctypes.c_int)),
    # ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId,
    #                                     int rank, ncclConfig_t* config);   (2.14)
    Function("ncclCommInitRankConfig", ncclResult_t,
             (_p(ncclComm_t), ctypes.c_int, ncclUniqueId, ctypes.c_int, _p(ncclConfig_t))),
    # ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm,
    #                            ncclConfig_t* config);   (2.18)
    Function("ncclCommSplit", ncclResult_t,
             (ncclComm_t, ctypes.c_int, ctypes.c_int, _p(ncclComm_t), _p(ncclConfig_t)), optional=True),
    # ncclResult_t ncclCommShrink(ncclComm_t comm, int* excludeRanksList, int excludeRanksCount,
    #                             ncclComm_t* newcomm, ncclConfig_t* config, int shrinkFlags);   (2.27)
    Function("ncclCommShrink", ncclResult_t,
             (ncclComm_t, _p(ctypes.c_int), ctypes.c_int, _p(ncclComm_t), _p(ncclConfig_t), ctypes.c_int),
             optional=True, since=(2, 27, 0)),
    # ncclResult_t ncclCommFinalize(ncclComm_t comm);   (2.14)
    Function("ncclCommFinalize", ncclResult_t, (ncclComm_t,)),
    # ncclResult_t ncclCommDestroy(ncclComm_t comm);
    Function("ncclCommDestroy", ncclResult_t, (ncclComm_t,)),
    # ncclResult_t ncclCommAbort(ncclComm_t comm);
    Function("ncclCommAbort", ncclResult_t, (ncclComm_t,)),
    # ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError);
    Function("ncclCommGetAsyncError", ncclResult_t, (ncclComm_t, _p(ncclResult_t))),
    # ncclResult_t ncclCommCount(const ncclComm_t comm, int* count);
    Function("ncclCommCount", ncclResult_t, (ncclComm_t, _p(ctypes.c_int))),
    # ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int* device);
    Function("ncclCommCuDevice", ncclResult_t, (ncclComm_t, _p(ctypes.c_int))),
    # ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank);
    Function("ncclCommUserRank", ncclResult_t, (ncclComm_t, _p(ctypes.c_int))),
    # ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count,
    #     ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
    Function("ncclAllReduce", ncclResult_t,
             (buffer_t, buffer_t, ctypes.c_size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t)),
    # ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count,
    #     ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream);
    Function("ncclBroadcast", ncclResult_t,
             (buffer_t, buffer_t, ctypes.c_size_t, ncclDataType_t, ctypes.c_int, ncclComm_t, cudaStream_t)),
    # ncclResult_t ncclReduce(const void* sendbuff, void* recvbuff, size_t count,
    #     ncclDataType_t datatype, ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream);
    Function("ncclReduce", ncclResult_t,
             (buffer_t, buffer_t, ctypes.c_size_t, ncclDataType_t, ncclRedOp_t, ctypes.c_int, ncclComm_t,
              cudaStream_t)),
    # ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount,
    #     ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream);
    Function("ncclAllGather", ncclResult_t,
             (buffer_t, buffer_t, ctypes.c_size_t, ncclDataType_t, ncclComm_t, cudaStream_t)),
    # ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount,
    #     ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
    Function("ncclReduceScatter", ncclResult_t,
             (buffer_t, buffer_t, ctypes.c_size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t)),
    # ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype,
    #     int peer, ncclComm_t comm, cudaStream_t stream);
    Function("ncclSend", ncclResult_t,
             (buffer_t, ctypes.c_size_t, ncclDataType_t, ctypes.c_int, ncclComm_t, cudaStream_t)),
    # ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype,
    #     int peer, ncclComm_t comm, cudaStream_t stream);
    Function("ncclRecv", ncclResult_t,
             (buffer_t, ctypes.c_size_t, ncclDataType_t, ctypes.c_int, ncclComm_t, cudaStream_t)),
    # ncclResult_t ncclGroupStart();
    Function("ncclGroupStart", ncclResult_t, ()),
    # ncclResult_t ncclGroupEnd();
    Function("ncclGroupEnd", ncclResult_t, ()),
    # ncclResult_t ncclRedOpCreatePreMulSum(ncclRedOp_t *op, void *scalar, ncclDataType_t datatype,
    #     ncclScalarResidence_t residence, ncclComm_t comm);   (2.11)
    Function("ncclRedOpCreatePreMulSum", ncclResult_t,
             (_p(ncclRedOp_t), buffer_t, ncclDataType_t, ncclScalarResidence_t, ncclComm_t), optional=True),
    # ncclResult_t ncclRedOpDestroy(ncclRedOp_t op, ncclComm_t comm);   (2.11)
    Function("ncclRedOpDestroy", ncclResult_t, (ncclRedOp_t, ncclComm_t), optional=True),
)

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
    """One loaded libnccl. Each :data:`FUNCTIONS` entry is an attribute of the same C name
    (``None`` when an optional one is missing; its name is then in :attr:`missing`), which
    raises :class:`~cupycoll.errors.NcclError` on a failed status; :attr:`unchecked` holds the
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
        return _split_version(self.version())

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
