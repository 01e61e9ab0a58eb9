"""The loaders of a weighted run: sharded without padding, each rank kept in step, counted ahead, resumable."""

from lightning_weighted.loaders.epoch import EpochBatches, Participation, Policy, staged
from lightning_weighted.loaders.sampler import UnpaddedDistributedSampler, marked, without_padding

# fmt: off
__all__ = [
    "EpochBatches", "Participation", "Policy", "UnpaddedDistributedSampler", "marked", "staged", "without_padding",
]
# fmt: on
