"""The anchors' two ways of training on the global item mean, re-implemented for the benchmark (not in src/).

Both give the same update as ``ddp_weighted`` (``g = (1/N) Σ_r Σ_m n_rm ḡ_rm``, see
:mod:`lightning_weighted.window`); they differ in what it costs.

Post-hoc normalisation (fairseq ``Trainer.train_step``: ``multiply_grads(world_size / sample_size)``; Megatron-LM
``finalize_model_grads``: all-reduce ``num_tokens`` then scale the grad buffers by ``1 / num_tokens``; torchtune
recipes: ``dist.all_reduce(num_tokens)`` then ``training.scale_grads(model, world_size / num_tokens)``):
every microbatch backpropagates its loss SUM, DDP's default reducer averages over the ``P`` ranks, and after the
backward one blocking all-reduce sums the window's count ``N`` and every gradient is multiplied by ``P / N``
before clipping and the optimizer step: an exposed collective plus an extra pass over the gradients.

Pre-count normalisation (HF ``Trainer.get_batch_samples`` with ``average_tokens_across_devices``, torchtitan's
``global_valid_tokens``, Composer): the whole window is loaded first, its count is all-reduced (blocking) before
the first forward, and each microbatch's loss SUM is scaled by ``P / N`` (HF divides by ``num_items_in_batch``
then multiplies by ``num_processes``): the window's batches are held in memory at once.

Both are written with the fastest primitive their sources allow: the count is a device tensor, the gradient
multiply is one ``torch._foreach_mul_`` (Megatron's contiguous buffer does one kernel too; torchtune loops over
parameters). HF gathers the count with ``all_gather`` then sums; torchtitan all-reduces, as here.
A window with ``N = 0`` divides by 1 here (its gradients are zero); the sources do not special-case it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from common import LR, Batch, RawStep, local_sum
from lightning.pytorch import LightningModule
from torch import Tensor


def _count(window_count: Tensor) -> Tensor:
    """Sums a window's item count over the ranks, blocking, in float64 (exact for any realistic count)."""
    total = window_count.to(torch.float64)
    dist.all_reduce(total)
    return total.clamp_min(1.0)


class PostHocStep(RawStep):
    """Post-hoc normalisation (fairseq / Megatron / torchtune) on a raw DDP module."""

    name = "post_hoc"
    summed = True

    def step(self, window: Iterator[Batch]) -> None:
        items = torch.zeros((), dtype=torch.int64)
        for micro, batch in enumerate(window):
            with self.sync_context(micro):
                loss = self.ddp(batch)  # the SUM; DDP averages it over the P ranks
                items += batch[2].sum()
                loss.backward()
        # After the backward: one blocking count all-reduce, then one pass over every gradient.
        scale = self.world_size / _count(items)
        torch._foreach_mul_([p.grad for p in self.ddp.parameters() if p.grad is not None], scale)
        self.finish()


class PreCountStep(RawStep):
    """Pre-count normalisation (HF Trainer / torchtitan / Composer) on a raw DDP module."""

    name = "pre_count"
    summed = True

    def step(self, window: Iterator[Batch]) -> None:
        batches = list(itertools.islice(window, self.accumulate))  # load the whole window first
        # Before the first forward: one blocking count all-reduce.
        scale = self.world_size / _count(sum((b[2].sum() for b in batches), torch.zeros((), dtype=torch.int64)))
        for micro, batch in enumerate(batches):
            with self.sync_context(micro):
                (self.ddp(batch) * scale).backward()
        del batches
        self.finish()


# ---------------------------------------------------------------------------------------------------------------
# The same two mechanisms inside Lightning (strategy="ddp"), as a user of plain Lightning would write them.


class PostHocModule(LightningModule):
    """Post-hoc normalisation as a LightningModule: the count all-reduce and the gradient multiply sit in
    ``on_before_optimizer_step`` (after the backward, before clipping)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self._items = torch.zeros((), dtype=torch.int64)

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        self._items += batch[2].sum()
        return local_sum(self.model, batch)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Lightning divided each loss by A and DDP averaged over P ranks: multiply back by P·A / N.
        scale = self.trainer.world_size * self.trainer.accumulate_grad_batches / _count(self._items)
        torch._foreach_mul_([p.grad for p in self.parameters() if p.grad is not None], scale)
        self._items = torch.zeros((), dtype=torch.int64)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=LR)


class WindowPrefetch:
    """Reads a whole accumulation window ahead (as HF's ``get_batch_samples`` does) and tags each microbatch
    with the window's local count; the window's batches are alive together until the window is consumed."""

    def __init__(self, batches: Iterable[Batch], accumulate: int, length: int) -> None:
        self.batches, self.accumulate, self.length = batches, accumulate, length

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[tuple[Batch, Tensor | None]]:
        iterator = iter(self.batches)
        while window := list(itertools.islice(iterator, self.accumulate)):
            local = sum((b[2].sum() for b in window), torch.zeros((), dtype=torch.int64))
            for micro, batch in enumerate(window):
                yield batch, (local if micro == 0 else None)


class PreCountModule(LightningModule):
    """Pre-count normalisation as a LightningModule fed by :class:`WindowPrefetch`: the blocking count
    all-reduce runs in the window's first ``training_step``, before its forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self._scale: Tensor | None = None

    def training_step(self, tagged: tuple[Batch, Tensor | None], batch_idx: int) -> Tensor:
        batch, window_count = tagged
        if window_count is not None:
            # P·A / N: DDP averages over P ranks and Lightning divides each loss by A.
            self._scale = self.trainer.world_size * self.trainer.accumulate_grad_batches / _count(window_count)
        assert self._scale is not None
        return local_sum(self.model, batch) * self._scale

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=LR)
