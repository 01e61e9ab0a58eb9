"""``WeightedFabricModelParallelStrategy``: FSDP2 for Fabric loops, whose update is the global item mean's gradient."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from lightning.fabric.strategies.model_parallel import ModelParallelStrategy
from torch.nn import Module
from typing_extensions import override

from lightning_weighted._compat import StrategyRegistry, register, set_backward_sync_control
from lightning_weighted.engines.fsdp2 import FSDP2Engine, shard_blocks
from lightning_weighted.fabric._strategy import MarkWindow, WeightedFabricStrategy
from lightning_weighted.loaders import Policy
from lightning_weighted.strategy import data_parallel_group, every_rank_data_parallel

__all__ = ["WeightedFabricModelParallelStrategy"]


class WeightedFabricModelParallelStrategy(WeightedFabricStrategy, ModelParallelStrategy):
    """Fabric's FSDP2 (``ModelParallelStrategy``), whose every window follows the gradient of the global item mean.

    Set the model up before its optimizer. Every FSDP module SUM-reduces on every microbatch; ``no_backward_sync``
    only marks the window. The loop's contract: ``docs/fabric.md``.

    Args:
        *args: ``ModelParallelStrategy``'s arguments; ``parallelize_fn`` defaults to
            :func:`~lightning_weighted.shard_blocks`.
        participation: as for :class:`~lightning_weighted.WeightedFabricDDPStrategy`.
        **kwargs: ``ModelParallelStrategy``'s keyword arguments.
    """

    strategy_name = "fsdp2_weighted"

    def __init__(self, *args: Any, participation: Policy = "pad", **kwargs: Any) -> None:
        if not args:
            kwargs.setdefault("parallelize_fn", shard_blocks)
        super().__init__(*args, participation=participation, **kwargs)
        set_backward_sync_control(self, MarkWindow(lambda module, enabled: self.accumulating(enabled)))
        self._accumulating = False  # inside `fabric.no_backward_sync(model)`

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistry) -> None:
        register(
            strategy_registry, cls, "Count-weighted Fabric FSDP2, every rank data-parallel", ("fsdp2_weighted", {})
        )

    @override
    def setup_environment(self) -> None:
        every_rank_data_parallel(self)
        super().setup_environment()

    @override
    def setup_module(self, module: Module) -> Module:
        module = super().setup_module(module)
        self._start(FSDP2Engine(module, data_parallel_group(self.device_mesh)))
        return module

    @contextlib.contextmanager
    def accumulating(self, enabled: bool = True) -> Iterator[None]:
        """What ``fabric.no_backward_sync(model, enabled)`` does here: marks backwards that do not end the window."""
        previous, self._accumulating = self._accumulating, enabled
        try:
            yield
        finally:
            self._accumulating = previous

    @override
    def _syncs(self) -> bool:
        return not self._accumulating
