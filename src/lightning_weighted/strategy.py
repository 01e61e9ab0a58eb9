"""What every weighted strategy tells of its loop of windows, Trainer and Fabric alike: one mixin, one check."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from lightning_weighted.loaders.sampler import marked
from lightning_weighted.loop import WindowLoop
from lightning_weighted.window import WindowResult

__all__ = ["WeightedStrategy", "weighted"]


class WeightedStrategy:
    """What every weighted strategy tells of its loop of windows, Trainer and Fabric alike (a mixin).

    Callbacks and loops that read a window's result check ``isinstance(strategy, WeightedStrategy)``.
    """

    _loop: WindowLoop | None

    @property
    def padding_step(self) -> bool:
        """The batch in progress replays a batch of a rank whose data ran out (it counts for nothing)."""
        raise NotImplementedError

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """The strategy's, ``num_replicas`` marked so that its padding sampler is told from the user's."""
        return marked(super().distributed_sampler_kwargs)  # type: ignore[misc]  # the Lightning strategy's, next

    @property
    def data_parallel_group(self) -> dist.ProcessGroup | None:
        """The ranks a window's counts are summed over, the ones that see different data (``None``: every rank)."""
        return self._loop.engine.group if self._loop is not None else None

    @property
    def skipped_steps(self) -> int:
        """Windows whose global ``N`` was 0: optimizer steps that changed nothing."""
        return self._loop.skipped_steps if self._loop is not None else 0

    @property
    def last_window(self) -> WindowResult | None:
        """The result of the last window."""
        return self._loop.last_window if self._loop is not None else None


def weighted(strategy: object, role: str) -> WeightedStrategy:
    """``strategy`` where it is a weighted one; else a clear error, opening with what ``role`` says the caller does."""
    if not isinstance(strategy, WeightedStrategy):
        raise ValueError(
            f"{role} a weighted strategy (`strategy='ddp_weighted'`), but the Trainer uses {type(strategy).__name__}."
            " Pass `strategy='ddp_weighted'` or drop the callback."
        )
    return strategy
