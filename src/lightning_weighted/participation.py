"""Uneven data across ranks: sharding without padding, and ranks that keep stepping until every rank is done.

A rank whose data runs out keeps taking part in every remaining optimizer step: it replays its last real
batch (the first batch of another rank if it had none) with a count of 0, so its forward, its backward and the
collectives inside ``training_step`` (``self.log(..., sync_dist=True)``, metric syncs) stay matched, and the
replay contributes exactly nothing to the objective. ``WeightedDDPStrategy.padding_step`` tells the module that
the batch at hand is such a replay. The epoch ends on every rank at the same step: for sized loaders after the
longest rank's last batch, for unsized ones (``IterableDataset``) at the first window boundary where no rank
has a real batch left, a flag that rides in the window's count reduction (no extra collective per step).
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.data import _update_dataloader
from torch.utils.data import DataLoader, Dataset, DistributedSampler

__all__ = ["ParticipatingLoader", "Participation", "UnpaddedDistributedSampler"]

T = TypeVar("T")
Policy = Literal["pad", "strict"]
_END = object()


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

    def __iter__(self) -> Iterator[T]:
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            indices: list[Any] = torch.randperm(self.total_size, generator=generator).tolist()
        else:
            indices = list(range(self.total_size))
        return iter(indices[self.rank : self.total_size : self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples


class Participation:
    """One rank's view of the epoch in progress: how many real batches it has and whether the epoch must end.

    Args:
        policy: ``"pad"`` (default) lets exhausted ranks replay batches with count 0 until every rank is done;
            ``"strict"`` raises instead, naming each rank's batch count.
    """

    def __init__(self, policy: Policy = "pad") -> None:
        if policy not in ("pad", "strict"):
            raise ValueError(f"participation={policy!r} is not a policy: choose 'pad' or 'strict'")
        self.policy = policy
        self.real: int | None = None  # this rank's real batches this epoch, once known
        self.seen = 0  # real batches handed out so far this epoch
        self.stop = False
        # Lightning's `batch_idx` starts past 0 on a mid-epoch resume while a loader without state starts over,
        # so loader positions are counted from the epoch's first `batch_idx`.
        self._first_batch_idx: int | None = None
        self.position = 0

    def new_epoch(self) -> None:
        """Forgets the last epoch (called when the train dataloader is iterated anew)."""
        self.real, self.seen, self.stop, self._first_batch_idx, self.position = None, 0, False, None, 0

    def begin_batch(self, batch_idx: int) -> bool:
        """Notes Lightning's ``batch_idx``; returns whether this batch is a replay of an exhausted rank."""
        if self._first_batch_idx is None:
            self._first_batch_idx = batch_idx
        self.position = batch_idx - self._first_batch_idx
        return self.real is not None and self.position >= self.real

    def has_more(self) -> bool:
        """Whether this rank holds a real batch after the current one (the lookahead makes this known)."""
        return self.real is None or self.real > self.position + 1

    def after_window(self, ranks_with_more: int, device: torch.device, group: dist.ProcessGroup | None = None) -> None:
        """Acts on the summed ``has_more`` flags of a window's count reduction, identically on every rank.

        ``group`` is the one the counts were summed over (``None``: every rank).
        """
        if ranks_with_more == 0:
            self.stop = True
        elif self.policy == "strict" and ranks_with_more != dist.get_world_size(group):
            counts = _gather_counts(self.real if self.real is not None else -1, device, group)
            raise ValueError(_strict_message(counts, f"after loader position {self.position}"))


class ParticipatingLoader:
    """Wraps a rank's train dataloader so that it keeps yielding until every rank is done.

    A sized loader reports the longest rank's length, so Lightning runs the same number of batches everywhere;
    an unsized one pads until the strategy ends the epoch. Attributes (``sampler``, ``batch_sampler``, ...)
    are those of the wrapped loader, so Lightning's ``set_epoch`` calls reach its sampler.
    """

    def __init__(self, loader: Any, participation: Participation, device: torch.device) -> None:
        self.loader = loader
        self.participation = participation
        self.device = device
        local = len(loader) if _has_len(loader) else None
        lengths = _gather_counts(-1 if local is None else local, device)
        # a sized loader with a batch on every rank needs no template exchange at each epoch's start
        self._exchange = min(lengths) <= 0
        if any(n < 0 for n in lengths):
            self.length: int | None = None
        else:
            if participation.policy == "strict" and len(set(lengths)) > 1:
                raise ValueError(_strict_message(lengths, "in their train dataloaders"))
            self.length = max(lengths)
        self._template: Any = _END

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError("this rank's train dataloader has no length")
        return self.length

    def __getattr__(self, name: str) -> Any:
        loader = self.__dict__.get("loader")
        if loader is None:
            raise AttributeError(name)
        return getattr(loader, name)

    def __iter__(self) -> Iterator[Any]:
        state = self.participation
        state.new_epoch()
        iterator = iter(self.loader)

        def fetch() -> Any:
            item = next(iterator, _END)
            if item is _END:
                state.real = state.seen  # the lookahead knows this rank is out before its last batch is used
            return item

        lookahead = fetch()
        self._share_template(lookahead)
        yielded = 0
        while self.length is None or yielded < self.length:
            if lookahead is _END:
                if self._template is _END:
                    return  # no rank has a batch this epoch
                item = self._template
            else:
                item, self._template = lookahead, lookahead
                state.seen += 1
                lookahead = fetch()
            yielded += 1
            yield item

    def _share_template(self, first: Any) -> None:
        """Gives a rank without any batch so far one real batch to replay (a collective only when needed)."""
        if first is not _END:
            self._template = first
        if not self._exchange or not dist.is_initialized():
            return
        missing = _gather_counts(int(self._template is _END), self.device)
        if not any(missing) or all(missing):
            return
        source = missing.index(0)
        box = [self._template if dist.get_rank() == source else None]
        dist.broadcast_object_list(box, src=source)
        if self._template is _END:
            self._template = box[0]


def without_padding(dataloader: object) -> object:
    """Swaps a padding ``DistributedSampler`` for one that repeats no item: the objective counts each item once."""
    if not isinstance(dataloader, DataLoader):
        return dataloader
    sampler = dataloader.sampler
    if type(sampler) is not DistributedSampler or sampler.drop_last:
        return dataloader
    unpadded = UnpaddedDistributedSampler(
        sampler.dataset,
        num_replicas=sampler.num_replicas,
        rank=sampler.rank,
        shuffle=sampler.shuffle,
        seed=sampler.seed,
    )
    return _update_dataloader(dataloader, unpadded)


def _has_len(loader: Any) -> bool:
    try:
        len(loader)
    except (TypeError, NotImplementedError):
        return False
    return True


def _gather_counts(local: int, device: torch.device, group: dist.ProcessGroup | None = None) -> list[int]:
    """Every rank's ``local`` value, by one SUM all-reduce of a group-size vector (at most twice per epoch)."""
    if not dist.is_initialized():
        return [local]
    vector = torch.zeros(dist.get_world_size(group), dtype=torch.float64, device=device)
    vector[dist.get_rank(group)] = local
    dist.all_reduce(vector, group=group)
    return [round(v) for v in vector.tolist()]


def _strict_message(counts: list[int], where: str) -> str:
    listed = ", ".join(f"rank {r}: {'?' if n < 0 else n}" for r, n in enumerate(counts))
    return (
        f"participation='strict' needs every rank to hold the same number of batches, but they differ {where}"
        f" ({listed}). Even out the shards, or use participation='pad' to let exhausted ranks contribute zero."
    )
