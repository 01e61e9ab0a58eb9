"""Whole parameters and gradients of a possibly sharded module, and the tensors its forward uses for them.

What :class:`~lightning_weighted.ObjectiveAudit` needs to replay a window under FSDP2 or FSDP1 as under DDP:
outside a forward, a sharded parameter holds this rank's shard (a DTensor, or a view of FSDP1's flat shard);
inside one, the module it belongs to holds the whole tensor the forward computes with, the one to differentiate.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import Tensor, nn

__all__ = ["Targets"]


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
            for name, param in owner._parameters.items():
                if param is not None and param.requires_grad and id(param) not in seen:
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
