"""Fabric strategies: each drives the window loop over one engine, for loops written with Fabric."""

from lightning_weighted.fabric.ddp import WeightedFabricDDPStrategy
from lightning_weighted.fabric.fsdp1 import WeightedFabricFSDPStrategy
from lightning_weighted.fabric.fsdp2 import WeightedFabricModelParallelStrategy

__all__ = ["WeightedFabricDDPStrategy", "WeightedFabricFSDPStrategy", "WeightedFabricModelParallelStrategy"]
