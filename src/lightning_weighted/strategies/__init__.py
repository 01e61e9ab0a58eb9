"""Lightning Trainer strategies: each wires the window core into one engine's reduction."""

from lightning_weighted.strategies.ddp import WeightedDDPStrategy
from lightning_weighted.strategies.fsdp import WeightedFSDPStrategy
from lightning_weighted.strategies.model_parallel import WeightedModelParallelStrategy

__all__ = ["WeightedDDPStrategy", "WeightedFSDPStrategy", "WeightedModelParallelStrategy"]
