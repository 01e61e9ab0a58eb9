"""What the sharded Trainer strategies (FSDP2, FSDP1) share: how the window's counts meet their gradient shards."""

from __future__ import annotations

from typing import Any

from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_weighted._counts import CountPayload
from lightning_weighted.participation import Policy
from lightning_weighted.reduce.sharded import ShardedReduceState, divide_gradients, empty_microbatch
from lightning_weighted.strategies._trainer import TrainerAdapter
from lightning_weighted.window import LossScale

__all__ = ["ShardedAdapter"]


class ShardedAdapter(TrainerAdapter):
    """The engine hooks of a sharded strategy (see :mod:`lightning_weighted.reduce.sharded`).

    Every reduction SUMs. Where ``training_step`` gives the counts, losses are item sums, the window's counts are
    summed by one float64 all-reduce started before the backward that ends the window, and the local gradient
    shards are divided by ``N`` before clipping. Where ``ItemCounter`` counts the batches ahead, each loss is scaled
    by ``n / N`` before its backward, so the SUM is the update itself: no division, and the all-reduce carries the
    next window's count. An empty microbatch runs its backward with :attr:`ShardedReduceState.empty` set, so its
    gradient reaches the reduction as exact zeros. Subclasses put it before their Lightning strategy and configure
    the engine's reduction with ``_reduce``.
    """

    def __init__(self, *args: Any, participation: Policy = "pad", **kwargs: Any) -> None:
        super().__init__(*args, participation=participation, **kwargs)
        self._reduce = ShardedReduceState()

    @override
    def _loss_scale(self) -> LossScale:
        return LossScale.ITEM_SUM

    @override
    def _start_sync(self, payload: CountPayload, reference: float) -> None:
        self._reduce.begin_window(payload, self.root_device)

    @override
    def _summed_counts(self) -> list[float]:
        return self._reduce.counts()

    @override
    def _divisor(self) -> int | None:
        return 1  # the reductions SUM: each loss scaled by n / N makes the SUM the update

    @override
    def _normalize(self, items: float) -> None:
        assert self.model is not None
        divide_gradients(self.model.parameters(), items)

    @override
    def _zero_loss(self, loss: Tensor | None) -> Tensor:
        source = f"On rank {self.global_rank}, training_step returned"
        return empty_microbatch(self._reduce, loss, source, self.strategy_name)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        try:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        finally:
            self._reduce.empty = False
            self._after_backward()

    def _after_backward(self) -> None:
        """Undoes what an empty microbatch's backward needed, beyond :attr:`ShardedReduceState.empty`."""
