"""``WeightedFabricDDPStrategy``: Fabric's DDP whose update is the gradient of the global item mean of each window."""

from __future__ import annotations

from typing import Any

from lightning.fabric.strategies.ddp import DDPStrategy
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_weighted._compat import StrategyRegistry, register
from lightning_weighted.engines.ddp import DDPEngine, fp16_backward
from lightning_weighted.fabric._strategy import WeightedFabricStrategy
from lightning_weighted.loaders import Policy
from lightning_weighted.strategy import LAUNCHERS

__all__ = ["WeightedFabricDDPStrategy"]


class WeightedFabricDDPStrategy(WeightedFabricStrategy, DDPStrategy):
    """Fabric's DDP, whose every window follows the gradient of the mean over every valid item of its microbatches.

    ``fabric.backward(loss, count=n)`` for each microbatch; the loop's contract, rules and errors: ``docs/fabric.md``.

    Args:
        *args: :class:`~lightning.fabric.strategies.DDPStrategy`'s arguments.
        participation: ``"pad"``: a rank out of data steps with count 0 until every rank is done; ``"strict"``: raise.
        **kwargs: :class:`~lightning.fabric.strategies.DDPStrategy`'s keyword arguments.

    Example::

        >>> import lightning_weighted
        >>> from lightning.fabric import Fabric
        >>> type(Fabric(strategy="ddp_weighted", accelerator="cpu", devices=1).strategy).__name__
        'WeightedFabricDDPStrategy'
    """

    strategy_name = "ddp_weighted"

    def __init__(self, *args: Any, participation: Policy = "pad", **kwargs: Any) -> None:
        super().__init__(*args, participation=participation, **kwargs)
        self._ddp: DistributedDataParallel | None = None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistry) -> None:
        notebook = ("ddp_weighted_notebook", {"start_method": "fork"})  # Fabric names a notebook launcher too
        register(strategy_registry, cls, "Count-weighted Fabric DDP", *LAUNCHERS, notebook)

    @override
    def setup_module(self, module: Module) -> DistributedDataParallel:
        ddp = super().setup_module(module)
        self._start(DDPEngine(ddp, module, mean_sized=fp16_backward(self.precision)))
        self._ddp = ddp
        return ddp

    @override
    def _syncs(self) -> bool:
        assert self._ddp is not None
        return self._ddp.require_backward_grad_sync

    @override
    def _local(self, backward: Any) -> Any:
        assert self._ddp is not None
        with self._ddp.no_sync():
            return backward()
