import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_collection_modifyitems(config, items):
    from mp import gpu_count

    if gpu_count():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible to torch here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cuda_standins(monkeypatch):
    """The few torch.cuda calls of the issue path, answered on CPU."""
    from standins import use_cuda_standins  # imports cupycoll: only where it is used

    use_cuda_standins(monkeypatch.setattr)
