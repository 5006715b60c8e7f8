"""A group on one GPU of a node of several (cuda:3 here), its thread and the package's own
threads starting on cuda:0 as a new thread does: every CUDA call of cupycoll's runs with the
group's device current, so no context is ever made on another device, and every CUDA object
is made on the group's.

The CUDA runtime is tests/standins.py's device ledger (a current device per thread, the
contexts made, the device of every object and call), the NCCL library tests/faulty.py's
DeviceRestoringLibrary (it sets back the device current when it was called, as NCCL does,
which is how a context appears on cuda:0 when that device was current). Each path of a
group's life is a test: eager init, synchronous and asynchronous calls, a coalescing block,
batched point-to-point, the ring, a watchdog pass, a timeout, abort(), abort_all(), a shrink,
the exit hook and destroy. The GPU tier reads the real contexts of every rank (tests/gpu).
"""

from __future__ import annotations

import datetime
import textwrap
import threading
import types

import pytest
import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d
from torch._subclasses.fake_tensor import FakeTensorMode

import cupycoll
from cupycoll import compat
from cupycoll.errors import CollectiveTimeoutError, CupycollValueError
from cupycoll.faults import all_groups
from cupycoll.nccl import communicator as communicator_module
from cupycoll.shell import shrinking
from faulty import DeviceRestoringLibrary, eventually, run_script, undiagnosed
from standins import OnDeviceGroup

DEVICE = torch.device("cuda", 3)


@pytest.fixture
def node(cuda_standins, monkeypatch):
    """``node.group(**options)``: rank 0 of 2 of a group on cuda:3; ``node.ledger``, its
    CUDA runtime; ``node.library``, its NCCL."""
    library = DeviceRestoringLibrary(cuda_standins)
    monkeypatch.setattr(communicator_module, "_library", lambda path=None: library)
    made = []

    def group(size=2, **options):
        options.setdefault("timeout", 60)
        made.append(OnDeviceGroup(dist.HashStore(), 0, size, datetime.timedelta(seconds=60),
                                  cupycoll.Options(**options)))
        return made[-1]
    yield types.SimpleNamespace(ledger=cuda_standins, library=library, group=group)
    for g in made:
        g.abort()


def only_the_groups_device(node):
    """Contexts only on cuda:3, every CUDA object made there, every NCCL call run there."""
    ledger = node.ledger
    elsewhere = [call for call in ledger.calls if call[2] != 3]
    assert ledger.contexts == {3}, elsewhere
    assert ledger.devices_made_on() == {3}, ledger.made
    assert all(device == 3 for _, device in node.library.launched), node.library.launched


def opts(kind="AllreduceOptions", async_op=False):
    made = getattr(c10d, kind)()
    if hasattr(made, "asyncOp"):
        made.asyncOp = async_op
    return made


def test_eager_init_without_set_device_makes_no_context_on_another_device(node):
    # init_process_group(device_id=cuda:3) without torch.cuda.set_device(3): torch never sets it
    group = node.group()
    group._cuda.eager_connect_single_device(DEVICE)
    assert group._cuda.comm is not None and node.ledger.current_device() == 0  # the caller's, kept
    only_the_groups_device(node)


def test_synchronous_calls_run_on_the_groups_device_from_a_thread_on_another(node):
    group = node.group()
    for _ in range(3):  # the first learns the plan; the others may take one frame
        group.allreduce([torch.ones(4)], opts()).wait()
    group.broadcast([torch.ones(4)], opts("BroadcastOptions")).wait()
    only_the_groups_device(node)


def test_the_one_frame_launch_runs_for_a_caller_on_the_groups_device(node, monkeypatch):
    group = node.group()
    issuer, later = group._issuer, []
    issue_later = issuer._later
    monkeypatch.setattr(issuer, "_later", lambda call: later.append(call.op) or issue_later(call))
    node.ledger.set_device(3)  # torch.cuda.set_device(3), as the README's init does
    group.allreduce([torch.ones(4)], opts()).wait()  # the first call makes the communicator
    group.allreduce([torch.ones(4)], opts()).wait()  # launched in one frame
    assert later == ["all_reduce"]
    node.ledger.set_device(0)  # a caller on another device: issued under the group's device
    group.allreduce([torch.ones(4)], opts()).wait()
    assert later == ["all_reduce", "all_reduce"]
    node.ledger.contexts.discard(0)  # made by this test's own set_device(0)
    only_the_groups_device(node)


def test_asynchronous_calls_their_waits_and_futures_run_on_the_groups_device(node):
    group = node.group()
    works = [group.allreduce([torch.ones(4)], opts(async_op=True)) for _ in range(2)]
    assert works[0].get_future().wait()[0].shape == (4,)
    works[0].wait()
    works[0].is_completed()
    # and from a thread that never chose a device (a hook's, a data loader's)
    looked = []
    thread = threading.Thread(target=lambda: looked.append(
        (works[1].is_completed(), works[1].wait(), works[1].get_future().wait()[0].shape)))
    thread.start()
    thread.join(10)
    assert looked == [(False, True, (4,))]
    only_the_groups_device(node)


def test_a_coalescing_block_runs_on_the_groups_device(node):
    group = node.group()
    group._start_coalescing(DEVICE)
    group.allreduce_coalesced([torch.ones(4), torch.ones(2)], opts("AllreduceCoalescedOptions"))
    group._end_coalescing(DEVICE).wait()
    only_the_groups_device(node)


def test_a_batch_of_sends_and_receives_runs_on_the_groups_communicator_alone(node):
    # An expert-parallel exchange with 8 peers as one batch: no pair communicator per peer.
    group = node.group(size=9)
    group._start_coalescing(DEVICE)
    for peer in range(1, 9):
        group.send([torch.ones(4)], peer)
        group.recv([torch.ones(4)], peer)
    group._end_coalescing(DEVICE).wait()
    made = [call for call in node.library.calls if call[0] == "ncclCommInitRankConfig"]
    assert made == [("ncclCommInitRankConfig", 9, 0)] and group._cuda.comms.pairs == {}
    assert [f for f, _ in node.library.launched].count("ncclSend") == 8
    only_the_groups_device(node)


def test_a_lone_send_takes_a_pair_communicator(node):
    group = node.group(size=4)
    group.send([torch.ones(4)], 2).wait()
    made = [call for call in node.library.calls if call[0] == "ncclCommInitRankConfig"]
    assert made == [("ncclCommInitRankConfig", 2, 0)] and list(group._cuda.comms.pairs) == [2]
    only_the_groups_device(node)


def test_batch_isend_irecv_is_told_from_a_lone_send_by_torchs_frame():
    # torch hands a Python group the ops of batch_isend_irecv one by one; its frame tells them.
    assert compat.calling_batch_isend_irecv() is False
    code = compile("def batch_isend_irecv(probe):\n    return probe()\n", dist.distributed_c10d.__file__, "exec")
    scope = {}
    exec(code, scope)
    assert scope["batch_isend_irecv"](compat.calling_batch_isend_irecv) is True


def test_the_ring_runs_on_the_groups_device(node):
    group = node.group(algorithm="ring")
    group.allreduce([torch.ones(64)], opts()).wait()
    made = {what for what, _ in node.ledger.made}
    assert {"stream", "event", "scratch", "kernel"} <= made  # the ring's own, on its device
    only_the_groups_device(node)


def test_the_watchdog_thread_checks_on_the_groups_device(node):
    group = node.group()
    group.allreduce([torch.ones(4)], opts()).wait()
    before = len(node.ledger.calls)
    assert eventually(lambda: any(name == "cupycoll-watchdog" for name, _, _ in node.ledger.calls[before:]))
    # its pass also records the synchronous call's shared event (sealing it), on cuda:3 too
    watch = group._cuda.watch
    assert eventually(lambda: all(slot.sealed for queue in watch._streams.values() for slot in queue))
    only_the_groups_device(node)


def test_a_timeout_is_handled_and_ended_on_the_groups_device(node):
    group = node.group(timeout=0.2, watchdog_interval=0.02)
    undiagnosed(group)
    work = group.allreduce([torch.ones(4)], opts(async_op=True))  # its event never fires
    assert group._cuda.life.ended.wait(10)
    with pytest.raises(CollectiveTimeoutError):
        work.wait()
    threads = {name.split("-")[1] for name, _, _ in node.ledger.calls if name.startswith("cupycoll-")}
    assert {"watchdog", "fault"} <= threads  # the fault was found and ended off the caller's thread
    assert ("ncclCommAbort", 3) in node.library.launched
    only_the_groups_device(node)


def test_a_users_abort_and_abort_all_end_on_the_groups_device(node):
    first, second = node.group(), node.group()
    for group in (first, second):
        group.allreduce([torch.ones(4)], opts()).wait()
    first.abort()
    assert all_groups.abort_all() >= 1 and second._cuda.life.ended.is_set()
    assert [f for f, _ in node.library.launched].count("ncclCommAbort") == 2
    only_the_groups_device(node)


def test_a_groups_communicators_are_aborted_side_by_side(node):
    # A pair communicator's abort may wait for the device (NCCL_CUMEM_ENABLE=0: its free syncs
    # it) behind the group communicator's stuck kernel, which only that one's abort ends.
    group = node.group(size=4)
    group.allreduce([torch.ones(4)], opts()).wait()
    group.send([torch.ones(4)], 2).wait()
    aborted = []
    inside_first = []

    def abort(comm):
        aborted.append(comm)
        if len(aborted) == 1:  # the first waits until the other's abort has begun too
            inside_first.append(eventually(lambda: len(aborted) == 2, timeout=5))
        return 0
    node.library.ncclCommAbort = abort
    group.abort()
    assert len(aborted) == 2 and inside_first == [True]
    only_the_groups_device(node)


def test_a_shrink_takes_the_survivors_communicator_on_the_groups_device(node):
    parent = node.group()
    parent.allreduce([torch.ones(4)], opts()).wait()
    with shrinking(parent, [1], False):
        child = OnDeviceGroup(dist.HashStore(), 0, 1, datetime.timedelta(seconds=60), cupycoll.Options(timeout=60))
    try:
        assert child.shrunk_by == "ncclCommShrink" and child._cuda.device == DEVICE
        child.allreduce([torch.ones(4)], opts()).wait()
    finally:
        child.abort()
    only_the_groups_device(node)


def test_destroy_runs_on_the_groups_device(node):
    group = node.group()
    group.allreduce([torch.ones(4)], opts()).wait()
    for slot in [s for q in group._cuda.watch._streams.values() for s in q]:
        group._cuda.watch.seal(slot)  # a synchronous call's event, recorded
        slot.event.fired.set()  # its work is done: a clean shutdown finalizes
    group.shutdown()
    assert [f for f, _ in node.library.launched][-2:] == ["ncclCommFinalize", "ncclCommDestroy"]
    only_the_groups_device(node)


def test_the_exit_hook_aborts_on_the_groups_device():
    # The exit hook stops the process's watchdog for good: in a process of its own.
    result = run_script(textwrap.dedent("""
        import datetime, torch, torch.distributed as dist, cupycoll
        from cupycoll import _cuda
        from cupycoll.faults import all_groups
        from cupycoll.nccl import communicator
        from faulty import DeviceRestoringLibrary
        from standins import DeviceLedger, OnDeviceGroup
        with _cuda.install(DeviceLedger()) as ledger:
            library = DeviceRestoringLibrary(ledger)
            communicator._library = lambda path=None: library
            group = OnDeviceGroup(dist.HashStore(), 0, 2, datetime.timedelta(seconds=60))
            group.allreduce([torch.ones(4)], dist.AllreduceOptions())
            all_groups._abort_at_exit()  # what atexit runs for a group never destroyed
            print("contexts", sorted(ledger.contexts), "made", sorted(set(d for _, d in ledger.made)),
                  "aborts", [d for f, d in library.launched if f == "ncclCommAbort"])
    """))
    assert "contexts [3] made [3] aborts [3]" in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize("call", ["all_reduce", "async all_reduce", "broadcast", "all_gather_into_tensor",
                                  "reduce_scatter_tensor", "coalesced", "send", "ring"])
def test_a_tensor_on_another_device_is_a_typed_error_naming_both_before_anything_is_issued(node, call):
    group = node.group(algorithm="ring" if call == "ring" else "auto")
    group.allreduce([torch.ones(4)], opts()).wait()  # the group's device is cuda:3 from now on
    launched, in_flight = len(node.library.launched), group._cuda.watch.in_flight()
    with FakeTensorMode(allow_non_fake_inputs=True):
        there, whole = torch.ones(4, device="cuda:2"), torch.ones(8, device="cuda:2")
    run = {"all_reduce": lambda: group.allreduce([there], opts()),
           "async all_reduce": lambda: group.allreduce([there], opts(async_op=True)),
           "broadcast": lambda: group.broadcast([there], opts("BroadcastOptions")),
           "all_gather_into_tensor": lambda: group.all_gather_single(whole, there, opts("AllgatherOptions")),
           "reduce_scatter_tensor": lambda: group.reduce_scatter_single(there, whole, opts("ReduceScatterOptions")),
           "coalesced": lambda: group.allreduce_coalesced([there, there], opts("AllreduceCoalescedOptions")),
           "send": lambda: group.send([there], 1),
           "ring": lambda: group.allreduce([there], opts())}[call]
    with pytest.raises(CupycollValueError, match=r"is on cuda:2 but this group's communicator is on cuda:3"):
        run()
    assert len(node.library.launched) == launched and group._cuda.watch.in_flight() == in_flight
    assert group._issuer.pending == [] and group._issuer.block is None
    group.allreduce([torch.ones(4)], opts()).wait()  # still usable


def test_destroy_aborts_a_group_whose_calls_a_graph_captured_instead_of_finalizing(node):
    # NCCL's finalize waits until every CUDA graph holding the communicator's calls is
    # destroyed: for as long as the program keeps one, destroy_process_group would hang.
    group = node.group()
    group.allreduce([torch.ones(4)], opts()).wait()
    node.ledger.capture = True
    group.allreduce([torch.ones(4)], opts(async_op=True)).wait()
    node.ledger.capture = False
    group.shutdown()
    ends = [f for f, _ in node.library.launched if f in ("ncclCommFinalize", "ncclCommAbort")]
    assert ends == ["ncclCommAbort"] and group._cuda.state == "aborted"
    only_the_groups_device(node)
