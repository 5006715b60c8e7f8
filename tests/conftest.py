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
