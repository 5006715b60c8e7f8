"""What every test folder shares: tests/ on the import path, so that test modules import the
support modules here (mp, standins, faulty, shapes, ...) by name and never one another; the
GPU tests skipped without a GPU; the tests that start processes first under worksteal; and
the fixtures used in more than one folder, which import cupycoll only when they run (the
tooling's tests need none of it)."""

import fcntl
import os
import pickle
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_collection_modifyitems(config, items):
    # Under `--dist worksteal` (make test), the tests that start processes first, in their
    # order: a worker that runs out takes half of the other's queue from its end, so the
    # run then ends on short tests, not on one worker's last launch while the other has
    # nothing left. (pytest-xdist's default scheduler would hand them all to one worker.)
    if getattr(config.option, "dist", "no") == "worksteal":
        items.sort(key=lambda item: item.get_closest_marker("launches") is None)
    from mp import gpu_count

    if gpu_count():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible to torch here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def once_per_run(tmp_path_factory):
    """``once_per_run(name, produce)``: what ``produce()`` returns, made once in this run and
    kept for it. Under pytest-xdist the first worker to ask makes it while the others wait,
    then read it (pickled beside the workers' temporary folders): a module fixture that runs
    ranks in processes runs once even when its module's tests are spread over the workers.
    A ``produce()`` that raises shares nothing: the next test to ask runs it again."""
    made = {}
    # the run's folder, above each worker's own (pytest-xdist gives each one below it)
    shared = tmp_path_factory.getbasetemp().parent if os.environ.get("PYTEST_XDIST_WORKER") else None

    def once(name, produce):
        if name in made:
            return made[name]
        if shared is None:
            made[name] = produce()
            return made[name]
        path = shared / f"once-{name}.pickle"
        with open(shared / f"once-{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if path.exists():
                made[name] = pickle.loads(path.read_bytes())
            else:
                made[name] = produce()
                partial = path.with_suffix(".partial")
                partial.write_bytes(pickle.dumps(made[name]))
                partial.replace(path)
        return made[name]
    return once


@pytest.fixture(autouse=True)
def cuda_standins():
    """The CUDA runtime of the groups and communicators a test builds: a fresh device ledger
    (tests/standins.py's DeviceLedger: a current device per thread, the contexts made, the
    device of every object), which a test may ask for by this name to look into it."""
    from standins import DeviceLedger  # imports cupycoll: only once a test runs
    from cupycoll import _cuda

    with _cuda.install(DeviceLedger()) as ledger:
        yield ledger


@pytest.fixture
def no_device(cuda_standins):
    """The runtime of a Communicator (cupycoll.nccl.communicator) on CPU: the device ledger."""
    return cuda_standins


@pytest.fixture
def made(monkeypatch, no_device):
    """Communicator.begin with a RecordingLibrary (tests/faulty.py) on the device ledger:
    ``made(nonblocking, **lib)``."""
    from cupycoll.nccl import communicator as communicator_module
    from cupycoll.nccl.communicator import Communicator
    from faulty import RecordingLibrary

    def make(nonblocking=False, **kwargs):
        library = RecordingLibrary(**kwargs)
        monkeypatch.setattr(communicator_module, "_library", lambda path=None: library)
        comm = Communicator.begin(b"\1" * 128, 0, 3, 0, nonblocking=nonblocking, timeout=60.0)
        comm.wait_ready()  # a nonblocking one's creation settles (the library answers ncclSuccess)
        return comm
    return make
