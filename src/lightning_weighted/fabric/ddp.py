"""``WeightedFabricDDPStrategy``: Fabric's DDP whose update is the gradient of the global item mean of each window."""

from __future__ import annotations

from typing import Any

from lightning.fabric.strategies.ddp import DDPStrategy
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_weighted._compat import StrategyRegistry, register
from lightning_weighted._launch import LAUNCHERS
from lightning_weighted.data import Policy
from lightning_weighted.engines.ddp import DDPEngine, fp16_backward
from lightning_weighted.fabric._strategy import WeightedFabricStrategy

__all__ = ["WeightedFabricDDPStrategy"]


class WeightedFabricDDPStrategy(WeightedFabricStrategy, DDPStrategy):
    """Fabric's DDP, optimising the mean over every valid item of each window, on every rank and microbatch.

    Each microbatch goes through ``fabric.backward(loss, count=n)``: ``loss`` is the mean over the ``n`` valid
    items of the microbatch (``reduction="sum"``: their sum), ``n`` an int, a float or a 0-dim tensor, finite and
    ``>= 0``. The microbatches inside ``fabric.no_backward_sync(model)`` and the next backward outside it form
    one window; after that backward every rank holds the gradient stated in :mod:`lightning_weighted.window`,
    so ``fabric.clip_gradients`` and ``optimizer.step()`` see it. A loop that accumulates without
    ``no_backward_sync`` marks its windows with ``fabric.backward(loss, count=n, window_end=...)``.

    - A microbatch with ``n = 0`` contributes exactly zero, also when its mean is NaN (0/0).
    - A window whose global ``N`` is 0 changes nothing: its gradients are ``None`` and the ``optimizer.step()``
      calls after it are skipped on every rank; rank 0 warns and ``skipped_steps`` counts such windows.
    - An invalid or missing count, or a loss without a graph, on any rank raises the same error on every rank
      at the end of the window's last backward, before clipping and stepping.
    - ``fabric.setup_dataloaders`` swaps a padding ``DistributedSampler`` for
      :class:`~lightning_weighted.UnpaddedDistributedSampler` and keeps ranks with less data stepping with
      count-0 replays (``padding_step`` is ``True`` during one) until every rank is done.

    Args:
        *args: :class:`~lightning.fabric.strategies.DDPStrategy`'s arguments.
        participation: ``"pad"`` lets a rank whose data ran out step with count 0 until every rank is done;
            ``"strict"`` raises instead (see :mod:`lightning_weighted.data`).
        **kwargs: :class:`~lightning.fabric.strategies.DDPStrategy`'s keyword arguments, passed on to
            ``DistributedDataParallel``.

    Example::

        >>> import lightning_weighted
        >>> from lightning.fabric import Fabric
        >>> fabric = Fabric(strategy="ddp_weighted", accelerator="cpu", devices=1)
        >>> type(fabric.strategy).__name__
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
