"""Benchmark: the ring's reduction kernel against the same GPU's device-to-device copy.

For each dtype and size, times ``ring_reduce`` (one ring step: read this rank's elements and
the incoming fp32/element partials, write the new partials) and ``ring_reduce_final`` (the
last step: read both, write elements), and a ``cudaMemcpyAsync`` device-to-device copy of
the same number of bytes as the kernel reads. Effective bandwidth is bytes read plus bytes
written over the median time of ``iterations`` timed runs (CUDA events) after ``warmup``
untimed ones; the copy's is 2 x bytes over its time. One GPU, no communicator.

    python -m bench.ring_kernels [--sizes 1M,16M,256M,1G] [--dtypes float32,float16,bfloat16]

``run(...)`` returns the table as a dict for the benchmark CLI; ``main(argv)`` prints it.

Deliberately left out: NCCL transfers (the kernels alone, so a slow kernel cannot hide
behind the network) and any pass/fail threshold (numbers, not tests).
"""

from __future__ import annotations

import argparse
import statistics
from typing import Dict, List, Optional, Sequence

from .sizes import SizeError, format_bytes, parse_size

DEFAULT_SIZES = (1 << 20, 1 << 24, 1 << 28, 1 << 30)  # bytes of input elements
DEFAULT_DTYPES = ("float32", "float16", "bfloat16")


def _median_seconds(cupy, stream, body, iterations: int, warmup: int) -> float:
    for _ in range(warmup):
        body()
    times = []
    for _ in range(iterations):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        body()
        stop.record(stream)
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
    return statistics.median(times)


def run(sizes: Sequence[int] = DEFAULT_SIZES, dtypes: Sequence[str] = DEFAULT_DTYPES,
        iterations: int = 20, warmup: int = 3, device: int = 0, verbose: bool = True) -> Dict:
    """Time the kernels; returns ``{"device": name, "rows": [...]}``, one row per
    (dtype, size, kernel) with seconds, bytes moved, GB/s and the ratio to the copy."""
    from cupycoll import _cuda
    from cupycoll.ring import kernels as _kernels
    from cupycoll.ring import programs

    if iterations < 1 or warmup < 0:
        raise ValueError("iterations must be >= 1 and warmup >= 0")
    cupy = _cuda.cupy_module()
    rows: List[Dict] = []
    with cupy.cuda.Device(device):
        name = cupy.cuda.runtime.getDeviceProperties(device)["name"]
        name = name.decode() if isinstance(name, bytes) else name
        stream = cupy.cuda.Stream(non_blocking=True)
        for dtype in dtypes:
            _kernels.check(dtype, "sum")
            element = _kernels.ELEMENTS[dtype]
            kernels = _kernels.compile_module(_cuda.CUDA, device, dtype, "sum")
            for size in sizes:
                n = size // element.itemsize
                local = cupy.ones(n * element.itemsize, dtype=cupy.uint8)
                partial = cupy.zeros(n * element.acc_itemsize, dtype=cupy.uint8)
                final = cupy.empty(n * element.itemsize, dtype=cupy.uint8)
                read_bytes = n * (element.itemsize + element.acc_itemsize)
                copy_src = cupy.empty(read_bytes, dtype=cupy.uint8)
                copy_dst = cupy.empty(read_bytes, dtype=cupy.uint8)

                def copy():
                    cupy.cuda.runtime.memcpyAsync(copy_dst.data.ptr, copy_src.data.ptr, read_bytes,
                                                  cupy.cuda.runtime.memcpyDeviceToDevice, stream.ptr)

                copy_seconds = _median_seconds(cupy, stream, copy, iterations, warmup)
                copy_gbps = 2 * read_bytes / copy_seconds / 1e9
                for kind, out, written in (
                    ("ring_reduce", partial, n * element.acc_itemsize),
                    ("ring_reduce_final", final, n * element.itemsize),
                ):
                    def step(kind=kind, out=out):
                        programs.launch_kernel(_cuda.CUDA, kernels[kind], dtype, local.data.ptr,
                                               partial.data.ptr, out.data.ptr, n, stream.ptr)

                    seconds = _median_seconds(cupy, stream, step, iterations, warmup)
                    moved = read_bytes + written
                    gbps = moved / seconds / 1e9
                    rows.append({"dtype": dtype, "size_bytes": size, "kernel": kind,
                                 "seconds": seconds, "bytes_moved": moved, "gbps": gbps,
                                 "copy_gbps": copy_gbps, "ratio_to_copy": gbps / copy_gbps})
                    if verbose:
                        print(f"{dtype:>9} {format_bytes(size):>8} {kind:>18} {seconds * 1e6:10.1f} us "
                              f"{gbps:8.1f} GB/s  copy {copy_gbps:8.1f} GB/s  "
                              f"{100 * gbps / copy_gbps:5.1f}%", flush=True)
                del local, partial, final, copy_src, copy_dst
                cupy.get_default_memory_pool().free_all_blocks()
    return {"device": name, "iterations": iterations, "warmup": warmup, "rows": rows}


def main(argv: Optional[Sequence[str]] = None) -> Dict:
    parser = argparse.ArgumentParser(prog="ring_kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=",".join(format_bytes(s).replace(" ", "") for s in DEFAULT_SIZES),
                        help="comma-separated input sizes in bytes (suffixes K, M, G)")
    parser.add_argument("--dtypes", default=",".join(DEFAULT_DTYPES))
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        sizes = [parse_size(s, "--sizes") for s in args.sizes.split(",") if s.strip()]
    except SizeError as exc:
        parser.error(str(exc))
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    print(f"{'dtype':>9} {'size':>8} {'kernel':>18} {'median':>13} {'effective':>13}  "
          f"{'d2d copy':>15}  of copy")
    result = run(sizes, dtypes, args.iterations, args.warmup, args.device)
    print(f"device: {result['device']}; median of {args.iterations} after {args.warmup} warm-up")
    return result


if __name__ == "__main__":
    main()
