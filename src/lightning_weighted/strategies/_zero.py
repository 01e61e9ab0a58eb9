"""An exact zero loss that reaches the same parameters as the loss it stands for."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.nn import Module

__all__ = ["zero_loss"]


def zero_loss(loss: Tensor | None, module: Module) -> Tensor:
    """An exact zero that reaches the parameters ``loss`` depends on (all trainable ones if it has no graph).

    Backpropagating ``0 * loss`` through a fully masked mean sends ``0 * (1/0) = NaN`` into the gradient;
    touching the parameters directly gives DDP the same set of ready parameters and exact zeros.
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
