"""One rank's pass over one loader: its real batches, then replays until every rank is done; counted; resumable.

A rank whose data runs out replays its last real batch (a peer's first if it had none) with a count of 0: its
collectives stay matched and it adds nothing (:meth:`Participation.replay`). Every rank's epoch ends at the same step:
after the longest rank's last batch or, unsized, at the first window end where no rank has a real batch left. A
checkpoint keeps each rank's place and its loader's state before its first untrained batch (:meth:`EpochBatches.place`).
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Any, Literal

import torch
import torch.distributed as dist

from lightning_weighted.count import Counts
from lightning_weighted.loaders.extension import extend, own_length, own_state

__all__ = ["EpochBatches", "Participation", "Pass", "Policy", "combined_lengths", "lengths_of", "staged"]

Policy = Literal["pad", "strict"]
_END = object()


class Participation:
    """One rank's view of one loader's epoch: ``"pad"`` replays exhausted ranks with count 0, ``"strict"`` raises."""

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


@dataclass(frozen=True)
class Pass:
    """Where one pass over a rank's loader starts and ends, in positions of the epoch (its batches, then replays)."""

    start: int = 0  # the first position handed out (past 0 where the pass resumes mid-epoch)
    first: int = 0  # the position of the loader's first batch; those before `start` trained already (skipped)
    real: int | None = None  # the position after this rank's last real batch (None: unsized, found at its end)
    longest: int | None = None  # the positions of the epoch on the longest rank (None: unsized)


class EpochBatches:
    """Yields a rank's batches of each pass, then replays until every rank is done (see the module docstring).

    ``lengths``: every rank's number of batches of a pass from the start (-1: unsized). ``windows``: windows end an
    unsized epoch (training); else a one-value all-reduce before each batch does.
    """

    def __init__(
        self, participation: Participation, lengths: list[int], device: torch.device, windows: bool = True
    ) -> None:
        self.participation, self.device, self.windows = participation, device, windows
        self.relength: Callable[[], list[int]] | None = None  # every rank's length asked again (one collective)
        self.count: Callable[[Any], Counts] | None = None  # counts ahead: each part's count, taken as fetched
        self.loader_state: Callable[[], dict[str, Any]] | None = None  # the loader's own `state_dict`, if any
        self.on_length: Callable[[int], None] | None = None  # told a pass's length where it differs from the last's
        self.lengths = lengths  # every rank's, as first gathered
        self.current = self._whole = self._fresh(lengths)  # the pass in progress; a pass from the epoch's start
        self.position = self.passes = 0  # the position of the next batch handed out; the passes begun
        self._resumed: tuple[Pass, dict[str, Any] | None] | None = None
        self._source: Iterator[Any] = iter(())
        self._held: deque[Any] = deque()  # batches fetched early, in order
        self._counts: deque[Counts] = deque()  # counts of the batches fetched and not planned yet
        self._fetched = 0
        self._states: dict[int, dict[str, Any]] = {}  # the loader's state before the real batch at each position

    @property
    def longest(self) -> int | None:
        """The positions of the epoch in progress on the longest rank (``None``: unsized)."""
        return self.current.longest

    def resume(self, resumed: Pass, loaded: dict[str, Any] | None = None) -> None:
        """Starts the next pass where ``resumed`` says, the loader put back to ``loaded`` (before ``resumed.first``)."""
        self._resumed = (resumed, loaded)
        self.current = resumed

    def iterate(self, iterator: Iterator[Any]) -> Iterator[Any]:
        """The batches of one pass, which starts as Lightning asks for the iterator (a stage of ``extend``)."""
        if self._resumed is not None:
            (current, loaded), self._resumed = self._resumed, None
        else:
            if self.relength is not None and self.passes and self.current.start > 0:  # after a resumed pass
                self._whole = self._fresh(self.relength())
            current, loaded = self._whole, None
            if current.longest not in (None, self.current.longest) and self.on_length is not None:
                self.on_length(current.longest)
        self.current, self.passes = current, self.passes + 1
        self.participation.new_epoch(current.real)
        self.position = self._fetched = current.start
        self._held, self._counts = deque(), deque()
        self._states = {current.first: copy.deepcopy(loaded)} if loaded is not None else {}
        self._source = self._produce(iterator, current)
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

    def place(self, trained: int, last: bool) -> dict[str, Any]:
        """This rank's place for a checkpoint, once ``trained`` positions of the pass trained (``last``: all of them).

        ``at`` is the position its ``loader`` state stands before: the first untrained real batch, or, on a rank that
        replays, its last real one (which its resumed pass replays); at the epoch's end, the loader's state after it.
        """
        real = self.participation.real
        at = trained if last or real is None or trained < real else max(real - 1, self.current.first)
        loader = None
        if self.loader_state is not None:
            saved = None if last else self._states.get(at)
            loader = saved if saved is not None else copy.deepcopy(self.loader_state())
        return {"position": trained, "real": real, "at": at, "loader": loader}

    def state_before(self, position: int) -> dict[str, Any] | None:
        """The loader's own state before the batch at ``position``, where it was fetched already."""
        return self._states.get(position)

    def _fresh(self, lengths: list[int]) -> Pass:
        self.shared_first = min(lengths) <= 0  # some rank may hold no batch and replay a peer's first
        local = lengths[dist.get_rank() if dist.is_initialized() else 0]
        sized = all(n >= 0 for n in lengths)
        return Pass(0, 0, local if local >= 0 else None, max(lengths) if sized else None)

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

    def _produce(self, iterator: Iterator[Any], current: Pass) -> Iterator[Any]:
        # A sized loader tells its real batches and is read no earlier than asked (its state stays the state of what
        # was consumed); an unsized one is read one batch ahead, to know its last before it is used.
        state, real, longest = self.participation, current.real, current.longest
        read = current.first  # the position of the loader's next batch

        def fetch() -> Any:
            nonlocal read
            if real is not None and read >= real:
                return _END
            item = next(iterator, _END)
            if item is _END:
                state.real = read
                return _END
            read += 1
            if read == real:  # read to its end, as an uninterrupted epoch is: its state is the finished one
                next(iterator, None)
            if self.loader_state is not None:  # never before the pass's first batch: a loaded state is pending
                self._states[read] = copy.deepcopy(self.loader_state())
            return item

        template: Any = _END
        while read < current.start:  # what was trained: skipped, the last one kept to replay
            skipped = fetch()
            if skipped is _END:
                break
            template = skipped
        following = fetch()
        template = following if following is not _END else template
        template = _shared(template, self.shared_first or current.start > 0, self.device)
        yielded = current.start
        while longest is None or yielded < longest:
            if longest is None and not self.windows and not any(_gather(int(following is not _END), self.device)):
                return  # no rank has a batch left: the epoch ends here on every rank
            if following is _END:
                if template is _END:
                    return  # no rank has a batch this epoch
                item = template
            else:
                item = template = following
                following = None if real is not None else fetch()
            yielded += 1
            yield item
            if following is None:
                following = fetch()


def staged(
    loader: Any, participation: Participation, device: torch.device, windows: bool = True
) -> tuple[Any, EpochBatches]:
    """Extends ``loader`` to yield until every rank is done; returns it and the :class:`EpochBatches` of its passes.

    An iterable that is no ``DataLoader`` comes back wrapped. A sized loader reports the longest rank's length.
    """
    lengths = lengths_of(loader, device)
    sized = all(n >= 0 for n in lengths)
    if participation.policy == "strict" and sized and len(set(lengths)) > 1:
        raise ValueError(_strict_message("in their dataloaders", lengths))
    participation.replays = not sized or len(set(lengths)) > 1
    stage = EpochBatches(participation, lengths, device, windows)
    stage.relength = lambda: lengths_of(loader, device, own_length)  # at the pass after a resumed one
    loader = extend(loader, stage.iterate, lambda: stage.longest)
    stage.loader_state = own_state(loader)
    return loader, stage


def lengths_of(loader: Any, device: torch.device, length: Callable[[Any], int] = len) -> list[int]:
    """Every rank's number of batches in its ``loader``, read by ``length`` (-1: it has none): one all-reduce."""
    try:
        local = length(loader)
    except (TypeError, NotImplementedError):
        local = -1
    return _gather(local, device)


def combined_lengths(mode: str, lengths: list[list[int]]) -> list[int] | None:
    """Every rank's number of combined batches of a ``CombinedLoader`` in ``mode``; ``None`` if one is unsized.

    ``lengths``: per loader, each rank's number of batches (-1: none). Example::

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
