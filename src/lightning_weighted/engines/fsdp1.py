"""FSDP1 (``FullyShardedDataParallel``): a communication hook SUM-reduce-scatters, an empty microbatch adds zeros.

The hook (registered on the root before its first forward) replaces FSDP1's division by the world size, so the
sharded gradient is the SUM over the ranks (:math:`D = 1`). Under ``no_sync`` it runs once per window, on the
gradient accumulated over the window's microbatches, so a microbatch known to hold no item backpropagates
``0 · loss``, whose own NaN (0/0) is cut before it accumulates, on FSDP1's flat parameters. Sharded strategies only
(``FULL_SHARD``, ``SHARD_GRAD_OP``): FSDP1 refuses hooks for the hybrid ones, and ``NO_SHARD`` would SUM an
accumulated gradient twice.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_weighted._compat import flat_parameters, reduce_scatter
from lightning_weighted.engines import finite_gradients

__all__ = ["FSDP1Engine"]


class FSDP1Engine:
    """The engine of a ``FullyShardedDataParallel`` root; the constructor registers its communication hook once.

    Args:
        root: the FSDP1 root (before its first forward), or a module holding FSDP1 units already set up (a
            ``validate()`` after a fit), whose first unit's hook is the one registered then.
    """

    divisor = 1
    mean_sized = False
    needs_graph = True  # every backward runs the collectives of the sharded model

    def __init__(self, root: nn.Module) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        self.root = root
        first = next(m for m in root.modules() if isinstance(m, FullyShardedDataParallel))
        self.group: dist.ProcessGroup | None = first.process_group
        self._zeroing: list[RemovableHandle] = []
        if first is root and first not in _HOOKED:  # FSDP1 takes one hook per root
            first.register_comm_hook(self, _sum_reduce_scatter)
            _HOOKED.add(first)

    def empty(self, loss: Tensor | None) -> Tensor:
        """``0 · loss`` through its own graph; the flat parameters keep the finite values of their gradients."""
        assert loss is not None  # the loop refuses a step without a graph first (`needs_graph`)
        self._zeroing = finite_gradients(flat_parameters(self.root))
        return loss.sum() * 0.0

    def after_backward(self) -> None:
        """Removes the zeroing hooks of an empty microbatch."""
        for handle in self._zeroing:
            handle.remove()
        self._zeroing = []

    def parameters(self) -> Iterable[Tensor]:
        """The root's parameters (FSDP1 keeps each one's gradient as a view of its flat gradient shard)."""
        return self.root.parameters()

    def __getstate__(self) -> dict[str, object]:
        return {}  # like `PowerSGDState`: a process group does not pickle


_HOOKED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _sum_reduce_scatter(engine: FSDP1Engine, grad: Tensor, output: Tensor | None = None) -> None:
    """FSDP1's communication hook: SUM-reduce-scatters the unsharded gradient into ``output``, with no division."""
    if output is None:
        raise ValueError(
            "fsdp_weighted reduce-scatters a sharded gradient, but FSDP called its hook without an output shard"
            " (NO_SHARD). Use a sharded strategy ('FULL_SHARD' or 'SHARD_GRAD_OP'), or 'ddp_weighted'."
        )
    reduce_scatter(output, grad, engine.group, dist.ReduceOp.SUM)
