"""Whole Lightning ``Trainer`` fits, side by side: ``"ddp"``, ``"ddp_weighted"``, the anchors, FSDP2 and FSDP1.

Each variant is a whole ``Trainer.fit`` in its own thread of one rank process, all in one gloo process group that
the rank creates (Lightning sees ``LOCAL_RANK`` and joins it instead of launching). A baton callback parks every fit
at the start of each accumulation window; the main thread releases one fit at a time, in an order shuffled per round
(the same on every rank) after a barrier, so the variants' optimizer steps interleave exactly as the raw steps do
and their collectives never mix. A step's time runs from the release to the fit parking at the next window (one
full window: Lightning's per-batch SIGTERM broadcast, data fetch, forward, backward, reduction, optimizer, hooks).

Counts ahead are the plain module with ``ItemCounter("tokens", key=2, mask=True)``; counts after
return ``{"loss": mean, "count": n}``. Plain FSDP1 is ``examples/cpu_fsdp.py``'s Lightning ``FSDPStrategy`` on
the CPU; every ``Linear`` is an FSDP unit (FSDP1) or ``fully_shard``-ed before the model (FSDP2).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from common import (
    LR,
    Batch,
    BatchStream,
    CollectiveCounter,
    Point,
    bucket_counts,
    deviation,
    gradient_deviation,
    local_mean,
    local_sum,
    make_batch,
    make_model,
    reference_gradient,
    reference_params,
    timed_rounds,
)
from cpu_fsdp import CPUFSDPStrategy
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import ModelParallelStrategy
from steps import count_all_ranks
from torch import Tensor, nn

import lightning_weighted

PRECISION = {"fp32": "32-true", "bf16": "bf16-true"}
WAIT_S = 300.0


class PlainModule(LightningModule):
    """Returns the local mean: what ``strategy="ddp"`` users write (the wrong objective with uneven counts)."""

    def __init__(self, model: nn.Module, shard: bool = False) -> None:
        super().__init__()
        self.model, self.shard = model, shard

    def training_step(self, batch: Batch, batch_idx: int) -> Any:
        return local_mean(self.model, batch)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=LR)

    def configure_model(self) -> None:
        if self.shard:  # FSDP2: each Linear, then the model, over the data-parallel ranks
            from torch.distributed.fsdp import fully_shard

            for layer in [m for m in self.model if isinstance(m, nn.Linear)] + [self.model]:
                fully_shard(layer, mesh=self.device_mesh["data_parallel"])


class WeightedModule(PlainModule):
    """Returns ``{"loss": local_mean, "count": n}``: counts known only after ``training_step`` (counts after)."""

    def training_step(self, batch: Batch, batch_idx: int) -> Any:
        return {"loss": local_mean(self.model, batch), "count": batch[2].sum()}


class PostHocModule(PlainModule):
    """Post-hoc normalisation under ``"ddp"``: the count all-reduce and the gradient multiply in
    ``on_before_optimizer_step`` (after the backward, before clipping)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.items = torch.zeros((), dtype=torch.int64)

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        self.items += batch[2].sum()
        return local_sum(self.model, batch)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Lightning divided each loss by A and DDP averaged over P ranks: multiply back by P·A / N.
        scale = self.trainer.world_size * self.trainer.accumulate_grad_batches / count_all_ranks(self.items)
        torch._foreach_mul_([p.grad for p in self.parameters() if p.grad is not None], scale)
        self.items = torch.zeros((), dtype=torch.int64)


class PreCountModule(PlainModule):
    """Pre-count normalisation under ``"ddp"``, fed by :class:`WindowPrefetch`: the blocking count all-reduce in
    the window's first ``training_step``, before its forward."""

    def training_step(self, tagged: tuple[Batch, Tensor | None], batch_idx: int) -> Tensor:
        batch, window_count = tagged
        if window_count is not None:  # P·A / N: DDP averages over P ranks and Lightning divides each loss by A
            self.scale = self.trainer.world_size * self.trainer.accumulate_grad_batches / count_all_ranks(window_count)
        return local_sum(self.model, batch) * self.scale


class WindowPrefetch(BatchStream):
    """Reads a whole window ahead (as HF's ``get_batch_samples`` does) and tags its first microbatch with the
    window's local count; the window's batches are alive together until it is consumed."""

    def __init__(self, batches: Sequence[Batch], accumulate: int) -> None:
        super().__init__(batches)
        self.accumulate = accumulate

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        iterator = super().__iter__()
        while window := list(itertools.islice(iterator, self.accumulate)):
            local = sum((b[2].sum() for b in window), torch.zeros((), dtype=torch.int64))
            yield from ((batch, local if micro == 0 else None) for micro, batch in enumerate(window))


def _counter() -> list[Callback]:
    return [lightning_weighted.ItemCounter("tokens", key=2, mask=True)]


# name -> (module, strategy, the callbacks it adds); "ddp_callback": plain "ddp" with one more Callback that
# overrides nothing, the cost of Lightning's dispatch of any callback (`ItemCounter`'s included)
VARIANTS: dict[str, tuple[Callable[[nn.Module], LightningModule], str, Callable[[], list[Callback]]]] = {
    "ddp": (PlainModule, "ddp", list),
    "ddp_control": (PlainModule, "ddp", list),
    "ddp_callback": (PlainModule, "ddp", lambda: [Callback()]),
    "ddp_weighted": (PlainModule, "ddp_weighted", _counter),
    "ddp_weighted_after": (WeightedModule, "ddp_weighted", list),
    "post_hoc": (PostHocModule, "ddp", list),
    "pre_count": (PreCountModule, "ddp", list),
    "fsdp2": (lambda m: PlainModule(m, shard=True), "fsdp2", list),
    "fsdp2_control": (lambda m: PlainModule(m, shard=True), "fsdp2", list),
    "fsdp2_weighted": (lambda m: WeightedModule(m, shard=True), "fsdp2_weighted", list),
    "fsdp2_weighted_ahead": (lambda m: PlainModule(m, shard=True), "fsdp2_weighted", _counter),
    "fsdp": (PlainModule, "fsdp", list),
    "fsdp_weighted": (WeightedModule, "fsdp_weighted", list),
    "fsdp_weighted_ahead": (PlainModule, "fsdp_weighted", _counter),
}


def make_strategy(name: str, timeout: float) -> Any:
    limit, world = timedelta(seconds=timeout), dist.get_world_size()
    if name.startswith("fsdp2"):
        cls = lightning_weighted.WeightedModelParallelStrategy if "_weighted" in name else ModelParallelStrategy
        return cls(data_parallel_size=world, tensor_parallel_size=1, timeout=limit)
    if name.startswith("fsdp"):
        cls = lightning_weighted.WeightedFSDPStrategy if "_weighted" in name else CPUFSDPStrategy
        return cls(auto_wrap_policy={nn.Linear}, timeout=limit)
    return name  # "ddp", "ddp_weighted": Lightning's defaults


def whole(trainer: Trainer, tensors: Callable[[], list[Tensor | None]], grads: bool = False) -> list[Tensor]:
    """Whole tensors from shards, FSDP1's summoned (a collective: every rank calls it at the same point)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    model, summon = trainer.strategy.model, contextlib.nullcontext()
    if isinstance(model, FullyShardedDataParallel):
        summon = FullyShardedDataParallel.summon_full_params(model, writeback=False, with_grads=grads)
    with summon:
        found = [t for t in tensors() if t is not None]
        return [t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone() for t in found]  # type: ignore[operator]


class Baton(Callback):
    """Parks the fit at every window start until released; keeps the whole parameters at the start and end and
    the first step's applied gradient (after the optimizer step: the module's own hooks have run by then)."""

    def __init__(self, accumulate: int, park: bool) -> None:
        self.accumulate, self.park = accumulate, park
        self.arrived, self.go = threading.Event(), threading.Event()
        self.error: BaseException | None = None
        self.initial: list[Tensor] = []
        self.final: list[Tensor] = []
        self.captured: list[Tensor] | None = None
        self.buckets: tuple[int, int] = (0, 0)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.initial = whole(trainer, lambda: list(pl_module.model.parameters()))
        trainer.optimizers[0].register_step_post_hook(lambda *_: self._capture(trainer, pl_module))

    def _capture(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.captured is None:
            self.captured = whole(trainer, lambda: [p.grad for p in pl_module.model.parameters()], grads=True)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.park and batch_idx % self.accumulate == 0:
            self.arrived.set()
            if not self.go.wait(WAIT_S):
                raise TimeoutError("the benchmark's main thread never released this fit")
            self.go.clear()

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if isinstance(trainer.strategy.model, nn.parallel.DistributedDataParallel):
            self.buckets = bucket_counts(trainer.strategy.model)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.final = whole(trainer, lambda: list(pl_module.model.parameters()))


class Fit(threading.Thread):
    """One variant's whole ``Trainer.fit`` of ``steps`` windows in a thread, parked by its baton at every window."""

    def __init__(
        self, name: str, point: Point, steps: int, timeout: float, extra: Sequence[Callback] = (), park: bool = True
    ) -> None:
        super().__init__(name=name, daemon=True)
        module, strategy, added = VARIANTS[name]
        self.baton = Baton(point.accumulate, park)
        self.module = module(make_model(point.size, point.seed))
        batches = [
            make_batch(point.size, point.rows, point.seed, dist.get_rank(), s, m)
            for s in range(steps)
            for m in range(point.accumulate)
        ]
        self.loader = WindowPrefetch(batches, point.accumulate) if name == "pre_count" else BatchStream(batches)
        self.trainer = Trainer(
            strategy=make_strategy(strategy, timeout),
            accelerator="cpu",
            devices=dist.get_world_size(),
            max_steps=steps,
            accumulate_grad_batches=point.accumulate,
            precision=PRECISION[point.dtype],
            callbacks=[*extra, self.baton, *added()],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            use_distributed_sampler=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
        )

    def run(self) -> None:
        torch.set_num_threads(1)
        try:
            self.trainer.fit(self.module, train_dataloaders=self.loader)
        except BaseException as error:  # reported by the main thread
            self.baton.error = error
            self.baton.arrived.set()

    def release(self) -> None:
        """Lets the fit run one window; returns when it parks at the next one."""
        self.baton.arrived.clear()
        self.baton.go.set()
        if not self.baton.arrived.wait(WAIT_S):
            raise TimeoutError(f"{self.name} did not finish its window within {WAIT_S}s")
        if self.baton.error is not None:
            raise RuntimeError(f"{self.name} failed") from self.baton.error


def interleave(fits: Mapping[str, Fit], point: Point, counter: CollectiveCounter) -> tuple[dict[str, Any], ...]:
    """Runs ``point.steps`` windows of every fit, one of each per round, then ends the fits. Returns the slowest
    rank's time of each timed round per fit, and the collectives of each fit's last warm-up window."""
    for name, fit in fits.items():  # one at a time: each set-up runs its own collectives
        fit.start()
        if not fit.baton.arrived.wait(WAIT_S) or fit.baton.error is not None:
            raise RuntimeError(f"{name} did not reach its first step") from fit.baton.error
    slowest, calls = timed_rounds(point, list(fits), lambda name: fits[name].release(), counter)
    for name, fit in fits.items():  # the last window and the end of the fit, one fit at a time
        fit.baton.go.set()
        fit.join(WAIT_S)
        if fit.is_alive() or fit.baton.error is not None:
            raise RuntimeError(f"{name} did not finish") from fit.baton.error
    return slowest, calls


def run_point(
    point: Point, names: Sequence[str], counter: CollectiveCounter, correctness: bool, timeout: float
) -> dict[str, Any]:
    steps = point.steps + 1  # the last window runs untimed, while the fits finish one by one
    fits = {name: Fit(name, point, steps, timeout) for name in names}
    slowest, calls = interleave(fits, point, counter)
    result: dict[str, Any] = {"point": point.__dict__, "times": slowest, "collectives": calls}
    result["buckets"] = {name: fit.baton.buckets for name, fit in fits.items()}
    if correctness and dist.get_rank() == 0:
        world = dist.get_world_size()
        expected, gradient = reference_params(point, steps, world), reference_gradient(point, world)
        result["deviation"] = {n: deviation(f.baton.final, f.baton.initial, expected, point) for n, f in fits.items()}
        result["gradient_deviation"] = {
            n: gradient_deviation(f.baton.captured or [], gradient) for n, f in fits.items()
        }
    dist.barrier()
    del fits
    gc.collect()
    return result
