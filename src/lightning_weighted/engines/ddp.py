"""DDP: its own C++ reducer averages every bucket over the ranks; no communication hook of this package's."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_weighted.engines import FiniteGradients

__all__ = ["DDPEngine", "fp16_backward"]


class DDPEngine(FiniteGradients):
    """The engine of ``ddp``, a ``DistributedDataParallel`` of ``module`` whose reducer averages (:math:`D = P`)."""

    def __init__(self, ddp: nn.Module, module: nn.Module, mean_sized: bool = False) -> None:
        self.ddp, self.module, self.mean_sized, self.needs_graph = ddp, module, mean_sized, False
        self.group: dist.ProcessGroup | None = getattr(ddp, "process_group", None)
        self.divisor = dist.get_world_size(self.group)
        self._parameters = tuple(ddp.parameters())  # DDP's parameters are fixed once it wraps the model

    def empty(self, loss: Tensor | None) -> Tensor:
        """``0 · loss`` through its own graph, each gradient's finite values kept; graphless, a zero of ``module``."""
        if loss is None or loss.grad_fn is None:
            return torch.stack([p.sum().float() * 0.0 for p in self.module.parameters() if p.requires_grad]).sum()
        self.keep_finite(p for p in self._parameters if p.requires_grad)
        return loss.sum() * 0.0

    def parameters(self) -> Iterable[Tensor]:
        """The wrapped model's parameters."""
        return self._parameters


def fp16_backward(plugin: object) -> bool:
    """Whether a Lightning precision plugin computes in fp16 (``16-mixed``, ``16-true``, Transformer Engine fp16)."""
    precision = str(getattr(plugin, "precision", ""))
    return "16" in precision and "bf16" not in precision
