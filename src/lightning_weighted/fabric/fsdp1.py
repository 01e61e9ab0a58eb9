"""``WeightedFabricFSDPStrategy``: FSDP1 for Fabric loops (LitGPT's recipes), whose update is the global item mean's."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from lightning.fabric.strategies.fsdp import FSDPStrategy
from torch.nn import Module
from typing_extensions import override

from lightning_weighted._compat import StrategyRegistry, register, set_backward_sync_control
from lightning_weighted.engines.fsdp1 import FSDP1Engine, wrapped_on_cpu
from lightning_weighted.fabric._strategy import MarkWindow, WeightedFabricStrategy
from lightning_weighted.loaders import Policy

__all__ = ["WeightedFabricFSDPStrategy"]


class WeightedFabricFSDPStrategy(WeightedFabricStrategy, FSDPStrategy):
    """Fabric's FSDP1 (``FSDPStrategy``, LitGPT's), whose every window follows the gradient of the global item mean.

    Its hook SUM-reduce-scatters once per window, on the CPU too; the loop's contract: ``docs/fabric.md``.

    Args:
        *args: ``FSDPStrategy``'s arguments; ``sharding_strategy`` ``"FULL_SHARD"`` (default) or ``"SHARD_GRAD_OP"``.
        participation: as for :class:`~lightning_weighted.WeightedFabricDDPStrategy`.
        **kwargs: ``FSDPStrategy``'s keyword arguments.
    """

    strategy_name = "fsdp_weighted"

    def __init__(self, *args: Any, participation: Policy = "pad", **kwargs: Any) -> None:
        super().__init__(*args, participation=participation, **kwargs)
        if self.sharding_strategy.name not in ("FULL_SHARD", "SHARD_GRAD_OP"):
            raise ValueError(
                f"`sharding_strategy={self.sharding_strategy.name!r}` does not shard gradients over every"
                " data-parallel rank, which fsdp_weighted's reduction needs. Use 'FULL_SHARD' or 'SHARD_GRAD_OP', or"
                " `strategy='ddp_weighted'` in place of 'NO_SHARD'."
            )
        set_backward_sync_control(self, MarkWindow(self.accumulating))
        self._accumulating = False  # inside `fabric.no_backward_sync(model)`

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistry) -> None:
        register(strategy_registry, cls, "Count-weighted Fabric FSDP1, on CPU or CUDA", ("fsdp_weighted", {}))

    @override
    def setup_module(self, module: Module) -> Module:
        wrapped = wrapped_on_cpu(self, module) or super().setup_module(module)
        self._start(FSDP1Engine(wrapped))  # its hook is registered before the root's first forward
        return wrapped

    @override
    def _syncs(self) -> bool:
        return not self._accumulating

    @override
    def _local(self, backward: Any) -> Any:
        assert self._loop is not None
        with self._loop.engine.root.no_sync():  # type: ignore[attr-defined]
            return backward()

    @contextlib.contextmanager
    def accumulating(self, module: Module, enabled: bool) -> Iterator[None]:
        """What ``fabric.no_backward_sync(model, enabled)`` does here: FSDP1's ``no_sync``, marked for the window."""
        previous, self._accumulating = self._accumulating, enabled
        try:
            with module.no_sync() if enabled else contextlib.nullcontext():  # type: ignore[operator]
                yield
        finally:
            self._accumulating = previous
