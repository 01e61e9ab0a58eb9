"""How the batches reach `training_step`: an iterator it fetches from, several combined loaders, float64 logging.

Scenarios (`LoaderConfig.scenario`), each rank holding its own batches (no sampler), every rank a float64 model:

- `iterator`: `training_step(self, dataloader_iter)` fetches one batch per step and returns a count (`count`
  "returned"), a bare loss ("bare"), or a bare loss beside an `ItemCounter` ("counter").
- `combined`: a `CombinedLoader` of `len(lengths)` loaders in `mode`; `lengths[l][r]` batches of loader `l` on rank `r`.
- `logging`: one loader, an `ItemCounter` counting it, an `ItemMonitor` logging `train/loss`, and `validation_step`
  returning its loss for `val/loss`.

Every rank saves its parameters, the items of each optimizer step's window, and `trainer.callback_metrics`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import CombinedLoader
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset
from worker import rank_arguments

import lightning_weighted

LR = 0.1


@dataclasses.dataclass
class LoaderConfig:
    scenario: str = "iterator"  # iterator | combined | logging
    strategy: str = "ddp_weighted"  # ddp_weighted | ddp
    world_size: int = 2
    lengths: Sequence[Sequence[int]] = ((4, 2),)  # per loader, per rank: its batches
    mode: str = "max_size_cycle"  # combined: the CombinedLoader's mode
    count: str = "returned"  # returned | bare | counter
    epochs: int = 1
    accumulate: int = 1  # accumulate_grad_batches (the reference takes 1)


def batch_of(loader: int, rank: int, index: int) -> tuple[Tensor, Tensor]:
    """Batch `index` of loader `loader` on rank `rank`: 1 to 4 items (x [B, 3], y [B]), float64, its own values."""
    generator = torch.Generator().manual_seed(10_000 * loader + 100 * rank + index)
    size = 1 + (3 * rank + index + loader) % 4
    return torch.randn(size, 3, generator=generator, dtype=torch.float64), torch.randn(
        size, generator=generator, dtype=torch.float64
    ) + rank


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(3, 1).double()


def item_losses(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return 0.5 * (model(x).squeeze(-1) - y) ** 2


def step_batches(config: LoaderConfig) -> list[list[tuple[Tensor, Tensor]]]:
    """The batches every rank trains at each optimizer step, as plain DDP takes them in lockstep."""
    lengths = [list(n) for n in config.lengths]
    ranks = range(config.world_size)
    if config.scenario != "combined":
        return [
            [batch_of(0, r, s) for r in ranks if s < lengths[0][r]] for s in range(max(lengths[0]))
        ]  # a rank out of data adds nothing (the weighted strategies replay with a count of 0)
    steps = []
    combined = [max(n[r] for n in lengths) for r in ranks]  # max_size_cycle and max_size
    assert len(set(combined)) == 1, "the reference holds ranks in lockstep"
    for s in range(combined[0]):
        held = []
        for r in ranks:
            for loader, n in enumerate(lengths):
                if s < n[r] or config.mode == "max_size_cycle":
                    held.append(batch_of(loader, r, s % n[r]))
        steps.append(held)
    return steps


def reference(config: LoaderConfig) -> dict[str, Any]:
    """Float64 SGD on each step's item mean over every rank: parameters, step losses and items."""
    model = make_model()
    losses, items = [], []
    for _ in range(config.epochs):
        for held in step_batches(config):
            x, y = torch.cat([b[0] for b in held]), torch.cat([b[1] for b in held])
            model.zero_grad()
            loss = item_losses(model, x, y).mean()
            loss.backward()
            losses.append(float(loss.detach()))
            items.append(float(len(y)))
            with torch.no_grad():
                for p in model.parameters():
                    p -= LR * p.grad
    validation = validation_data()
    with torch.no_grad():
        val_loss = float(item_losses(model, *validation).mean())
    return {"params": [p.detach().clone() for p in model.parameters()], "losses": losses, "items": items,
            "val_loss": val_loss}


def validation_data() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(77)
    return torch.randn(7, 3, generator=generator, dtype=torch.float64), torch.randn(
        7, generator=generator, dtype=torch.float64
    )


class Batches(Dataset[tuple[Tensor, Tensor]]):
    def __init__(self, loader: int, rank: int, length: int) -> None:
        self.loader, self.rank, self.length = loader, rank, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        return batch_of(self.loader, self.rank, index)


def _joined(batch: Any) -> tuple[Tensor, Tensor]:
    """A combined batch's items, every loader's part (`None` for a loader out of batches under `max_size`)."""
    parts = [part for part in batch.values() if part is not None] if isinstance(batch, dict) else [batch]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


class LoaderModule(LightningModule):
    def __init__(self, config: LoaderConfig) -> None:
        super().__init__()
        self.config = config
        self.model = make_model()

    def step(self, batch: Any) -> Any:
        x, y = _joined(batch)
        mean = item_losses(self.model, x, y).mean()
        return mean if self.config.count != "returned" else {"loss": mean, "count": len(y)}

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return self.step(batch)

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        return self.step(batch)

    def train_dataloader(self) -> Any:
        loaders = {
            f"l{loader}": DataLoader(Batches(loader, self.global_rank, n[self.global_rank]), batch_size=None)
            for loader, n in enumerate(self.config.lengths)
        }
        if self.config.scenario == "combined":
            return CombinedLoader(loaders, mode=self.config.mode)
        return loaders["l0"]

    def val_dataloader(self) -> Any:
        x, y = validation_data()
        rank, ranks = self.global_rank, self.config.world_size
        return DataLoader(list(zip(x[rank::ranks].split(2), y[rank::ranks].split(2), strict=True)), batch_size=None)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=LR)


class IteratorModule(LoaderModule):
    def training_step(self, dataloader_iter: Iterator[Any]) -> Any:  # type: ignore[override]
        batch, _, _ = next(dataloader_iter)
        return self.step(batch)


class Record(Callback):
    def __init__(self) -> None:
        self.windows: list[tuple[int, float]] = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        window = getattr(trainer.strategy, "last_window", None)
        if window is not None and (not self.windows or self.windows[-1][0] != window.step):
            self.windows.append((window.step, window.items))


def main() -> None:
    args = rank_arguments()
    config = LoaderConfig(**json.loads(args.config))
    weighted = config.strategy.endswith("_weighted")
    strategy = (lightning_weighted.WeightedDDPStrategy if weighted else DDPStrategy)(timeout=timedelta(seconds=30))
    record = Record()
    callbacks: list[Callback] = [record]
    if config.count == "counter" or config.scenario == "logging":
        callbacks.append(lightning_weighted.ItemCounter("examples"))
    if config.scenario == "logging":
        callbacks.append(lightning_weighted.ItemMonitor())
    trainer = Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=config.world_size,
        precision="64-true",
        max_epochs=config.epochs,
        accumulate_grad_batches=config.accumulate,
        callbacks=callbacks,
        logger=CSVLogger(f"{args.out}.logs", name="", version="") if config.scenario == "logging" else False,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        limit_val_batches=None if config.scenario == "logging" else 0,
        default_root_dir=str(Path(args.out).parent),
    )
    module = (IteratorModule if config.scenario == "iterator" else LoaderModule)(config)
    trainer.fit(module)
    out = {
        "params": [p.detach().clone() for p in module.model.parameters()],
        "windows": record.windows,
        "global_step": trainer.global_step,
        "metrics": {k: v.detach().clone() for k, v in trainer.callback_metrics.items()},
    }
    torch.save(out, f"{args.out}.rank{trainer.global_rank}")


if __name__ == "__main__":
    main()
