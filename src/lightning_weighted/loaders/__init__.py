"""The loaders of a weighted run: sharded without padding, each rank kept in step, counted ahead, resumable."""

from lightning_weighted.loaders.epoch import EpochBatches, Participation, Policy, staged
from lightning_weighted.loaders.sampler import UnpaddedDistributedSampler, without_padding

__all__ = ["EpochBatches", "Participation", "Policy", "UnpaddedDistributedSampler", "staged", "without_padding"]
