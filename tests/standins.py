"""Stand-in process groups for CPU tests of logic that normally runs on CUDA.

:class:`CpuAsCudaGroup` is the real ProcessGroupCupycoll with two routing seams replaced (no
inner gloo group; CPU tensors take the CUDA route, after the real type and mixing checks)
and one backend seam: :class:`CpuAsCudaBackend`, the real CudaBackend for which every tensor
counts as being on ``cuda:0``. What happens after that (queueing, enqueue, faults) is the
real code unless a test's subclass of the backend replaces it. The GPU tier runs the same
paths for real.
"""

from __future__ import annotations

import torch

from cupycoll.backend import CudaBackend
from cupycoll.errors import CupycollValueError
from cupycoll.process_group import ProcessGroupCupycoll

CUDA = torch.device("cuda", 0)


class CpuAsCudaBackend(CudaBackend):
    def check_device(self, tensor, what):
        if not tensor.is_contiguous():
            raise CupycollValueError(f"{what} is not contiguous")
        return CUDA


class CpuAsCudaGroup(ProcessGroupCupycoll):
    backend_class = CpuAsCudaBackend

    def _build_cpu_group(self, store, rank, size, timeout):
        return None

    def _classify(self, tensors, op_name):
        super()._classify(tensors, op_name)  # the real mixing/type checks, CPU tensors stand in
        return True
