"""Stage 1 of ``make verify-gpu``: what this GPU machine has, as JSON.

GPU name, count, compute capability and memory, driver, compute mode (anything but Default
is a problem: ranks sharing a GPU need it) and MIG mode, Python, torch (and its CUDA and
NCCL), CuPy, the CUDA runtime, the NCCL version as CuPy loaded it and as cupycoll's ctypes
bindings loaded it (with the library path; the two must agree, or cupycoll would drive two
different NCCLs), and one tiny CUDA computation through torch and through CuPy. The
driver's figures (GPU name, driver, memory, the modes) come from bench/gpu_info.py: NVML, or
nvidia-smi where nvidia-ml-py is not installed.

``python -m tools.gpu_env [--json PATH]`` prints one ``key: value`` line per figure.
Exit status: 0 all good; 1 something is missing or disagrees (the JSON says what, under
"problems"); 3 torch sees no CUDA GPU (nothing else on the CUDA path can run).

Left out: anything that needs a second process or a communicator (the later stages).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from typing import Dict, List

from bench import gpu_info
from cupycoll.nccl import bindings as nccl_bindings
from cupycoll.nccl import header as nccl_header

NO_GPU_EXIT = 3


def _cuda_text(code: int) -> str:
    return f"{code // 1000}.{code // 10 % 100}"


def smi_figures(found: List[gpu_info.Gpu]) -> Dict:
    """The driver's figures (NVML's, or nvidia-smi's where nvidia-ml-py is absent): name,
    driver and memory of the first GPU; the compute mode and the MIG mode of all of them
    ("Default", or "GPU 0: Default; GPU 1: Exclusive_Process" where they differ; no MIG mode
    where the driver has no such field)."""
    first = found[0]
    memory = gpu_info.NOT_AVAILABLE if first.memory_mib is None else f"{first.memory_mib} MiB"
    info = {"smi_name": first.name, "driver": first.driver, "smi_memory": memory,
            "compute_modes": [gpu.compute_mode for gpu in found]}
    info["compute_mode"] = _per_gpu(info["compute_modes"])
    if all(gpu.mig_mode is not None for gpu in found):
        info["mig_mode"] = _per_gpu([gpu.mig_mode for gpu in found])
    return info


def _per_gpu(values: List[str]) -> str:
    if len(set(values)) == 1:
        return values[0]
    return "; ".join(f"GPU {index}: {value}" for index, value in enumerate(values))


def smi_problems(info: Dict) -> List[str]:
    """Ranks sharing one GPU (the tier, the demo and the benchmarks on a one-GPU machine) each
    open a CUDA context on it: only the Default compute mode allows that (Exclusive_Process
    lets one process in, Prohibited none), so any other mode fails them at their first CUDA
    call, on every test."""
    return [f"GPU {index} is in compute mode {mode}, not Default: several ranks sharing one GPU each need a "
            f"CUDA context on it, which only Default allows (set it with `nvidia-smi -i {index} -c DEFAULT`, "
            "as root)"
            for index, mode in enumerate(info.get("compute_modes", [])) if mode != "Default"]


def _driver_figures() -> Dict:
    """smi_figures of this machine's GPUs; where the driver does not answer, ``nvidia_smi``:
    what it said."""
    try:
        return smi_figures(gpu_info.gpus())
    except gpu_info.GpuInfoUnavailable as exc:
        return {"nvidia_smi": str(exc)}


def collect() -> (Dict, List[str], int):
    info: Dict = {"python": platform.python_version(), "host": platform.node(),
                  "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", "(unset)")}
    problems: List[str] = []
    info.update(_driver_figures())
    problems += smi_problems(info)
    info.pop("compute_modes", None)  # in compute_mode, per GPU where they differ
    import torch

    info["torch"] = torch.__version__
    info["torch_cuda"] = torch.version.cuda or "none"
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        why = "this torch was built without CUDA" if torch.version.cuda is None else "torch sees no CUDA GPU"
        problems.append(f"no GPU for torch: {why}")
        return info, problems, NO_GPU_EXIT
    info["gpus"] = torch.cuda.device_count()
    props = torch.cuda.get_device_properties(0)
    info["gpu"] = props.name
    info["compute_capability"] = f"{props.major}.{props.minor}"
    info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
    try:
        version = torch.cuda.nccl.version()  # (2, 28, 3); an int code in old releases
        info["nccl_torch"] = nccl_header.version_text(version)
    except Exception as exc:  # noqa: BLE001 - torch may be built without NCCL
        info["nccl_torch"] = f"n/a ({exc})"
    try:
        x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
        ok = float(x.sum().item()) == float((1 << 20) * ((1 << 20) - 1) // 2)
        info["torch_cuda_op"] = "ok" if ok else "wrong result"
        if not ok:
            problems.append("a sum on the GPU through torch gave a wrong result")
    except Exception as exc:  # noqa: BLE001
        info["torch_cuda_op"] = f"failed: {exc}"
        problems.append(f"a CUDA operation through torch failed: {exc}")

    try:
        import cupy
        from cupy.cuda import nccl

        info["cupy"] = cupy.__version__
        info["cuda_runtime"] = _cuda_text(cupy.cuda.runtime.runtimeGetVersion())
        info["cuda_driver_api"] = _cuda_text(cupy.cuda.runtime.driverGetVersion())
        if not getattr(nccl, "available", False):
            problems.append("CuPy found no NCCL library")
        else:
            info["nccl_cupy"] = nccl_header.version_text(nccl.get_version())
        y = cupy.arange(1024, dtype=cupy.float32)
        info["cupy_cuda_op"] = "ok" if float(y.sum()) == 1023 * 512 else "wrong result"
    except Exception as exc:  # noqa: BLE001
        problems.append(f"CuPy: {type(exc).__name__}: {exc}")

    try:
        library = nccl_bindings.load(os.environ.get("CUPYCOLL_NCCL_LIBRARY") or None)
        info["nccl_bindings"] = nccl_header.version_text(library.version())
        info["nccl_library"] = library.path
        if library.missing:
            info["nccl_bindings_missing"] = library.missing
    except Exception as exc:  # noqa: BLE001
        problems.append(f"cupycoll's NCCL bindings: {type(exc).__name__}: {exc}")
    if info.get("nccl_cupy") and info.get("nccl_bindings") and info["nccl_cupy"] != info["nccl_bindings"]:
        problems.append(f"NCCL versions disagree: CuPy loaded {info['nccl_cupy']}, the ctypes bindings "
                        f"{info['nccl_bindings']} ({info.get('nccl_library')})")
    try:
        import cupycoll

        info["cupycoll"] = cupycoll.__version__
    except Exception as exc:  # noqa: BLE001
        problems.append(f"import cupycoll: {exc}")
    return info, problems, (1 if problems else 0)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.gpu_env", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    info, problems, status = collect()
    info["problems"] = problems
    for key, value in info.items():
        if key != "problems":
            print(f"{key}: {value}")
    for problem in problems:  # last, so that a one-line report of the step shows it
        print(f"problem: {problem}")
    sys.stdout.flush()
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(info, fh, indent=1)
    return status


if __name__ == "__main__":
    sys.exit(main())
