"""Count-weighted distributed training for Lightning: every optimizer step optimises the global item mean.

Importing it registers ``"ddp_weighted"`` (with its ``_spawn``, ``_fork``, ``_find_unused_parameters_true`` and, in
Fabric, ``_notebook`` variants), ``"fsdp2_weighted"`` and ``"fsdp_weighted"`` in Lightning's and Fabric's registries.
The objective: :mod:`lightning_weighted.window`; one window from the batch to the gradients: ``docs/architecture.md``.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as _FABRIC_STRATEGIES
from lightning.pytorch.strategies import StrategyRegistry

from lightning_weighted.counter import ItemCounter, count_documents, count_examples, count_tokens, count_weights
from lightning_weighted.engines.fsdp2 import shard_blocks
from lightning_weighted.fabric.strategies import (
    WeightedFabricDDPStrategy,
    WeightedFabricFSDPStrategy,
    WeightedFabricModelParallelStrategy,
)
from lightning_weighted.loaders import UnpaddedDistributedSampler
from lightning_weighted.monitor import ItemMetrics, ItemMonitor
from lightning_weighted.payload import WindowResult
from lightning_weighted.trainer.audit import AuditReport, ObjectiveAudit, ObjectiveMismatchError, is_audit_rerun
from lightning_weighted.trainer.strategies import (
    WeightedDDPStrategy,
    WeightedFSDPStrategy,
    WeightedModelParallelStrategy,
)

# fmt: off
__all__ = [
    "AuditReport", "ItemCounter", "ItemMetrics", "ItemMonitor", "ObjectiveAudit", "ObjectiveMismatchError",
    "UnpaddedDistributedSampler", "WeightedDDPStrategy", "WeightedFSDPStrategy", "WeightedFabricDDPStrategy",
    "WeightedFabricFSDPStrategy", "WeightedFabricModelParallelStrategy", "WeightedModelParallelStrategy",
    "WindowResult", "count_documents", "count_examples", "count_tokens", "count_weights", "is_audit_rerun",
    "shard_blocks",
]
# fmt: on

__version__ = "0.1.0"

for _trainer_strategy in (WeightedDDPStrategy, WeightedModelParallelStrategy, WeightedFSDPStrategy):
    _trainer_strategy.register_strategies(StrategyRegistry)
for _fabric_strategy in (WeightedFabricDDPStrategy, WeightedFabricModelParallelStrategy, WeightedFabricFSDPStrategy):
    _fabric_strategy.register_strategies(_FABRIC_STRATEGIES)
