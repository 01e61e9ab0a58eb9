"""Count-weighted distributed training for Lightning: every optimizer step optimises the global item mean.

Importing this package registers ``"ddp_weighted"``, ``"ddp_weighted_spawn"``, ``"ddp_weighted_fork"``,
``"ddp_weighted_find_unused_parameters_true"``, ``"fsdp2_weighted"`` (FSDP2) and ``"fsdp_weighted"`` (FSDP1) in
Lightning's ``StrategyRegistry``, and the DDP names (with ``"ddp_weighted_notebook"``), ``"fsdp2_weighted"`` and
``"fsdp_weighted"`` in Fabric's ``STRATEGY_REGISTRY``. The objective is stated in :mod:`lightning_weighted.window`;
how one window flows from the batch to the gradients, in ``docs/architecture.md``.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as _FABRIC_STRATEGIES
from lightning.pytorch.strategies import StrategyRegistry

from lightning_weighted.audit import AuditReport, ObjectiveAudit, ObjectiveMismatchError, is_audit_rerun
from lightning_weighted.counter import ItemCounter, count_documents, count_examples, count_tokens, count_weights
from lightning_weighted.engines.fsdp2 import shard_blocks
from lightning_weighted.fabric import (
    WeightedFabricDDPStrategy,
    WeightedFabricFSDPStrategy,
    WeightedFabricModelParallelStrategy,
)
from lightning_weighted.loaders import UnpaddedDistributedSampler
from lightning_weighted.monitor import ItemMetrics, ItemMonitor
from lightning_weighted.trainer import WeightedDDPStrategy, WeightedFSDPStrategy, WeightedModelParallelStrategy
from lightning_weighted.window import WindowResult

__all__ = [
    "AuditReport",
    "ItemCounter",
    "ItemMetrics",
    "ItemMonitor",
    "ObjectiveAudit",
    "ObjectiveMismatchError",
    "UnpaddedDistributedSampler",
    "WeightedDDPStrategy",
    "WeightedFSDPStrategy",
    "WeightedFabricDDPStrategy",
    "WeightedFabricFSDPStrategy",
    "WeightedFabricModelParallelStrategy",
    "WeightedModelParallelStrategy",
    "WindowResult",
    "count_documents",
    "count_examples",
    "count_tokens",
    "count_weights",
    "is_audit_rerun",
    "shard_blocks",
]

__version__ = "0.1.0"

WeightedDDPStrategy.register_strategies(StrategyRegistry)
WeightedModelParallelStrategy.register_strategies(StrategyRegistry)
WeightedFSDPStrategy.register_strategies(StrategyRegistry)
WeightedFabricDDPStrategy.register_strategies(_FABRIC_STRATEGIES)
WeightedFabricModelParallelStrategy.register_strategies(_FABRIC_STRATEGIES)
WeightedFabricFSDPStrategy.register_strategies(_FABRIC_STRATEGIES)
