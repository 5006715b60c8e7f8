"""One rank of a training job driven by a framework (accelerate, DeepSpeed, Lightning) on the
backend given, on CPU: a small model trained a few steps on data that depends on the step
and the rank, then the framework's own collectives once. The rank's final parameters and
what the framework reports go to ``--out``; a test compares a cupycoll run with a gloo one.

Each framework is told of cupycoll the way docs/usage.md says:

* accelerate: ``dist.init_process_group("cupycoll")`` before the ``Accelerator`` (on CPU it
  would make a "gloo" group itself);
* DeepSpeed: ``deepspeed.init_distributed(dist_backend="cupycoll")``, then ZeRO stage 1;
* Lightning: ``DDPStrategy(process_group_backend="cupycoll")``.

Usage (under torchrun, 2 processes): frameworks_worker.py FRAMEWORK BACKEND OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

FEATURES, HIDDEN, BATCH, STEPS = 8, 16, 4, 6


def new_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1))


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(BATCH, FEATURES, generator=g)
    return x, x.sum(dim=1, keepdim=True).cos()


def params(model) -> list:
    return [p.detach().flatten().tolist() for p in model.parameters()]


def group_facts() -> dict:
    group = dist.group.WORLD
    return {"group_type": type(group).__name__, "backend": str(dist.get_backend())}


def with_accelerate(backend: str) -> dict:
    from accelerate import Accelerator

    if backend == "cupycoll":
        dist.init_process_group("cupycoll")  # before the Accelerator, which keeps the group it finds
    accelerator = Accelerator(cpu=True)
    model = new_model()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    rank = accelerator.process_index
    for step in range(STEPS):
        x, y = batch(step, rank)
        loss = F.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    gathered = accelerator.gather(torch.tensor([float(rank + 1)]))
    reduced = accelerator.reduce(torch.tensor([float(rank + 1)]), "mean")
    return {**group_facts(), "params": params(accelerator.unwrap_model(model)), "gathered": gathered.tolist(),
            "reduced": reduced.tolist(), "distributed_type": str(accelerator.distributed_type),
            "state_backend": str(accelerator.state.backend)}


def with_deepspeed(backend: str) -> dict:
    import deepspeed

    deepspeed.init_distributed(dist_backend=backend)
    model = new_model()
    config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 1},
              "zero_allow_untested_optimizer": True}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    rank = dist.get_rank()
    for step in range(STEPS):
        x, y = batch(step, rank)
        loss = F.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
    return {**group_facts(), "params": params(engine.module), "zero_stage": engine.zero_optimization_stage()}


def with_lightning(backend: str) -> dict:
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import DDPStrategy

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = new_model()

        def training_step(self, data, index):
            x, y = batch(index, self.global_rank)
            loss = F.mse_loss(self.model(x), y)
            self.log("loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(2 * STEPS, 1)), batch_size=1)
    module = Module()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(process_group_backend=backend),
                         max_epochs=1, enable_progress_bar=False, enable_checkpointing=False, logger=False,
                         enable_model_summary=False, use_distributed_sampler=True)
    trainer.fit(module, data)
    return {**group_facts(), "params": params(module.model), "steps": trainer.global_step,
            "loss": float(trainer.callback_metrics["loss"])}


def main() -> int:
    framework, backend, out = sys.argv[1:4]
    import cupycoll  # noqa: F401 - registers "cupycoll" (the torch.backends entry point does too)

    result = {"with_accelerate": with_accelerate, "with_deepspeed": with_deepspeed,
              "with_lightning": with_lightning}[f"with_{framework}"](backend)
    rank = dist.get_rank()
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
