"""torch arguments in NCCL terms: the checks a call passes before anything is enqueued,
and dtype/op -> NCCL codes with one reduction plan (NCCL or one of cupycoll's algorithms, and the PREMUL factor).

Every check raises CupycollValueError / CupycollTypeError naming the offending argument as
the user wrote it. Reductions need an NCCL datatype; collectives that only move data
(broadcast, gathers, all-to-all, send/recv) move bytes (``ncclUint8``), so every torch dtype
works for them.

Deliberately left out: anything that needs the group's state (its device: the backend
checks that), CuPy (the fp8 probe, :func:`fp8_supported`, runs only for fp8
tensors), bitwise reductions on NCCL (NCCL has none; the plan sends them to the ring) and
any casting.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
from torch.distributed import ReduceOp

from . import _cuda, compat
from .nccl import header as nh
from . import algorithms
from .errors import CupycollTypeError, CupycollValueError

NCCL_BYTE = nh.ncclUint8


# ------------------------------------------------------------------------------------------
# argument checks: raise before anything is enqueued, naming the offending value


def check_tensor(tensor, what: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise CupycollTypeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    return tensor


def single(tensors, what: str) -> torch.Tensor:
    if not isinstance(tensors, (list, tuple)) or len(tensors) != 1:
        count = len(tensors) if isinstance(tensors, (list, tuple)) else type(tensors).__name__
        raise CupycollValueError(f"{what}: cupycoll takes exactly one tensor per process, got {count}")
    tensor = tensors[0]
    if not isinstance(tensor, torch.Tensor):
        check_tensor(tensor, what)  # raises, naming what it is
    return tensor


def single_list(lists, what: str):
    if not isinstance(lists, (list, tuple)) or len(lists) != 1:
        raise CupycollValueError(f"{what}: cupycoll takes one list of tensors per process")
    return lists[0]


def check_list(tensors, what: str, length: int) -> List[torch.Tensor]:
    if not isinstance(tensors, (list, tuple)):
        raise CupycollTypeError(f"{what} must be a list of tensors, got {type(tensors).__name__}")
    if len(tensors) != length:
        raise CupycollValueError(f"{what} has {len(tensors)} tensors; the group has {length} ranks")
    for index, tensor in enumerate(tensors):
        check_tensor(tensor, f"{what}[{index}]")
    return list(tensors)


def check_numel(tensor: torch.Tensor, expected: int, what: str) -> None:
    if tensor.numel() != expected:
        raise CupycollValueError(
            f"{what} has {tensor.numel()} elements (shape {tuple(tensor.shape)}); expected {expected}"
        )


def check_same_dtype(tensors: Sequence[torch.Tensor], reference: torch.Tensor, what: str) -> None:
    for tensor in tensors:
        if tensor.dtype != reference.dtype:
            raise CupycollTypeError(f"{what}: dtype {tensor.dtype} differs from {reference.dtype}")


def check_root(root: int, size: int, what: str = "root") -> int:
    if not isinstance(root, int) or not 0 <= root < size:
        raise CupycollValueError(f"{what} {root!r} is out of range for a group of {size} ranks")
    return root


def check_peer(peer: int, rank: int, size: int) -> int:
    check_root(peer, size, "peer rank")
    if peer == rank:
        raise CupycollValueError(f"peer rank {peer} is this process's own rank")
    return peer


def split_ranks(ranks, size: int) -> List[int]:
    """A split's sub-list of group ranks (torch's ``split_group``), sorted."""
    if not isinstance(ranks, (list, tuple)) or not ranks:
        raise CupycollValueError(f"split_group ranks {ranks!r}: expected a non-empty list of group ranks")
    for rank in ranks:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
            raise CupycollValueError(f"split_group rank {rank!r} is not a rank of the parent group "
                                     f"(ranks 0 to {size - 1})")
    if len(set(ranks)) != len(ranks):
        raise CupycollValueError(f"split_group ranks {list(ranks)} name a rank twice")
    return sorted(ranks)


def flat(tensors) -> List[torch.Tensor]:
    out = []
    for item in tensors:
        if isinstance(item, (list, tuple)):
            out.extend(flat(item))
        else:
            out.append(item)
    return out


def classify_slowly(tensors: List, op_name: str) -> bool:
    """Is this a CUDA call? The slow path of the group's routing: names the tensor that is
    not one, and rejects calls that mix device types or CUDA devices."""
    for index, tensor in enumerate(tensors):
        check_tensor(tensor, f"{op_name}: tensor {index}")
    kinds = {t.device.type for t in tensors}
    if len(kinds) > 1:
        raise CupycollValueError(f"{op_name}: tensors on different device types {sorted(kinds)}")
    if not kinds or kinds == {"cpu"}:
        return False
    if kinds != {"cuda"}:
        raise CupycollValueError(f"{op_name}: tensors on {kinds.pop()} are not supported")
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise CupycollValueError(f"{op_name}: tensors on several devices {sorted(map(str, devices))}")
    return True


def is_cpu(device) -> bool:
    return device is not None and torch.device(device).type == "cpu"


def barrier_device(opts, current_device: Callable[[], int]) -> Optional[torch.device]:
    """The CUDA device a barrier should run on, or None for a CPU (gloo) barrier;
    ``current_device()``: the thread's (when the options name no index)."""
    device = getattr(opts, "device", None)
    device_ids = list(getattr(opts, "device_ids", None) or [])
    if device is not None and device.type == "cuda":
        if device.index is None:
            return torch.device("cuda", device_ids[0] if device_ids else current_device())
        return device
    if device_ids and (device is None or device.type != "cpu"):
        return torch.device("cuda", device_ids[0])
    return None


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def split_bytes(tensor: torch.Tensor, split_sizes, world: int, what: str) -> List[Tuple[int, int]]:
    """(byte offset, byte count) per peer for all_to_all_single's dim-0 splits."""
    rows = tensor.shape[0] if tensor.dim() > 0 else 1
    row_bytes = (nbytes(tensor) // rows) if rows else 0
    sizes = list(split_sizes or [])
    if not sizes:
        if rows % world:
            raise CupycollValueError(
                f"all_to_all_single {what}: dim 0 ({rows}) is not divisible by the group size ({world}); "
                "pass split sizes")
        sizes = [rows // world] * world
    if len(sizes) != world:
        raise CupycollValueError(f"all_to_all_single {what} split sizes {sizes} have {len(sizes)} entries; "
                                 f"the group has {world} ranks")
    if any(s < 0 for s in sizes) or sum(sizes) != rows:
        raise CupycollValueError(f"all_to_all_single {what} split sizes {sizes} do not add up to dim 0 ({rows})")
    offsets = list(itertools.accumulate([0] + sizes[:-1]))
    return [(o * row_bytes, s * row_bytes) for o, s in zip(offsets, sizes)]


# ------------------------------------------------------------------------------------------
# dtype / ReduceOp -> NCCL codes

RedOpType = ReduceOp.RedOpType

_REDUCTION_DTYPES = {
    torch.int8: nh.ncclInt8,
    torch.uint8: nh.ncclUint8,
    torch.int32: nh.ncclInt32,
    torch.int64: nh.ncclInt64,
    torch.float16: nh.ncclFloat16,
    torch.float32: nh.ncclFloat32,
    torch.float64: nh.ncclFloat64,
    torch.bfloat16: nh.ncclBfloat16,
    torch.bool: nh.ncclUint8,
    # complex reduces as pairs of reals: only element-wise-linear ops make sense.
    torch.complex64: nh.ncclFloat32,
    torch.complex128: nh.ncclFloat64,
    torch.uint32: nh.ncclUint32,
    torch.uint64: nh.ncclUint64,
}
_FP8_DTYPES = {torch.float8_e4m3fn: nh.ncclFloat8e4m3, torch.float8_e5m2: nh.ncclFloat8e5m2}
_COMPLEX = (torch.complex64, torch.complex128)
_FLOATING_FOR_PREMUL = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_NCCL_OPS = {
    RedOpType.SUM: nh.ncclSum,
    RedOpType.PRODUCT: nh.ncclProd,
    RedOpType.MAX: nh.ncclMax,
    RedOpType.MIN: nh.ncclMin,
    RedOpType.AVG: nh.ncclAvg,
}
# NCCL has no logical ops; on {0, 1} bytes MAX is OR and MIN is AND, as ProcessGroupNCCL does.
_BOOL_OPS = {RedOpType.SUM: nh.ncclMax, RedOpType.PRODUCT: nh.ncclMin,
             RedOpType.MAX: nh.ncclMax, RedOpType.MIN: nh.ncclMin}
_BITWISE = (RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR)
BITWISE_VALUES = frozenset(kind.value for kind in _BITWISE)


def algorithm_names(dtype: torch.dtype, kind: RedOpType):
    """(dtype, op) as the algorithms name them (cupycoll.algorithms): ``("bfloat16", "sum")``."""
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


def reduction(dtype: torch.dtype, reduce_op, fp8_available: bool) -> Reduction:
    """Map (dtype, op) to NCCL, or raise naming both when NCCL cannot do it (the hot path
    reaches it once per dtype and op: :func:`reduction_plan` keeps the plans)."""
    return _reduction(dtype, op_type(reduce_op), reduce_op, fp8_available)


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
    if size == 1 and red.op == nh.ncclAvg and dtype in _FP8_DTYPES:
        return dataclasses.replace(red, op=nh.ncclSum)
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


@dataclasses.dataclass(frozen=True)
class AlgorithmReduction:
    """A reduction one of cupycoll's algorithms runs (:mod:`cupycoll.algorithms`, by name):
    dtype and op by the algorithms' names, and the PREMUL_SUM factor as a number
    (``premul``) or a device pointer to one element (``premul_ptr``, into ``premul_tensor``)."""

    algorithm: str
    dtype: str
    op: str
    premul: Optional[float] = None
    premul_ptr: Optional[int] = None
    premul_tensor: Optional[torch.Tensor] = dataclasses.field(default=None, compare=False, repr=False)


@functools.lru_cache(maxsize=None)
def fp8_supported() -> bool:
    """Can the NCCL CuPy loaded reduce fp8 (NCCL >= 2.24)? Asked only for fp8 tensors."""
    return nh.fp8_supported(_cuda.nccl_module().get_version())


# (dtype, RedOpType value, algorithm, one rank) -> the plan, for every op but PREMUL_SUM
# (whose factor is per call): what the hot path looks up instead of deciding again. Hashing
# pybind enums and comparing them costs a microsecond each; the key holds the op's int.
_PLANS: dict = {}
_PREMUL_SUM = RedOpType.PREMUL_SUM.value


def reduction_plan(tensor: torch.Tensor, reduce_op, algorithm: str,
                   group_size: int) -> Union[Reduction, AlgorithmReduction]:
    """How to reduce ``tensor`` with ``reduce_op``: on NCCL (a :class:`Reduction`) or on one
    of cupycoll's algorithms (an :class:`AlgorithmReduction`), or raise naming the dtype and
    op none can do.

    ``algorithm``: ``nccl``; ``auto``, NCCL but for what it lacks (bitwise ops), which goes to
    the algorithm taking it over; or an algorithm's name, for every call (raising for a pair
    it cannot do)."""
    kind = op_type(reduce_op)
    key = (tensor.dtype, kind.value, algorithm, group_size == 1)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan(tensor, reduce_op, kind, algorithm, group_size)
        if kind.value != _PREMUL_SUM:  # a factor is per call
            _PLANS[key] = plan
    return plan


def _plan(tensor: torch.Tensor, reduce_op, kind: RedOpType, algorithm: str,
          group_size: int) -> Union[Reduction, AlgorithmReduction]:
    dtype = tensor.dtype
    chosen = None
    if algorithm == algorithms.AUTO:
        if kind.value in BITWISE_VALUES:
            chosen = algorithms.taking_over(kind.name.lower())  # None: NCCL's error below
    elif algorithm != algorithms.NCCL:
        chosen = algorithms.get(algorithm)
    if chosen is not None:
        name, op = algorithm_names(dtype, kind)
        chosen.check(name, op)
        if op != "premul_sum":
            return AlgorithmReduction(chosen.name, name, op)
        factor = _premul_checked(premul_factor(reduce_op), tensor)
        if isinstance(factor, torch.Tensor):
            return AlgorithmReduction(chosen.name, name, op, premul_ptr=factor.data_ptr(), premul_tensor=factor)
        return AlgorithmReduction(chosen.name, name, op, premul=float(factor))
    fp8_available = dtype in _FP8_DTYPES and fp8_supported()
    red = for_group_size(reduction(dtype, reduce_op, fp8_available), dtype, group_size)
    _premul_checked(red.premul_factor, tensor)
    return red


def factor_tensor(plan: Union[Reduction, AlgorithmReduction]) -> Optional[torch.Tensor]:
    """The PREMUL_SUM factor tensor NCCL or the algorithm reads on the device (None: no
    factor, or a number). A call's keepalive must hold it: the ReduceOp may be a temporary,
    its tensor freed and reused before an async call's kernel reads it."""
    factor = plan.premul_tensor if isinstance(plan, AlgorithmReduction) else plan.premul_factor
    return factor if isinstance(factor, torch.Tensor) else None


def _premul_checked(factor, tensor: torch.Tensor):
    if isinstance(factor, torch.Tensor):
        check_premul_tensor(factor, tensor.dtype, tensor.device)
    return factor
