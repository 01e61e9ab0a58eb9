r"""The audit's replay of a window: each microbatch's ``training_step`` again, and the gradient sum it implies.

:class:`~lightning_weighted.ObjectiveAudit` caches the batches of an audited window and, before the optimizer
step, re-runs ``training_step`` on each (same RNG state, buffers restored, ``self.log`` ignored) to take this
rank's :math:`S_r = \sum_m n_m \bar g_m` with ``torch.autograd.grad``, never touching ``.grad``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import Tensor

from lightning_weighted._counts import Count, count_of, split_output
from lightning_weighted._patch import patched
from lightning_weighted._whole import Targets
from lightning_weighted.counting import ItemCounter

__all__ = ["Microbatch", "flat", "is_replaying", "local_sum"]

_replaying = False  # True while an audit re-runs `training_step`


def is_replaying() -> bool:
    """Whether ``training_step`` is being re-run by an :class:`~lightning_weighted.ObjectiveAudit`, not trained on.

    The replay runs ``training_step`` a second time on audited microbatches. ``self.log`` calls are ignored
    during the replay; guard any other side effect (a counter, a ``torchmetrics`` update) with this.

    Example::

        >>> is_replaying()
        False
    """
    return _replaying


@dataclass
class Microbatch:
    """One cached microbatch of an audited window."""

    batch: Any
    batch_idx: int
    rng: list[Tensor]  # the CPU state, then the device's when it is CUDA
    padding: bool = False  # an exhausted rank's replay under ddp_weighted: count 0


def local_sum(
    trainer: Trainer,
    pl_module: LightningModule,
    targets: Targets,
    params: list[Tensor],
    window: list[Microbatch],
    sharded: bool,
) -> tuple[Tensor, float, float]:
    """Replays the window's microbatches; returns ``(Σ_m n_m · ḡ_m, Σ_m n_m, 1.0 if a count is invalid)``.

    ``params`` are the whole parameters (shapes of the gradient). Under FSDP every microbatch's backward runs, also
    one that counts nothing, since its all-gathers are collectives every rank takes part in.
    """
    total = torch.zeros(sum(param.numel() for param in params), dtype=torch.float64, device=pl_module.device)
    items, invalid = 0.0, 0.0
    takes_index = is_param_in_hook_signature(pl_module.training_step, "batch_idx", min_args=2)
    count = _count_rule(trainer)
    buffers = [(buffer, buffer.detach().clone()) for buffer in pl_module.buffers()]
    cuda = [pl_module.device] if pl_module.device.type == "cuda" else []
    with _replaying_step(pl_module), torch.enable_grad():
        for microbatch in window:
            with torch.random.fork_rng(devices=cuda), targets.used() as used:
                torch.set_rng_state(microbatch.rng[0])
                if cuda:
                    torch.cuda.set_rng_state(microbatch.rng[1], cuda[0])
                with trainer.strategy.precision_plugin.train_step_context():
                    args = (microbatch.batch, microbatch.batch_idx) if takes_index else (microbatch.batch,)
                    output = _training_step(trainer, pl_module, args)
            loss, item_sum, problem = split_output(output)
            if loss is None or loss.grad_fn is None:
                continue  # Lightning skips a `None` step; a loss without a graph fails its own backward
            counted = count(output, microbatch.batch)
            bad = problem is not None or counted.problem is not None
            invalid = 1.0 if bad else invalid
            skipped = bad or counted.value == 0 or microbatch.padding  # exactly zero, also for a NaN mean
            if skipped and not sharded:
                continue
            grads = torch.autograd.grad(loss.sum(), used, allow_unused=True)
            if skipped:
                continue
            gradient = flat(grads, params)
            total.add_(gradient, alpha=1.0 if item_sum else counted.value)
            items += counted.value
    with torch.no_grad():
        for buffer, saved in buffers:
            buffer.copy_(saved)
    return total, items, invalid


def _training_step(trainer: Trainer, pl_module: LightningModule, args: tuple[Any, ...]) -> Any:
    """``training_step`` through the model's wrapper where it is FSDP1's root, as Lightning calls it."""
    model = trainer.strategy.model
    if isinstance(trainer.strategy, FSDPStrategy) and model is not None and model is not pl_module:
        return trainer.strategy._forward_redirection(model, pl_module, "training_step", *args)
    return pl_module.training_step(*args)


def _count_rule(trainer: Trainer) -> Callable[[Any, Any], Count]:
    """The training count rule (:func:`~lightning_weighted._counts.count_of`), with the run's ``ItemCounter``."""
    counter = next((c for c in trainer.callbacks if isinstance(c, ItemCounter)), None)  # type: ignore[attr-defined]
    if counter is None:
        return lambda output, batch: count_of(output, batch)
    return lambda output, batch: count_of(output, batch, (counter.count_of(batch), counter.integer))


def flat(tensors: Sequence[Tensor | None], like: Sequence[Tensor]) -> Tensor:
    """Concatenates ``tensors`` as float64 on ``like``'s device; a missing tensor reads as zeros shaped as ``like``."""
    return torch.cat(
        [
            (tensor.detach() if tensor is not None else torch.zeros_like(reference)).reshape(-1).double()
            for tensor, reference in zip(tensors, like, strict=True)
        ]
    )


@contextlib.contextmanager
def _replaying_step(pl_module: LightningModule) -> Iterator[None]:
    """Marks the replay for :func:`is_replaying`; the replay's ``self.log`` calls do nothing (no double logging)."""
    global _replaying

    def ignore(*args: Any, **kwargs: Any) -> None:
        return None

    with patched(pl_module, log=ignore, log_dict=ignore):
        _replaying = True
        try:
            yield
        finally:
            _replaying = False
