"""``WeightedFSDPStrategy``: FSDP1 whose update is the gradient of the global item mean of each optimizer step."""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.strategies.fsdp import _move_torchmetrics_to_device, _setup_activation_checkpointing
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import FSDPStrategy
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_weighted._counts import CountPayload
from lightning_weighted.participation import Policy
from lightning_weighted.reduce.sharded import ShardedReduceState, divide_gradients, weighted_reduce_scatter_hook
from lightning_weighted.strategies._trainer import TrainerAdapter
from lightning_weighted.strategies.model_parallel import sharded_zero_loss
from lightning_weighted.window import LossScale

__all__ = ["WeightedFSDPStrategy"]

_REFUSED_SHARDING = ("NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")


class AnyDeviceFSDPStrategy(FSDPStrategy):
    """Lightning's ``FSDPStrategy``, also on CPU (gloo): FSDP1 is wrapped with ``device_id=torch.device("cpu")``.

    Lightning refuses its own ``FSDPStrategy`` on CPU; FSDP1 runs there when told its device. Nothing else differs.
    """

    @override
    def _setup_model(self, model: Module) -> Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        if self.root_device.type != "cpu" or any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
            return super()._setup_model(model)
        wrapped = FullyShardedDataParallel(
            module=model,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),  # Lightning passes the device index, which is None on CPU
            **self.kwargs,
        )
        _move_torchmetrics_to_device(wrapped, self.root_device)
        _setup_activation_checkpointing(wrapped, self._activation_checkpointing_kwargs)
        return wrapped


class WeightedFSDPStrategy(TrainerAdapter, AnyDeviceFSDPStrategy):
    """FSDP1 that optimises the mean over every valid item of each optimizer step, on every rank and microbatch.

    Takes ``FSDPStrategy``'s arguments (auto-wrap policy, sharding strategy, mixed precision, activation
    checkpointing, state-dict type) and runs on CPU too. ``training_step`` follows
    :class:`~lightning_weighted.WeightedDDPStrategy`'s contract and rules, and the update is the one stated in
    :mod:`lightning_weighted.window`.

    Its communication hook SUM-reduce-scatters item-sum gradients on every microbatch (Lightning's ``FSDPStrategy``
    skips the reduction of all but a window's last microbatch and holds the unsharded gradient in between; here,
    as with FSDP2, no unsharded gradient outlives its microbatch), the window's counts are summed by one 48-byte
    all-reduce, and the local gradient shards are divided by ``N`` before clipping and the optimizer (see
    :mod:`lightning_weighted.reduce.sharded`).

    Args:
        *args: ``FSDPStrategy``'s arguments. ``sharding_strategy`` must shard: ``"FULL_SHARD"`` (default) or
            ``"SHARD_GRAD_OP"``; FSDP1 takes no communication hook for the hybrid ones, and ``"NO_SHARD"`` is
            ``"ddp_weighted"``. A ``mixed_precision`` that reduces in float16 is refused (item sums overflow it).
        participation: ``"pad"`` lets a rank whose data ran out step with count 0 until every rank is done;
            ``"strict"`` raises instead (see :mod:`lightning_weighted.participation`).
        **kwargs: ``FSDPStrategy``'s keyword arguments.

    Example::

        >>> import lightning_weighted
        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(strategy="fsdp_weighted", accelerator="cpu", devices=1, logger=False)
        >>> type(trainer.strategy).__name__
        'WeightedFSDPStrategy'
    """

    strategy_name = "fsdp_weighted"

    def __init__(self, *args: Any, participation: Policy = "pad", **kwargs: Any) -> None:
        super().__init__(*args, participation=participation, **kwargs)
        if self.sharding_strategy.name in _REFUSED_SHARDING:
            raise ValueError(
                f"`sharding_strategy={self.sharding_strategy.name!r}` does not shard gradients over every"
                " data-parallel rank, which fsdp_weighted's reduction needs (FSDP1 takes no communication hook for"
                " the hybrid strategies). Use 'FULL_SHARD' or 'SHARD_GRAD_OP', or `strategy='ddp_weighted'` in place"
                " of 'NO_SHARD'."
            )
        self._reduce = ShardedReduceState()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            "fsdp_weighted",
            cls,
            description="Count-weighted Fully Sharded Data Parallel (FSDP1) training, on CPU or CUDA",
            override=True,  # importing twice leaves the registry as it was
        )

    @override
    def setup(self, trainer: Trainer) -> None:
        config = self.mixed_precision_config
        reduce = None if config is None else (config.reduce_dtype or config.param_dtype)
        if reduce == torch.float16:
            raise MisconfigurationException(
                f"fsdp_weighted would reduce gradients in float16 ({config}): fp16 cannot hold the item sums that"
                " are reduced before the division by N. Use `precision='bf16-mixed'` or 'bf16-true', or"
                " `MixedPrecision(..., reduce_dtype=torch.float32)`."
            )
        super().setup(trainer)

    @override
    def _setup_model(self, model: Module) -> Module:
        wrapped = super()._setup_model(model)
        self._reduce.process_group = wrapped.process_group  # type: ignore[assignment]
        wrapped.register_comm_hook(self._reduce, weighted_reduce_scatter_hook)  # type: ignore[operator]
        return wrapped

    @contextlib.contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        # Reduce every microbatch: its reduction is where an empty microbatch's gradient is zeroed.
        yield None

    @override
    def _count_group(self) -> dist.ProcessGroup | None:
        return self._reduce.process_group

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
    def _normalize(self, items: float) -> None:
        assert self.model is not None
        divide_gradients(self.model.parameters(), items)

    @override
    def _zero_loss(self, loss: Tensor | None) -> Tensor:
        return sharded_zero_loss(self, self._reduce, loss)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        try:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        finally:
            self._reduce.empty = False
