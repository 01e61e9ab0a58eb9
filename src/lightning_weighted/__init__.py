"""Count-weighted DDP for Lightning: ``Trainer(strategy="ddp_weighted")`` optimises the global item mean.

Importing this package registers ``"ddp_weighted"``, ``"ddp_weighted_spawn"``, ``"ddp_weighted_fork"`` and
``"ddp_weighted_find_unused_parameters_true"`` in Lightning's ``StrategyRegistry``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_weighted.audit import AuditReport, ObjectiveAudit, ObjectiveMismatchError, is_replaying
from lightning_weighted.callback import ItemCounter
from lightning_weighted.hook import WeightedReduceState, weighted_allreduce_hook
from lightning_weighted.participation import UnpaddedDistributedSampler
from lightning_weighted.strategy import WeightedDDPStrategy, WindowResult

__all__ = [
    "AuditReport",
    "ItemCounter",
    "ObjectiveAudit",
    "ObjectiveMismatchError",
    "UnpaddedDistributedSampler",
    "WeightedDDPStrategy",
    "WeightedReduceState",
    "WindowResult",
    "is_replaying",
    "weighted_allreduce_hook",
]

__version__ = "0.1.0"

WeightedDDPStrategy.register_strategies(StrategyRegistry)
