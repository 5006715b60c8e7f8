"""torch dtype and ReduceOp -> NCCL codes, with the errors users see for unsupported pairs.

Reductions need an NCCL datatype. Collectives that only move data (broadcast, gathers,
all-to-all, send/recv) move bytes (``ncclUint8``), so every torch dtype works for them.

Deliberately left out: bitwise reductions (NCCL has none) and any casting.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch.distributed import ReduceOp

from . import compat
from . import nccl_bindings as nb
from .errors import CupycollTypeError, CupycollValueError

RedOpType = ReduceOp.RedOpType

NCCL_BYTE = nb.ncclUint8

_REDUCTION_DTYPES = {
    torch.int8: nb.ncclInt8,
    torch.uint8: nb.ncclUint8,
    torch.int32: nb.ncclInt32,
    torch.int64: nb.ncclInt64,
    torch.float16: nb.ncclFloat16,
    torch.float32: nb.ncclFloat32,
    torch.float64: nb.ncclFloat64,
    torch.bfloat16: nb.ncclBfloat16,
    torch.bool: nb.ncclUint8,
    # complex reduces as pairs of reals: only element-wise-linear ops make sense.
    torch.complex64: nb.ncclFloat32,
    torch.complex128: nb.ncclFloat64,
    torch.uint32: nb.ncclUint32,
    torch.uint64: nb.ncclUint64,
}
_FP8_DTYPES = {torch.float8_e4m3fn: nb.ncclFloat8e4m3, torch.float8_e5m2: nb.ncclFloat8e5m2}
_COMPLEX = (torch.complex64, torch.complex128)
_FLOATING_FOR_PREMUL = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_NCCL_OPS = {
    RedOpType.SUM: nb.ncclSum,
    RedOpType.PRODUCT: nb.ncclProd,
    RedOpType.MAX: nb.ncclMax,
    RedOpType.MIN: nb.ncclMin,
    RedOpType.AVG: nb.ncclAvg,
}
# NCCL has no logical ops; on {0, 1} bytes MAX is OR and MIN is AND, as ProcessGroupNCCL does.
_BOOL_OPS = {RedOpType.SUM: nb.ncclMax, RedOpType.PRODUCT: nb.ncclMin,
             RedOpType.MAX: nb.ncclMax, RedOpType.MIN: nb.ncclMin}
_BITWISE = (RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR)
BITWISE_VALUES = frozenset(kind.value for kind in _BITWISE)


def ring_names(dtype: torch.dtype, kind: RedOpType):
    """(dtype, op) as cupycoll.ring names them: ``("bfloat16", "sum")``."""
    return str(dtype).replace("torch.", ""), kind.name.lower()


@dataclasses.dataclass(frozen=True)
class Reduction:
    """How to run one reduction: NCCL datatype and op, element-count multiplier, and the
    PREMUL_SUM factor (a Python number or a one-element tensor) when there is one."""

    dtype: int
    op: int
    count_scale: int = 1
    premul_factor: object = None


def op_type(reduce_op) -> RedOpType:
    """The RedOpType of ``ReduceOp``, ``RedOpType`` or an options' ``reduceOp``."""
    if type(reduce_op) is ReduceOp:
        return reduce_op.op
    if isinstance(reduce_op, RedOpType):
        return reduce_op
    op = getattr(reduce_op, "op", None)
    if isinstance(op, RedOpType):
        return op
    raise CupycollTypeError(f"reduce op {reduce_op!r} is not a torch.distributed.ReduceOp")


# (dtype, RedOpType value, fp8 available) -> Reduction, for every op but PREMUL_SUM (whose
# factor is per call). Hashing pybind enums and comparing them costs a microsecond each;
# the hot path pays one int and one dict lookup instead.
_CACHE: dict = {}


def reduction(dtype: torch.dtype, reduce_op, fp8_available: bool) -> Reduction:
    """Map (dtype, op) to NCCL, or raise naming both when NCCL cannot do it."""
    kind = op_type(reduce_op)
    key = (dtype, kind.value, fp8_available)
    cached = _CACHE.get(key)
    if cached is not None:
        return cached
    red = _reduction(dtype, kind, reduce_op, fp8_available)
    if red.premul_factor is None:
        _CACHE[key] = red
    return red


def _reduction(dtype: torch.dtype, kind: RedOpType, reduce_op, fp8_available: bool) -> Reduction:
    if kind in _BITWISE:
        raise CupycollValueError(
            f"ReduceOp.{kind.name} is not supported by NCCL (dtype {dtype}); cupycoll's ring "
            "algorithm does bitwise reductions: algorithm 'auto' (the default) or 'ring'"
        )
    if dtype in _FP8_DTYPES:
        if not fp8_available:
            raise CupycollTypeError(f"dtype {dtype} needs NCCL >= 2.24 (the loaded NCCL is older)")
        code = _FP8_DTYPES[dtype]
    elif dtype in _REDUCTION_DTYPES:
        code = _REDUCTION_DTYPES[dtype]
    else:
        raise CupycollTypeError(f"dtype {dtype} cannot be reduced by NCCL (ReduceOp.{kind.name})")

    if dtype == torch.bool:
        if kind not in _BOOL_OPS:
            raise CupycollValueError(f"ReduceOp.{kind.name} is not defined for dtype {dtype}")
        return Reduction(code, _BOOL_OPS[kind])
    if dtype in _COMPLEX:
        if kind not in (RedOpType.SUM, RedOpType.AVG):
            raise CupycollValueError(
                f"ReduceOp.{kind.name} is not defined for dtype {dtype} (SUM and AVG are)"
            )
        return Reduction(code, _NCCL_OPS[kind], count_scale=2)
    if kind == RedOpType.PREMUL_SUM:
        if dtype not in _FLOATING_FOR_PREMUL:
            raise CupycollValueError(f"ReduceOp.PREMUL_SUM needs a floating dtype, got {dtype}")
        return Reduction(code, -1, premul_factor=premul_factor(reduce_op))
    return Reduction(code, _NCCL_OPS[kind])


def for_group_size(red: Reduction, dtype: torch.dtype, size: int) -> Reduction:
    """``red`` as a group of ``size`` ranks must issue it. NCCL (2.28 to at least 2.30) runs a
    one-rank reduction through a host function whose fp8 branches exist only in device code,
    so ncclAvg on fp8 returns ncclInvalidArgument there; on one rank AVG is SUM."""
    if size == 1 and red.op == nb.ncclAvg and dtype in _FP8_DTYPES:
        return dataclasses.replace(red, op=nb.ncclSum)
    return red


def premul_factor(reduce_op):
    """PREMUL_SUM's factor (a number or a one-element tensor), or an error saying how to make one."""
    factor = compat.premul_factor(reduce_op)
    if factor is None:
        raise CupycollValueError(
            "ReduceOp.PREMUL_SUM without a factor: build it with "
            "torch.distributed._make_nccl_premul_sum(factor)"
        )
    return factor


def premul_scalar_bytes(factor, dtype: torch.dtype) -> bytes:
    """The PREMUL_SUM factor as one host element of ``dtype``, raw bytes."""
    return torch.tensor([float(factor)], dtype=dtype).view(torch.uint8).numpy().tobytes()


def check_premul_tensor(factor: torch.Tensor, dtype: torch.dtype, device: torch.device) -> None:
    if factor.numel() != 1 or factor.dtype != dtype or factor.device != device:
        raise CupycollValueError(
            f"PREMUL_SUM factor tensor must be one element of {dtype} on {device}; got "
            f"{factor.numel()} element(s) of {factor.dtype} on {factor.device}"
        )


def optional_attr(options, name: str, default=None) -> Optional[object]:
    return getattr(options, name, default) if options is not None else default
