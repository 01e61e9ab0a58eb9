"""``WeightedFabricDDPStrategy``: Fabric's DDP whose update is the gradient of the global item mean of each window."""

from __future__ import annotations

from typing import Any, Literal

from lightning.fabric.strategies.ddp import DDPStrategy
from lightning.fabric.strategies.registry import _StrategyRegistry
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_weighted._counts import CountPayload
from lightning_weighted.fabric._adapter import FabricAdapter
from lightning_weighted.participation import Policy
from lightning_weighted.reduce.ddp_hook import (
    PYTHON_REDUCER,
    RIDE_LIMIT_BYTES,
    WeightedReduceState,
    fp16_backward,
    python_reducer,
)
from lightning_weighted.strategies._zero import zero_loss
from lightning_weighted.strategies.ddp import LAUNCHERS, register_launchers
from lightning_weighted.window import LossScale

__all__ = ["WeightedFabricDDPStrategy"]


class WeightedFabricDDPStrategy(FabricAdapter, DDPStrategy):
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
            ``"strict"`` raises instead (see :mod:`lightning_weighted.participation`).
        loss_scale: ``"item_sum"`` or ``"mean_sized"`` (see :class:`~lightning_weighted.window.LossScale`); by
            default item sums, and mean-sized losses where fp16 computes the backward or bf16/fp16 gradients keep
            the counts from riding.
        ride_limit_bytes: the largest first gradient bucket the counts ride in (see
            :class:`~lightning_weighted.WeightedReduceState`).
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

    def __init__(
        self,
        *args: Any,
        participation: Policy = "pad",
        loss_scale: Literal["item_sum", "mean_sized"] | None = None,
        ride_limit_bytes: int = RIDE_LIMIT_BYTES,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, participation=participation, **kwargs)
        self._scale = None if loss_scale is None else LossScale(loss_scale)
        self._reduce_state = WeightedReduceState(ride_limit_bytes=ride_limit_bytes)
        self._ddp: DistributedDataParallel | None = None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        launchers = (*LAUNCHERS, ("ddp_weighted_notebook", "fork", {}))  # Fabric names a notebook launcher too
        register_launchers(strategy_registry, cls, launchers, "Count-weighted Fabric DDP")

    @override
    def setup_module(self, module: Module) -> DistributedDataParallel:
        if self._ddp is not None:
            raise RuntimeError(
                f"{type(self).__name__} weights the gradients of one model, and a second one was set up. Set up"
                " the trained modules as one `nn.Module` (a container of both), or use `strategy='ddp'`."
            )
        if python_reducer():
            raise RuntimeError(PYTHON_REDUCER)
        ddp = self._ddp = super().setup_module(module)
        self._scale = self._reduce_state.register(ddp, self._scale, fp16_backward(self.precision))
        return ddp

    @override
    def _loss_scale(self) -> LossScale:
        return self._scale or LossScale.ITEM_SUM

    @override
    def _syncs(self) -> bool:
        return self._model().require_backward_grad_sync

    @override
    def _hold(self) -> None:
        self._reduce_state.hold()

    @override
    def _start_sync(self, payload: CountPayload, reference: float) -> None:
        self._reduce_state.begin_window(payload, reference, self.root_device)

    @override
    def _summed_counts(self) -> list[float]:
        return self._reduce_state.counts()

    @override
    def _trained_module(self) -> Module:
        return self._model()

    @override
    def _zero_loss(self, loss: Tensor) -> Tensor:
        return zero_loss(loss, self._model())

    def _model(self) -> DistributedDataParallel:
        if self._ddp is None:
            raise RuntimeError(
                "fabric.backward ran before a model was set up: call `model, optimizer = fabric.setup(model,"
                " optimizer)` first."
            )
        return self._ddp
