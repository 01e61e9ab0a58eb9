"""``WeightedModelParallelStrategy``: FSDP2 (and tensor parallelism) whose update is the global item mean's gradient."""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ModelParallelStrategy
from typing_extensions import override

from lightning_weighted._compat import StrategyRegistry, register
from lightning_weighted.engines import Engine
from lightning_weighted.engines.fsdp2 import FP16_FIX, FSDP2Engine
from lightning_weighted.loaders import Policy
from lightning_weighted.strategy import data_parallel_group, every_rank_data_parallel
from lightning_weighted.trainer._strategy import WeightedTrainerStrategy

__all__ = ["WeightedModelParallelStrategy"]


class WeightedModelParallelStrategy(WeightedTrainerStrategy, ModelParallelStrategy):
    """FSDP2 (and tensor parallelism) whose every optimizer step follows the gradient of the global item mean.

    The module shards itself in ``configure_model`` (:func:`~lightning_weighted.shard_blocks`). The contract, the
    engine and what is refused: ``docs/how_it_works.md``.

    Args:
        *args: ``ModelParallelStrategy``'s arguments; ``data_parallel_size`` defaults to every rank not tensor-parallel.
        participation: as for :class:`~lightning_weighted.WeightedDDPStrategy`.
        **kwargs: ``ModelParallelStrategy``'s keyword arguments.
    """

    strategy_name = "fsdp2_weighted"

    def __init__(self, *args: Any, participation: Policy = "pad", **kwargs: Any) -> None:
        super().__init__(*args, participation=participation, **kwargs)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistry) -> None:
        register(strategy_registry, cls, "Count-weighted FSDP2, every rank data-parallel", ("fsdp2_weighted", {}))

    @override
    def setup_environment(self) -> None:
        every_rank_data_parallel(self)
        super().setup_environment()

    @override
    def setup(self, trainer: Trainer) -> None:
        precision = getattr(self.precision_plugin, "precision", "")
        if precision in ("16-mixed", "16-true"):
            raise MisconfigurationException(f"fsdp2_weighted would compute in float16 ({precision=}). {FP16_FIX}.")
        super().setup(trainer)

    @override
    def _make_engine(self) -> Engine:
        assert self.model is not None
        return FSDP2Engine(self.model, data_parallel_group(self.device_mesh))
