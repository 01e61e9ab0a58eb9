"""A model whose backward holds collectives, trained on ranks of uneven lengths with an empty microbatch.

The model's hidden layer is centred by its mean over every rank's rows, all-reduced in the forward and, through
``torch.distributed.nn.functional.all_reduce``, in the backward too (SyncBatchNorm's shape, on the CPU); its loss
adds a term of every rank's mean hidden vector, gathered with ``all_gather(..., sync_grads=True)`` (a contrastive
loss's shape); with ``sparse`` an ``nn.Embedding(sparse=True)`` adds to the hidden layer. Each rank runs as a
Trainer (``ddp_weighted``, ``fsdp2_weighted``, ``fsdp_weighted``, plain ``ddp``) or a Fabric loop (``fabric_`` and
a Fabric strategy's name) and saves its whole parameters to ``<out>.rank<r>``. The float64 reference is
:func:`reference`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

Batch = tuple[Tensor, Tensor, Tensor, Tensor]  # x [B, 3], y [B], w [B] (a 0/1 token mask), ids [B] (embedding rows)
TERM = 0.1  # the weight of the gathered term


@dataclasses.dataclass
class BackwardConfig:
    strategy: str = "ddp_weighted"
    world_size: int = 2
    lengths: Sequence[int] = (3, 4)  # microbatches per rank: rank 0 replays its last one once
    accumulate: int = 2
    masked: Sequence[Sequence[int]] = ((0, 1),)  # (rank, batch) with every token masked: a count of 0 on the host
    safe_mean: bool = True  # a fully masked mean divides by max(n, 1); False: 0/0 = NaN
    sparse: bool = False  # an nn.Embedding(sparse=True) in the model (DDP only: FSDP has no sparse gradients)
    float64: bool = True  # the model and batches in float64 (FSDP1 keeps float32 parameters)
    counter: bool = False  # Trainer: an ItemCounter counts the mask ahead and training_step returns the loss alone
    lr: float = 0.1
    pg_timeout: float = 30.0


def rank_batches(config: BackwardConfig, rank: int) -> list[Batch]:
    generator = torch.Generator().manual_seed(100 + rank)
    batches = []
    for k in range(config.lengths[rank]):
        size = 2 + k % 2 + 4 * rank  # rank 1 holds larger microbatches than rank 0
        x = torch.randn(size, 3, generator=generator)
        y = torch.randn(size, generator=generator) + rank
        w = (torch.rand(size, generator=generator) < 0.7).float()
        w[0] = 1.0
        if [rank, k] in [list(pair) for pair in config.masked]:
            w = torch.zeros(size)
        batches.append((x, y, w, torch.randint(0, 4, (size,), generator=generator)))
    return batches


class Coupled(nn.Module):
    """``last(tanh(h − mean over every rank's rows of h))``, ``h = first(x) (+ embed(ids))``; returns it and ``h``."""

    def __init__(self, sparse: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(3, 4)
        self.embed = nn.Embedding(4, 4, sparse=True) if sparse else None
        self.last = nn.Linear(4, 1)

    def hidden(self, x: Tensor, ids: Tensor) -> Tensor:
        h = self.first(x)
        return h if self.embed is None else h + self.embed(ids)

    def head(self, h: Tensor, mean: Tensor) -> Tensor:
        return self.last(torch.tanh(h - mean)).squeeze(-1)

    def forward(self, x: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
        from torch.distributed.nn.functional import all_reduce

        h = self.hidden(x, ids)
        stats = all_reduce(torch.cat([h.sum(0), h.new_full((1,), float(len(h)))]))  # forward and backward
        return self.head(h, stats[:-1] / stats[-1]), h


def step_loss(config: BackwardConfig, model: Any, batch: Batch, all_gather: Any) -> tuple[Tensor, int]:
    """The microbatch's token mean plus the gathered term, and its count (a Python int: counted on the host)."""
    x, y, w, ids = batch
    out, h = model(x, ids)
    gathered = all_gather(h.mean(0), sync_grads=True)  # [P, 4]
    n = w.sum()
    total = (0.5 * (out - y) ** 2 * w).sum()
    mean = total / (n.clamp(min=1) if config.safe_mean else n)
    return mean + TERM * gathered.mean(0).pow(2).sum(), int(n.item())


def reference(config: BackwardConfig) -> list[Tensor]:
    """Float64 single-process SGD on each window's item mean over every rank; replays add no item but enter the
    centring mean and the gathered term, as they do on their rank."""
    model = Coupled(config.sparse).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
    per_rank = [rank_batches(config, r) for r in range(config.world_size)]
    longest = max(config.lengths)
    for start in range(0, longest, config.accumulate):
        optimizer.zero_grad()
        objective, items = torch.zeros((), dtype=torch.float64), 0.0
        for k in range(start, min(start + config.accumulate, longest)):
            held = [(batches[min(k, len(batches) - 1)], k < len(batches)) for batches in per_rank]
            hs = [model.hidden(b[0].double(), b[3]) for b, _ in held]
            mean = sum(h.sum(0) for h in hs) / sum(len(h) for h in hs)
            term = TERM * torch.stack([h.mean(0) for h in hs]).mean(0).pow(2).sum()
            for ((_, y, w, _), real), h in zip(held, hs, strict=True):
                if real:
                    y, w = y.double(), w.double()
                    objective = objective + (0.5 * (model.head(h, mean) - y) ** 2 * w).sum() + w.sum() * term
                    items += float(w.sum())
        (objective / items).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def _loader(config: BackwardConfig, rank: int) -> DataLoader[Any]:
    return DataLoader(rank_batches(config, rank), batch_size=None)  # type: ignore[arg-type]


def _cast(config: BackwardConfig, batch: Batch) -> Batch:
    x, y, w, ids = batch
    return (x.double(), y.double(), w.double(), ids) if config.float64 else batch


def _whole(tensor: Tensor) -> Tensor:
    full = getattr(tensor, "full_tensor", None)
    return (full() if full is not None else tensor).detach().clone()


def run_trainer(config: BackwardConfig, out: str) -> None:
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.strategies import DDPStrategy

    import lightning_weighted
    from lightning_weighted.engines.fsdp2 import shard_blocks

    class CoupledModule(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = Coupled(config.sparse)
            if config.float64:
                self.model.double()

        def configure_model(self) -> None:
            if config.strategy.startswith("fsdp2"):
                shard_blocks(self.model, self.device_mesh)

        def training_step(self, batch: Batch, batch_idx: int) -> Any:
            loss, n = step_loss(config, self.model, _cast(config, batch), self.all_gather)
            return loss if config.strategy == "ddp" or config.counter else {"loss": loss, "count": n}

        def train_dataloader(self) -> Any:
            return _loader(config, self.global_rank)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=config.lr)

        def on_train_end(self) -> None:
            from torch.distributed.fsdp import FullyShardedDataParallel

            model = self.trainer.strategy.model
            if isinstance(model, FullyShardedDataParallel):
                with FullyShardedDataParallel.summon_full_params(model, writeback=False):
                    params = [_whole(p) for p in self.model.parameters()]
            else:
                params = [_whole(p) for p in self.model.parameters()]
            torch.save({"params": params}, f"{out}.rank{self.global_rank}")

    timeout = timedelta(seconds=config.pg_timeout)
    strategy: Any
    if config.strategy == "ddp":
        strategy = DDPStrategy(timeout=timeout)
    elif config.strategy == "ddp_weighted":
        strategy = lightning_weighted.WeightedDDPStrategy(timeout=timeout)
    elif config.strategy == "fsdp2_weighted":
        strategy = lightning_weighted.WeightedModelParallelStrategy(
            data_parallel_size=config.world_size, tensor_parallel_size=1, timeout=timeout
        )
    else:
        strategy = lightning_weighted.WeightedFSDPStrategy(timeout=timeout, auto_wrap_policy={nn.Linear})
    counters = [lightning_weighted.ItemCounter("tokens", key=2, mask=True)] if config.counter else []
    trainer = Trainer(
        strategy=strategy,
        callbacks=counters,
        accelerator="cpu",
        devices=config.world_size,
        max_epochs=1,
        accumulate_grad_batches=config.accumulate,
        precision="64-true" if config.float64 and config.strategy.startswith("ddp") else "32-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(CoupledModule())


def run_fabric(config: BackwardConfig, out: str) -> None:
    from lightning.fabric import Fabric

    import lightning_weighted

    timeout = timedelta(seconds=config.pg_timeout)
    strategy: Any
    if config.strategy == "fabric_fsdp2_weighted":
        strategy = lightning_weighted.WeightedFabricModelParallelStrategy(timeout=timeout)
    else:
        strategy = lightning_weighted.WeightedFabricDDPStrategy(timeout=timeout)
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=config.world_size, precision="32-true")
    fabric.launch()
    model = Coupled(config.sparse)
    if config.float64:
        model.double()
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=config.lr))
    loader = fabric.setup_dataloaders(_loader(config, fabric.global_rank), use_distributed_sampler=False)
    for index, batch in enumerate(loader):
        last = (index + 1) % config.accumulate == 0 or index + 1 == len(loader)
        with fabric.no_backward_sync(model, enabled=not last):
            loss, n = step_loss(config, model, _cast(config, batch), fabric.all_gather)
            fabric.backward(loss, count=n)
        if last:
            optimizer.step()
            optimizer.zero_grad()
    torch.save({"params": [_whole(p) for p in model.parameters()]}, f"{out}.rank{fabric.global_rank}")


def main() -> None:
    from worker import rank_arguments

    args = rank_arguments()
    config = BackwardConfig(**json.loads(args.config))
    (run_fabric if config.strategy.startswith("fabric_") else run_trainer)(config, args.out)


if __name__ == "__main__":
    main()
