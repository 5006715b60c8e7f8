"""cupycoll/process_group.py: how a group in the ProcessGroup shape holds its gloo half, so
that freeing the group never hangs the process (cupycoll.compat.PROCESS_GROUP_FREED_WITHOUT_GIL)."""

from __future__ import annotations

import subprocess

import pytest
import torch
import torch.distributed as dist

import warm_python
from cupycoll import compat

# Groups made, used on CPU and freed, one after another: before the fix, torch 2.7.1 hung
# within the first 10 to 20 of them.
CYCLES = 100

FREE_GROUPS = f"""
import torch, torch.distributed as dist
import cupycoll
for cycle in range({CYCLES}):
    dist.init_process_group("cpu:gloo,cuda:cupycoll", store=dist.HashStore(), rank=0, world_size=1)
    group = dist.group.WORLD
    for _ in range(3):
        dist.all_reduce(torch.ones(2))  # a tensor Python drops while gloo's worker still holds it
    dist.destroy_process_group()
    del group  # the group is freed here, right after its last CPU call
print("freed", {CYCLES})
"""


def test_a_group_freed_right_after_a_cpu_call_never_hangs_the_process():
    try:
        done = warm_python.run(FREE_GROUPS, timeout=90)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"freeing a group hung the process (torch {torch.__version__}):\n{exc.stderr}")
    assert done.returncode == 0 and f"freed {CYCLES}" in done.stdout, done.stderr


def test_the_gloo_half_is_held_by_its_own_python_object_and_handed_to_whoever_asks():
    dist.init_process_group("cpu:gloo,cuda:cupycoll", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        gloo = group._gloo_backend
        assert isinstance(gloo, dist.ProcessGroupGloo)
        # the CPU half first, then gloo's own object: the order a freed group drops them in
        names = list(vars(group))
        assert names.index("_cpu") < names.index("_gloo_backend")
        cpu = group._get_backend(torch.device("cpu"))
        if compat.PROCESS_GROUP_FREED_WITHOUT_GIL:
            assert cpu.rank() == gloo.rank() and type(cpu) is type(gloo)  # the one registered in C++
        else:
            assert cpu is gloo  # nothing registered in the group's C++ part
    finally:
        dist.destroy_process_group()


# -- split_group: the subgroups of torch's split_group and init_device_mesh ------------------


@pytest.fixture
def bound_parent(cuda_standins, monkeypatch):
    """Rank 0 of a 4-rank group on cuda:3, bound to it (device_id), its communicator made; the
    NCCL library records the splits (tests/faulty.py)."""
    import datetime

    import cupycoll
    from cupycoll.nccl import communicator as communicator_module
    from faulty import DeviceRestoringLibrary
    from standins import OnDeviceGroup

    library = DeviceRestoringLibrary(cuda_standins)
    monkeypatch.setattr(communicator_module, "_library", lambda path=None: library)
    parent = OnDeviceGroup(dist.HashStore(), 0, 4, datetime.timedelta(seconds=60),
                           cupycoll.Options(timeout=42, algorithm="nccl"))
    parent._cuda.eager_connect_single_device(torch.device("cuda", 3))
    yield parent, library
    parent.abort()


def test_a_split_is_one_nccl_comm_split_with_a_color_per_sub_list_and_the_parents_options(bound_parent):
    from cupycoll.backend import split_color

    parent, library = bound_parent
    child = parent.split_group([1, 0], group_name="tp-0", group_desc="mesh_tp")
    try:
        splits = [call for call in library.calls if call[0] == "ncclCommSplit"]
        assert splits == [("ncclCommSplit", 0x5000, split_color([0, 1]), 0)]  # key: its rank in the child
        assert child.getGroupName() == "tp-0" and child.getGroupDesc() == "mesh_tp"
        assert (child.rank(), child.size(), child._global_ranks) == (0, 2, [0, 1])
        assert child._cuda.comm is not None and child._cuda.device == torch.device("cuda", 3)
        assert child.bound_device == torch.device("cuda", 3)  # splits of its own split too
        assert child.settings.timeout.total_seconds() == 42 and child.settings.algorithm == "nccl"
    finally:
        child.abort()


def test_a_rank_in_none_of_the_sub_lists_takes_part_with_no_color_and_gets_no_group(bound_parent):
    from cupycoll.nccl import header as nh

    parent, library = bound_parent
    assert parent.split_group([2, 3]) is None
    assert [call for call in library.calls if call[0] == "ncclCommSplit"] == [
        ("ncclCommSplit", 0x5000, nh.NCCL_SPLIT_NOCOLOR, 0)]


def test_a_split_timeout_given_beats_the_parents(bound_parent):
    import datetime

    parent, _ = bound_parent
    child = parent.split_group([0, 1], timeout=datetime.timedelta(seconds=7))
    try:
        assert child.settings.timeout.total_seconds() == 7
    finally:
        child.abort()


@pytest.mark.parametrize("ranks, message", [([], "non-empty list"), ([0, 4], "rank 4 is not a rank"),
                                            ([1, 1], "name a rank twice"), ([0.5], "rank 0.5")])
def test_bad_split_ranks_are_a_typed_error_naming_them_before_anything_is_split(bound_parent, ranks, message):
    from cupycoll.errors import CupycollValueError

    parent, library = bound_parent
    with pytest.raises(CupycollValueError, match=message):
        parent.split_group(ranks)
    assert not [call for call in library.calls if call[0] == "ncclCommSplit"]
