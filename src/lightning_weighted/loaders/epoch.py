"""One rank's pass over one loader: its real batches, then replays until every rank is done; counted; resumable.

A rank whose data runs out replays its last real batch (a peer's first if it had none) with a count of 0: its
collectives stay matched and it adds nothing (:meth:`Participation.replay`). Every rank's epoch ends at the same step:
after the longest rank's last batch or, unsized, at the first window end where no rank has a real batch left. A
checkpoint keeps each rank's place and its loader's state before its first untrained batch (:meth:`EpochBatches.state`).
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any, Literal

import torch
import torch.distributed as dist

from lightning_weighted.count import Counts
from lightning_weighted.loaders.extension import extend

__all__ = ["EpochBatches", "Participation", "Policy", "combined_lengths", "lengths_of", "participating"]

Policy = Literal["pad", "strict"]
_END = object()


class Participation:
    """One rank's view of one loader's epoch: how many real batches it holds, and whether every rank is done.

    Args:
        policy: ``"pad"`` (default): exhausted ranks replay with count 0; ``"strict"`` raises, naming each rank's.
    """

    def __init__(self, policy: Policy = "pad") -> None:
        if policy not in ("pad", "strict"):
            raise ValueError(f"participation={policy!r} is not a policy: choose 'pad' or 'strict'")
        self.policy = policy
        self.real: int | None = None  # this rank's real batches this epoch, once known
        self.stop = False  # every rank is out of data (an unsized loader's epoch ends)
        self.replays = False  # the ranks' lengths differ: some rank replays

    def new_epoch(self, real: int | None = None) -> None:
        """Forgets the last epoch; ``real`` where the loader's length tells it."""
        self.real, self.stop = real, False

    def replay(self, position: int) -> bool:
        """Whether the batch at ``position`` of the epoch replays a batch of a rank whose data ran out."""
        return self.real is not None and position >= self.real

    def has_more(self, position: int) -> bool:
        """Whether this rank holds a real batch after the one at ``position``."""
        return self.real is None or self.real > position + 1

    def after_window(
        self, ranks_with_more: int, position: int, group: dist.ProcessGroup | None, device: torch.device
    ) -> None:
        """Acts on how many ranks hold real batches after the window that ended at ``position``."""
        if ranks_with_more == 0:
            self.stop = True
        elif self.policy == "strict" and ranks_with_more != dist.get_world_size(group):
            counts = _gather(self.real if self.real is not None else -1, device, group)
            raise ValueError(_strict_message(f"after loader position {position}", counts))


class EpochBatches:
    """Yields a rank's batches of each pass, then replays until every rank is done (see the module docstring).

    Args:
        participation: the loader's epoch.
        longest: the longest rank's number of batches (``None``: unsized): every rank yields as many.
        local: this rank's number of batches (``None``: unsized).
        device: where the collectives' tensors live.
        shared_first: a rank may hold no batch at all, and replays a peer's first.
        windows: windows end an unsized epoch (training); else a one-value all-reduce before each batch does.

    Attributes:
        count: counts ahead: each part's count of a batch, ``count(batch)``, taken as the batch is fetched.
        loader_state: the loader's own ``state_dict`` (a ``StatefulDataLoader``'s), or ``None``.
        position: the position of the next batch handed out.
        start: where the pass in progress started (past 0 where it resumed mid-epoch).
        passes: how many passes over the loader began.
    """

    def __init__(
        self,
        participation: Participation,
        longest: int | None,
        local: int | None,
        device: torch.device,
        shared_first: bool = False,
        windows: bool = True,
    ) -> None:
        self.participation, self.longest, self.local, self.device = participation, longest, local, device
        self.shared_first, self.windows = shared_first, windows
        self.count: Callable[[Any], Counts] | None = None
        self.loader_state: Callable[[], dict[str, Any]] | None = None
        self.position = self.start = self.passes = 0
        self._resume: tuple[int, int | None, int] | None = None
        self._source: Iterator[Any] = iter(())
        self._held: deque[Any] = deque()  # batches fetched early, in order
        self._counts: deque[Counts] = deque()  # counts of the batches fetched and not planned yet
        self._fetched = 0
        self._states: dict[int, dict[str, Any]] = {}  # the loader's state before each real batch still needed

    def resume(self, position: int, real: int | None, at: int = 0) -> None:
        """Starts the next pass at ``position``, a mid-epoch resume.

        Args:
            position: where the run resumes: the batches before it were trained.
            real: this rank's real batches in the epoch, where known.
            at: the real batch the loader yields first (0 without state); those up to ``position`` are skipped.
        """
        self._resume = (position, real, at)

    def iterate(self, iterator: Iterator[Any]) -> Iterator[Any]:
        """The batches of one pass, which starts as Lightning asks for the iterator (a stage of ``extend``)."""
        start, real, at = self._resume or (0, None, 0)
        self._resume, self.passes = None, self.passes + 1
        self.participation.new_epoch(self.local if real is None else real)
        self.position = self.start = self._fetched = start
        self._held, self._counts, self._states = deque(), deque(), {}
        self._source = self._produce(iterator, start, at)
        return self._handed(self.passes)

    def take(self, size: int) -> list[Counts]:
        """The counts of the ``size`` batches trained next (fewer where the loader ends), fetching them now."""
        counts = self.peek(size)
        for _ in counts:
            self._counts.popleft()
        return counts

    def peek(self, size: int) -> list[Counts]:
        """The counts of the ``size`` batches after those taken (fewer where the loader ends), fetching them now."""
        while len(self._counts) < size:
            item = self._next()
            if item is _END:
                break
            self._held.append(item)
        return list(islice(self._counts, size))

    def state(self, trained: int) -> dict[str, Any]:
        """This rank's place for a checkpoint, once ``trained`` batches of the pass trained."""
        real = self.participation.real
        at = trained if real is None or trained < real else max(real - 1, 0)
        loader = None
        if self.loader_state is not None:
            loader = self._states[at] if at in self._states else copy.deepcopy(self.loader_state())
        return {"position": trained, "real": real, "at": at, "loader": loader}

    def state_before(self, position: int) -> dict[str, Any] | None:
        """The loader's own state before the batch at ``position``, where it was fetched already."""
        return self._states.get(position)

    def _handed(self, passes: int) -> Iterator[Any]:
        while passes == self.passes:
            item = self._held.popleft() if self._held else self._next()
            if item is _END:
                return
            self.position += 1
            last = (self.participation.real or 0) - 1
            for old in [p for p in self._states if p < self.position - 2 and p != last]:
                del self._states[old]  # a checkpoint saves one of the last ones, or the last real one
            yield item

    def _next(self) -> Any:
        item = next(self._source, _END)
        if item is not _END:
            if self.count is not None:
                replay = self.participation.replay(self._fetched)
                counts = self.count(item)
                self._counts.append(Counts((0.0,) * len(counts.values)) if replay else counts)
            self._fetched += 1
        return item

    def _produce(self, iterator: Iterator[Any], start: int, at: int) -> Iterator[Any]:
        # A sized loader tells its real batches and is read no earlier than asked (its state stays the state of what
        # was consumed); an unsized one is read one batch ahead, to know its last before it is used.
        state, local = self.participation, self.participation.real
        seen, template, drain = at, _END, start > 0 and self.loader_state is not None
        while seen < start and (local is None or seen < local):  # what was trained: skipped, the last one kept
            skipped = next(iterator, _END)
            if skipped is _END:
                break
            seen, template = seen + 1, skipped

        def fetch() -> Any:
            nonlocal seen, drain
            item: Any = _END
            if local is None or seen < local:
                if self.loader_state is not None:
                    self._states[seen] = copy.deepcopy(self.loader_state())
                item = next(iterator, _END)
            # a loader put back mid-epoch is read to its end as an uninterrupted epoch reads it, before its last
            # real batch is handed out: Lightning asks for no batch after a sized loader's last
            if drain and (item is _END or (local is not None and seen + 1 >= local)):
                next(iterator, None)
                drain = False
            if item is _END:
                state.real = seen
            return item

        following = fetch()
        template = following if following is not _END else template
        template = _shared(template, self.shared_first or start > 0, self.device)
        yielded = start
        while self.longest is None or yielded < self.longest:
            if self.longest is None and not self.windows and not any(_gather(int(following is not _END), self.device)):
                return  # no rank has a batch left: the epoch ends here on every rank
            if following is _END:
                if template is _END:
                    return  # no rank has a batch this epoch
                item = template
            else:
                item = template = following
                seen += 1
                following = None if local is not None else fetch()
            yielded += 1
            yield item
            if following is None:
                following = fetch()


def participating(
    loader: Any,
    participation: Participation,
    device: torch.device,
    windows: bool = True,
    lengths: list[int] | None = None,
    always: bool = False,
) -> tuple[Any, EpochBatches | None]:
    """The rank's loader, made to keep yielding until every rank is done where ranks hold unequal data.

    A loader as long on every rank is returned as it is (unless ``always``); a sized one reports the longest rank's
    length. ``windows``, ``lengths``: as for :class:`EpochBatches` and :func:`lengths_of`. Returns the loader and its
    :class:`EpochBatches` (``None``: left as it is).
    """
    lengths = lengths_of(loader, device) if lengths is None else lengths
    local = lengths[dist.get_rank() if dist.is_initialized() else 0]
    sized = all(n >= 0 for n in lengths)
    if sized and len(set(lengths)) == 1 and not always:
        return loader, None
    if participation.policy == "strict" and sized and len(set(lengths)) > 1:
        raise ValueError(_strict_message("in their dataloaders", lengths))
    participation.replays = not sized or len(set(lengths)) > 1
    longest = max(lengths) if sized else None
    stage = EpochBatches(participation, longest, local if local >= 0 else None, device, min(lengths) <= 0, windows)
    return extend(loader, stage.iterate, None if longest is None else lambda: longest), stage


def lengths_of(loader: Any, device: torch.device) -> list[int]:
    """Every rank's number of batches in its ``loader`` (-1 for a loader without a length): one all-reduce."""
    try:
        local = len(loader)
    except (TypeError, NotImplementedError):
        local = -1
    return _gather(local, device)


def combined_lengths(mode: str, lengths: list[list[int]]) -> list[int] | None:
    """Every rank's number of combined batches of a ``CombinedLoader`` in ``mode``; ``None`` if one is unsized.

    ``lengths``: per loader, each rank's number of batches (-1: none).

    Example::

        >>> combined_lengths("max_size_cycle", [[2, 1], [4, 4]]), combined_lengths("min_size", [[2, 1], [4, 4]])
        ([4, 4], [2, 1])
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


def _gather(local: int, device: torch.device, group: dist.ProcessGroup | None = None) -> list[int]:
    """Every rank's ``local``, by one SUM all-reduce of a group-size vector."""
    if not dist.is_initialized():
        return [local]
    vector = torch.zeros(dist.get_world_size(group), dtype=torch.float64, device=device)
    vector[dist.get_rank(group)] = local
    dist.all_reduce(vector, group=group)
    return [round(v) for v in vector.tolist()]


def _shared(template: Any, needed: bool, device: torch.device) -> Any:
    """A real batch to replay for a rank that holds none (a collective only where one may lack it)."""
    if not needed or not dist.is_initialized():
        return template
    missing = _gather(int(template is _END), device)
    if not any(missing) or all(missing):
        return template
    box = [template if dist.get_rank() == missing.index(0) else None]
    dist.broadcast_object_list(box, src=missing.index(0))
    return box[0] if template is _END else template


def _listed(counts: list[int]) -> str:
    return ", ".join(f"rank {r}: {'?' if n < 0 else n}" for r, n in enumerate(counts))


def _strict_message(where: str, counts: list[int]) -> str:
    return (
        f"participation='strict' needs every rank to hold the same number of batches, but they differ {where}"
        f" ({_listed(counts)}). Even out the shards, or use participation='pad' to let exhausted ranks contribute"
        " zero."
    )
