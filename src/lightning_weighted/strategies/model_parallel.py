"""``WeightedModelParallelStrategy``: FSDP2 (and tensor parallelism) whose update is the global item mean's gradient."""

from __future__ import annotations

from datetime import timedelta
from typing import Literal

import torch.distributed as dist
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ModelParallelStrategy
from typing_extensions import override

from lightning_weighted.participation import Policy
from lightning_weighted.reduce.sharded import FP16_FIX, data_parallel_group, mesh_sizes, reduce_with_sum
from lightning_weighted.strategies._sharded import ShardedAdapter

__all__ = ["WeightedModelParallelStrategy"]

_DEFAULT_TIMEOUT = timedelta(minutes=30)  # Lightning's and torch's default process-group timeout


class WeightedModelParallelStrategy(ShardedAdapter, ModelParallelStrategy):
    """FSDP2 that optimises the mean over every valid item of each optimizer step, on every rank and microbatch.

    The module applies ``fully_shard`` in ``configure_model`` over ``self.device_mesh["data_parallel"]`` (and
    tensor parallelism over ``self.device_mesh["tensor_parallel"]``), exactly as for Lightning's
    ``ModelParallelStrategy``; ``training_step`` follows :class:`~lightning_weighted.WeightedDDPStrategy`'s contract
    and rules, and the update is the one stated in :mod:`lightning_weighted.window`.

    Every FSDP module SUM-reduces item-sum gradients on each microbatch (FSDP2's default under accumulation in
    Lightning: no unsharded gradient is held between microbatches), the window's counts are summed over the
    data-parallel group by one 48-byte all-reduce, and the local gradient shards are divided by ``N`` before
    clipping and the optimizer (see :mod:`lightning_weighted.reduce.sharded`). With an ``ItemCounter`` the counts
    are taken ahead: each loss is scaled by ``n / N`` before its backward, nothing is divided, and the all-reduce
    (32 bytes) carries the next window's count. Float16 computation or reduction (``"16-mixed"``, ``"16-true"``, a
    ``MixedPrecisionPolicy`` in float16) is refused: item sums overflow it.

    Args:
        data_parallel_size: ranks that see different data; ``"auto"``: the world size divided by
            ``tensor_parallel_size``.
        tensor_parallel_size: ranks that split each layer; ``"auto"``: 1, or the world size divided by
            ``data_parallel_size`` when that is given.
        save_distributed_checkpoint: as for ``ModelParallelStrategy``: a folder of shards (``True``) or one full file.
        process_group_backend: as for ``ModelParallelStrategy``.
        timeout: the process-group timeout; a dead or stalled rank ends every rank after it.
        participation: ``"pad"`` lets a rank whose data ran out step with count 0 until every rank is done;
            ``"strict"`` raises instead (see :mod:`lightning_weighted.participation`).

    Example::

        >>> import lightning_weighted
        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(strategy="fsdp2_weighted", accelerator="cpu", devices=1, logger=False)
        >>> type(trainer.strategy).__name__
        'WeightedModelParallelStrategy'
    """

    strategy_name = "fsdp2_weighted"

    def __init__(
        self,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: Literal["auto"] | int = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = _DEFAULT_TIMEOUT,
        participation: Policy = "pad",
    ) -> None:
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
            participation=participation,
        )
        self._data_parallel_group: dist.ProcessGroup | None = None  # once the device mesh exists

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            "fsdp2_weighted",
            cls,
            description="Count-weighted FSDP2 (ModelParallelStrategy), data-parallel over every rank by default",
            override=True,  # importing twice leaves the registry as it was
        )

    @override
    def setup_environment(self) -> None:
        world = self.num_nodes * self.num_processes
        sizes = mesh_sizes(world, self._data_parallel_size, self._tensor_parallel_size)
        self._data_parallel_size, self._tensor_parallel_size = sizes
        super().setup_environment()

    @override
    def setup(self, trainer: Trainer) -> None:
        precision = getattr(self.precision_plugin, "precision", "")
        if precision in ("16-mixed", "16-true"):
            raise MisconfigurationException(f"fsdp2_weighted would compute in float16 ({precision=}). {FP16_FIX}.")
        super().setup(trainer)
        assert self.model is not None
        self._data_parallel_group = data_parallel_group(self.device_mesh)
        self._reduce.process_group = self._count_group()
        reduce_with_sum(self.model, self._reduce)

    @override
    def _count_group(self) -> dist.ProcessGroup | None:
        return self._data_parallel_group
