r"""The audit's re-run of a window: each microbatch's ``training_step`` again, and the gradient sum it implies.

:class:`~lightning_weighted.ObjectiveAudit` caches the batches of an audited window and, before the optimizer
step, re-runs ``training_step`` on each (same RNG state, buffers restored, ``self.log`` ignored) to take this
rank's :math:`S_r = \sum_m n_m \bar g_m` with ``torch.autograd.grad``, never touching ``.grad``. Under FSDP a
parameter outside a forward is this rank's shard; inside one, its module holds the whole tensor the forward
computes with, the one to differentiate (:class:`Targets`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import Tensor, nn

from lightning_weighted._compat import forward_redirection
from lightning_weighted.counts import Count, count_rule, split_output
from lightning_weighted.trainer._seam import logs_ignored
from lightning_weighted.trainer._strategy import WeightedTrainerStrategy

__all__ = ["Microbatch", "Targets", "flat", "is_audit_rerun", "local_sum"]

_rerunning = False  # True while an audit re-runs `training_step`


def is_audit_rerun() -> bool:
    """Whether ``training_step`` is being re-run by an :class:`~lightning_weighted.ObjectiveAudit`, not trained on.

    The audit runs ``training_step`` a second time on audited microbatches. ``self.log`` calls are ignored
    during the re-run; guard any other side effect (a counter, a ``torchmetrics`` update) with this.

    Example::

        >>> is_audit_rerun()
        False
    """
    return _rerunning


@dataclass
class Microbatch:
    """One cached microbatch of an audited window."""

    batch: Any
    batch_idx: int
    rng: list[Tensor]  # the CPU state, then the device's when it is CUDA
    padding: bool = False  # an exhausted rank's replay of a batch under a weighted strategy: count 0


def local_sum(
    trainer: Trainer,
    pl_module: LightningModule,
    targets: Targets,
    params: list[Tensor],
    window: list[Microbatch],
    sharded: bool,
) -> tuple[Tensor, float, float]:
    """Re-runs the window's microbatches; returns ``(Σ_m n_m · ḡ_m, Σ_m n_m, 1.0 if a count is invalid)``.

    ``params`` are the whole parameters (shapes of the gradient). Under FSDP every microbatch's backward runs, also
    one that counts nothing, since its all-gathers are collectives every rank takes part in.
    """
    total = torch.zeros(sum(param.numel() for param in params), dtype=torch.float64, device=pl_module.device)
    items, invalid = 0.0, 0.0
    takes_index = is_param_in_hook_signature(pl_module.training_step, "batch_idx", min_args=2)
    count = _count_rule(trainer)
    buffers = [(buffer, buffer.detach().clone()) for buffer in pl_module.buffers()]
    cuda = [pl_module.device] if pl_module.device.type == "cuda" else []
    with _rerun_step(pl_module), torch.enable_grad():
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
            counted = _on_host(count(output, microbatch.batch))
            bad = problem is not None or counted.problem is not None
            invalid = 1.0 if bad else invalid
            skipped = bad or counted.value == 0 or microbatch.padding  # exactly zero, also for a NaN mean
            if skipped and not sharded:
                continue
            grads = torch.autograd.grad(loss.sum(), used, allow_unused=True)
            if skipped:
                continue
            gradient = flat(grads, params)
            weight = float(counted.value)
            total.add_(gradient, alpha=1.0 if item_sum else weight)
            items += weight
    with torch.no_grad():
        for buffer, saved in buffers:
            buffer.copy_(saved)
    return total, items, invalid


def _training_step(trainer: Trainer, pl_module: LightningModule, args: tuple[Any, ...]) -> Any:
    """``training_step`` through the model's wrapper where it is FSDP1's root, as Lightning calls it."""
    model = trainer.strategy.model
    if isinstance(trainer.strategy, FSDPStrategy) and model is not None and model is not pl_module:
        return forward_redirection(trainer.strategy, model, pl_module, "training_step", *args)
    return pl_module.training_step(*args)


def _count_rule(trainer: Trainer) -> Callable[[Any, Any], Count]:
    """The training count rule (:func:`~lightning_weighted.counts.count_rule`), with the strategy's ``ItemCounter``."""
    strategy = trainer.strategy
    counter = strategy.item_counter if isinstance(strategy, WeightedTrainerStrategy) else None
    if counter is None:
        return lambda output, batch: count_rule(output, batch, extract_batch_size)
    return lambda output, batch: count_rule(
        output, batch, extract_batch_size, (counter.count_of(batch), counter.integer)
    )


def _on_host(count: Count) -> Count:
    """``count`` with its value and problem read on the host (the audit reads what training never does)."""
    problem = count.problem
    if isinstance(problem, Tensor):
        problem = None if float(problem) == 0 else problem
    value = float(count.value) if isinstance(count.value, Tensor) else count.value
    return Count(value, None if problem is None else problem, count.implicit)


def flat(tensors: Sequence[Tensor | None], like: Sequence[Tensor]) -> Tensor:
    """Concatenates ``tensors`` as float64 on ``like``'s device; a missing tensor reads as zeros shaped as ``like``."""
    return torch.cat(
        [
            (tensor.detach() if tensor is not None else torch.zeros_like(reference)).reshape(-1).double()
            for tensor, reference in zip(tensors, like, strict=True)
        ]
    )


@contextlib.contextmanager
def _rerun_step(pl_module: LightningModule) -> Iterator[None]:
    """Marks the re-run for :func:`is_audit_rerun`; its ``self.log`` calls do nothing (no double logging)."""
    global _rerunning

    with logs_ignored(pl_module):
        _rerunning = True
        try:
            yield
        finally:
            _rerunning = False


class Targets:
    """The trainable parameters of ``module``, each read whole, and as the tensor a forward uses.

    Args:
        module: the ``LightningModule`` (its submodules may be FSDP2 modules or FSDP1 units).
        root: the FSDP1 root that wraps ``module``, or ``None``; the whole values of its units are read inside
            ``summon_full_params``.
    """

    def __init__(self, module: nn.Module, root: nn.Module | None = None) -> None:
        self.root = root
        self.owners: list[tuple[nn.Module, str]] = []
        seen: set[int] = set()
        for owner in module.modules():
            for name, param in owner.named_parameters(recurse=False):
                if param.requires_grad and id(param) not in seen:
                    seen.add(id(param))
                    self.owners.append((owner, name))

    @contextlib.contextmanager
    def used(self) -> Iterator[list[Tensor]]:
        """For the forward run inside the block: the tensor each parameter's module computed with.

        Under FSDP that is the whole (unsharded) parameter, differentiable where the shard outside a forward is not;
        a parameter whose module did not run (or that is used outside its module's forward) is itself.
        """
        tensors: list[Tensor] = [getattr(owner, name) for owner, name in self.owners]
        slots: dict[nn.Module, list[tuple[int, str]]] = {}
        for index, (owner, name) in enumerate(self.owners):
            slots.setdefault(owner, []).append((index, name))

        def record(owner: nn.Module, args: Any) -> None:
            for index, name in slots[owner]:
                tensors[index] = getattr(owner, name)

        hooks = [owner.register_forward_pre_hook(record) for owner in slots]
        try:
            yield tensors
        finally:
            for hook in hooks:
                hook.remove()

    def values(self, gradients: bool = False) -> list[Tensor | None]:
        """Every parameter (or its gradient, ``None`` where there is none) whole, the same on every rank.

        A collective under FSDP: every rank calls it at the same point.
        """
        with self._summoned(gradients):
            values = [getattr(owner, name) for owner, name in self.owners]
            if gradients:
                values = [value.grad for value in values]
            return [None if value is None else _whole(value.detach()) for value in values]

    def _summoned(self, gradients: bool) -> contextlib.AbstractContextManager[Any]:
        if self.root is None:
            return contextlib.nullcontext()
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel.summon_full_params(self.root, writeback=False, with_grads=gradients)


def _whole(tensor: Tensor) -> Tensor:
    full_tensor = getattr(tensor, "full_tensor", None)  # a DTensor: all-gathered over its mesh
    return full_tensor() if full_tensor is not None else tensor.clone()
