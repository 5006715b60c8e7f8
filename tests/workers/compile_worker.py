"""One rank of tests/multiproc/test_compile.py: ``torch.compile`` over a group of one backend
string, three ways, on CPU tensors: a DDP model, an FSDP2 model and a function of functional
collectives, 3 training steps each from the same seed.

usage: compile_worker.py BACKEND OUT_DIR   (RANK, WORLD_SIZE=2, MASTER_ADDR/PORT from
tests/mp.py). Writes ``<OUT_DIR>/rank<R>.json``: ``case -> {"params": [...]}`` or
``{"error": "Type: text"}``. The "aot_eager" backend keeps Dynamo and AOTAutograd (where
a group's methods are reached) and leaves out Inductor's C++ compile, which proves nothing
about the group and takes minutes on a small machine.
"""

from __future__ import annotations

import datetime
import os
import sys
import traceback

import torch
import torch.distributed as dist

import cupycoll  # noqa: F401 - registers the backend
from epilogue import write_json

STEPS = 3


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def train(module, params, rank):
    compiled = torch.compile(module, backend="aot_eager")
    optimizer = torch.optim.SGD(params, lr=0.1)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        compiled(torch.randn(4, 8, generator=generator)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def ddp(rank):
    net = model()
    train(torch.nn.parallel.DistributedDataParallel(net), net.parameters(), rank)
    return [p.detach().flatten().tolist() for p in net.parameters()]


def fsdp2(rank):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    net = model()
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    train(net, net.parameters(), rank)
    return [p.full_tensor().detach().flatten().tolist() for p in net.parameters()]


def functional(rank):
    from torch.distributed import _functional_collectives as funcol

    def step(x):
        y = funcol.all_reduce(x * 2, "sum", dist.group.WORLD)
        return funcol.all_gather_tensor(y + 1, 0, dist.group.WORLD)

    out = torch.compile(step, backend="aot_eager")(torch.full((3,), float(rank + 1)))
    return [out.tolist()]


def main() -> None:
    backend, out_dir = sys.argv[1:3]
    rank = int(os.environ["RANK"])
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=60))
    results = {}
    for name, case in (("ddp", ddp), ("fsdp2", fsdp2), ("functional", functional)):
        try:
            results[name] = {"params": case(rank)}
        except Exception as exc:  # noqa: BLE001 - recorded: the test compares with gloo
            traceback.print_exc()
            results[name] = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
        torch._dynamo.reset()
        dist.barrier()
    write_json(out_dir, f"rank{rank}.json", results)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
