"""The NVIDIA GPUs of this machine as the driver reports them, without torch or CUDA: each
GPU's index, name, UUID, total memory, compute mode and MIG mode, the driver version, and
the GPU memory one process uses.

Asked through NVML's Python bindings (``pynvml``, the package nvidia-ml-py, in the bench and
test extras) where they import and the driver answers them; else through ``nvidia-smi``'s
CSV queries, since a GPU machine without network may lack nvidia-ml-py. A question is
answered whole by the first of the two that can. Both give the same facts in nvidia-smi's
words ("Default", "Exclusive_Process", "Enabled", "[N/A]"), so a caller cannot tell which
one answered. Where neither answers, :func:`gpus` raises :class:`GpuInfoUnavailable` saying
why, and :func:`process_memory_mib` returns None.

Used by the benchmarks' metadata (driver version), the GPU tier's ``--check`` (compute and
MIG mode), ``make verify-gpu``'s GPU check and environment stage, and the fault workers'
memory samples. Imports nothing outside the standard library until asked.

Left out: what CUDA or torch see (NVML and nvidia-smi list every GPU of the machine, whatever
CUDA_VISIBLE_DEVICES says), MIG instances, utilisation, clocks and temperatures.
"""

from __future__ import annotations

import importlib
import os
import subprocess
from dataclasses import dataclass
from typing import List, Optional, Sequence

# nvidia-smi's words for NVML's compute modes (nvmlComputeMode_t), as --query-gpu prints them.
COMPUTE_MODES = {0: "Default", 1: "Exclusive_Thread", 2: "Prohibited", 3: "Exclusive_Process"}
MIG_MODES = {0: "Disabled", 1: "Enabled"}
NOT_AVAILABLE = "[N/A]"  # nvidia-smi's word for a field the GPU does not have (MIG on most)

# What nvidia-smi is asked, one line per GPU. A driver that does not know the MIG field
# rejects the whole query: then it is asked again without it.
SMI_FIELDS = ("index", "name", "uuid", "driver_version", "memory.total", "compute_mode", "mig.mode.current")
SMI_TIMEOUT_S = 10.0


class GpuInfoUnavailable(Exception):
    """Neither NVML nor nvidia-smi answered; the message says what each said."""


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    uuid: str
    driver: str
    memory_mib: Optional[int]  # total; None where the driver does not say
    compute_mode: str
    mig_mode: Optional[str]  # "Enabled", "Disabled", "[N/A]"; None: the driver has no such field

    def listing(self) -> str:
        """The GPU's line in ``nvidia-smi -L``."""
        return f"GPU {self.index}: {self.name} (UUID: {self.uuid})"


def gpus(timeout: float = SMI_TIMEOUT_S) -> List[Gpu]:
    """Every GPU of the machine, in the driver's order (at least one). ``timeout`` bounds
    the nvidia-smi query; NVML answers in milliseconds or not at all."""
    nvml_error = None
    nvml = _pynvml()
    if nvml is not None:
        try:
            return _nvml_gpus(nvml)
        except nvml.NVMLError as exc:
            nvml_error = f"NVML: {exc}"
    try:
        return _smi_gpus(timeout)
    except GpuInfoUnavailable as exc:
        raise GpuInfoUnavailable("; ".join(filter(None, [nvml_error, str(exc)]))) from None


def process_memory_mib(pid: Optional[int] = None, timeout: float = SMI_TIMEOUT_S) -> Optional[int]:
    """The GPU memory (MiB) that process ``pid`` (default: this one) uses on the first GPU
    listing it, or None where it uses none, or the driver does not say (a GPU in MIG mode)."""
    pid = os.getpid() if pid is None else pid
    nvml = _pynvml()
    if nvml is not None:
        try:
            return _nvml_process_memory(nvml, pid)
        except nvml.NVMLError:
            pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=timeout).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_compute_apps(out, pid)


# -- through NVML ---------------------------------------------------------------------
def _pynvml():
    """The pynvml module, or None where nvidia-ml-py is not installed."""
    try:
        return importlib.import_module("pynvml")
    except ImportError:
        return None


def _text(value) -> str:
    """pynvml before 11.515 gives bytes where later releases give str."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _nvml_gpus(nvml) -> List[Gpu]:
    nvml.nvmlInit()
    try:
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        found = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            mode = nvml.nvmlDeviceGetComputeMode(handle)
            found.append(Gpu(index=index, name=_text(nvml.nvmlDeviceGetName(handle)),
                             uuid=_text(nvml.nvmlDeviceGetUUID(handle)), driver=driver,
                             memory_mib=nvml.nvmlDeviceGetMemoryInfo(handle).total // 2**20,
                             compute_mode=COMPUTE_MODES.get(mode, str(mode)),
                             mig_mode=_nvml_mig_mode(nvml, handle)))
    finally:
        nvml.nvmlShutdown()
    if not found:
        raise nvml.NVMLError(nvml.NVML_ERROR_NOT_FOUND)
    return found


def _nvml_mig_mode(nvml, handle) -> Optional[str]:
    try:
        current, _pending = nvml.nvmlDeviceGetMigMode(handle)
    except nvml.NVMLError as exc:
        # a GPU without MIG: nvidia-smi's [N/A]; a driver without the call: no such field
        if getattr(exc, "value", None) == nvml.NVML_ERROR_FUNCTION_NOT_FOUND:
            return None
        return NOT_AVAILABLE
    return MIG_MODES.get(current, str(current))


def _nvml_process_memory(nvml, pid: int) -> Optional[int]:
    nvml.nvmlInit()
    try:
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            for process in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if process.pid == pid:
                    used = process.usedGpuMemory  # bytes; None where the driver does not say
                    return None if used is None else used // 2**20
    finally:
        nvml.nvmlShutdown()
    return None


# -- through nvidia-smi ---------------------------------------------------------------
def _smi_gpus(timeout: float) -> List[Gpu]:
    for fields in (SMI_FIELDS, SMI_FIELDS[:-1]):
        try:
            out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise GpuInfoUnavailable(f"not usable: {exc}") from None
        found = parse_query_gpu(out.stdout if out.returncode == 0 else "", fields)
        if found:
            return found
    raise GpuInfoUnavailable((out.stderr or out.stdout).strip()[:200] or "no output")


def parse_query_gpu(stdout: str, fields: Sequence[str] = SMI_FIELDS) -> List[Gpu]:
    """The GPUs in ``nvidia-smi --query-gpu=<fields> --format=csv,noheader,nounits`` (fields:
    SMI_FIELDS, the MIG field may be missing); [] where the output is not that."""
    rows = [[p.strip() for p in line.split(",")] for line in stdout.strip().splitlines() if line.strip()]
    if not rows or any(len(row) != len(fields) or not row[0].isdigit() for row in rows):
        return []
    found = []
    for row in rows:
        value = dict(zip(fields, row))
        memory = value["memory.total"]
        found.append(Gpu(index=int(value["index"]), name=value["name"], uuid=value["uuid"],
                         driver=value["driver_version"], memory_mib=int(memory) if memory.isdigit() else None,
                         compute_mode=value["compute_mode"], mig_mode=value.get("mig.mode.current")))
    return found


def parse_compute_apps(text: str, pid: int) -> Optional[int]:
    """The used_memory of ``pid`` in nvidia-smi's ``pid, used_memory`` CSV (None if absent)."""
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 2 and fields[0] == str(pid):
            try:
                return int(fields[1])
            except ValueError:
                return None
    return None
