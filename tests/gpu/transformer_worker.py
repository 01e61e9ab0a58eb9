"""Paired step times of plain DDP and ddp_weighted (counts ahead) on a decoder-only transformer, in bf16-mixed.

Fits of `"ddp"`, `"ddp_weighted"` (the same module, a bare token-mean loss, plus `ItemCounter`) and a second
`"ddp"` (the A-vs-A control) alternate for `rounds` rounds on identical data, each for `steps` optimizer steps;
a window's time runs from its first batch to the next window's first batch, with the device synchronized at
those two points only. Rank 0 writes the median window time of every fit.

`size="100M"`: 12 layers of width 768 (12 heads, MLP 3072), vocabulary 8192, 512 tokens: 97.6 M parameters.
`size="tiny"`: the CPU dry run.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from worker import device_kwargs, rank_arguments

import lightning_weighted

SIZES = {"100M": (768, 12, 12, 8192, 512), "tiny": (32, 1, 2, 64, 16)}  # width, layers, heads, vocabulary, tokens


@dataclasses.dataclass
class Config:
    device: str = "cpu"
    size: str = "tiny"
    accumulate: int = 1
    batch_size: int = 8
    steps: int = 6  # timed windows per fit, after `warmup`
    warmup: int = 2
    rounds: int = 2
    precision: str = "bf16-mixed"


class Decoder(LightningModule):
    def __init__(self, config: Config) -> None:
        super().__init__()
        width, layers, heads, vocabulary, tokens = SIZES[config.size]
        torch.manual_seed(0)
        self.embed, self.position = nn.Embedding(vocabulary, width), nn.Embedding(tokens, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocabulary)
        self.causal = nn.Transformer.generate_square_subsequent_mask(tokens)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids, labels = batch["input_ids"], batch["labels"]
        positions = torch.arange(ids.shape[1], device=ids.device)
        inputs = self.embed(ids) + self.position(positions)
        hidden = self.blocks(inputs, mask=self.causal.to(ids.device), is_causal=True)
        logits = self.head(hidden)
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=self.device.type == "cuda")


def batches(config: Config, count: int) -> list[dict[str, torch.Tensor]]:
    """Token batches whose number of valid targets varies from microbatch to microbatch (a padded tail)."""
    _, _, _, vocabulary, tokens = SIZES[config.size]
    generator = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        ids = torch.randint(vocabulary, (config.batch_size, tokens), generator=generator)
        lengths = torch.randint(tokens // 4, tokens + 1, (config.batch_size, 1), generator=generator)
        labels = torch.where(torch.arange(tokens) < lengths, ids.roll(-1, 1), -100)
        out.append({"input_ids": ids, "labels": labels})
    return out


class WindowClock(Callback):
    """Times each accumulation window from its first batch to the next window's first batch."""

    def __init__(self, config: Config) -> None:
        self.config, self.times, self._start = config, [], None

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx % self.config.accumulate:
            return
        if self.config.device == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        if self._start is not None and batch_idx // self.config.accumulate > self.config.warmup:
            self.times.append(now - self._start)
        self._start = now


def fit(config: Config, strategy: str, data: list[dict[str, torch.Tensor]]) -> float:
    clock = WindowClock(config)
    callbacks: list[Callback] = [clock]
    if strategy == "ddp_weighted":
        callbacks.append(lightning_weighted.ItemCounter("tokens", key="labels"))
    cls = lightning_weighted.WeightedDDPStrategy if strategy == "ddp_weighted" else DDPStrategy
    trainer = Trainer(
        strategy=cls(**device_kwargs(config.device, 1)),
        accelerator=config.device,
        devices=1,
        precision=config.precision,  # type: ignore[arg-type]
        max_steps=config.warmup + config.steps + 1,
        accumulate_grad_batches=config.accumulate,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(Decoder(config), train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    return statistics.median(clock.times)


def main() -> None:
    args = rank_arguments()
    config = Config(**json.loads(args.config))
    data = batches(config, (config.warmup + config.steps + 1) * config.accumulate)
    times: dict[str, list[float]] = {"ddp": [], "ddp_weighted": [], "ddp_control": []}
    for _ in range(config.rounds):  # alternating fits: each round's three are paired
        for name in times:
            times[name].append(fit(config, name.replace("_control", ""), data))
    Path(f"{args.out}.rank0").write_text(json.dumps(times))


if __name__ == "__main__":
    main()
