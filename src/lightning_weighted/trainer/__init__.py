"""Lightning Trainer strategies: each drives the window loop over one engine."""

from lightning_weighted.trainer.ddp import WeightedDDPStrategy
from lightning_weighted.trainer.fsdp1 import WeightedFSDPStrategy
from lightning_weighted.trainer.fsdp2 import WeightedModelParallelStrategy

__all__ = ["WeightedDDPStrategy", "WeightedFSDPStrategy", "WeightedModelParallelStrategy"]
