"""The data side of a weighted run: sharding without padding, and replays for ranks that run out of data.

**Participation.** A rank whose data runs out keeps taking part in every remaining step: it replays its last real
batch (the first batch of another rank if it had none) with a count of 0, so its forward, its backward and the
collectives inside its step (``self.log(..., sync_dist=True)``, metric syncs) stay matched, and the replay
contributes exactly nothing. The epoch ends on every rank at the same step: for sized loaders after the longest
rank's last batch, for unsized ones (``IterableDataset``) at the first window boundary where no rank has a real
batch left, a flag of the window's count payload. Where every rank holds as many batches, the loader is left
exactly as it is; one that replays stays the same object (:func:`lightning_weighted.extension.extend`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler

from lightning_weighted._compat import rebuild_loader, set_sampler
from lightning_weighted.extension import extend

__all__ = [
    "Participation",
    "Replicas",
    "UnpaddedDistributedSampler",
    "combined_lengths",
    "combined_message",
    "lengths_of",
    "participating",
    "without_padding",
]

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


class Replicas(int):
    """The rank count a weighted strategy hands Lightning for the ``DistributedSampler`` it inserts.

    The sampler keeps it as its ``num_replicas``: so :func:`without_padding` tells the sampler Lightning (or Fabric)
    inserted from one of the user's own, which is left alone.
    """


def without_padding(dataloader: object) -> object:
    """Swaps the padding ``DistributedSampler`` Lightning inserted for one that repeats no item.

    The objective counts each item once. The sampler is replaced inside the loader Lightning has just built, which
    keeps every argument of a ``DataLoader`` subclass; where that is impossible the loader is built once more, and
    where that fails too the padding sampler stays and rank 0 says so. A sampler of the user's own stays.
    """
    if not isinstance(dataloader, DataLoader):
        return dataloader
    sampler = dataloader.sampler
    if type(sampler) is not DistributedSampler or sampler.drop_last or not isinstance(sampler.num_replicas, Replicas):
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
        set_sampler(dataloader, unpadded)
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


class Participation:
    """One rank's view of one loader's epoch in progress: how many real batches it has, whether the epoch ends.

    Args:
        policy: ``"pad"`` (default) lets exhausted ranks replay batches with count 0 until every rank is done;
            ``"strict"`` raises instead, naming each rank's batch count.
    """

    def __init__(self, policy: Policy = "pad") -> None:
        if policy not in ("pad", "strict"):
            raise ValueError(f"participation={policy!r} is not a policy: choose 'pad' or 'strict'")
        self.policy = policy
        self.real: int | None = None  # this rank's real batches this epoch, once known
        self.stop = False
        # Lightning's `batch_idx` starts past 0 on a mid-epoch resume while a loader without state starts over,
        # so positions are counted from the epoch's first `batch_idx`.
        self._first: int | None = None
        self.position = 0
        self.replays = False  # whether the loader replays at all (the ranks' lengths differ)

    def new_epoch(self, real: int | None = None) -> None:
        """Forgets the last epoch (the loader is iterated anew); ``real`` where the loader's length tells it."""
        self.real, self.stop, self._first, self.position = real, False, None, 0

    def begin_batch(self, batch_idx: int) -> bool:
        """Notes Lightning's ``batch_idx``; returns whether this batch is a replay of an exhausted rank."""
        if self._first is None:
            self._first = batch_idx
        self.position = batch_idx - self._first
        return self.real is not None and self.position >= self.real

    def has_more(self) -> bool:
        """Whether this rank holds a real batch after the current one."""
        return self.real is None or self.real > self.position + 1

    def after_window(self, ranks_with_more: int, device: torch.device, group: dist.ProcessGroup | None) -> None:
        """Acts on the summed ``has_more`` flags of a window's count reduction, identically on every rank.

        ``group`` is the one the counts were summed over (``None``: every rank).
        """
        if ranks_with_more == 0:
            self.stop = True
        elif self.policy == "strict" and ranks_with_more != dist.get_world_size(group):
            counts = _gather(self.real if self.real is not None else -1, device, group)
            raise ValueError(_strict_message(f"after loader position {self.position}", counts))


def participating(
    loader: Any,
    participation: Participation,
    device: torch.device,
    windows: bool = True,
    lengths: list[int] | None = None,
) -> Any:
    """The rank's loader, made to keep yielding until every rank is done where ranks hold unequal data.

    A loader with as many batches on every rank is returned as it is. Otherwise a sized one reports the longest
    rank's length, so Lightning runs as many batches everywhere, and an unsized one replays until the window that
    finds every rank out of data ends the epoch (``windows=False``, in a loop without windows such as evaluation:
    until a one-value all-reduce before each batch finds it). ``lengths``: every rank's, where already gathered
    (:func:`lengths_of`).
    """
    lengths = lengths_of(loader, device) if lengths is None else lengths
    here = lengths[dist.get_rank() if dist.is_initialized() else 0]
    local = here if here >= 0 else None
    sized = all(n >= 0 for n in lengths)
    if sized and len(set(lengths)) == 1:
        return loader
    if participation.policy == "strict" and sized:
        raise ValueError(_strict_message("in their dataloaders", lengths))
    participation.replays = True
    replays = _Replays(participation, max(lengths) if sized else None, min(lengths) <= 0, device, local, windows)
    longest = replays.length
    return extend(loader, replays.iterate, None if longest is None else lambda: longest)


def lengths_of(loader: Any, device: torch.device) -> list[int]:
    """Every rank's number of batches in its ``loader`` (-1 for a loader without a length): one all-reduce."""
    return _gather(len(loader) if _has_len(loader) else -1, device)


def combined_lengths(mode: str, lengths: list[list[int]]) -> list[int] | None:
    """Every rank's number of combined batches of a ``CombinedLoader`` in ``mode``; ``None`` if one is unsized.

    ``lengths`` holds one list per loader, each rank's number of batches in it (-1: no length).

    Example::

        >>> combined_lengths("max_size_cycle", [[2, 1], [4, 4]])  # the shorter loaders cycle
        [4, 4]
        >>> combined_lengths("min_size", [[2, 1], [4, 4]])
        [2, 1]
    """
    if any(n < 0 for loader in lengths for n in loader):
        return None
    per_rank = list(zip(*lengths, strict=True))
    if mode == "sequential":
        return [sum(rank) for rank in per_rank]
    return [min(rank) if mode == "min_size" else max(rank) for rank in per_rank]


def combined_message(mode: str, lengths: list[list[int]], combined: list[int]) -> str:
    """The refusal of several train loaders whose combined batches differ in number across ranks."""
    each = "; ".join(f"loader {index}: {_listed(n)}" for index, n in enumerate(lengths))
    return (
        f"the loaders of a CombinedLoader in mode {mode!r} give the ranks different numbers of batches"
        f" ({_listed(combined)}; each loader: {each}), which would leave the ranks out of step. Even out their"
        " shards, or combine them into one loader, whose uneven length the ranks then share with replays."
    )


class _Replays:
    """Yields a rank's batches, then replays until every rank is done (see the module docstring)."""

    def __init__(
        self, participation: Participation, length: int | None, exchange: bool, device: Any, local: Any, windows: bool
    ) -> None:
        self.participation, self.length, self.device, self.local = participation, length, device, local
        self.exchange = exchange  # a rank may have no batch at all: its first batch of the epoch comes from a peer
        self.windows = windows  # whether windows tell when every rank is out of an unsized loader
        self.template: Any = _END

    def iterate(self, iterator: Iterator[Any]) -> Iterator[Any]:
        # The epoch starts as Lightning asks for the iterator, before its first batch begins: a `training_step`
        # taking `dataloader_iter` reads that batch only inside the step.
        self.participation.new_epoch(self.local)
        return self._batches(iterator)

    def _batches(self, iterator: Iterator[Any]) -> Iterator[Any]:
        state = self.participation
        # A sized loader tells its real batches and is read no earlier than Lightning asks (its state stays the
        # state of what was consumed); an unsized one is read one batch ahead, to know its last before it is used.
        seen = 0

        def fetch() -> Any:
            item = next(iterator, _END) if self.local is None or seen < self.local else _END
            if item is _END:
                state.real = seen
            return item

        following = fetch()
        self._share_template(following)
        yielded = 0
        while self.length is None or yielded < self.length:
            if self.length is None and not self.windows and not any(_gather(int(following is not _END), self.device)):
                return  # no rank has a batch left: the epoch ends here on every rank
            if following is _END:
                if self.template is _END:
                    return  # no rank has a batch this epoch
                item = self.template
            else:
                item = self.template = following
                seen += 1
                following = None if self.local is not None else fetch()
            yielded += 1
            yield item
            if following is None:
                following = fetch()

    def _share_template(self, first: Any) -> None:
        """Gives a rank without any batch one real batch to replay (a collective only where one may lack it)."""
        if first is not _END:
            self.template = first
        if not self.exchange or not dist.is_initialized():
            return
        missing = _gather(int(self.template is _END), self.device)
        if not any(missing) or all(missing):
            return
        source = missing.index(0)
        box = [self.template if dist.get_rank() == source else None]
        dist.broadcast_object_list(box, src=source)
        if self.template is _END:
            self.template = box[0]


def _has_len(loader: Any) -> bool:
    try:
        len(loader)
    except (TypeError, NotImplementedError):
        return False
    return True


def _gather(local: int, device: torch.device, group: dist.ProcessGroup | None = None) -> list[int]:
    """Every rank's ``local``, by one SUM all-reduce of a group-size vector (at most twice per epoch)."""
    if not dist.is_initialized():
        return [local]
    vector = torch.zeros(dist.get_world_size(group), dtype=torch.float64, device=device)
    vector[dist.get_rank(group)] = local
    dist.all_reduce(vector, group=group)
    return [round(v) for v in vector.tolist()]


def _listed(counts: list[int]) -> str:
    return ", ".join(f"rank {r}: {'?' if n < 0 else n}" for r, n in enumerate(counts))


def _strict_message(where: str, counts: list[int]) -> str:
    return (
        f"participation='strict' needs every rank to hold the same number of batches, but they differ {where}"
        f" ({_listed(counts)}). Even out the shards, or use participation='pad' to let exhausted ranks contribute"
        " zero."
    )
