"""One Trainer run of one cell of the compatibility matrix (`matrix.py`); every rank saves a record to `<out>.rank<r>`.

The cell (`--config`, JSON): the row's `options`, the `engine` (ddp | fsdp2 | fsdp1), the count `path` (after |
ahead | bare), whether the strategy is the `weighted` one or its plain counterpart, the `world_size`, and the
checkpoint to `resume` from. The record: the final parameters (whole, under every engine), what each optimizer step
trained (the ids of every batch `training_step` received since the step before, with whether it was a replay),
the replay flags the batch-start hooks read, the callback metrics, and the error the rank raised (``None``).
"""

from __future__ import annotations

import json
import os
import types
from datetime import timedelta
from typing import Any

import litdata_items
import matrix
import torch
import torchmetrics
from cpu_fsdp import CPUFSDPStrategy
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import (
    EarlyStopping,
    GradientAccumulationScheduler,
    ModelCheckpoint,
    OnExceptionCheckpoint,
)
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities import CombinedLoader
from matrix import LBFGS, LR
from torch import Tensor, nn
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, RandomSampler
from worker import full, rank_arguments, whole

import lightning_weighted

PG_TIMEOUT = timedelta(seconds=20)


# --------------------------------------------------------------------------------------------------- the data
def as_batch(ids: list[int], mode: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    tensor = torch.tensor(ids, dtype=torch.long)
    return (*matrix.values(tensor, mode), tensor)


class Clock:
    """Which epoch the loaders serve (the trainer's, read when a batch is fetched)."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None

    @property
    def epoch(self) -> int:
        return self.trainer.current_epoch if self.trainer is not None else 0


class Batches(Dataset[Any]):
    """One rank's own batches of the epoch in progress (`matrix.rank_batches`), whole batches (`batch_size=None`)."""

    def __init__(self, options: dict[str, Any], rank: int, world_size: int, clock: Clock, epoch: int = 0) -> None:
        self.options, self.rank, self.world_size, self.clock = options, rank, world_size, clock
        self.length = len(matrix.rank_batches(options, rank, epoch, world_size))

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, k: int) -> Any:
        epoch = self.clock.epoch
        return as_batch(matrix.rank_batches(self.options, self.rank, epoch, self.world_size)[k], self.options["mode"])


class Stream(IterableDataset[Any]):
    """The same batches without a length."""

    def __init__(self, batches: Batches) -> None:
        self.batches = batches

    def __iter__(self) -> Any:
        return (self.batches[k] for k in range(len(self.batches)))


class LoaderPart(Dataset[Any]):
    """Loader `loader` of a CombinedLoader: this rank's batches `matrix.batch_ids(rank, epoch, k, loader)`."""

    def __init__(self, options: dict[str, Any], rank: int, loader: int, clock: Clock) -> None:
        self.options, self.rank, self.loader, self.clock = options, rank, loader, clock
        self.length = options["combined"]["lengths"][loader][rank]

    def __len__(self) -> int:
        return int(self.length)

    def __getitem__(self, k: int) -> Any:
        return as_batch(matrix.batch_ids(self.rank, self.clock.epoch, k, self.loader), self.options["mode"])


class Items(Dataset[Any]):
    """The shared data set: item ``i`` is ``(x, y, w, id)``."""

    def __init__(self, options: dict[str, Any]) -> None:
        self.x, self.y, self.w = matrix.values(torch.arange(options["items"]), options["mode"])

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> Any:
        return self.x[i], self.y[i], self.w[i], torch.tensor(i)


class NamedLoader(DataLoader[Any]):
    """A DataLoader subclass with an argument of its own (Lightning re-creates it with its sampler)."""

    def __init__(self, dataset: Any, name: str, **kwargs: Any) -> None:
        self.name = name
        super().__init__(dataset, **kwargs)


class VariedBatchSampler(BatchSampler):
    """Batches of 2, 3 and 4 indices in turn (`matrix._varied`)."""

    def __init__(self, sampler: Any, batch_size: int = 4, drop_last: bool = False) -> None:
        super().__init__(sampler, batch_size, drop_last)

    def __iter__(self) -> Any:
        return matrix._varied(list(self.sampler))

    def __len__(self) -> int:
        return len(list(matrix._varied(list(range(len(self.sampler))))))


def stateful(*args: Any, **kwargs: Any) -> Any:
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(*args, **kwargs)


def train_loader(cell: dict[str, Any], rank: int, clock: Clock, epoch: int) -> Any:
    options, world_size = cell["options"], cell["world_size"]
    layout, kind, workers = options["layout"], options["loader"], options["num_workers"]
    if layout == "combined":
        parts = {
            f"l{loader}": DataLoader(LoaderPart(options, rank, loader, clock), batch_size=None)
            for loader in range(len(options["combined"]["lengths"]))
        }
        return CombinedLoader(parts, mode=options["combined"]["mode"])
    if layout == "litdata":
        return litdata_items.loader(options)  # built here, after the process group exists: LitData reads it
    if layout in ("per_rank", "iterable"):
        batches = Batches(options, rank, world_size, clock, epoch)
        dataset: Any = Stream(batches) if layout == "iterable" else batches
        make: Any = stateful if kind == "stateful" else DataLoader
        return make(dataset, batch_size=None, num_workers=workers)
    items = Items(options)
    if layout == "user_sharded":
        subset = torch.utils.data.Subset(items, list(range(rank, len(items), matrix.WORLD)))
        return DataLoader(subset, batch_size=options["batch_size"], num_workers=workers)
    if kind == "batch_sampler":
        return DataLoader(items, batch_sampler=VariedBatchSampler(RandomSampler(items)), num_workers=workers)
    if kind == "subclass":
        return NamedLoader(items, "named", batch_size=options["batch_size"], shuffle=True, num_workers=workers)
    make = stateful if kind == "stateful" else DataLoader
    return make(items, batch_size=options["batch_size"], shuffle=options["shuffle"], num_workers=workers)


def parts_of(batch: Any) -> list[Any]:
    """A batch's parts: one, or each loader's of a combined batch (`None` for a loader out of batches)."""
    if isinstance(batch, dict):
        return [part for part in batch.values() if part is not None]
    return [batch]


def joined(batch: Any) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A batch's items, every part's: ``(x, y, w, ids)``."""
    parts = parts_of(batch)
    x, y, w, ids = (torch.cat([part[i] for part in parts]) for i in range(4))
    return x, y, w, ids


# -------------------------------------------------------------------------------------------------- the module
class MatrixModule(LightningModule):
    """The tiny model of `matrix.make_model`, its loss the mean over a batch's valid items; the row's hooks."""

    def __init__(self, cell: dict[str, Any]) -> None:
        super().__init__()
        self.cell, self.options = cell, cell["options"]
        self.hook = self.options["hook"]
        self.model = matrix.make_model()
        if float64(cell):
            self.model.double()
        self.automatic_optimization = self.hook != "manual"
        self.items_metric = torchmetrics.SumMetric(dist_sync_on_step=True) if self.hook == "metric" else None
        self.clock = Clock()
        self.steps: list[dict[str, Any]] = []  # each optimizer step: its global_step and the batches it trained
        self.pending: list[tuple[int, int, list[int], bool]] = []  # since the last step: (epoch, idx, ids, replay)
        self.flags: dict[str, list[tuple[int, int, bool]]] = {"callback": [], "module": []}
        self.step_at_batch_start = 0
        self.losses_seen: list[float] = []

    # -------------------------------------------------------------------------------------------------- training
    def training_step(self, batch: Any, batch_idx: int = 0, dataloader_idx: int = 0) -> Any:
        return self.step(batch, batch_idx)

    def step(self, batch: Any, batch_idx: int) -> Any:
        raise_at = self.options["raise_at"]
        if raise_at is not None and [self.current_epoch, batch_idx] == list(raise_at):
            raise RuntimeError(f"injected failure at epoch {self.current_epoch}, batch {batch_idx}")
        x, y, w, ids = joined(batch)
        dtype = next(self.model.parameters()).dtype
        x, y, w = x.to(dtype), y.to(dtype), w.to(dtype)
        replay = bool(getattr(self.trainer.strategy, "padding_step", False))
        if not any(p[0] == self.current_epoch and p[1] == batch_idx for p in self.pending):
            self.pending.append((self.current_epoch, batch_idx, ids.tolist(), replay))
        mean = matrix.masked_mean(matrix.item_losses(self.model, x, y), w)
        count = w.sum().detach()
        if self.hook == "log":
            self.log("train/mean", mean.detach(), on_step=True, on_epoch=True, sync_dist=True, batch_size=len(ids))
            self.log("train/items", count, reduce_fx="sum", on_step=False, on_epoch=True, sync_dist=True)
        if self.hook == "metric":
            assert self.items_metric is not None
            self.items_metric(count)  # its forward syncs across the ranks on every step
            self.log("train/items_metric", self.items_metric, on_step=False, on_epoch=True)
        if self.options["early_stopping"]:
            self.log("stopper", float(self.current_epoch), on_step=False, on_epoch=True)
        if self.hook == "none" and (self.current_epoch, batch_idx) == (0, 0):
            return None  # Lightning skips such a batch under a single device
        if self.hook == "manual":
            self.manual_backward(mean)
            self.optimizers().step()
            self.optimizers().zero_grad()
            return None
        if not self.cell["weighted"]:
            return {"loss": mean}
        return {"loss": mean, "count": count} if self.cell["path"] == "after" else mean

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        replay = bool(getattr(self.trainer.strategy, "padding_step", False))
        self.flags["module"].append((self.current_epoch, batch_idx, replay))
        self.step_at_batch_start = self.global_step
        stop_at = self.options["stop_at"]
        return -1 if stop_at is not None and [self.current_epoch, batch_idx] == list(stop_at) else None

    def on_train_epoch_start(self) -> None:
        self.pending = []  # a half window the last epoch dropped trained nothing

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.pending and self.global_step > self.step_at_batch_start:  # a window of no item: no optimizer step
            self.steps.append({"step": self.step_at_batch_start, "batches": self.pending})
            self.pending = []

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if not self.steps or self.steps[-1]["step"] != self.global_step:
            self.steps.append({"step": self.global_step, "batches": []})
        batches = self.steps[-1]["batches"]  # LBFGS: its closure runs training_step several times for one step
        batches += [b for b in self.pending if all(b[:2] != c[:2] for c in batches)]
        self.pending = []
        if self.hook == "halve":
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.mul_(0.5)

    # ------------------------------------------------------------------------------------------- the row's hooks
    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        if self.hook == "cast" and isinstance(batch, (tuple, list)):
            return tuple(t.to(device) for t in batch)
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if self.hook == "drop_before" and self.trainer.training and len(batch[3]) > 1:
            return tuple(t[:-1] for t in batch)  # the last row goes
        return batch

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if self.hook == "cast" and isinstance(batch, (tuple, list)):
            return (batch[0].double(), batch[1].double(), batch[2].double(), batch[3])
        if self.hook == "mask_after" and self.trainer.training:
            x, y, w, ids = batch
            return x, y, torch.where(ids % 3 == 0, torch.zeros_like(w), w), ids
        return batch

    def on_before_backward(self, loss: Tensor) -> None:
        if self.hook == "before_backward":
            self.losses_seen.append(float(loss.detach()))

    def on_after_backward(self) -> None:
        if self.hook == "freeze":
            grad = self.model[2].bias.grad
            if grad is not None:
                grad.zero_()

    def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        if self.hook == "backward":
            loss.backward()
        else:
            super().backward(loss, *args, **kwargs)

    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: float | None = None, gradient_clip_algorithm: str | None = None
    ) -> None:
        if self.hook == "configure_clipping":
            if self.trainer.global_step >= 1:
                self.clip_gradients(optimizer, gradient_clip_val=0.02, gradient_clip_algorithm="value")
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        if self.hook == "warmup":
            for group in optimizer.param_groups:
                group["lr"] = LR * min(1.0, (self.trainer.global_step + 1) / 3)
            optimizer.step(closure=optimizer_closure)
            return
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        if self.hook == "zero_grad":
            optimizer.zero_grad(set_to_none=False)
        else:
            super().optimizer_zero_grad(epoch, batch_idx, optimizer)

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        scheduler.step()  # the override Lightning documents for a scheduler of one's own

    # ----------------------------------------------------------------------------------------- data and model
    def train_dataloader(self) -> Any:
        self.clock.trainer = self.trainer
        rank = int(os.environ["LOCAL_RANK"])
        return train_loader(self.cell, rank, self.clock, self.trainer.current_epoch if self.options["reload"] else 0)

    def val_dataloader(self) -> Any:
        rank = int(os.environ["LOCAL_RANK"])
        lengths = self.options["val_lengths"] if self.cell["world_size"] == 2 else (sum(self.options["val_lengths"]),)
        return DataLoader(
            [as_batch(matrix.batch_ids(rank, 9, k, loader=4), "tokens") for k in range(lengths[rank])], batch_size=None
        )

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, w, _ = batch
        dtype = next(self.model.parameters()).dtype
        matrix.masked_mean(matrix.item_losses(self.model, x.to(dtype), y.to(dtype)), w.to(dtype))

    def configure_model(self) -> None:
        if self.cell["engine"] != "fsdp2":
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in (self.model[0], self.model[2], self.model):
            fully_shard(layer, mesh=mesh)

    def configure_optimizers(self) -> Any:
        if self.options["optimizer"] == "lbfgs":
            return torch.optim.LBFGS(self.model.parameters(), **LBFGS)
        optimizer = torch.optim.SGD(self.model.parameters(), lr=LR, momentum=self.options["momentum"])
        if self.hook != "scheduler":
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class IteratorModule(MatrixModule):
    def training_step(self, dataloader_iter: Any) -> Any:  # type: ignore[override]
        batch, batch_idx, _ = next(dataloader_iter)
        return self.step(batch, batch_idx)


class Record(Callback):
    """Reads the replay flag at each batch's start; keeps the whole parameters when training ends."""

    def __init__(self) -> None:
        self.params: list[Tensor] | None = None

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        replay = bool(getattr(trainer.strategy, "padding_step", False))
        pl_module.flags["callback"].append((trainer.current_epoch, batch_idx, replay))

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        with full(trainer):
            self.params = [whole(p) for p in pl_module.model.parameters()]


class FakeClock(Callback):
    """`max_time` on a clock that advances one second at the start of each train batch."""

    def __init__(self) -> None:
        self.now = 0.0
        import lightning.pytorch.callbacks.timer as timer

        timer.time = types.SimpleNamespace(monotonic=lambda: self.now)  # type: ignore[attr-defined]

    def on_train_batch_start(self, *args: Any) -> None:
        self.now += 1.0


# ------------------------------------------------------------------------------------------------ the strategy
def float64(cell: dict[str, Any]) -> bool:
    """A float64 model: under DDP (64-true) and FSDP2 (which keeps its dtype), unless the row sets a precision."""
    precision = cell["options"]["precision"]
    return precision == "64-true" or (precision is None and cell["engine"] in ("ddp", "fsdp2"))


def precision_of(cell: dict[str, Any]) -> str:
    precision = cell["options"]["precision"]
    if precision is not None:
        return str(precision)
    return "64-true" if cell["engine"] == "ddp" else "32-true"


def make_strategy(cell: dict[str, Any]) -> Any:
    engine, weighted = cell["engine"], cell["weighted"]
    if engine == "ddp":
        return (lightning_weighted.WeightedDDPStrategy if weighted else DDPStrategy)(timeout=PG_TIMEOUT)
    if engine == "fsdp2":
        cls: Any = lightning_weighted.WeightedModelParallelStrategy if weighted else ModelParallelStrategy
        return cls(data_parallel_size=cell["world_size"], tensor_parallel_size=1, timeout=PG_TIMEOUT)
    cls = lightning_weighted.WeightedFSDPStrategy if weighted else CPUFSDPStrategy
    return cls(timeout=PG_TIMEOUT, auto_wrap_policy={nn.Linear}, state_dict_type=cell["options"]["state_dict_type"])


def make_trainer(cell: dict[str, Any], out: str, record: Record) -> Trainer:
    options = cell["options"]
    callbacks: list[Callback] = [record]
    path = cell["path"] if cell["weighted"] else None
    if path == "ahead":
        counter = "examples" if options["mode"] == "examples" else "tokens"
        callbacks.append(
            lightning_weighted.ItemCounter("examples")
            if counter == "examples"
            else lightning_weighted.ItemCounter("tokens", key=2, mask=True)
        )
    if options["schedule"] is not None:
        callbacks.append(GradientAccumulationScheduler({int(k): v for k, v in options["schedule"].items()}))
    if options["early_stopping"]:
        callbacks.append(EarlyStopping(monitor="stopper", mode="min", patience=0, check_on_train_epoch_end=True))
    if options["max_time"] is not None:
        callbacks.append(FakeClock())
    checkpoint = options["checkpoint"]
    if checkpoint == "epoch":
        callbacks.append(ModelCheckpoint(dirpath=f"{out}.ckpt", save_top_k=-1, save_on_train_epoch_end=True))
    elif checkpoint is not None:
        callbacks.append(ModelCheckpoint(dirpath=f"{out}.ckpt", save_top_k=-1, every_n_train_steps=int(checkpoint)))
    if options["raise_at"] is not None:
        callbacks.append(OnExceptionCheckpoint(dirpath=f"{out}.ckpt"))
    validation = options["validation"]
    return Trainer(
        strategy=make_strategy(cell),
        accelerator="cpu",
        devices=cell["world_size"],
        precision=precision_of(cell),  # type: ignore[arg-type]
        max_epochs=options["epochs"],
        max_steps=options["max_steps"],
        max_time={"seconds": options["max_time"]} if options["max_time"] is not None else None,
        accumulate_grad_batches=1 if options["schedule"] is not None else options["accumulate"],
        limit_train_batches=options["limit_train_batches"],
        overfit_batches=options["overfit_batches"],
        limit_val_batches=None if validation else 0,
        val_check_interval=options["val_check_interval"],
        check_val_every_n_epoch=options["check_val_every_n_epoch"],
        num_sanity_val_steps=0,
        gradient_clip_val=options["clip"],
        gradient_clip_algorithm=options["clip_algorithm"] if options["clip"] is not None else None,
        reload_dataloaders_every_n_epochs=1 if options["reload"] else 0,
        # shared: Lightning's sampler shards; litdata: Lightning's default, which LitData's users keep (Lightning
        # inserts no sampler into a loader of an IterableDataset); else each rank's own data
        use_distributed_sampler=options["layout"] in ("shared", "litdata"),
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=checkpoint is not None or options["raise_at"] is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=os.path.dirname(out),
    )


def main() -> None:
    args = rank_arguments()
    cell = json.loads(args.config)
    cell["options"] = {**matrix.DEFAULTS, **cell["options"]}
    rank = int(os.environ["LOCAL_RANK"])
    record: dict[str, Any] = {"rank": rank, "error": None, "params": None, "steps": [], "global_step": None}
    recorder = Record()
    trainer: Trainer | None = None
    module: Any = None
    try:
        trainer = make_trainer(cell, args.out, recorder)
        module = (IteratorModule if cell["options"]["hook"] == "dataloader_iter" else MatrixModule)(cell)
        trainer.fit(module, ckpt_path=cell.get("resume"))
    except BaseException as error:
        record["error"] = f"{type(error).__name__}: {error}"
        print(f"MATRIX rank {rank} raised {record['error']}", flush=True)
        raise
    finally:
        if module is not None:
            record.update(steps=module.steps, flags=module.flags, losses_seen=module.losses_seen)
        if trainer is not None:
            record["global_step"] = trainer.global_step
            record["metrics"] = {k: float(v) for k, v in trainer.callback_metrics.items()}
        record["params"] = recorder.params
        torch.save(record, f"{args.out}.rank{rank}")


if __name__ == "__main__":
    main()
