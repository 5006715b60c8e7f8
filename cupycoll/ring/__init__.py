"""cupycoll's own algorithm: ring all-reduce and reduce-scatter with fp32 accumulation for
fp16/bf16, bitwise ops and results independent of timing.

* :mod:`.algorithm`: the ring on a communicator (NCCL send/recv plus CuPy RawKernels);
* :mod:`.programs`: its calls compiled, once each, into flat programs of launches;
* :mod:`.schedule`: its schedule as plain data (chunks, slices, per-rank plans);
* :mod:`.stream_order`: those plans on two streams, ordered by events, and their launches;
* :mod:`.kernels`: which (dtype, op) pairs exist and the CUDA source each compiles from
  (``cuda/``, package data; compiled as every algorithm's is, :mod:`cupycoll.kernels`).

:data:`ALGORITHM` is what the seam (:mod:`cupycoll.algorithms`) knows of it: under ``auto``
it takes over the bitwise ops, which NCCL lacks. Importing this package imports neither
CuPy nor numpy; :mod:`.algorithm` loads them when a ring is first made.
"""

from ..algorithms import Algorithm
from .kernels import check


def _ring(communicator, settings):
    from .algorithm import Ring  # CuPy and numpy: only a group that runs the ring pays for them

    return Ring(communicator, settings.ring_scratch_bytes)


ALGORITHM = Algorithm("ring", check=check, takes_over=frozenset({"band", "bor", "bxor"}), make_runner=_ring)
