"""Count-weighted distributed training for Lightning: every optimizer step optimises the global item mean.

Importing this package registers ``"ddp_weighted"``, ``"ddp_weighted_spawn"``, ``"ddp_weighted_fork"`` and
``"ddp_weighted_find_unused_parameters_true"`` in Lightning's ``StrategyRegistry``. The objective is stated in
:mod:`lightning_weighted.window`.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_weighted.audit import AuditReport, ObjectiveAudit, ObjectiveMismatchError, is_replaying
from lightning_weighted.counting import ItemCounter, count_examples, count_tokens, count_weights
from lightning_weighted.lookahead import BatchCounter
from lightning_weighted.participation import UnpaddedDistributedSampler
from lightning_weighted.reduce.ddp_hook import WeightedReduceState, weighted_allreduce_hook
from lightning_weighted.strategies import WeightedDDPStrategy
from lightning_weighted.window import LossScale, Window, WindowResult

__all__ = [
    "AuditReport",
    "BatchCounter",
    "ItemCounter",
    "LossScale",
    "ObjectiveAudit",
    "ObjectiveMismatchError",
    "UnpaddedDistributedSampler",
    "WeightedDDPStrategy",
    "WeightedReduceState",
    "Window",
    "WindowResult",
    "count_examples",
    "count_tokens",
    "count_weights",
    "is_replaying",
    "weighted_allreduce_hook",
]

__version__ = "0.1.0"

WeightedDDPStrategy.register_strategies(StrategyRegistry)
