"""NCCL's C declarations as ctypes: what ``nccl.h`` declares of every call cupycoll makes.

The handle and enum types, ``ncclUniqueId`` and ``ncclConfig_t`` (and :func:`make_config`,
``NCCL_CONFIG_INITIALIZER`` with the fields cupycoll sets), the enum values cupycoll passes
and reads (results, data types, reduction ops, split and shrink flags), NCCL's version codes
(:func:`version_text`, :func:`fp8_supported`), and :data:`FUNCTIONS`, one declarative table of
the C functions: each one's C name, prototype, whether a usable library may lack it and the
release that added it. Names are NCCL's C names. The tests check all of it against the
``nccl.h`` of each NCCL the CI runs (tests/nccl/test_nccl_bindings.py).

Deliberately left out: finding, loading and binding a library (:mod:`cupycoll.nccl.bindings`),
and anything that needs CuPy, torch or a GPU: importing this module loads no library.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple, Optional

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


def split_version(code: int) -> tuple:
    """``(major, minor, patch)`` of an NCCL version code."""
    # NCCL_VERSION(X,Y,Z) is X*1000 + Y*100 + Z up to 2.8 and X*10000 + Y*100 + Z from 2.9.
    if code >= 10000:
        return code // 10000, code % 10000 // 100, code % 100
    return code // 1000, code % 1000 // 100, code % 100


def version_text(version) -> str:
    """``"2.28.9"`` from an NCCL version code (``ncclGetVersion``, CuPy's ``get_version``) or
    from a ``(2, 28, 9)`` tuple (``torch.cuda.nccl.version()``)."""
    parts = version if isinstance(version, tuple) else split_version(int(version))
    return ".".join(map(str, parts))


def fp8_supported(version_code: int) -> bool:
    """Whether an NCCL of this version code has ``ncclFloat8e4m3``/``ncclFloat8e5m2`` (2.24+)."""
    return split_version(version_code) >= (2, 24, 0)


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
