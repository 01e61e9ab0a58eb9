"""Lightning Trainer strategies: each drives the window loop over one engine."""

from lightning_weighted.trainer.strategies import (
    WeightedDDPStrategy,
    WeightedFSDPStrategy,
    WeightedModelParallelStrategy,
)

__all__ = ["WeightedDDPStrategy", "WeightedFSDPStrategy", "WeightedModelParallelStrategy"]
