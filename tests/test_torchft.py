"""cupycoll.torchft against torchft's own tests: its process-group patterns
(``torchft.process_group_test``: every collective torchft's groups answer, on ranks that are
threads of this process, then again after a reconfigure with one rank crashed) and its
Manager integration tests (``torchft.manager_integ_test``: DDP under a Manager, healthy, with
a replica failing mid-run and recovering, on 2 ranks per replica), with the group they build
replaced by cupycoll's. Also what cupycoll adds: ``errored()`` is the group's end (its fault
the cause), read from it, until the next quorum; ``shutdown()`` ends the group.

Skipped where torchft is not installed (CI installs the pinned torchft on one leg: the
Makefile's TORCHFT_SPEC, set in .ci/run). The Manager run with replicas as processes killed
and restarted is examples/torchft_ddp.py's (tests/multiproc/test_examples.py).
"""

from __future__ import annotations

import os
from datetime import timedelta
from unittest import TestCase, mock

import pytest
import torch
import torch.distributed as dist

from cupycoll import compat

pytest.importorskip("torchft", reason="torchft is not installed (CI's today leg installs it: TORCHFT_SPEC)")
pytest.importorskip("parameterized", reason="torchft's tests need parameterized (installed with torchft)")

from parameterized import parameterized  # noqa: E402
from torch.distributed import TCPStore  # noqa: E402
from torchft import manager_integ_test as integration  # noqa: E402
from torchft import process_group_test as patterns  # noqa: E402
from torchft.manager import Manager  # noqa: E402

from cupycoll.errors import CommunicatorAbortedError  # noqa: E402
from cupycoll.torchft import ProcessGroupCupycoll  # noqa: E402

# torchft's pattern for reduce_scatter_tensor_coalesced hands a [W] output for a [W, W]
# input, which NCCL takes (it counts elements) and gloo refuses ("outputShape[0] * worldSize
# == inputShape[0]"): the CPU route is gloo's, so it is left out here as torchft leaves it out
# for its gloo group. torchft's CPU run of reduce_scatter returns before calling anything.
CPU_COLLECTIVES = [c for c in patterns._ALL_COLLECTIVES if c != "reduce_scatter_tensor_coalesced"]
BACKEND_SHAPE = pytest.mark.skipif(not compat.PY_BACKEND,
                                   reason=f"torch {torch.__version__} has no Backend shape (2.14 added it)")


def _store():
    return TCPStore(host_name="localhost", port=0, is_master=True, wait_for_workers=False)


class _Shape:
    """A test class whose groups take the shape SHAPE (CUPYCOLL_SHAPE, read at each group's creation)."""

    SHAPE = "process_group"

    @classmethod
    def setUpClass(cls) -> None:
        cls._shape_before = os.environ.get("CUPYCOLL_SHAPE")
        os.environ["CUPYCOLL_SHAPE"] = cls.SHAPE
        super().setUpClass()

    @classmethod
    def tearDownClass(cls) -> None:
        super().tearDownClass()
        if cls._shape_before is None:
            os.environ.pop("CUPYCOLL_SHAPE", None)
        else:
            os.environ["CUPYCOLL_SHAPE"] = cls._shape_before


class CupycollCollectivesTest(_Shape, patterns.MultiPgBaseTest):
    """torchft's NormalGlooMultiPgTest with cupycoll's group: 3 ranks, each collective, then
    each after a reconfigure in which the last rank crashes (the others must fail, not hang)."""

    WORLD_SIZE = 3

    @classmethod
    def _create_pg(cls, backend: str):
        return ProcessGroupCupycoll(timeout=timedelta(seconds=1))  # torchft's gloo group's timeout

    @parameterized.expand(CPU_COLLECTIVES)
    def test_collective(self, collective: str) -> None:
        self._run_parallel(collective, device="cpu")

    @parameterized.expand(CPU_COLLECTIVES)
    def test_collective_with_resiliency(self, collective: str) -> None:
        self._run_with_resiliency(collective, device="cpu")


@BACKEND_SHAPE
class CupycollCollectivesBackendShapeTest(CupycollCollectivesTest):
    SHAPE = "backend"


class CupycollGroupTest(_Shape, TestCase):
    """torchft's ProcessGroupTest patterns on one rank: its every-API check (each call form
    torchft uses, the Works' futures, DDP) before and after a reconfigure, its functional
    collectives through a registered group, and a configure whose peers never come."""

    def test_every_api_then_ddp_then_again_after_a_reconfigure(self) -> None:
        store = _store()
        pg = ProcessGroupCupycoll()
        pg.configure(f"localhost:{store.port}/prefix", "0", 0, 1)
        self.assertEqual(pg.size(), 1)
        works = patterns._test_pg(pg, torch.tensor([2]))
        self.assertIn("reduce_scatter", works)  # gloo's lacks a future; cupycoll's answers
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 4), process_group=pg)
        model(torch.rand(2, 3)).sum().backward()
        pg.configure(f"localhost:{store.port}/prefix2", "0", 0, 1)
        patterns._test_pg(pg, torch.tensor([2]))
        pg.shutdown()

    def test_functional_collectives_reach_the_registered_group(self) -> None:
        patterns.dummy_init_pg()
        try:
            store = _store()
            pg = ProcessGroupCupycoll().register(f"cupycoll_functional_{self.SHAPE}")
            pg.configure(f"localhost:{store.port}/prefix", "0", 0, 1)
            t = torch.full((10,), 3.0)
            dist._functional_collectives.all_reduce(t, "sum", pg).wait()
            torch.testing.assert_close(t, torch.full((10,), 3.0))
            pg.unregister()
        finally:
            dist.destroy_process_group()

    def test_a_configure_whose_peers_never_come_times_out_naming_them(self) -> None:
        store = _store()
        pg = ProcessGroupCupycoll(timeout=timedelta(seconds=0.5))
        with self.assertRaisesRegex(TimeoutError, "rank 1 never joined it"):
            pg.configure(f"localhost:{store.port}/prefix", "0", 0, 2)

    def test_errored_is_the_groups_fault_until_the_next_quorum(self) -> None:
        store = _store()
        pg = ProcessGroupCupycoll()
        pg.configure(f"localhost:{store.port}/q1", "0", 0, 1, quorum_id=1)
        self.assertIsNone(pg.errored())
        group = pg.parent
        pg.abort()
        error = pg.errored()
        self.assertIsInstance(error, CommunicatorAbortedError)
        self.assertIn("'torchft_quorum_1_rank_0' was aborted", str(error))
        with self.assertRaises(CommunicatorAbortedError):
            group.allreduce([torch.ones(1)]).wait()
        pg.configure(f"localhost:{store.port}/q2", "0", 0, 1, quorum_id=2)
        self.assertIsNone(pg.errored())  # a new quorum, a new group
        self.assertIsNot(pg.parent, group)
        pg.shutdown()
        self.assertIsNone(pg.errored())

    def test_errored_after_a_fault_says_aborted_with_the_fault_as_its_cause(self) -> None:
        # torchft's own groups say "aborted" for a group to reconfigure; the fault is the cause
        from cupycoll.errors import CollectiveTimeoutError
        from cupycoll.shell import shell_of

        store = _store()
        pg = ProcessGroupCupycoll()
        pg.configure(f"localhost:{store.port}/q1", "0", 0, 1, quorum_id=1)
        fault = CollectiveTimeoutError("all_reduce #1 timed out after 1 s on rank 0; rank 1 is behind")
        shell_of(pg.parent)._cuda.life.fault_once(fault)
        error = pg.errored()
        self.assertIsInstance(error, CommunicatorAbortedError)
        self.assertIn("'torchft_quorum_1_rank_0' was aborted: all_reduce #1 timed out", str(error))
        self.assertIs(error.__cause__, fault)
        pg.shutdown()


@BACKEND_SHAPE
class CupycollGroupBackendShapeTest(CupycollGroupTest):
    SHAPE = "backend"


class _Counted(ProcessGroupCupycoll):
    made = 0

    def _create_pg(self, store, rank, world_size):
        type(self).made += 1
        return super()._create_pg(store, rank, world_size)


def _manager_on_a_free_port(*args, port=None, **kwargs):
    """torchft's Manager as its tests make it, but on a port of the system's choosing: they fix
    19530 + the replica's number, which two test processes (or two runs) would share."""
    return Manager(*args, port=0, **kwargs)


class CupycollManagerTest(TestCase):
    """torchft's Manager integration tests with cupycoll's group in place of its gloo group."""

    def setUp(self) -> None:
        _Counted.made = 0
        for name, replacement in (("ProcessGroupGloo", _Counted), ("Manager", _manager_on_a_free_port)):
            patcher = mock.patch.object(integration, name, replacement)
            patcher.start()
            self.addCleanup(patcher.stop)

    def tearDown(self) -> None:
        self.assertGreaterEqual(_Counted.made, 2)  # every replica's group was cupycoll's

    test_ddp_healthy = integration.ManagerIntegTest.test_ddp_healthy
    test_ddp_skip_init_sync = integration.ManagerIntegTest.test_ddp_skip_init_sync
    test_ddp_recovery_multi_rank = integration.ManagerIntegTest.test_ddp_recovery_multi_rank
    # torchft's parameterized test_ddp_recovery, as its expansion names them
    test_ddp_recovery_async_quorum = integration.ManagerIntegTest.test_ddp_recovery_0_async_quorum
    test_ddp_recovery_sync_quorum = integration.ManagerIntegTest.test_ddp_recovery_1_sync_quorum
