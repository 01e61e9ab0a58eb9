"""Uneven data across ranks: sharding without padding, and ranks that keep stepping until every rank is done.

A rank whose data runs out keeps taking part in every remaining optimizer step: it replays its last real
batch (the first batch of another rank if it had none) with a count of 0, so its forward, its backward and the
collectives inside ``training_step`` (``self.log(..., sync_dist=True)``, metric syncs) stay matched, and the
replay contributes exactly nothing to the objective. The strategy's ``padding_step`` tells the module that the
batch at hand is such a replay. The epoch ends on every rank at the same step: for sized loaders after the longest
rank's last batch, for unsized ones (``IterableDataset``) at the first window boundary where no rank has a real
batch left, a flag that rides in the window's count payload (no extra collective per step).

Where every rank holds as many batches, the train loader is left exactly as it is. A ``DataLoader`` that needs
replays stays the same object (Lightning's worker seeding and worker checks reach it): its class is extended for
the length of the fit, and restored afterwards (:mod:`lightning_weighted._loader`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.data import _update_dataloader
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler

from lightning_weighted._loader import extend

__all__ = ["Participation", "UnpaddedDistributedSampler", "participating", "release", "without_padding"]

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
        self.loaders = 0  # train loaders set up so far (a CombinedLoader has several)
        self.replaying: Any = None  # the loader that replays, when one must

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


def participating(loader: Any, participation: Participation, device: torch.device) -> Any:
    """The rank's train loader, made to keep yielding until every rank is done where ranks hold unequal data.

    A loader with as many batches on every rank is returned as it is. Otherwise a sized one reports the longest
    rank's length, so Lightning runs as many batches everywhere, and an unsized one replays until the strategy
    ends the epoch. Several train loaders (a ``CombinedLoader``) must each hold as many batches on every rank.
    """
    local = len(loader) if _has_len(loader) else None
    lengths = _gather_counts(-1 if local is None else local, device)
    participation.loaders += 1
    sized = all(n >= 0 for n in lengths)
    if sized and len(set(lengths)) == 1:
        return loader
    if participation.policy == "strict" and sized:
        raise ValueError(_strict_message(lengths, "in their train dataloaders"))
    if participation.loaders > 1 or participation.replaying is not None:
        if not sized:
            return loader  # several unsized loaders: as under "ddp", their ends are theirs to align
        raise ValueError(
            f"the train loaders of a CombinedLoader must each hold as many batches on every rank, but loader"
            f" {participation.loaders - 1} differs ({_listed(lengths)}). Even out their shards, or combine them into"
            " one loader, whose uneven length the ranks then share with replays."
        )
    replays = _Replays(participation, None if not sized else max(lengths), exchange=min(lengths) <= 0, device=device)
    length = replays.length
    loader = extend(loader, replays.iterate, None if length is None else lambda: length)
    participation.replaying = loader
    return loader


def release(participation: Participation) -> Any:
    """Forgets the replaying loader (called when the fit ends or the train loaders are set up anew); returns it."""
    loader, participation.replaying, participation.loaders = participation.replaying, None, 0
    participation.new_epoch()
    return loader


class _Replays:
    """Yields a rank's batches, then replays until every rank is done (see the module docstring)."""

    def __init__(self, participation: Participation, length: int | None, exchange: bool, device: torch.device):
        self.participation, self.length, self.device = participation, length, device
        self.exchange = exchange  # a rank may have no batch at all: its first epoch batch comes from a peer
        self.template: Any = _END

    def iterate(self, iterator: Iterator[Any]) -> Iterator[Any]:
        state = self.participation
        state.new_epoch()

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
                if self.template is _END:
                    return  # no rank has a batch this epoch
                item = self.template
            else:
                item, self.template = lookahead, lookahead
                state.seen += 1
                lookahead = fetch()
            yielded += 1
            yield item

    def _share_template(self, first: Any) -> None:
        """Gives a rank without any batch so far one real batch to replay (a collective only when needed)."""
        if first is not _END:
            self.template = first
        if not self.exchange or not dist.is_initialized():
            return
        missing = _gather_counts(int(self.template is _END), self.device)
        if not any(missing) or all(missing):
            return
        source = missing.index(0)
        box = [self.template if dist.get_rank() == source else None]
        dist.broadcast_object_list(box, src=source)
        if self.template is _END:
            self.template = box[0]


def without_padding(dataloader: object) -> object:
    """Swaps a padding ``DistributedSampler`` for one that repeats no item: the objective counts each item once.

    The sampler is replaced inside the loader Lightning has just built, which keeps every argument of a
    ``DataLoader`` subclass; where that is impossible the loader is built once more, and where that fails too the
    padding sampler stays and rank 0 says so.
    """
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
    batches = dataloader.batch_sampler
    if batches is None or (type(batches) is BatchSampler and batches.sampler is sampler):
        if batches is not None:
            batches.sampler = unpadded
        object.__setattr__(dataloader, "sampler", unpadded)  # `DataLoader.__setattr__` guards it after `__init__`
        return dataloader
    try:
        return _update_dataloader(dataloader, unpadded)
    except Exception as error:  # Lightning cannot rebuild every loader; the padded one still trains
        rank_zero_warn(
            f"The {type(dataloader).__name__}'s DistributedSampler pads each rank to the same length, so up to"
            f" {sampler.num_replicas - 1} items repeat every epoch and count twice; it could not be replaced ({error})."
            " Pass a sampler of your own, or a DataLoader that Lightning can re-create."
        )
        return dataloader


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


def _listed(counts: list[int]) -> str:
    return ", ".join(f"rank {r}: {'?' if n < 0 else n}" for r, n in enumerate(counts))


def _strict_message(counts: list[int], where: str) -> str:
    return (
        f"participation='strict' needs every rank to hold the same number of batches, but they differ {where}"
        f" ({_listed(counts)}). Even out the shards, or use participation='pad' to let exhausted ranks contribute"
        " zero."
    )
