"""DDP: its own C++ reducer averages every bucket over the ranks; no communication hook of this package's."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["DDPEngine", "fp16_backward", "zero_loss"]


class DDPEngine:
    """The engine of a ``DistributedDataParallel`` model (Lightning's or Fabric's DDP strategy).

    Args:
        ddp: the wrapped model; its reducer averages over its process group (:math:`D = P`).
        module: the module it wraps, whose trainable parameters an empty microbatch's zero reaches.
        mean_sized: keep losses the size of a mean (an fp16 backward).
    """

    def __init__(self, ddp: nn.Module, module: nn.Module, mean_sized: bool = False) -> None:
        self.ddp, self.module, self.mean_sized = ddp, module, mean_sized
        self.needs_graph = False
        self.group: dist.ProcessGroup | None = getattr(ddp, "process_group", None)
        self.divisor = dist.get_world_size(self.group)
        self._parameters = tuple(ddp.parameters())  # DDP's parameters are fixed once it wraps the model

    def empty(self, loss: Tensor | None) -> Tensor:
        """See :func:`zero_loss`."""
        return zero_loss(loss, self.module)

    def after_backward(self) -> None:
        """Nothing to undo: :meth:`empty` only builds a loss."""

    def parameters(self) -> Iterable[Tensor]:
        """The wrapped model's parameters."""
        return self._parameters


def zero_loss(loss: Tensor | None, module: nn.Module) -> Tensor:
    """An exact zero that reaches the parameters ``loss`` depends on (all trainable ones if it has no graph).

    Backpropagating ``0 * loss`` through a fully masked mean sends ``0 * (1/0) = NaN`` into the gradient;
    touching the parameters directly gives DDP the same set of ready parameters and exact zeros.

    Example::

        >>> weight = nn.Parameter(torch.ones(2))
        >>> nan_mean = (weight * 0.0).sum() / 0.0
        >>> zero_loss(nan_mean, nn.Linear(1, 1)).backward()
        >>> weight.grad
        tensor([0., 0.])
    """
    if loss is not None and loss.grad_fn is not None:
        params = _graph_parameters(loss)
    else:
        params = [param for param in module.parameters() if param.requires_grad]
    return torch.stack([param.sum().float() * 0.0 for param in params]).sum()


def _graph_parameters(loss: Tensor) -> list[Tensor]:
    """The leaf tensors that require grad and that ``loss`` was computed from."""
    params: list[Tensor] = []
    seen: set[Any] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, Tensor):
            params.append(variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return params


def fp16_backward(plugin: object) -> bool:
    """Whether a Lightning precision plugin computes in fp16 (``16-mixed``, ``16-true``, Transformer Engine fp16)."""
    precision = str(getattr(plugin, "precision", ""))
    return "16" in precision and "bf16" not in precision
