"""Shared by the distributed tests and their worker script: data, module, and the float64 reference.

Each rank holds its own list of microbatches with uneven item counts; the reference trains one float64
copy of the model on the concatenation of every rank's microbatches of each optimizer step, minimising
the weighted item mean ``Σ w_i ℓ_i / Σ w_i`` of that step.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torchmetrics
from lightning.pytorch import LightningModule
from reads import to_device, to_host
from torch import Tensor, nn

Batch = tuple[Tensor, Tensor, Tensor]  # x [B, 3], y [B], w [B] (ones, a 0/1 token mask, or sample weights)


@dataclasses.dataclass
class Config:
    strategy: str = "ddp_weighted"
    world_size: int = 2
    mode: str = "tokens"  # examples | tokens | weights
    accumulate: int = 1
    schedule: dict[int, int] | None = None  # GradientAccumulationScheduler's {epoch: A}
    batches: int = 6  # microbatches per rank and epoch
    epochs: int = 1
    seed: int = 0
    optimizer: str = "sgd"  # sgd (momentum 0.9) | adam
    lr: float = 0.1
    precision: str = "32-true"
    clip: float | None = None
    masked: Sequence[tuple[int, int]] = ()  # (rank, batch) pairs whose mask is all zero
    empty_windows: Sequence[int] = ()  # windows (per epoch, A=accumulate) fully masked on every rank
    scheduler: bool = False
    static_graph: bool = False
    manual: bool = False
    count_collectives: bool = False
    find_unused: bool = False
    bad_count: Sequence[Any] | None = None  # (rank, batch, value) returned as that microbatch's count
    unused_layer: bool = False  # a layer that never enters the loss
    lengths: Sequence[int] | None = None  # microbatches per rank and epoch, when ranks differ
    iterable: bool = False  # serve each rank's microbatches from an IterableDataset (no length)
    items: int | None = None  # one shared dataset of this many items, sharded by Lightning's sampler
    batch_size: int = 4  # with `items`
    participation: str = "pad"
    log_sync_dist: bool = False  # self.log(..., sync_dist=True) on every step, a collective inside training_step
    val_items: int | None = None  # a validation set of this many items, scored by a weighted MeanMetric
    counter: str | None = None  # "mask": ItemCounter counts the mask, ItemMonitor logs ("quiet": no log); "bad": fails
    monitor: bool = False  # an ItemMonitor logs each step (any `counter` but "quiet" adds one too)
    bare_loss: bool = False  # training_step returns the mean alone
    merged_from: int | None = None  # world_size 1 holding, as microbatch k, every rank's microbatch k of this size
    checkpoint: bool = False  # save a checkpoint at each epoch end and on an exception
    resume: str | None = None  # checkpoint to resume from
    raise_at: Sequence[int] | None = None  # (epoch, batch_idx) where training_step raises on every rank
    count_override: float | None = None  # every microbatch returns this count (an int when it is whole)
    fault: Sequence[Any] | None = None  # (kind, rank, batch_idx): see `inject`
    pg_timeout: float = 30.0
    clip_algorithm: str = "norm"
    compile: bool = False  # torch.compile the model (aot_eager: the DDP graph splitting without a C++ build)
    join: bool = False  # enter DistributedDataParallel.join() around training
    python_reducer: bool = False  # torch._dynamo.config.optimize_ddp = "python_reducer"
    bucket_cap_mb: float | None = None  # DDP's bucket size: a tiny one puts every parameter in its own bucket
    loss_shape: Sequence[int] | None = None  # the mean reshaped to this one-element shape
    item_sum: bool = False  # return {"loss": Σ w·ℓ, "count": n, "reduction": "sum"}
    python_count: bool = False  # return the count as a Python number (host), not a tensor (on the device)
    safe_mean: bool = False  # the mean of a fully masked microbatch divides 0 by 1, not by 0 (a finite gradient)
    no_count: bool = False  # return {"loss": mean}
    host_reads: bool = False  # batches leave the loader as `reads.HostTensor`s, reach the device as `DeviceTensor`s
    device: str = "cpu"  # "cuda": every rank on cuda:0 (NCCL alone, gloo on CUDA tensors for several)
    sync_debug: bool = False  # CUDA: torch.cuda.set_sync_debug_mode("error") around microbatches after step 2
    read_in_step: bool = False  # training_step reads its count on the host (a synchronisation on a GPU)
    aux: str | None = None  # auxiliary terms: "parts" returns them in "aux", "inside" adds them into "loss"
    tied: bool = False  # a model whose first and second layers share their weight
    end_epoch_at: Sequence[int] | None = None  # (epoch, batch_idx) where on_train_batch_start returns -1 (every rank)
    parts: bool = False  # two loss parts, each the mean over its own items (see `part_masks`), counted ahead
    part_empty: Sequence[tuple[int, int]] = ()  # (rank, batch) pairs whose "positive" part holds no item


def make_model(seed: int, tied: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    if not tied:
        return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    # two layers share one weight, as a language model's embedding and output layer do (Hugging Face's GPT-2)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))
    model[2].weight = model[0].weight
    return model


def make_batches(config: Config, rank: int, epoch: int) -> list[Batch]:
    if config.items is not None:
        return _sharded_batches(config, rank, epoch)
    if config.merged_from is not None:
        ranks = [
            make_batches(dataclasses.replace(config, merged_from=None, world_size=config.merged_from), r, epoch)
            for r in range(config.merged_from)
        ]
        return [
            tuple(torch.cat(parts) for parts in zip(*(b[k] for b in ranks if k < len(b)), strict=True))
            for k in range(max(map(len, ranks)))
        ]  # type: ignore[misc]
    generator = torch.Generator().manual_seed(1000 * config.seed + 100 * epoch + rank)
    batches = []
    for k in range(config.batches if config.lengths is None else config.lengths[rank]):
        # rank 0 holds small microbatches, rank 1 large ones: a several-fold imbalance
        size = int(torch.randint(1, 4, (), generator=generator)) + 5 * rank * (k % 2 + 1)
        x = torch.randn(size, 3, generator=generator)
        y = torch.randn(size, generator=generator) + 2.0 * rank
        if config.mode == "examples":
            w = torch.ones(size)
        elif config.mode == "tokens":
            w = (torch.rand(size, generator=generator) < 0.7).float()
            w[0] = 1.0  # fully masked microbatches only where `masked` asks for them
        else:
            w = torch.rand(size, generator=generator) * 1.9 + 0.1
        window = k // config.accumulate
        if [rank, k] in [list(pair) for pair in config.masked] or window in config.empty_windows:
            w = torch.zeros(size)
        if [rank, k] in [list(pair) for pair in config.part_empty]:
            x[:, 0] = -x[:, 0].abs() - 0.1  # no item of the "positive" part
        batches.append((x, y, w))
    return batches


def part_masks(x: Tensor, w: Tensor) -> dict[str, Tensor]:
    """The items of each loss part: "tokens", the token mask; "positive", the tokens whose first feature is > 0."""
    return {"tokens": w, "positive": w * (x[:, 0] > 0)}


def _items(config: Config, batch: Batch) -> float:
    """A microbatch's items: its token mask's, or with loss parts every part's summed."""
    x, _, w = batch
    return float(sum(m.sum() for m in part_masks(x, w).values())) if config.parts else float(w.sum())


def part_means(model: nn.Module, x: Tensor, y: Tensor, w: Tensor) -> dict[str, Tensor]:
    """Each part's mean over its own items: finite where it has none beside another part's (a part counted 0 still
    runs its backward), 0/0 = NaN where the microbatch is fully masked, as a token mean is."""
    masks, predictions = part_masks(x, w), model(x).squeeze(-1)
    losses = {"tokens": 0.5 * (predictions - y) ** 2, "positive": 0.3 * predictions**2}
    held = w.sum() > 0
    return {
        name: (losses[name] * mask).sum() / torch.where(held, mask.sum().clamp(min=1), 0.0)
        for name, mask in masks.items()
    }


def shared_dataset(config: Config) -> torch.utils.data.TensorDataset:
    assert config.items is not None
    generator = torch.Generator().manual_seed(config.seed)
    x = torch.randn(config.items, 3, generator=generator)
    y = torch.randn(config.items, generator=generator)
    w = torch.rand(config.items, generator=generator) * 1.9 + 0.1
    return torch.utils.data.TensorDataset(x, y, w)


def validation_set(config: Config) -> torch.utils.data.TensorDataset:
    assert config.val_items is not None
    generator = torch.Generator().manual_seed(config.seed + 7)
    x = torch.randn(config.val_items, 3, generator=generator)
    return torch.utils.data.TensorDataset(
        x, torch.randn(config.val_items, generator=generator), torch.rand(config.val_items, generator=generator) + 0.5
    )


def _sharded_batches(config: Config, rank: int, epoch: int) -> list[Batch]:
    """What rank `rank` sees in `epoch` under a shuffling sampler that shards without padding."""
    assert config.items is not None
    x, y, w = shared_dataset(config).tensors
    order = torch.randperm(config.items, generator=torch.Generator().manual_seed(epoch))[rank :: config.world_size]
    return [(x[i], y[i], w[i]) for i in order.split(config.batch_size)]


def item_losses(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return 0.5 * (model(x).squeeze(-1) - y) ** 2


def aux_terms(model: nn.Module, x: Tensor) -> dict[str, Tensor]:
    """Two auxiliary terms of a microbatch, standing for a MoE load-balancing loss and a router z-loss."""
    hidden = model[1](model[0](x))
    return {"load_balance": 0.5 * hidden.pow(2).mean(), "z": 0.1 * model[2](hidden).pow(2).mean()}


def count_of(config: Config, w: Tensor) -> Any:
    if config.mode == "examples":
        return len(w)  # a Python int
    count = w.long().sum() if config.mode == "tokens" else w.sum()  # an int64 tensor, or a float one
    return count.item() if config.python_count else count


def masked_mean(config: Config, losses: Tensor, w: Tensor) -> Tensor:
    """``Σ w·ℓ / Σ w``: NaN when every item is masked (0/0), unless ``safe_mean`` divides 0 by 1 there."""
    total = w.sum()
    return (losses * w).sum() / (torch.where(total > 0, total, 1.0) if config.safe_mean else total)


class WeightedModule(LightningModule):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.model = make_model(config.seed, config.tied)
        if config.compile:
            self.model = torch.compile(self.model, backend="aot_eager")  # type: ignore[assignment]
        if config.precision == "64-true":
            # Lightning restores checkpoint weights before it converts the module: keep them float64 throughout
            self.model.double()
        self.unused = nn.Linear(2, 2) if config.unused_layer else None
        self.val_loss = torchmetrics.MeanMetric()
        self.automatic_optimization = not config.manual

    def training_step(self, batch: Batch, batch_idx: int) -> dict[str, Any]:
        x, y, w = batch
        if self.config.raise_at is not None and [self.current_epoch, batch_idx] == list(self.config.raise_at):
            raise RuntimeError(f"injected failure at epoch {self.current_epoch}, batch {batch_idx}")
        losses = item_losses(self.model, x, y)
        mean = masked_mean(self.config, losses, w)
        count = count_of(self.config, w)
        if self.config.fault is not None and self.config.fault[2] == batch_idx:
            failed = inject(self.config.fault, self.global_rank, "training_step")
            if failed is not NO_FAULT:
                return failed  # type: ignore[no-any-return]
        if self.config.read_in_step:
            count = int(count)  # the user's own read: what the sync check must catch
        if self.config.count_override is not None:
            value = self.config.count_override
            count = int(value) if float(value).is_integer() else value
        if self.config.loss_shape is not None:
            mean = mean.reshape(self.config.loss_shape)
        if self.config.aux == "inside":  # the control: weighted by the microbatch's items, as the loss is
            mean = mean + sum(aux_terms(self.model, x).values())
        if self.config.parts:
            parts = part_means(self.model, x, y, w)
            return {"loss": sum(parts.values()), "parts": parts}
        if self.config.aux == "parts":
            output: dict[str, Any] = {"loss": mean, "aux": aux_terms(self.model, x)}
            return output if self.config.bare_loss else {**output, "count": count}
        if self.config.bare_loss:
            return mean  # type: ignore[return-value]
        if self.config.item_sum:
            return {"loss": (losses * w).sum(), "count": count, "reduction": "sum"}
        if self.config.no_count:
            return {"loss": mean}
        if self.config.log_sync_dist:
            self.log("train/mean", mean.detach().nan_to_num(), sync_dist=True, batch_size=len(w))
        if self.config.bad_count is not None and list(self.config.bad_count[:2]) == [self.global_rank, batch_idx]:
            count = self.config.bad_count[2]
        return {"loss": mean, "count": count}

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        return -1 if [self.current_epoch, batch_idx] == list(self.config.end_epoch_at or ()) else None

    def on_before_backward(self, loss: Tensor) -> None:
        if self.config.fault is not None and self.config.fault[2] == self.trainer.fit_loop.epoch_loop.batch_idx:
            inject(self.config.fault, self.global_rank, "before_backward")

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.config.fault is not None and self.config.fault[2] == self.trainer.fit_loop.epoch_loop.batch_idx:
            inject(self.config.fault, self.global_rank, "step")

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        x, y, w = batch
        self.val_loss.update(item_losses(self.model, x, y), weight=w)
        self.log("val/loss", self.val_loss, on_epoch=True)

    def val_dataloader(self) -> Any:
        from torch.utils.data import DataLoader

        return DataLoader(validation_set(self.config), batch_size=4)

    @property
    def data_rank(self) -> int:
        """Which rank's microbatches this process trains on."""
        return self.global_rank

    def train_dataloader(self) -> Any:
        return train_loader(self.config, self.data_rank, self)

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        batch = super().transfer_batch_to_device(batch, device, dataloader_idx)
        return to_device(batch) if self.config.host_reads and self.trainer.training else batch

    def configure_optimizers(self) -> Any:
        optimizer = make_optimizer(self.config, self.model.parameters())
        if not self.config.scheduler:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


NO_FAULT = object()


# where each fault kind strikes; the others strike in training_step, before the window's count reduction
_POINTS = {"exit_after_count": "before_backward", "kill_after_count": "before_backward", "raise_in_step": "step"}


def inject(fault: Sequence[Any], rank: int, where: str) -> Any:
    """Injects `fault = (kind, rank, batch_idx[, seconds])` on its rank, at the point its kind belongs to."""
    import os
    import signal
    import time

    kind, target = fault[0], fault[1]
    if rank != target or _POINTS.get(kind, "training_step") != where:
        return NO_FAULT
    print(f"FAULT {kind} {time.time():.3f}", flush=True)
    if kind in ("raise", "raise_in_step"):
        raise RuntimeError(f"injected {kind} on rank {rank}")
    if kind in ("exit", "exit_after_count"):
        os._exit(1)
    if kind in ("kill", "kill_after_count"):
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)  # what SLURM sends before preempting a job
        return NO_FAULT
    if kind == "stall":
        time.sleep(float(fault[3]))
        return NO_FAULT
    if kind == "none":
        return None
    if kind == "nograd":
        return {"loss": torch.tensor(0.0), "count": 3}
    raise ValueError(f"unknown fault {kind!r}")


class Clock(Protocol):
    """What says which epoch a loader serves: the LightningModule (its trainer's epoch), or a Fabric loop's own."""

    current_epoch: int


def train_loader(config: Config, rank: int, clock: Clock) -> torch.utils.data.DataLoader[Any]:
    """Rank `rank`'s training loader: its own microbatches of `clock`'s epoch (whole microbatches, `batch_size=None`),
    or with `items` one shared data set that the front end's sampler shards."""
    from torch.utils.data import DataLoader

    if config.items is not None:
        return DataLoader(shared_dataset(config), batch_size=config.batch_size, shuffle=True)
    epochs = [make_batches(config, rank, e) for e in range(config.epochs)]
    if config.host_reads:  # the loader hands out host batches
        epochs = [[to_host(b) for b in e] for e in epochs]
    if config.iterable:
        return DataLoader(_EpochStream(epochs, clock), batch_size=None)
    return DataLoader(_EpochList(epochs, clock), batch_size=None)


class _EpochList(torch.utils.data.Dataset[Batch]):
    """Serves the current epoch's microbatches of one rank."""

    def __init__(self, epochs: list[list[Batch]], clock: Clock) -> None:
        self.epochs, self.clock = epochs, clock

    def __len__(self) -> int:
        return len(self.epochs[0])

    def __getitem__(self, index: int) -> Batch:
        return self.epochs[self.clock.current_epoch][index]


class _EpochStream(torch.utils.data.IterableDataset[Batch]):
    """Streams the current epoch's microbatches of one rank, without a length."""

    def __init__(self, epochs: list[list[Batch]], clock: Clock) -> None:
        self.epochs, self.clock = epochs, clock

    def __iter__(self) -> Any:
        return iter(self.epochs[self.clock.current_epoch])


def make_optimizer(config: Config, params: Any) -> torch.optim.Optimizer:
    if config.optimizer == "adam":
        return torch.optim.Adam(params, lr=config.lr)
    return torch.optim.SGD(params, lr=config.lr, momentum=0.9)


def windows(config: Config, epoch: int) -> list[range]:
    """The microbatch indices of each optimizer step: every rank runs as many as the longest rank holds."""
    a = config.accumulate
    if config.schedule is not None:
        a = max(v for k, v in config.schedule.items() if int(k) <= epoch)
    longest = max(len(make_batches(config, r, epoch)) for r in range(config.world_size))
    return [range(start, min(start + a, longest)) for start in range(0, longest, a)]


def reference(config: Config) -> dict[str, Any]:
    """Float64 single-process training on the intended objective; returns params and per-step grad norms."""
    model = copy.deepcopy(make_model(config.seed, config.tied)).double()
    optimizer = make_optimizer(config, model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5) if config.scheduler else None
    norms, losses, items, local_items, aux_means = [], [], [], [], []
    for epoch in range(config.epochs):
        per_rank = [make_batches(config, r, epoch) for r in range(config.world_size)]
        for window in windows(config, epoch):
            ends = config.end_epoch_at
            if ends is not None and ends[0] == epoch and window.stop > ends[1]:
                break  # the module ends the epoch there: Lightning steps no window it cut, and drops its gradient
            held = [per_rank[r][k] for r in range(config.world_size) for k in window if k < len(per_rank[r])]
            x = torch.cat([b[0] for b in held]).double()
            y = torch.cat([b[1] for b in held]).double()
            w = torch.cat([b[2] for b in held]).double()
            masks = part_masks(x, w) if config.parts else {"": w}
            if all(mask.sum() == 0 for mask in masks.values()):
                continue  # a window without items changes nothing
            optimizer.zero_grad()
            if config.parts:  # each part the mean over its own items of the window, every rank and microbatch
                totals = {name: mask.sum() for name, mask in masks.items()}
                means = part_means(model, x, y, w)
                loss = sum(means[name] * masks[name].sum().clamp(min=1) / n for name, n in totals.items() if n > 0)
            else:
                loss = (item_losses(model, x, y) * w).sum() / w.sum()
            if config.aux is not None:  # averaged over the window's microbatches and ranks, as plain DDP averages
                shares = config.world_size * len(window)
                parts = [aux_terms(model, b[0].double()) for b in held]
                loss = loss + sum(sum(p.values()) for p in parts) / shares
                aux_means.append({name: float(sum(p[name].detach() for p in parts)) / shares for name in parts[0]})
            loss.backward()
            losses.append(loss.item())
            items.append(float(sum(mask.sum() for mask in masks.values())))
            local_items.append([sum(_items(config, b[k]) for k in window if k < len(b)) for b in per_rank])
            norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
            norms.append(float(norm))
            if config.clip is not None and config.clip_algorithm == "value":
                torch.nn.utils.clip_grad_value_(model.parameters(), config.clip)
            elif config.clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "norms": norms,
        "losses": losses,
        "items": items,
        "local_items": local_items,
        "aux_means": aux_means,
    }


def max_relative_error(params: Sequence[Tensor], expected: Sequence[Tensor]) -> float:
    scale = max(float(e.abs().max()) for e in expected)
    return max(float((p.double() - e).abs().max()) for p, e in zip(params, expected, strict=True)) / scale


def identical(a: object, b: object) -> bool:
    """Whether two records (tensors, nested in dicts and lists) are equal bit for bit."""
    if isinstance(a, Tensor):
        return isinstance(b, Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(identical(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(identical, a, b))
    return a == b


def is_finite(params: Sequence[Tensor]) -> bool:
    return all(math.isfinite(float(p.double().sum())) for p in params)
