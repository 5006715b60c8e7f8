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
