"""Lightning Trainer strategies: each wires the window core into one engine's reduction."""

from lightning_weighted.strategies.ddp import WeightedDDPStrategy

__all__ = ["WeightedDDPStrategy"]
