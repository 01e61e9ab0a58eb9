"""Engines: how one engine's gradient reduction meets a window's counts, one small object each (:class:`Engine`).

An empty microbatch backpropagates through its own graph, as under plain DDP (every collective runs, a sparse gradient
stays sparse); its own NaN is cut from each gradient on its way in, but not what collectives bring from other ranks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.hooks import RemovableHandle

__all__ = ["Engine", "FiniteGradients"]


class Engine(Protocol):
    """What the window loop needs of an engine's reduction."""

    divisor: int  # D: what the reduction divides the SUM of the ranks' gradients by (P for an average, 1 for a SUM)
    group: dist.ProcessGroup | None  # the data-parallel ranks
    mean_sized: bool  # losses keep the size of a mean (an fp16 backward, where item sums could overflow)
    needs_graph: bool  # every microbatch must backpropagate through the model (a sharded model's collectives)

    def empty(self, loss: Tensor | None) -> Tensor:
        """``0 · loss`` for a microbatch that holds no item, or a zero where ``loss`` is ``None`` or graphless."""

    def after_backward(self) -> None:
        """Undoes what :meth:`empty` set up, once the backward has run."""

    def parameters(self) -> Iterable[Tensor]:
        """The trained parameters (the loop touches their local shards' gradients)."""


class FiniteGradients:
    """What the engines that accumulate unsharded gradients (DDP, FSDP1) share: an empty microbatch's NaN, cut."""

    _handles: Sequence[RemovableHandle] = ()

    def keep_finite(self, tensors: Iterable[Tensor]) -> None:
        """Keeps only the finite values of each gradient computed for ``tensors``, until :meth:`after_backward`."""
        self._handles = [tensor.register_hook(_finite) for tensor in tensors]  # type: ignore[no-untyped-call]

    def after_backward(self) -> None:
        """Removes the hooks of an empty microbatch."""
        for handle in self._handles:
            handle.remove()
        self._handles = ()


def _finite(gradient: Tensor) -> Tensor:
    return torch.nan_to_num(gradient, nan=0.0, posinf=0.0, neginf=0.0)
