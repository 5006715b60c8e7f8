"""cupycoll's own algorithm: ring all-reduce and reduce-scatter with fp32 accumulation for
fp16/bf16, bitwise ops and results independent of timing.

* :mod:`.algorithm`: the ring on a communicator (NCCL send/recv plus CuPy RawKernels);
* :mod:`.schedule`: its schedule as plain data (chunks, slices, per-rank plans);
* :mod:`.kernels`: which (dtype, op) pairs exist and the CUDA source each compiles from
  (``cuda/``, package data).

Importing this package imports neither CuPy nor numpy; :mod:`.algorithm` loads them when a
ring is first made.
"""
