"""Runs a LightningModule written for `"ddp"` the way users write them, under `"ddp"` or `"ddp_weighted"`.

Every rank saves what it saw to `<out>.rank<r>` (torch.save). Scenarios:

- `docs`: a Lightning-docs-style classifier with `EarlyStopping`, `ModelCheckpoint`, `StochasticWeightAveraging`,
  `EMAWeightAveraging`, `self.log(..., sync_dist=True)`, then `validate`, `test`, `predict` and `torch.save(model)`;
- `seeding`: `seed_everything(workers=True)` with `num_workers=2` loader workers drawing random numbers;
- `subclass`: a `DataLoader` subclass whose `__init__` takes an argument it does not keep, for train, val and test;
- `combined`: a `CombinedLoader` of two train loaders (2 and 4 batches per rank) in `mode`.

With `counter`, an `ItemCounter` counts the examples of each batch (ahead, where the train loader is one).
"""

from __future__ import annotations

import dataclasses
import json
from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import (
    EarlyStopping,
    EMAWeightAveraging,
    ModelCheckpoint,
    StochasticWeightAveraging,
)
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import CombinedLoader
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset
from worker import rank_arguments

import lightning_weighted


@dataclasses.dataclass
class Config:
    strategy: str = "ddp_weighted"  # ddp | ddp_weighted
    scenario: str = "docs"
    world_size: int = 2
    precision: str = "32-true"
    mode: str = "max_size"  # combined: the CombinedLoader mode
    uneven: bool = False  # seeding, combined: rank 1 holds more items than rank 0
    spawn_workers: bool = False  # seeding: workers started with spawn (Lightning's worker check warns then)
    counter: bool = False  # seeding, subclass, combined: an ItemCounter counts each batch's examples
    bare: bool = False  # combined: training_step returns a bare loss, whose count is ambiguous


def classification_data(seed: int, items: int = 64) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(items, 8, generator=generator)
    return TensorDataset(x, (x[:, 0] + x[:, 1] > 0).long())


class LitClassifier(LightningModule):
    """The shape of the Lightning docs' examples: a bare loss, logged metrics, the usual hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        accuracy = (self(x).argmax(-1) == y).float().mean()
        self.log("test_acc", accuracy, sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)}

    def train_dataloader(self) -> Any:
        return DataLoader(classification_data(1), batch_size=8, shuffle=True)

    def val_dataloader(self) -> Any:
        return DataLoader(classification_data(2, 32), batch_size=8)

    def test_dataloader(self) -> Any:
        return DataLoader(classification_data(3, 32), batch_size=8)

    def predict_dataloader(self) -> Any:
        return DataLoader(classification_data(4, 16), batch_size=8)


class Draws(Dataset[torch.Tensor]):
    """Each item is a random draw made in the loader worker: it shows how workers were seeded."""

    def __init__(self, items: int) -> None:
        self.items = items

    def __len__(self) -> int:
        return self.items

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.rand(1)


class KeepsNoArgument(DataLoader[Any]):
    """A subclass as users write them: `scale` shapes the dataset and is not stored as an attribute."""

    def __init__(self, items: int, scale: float, **kwargs: Any) -> None:
        super().__init__(TensorDataset(torch.arange(items, dtype=torch.float32) * scale), **kwargs)


class Seen(LightningModule):
    """A one-parameter module that records the batches each stage hands it."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.w = nn.Parameter(torch.zeros(1))
        self.seen: dict[str, list[Any]] = {"train": [], "val": [], "test": []}

    def _see(self, stage: str, batch: Any) -> torch.Tensor:
        if not getattr(self.trainer.strategy, "padding_step", False):  # a replay keeps ranks in step, sees nothing
            self.seen[stage].append(_plain(batch))
        return sum((t.float().sum() for t in _tensors(batch)), torch.zeros(()))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = (self.w * self._see("train", batch) + self.w**2).sum()
        if self.config.scenario == "combined" and not self.config.counter and not self.config.bare:
            # the rows of every loader's part: a combined batch's number of examples is the step's to say
            return {"loss": loss, "count": sum(len(t) for t in _tensors(batch))}
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._see("val", batch)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._see("test", batch)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> Any:
        rank, config = self.global_rank, self.config
        if config.scenario == "seeding":
            items = 6 + (6 if config.uneven and rank == 1 else 0)
            spawn = {"multiprocessing_context": "spawn", "num_workers": 1} if config.spawn_workers else {}
            return DataLoader(Draws(items), batch_size=2, **({"num_workers": 2} | spawn))
        if config.scenario == "subclass":
            return KeepsNoArgument(12, 10.0, batch_size=2, shuffle=True)
        first = DataLoader(torch.arange(2 * 2) + 100 * rank, batch_size=2)  # 2 batches per rank
        batches = 4 + (rank if config.uneven else 0)  # 4 batches per rank (rank 1: 5 when uneven)
        second = DataLoader(torch.arange(batches * 2) + 1000 + 100 * rank, batch_size=2)
        return CombinedLoader({"first": first, "second": second}, mode=config.mode)

    def val_dataloader(self) -> Any:
        return KeepsNoArgument(9, 1.0, batch_size=2) if self.config.scenario == "subclass" else []

    def test_dataloader(self) -> Any:
        return KeepsNoArgument(7, 1.0, batch_size=2)


def _tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        return [t for value in batch.values() for t in _tensors(value)]
    if isinstance(batch, (list, tuple)):
        return [t for value in batch for t in _tensors(value)]
    return []


def _plain(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.tolist()
    if isinstance(batch, dict):
        return {key: _plain(value) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return [_plain(value) for value in batch]
    return batch


class Record(Callback):
    def __init__(self, out: str) -> None:
        self.out = out
        self.record: dict[str, Any] = {}

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.record["fit"] = {
            "global_step": trainer.global_step,
            "epochs": trainer.current_epoch,
            "params": [p.detach().clone() for p in pl_module.parameters()],
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "loader": type(trainer.train_dataloader).__name__,
            "counts_ahead": getattr(trainer.strategy, "counts_ahead", None),
            "comm_hook": self.record.get("comm_hook"),
        }

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.record["comm_hook"] = trainer.strategy.model._get_ddp_logging_data().get("comm_hook")


def main() -> None:
    args = rank_arguments()
    config = Config(**json.loads(args.config))
    seed_everything(42, workers=True, verbose=False)
    weighted = config.strategy == "ddp_weighted"
    cls = lightning_weighted.WeightedDDPStrategy if weighted else DDPStrategy
    common: dict[str, Any] = {
        "strategy": cls(timeout=timedelta(seconds=30)),
        "accelerator": "cpu",
        "devices": config.world_size,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "precision": config.precision,
    }
    record = Record(args.out)
    if config.scenario == "docs":
        model: LightningModule = LitClassifier()
        checkpoint = ModelCheckpoint(dirpath=f"{args.out}.ckpt", monitor="val_loss", save_top_k=1)
        callbacks = [
            record,
            checkpoint,
            EarlyStopping(monitor="val_loss", patience=2, min_delta=10.0),  # stops after the third epoch
            StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=2),
            EMAWeightAveraging(decay=0.9),
        ]
        trainer = Trainer(max_epochs=5, callbacks=callbacks, **common)
        trainer.fit(model)
        after = {
            "validate": trainer.validate(model, verbose=False),
            "test": trainer.test(model, verbose=False),
            "predict": [p.tolist() for p in trainer.predict(model)],  # type: ignore[union-attr]
            "best_score": float(checkpoint.best_model_score),  # type: ignore[arg-type]
            "stopped_epoch": callbacks[2].stopped_epoch,  # type: ignore[attr-defined]
        }
        torch.save(model, f"{args.out}.model.rank{trainer.global_rank}")  # the module itself, pickled
        saved = torch.load(f"{args.out}.model.rank{trainer.global_rank}", weights_only=False)
        after["saved"] = {"params": [p.detach() for p in saved.parameters()], "attributes": sorted(vars(saved))}
        record.record["after"] = after
    else:
        model = Seen(config)
        counter = [lightning_weighted.ItemCounter(lambda batch: len(_tensors(batch)[0]))]
        trainer = Trainer(
            max_epochs=1,
            callbacks=[record, *(counter if config.counter else [])],
            enable_checkpointing=False,
            num_sanity_val_steps=0,
            use_distributed_sampler=config.scenario == "subclass",  # the others hold each rank's own data
            **common,
        )
        trainer.fit(model)
        if config.scenario == "subclass":
            trainer.test(model, verbose=False)
        record.record["seen"] = model.seen
    torch.save(record.record, f"{args.out}.rank{trainer.global_rank}")


if __name__ == "__main__":
    main()
