"""Where users look: logged values, evaluation with uneven ranks, mid-epoch resume, loss spikes, SWA (one rank).

Scenarios (`EdgeConfig.scenario`):

- `logging`: a small token model fits one epoch, then validates and tests; every stage logs what Lightning users
  write (`self.log(..., sync_dist=True)` of a batch mean with the batch size inferred, of a token mean with
  `batch_size=n_tokens` as an int and as a float, a torchmetrics `MeanMetric`, a loss returned for `val/loss`),
  optionally an on-step synced value and an `all_gather` in every evaluation step; then predicts. Every rank saves
  the metrics Lightning holds after each stage and the items each stage saw.
- `resume`: 8 optimizer steps of A = 2 over a `StatefulDataLoader` with the user's own unshuffled
  `DistributedSampler`, stopped at `stop_at` and resumed from the checkpoint saved there (or not stopped).
- `spike`: rank 1's loss turns `inf` at one step, under Lightning's `SpikeDetection`.
- `swa`: `StochasticWeightAveraging` on a model with BatchNorm (its last epoch only recomputes the statistics).
"""

from __future__ import annotations

import dataclasses
import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torchmetrics
from cpu_fsdp import CPUFSDPStrategy
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, SpikeDetection, StochasticWeightAveraging
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from worker import rank_arguments

import lightning_weighted

TOKENS = 4  # per item; each item holds 1 to 4 valid ones


@dataclasses.dataclass
class EdgeConfig:
    scenario: str = "logging"
    strategy: str = "ddp_weighted"  # ddp_weighted | ddp | fsdp2_weighted | fsdp2 | fsdp_weighted | fsdp
    world_size: int = 2
    items: int = 7  # in each of the train, validation and test sets
    batch_size: int = 2
    on_step: bool = False  # validation_step also logs an on-step synced value and all-gathers its batch
    counter: bool = False  # an ItemCounter counts the valid tokens
    stop_at: int | None = None  # resume: the step the first run stops and checkpoints at
    resume: str | None = None


def token_data(items: int, seed: int) -> TensorDataset:
    """``items`` items of ``TOKENS`` tokens: inputs ``[items, TOKENS, 3]``, targets, a 0/1 mask of 1-4 valid tokens."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(items, TOKENS, 3, generator=generator)
    y = torch.randn(items, TOKENS, generator=generator)
    valid = torch.randint(1, TOKENS + 1, (items, 1), generator=generator)
    mask = (torch.arange(TOKENS) < valid).float()
    return TensorDataset(x, y, mask, torch.arange(items))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))


def token_losses(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return 0.5 * (model(x).squeeze(-1) - y) ** 2


class TokenModule(LightningModule):
    def __init__(self, config: EdgeConfig) -> None:
        super().__init__()
        self.config = config
        self.model = make_model()
        self.metrics = nn.ModuleDict({f"{s}_mean": torchmetrics.MeanMetric() for s in ("train", "val", "test")})
        self.seen: dict[str, list[int]] = {"train": [], "val": [], "test": []}

    def configure_model(self) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if self.config.strategy.startswith("fsdp2") and not isinstance(self.model, FSDPModule):  # once per module
            for layer in (self.model[0], self.model[2]):
                fully_shard(layer, mesh=self.device_mesh["data_parallel"])
            fully_shard(self.model, mesh=self.device_mesh["data_parallel"])

    def step(self, stage: str, batch: Any) -> dict[str, Any]:
        x, y, mask, index = batch
        losses = token_losses(self.model, x, y)
        n = mask.sum()
        token_mean = (losses * mask).sum() / n
        item_means = (losses * mask).sum(-1) / mask.sum(-1)
        if not getattr(self.trainer.strategy, "padding_step", False):  # a replay keeps pace, sees nothing
            self.seen[stage].extend(index.tolist())
        self.log(f"{stage}/batch_mean", item_means.mean(), sync_dist=True, on_epoch=True, on_step=False)
        self.log(f"{stage}/token_mean", token_mean, sync_dist=True, batch_size=int(n), on_epoch=True, on_step=False)
        self.log(f"{stage}/token_mean_f", token_mean, sync_dist=True, batch_size=float(n), on_epoch=True)
        self.metrics[f"{stage}_mean"].update(losses, weight=mask)
        self.log(f"{stage}/metric", self.metrics[f"{stage}_mean"], on_epoch=True, on_step=False)
        return {"loss": token_mean, "count": n.long()}

    def on_validation_start(self) -> None:
        self.seen["val"] = []  # the items of the last validation run (the fit's, then `validate()`'s)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        output = self.step("train", batch)
        return output if not self.config.counter else output["loss"]

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        output = self.step("val", batch)
        if self.config.on_step:
            self.log("val/step_mean", output["loss"], sync_dist=True, on_step=True, on_epoch=False)
            self.all_gather(output["loss"].detach())  # a per-batch collective of the user's own (a fixed shape)
        return output

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        return self.step("test", batch)

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        return batch[3]

    def loader(self, seed: int) -> DataLoader:
        return DataLoader(token_data(self.config.items, seed), batch_size=self.config.batch_size)

    def train_dataloader(self) -> Any:
        return self.loader(1)

    def val_dataloader(self) -> Any:
        return self.loader(2)

    def test_dataloader(self) -> Any:
        return self.loader(3)

    def predict_dataloader(self) -> Any:
        return self.loader(3)

    def configure_optimizers(self) -> Any:
        # logging: lr 0 keeps every stage's values those of the initial model, the test's exact reference
        return torch.optim.SGD(self.parameters(), lr=0.0 if self.config.scenario == "logging" else 0.1)


class ResumeModule(TokenModule):
    """16 batches of one item per rank, each rank's shard taken by a `DistributedSampler` of the user's own."""

    def train_dataloader(self) -> Any:
        from torchdata.stateful_dataloader import StatefulDataLoader

        data = token_data(16 * self.config.world_size, 4)
        sampler = DistributedSampler(data, num_replicas=self.config.world_size, rank=self.global_rank, shuffle=False)
        return StatefulDataLoader(data, batch_size=1, sampler=sampler)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y, mask, index = batch
        self.seen["train"].append(int(index))
        losses = token_losses(self.model, x, y)
        mean = (losses * mask).sum() / mask.sum()
        return mean if self.config.counter else {"loss": mean, "count": mask.sum().long()}


class SpikeModule(TokenModule):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        output = self.step("train", batch)
        if batch_idx == 1 and self.global_rank == 1:
            output["loss"] = output["loss"] * torch.tensor(float("inf"))  # a loss spike on one rank
        return output if not self.config.counter else {"loss": output["loss"]}


class BatchNormModule(TokenModule):
    def __init__(self, config: EdgeConfig) -> None:
        super().__init__(config)
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(TOKENS), nn.Tanh(), nn.Linear(8, 1))


def make_strategy(config: EdgeConfig) -> Any:
    timeout = timedelta(seconds=30)
    weighted = config.strategy.endswith("_weighted")
    if config.strategy.startswith("fsdp2"):
        cls = lightning_weighted.WeightedModelParallelStrategy if weighted else ModelParallelStrategy
        return cls(data_parallel_size=config.world_size, tensor_parallel_size=1, timeout=timeout)
    if config.strategy.startswith("fsdp"):
        cls = lightning_weighted.WeightedFSDPStrategy if weighted else CPUFSDPStrategy
        return cls(timeout=timeout, auto_wrap_policy={nn.Linear}, state_dict_type="full")
    return (lightning_weighted.WeightedDDPStrategy if weighted else DDPStrategy)(timeout=timeout)


class Record(Callback):
    def __init__(self) -> None:
        self.metrics: dict[str, dict[str, float]] = {}

    def _take(self, trainer: Trainer, stage: str) -> None:
        self.metrics[stage] = {k: float(v) for k, v in trainer.callback_metrics.items()}

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._take(trainer, "fit")

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._take(trainer, "validate")

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._take(trainer, "test")


def main() -> None:
    args = rank_arguments()
    config = EdgeConfig(**json.loads(args.config))
    module_class = {"resume": ResumeModule, "spike": SpikeModule, "swa": BatchNormModule}.get(config.scenario)
    module = (module_class or TokenModule)(config)
    record = Record()
    callbacks: list[Callback] = [record]
    if config.counter:
        callbacks.append(lightning_weighted.ItemCounter("tokens", key=2, mask=True))
    common: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": config.world_size,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "default_root_dir": str(Path(args.out).parent),  # Lightning's own checkpoints land in the test's folder
    }
    out: dict[str, Any] = {}
    if config.scenario == "logging":
        trainer = Trainer(strategy=make_strategy(config), max_epochs=1, callbacks=callbacks, **common)
        trainer.fit(module)
        trainer.validate(module, verbose=False)
        trainer.test(module, verbose=False)
        out["predictions"] = [int(i) for batch in trainer.predict(module) or [] for i in batch]
    elif config.scenario == "resume":
        checkpoints = ModelCheckpoint(
            dirpath=f"{args.out}.ckpt", every_n_train_steps=config.stop_at or 8, save_top_k=-1
        )
        steps = config.stop_at if config.stop_at is not None and config.resume is None else 8
        trainer = Trainer(
            strategy=make_strategy(config),
            max_steps=steps,
            accumulate_grad_batches=2,
            callbacks=[*callbacks, checkpoints],
            enable_checkpointing=True,
            **{**common, "limit_val_batches": 0},
        )
        trainer.fit(module, ckpt_path=config.resume)
        out["checkpoint"] = str(next(Path(f"{args.out}.ckpt").glob("*.ckpt"), ""))
        out["global_step"] = trainer.global_step
    elif config.scenario == "spike":
        trainer = Trainer(
            strategy=make_strategy(config),
            max_epochs=1,
            callbacks=[*callbacks, SpikeDetection(exclude_batches_path=f"{args.out}.spikes.json")],
            **{**common, "limit_val_batches": 0},
        )
        try:
            trainer.fit(module)
            out["outcome"] = "trained"
        except Exception as error:  # what the callback decided, the same under every strategy
            out["outcome"] = type(error).__name__
    elif config.scenario == "swa":
        swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)
        trainer = Trainer(
            strategy=make_strategy(config),
            max_epochs=3,
            callbacks=[*callbacks, swa],
            **{**common, "limit_val_batches": 0},
        )
        trainer.fit(module)
        out["global_step"] = trainer.global_step
    out.update(
        metrics=record.metrics,
        seen=module.seen,
        full=_full_state(trainer, module),
    )
    torch.save(out, f"{args.out}.rank{trainer.global_rank}")


def _full_state(trainer: Trainer, module: LightningModule) -> dict[str, Tensor] | None:
    """The module's whole parameters under DDP or FSDP2 (a collective there); ``None`` under FSDP1."""
    if isinstance(trainer.strategy, FSDPStrategy):
        return None
    state = {}
    for name, param in module.named_parameters():
        full = getattr(param, "full_tensor", None)
        state[name] = (full() if full is not None else param).detach().clone()
    return state


if __name__ == "__main__":
    main()
