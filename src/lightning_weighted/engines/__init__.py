r"""Engines: how one engine's gradient reduction meets a window's counts, one small object each.

The window loop (:mod:`lightning_weighted.loop`) needs four things of an engine, whatever it is:

- :attr:`Engine.divisor`, :math:`D`: what its reduction divides the SUM of the ranks' gradients by (the number of
  data-parallel ranks for an average, as DDP's and FSDP's own reductions are), and :attr:`Engine.group`, the
  data-parallel ranks, over which a window's counts are summed;
- :meth:`Engine.empty`: the loss that backpropagates exactly nothing for a microbatch known on the host to hold
  no item, whose mean may be NaN (0/0 over a fully masked batch), while every collective of its backward runs;
- :meth:`Engine.parameters`: the trained parameters, whose local gradients (a shard each, when sharded) the loop
  multiplies by :math:`D c / N` where the counts came after the forward, or drops where :math:`N = 0`.

To add an engine, write one file here with such an object and the strategy classes that build it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch.distributed as dist
from torch import Tensor

__all__ = ["Engine"]


class Engine(Protocol):
    """What the window loop needs of an engine's reduction (see the module docstring)."""

    divisor: int
    group: dist.ProcessGroup | None
    mean_sized: bool  # losses keep the size of a mean (an fp16 backward, where item sums could overflow)
    needs_graph: bool  # every microbatch must backpropagate through the model (a sharded model's collectives)

    def empty(self, loss: Tensor | None) -> Tensor:
        """An exact zero standing for ``loss`` in the backward of a microbatch that holds no item.

        ``loss`` has a graph where :attr:`needs_graph` is set; elsewhere it may be ``None`` or have none.
        """

    def after_backward(self) -> None:
        """Undoes what :meth:`empty` set up, once the backward has run."""

    def parameters(self) -> Iterable[Tensor]:
        """The trained parameters (the gradients of their local shards are the ones the loop touches)."""
