"""bench/gpu_info.py: the GPU facts through NVML (a stand-in ``pynvml`` module with the real
one's names), through nvidia-smi's CSV (canned answers of ``subprocess.run``), and where
neither answers. The real NVML against a real driver runs in the GPU tier (tools/gpu_env.py
in make verify-gpu's environment stage); here, only that the real pynvml without a driver
falls back.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import gpu_info  # noqa: E402
from bench.gpu_info import Gpu  # noqa: E402

pytestmark = pytest.mark.any_stack  # its subject is the same on every stack: one CI leg runs it

H100_UUID = "GPU-5c3f2b9e-1111-2222-3333-444455556666"
A100_UUID = "GPU-0a1b2c3d-7777-8888-9999-aaaabbbbcccc"


class FakeNvml(types.ModuleType):
    """The part of pynvml that gpu_info calls, over two GPUs: an H100 without MIG (its MIG
    query is not supported) and an A100 in MIG mode, Exclusive_Process. Names come back as
    bytes, as pynvml before 11.515 gives them."""

    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_NOT_FOUND = 6
    NVML_ERROR_LIBRARY_NOT_FOUND = 12
    NVML_ERROR_FUNCTION_NOT_FOUND = 13

    def __init__(self, init_error=None, mig_error=NVML_ERROR_NOT_SUPPORTED, processes=None, count=2):
        super().__init__("pynvml")

        class NVMLError(Exception):
            def __init__(self, value):
                super().__init__(value)
                self.value = value

            def __str__(self):
                return {12: "NVML Shared Library Not Found", 6: "Not Found"}.get(self.value, f"error {self.value}")

        self.NVMLError = NVMLError
        self.init_error, self.mig_error, self.count = init_error, mig_error, count
        self.processes = processes or {}
        self.open = 0  # nvmlInit calls not yet matched by nvmlShutdown

    def nvmlInit(self):
        if self.init_error is not None:
            raise self.NVMLError(self.init_error)
        self.open += 1

    def nvmlShutdown(self):
        self.open -= 1

    def nvmlSystemGetDriverVersion(self):
        return "580.65.06"

    def nvmlDeviceGetCount(self):
        return self.count

    def nvmlDeviceGetHandleByIndex(self, index):
        return ("handle", index)

    def nvmlDeviceGetName(self, handle):
        return [b"NVIDIA H100 80GB HBM3", b"NVIDIA A100-SXM4-80GB"][handle[1]]

    def nvmlDeviceGetUUID(self, handle):
        return [H100_UUID, A100_UUID][handle[1]]

    def nvmlDeviceGetMemoryInfo(self, handle):
        return types.SimpleNamespace(total=[81559, 81920][handle[1]] * 2**20 + 12345, used=0, free=0)

    def nvmlDeviceGetComputeMode(self, handle):
        return [0, 3][handle[1]]

    def nvmlDeviceGetMigMode(self, handle):
        if handle[1] == 0 and self.mig_error is not None:
            raise self.NVMLError(self.mig_error)
        return [0, 1][handle[1]], 0

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return [types.SimpleNamespace(pid=pid, usedGpuMemory=used)
                for pid, (index, used) in self.processes.items() if index == handle[1]]


def _no_smi(argv, **kwargs):
    raise AssertionError(f"nvidia-smi asked although NVML answered: {argv}")


def _smi(answers, calls=None):
    """subprocess.run answering nvidia-smi's queries from ``answers``: query -> (status,
    stdout, stderr), the query being the argument after "nvidia-smi"."""
    def run(argv, **kwargs):
        assert argv[0] == "nvidia-smi" and kwargs.get("timeout"), (argv, kwargs)
        if calls is not None:
            calls.append(argv[1])
        status, out, err = answers[argv[1]]
        return subprocess.CompletedProcess(argv, status, out, err)
    return run


QUERY = "--query-gpu=index,name,uuid,driver_version,memory.total,compute_mode,mig.mode.current"
QUERY_WITHOUT_MIG = "--query-gpu=index,name,uuid,driver_version,memory.total,compute_mode"
SMI_TWO_GPUS = (f"0, NVIDIA H100 80GB HBM3, {H100_UUID}, 580.65.06, 81559, Default, [N/A]\n"
                f"1, NVIDIA A100-SXM4-80GB, {A100_UUID}, 580.65.06, 81920, Exclusive_Process, Enabled\n")
TWO_GPUS = [Gpu(0, "NVIDIA H100 80GB HBM3", H100_UUID, "580.65.06", 81559, "Default", "[N/A]"),
            Gpu(1, "NVIDIA A100-SXM4-80GB", A100_UUID, "580.65.06", 81920, "Exclusive_Process", "Enabled")]


@pytest.fixture
def no_pynvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError


# -- NVML -------------------------------------------------------------------------------------

def test_nvml_gives_the_facts_in_nvidia_smis_words(monkeypatch):
    nvml = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(gpu_info.subprocess, "run", _no_smi)
    assert gpu_info.gpus() == TWO_GPUS
    assert nvml.open == 0  # every nvmlInit is shut down again


def test_nvml_and_nvidia_smi_give_the_same_gpus(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml())
    through_nvml = gpu_info.gpus()
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(gpu_info.subprocess, "run", _smi({QUERY: (0, SMI_TWO_GPUS, "")}))
    assert gpu_info.gpus() == through_nvml


def test_a_driver_without_nvmls_mig_call_has_no_mig_mode(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(mig_error=FakeNvml.NVML_ERROR_FUNCTION_NOT_FOUND))
    assert gpu_info.gpus()[0].mig_mode is None


def test_nvml_that_cannot_start_hands_the_question_to_nvidia_smi(monkeypatch):
    nvml = FakeNvml(init_error=FakeNvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    calls = []
    monkeypatch.setattr(gpu_info.subprocess, "run", _smi({QUERY: (0, SMI_TWO_GPUS, "")}, calls))
    assert gpu_info.gpus() == TWO_GPUS and calls == [QUERY]


def test_nvml_without_gpus_hands_the_question_to_nvidia_smi(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(count=0))
    none = (6, "No devices were found\n", "")
    monkeypatch.setattr(gpu_info.subprocess, "run", _smi({QUERY: none, QUERY_WITHOUT_MIG: none}))
    with pytest.raises(gpu_info.GpuInfoUnavailable, match=r"^NVML: Not Found; No devices were found$"):
        gpu_info.gpus()


def test_process_memory_through_nvml(monkeypatch):
    me = os.getpid()
    nvml = FakeNvml(processes={me: (1, 600 * 2**20 + 5), 77: (0, None)})
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(gpu_info.subprocess, "run", _no_smi)
    assert gpu_info.process_memory_mib() == 600  # this process, found on GPU 1
    assert gpu_info.process_memory_mib(77) is None  # listed, memory not reported
    assert gpu_info.process_memory_mib(5) is None  # not listed
    assert nvml.open == 0


# -- nvidia-smi -------------------------------------------------------------------------------

def test_without_pynvml_nvidia_smis_csv_is_read(monkeypatch, no_pynvml):
    calls = []
    monkeypatch.setattr(gpu_info.subprocess, "run", _smi({QUERY: (0, SMI_TWO_GPUS, "")}, calls))
    assert gpu_info.gpus() == TWO_GPUS and calls == [QUERY]


def test_a_driver_without_the_mig_field_is_asked_again_without_it(monkeypatch, no_pynvml):
    calls = []
    rejected = (2, "", 'Field "mig.mode.current" is not a valid field to query.\n')
    old = f"0, Tesla V100-SXM2-16GB, {H100_UUID}, 418.87.01, 16130, Default\n"
    monkeypatch.setattr(gpu_info.subprocess, "run", _smi({QUERY: rejected, QUERY_WITHOUT_MIG: (0, old, "")}, calls))
    assert gpu_info.gpus() == [Gpu(0, "Tesla V100-SXM2-16GB", H100_UUID, "418.87.01", 16130, "Default", None)]
    assert calls == [QUERY, QUERY_WITHOUT_MIG]


def test_unreadable_nvidia_smi_output_is_no_gpu():
    assert gpu_info.parse_query_gpu("") == []
    assert gpu_info.parse_query_gpu("No devices were found\n") == []
    assert gpu_info.parse_query_gpu(SMI_TWO_GPUS + "garbage\n") == []
    # a memory the driver does not report
    (gpu,) = gpu_info.parse_query_gpu(SMI_TWO_GPUS.splitlines()[0].replace("81559", "[N/A]"))
    assert gpu.memory_mib is None


def test_the_listing_is_nvidia_smi_dash_ls_line():
    assert TWO_GPUS[0].listing() == f"GPU 0: NVIDIA H100 80GB HBM3 (UUID: {H100_UUID})"


def test_process_memory_is_read_from_nvidia_smi_csv(monkeypatch, no_pynvml):
    text = "1234, 512\n99, 80\n"
    assert gpu_info.parse_compute_apps(text, 99) == 80 and gpu_info.parse_compute_apps(text, 1234) == 512
    assert gpu_info.parse_compute_apps(text, 5) is None and gpu_info.parse_compute_apps("[N/A]\n", 5) is None
    monkeypatch.setattr(gpu_info.subprocess, "run", _smi({"--query-compute-apps=pid,used_memory": (0, text, "")}))
    assert gpu_info.process_memory_mib(99) == 80


# -- neither ----------------------------------------------------------------------------------

def _missing(argv, **kwargs):
    raise FileNotFoundError(2, "No such file or directory", argv[0])


def test_without_nvml_or_nvidia_smi_the_error_says_why(monkeypatch, no_pynvml):
    monkeypatch.setattr(gpu_info.subprocess, "run", _missing)
    with pytest.raises(gpu_info.GpuInfoUnavailable) as caught:
        gpu_info.gpus()
    assert str(caught.value) == "not usable: [Errno 2] No such file or directory: 'nvidia-smi'"
    assert gpu_info.process_memory_mib() is None


def test_a_failed_nvml_is_named_beside_nvidia_smi(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(init_error=FakeNvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    monkeypatch.setattr(gpu_info.subprocess, "run", _missing)
    with pytest.raises(gpu_info.GpuInfoUnavailable, match=r"^NVML: NVML Shared Library Not Found; not usable: "):
        gpu_info.gpus()
    assert gpu_info.process_memory_mib() is None


def test_the_real_pynvml_without_a_driver_falls_back(monkeypatch):
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this machine has an NVIDIA driver")
    monkeypatch.setattr(gpu_info.subprocess, "run", _missing)
    with pytest.raises(gpu_info.GpuInfoUnavailable, match=r"^NVML: .+; not usable: "):
        gpu_info.gpus()
    assert gpu_info.process_memory_mib() is None
