"""``WeightedFSDPStrategy``: FSDP1 whose update is the gradient of the global item mean of each optimizer step."""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Trainer
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import FSDPStrategy
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_weighted._compat import StrategyRegistry, fsdp1_options, register
from lightning_weighted.engines import Engine
from lightning_weighted.engines.fsdp1 import FSDP1Engine, wrapped_on_cpu
from lightning_weighted.engines.fsdp2 import FP16_FIX
from lightning_weighted.loaders import Policy
from lightning_weighted.trainer._strategy import WeightedTrainerStrategy

__all__ = ["WeightedFSDPStrategy"]

_REFUSED_SHARDING = ("NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")


def _full_state_dict_in_place(module: Module) -> contextlib.AbstractContextManager[Any]:
    """FSDP1's full state-dict context of Lightning's checkpoints (rank 0 only), without the offload to the CPU."""
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return FSDP.state_dict_type(
        module=module,
        state_dict_type=StateDictType.FULL_STATE_DICT,
        state_dict_config=FullStateDictConfig(offload_to_cpu=False, rank0_only=True),
        optim_state_dict_config=FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True),
    )


class WeightedFSDPStrategy(WeightedTrainerStrategy, FSDPStrategy):
    """FSDP1 whose every optimizer step follows the gradient of the global item mean, on the CPU too.

    The contract, the engine and what is refused: ``docs/how_it_works.md``.

    Args:
        *args: ``FSDPStrategy``'s arguments; ``sharding_strategy`` ``"FULL_SHARD"`` (default) or ``"SHARD_GRAD_OP"``.
        participation: as for :class:`~lightning_weighted.WeightedDDPStrategy`.
        sync_every_microbatch: reduce-scatter every microbatch (as FSDP2 does), holding no unsharded gradient.
        **kwargs: ``FSDPStrategy``'s keyword arguments.
    """

    strategy_name = "fsdp_weighted"

    def __init__(
        self, *args: Any, participation: Policy = "pad", sync_every_microbatch: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(*args, participation=participation, **kwargs)
        self.sync_every_microbatch = sync_every_microbatch
        if self.sharding_strategy.name in _REFUSED_SHARDING:
            raise ValueError(
                f"`sharding_strategy={self.sharding_strategy.name!r}` does not shard gradients over every"
                " data-parallel rank, which fsdp_weighted's reduction needs (FSDP1 takes no communication hook for"
                " the hybrid strategies). Use 'FULL_SHARD' or 'SHARD_GRAD_OP', or `strategy='ddp_weighted'` in place"
                " of 'NO_SHARD'."
            )
        self._fsdp1: FSDP1Engine | None = None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistry) -> None:
        register(strategy_registry, cls, "Count-weighted FSDP1, on CPU or CUDA", ("fsdp_weighted", {}))

    @override
    def setup(self, trainer: Trainer) -> None:
        config = self.mixed_precision_config
        if config is not None and torch.float16 in (config.param_dtype, config.reduce_dtype):
            raise MisconfigurationException(f"fsdp_weighted would compute or reduce in float16 ({config}). {FP16_FIX}.")
        super().setup(trainer)
        # `gradient_clip_algorithm="norm"`: FSDP1's own norm over the shards, where Lightning's FSDPPrecision refuses
        self._seam.clip_fsdp1(self.precision_plugin, self._clip_by_norm)

    def _clip_by_norm(self, optimizer: Optimizer, clip_val: float | int) -> None:
        assert self.model is not None
        self.model.clip_grad_norm_(clip_val)  # type: ignore[operator]

    @override
    def _setup_model(self, model: Module) -> Module:
        wrapped = wrapped_on_cpu(self, model) or super()._setup_model(model)
        self._fsdp1 = FSDP1Engine(wrapped)  # its hook is registered before the root's first forward
        return wrapped

    @override
    def _make_engine(self) -> Engine:
        assert self._fsdp1 is not None
        return self._fsdp1

    @contextlib.contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        if self.sync_every_microbatch:
            yield None  # FSDP1 accumulates the reduced shards
        else:
            with super().block_backward_sync():
                yield None

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if not self._full_on_cpu():
            return super().lightning_module_state_dict()
        assert self.model is not None
        with _full_state_dict_in_place(self.model):
            state: dict[str, Any] = self.model.state_dict()
        return state

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        if not self._full_on_cpu():
            return super().optimizer_state(optimizer)
        from torch.distributed.fsdp import FullyShardedDataParallel, OptimStateKeyType

        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        assert self.model is not None
        with _full_state_dict_in_place(self.model):
            state = FullyShardedDataParallel.optim_state_dict(self.model, optimizer)
            if self.global_rank == 0:  # the standard layout, as Lightning saves it
                state = FullyShardedDataParallel.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_ID, self.model)
        return state

    def _full_on_cpu(self) -> bool:
        return fsdp1_options(self)[0] == "full" and self.root_device.type == "cpu"
