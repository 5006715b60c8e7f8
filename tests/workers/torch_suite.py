"""torch's own DistributedTest (``torch.testing._internal.distributed.distributed_test``) run
against cupycoll's CPU route: every ``init_process_group(backend="gloo")`` the suite makes
creates a ``"cupycoll"`` group instead, so the suite's gloo expectations (results, error
types, the words of a timeout) hold cupycoll to what gloo users rely on.

Run by tests/multiproc/test_torch_suite.py in a pytest process of its own, with BACKEND=gloo,
WORLD_SIZE and TEMP_DIR set as torch's suite expects; each test spawns its ranks, which
import this module again (so the redirection holds in them too). Needs ``expecttest``
(the ``test`` extra), as torch's testing module does.

Left out: the suite's subgroups created with an explicit ``backend="gloo"`` stay plain gloo
(the suite names the backend it compares against), and its CUDA tests skip without a GPU.
"""

from __future__ import annotations

import os

import torch.distributed as dist

import cupycoll  # noqa: F401 - registers the backend

_init_process_group = dist.init_process_group


def _init_as_cupycoll(*args, backend=None, **kwargs):
    if backend == "gloo":
        backend = "cupycoll"
    return _init_process_group(*args, backend=backend, **kwargs)


dist.init_process_group = _init_as_cupycoll

# torch's test harness reads any non-empty CI as torch's own CI and then writes XML reports
# through xmlrunner, which this suite neither needs nor installs.
os.environ.pop("CI", None)

from torch.testing._internal.common_utils import run_tests  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest, TestDistBackend)


class TestCupycollCpuRoute(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()


if __name__ == "__main__":
    run_tests()
