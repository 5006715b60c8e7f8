"""The API suite's decisions that do not need a process group, kept apart from
api_worker.py so the CPU tier can test them: how exactly each reduction can be checked,
which cases torch's own nccl backend cannot run as a reference, how outputs are kept for the
cross-backend comparison, and that comparison.
"""

from __future__ import annotations

import hashlib
import re
from typing import Dict, Iterable, List, Set, Tuple

import torch
import torch.distributed as dist

R = dist.ReduceOp

# Outputs with more elements than this are kept as a digest, not a tensor: the GPU tier runs
# the suite several times, and full copies of the large cases filled most of a 64 GiB disk.
KEEP_TENSORS_UP_TO = 4096

# The large size of the CUDA suite: several NCCL chunks and pipeline steps, yet cheap to
# move between ranks sharing one GPU over sockets and to check on the CPU.
LARGE = (1 << 20) + 3

# Relative half-spacing of each fp8 format at the bottom of a binade (its worst case):
# e4m3 has 3 mantissa bits, e5m2 two.
_FP8_HALF_ULP = {torch.float8_e4m3fn: 2.0 ** -(3 + 1), torch.float8_e5m2: 2.0 ** -(2 + 1)}


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in _FP8_HALF_ULP


def reduce_check(dtype: torch.dtype, op, world: int) -> Dict[str, object]:
    """How a reduction's result can be checked against the exact reference:
    ``Suite.check`` keyword arguments.

    The suite's inputs are small integers, so sums, products, minima and maxima are exact in
    every dtype but fp8, where the partial results travel between ranks in fp8 and are rounded
    at every step (e5m2 cannot even hold 9). AVG divides, so it is never bit-exact."""
    if is_fp8(dtype) and op in (R.MIN, R.MAX):
        return {"exact": True}  # picks one of the inputs, each exact in fp8
    if is_fp8(dtype):
        # one rounding per step of the reduction, and for AVG the 1/n factor and each
        # pre-multiplied input are rounded too
        steps = max(1, world - 1) + (2 if op == R.AVG else 0)
        rtol = (1.0 + _FP8_HALF_ULP[dtype]) ** steps - 1.0
        return {"exact": False, "rtol": rtol, "atol": 1e-2}
    exact = op != R.AVG and not (dtype == torch.bfloat16 and op == R.PRODUCT)
    return {"exact": exact}


def reduce_ops_for(dtype: torch.dtype) -> Tuple:
    """The ops the suite's ``dist.reduce`` loop runs: complex numbers have no order, so no
    MAX (cupycoll rejects it, and the reference could not compute it)."""
    return (R.SUM,) if dtype.is_complex else (R.SUM, R.MAX)


def self_p2p_cases_apply(world: int) -> bool:
    """The ring isend/irecv cases send to the right neighbour: at one rank that is the rank
    itself, which cupycoll rejects (and torch's nccl, issuing the send and the receive as
    separate NCCL calls, would hang on)."""
    return world > 1


_TORCH_NCCL_NO_DTYPE = (torch.int16, torch.uint16)


def reference_lacks(backend: str, family: str, dtype: torch.dtype = None) -> str:
    """Why the reference backend cannot run a case of ``family`` ("" when it can).

    Only torch's own nccl backend is a reference with gaps: it has no int16/uint16 NCCL type,
    its ``dist.reduce`` hands complex tensors to NCCL unconverted (torch 2.11), and its
    ``_coalescing_manager`` leaves the group in coalescing mode when the body raises."""
    if "cupycoll" in backend or backend != "nccl":
        return ""
    if dtype in _TORCH_NCCL_NO_DTYPE and family in ("broadcast", "all_gather", "all_gather_into_tensor"):
        return f"ProcessGroupNCCL has no NCCL type for {dtype}"
    if dtype is not None and dtype.is_complex and family == "reduce":
        return "torch's dist.reduce passes complex tensors to ProcessGroupNCCL unconverted"
    if family == "coalesced/exception_then_collective":
        return "torch's _coalescing_manager stays in coalescing mode after its body raises"
    return ""


def kept(output):
    """What the suite keeps of a case's output (CPU tensors, or a list of them)."""
    if isinstance(output, list):
        return [kept(o) for o in output]
    if output.numel() > KEEP_TENSORS_UP_TO:
        return digest(output)
    return output


def digest(t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous()
    data = t.view(torch.uint8) if t.numel() else t
    return (f"sha256:{str(t.dtype).replace('torch.', '')}:{tuple(t.shape)}:"
            f"{hashlib.sha256(data.numpy().tobytes()).hexdigest()}")


def _bitwise_equal(a, b) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def loose_case(name: str) -> bool:
    """Cases whose bits may differ between two correct backends: AVG and fp8 round
    differently depending on the reduction order (the reference checks cover them)."""
    return "AVG" in name or "float8" in name


def failed_case_names(failures: Iterable[str]) -> Set[str]:
    """The case names in a summary's failure lines ("name: ..." or "name[i]: ...")."""
    return {re.split(r"[\[:]", line, 1)[0] for line in failures}


def compare_runs(ours: Dict[str, object], reference: Dict[str, object],
                 exclude: Iterable[str] = ()) -> Tuple[int, List[str]]:
    """Compare two backends' kept outputs case by case, over the cases both ran, leaving out
    ``exclude`` (cases the reference itself got wrong): (how many were compared bitwise, the
    names that differ with what differed)."""
    compared, mismatches = 0, []
    exclude = set(exclude)
    for name in sorted(set(ours) & set(reference)):
        if loose_case(name) or name in exclude:
            continue
        a, b = ours[name], reference[name]
        al, bl = (a, b) if isinstance(a, list) else ([a], [b])
        if not isinstance(bl, list) or len(al) != len(bl):
            mismatches.append(f"{name}: {len(al)} outputs vs {len(bl) if isinstance(bl, list) else 1}")
            continue
        compared += 1
        for index, (x, y) in enumerate(zip(al, bl)):
            if not _bitwise_equal(x, y):
                mismatches.append(f"{name}[{index}]: {_short(x)} vs reference {_short(y)}")
                break
    return compared, mismatches


def _short(x) -> str:
    if isinstance(x, str):
        return x[:40]
    return f"{x.dtype} {tuple(x.shape)} {x.flatten()[:6].tolist()}"
