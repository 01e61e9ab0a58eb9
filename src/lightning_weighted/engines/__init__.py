r"""Engines: how one engine's gradient reduction meets a window's counts, one small object each.

The window loop (:mod:`lightning_weighted.loop`) needs of an engine: :math:`D` (:attr:`Engine.divisor`, what its
reduction divides the SUM of the ranks' gradients by: the data-parallel ranks for an average, 1 for a SUM), the
data-parallel ranks (:attr:`Engine.group`), whether losses stay mean-sized (:attr:`Engine.mean_sized`), whether every
microbatch must backpropagate through the model (:attr:`Engine.needs_graph`), the loss of a microbatch that holds
no item (:meth:`Engine.empty` and :meth:`Engine.after_backward`) and the trained parameters
(:meth:`Engine.parameters`).

An empty microbatch's backward runs through its own forward's graph, as under plain DDP, so that every collective of
the model's backward (SyncBatchNorm's, an ``all_gather(..., sync_grads=True)``'s) runs and a sparse gradient stays
sparse; its own NaN (0/0 over a fully masked batch) is cut from each gradient on its way in, while what a collective
brings from the other ranks' losses stays.

To add an engine, write one file here with such an object and the strategy classes that build it.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.hooks import RemovableHandle

__all__ = ["Engine", "FiniteGradients", "finite_gradients"]


class Engine(Protocol):
    """What the window loop needs of an engine's reduction (see the module docstring)."""

    divisor: int
    group: dist.ProcessGroup | None
    mean_sized: bool  # losses keep the size of a mean (an fp16 backward, where item sums could overflow)
    needs_graph: bool  # every microbatch must backpropagate through the model (a sharded model's collectives)

    def empty(self, loss: Tensor | None) -> Tensor:
        """``0 · loss``, backpropagated through ``loss``'s graph for a microbatch that holds no item.

        The gradients its own loss sends (NaN for 0/0) reach no parameter until :meth:`after_backward`. ``loss``
        has a graph where :attr:`needs_graph` is set; elsewhere it may be ``None`` or have none (a microbatch the
        window refuses), for which a zero built from the parameters stands.
        """

    def after_backward(self) -> None:
        """Undoes what :meth:`empty` set up, once the backward has run."""

    def parameters(self) -> Iterable[Tensor]:
        """The trained parameters (the gradients of their local shards are the ones the loop touches)."""


class FiniteGradients:
    """What the engines that accumulate unsharded gradients (DDP, FSDP1) share: an empty microbatch's NaN, cut."""

    def __init__(self) -> None:
        self._handles: list[RemovableHandle] = []

    def _cut(self, tensors: Iterable[Tensor]) -> None:
        self._handles = finite_gradients(tensors)

    def after_backward(self) -> None:
        """Removes the hooks of an empty microbatch."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def finite_gradients(tensors: Iterable[Tensor]) -> list[RemovableHandle]:
    """Keeps only the finite values of each gradient computed for ``tensors`` (before it accumulates).

    Until the handles go, an empty microbatch's own NaN (``0 · (1/0)``) becomes 0; sparse gradients stay sparse.
    Where its loss is finite, ``0 · loss`` already sends exact zeros, and a gradient a collective of the model's
    backward brings from the other ranks' losses (SyncBatchNorm's statistics) passes unchanged.

    Example::

        >>> weight = torch.nn.Parameter(torch.ones(2))
        >>> handles = finite_gradients([weight])
        >>> ((weight * torch.tensor([1.0, 2.0])).sum() * 0.0 / 0.0).backward()  # a fully masked mean: 0/0
        >>> for handle in handles:
        ...     handle.remove()
        >>> weight.grad
        tensor([0., 0.])
    """
    keep_finite = partial(torch.nan_to_num, nan=0.0, posinf=0.0, neginf=0.0)
    return [tensor.register_hook(keep_finite) for tensor in tensors]  # type: ignore[no-untyped-call]
