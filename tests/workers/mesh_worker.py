"""A rank of a job that binds its default group to a device and then makes subgroups the way
an 8-GPU recipe does: ``dist.split_group`` and ``init_device_mesh("cuda", (2, 2))`` (FSDP2 +
TP, HSDP). Run by tests/multiproc/test_device_mesh.py as 4 ranks on CPU, where torch is told
the accelerator is CUDA and the default group is bound as ``device_id`` binds it; the groups'
CUDA halves then have no communicator, so the subgroups' collectives here are CPU tensors
(gloo halves). Prints one ``RESULT {json}`` line; the GPU tier runs the same recipes for real
(tests/gpu/test_gpu_fsdp.py).

Usage: mesh_worker.py BACKEND (e.g. "cpu:gloo,cuda:cupycoll")
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

import cupycoll  # noqa: F401 - registers the backend
from cupycoll import compat
from cupycoll.shell import GroupShell


def cupycoll_half(group) -> str:
    """The class of what serves ``group``'s CUDA calls (a cupycoll shell, in either shape)."""
    found = group if isinstance(group, GroupShell) else group._get_backend(torch.device("cuda"))
    return type(found).__name__ if isinstance(found, GroupShell) else "not cupycoll: " + type(found).__name__


def main() -> int:
    backend = sys.argv[1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # What a node with GPUs tells torch: the accelerator is CUDA (the recipes take
    # split_group only then), and the default group is bound as device_id binds it.
    torch.accelerator.is_available = lambda: True
    torch.accelerator.current_accelerator = lambda check_available=False: torch.device("cuda")
    torch.cuda.is_available = lambda: True  # what torch 2.11's DeviceMesh asks instead
    torch.cuda.set_device = lambda device: None  # the mesh sets the rank's device, which is not here
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=60))
    # bound as init_process_group(device_id=cuda:rank) binds it (no communicator: no GPU here)
    world_group = dist.group.WORLD
    if isinstance(world_group, GroupShell):
        world_group._bind(torch.device("cuda", rank))
    else:
        world_group.bound_device_id = torch.device("cuda", rank)
    result = {"rank": rank}
    if compat.SPLIT_GROUP_REACHES_PYTHON_GROUPS:  # else torch's split_group takes ProcessGroupNCCL alone
        split_groups(result, rank)
    mesh_groups(result, rank)
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()
    return 0


def split_groups(result, rank):
    halves = dist.split_group(split_ranks=[[0, 1], [2, 3]], group_desc="halves")
    mine = dist.get_process_group_ranks(halves)
    total = torch.tensor([float(rank)])
    dist.all_reduce(total, group=halves)
    result["split"] = {"cuda": cupycoll_half(halves), "ranks": mine, "sum": total.item(),
                       "backend": dist.get_backend(halves), "name": halves.group_name,
                       "bound": str(getattr(halves, "bound_device_id", None))}
    # a rank in none of the sub-lists gets no group
    # (torch before 2.15 says None, 2.15 its NON_GROUP_MEMBER; the Backend shape refuses:
    # torch's trampoline cannot take "no group" back from a Python Backend)
    try:
        lonely = dist.split_group(split_ranks=[[0, 1, 2]])
    except cupycoll.CupycollValueError as exc:
        result["lonely"] = "refused: " + str(exc)
    else:
        result["lonely"] = (None if lonely in (None, dist.GroupMember.NON_GROUP_MEMBER)
                            else dist.get_process_group_ranks(lonely))


def mesh_groups(result, rank):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("dp", "tp"))
    for dim in ("dp", "tp"):
        group = mesh.get_group(dim)
        value = torch.tensor([float(rank)])
        dist.all_reduce(value, group=group)
        result[dim] = {"cuda": cupycoll_half(group), "ranks": dist.get_process_group_ranks(group),
                       "sum": value.item()}


if __name__ == "__main__":
    sys.exit(main())
