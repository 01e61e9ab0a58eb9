"""``WeightedDDPStrategy``: DDP whose update is the gradient of the global item mean of each optimizer step."""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.types import STEP_OUTPUT
from typing_extensions import override

from lightning_weighted._compat import StrategyRegistry, augment_message, ddp_kwargs, join_enabled, register
from lightning_weighted.engines import Engine
from lightning_weighted.engines.ddp import DDPEngine, fp16_backward
from lightning_weighted.loaders import Policy
from lightning_weighted.strategy import LAUNCHERS
from lightning_weighted.trainer._strategy import WeightedTrainerStrategy, accumulates

__all__ = ["WeightedDDPStrategy"]


class WeightedDDPStrategy(WeightedTrainerStrategy, DDPStrategy):
    """DDP whose every optimizer step follows the gradient of the mean over every valid item of its window.

    The contract of ``training_step``, the rules and the errors: ``docs/how_it_works.md``.

    Args:
        *args: :class:`~lightning.pytorch.strategies.DDPStrategy`'s arguments (a ``ddp_comm_hook`` of yours must
            average over the ranks, as torch's do).
        participation: ``"pad"``: a rank out of data steps with count 0 until every rank is done; ``"strict"``: raise.
        **kwargs: :class:`~lightning.pytorch.strategies.DDPStrategy`'s keyword arguments.

    Example::

        >>> import lightning_weighted
        >>> from lightning.pytorch import Trainer
        >>> type(Trainer(strategy="ddp_weighted", accelerator="cpu", devices=1, logger=False).strategy).__name__
        'WeightedDDPStrategy'
    """

    strategy_name = "ddp_weighted"

    def __init__(self, *args: Any, participation: Policy = "pad", **kwargs: Any) -> None:
        super().__init__(*args, participation=participation, **kwargs)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistry) -> None:
        register(strategy_registry, cls, "Count-weighted DDP strategy", *LAUNCHERS)

    @override
    def setup(self, trainer: Trainer) -> None:
        if ddp_kwargs(self).get("static_graph") and accumulates(trainer):
            raise MisconfigurationException(
                "`static_graph=True` with gradient accumulation is not supported by DDP in this torch version."
                " Drop `static_graph=True`, or set `accumulate_grad_batches=1`."
            )
        super().setup(trainer)

    @override
    def _make_engine(self) -> Engine:
        assert self.model is not None and self.lightning_module is not None
        return DDPEngine(self.model, self.lightning_module, mean_sized=fp16_backward(self.precision_plugin))

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        if self.model is not None and join_enabled(self.model):
            raise RuntimeError(
                "DistributedDataParallel.join() is active around a ddp_weighted step. ddp_weighted keeps ranks with"
                " uneven inputs matched itself (participation='pad'), and join's shadow collectives would pair with"
                " the count reduction. Remove the join() context."
            )
        return super().training_step(*args, **kwargs)

    @override
    def on_exception(self, exception: BaseException) -> None:
        augment_message(exception, ".*Expected to have finished reduction in the prior iteration.*", UNUSED_PARAMETERS)


UNUSED_PARAMETERS = (
    "It looks like your LightningModule has parameters that were not used in producing the loss returned by"
    " training_step. If this is intentional, enable the detection of unused parameters in DDP, either with the"
    " strategy name `strategy='ddp_weighted_find_unused_parameters_true'` or with"
    " `strategy=WeightedDDPStrategy(find_unused_parameters=True)`."
)
