"""Names the command line accepts: collectives, data types, reduction ops, candidates.

Pure Python (no torch): each table maps the user's spelling to one canonical name, and
:func:`resolve_list` turns a comma list into canonical names or raises :class:`NameError_`
with a message meant for the user. The torch objects behind the names (``torch.float16``,
``ReduceOp.SUM``) are looked up on the rank side, not here.

Data types use nccl-tests' names in output (int8, uint8, int32, uint32, int64, uint64, half,
float, double, bfloat16); torch's spellings (float16, fp32, bf16, ...) are accepted too.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Sequence, Tuple


class NameError_(ValueError):
    """An unknown or unusable name on the command line; the message is for the user."""


# -- collectives ----------------------------------------------------------------------
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "sendrecv")
_COLLECTIVE_ALIASES = {
    "allreduce": "all_reduce", "all_reduce": "all_reduce", "ar": "all_reduce",
    "allgather": "all_gather", "all_gather": "all_gather", "ag": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "reducescatter": "reduce_scatter", "reduce_scatter": "reduce_scatter", "rs": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "broadcast": "broadcast", "bcast": "broadcast",
    "reduce": "reduce",
    "alltoall": "all_to_all", "all_to_all": "all_to_all", "all_to_all_single": "all_to_all", "a2a": "all_to_all",
    "sendrecv": "sendrecv", "send_recv": "sendrecv", "p2p": "sendrecv",
}
# Reductions take an op; broadcast and reduce take a root (nccl-tests prints "none" / -1).
REDUCING = frozenset({"all_reduce", "reduce_scatter", "reduce"})
ROOTED = frozenset({"broadcast", "reduce"})

# -- data types: canonical name -> (torch dtype attribute, bytes per element, kind) ----
DTYPES: Dict[str, Tuple[str, int, str]] = {
    "int8": ("int8", 1, "int"),
    "uint8": ("uint8", 1, "uint"),
    "int32": ("int32", 4, "int"),
    "uint32": ("uint32", 4, "uint"),
    "int64": ("int64", 8, "int"),
    "uint64": ("uint64", 8, "uint"),
    "half": ("float16", 2, "float"),
    "float": ("float32", 4, "float"),
    "double": ("float64", 8, "float"),
    "bfloat16": ("bfloat16", 2, "float"),
    # NCCL >= 2.24 (nccl-tests' names); not in "all", like every type a torch may lack.
    "f8e4m3": ("float8_e4m3fn", 1, "float"),
    "f8e5m2": ("float8_e5m2", 1, "float"),
}
# What "all" means: nccl-tests' ten classic types.
ALL_DTYPES = ("int8", "uint8", "int32", "uint32", "int64", "uint64", "half", "float", "double", "bfloat16")
_DTYPE_ALIASES = {name: name for name in DTYPES}
_DTYPE_ALIASES.update({
    "char": "int8", "int": "int32", "float16": "half", "fp16": "half", "f16": "half",
    "float32": "float", "fp32": "float", "f32": "float", "float64": "double", "fp64": "double",
    "f64": "double", "bf16": "bfloat16", "long": "int64",
    "float8_e4m3fn": "f8e4m3", "fp8_e4m3": "f8e4m3", "e4m3": "f8e4m3",
    "float8_e5m2": "f8e5m2", "fp8_e5m2": "f8e5m2", "e5m2": "f8e5m2",
})

# -- reduction ops --------------------------------------------------------------------
# nccl-tests' "all" is sum, prod, max, min, avg, mulsum (in that order). mulsum is NCCL's
# PreMulSum, here torch's dist._make_nccl_premul_sum(MULSUM_FACTOR): floating types only.
OPS = ("sum", "prod", "max", "min", "avg", "mulsum")
MULSUM_FACTOR = 2.0
BITWISE_OPS = ("band", "bor", "bxor")  # NCCL has none; only cupycoll's ring offers them
_OP_ALIASES = {name: name for name in OPS + BITWISE_OPS}
_OP_ALIASES.update({"product": "prod", "mean": "avg", "and": "band", "or": "bor", "xor": "bxor",
                    "premul_sum": "mulsum", "premulsum": "mulsum"})

# -- candidates -----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CandidateSpec:
    name: str
    library: str          # "cupycoll" or "torch"
    algorithm: str        # cupycoll's algorithm, or torch's backend name
    device: str           # "cuda" or "cpu"
    description: str


CANDIDATES: Dict[str, CandidateSpec] = {
    "cupycoll:nccl": CandidateSpec("cupycoll:nccl", "cupycoll", "nccl", "cuda",
                                   "cupycoll, NCCL collectives (the group's own algorithm)"),
    "cupycoll:ring": CandidateSpec("cupycoll:ring", "cupycoll", "ring", "cuda",
                                   "cupycoll, its own ring kernels (cupycoll.algorithm('ring'))"),
    "torch:nccl": CandidateSpec("torch:nccl", "torch", "nccl", "cuda", "torch's ProcessGroupNCCL (baseline)"),
    # Development only (--device cpu): the pipeline without a GPU; the numbers mean nothing.
    # cupycoll's CPU route is its inner gloo group, whatever the algorithm: named for what runs.
    "cupycoll:gloo": CandidateSpec("cupycoll:gloo", "cupycoll", "nccl", "cpu",
                                   "cupycoll, its CPU route (CPU tensors go to its inner gloo group)"),
    "torch:gloo": CandidateSpec("torch:gloo", "torch", "gloo", "cpu", "torch's ProcessGroupGloo (CPU)"),
}
_CANDIDATE_ALIASES = {name: name for name in CANDIDATES}
_CANDIDATE_ALIASES.update({
    "nccl": "torch:nccl", "torch": "torch:nccl", "ring": "cupycoll:ring", "gloo": "torch:gloo",
})
# What each --device can run.
ALLOWED_CANDIDATES = {"cuda": ("cupycoll:nccl", "cupycoll:ring", "torch:nccl"),
                      "cpu": ("cupycoll:gloo", "torch:gloo")}
DEFAULT_CANDIDATES = {"cuda": ("cupycoll:nccl", "cupycoll:ring", "torch:nccl"),
                      "cpu": ("cupycoll:gloo", "torch:gloo")}
BASELINE = {"cuda": "torch:nccl", "cpu": "torch:gloo"}
# cupycoll's own path on each device: what the bare name "cupycoll" means, and the candidate
# the coalescing scenario's targets judge.
CUPYCOLL = {"cuda": "cupycoll:nccl", "cpu": "cupycoll:gloo"}
# Collectives the ring algorithm implements; for the others cupycoll:ring reports n/a.
RING_COLLECTIVES = frozenset({"all_reduce", "reduce_scatter"})

SCENARIOS = ("coalescing", "overhead", "kernel")
# Scenarios of the host alone, run in the launching process (no GPU, no ranks spawned), and
# never part of "all": "store", what cupycoll's store traffic costs (bench/store_load.py).
HOST_SCENARIOS = ("store",)


def _resolve(text: str, aliases: Dict[str, str], what: str, known: Sequence[str],
             everything: Sequence[str] = ()) -> List[str]:
    names: List[str] = []
    for raw in str(text).split(","):
        item = raw.strip().lower().replace("-", "_") if what == "collective" else raw.strip().lower()
        if not item:
            continue
        if item == "all" and everything:
            picked = list(everything)
        elif item in aliases:
            picked = [aliases[item]]
        else:
            raise NameError_(f"unknown {what} {raw.strip()!r} (choose from {', '.join(known)}"
                             + (", all" if everything else "") + ")")
        names.extend(n for n in picked if n not in names)
    if not names:
        raise NameError_(f"no {what} given")
    return names


def resolve_collectives(text: str) -> List[str]:
    return _resolve(text, _COLLECTIVE_ALIASES, "collective", COLLECTIVES, COLLECTIVES)


def resolve_dtypes(text: str) -> List[str]:
    return _resolve(text, _DTYPE_ALIASES, "data type", tuple(DTYPES), ALL_DTYPES)


def resolve_ops(text: str) -> List[str]:
    return _resolve(text, _OP_ALIASES, "reduction op", OPS + BITWISE_OPS, OPS)


def resolve_candidates(text: str, device: str = "cuda") -> List[str]:
    aliases = dict(_CANDIDATE_ALIASES, cupycoll=CUPYCOLL[device])
    return _resolve(text, aliases, "backend", tuple(CANDIDATES))


def resolve_scenarios(text: str) -> List[str]:
    known = SCENARIOS + HOST_SCENARIOS
    return _resolve(text, {s: s for s in known}, "scenario", known, SCENARIOS)


def static_unsupported(candidate: str, collective: str, dtype: str, op: str, world: int) -> str:
    """Why ``candidate`` cannot run this case at all, known without running it ("" if it may).

    Whatever this does not rule out is tried; an error raised by the call itself (before
    any communication) also makes the cell "n/a".
    """
    kind = DTYPES[dtype][2]
    if op in BITWISE_OPS and kind == "float":
        return f"{op} needs an integer type"
    if op == "mulsum" and kind != "float":
        return "mulsum (PreMulSum) needs a floating type"
    if collective == "sendrecv" and world < 2:
        return "sendrecv needs 2 ranks or more"
    if candidate == "cupycoll:ring":
        if collective not in RING_COLLECTIVES:
            return "the ring implements all_reduce and reduce_scatter only"
    elif op in BITWISE_OPS:
        if candidate == "torch:gloo":
            return ""
        return "NCCL has no bitwise reductions"
    if candidate == "torch:gloo" and op == "avg":
        return "gloo has no avg"
    return ""
