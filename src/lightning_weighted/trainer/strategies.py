"""The weighted Trainer strategies, one per engine: DDP, FSDP1, and FSDP2 with tensor parallelism."""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Trainer
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_weighted._compat import augment_message, ddp_kwargs, fsdp1_checkpoints, fsdp1_options, join_enabled
from lightning_weighted.engines import Engine
from lightning_weighted.engines.ddp import DDPEngine, fp16_backward
from lightning_weighted.engines.fsdp1 import FSDP1Engine, check_sharding, full_state_dict_in_place, wrapped_on_cpu
from lightning_weighted.engines.fsdp2 import FP16_FIX, FSDP2Engine
from lightning_weighted.strategy import LAUNCHERS, data_parallel_group, every_rank_data_parallel
from lightning_weighted.trainer._strategy import WeightedTrainerStrategy, accumulates

__all__ = ["WeightedDDPStrategy", "WeightedFSDPStrategy", "WeightedModelParallelStrategy"]


class WeightedDDPStrategy(WeightedTrainerStrategy, DDPStrategy):
    """The weighted strategy over DDP: ``strategy="ddp_weighted"``.

    Args:
        *args: ``DDPStrategy``'s arguments (a ``ddp_comm_hook`` of yours must average over the ranks, as torch's do).
        participation: ``"pad"``: a rank out of data steps with count 0 until every rank is done; ``"strict"``: raise.

    Example::

        >>> import lightning_weighted
        >>> from lightning.pytorch import Trainer
        >>> type(Trainer(strategy="ddp_weighted", accelerator="cpu", devices=1, logger=False).strategy).__name__
        'WeightedDDPStrategy'
    """

    strategy_name = "ddp_weighted"
    _registered = "Count-weighted DDP strategy", LAUNCHERS

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


class WeightedFSDPStrategy(WeightedTrainerStrategy, FSDPStrategy):
    """The weighted strategy over FSDP1, on the CPU too: ``strategy="fsdp_weighted"``.

    Args:
        *args: ``FSDPStrategy``'s arguments; ``sharding_strategy`` ``"FULL_SHARD"`` (default) or ``"SHARD_GRAD_OP"``.
        participation: as for :class:`~lightning_weighted.WeightedDDPStrategy`.
        sync_every_microbatch: reduce-scatter every microbatch (as FSDP2 does), holding no unsharded gradient.
    """

    strategy_name = "fsdp_weighted"
    _registered = "Count-weighted FSDP1, on CPU or CUDA", [("fsdp_weighted", {})]

    def __init__(self, *args: Any, sync_every_microbatch: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # `participation` among them
        self.sync_every_microbatch = sync_every_microbatch
        check_sharding(self.sharding_strategy.name)
        self._fsdp1: FSDP1Engine | None = None

    @override
    def setup(self, trainer: Trainer) -> None:
        config = self.mixed_precision_config
        if config is not None and torch.float16 in (config.param_dtype, config.reduce_dtype):
            raise MisconfigurationException(f"fsdp_weighted would compute or reduce in float16 ({config}). {FP16_FIX}.")
        super().setup(trainer)
        self._windows.seam.clip_fsdp1(self.precision_plugin, self._clip_by_norm)

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
        with contextlib.nullcontext() if self.sync_every_microbatch else super().block_backward_sync():
            yield None

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if not self._full_on_cpu():
            return super().lightning_module_state_dict()
        assert self.model is not None
        with full_state_dict_in_place(self.model):
            return self.model.state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        if not self._full_on_cpu():
            return super().optimizer_state(optimizer)
        from torch.distributed.fsdp import FullyShardedDataParallel, OptimStateKeyType

        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        assert self.model is not None
        with full_state_dict_in_place(self.model):
            state = FullyShardedDataParallel.optim_state_dict(self.model, optimizer)
            if self.global_rank == 0:  # the standard layout, as Lightning saves it
                state = FullyShardedDataParallel.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_ID, self.model)
        return state

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        with fsdp1_checkpoints():  # a sharded checkpoint of an optimizer without state loads
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    def _full_on_cpu(self) -> bool:
        return fsdp1_options(self)[0] == "full" and self.root_device.type == "cpu"


class WeightedModelParallelStrategy(WeightedTrainerStrategy, ModelParallelStrategy):
    """The weighted strategy over FSDP2 and tensor parallelism: ``strategy="fsdp2_weighted"``.

    The module shards itself in ``configure_model`` (:func:`~lightning_weighted.shard_blocks`).

    Args:
        *args: ``ModelParallelStrategy``'s arguments; ``data_parallel_size`` defaults to every rank not tensor-parallel.
        participation: as for :class:`~lightning_weighted.WeightedDDPStrategy`.
    """

    strategy_name = "fsdp2_weighted"
    _registered = "Count-weighted FSDP2, every rank data-parallel", [("fsdp2_weighted", {})]

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
