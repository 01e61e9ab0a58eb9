"""``WeightedFabricModelParallelStrategy``: FSDP2 for Fabric loops, whose update is the global item mean's gradient."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, Literal

import torch.distributed as dist
from lightning.fabric.strategies.model_parallel import ModelParallelStrategy
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch import Tensor
from torch.nn import Module
from typing_extensions import override

from lightning_weighted._counts import CountPayload
from lightning_weighted.fabric._adapter import FabricAdapter
from lightning_weighted.participation import Policy
from lightning_weighted.reduce.sharded import (
    ShardedReduceState,
    data_parallel_group,
    divide_gradients,
    empty_microbatch,
    mesh_sizes,
    reduce_with_sum,
)

__all__ = ["WeightedFabricModelParallelStrategy", "shard_each_child"]

_DEFAULT_TIMEOUT = timedelta(minutes=30)  # Lightning's and torch's default process-group timeout


def shard_each_child(module: Module, mesh: Any) -> Module:
    """The default ``parallelize_fn``: ``fully_shard`` every child module that holds parameters, then the whole.

    Sharded over ``mesh["data_parallel"]``. Pass a ``parallelize_fn`` of your own for another wrapping (each
    transformer block, tensor parallelism over ``mesh["tensor_parallel"]``, a mixed-precision policy).
    """
    from torch.distributed.fsdp import fully_shard

    for child in module.children():
        if any(param.requires_grad for param in child.parameters()):
            fully_shard(child, mesh=mesh["data_parallel"])
    fully_shard(module, mesh=mesh["data_parallel"])
    return module


class WeightedFabricModelParallelStrategy(FabricAdapter, ModelParallelStrategy):
    """Fabric's FSDP2 (``ModelParallelStrategy``), optimising the mean over every valid item of each window.

    The loop is :class:`~lightning_weighted.WeightedFabricDDPStrategy`'s, with its rules (``fabric.backward(loss,
    count=n)``, windows ended by the backward outside ``fabric.no_backward_sync`` or marked with ``window_end=``,
    empty microbatches and windows, errors on every rank, uneven data); the update is the one stated in
    :mod:`lightning_weighted.window`. Set the model up before creating its optimizer (``model =
    fabric.setup_module(model)``, then ``fabric.setup_optimizers(...)`` over ``model.parameters()``).

    Every FSDP module SUM-reduces item-sum gradients on every microbatch, also inside ``no_backward_sync``, which
    here only marks the window: an empty microbatch's gradient (NaN for a fully masked mean) is zeroed on its way
    into its reduce-scatter, which a gradient accumulated unsharded over the window would not allow, and no
    unsharded gradient is held between microbatches. The window's counts are summed over the data-parallel group
    by one 48-byte all-reduce, and the local gradient shards are divided by ``N`` at the end of the window's last
    backward (see :mod:`lightning_weighted.reduce.sharded`).

    Args:
        parallelize_fn: ``fn(module, device_mesh) -> module`` applying ``fully_shard`` (and tensor parallelism);
            by default :func:`shard_each_child`.
        data_parallel_size: ranks that see different data; ``"auto"``: the world size divided by
            ``tensor_parallel_size``.
        tensor_parallel_size: ranks that split each layer; ``"auto"``: 1, or the world size divided by
            ``data_parallel_size`` when that is given.
        save_distributed_checkpoint: as for ``ModelParallelStrategy``.
        process_group_backend: as for ``ModelParallelStrategy``.
        timeout: the process-group timeout; a dead or stalled rank ends every rank after it.
        participation: ``"pad"`` lets a rank whose data ran out step with count 0 until every rank is done;
            ``"strict"`` raises instead (see :mod:`lightning_weighted.participation`).

    Example::

        >>> import lightning_weighted
        >>> from lightning.fabric import Fabric
        >>> fabric = Fabric(strategy="fsdp2_weighted", accelerator="cpu", devices=1)
        >>> type(fabric.strategy).__name__
        'WeightedFabricModelParallelStrategy'
    """

    strategy_name = "fsdp2_weighted"

    def __init__(
        self,
        parallelize_fn: Callable[[Any, Any], Any] = shard_each_child,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: Literal["auto"] | int = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = _DEFAULT_TIMEOUT,
        participation: Policy = "pad",
    ) -> None:
        super().__init__(
            parallelize_fn=parallelize_fn,
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
            participation=participation,
        )
        self._backward_sync_control = _MarkWindow(self)
        self._reduce = ShardedReduceState()
        self._module: Module | None = None
        self._accumulating = False  # inside `fabric.no_backward_sync(model)`

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            "fsdp2_weighted",
            cls,
            description="Count-weighted FSDP2 (ModelParallelStrategy) for Fabric, data-parallel over every rank",
            override=True,  # importing twice leaves the registry as it was
        )

    @override
    def setup_environment(self) -> None:
        # Lightning's "auto" is one data-parallel group per node; here every rank is data-parallel unless told.
        world = self.num_nodes * self.num_processes
        sizes = mesh_sizes(world, self._data_parallel_size, self._tensor_parallel_size)
        self._data_parallel_size, self._tensor_parallel_size = sizes
        super().setup_environment()

    @override
    def setup_module(self, module: Module) -> Module:
        if self._module is not None:
            raise RuntimeError(
                f"{type(self).__name__} weights the gradients of one model, and a second one was set up. Set up"
                " the trained modules as one `nn.Module` (a container of both)."
            )
        module = self._module = super().setup_module(module)
        self._reduce.process_group = self._count_group()
        reduce_with_sum(module, self._reduce)
        return module

    @override
    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        try:
            super().backward(tensor, module, *args, **kwargs)
        finally:
            self._reduce.empty = False

    @contextlib.contextmanager
    def accumulating(self, enabled: bool = True) -> Iterator[None]:
        """What ``fabric.no_backward_sync(model, enabled)`` does here: marks backwards that do not end the window."""
        previous, self._accumulating = self._accumulating, enabled
        try:
            yield
        finally:
            self._accumulating = previous

    @override
    def _count_group(self) -> dist.ProcessGroup | None:
        return data_parallel_group(self.device_mesh)

    @override
    def _syncs(self) -> bool:
        return not self._accumulating

    @override
    def _hold(self) -> None:
        pass  # every microbatch is SUM-reduced into the shards as it comes; only the division waits for the end

    @override
    def _start_sync(self, payload: CountPayload, reference: float) -> None:
        self._reduce.begin_window(payload, self.root_device)

    @override
    def _summed_counts(self) -> list[float]:
        return self._reduce.counts()

    @override
    def _normalize(self, items: float) -> None:
        divide_gradients(self._trained_module().parameters(), items)

    @override
    def _trained_module(self) -> Module:
        if self._module is None:
            raise RuntimeError(
                "fabric.backward ran before a model was set up: call `model = fabric.setup_module(model)` first."
            )
        return self._module

    @override
    def _zero_loss(self, loss: Tensor) -> Tensor:
        source = f"On rank {self.global_rank}, fabric.backward got"
        return empty_microbatch(self._reduce, loss, source, self.strategy_name)


class _MarkWindow(_BackwardSyncControl):
    """``fabric.no_backward_sync`` under ``fsdp2_weighted``: marks the window, keeps each microbatch's reduction."""

    def __init__(self, strategy: WeightedFabricModelParallelStrategy) -> None:
        self.strategy = strategy

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> contextlib.AbstractContextManager[None]:
        return self.strategy.accumulating(enabled)
