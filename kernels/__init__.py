"""CUDA C++ sources of the ring-reduce RawKernels, shipped as package data (cupycoll.kernels)."""
