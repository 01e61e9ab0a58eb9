"""Fabric strategies: each drives the window loop over one engine, for loops written with Fabric."""

from lightning_weighted.fabric.strategies import (
    WeightedFabricDDPStrategy,
    WeightedFabricFSDPStrategy,
    WeightedFabricModelParallelStrategy,
)

__all__ = ["WeightedFabricDDPStrategy", "WeightedFabricFSDPStrategy", "WeightedFabricModelParallelStrategy"]
