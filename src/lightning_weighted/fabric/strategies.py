"""The weighted Fabric strategies, one per engine: DDP, FSDP1 (LitGPT's recipes), and FSDP2."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from lightning.fabric.strategies.ddp import DDPStrategy
from lightning.fabric.strategies.fsdp import FSDPStrategy
from lightning.fabric.strategies.model_parallel import ModelParallelStrategy
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_weighted._compat import BackwardSyncControl, fsdp1_checkpoints, set_backward_sync_control
from lightning_weighted.engines import Engine
from lightning_weighted.engines.ddp import DDPEngine, fp16_backward
from lightning_weighted.engines.fsdp1 import FSDP1Engine, check_sharding, full_state_dict_in_place, wrapped_on_cpu
from lightning_weighted.engines.fsdp2 import FSDP2Engine, shard_blocks
from lightning_weighted.fabric._strategy import WeightedFabricStrategy
from lightning_weighted.strategy import LAUNCHERS, data_parallel_group, every_rank_data_parallel

__all__ = ["WeightedFabricDDPStrategy", "WeightedFabricFSDPStrategy", "WeightedFabricModelParallelStrategy"]


class WeightedFabricDDPStrategy(WeightedFabricStrategy, DDPStrategy):
    """The weighted Fabric strategy over DDP: ``strategy="ddp_weighted"``.

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
    _registered = "Count-weighted Fabric DDP", [*LAUNCHERS, ("ddp_weighted_notebook", {"start_method": "fork"})]

    @override
    def setup_module(self, module: Module) -> DistributedDataParallel:
        ddp = super().setup_module(module)
        self._start(DDPEngine(ddp, module, mean_sized=fp16_backward(self.precision)), ddp)
        return ddp

    @override
    def _syncs(self, engine: Engine) -> bool:
        return bool(engine.ddp.require_backward_grad_sync)  # type: ignore[attr-defined]

    @override
    def _local(self, engine: Engine) -> contextlib.AbstractContextManager[Any]:
        return engine.ddp.no_sync()  # type: ignore[attr-defined,no-any-return]


class MarkWindow(BackwardSyncControl):
    """``fabric.no_backward_sync`` under a sharded weighted strategy: marks the backwards inside it as accumulating."""

    def __init__(self, strategy: WeightedFabricStrategy, no_sync: bool) -> None:
        self.strategy, self.no_sync = strategy, no_sync  # `no_sync`: enter the model's own too (FSDP1's)

    @override
    @contextlib.contextmanager
    def no_backward_sync(self, module: Module, enabled: bool) -> Iterator[None]:
        previous, self.strategy._accumulating = self.strategy._accumulating, enabled  # what its `_syncs` reads
        try:
            with module.no_sync() if enabled and self.no_sync else contextlib.nullcontext():  # type: ignore[operator]
                yield
        finally:
            self.strategy._accumulating = previous


class WeightedFabricFSDPStrategy(WeightedFabricStrategy, FSDPStrategy):
    """The weighted Fabric strategy over FSDP1 (``FSDPStrategy``, LitGPT's): ``strategy="fsdp_weighted"``.

    Its hook SUM-reduce-scatters once per window, on the CPU too. It takes ``FSDPStrategy``'s arguments, with
    ``sharding_strategy`` ``"FULL_SHARD"`` (the default) or ``"SHARD_GRAD_OP"``, and ``participation`` as DDP's does.
    """

    strategy_name = "fsdp_weighted"
    _registered = "Count-weighted Fabric FSDP1, on CPU or CUDA", [("fsdp_weighted", {})]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        check_sharding(self.sharding_strategy.name)
        set_backward_sync_control(self, MarkWindow(self, no_sync=True))

    @override
    def setup_module(self, module: Module) -> Module:
        wrapped = wrapped_on_cpu(self, module) or super().setup_module(module)
        self._start(FSDP1Engine(wrapped), wrapped)  # its hook is registered before the root's first forward
        return wrapped

    @override
    def save_checkpoint(self, path: Any, state: Any, storage_options: Any = None, filter: Any = None) -> None:
        with fsdp1_checkpoints(self._full_context()):
            super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)

    @override
    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True, weights_only: Any = None) -> Any:
        with fsdp1_checkpoints(self._full_context()):
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)

    def _full_context(self) -> Any:
        """The full state-dict context of this strategy's checkpoints: without offload on the CPU, else Fabric's."""
        if self.root_device.type != "cpu":
            return None
        return lambda module, world_size, rank0_only=True: full_state_dict_in_place(module, rank0_only)

    @override
    def _local(self, engine: Engine) -> contextlib.AbstractContextManager[Any]:
        return engine.root.no_sync()  # type: ignore[attr-defined,no-any-return]


class WeightedFabricModelParallelStrategy(WeightedFabricStrategy, ModelParallelStrategy):
    """The weighted Fabric strategy over FSDP2 (``ModelParallelStrategy``): ``strategy="fsdp2_weighted"``.

    Set up the model before its optimizer. FSDP2 SUM-reduces each microbatch; ``no_backward_sync`` only marks windows.
    Takes ``participation`` and ``ModelParallelStrategy``'s arguments; ``parallelize_fn`` defaults to ``shard_blocks``.
    """

    strategy_name = "fsdp2_weighted"
    _registered = "Count-weighted Fabric FSDP2, every rank data-parallel", [("fsdp2_weighted", {})]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not args:
            kwargs.setdefault("parallelize_fn", shard_blocks)
        super().__init__(*args, **kwargs)
        set_backward_sync_control(self, MarkWindow(self, no_sync=False))

    @override
    def setup_environment(self) -> None:
        every_rank_data_parallel(self)
        super().setup_environment()

    @override
    def setup_module(self, module: Module) -> Module:
        module = super().setup_module(module)
        self._start(FSDP2Engine(module, data_parallel_group(self.device_mesh)), module)
        return module
