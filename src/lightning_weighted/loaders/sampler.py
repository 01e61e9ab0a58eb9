"""Sharding without padding: every item once per epoch over all ranks, whatever sampler Lightning inserted."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sized
from itertools import islice
from typing import Any, TypeVar

import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler

from lightning_weighted._compat import rebuild_loader, set_sampler

__all__ = ["InsertedReplicas", "UnpaddedDistributedSampler", "dealt_sampler", "marked", "taken", "without_padding"]

T = TypeVar("T")


class UnpaddedDistributedSampler(DistributedSampler[T]):
    """A ``DistributedSampler`` that shards without padding: every index exactly once per epoch over all ranks.

    Rank ``r`` takes positions ``r, r + P, r + 2P, ...`` of the same permutation ``DistributedSampler`` draws
    (``seed + epoch``, call ``set_epoch`` as usual), so ranks differ by at most one item and none is repeated.

    Example::

        >>> [list(UnpaddedDistributedSampler(range(5), num_replicas=2, rank=r, shuffle=False)) for r in (0, 1)]
        [[0, 2, 4], [1, 3]]
    """

    def __init__(
        self,
        dataset: Dataset[T],
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        if not isinstance(dataset, Sized):
            raise TypeError(f"UnpaddedDistributedSampler needs a dataset with a length, got {type(dataset).__name__}")
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=False)
        self.total_size = len(dataset)
        self.num_samples = len(range(self.rank, self.total_size, self.num_replicas))
        self.dealt: tuple[int, int] | None = None  # a resumed epoch, and how many items of its order trained before
        self.epochs_before = 0  # added to the epoch set: Fabric counts a resumed process's epochs from 0

    def order(self) -> list[Any]:
        """Every index of the epoch set last, in the order the ranks take them in turn."""
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            return torch.randperm(self.total_size, generator=generator).tolist()
        return list(range(self.total_size))

    def deal_from(self, epoch: int, consumed: int) -> None:
        """Deals epoch ``epoch`` from item ``consumed`` of its order on (those before trained); later epochs whole."""
        self.set_epoch(epoch)
        self.dealt = (epoch, consumed)

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch whose order the sampler deals (``epochs_before`` later)."""
        super().set_epoch(self.epochs_before + epoch)

    def __iter__(self) -> Iterator[T]:
        return iter(self.order()[self._first() + self.rank :: self.num_replicas])

    def __len__(self) -> int:
        return len(range(self._first() + self.rank, self.total_size, self.num_replicas))

    def _first(self) -> int:
        return self.dealt[1] if self.dealt is not None and self.dealt[0] == self.epoch else 0


class _UnpaddedWrapper(UnpaddedDistributedSampler[T]):
    """Lightning's ``DistributedSamplerWrapper`` without padding: what a sampler of the user's draws, each once."""

    def __iter__(self) -> Iterator[T]:
        self.dataset.reset()  # type: ignore[attr-defined]  # Lightning's view of the sampler draws anew
        return (self.dataset[index] for index in super().__iter__())

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        drawn = getattr(self.dataset._sampler, "set_epoch", None)  # type: ignore[attr-defined]
        if callable(drawn):
            drawn(epoch)


class InsertedReplicas(int):
    """The rank count handed to the ``DistributedSampler`` Lightning inserts: it tells that one from the user's."""


def marked(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """A strategy's ``distributed_sampler_kwargs`` with ``num_replicas`` marked as :class:`InsertedReplicas`."""
    kwargs = dict(kwargs or {})
    kwargs["num_replicas"] = InsertedReplicas(kwargs["num_replicas"])
    return kwargs


def without_padding(dataloader: object) -> object:
    """Swaps the padding ``DistributedSampler`` Lightning inserted for one that repeats no item.

    In place where possible (which keeps a ``DataLoader`` subclass's arguments), else in a loader built anew, else
    the padding one stays and rank 0 says so. A sampler of the user's own stays.
    """
    if not isinstance(dataloader, DataLoader):
        return dataloader
    batches: Any = dataloader.batch_sampler
    sampler: Any = next((s for s in (dataloader.sampler, getattr(batches, "sampler", None)) if _inserted(s)), None)
    if sampler is None:
        return dataloader
    kind = _UnpaddedWrapper if isinstance(sampler, DistributedSamplerWrapper) else UnpaddedDistributedSampler
    unpadded = kind(sampler.dataset, sampler.num_replicas, sampler.rank, sampler.shuffle, sampler.seed)
    unpadded.set_epoch(sampler.epoch)
    if batches is None or (isinstance(batches, BatchSampler) and batches.sampler is sampler):
        set_sampler(dataloader, unpadded, keep=dataloader.sampler is not sampler)
        return dataloader
    try:
        return rebuild_loader(dataloader, unpadded)
    except Exception as error:  # Lightning cannot rebuild every loader; the padded one still trains
        rank_zero_warn(
            f"The {type(dataloader).__name__}'s DistributedSampler pads each rank to the same length, so up to"
            f" {sampler.num_replicas - 1} items repeat every epoch and count twice; it could not be replaced ({error})."
            " Pass a sampler of your own, or a DataLoader that Lightning can re-create."
        )
        return dataloader


def dealt_sampler(loader: object) -> UnpaddedDistributedSampler[Any] | None:
    """The sampler inserted in place of Lightning's, whose epoch's order can be dealt again; ``None`` if none."""
    batches = getattr(loader, "batch_sampler", None)
    samplers = (getattr(loader, "sampler", None), getattr(batches, "sampler", None))
    return next((sampler for sampler in samplers if type(sampler) is UnpaddedDistributedSampler), None)


def taken(loader: object, indices: list[int], batches: int) -> int:
    """How many of ``indices`` the first ``batches`` batches of ``loader``'s batch sampler take, run over them."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    if batch_sampler is None:  # `batch_size=None`: an index a batch
        return min(batches, len(indices))
    replica = copy.copy(batch_sampler)
    replica.sampler = indices
    return sum(len(batch) for batch in islice(replica, batches))


def _inserted(sampler: object) -> bool:
    """Whether ``sampler`` is the padding one Lightning inserted (or its wrapper of a sampler of the user's)."""
    padding = type(sampler) in (DistributedSampler, DistributedSamplerWrapper) and not sampler.drop_last  # type: ignore[attr-defined]
    return padding and isinstance(sampler.num_replicas, InsertedReplicas)  # type: ignore[attr-defined]
