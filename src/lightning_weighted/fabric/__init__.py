"""Fabric strategies: each wires the window core into one engine's reduction, for loops written with Fabric."""

from lightning_weighted.fabric.ddp import WeightedFabricDDPStrategy
from lightning_weighted.fabric.model_parallel import WeightedFabricModelParallelStrategy

__all__ = ["WeightedFabricDDPStrategy", "WeightedFabricModelParallelStrategy"]
