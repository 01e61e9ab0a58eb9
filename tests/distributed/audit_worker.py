"""One 2-rank run of the worked trace under `ObjectiveAudit`; every rank saves its reports to `<out>.rank<r>`.

w = 10, per-item loss ½(w − y)². Per optimizer step rank 0 holds targets [9, 9] (then [8] when accumulating),
rank 1 holds [7] * 6 (then [7, 7]).
"""

from __future__ import annotations

import dataclasses
import json
from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor
from worked_trace import WorkedTrace
from worker import rank_arguments

import lightning_weighted
from lightning_weighted.audit import ObjectiveAudit

WINDOWS = {0: [[9.0, 9.0], [8.0]], 1: [[7.0] * 6, [7.0, 7.0]]}  # rank -> microbatches of one window


@dataclasses.dataclass
class Config:
    strategy: str = "ddp"  # ddp | ddp_weighted
    world_size: int = 2
    accumulate: int = 1
    steps: int = 1
    every: int | None = 1
    on_mismatch: str = "warn"
    bare: bool = False  # training_step returns the mean only: the audit counts the batch size
    corrupt: bool = False  # a callback changes rank 1's gradient before the audit sees it
    short: bool = False  # rank 0 runs out after one window: ddp_weighted replays its batch with count 0
    counter: bool = False  # an ItemCounter supplies the counts: the first target of each microbatch


class Trace(WorkedTrace):
    def __init__(self, config: Config) -> None:
        steps = {rank: 1 if config.short and rank == 0 else config.steps for rank in WINDOWS}
        super().__init__({rank: WINDOWS[rank][: config.accumulate] * steps[rank] for rank in WINDOWS})
        self.config = config

    def training_step(self, batch: Tensor, batch_idx: int) -> Any:
        output = super().training_step(batch, batch_idx)
        self.log("mean", output["loss"])  # the audit's replay must not log it a second time
        return output["loss"] if self.config.bare else output


class Corrupt(Callback):
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if trainer.global_rank == 1:
            pl_module.w.grad.add_(1.0)


class Save(Callback):
    def __init__(self, audit: ObjectiveAudit, out: str) -> None:
        self.audit, self.out, self.grads = audit, out, []

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        self.grads.append(float(pl_module.w.grad))

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        record = {
            "reports": [dataclasses.asdict(r) for r in self.audit.reports],
            "grads": self.grads,
            "w": float(pl_module.w.detach()),
            "global_step": trainer.global_step,
        }
        torch.save(record, f"{self.out}.rank{trainer.global_rank}")


def main() -> None:
    args = rank_arguments()
    config = Config(**json.loads(args.config))
    cls = lightning_weighted.WeightedDDPStrategy if config.strategy == "ddp_weighted" else DDPStrategy
    audit = ObjectiveAudit(every_n_steps=config.every, on_mismatch=config.on_mismatch)  # type: ignore[arg-type]
    callbacks: list[Callback] = [Corrupt()] if config.corrupt else []
    if config.counter:
        callbacks.append(lightning_weighted.ItemCounter(lambda batch: batch[0], integer=False))
    callbacks += [audit, Save(audit, args.out)]
    trainer = Trainer(
        strategy=cls(timeout=timedelta(seconds=30)),
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        accumulate_grad_batches=config.accumulate,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(Trace(config))


if __name__ == "__main__":
    main()
