"""Version differences in how torch's calls are made: the tensor collectives' names, the
short forms' timeout, what an options object and a ReduceOp carry, the current stream's raw
pointer.

Left out: the forms cupycoll binds (:mod:`cupycoll.call_forms`, which takes every form on
every release), and gloo's own differences (:mod:`cupycoll.compat.gloo`).
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from .release import TORCH


# torch 2.13 renamed the tensor-in/tensor-out collectives all_gather_into_tensor and
# reduce_scatter_tensor to all_gather_single and reduce_scatter_single; the old names, which
# every supported version has, warn there ("... is deprecated"). 2.11 has only the old
# names; 2.12 is not run (the rename, the stack of pytorch#186134, came in June 2026, after
# its release), and the old names work there anyway. For callers outside the package (the
# benchmark): warning-free on every version. The same release binds ProcessGroup's methods
# under the new names too (all_gather_single, all_gather_single_coalesced,
# reduce_scatter_single, reduce_scatter_single_coalesced, all_to_all_single) next to the old
# ones (_allgather_base, allgather_into_tensor_coalesced, _reduce_scatter_base,
# reduce_scatter_tensor_coalesced, alltoall_base); 2.11 and 2.7.1 bind the old ones alone
# (run here). A cupycoll group answers both names on every release.
TENSOR_COLLECTIVES_RENAMED = TORCH >= (2, 13)
if TENSOR_COLLECTIVES_RENAMED:
    all_gather_single = dist.all_gather_single
    reduce_scatter_single = dist.reduce_scatter_single
else:
    all_gather_single = dist.all_gather_into_tensor
    reduce_scatter_single = dist.reduce_scatter_tensor



# torch 2.9 gave every short form of ProcessGroup's methods (a bare op, a root, one tensor) a
# trailing ``timeout`` and added the forms alltoall_base(..., timeout) and barrier(timeout)
# (pytorch#158123, July 2025, after 2.8's branch cut). Run here: 2.11, 2.13 and 2.15 bind
# them, 2.7.1 does not; 2.8 - 2.10 are not run. cupycoll.call_forms takes the timeouts on
# every release (2.7.1's binding refuses such a call, and binds no other form to it), so
# nothing in the package branches on this: it says which forms this torch's own binding has.
SHORT_FORMS_TAKE_TIMEOUT = TORCH >= (2, 9)



def premul_factor(reduce_op) -> Optional[object]:
    """The factor of a ``ReduceOp`` made by ``dist._make_nccl_premul_sum`` (a number or a
    one-element tensor); None when ``reduce_op`` carries none."""
    # torch 2.13 binds ReduceOp.factor; 2.7-2.12 do not, and reading it there made a valid
    # PREMUL_SUM op look like one without a factor. The pickling state is the same on all
    # of them: __getstate__() returns (op, factor), factor None unless PREMUL_SUM.
    if type(reduce_op) is not ReduceOp:  # a bare RedOpType carries no factor
        return None
    state = reduce_op.__getstate__()
    return state[1] if len(state) > 1 else None



#: torch 2.11: every options object has ``asyncOp`` (2.7 has it on the options of broadcast,
#: all-gather, scatter and reduce-scatter only; 2.8 - 2.10 are not run).
EVERY_OPTIONS_HAS_ASYNC_OP = TORCH >= (2, 11)

if EVERY_OPTIONS_HAS_ASYNC_OP:
    #: async_requested(opts): did the caller pass ``async_op=True``? (One C call: the hot path's.)
    async_requested = operator.attrgetter("asyncOp")
else:
    def async_requested(opts) -> bool:
        """Did the caller pass ``async_op=True``? Where an options object has no asyncOp,
        torch waits on the Work itself, so the call counts as asynchronous."""
        return bool(getattr(opts, "asyncOp", True))



# The current stream's raw pointer in one C call: torch._C._cuda_getCurrentRawStream (every
# CUDA build from 1.10 to 2.15; what Inductor's generated code calls), about 0.2 µs where
# torch.cuda.current_stream() builds a Python Stream (about 4 µs). A build without it (CPU
# builds, and the stand-ins of the CPU tests) takes the public call.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_stream_pointer(device_index: int) -> int:
    return torch.cuda.current_stream(device_index).cuda_stream


#: current_raw_stream(device_index): the current CUDA stream of device ``device_index`` on
#: this thread, as a raw pointer (the C call itself where torch has it: no Python frame).
current_raw_stream = _raw_stream if _raw_stream is not None else _current_stream_pointer
