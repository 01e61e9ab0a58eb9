"""Counts ahead: each train batch counted on the host as the loader yields it, each window planned from them.

Where :class:`~lightning_weighted.ItemCounter` says how to count a batch, :class:`Lookahead` counts each train batch
on the host as the loader yields it, before it reaches the device, and fetches a window's batches before its first
forward; :class:`Planner` hands the loop each window's counts before that forward (see
:mod:`lightning_weighted.loop`). A checkpoint still saves the state of what was trained: the loader's state from
before the oldest batch fetched early.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_weighted.counts import Count, Problem, read_count
from lightning_weighted.data import Participation

__all__ = ["Lookahead", "Planner", "summed"]

_END = object()


class Lookahead:
    """A train loader's iteration that counts each batch as it is fetched and fetches a window's batches early.

    Counts are kept in the order Lightning trains the batches: :meth:`take` hands out the counts of the next window's
    batches, :meth:`peek` shows those of the window after it, fetching them now (they are held, on the host, until
    Lightning asks for them). A batch an exhausted rank replays counts 0. :meth:`state` is the loader's
    state before the oldest batch still held, the state of what was trained.

    Args:
        count: how to count a batch: ``count(batch)``, an int, a float or a tensor in host memory.
        integer: whether counts must be whole numbers (examples, tokens).
        participation: the loader's epoch, which knows which batches are replays.
        loader_state: the loader's ``state_dict`` (a ``StatefulDataLoader``'s), or ``None``.

    Example::

        >>> ahead = Lookahead(len, True, Participation())
        >>> batches = ahead.iterate(iter([[1], [1, 2], [1, 2, 3]]))
        >>> next(batches)  # Lightning fetches the first batch ...
        [1]
        >>> [count.value for count in ahead.take(2)], [count.value for count in ahead.peek(1)]  # ... its window's
        ([1.0, 2.0], [3.0])
        >>> list(batches)  # the batches fetched early still come in order
        [[1, 2], [1, 2, 3]]
    """

    def __init__(
        self,
        count: Callable[[Any], object],
        integer: bool,
        participation: Participation,
        loader_state: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.count, self.integer, self.participation, self.loader_state = count, integer, participation, loader_state
        self.epoch = 0  # how many times the loader was iterated: a plan of an earlier pass is stale
        self._source: Iterator[Any] = iter(())
        self._held: deque[tuple[Any, dict[str, Any] | None]] = deque()  # fetched early, with the state before it
        self._counts: deque[Count] = deque()  # counts of the batches fetched and not trained yet
        self._fetched = 0

    def iterate(self, iterator: Iterator[Any]) -> Iterator[Any]:
        """The batches of one pass over the loader (a stage of :func:`lightning_weighted._compat.extend`)."""
        self.epoch += 1
        self._source, self._fetched = iterator, 0
        self._held.clear()
        self._counts.clear()
        return self._batches(self.epoch)

    def _batches(self, epoch: int) -> Iterator[Any]:
        while epoch == self.epoch:
            item = self._held.popleft()[0] if self._held else self._fetch()
            if item is _END:
                return
            yield item

    def take(self, size: int) -> list[Count]:
        """The counts of the ``size`` batches Lightning trains next (fewer where the loader ends), fetching them now."""
        counts = self.peek(size)
        for _ in counts:
            self._counts.popleft()
        return counts

    def peek(self, size: int) -> list[Count]:
        """The counts of the ``size`` batches after those taken (fewer where the loader ends), fetching them now."""
        while len(self._counts) < size:
            state = self.loader_state() if self.loader_state is not None else None
            item = self._fetch()
            if item is _END:
                break
            self._held.append((item, state))
        return list(islice(self._counts, size))

    def state(self) -> dict[str, Any] | None:
        """The loader's state before the oldest batch fetched early and not yet handed out (``None``: none held)."""
        return self._held[0][1] if self._held else None

    def _fetch(self) -> Any:
        item = next(self._source, _END)
        if item is not _END:
            real = self.participation.real
            replay = real is not None and self._fetched >= real
            self._counts.append(Count(0.0) if replay else read_count(self.count(item), self.integer, host=True))
            self._fetched += 1
        return item


class Planner:
    """The counts of each window of the train loader, taken by a :class:`Lookahead` before the window's first forward.

    The loop plans each window from them (:meth:`lightning_weighted.loop.WindowLoop.plan`): its :math:`N` is summed
    then, at an epoch's first window, and carried by the exchange of the window before it for every later one.

    Args:
        lookahead: the train loader's lookahead.
        size_at: how many batches the window that would start at a given ``batch_idx`` holds.
    """

    def __init__(self, lookahead: Lookahead, size_at: Callable[[int], int]) -> None:
        self.lookahead, self.size_at = lookahead, size_at
        self._next: tuple[int, int] = (0, 0)  # the loader pass and the size of the window after the one in progress
        self._received: tuple[int, int, float] | None = None  # the same, with its N, once the exchange brought it

    def window(self, batch_idx: int) -> tuple[list[Count], float | None]:
        """The counts of the window starting at ``batch_idx``, and its ``N`` where an exchange brought it already."""
        counts = self.lookahead.take(self.size_at(batch_idx))
        received, self._received = self._received, None
        planned = received is not None and received[:2] == (self.lookahead.epoch, len(counts))
        return counts, received[2] if planned and received is not None else None

    def following(self, batch_idx: int) -> float:
        """This rank's items in the window starting at ``batch_idx``, the next one (its batches fetched now)."""
        size = self.size_at(batch_idx)
        counts = self.lookahead.peek(size) if size > 0 else []
        self._next = (self.lookahead.epoch, len(counts))
        return _items(counts)

    def received(self, total: float) -> None:
        """Takes the next window's ``N`` from the exchange that ended the window in progress."""
        self._received = (*self._next, total) if self._next[1] else None


def summed(counts: Iterable[Count], device: torch.device, group: dist.ProcessGroup | None) -> Tensor:
    """The SUM over ``group`` of every rank's valid ``counts``, left on the device.

    One all-reduce, waited on by the device's stream, not the host.
    """
    total = torch.zeros(1, dtype=torch.float64, device=device)
    for count in counts:
        if isinstance(count.problem, Problem):
            continue  # its problem is reported at the window's end, where the loop meets it
        if isinstance(count.problem, Tensor):  # a count on the device, checked there
            total += torch.where(count.problem == 0, count.value, 0.0)
        else:
            total += count.value
    dist.all_reduce(total, group=group)
    return total[0]


def _items(counts: Iterable[Count]) -> float:
    """The items of valid planned counts (a host count each)."""
    return sum(c.value for c in counts if c.problem is None and isinstance(c.value, float))
