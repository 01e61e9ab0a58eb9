"""Counts ahead: every train batch counted on the host as the loader yields it, a window's batches fetched early.

When a :class:`BatchCounter` (such as :class:`~lightning_weighted.ItemCounter`) says how to count a batch, the
strategy counts each batch where the loader hands it out, before Lightning moves it to the device, and fetches the
batches of the next accumulation window before that window's first forward. The window's counts are then summed
over the ranks before any of its losses needs them (see :class:`~lightning_weighted.window.LossScale`), and no
count is ever read back from the device.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from itertools import islice
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

from lightning_weighted._counts import Count, read_count
from lightning_weighted.participation import Participation

__all__ = ["BatchCounter", "Lookahead"]

_END = object()


@runtime_checkable
class BatchCounter(Protocol):
    """Counts a batch's items from the batch itself, on the host (what :class:`~lightning_weighted.ItemCounter` does).

    Attributes:
        integer: whether counts must be whole numbers (examples, tokens).
    """

    integer: bool

    def count_of(self, batch: Any) -> int | float | Tensor:
        """The number of valid items of ``batch`` (or the sum of its sample weights)."""


class Lookahead:
    """The train loader's iteration, counting each batch as it is fetched and fetching a window's batches early.

    Counts are kept in the order Lightning trains the batches: :meth:`advance` hands out the count of the batch
    about to be trained, :meth:`ahead` the counts of the batches after it, fetching them from the loader now (they
    are held, on the host, until Lightning asks for them). A batch an exhausted rank replays counts 0.

    Args:
        counter: how to count a batch.
        participation: the rank's epoch, which knows which batches are replays.

    Example::

        >>> from types import SimpleNamespace
        >>> ahead = Lookahead(SimpleNamespace(count_of=len, integer=True), Participation())
        >>> batches = ahead.iterate(iter([[1], [1, 2], [1, 2, 3]]))
        >>> next(batches)  # Lightning fetches the first batch ...
        [1]
        >>> ahead.advance().value, [count.value for count in ahead.ahead(2)]  # ... trains it, looks ahead
        (1.0, [2.0, 3.0])
        >>> list(batches)  # the batches fetched early still come in order
        [[1, 2], [1, 2, 3]]
    """

    def __init__(self, counter: BatchCounter, participation: Participation) -> None:
        self.counter, self.participation = counter, participation
        self.epoch = 0  # how many times the loader was iterated: a plan of an earlier iteration is stale
        self._source: Iterator[Any] = iter(())
        self._held: deque[Any] = deque()  # batches fetched early, not yet handed to Lightning
        self._counts: deque[Count] = deque()  # counts of the batches fetched and not yet trained
        self._fetched = 0

    def iterate(self, iterator: Iterator[Any]) -> Iterator[Any]:
        """The batches of one pass over the loader (a stage of :func:`lightning_weighted._loader.extend`)."""
        self.epoch += 1
        self._source, self._fetched = iterator, 0
        self._held.clear()
        self._counts.clear()
        return self._batches(self.epoch)

    def _batches(self, epoch: int) -> Iterator[Any]:
        while epoch == self.epoch:
            item = self._held.popleft() if self._held else self._fetch()
            if item is _END:
                return
            yield item

    def advance(self) -> Count:
        """The count of the batch Lightning is about to train (the oldest one fetched and not trained yet)."""
        return self._counts.popleft()

    def ahead(self, size: int) -> list[Count]:
        """The counts of the ``size`` batches after the current one (fewer where the loader ends), fetched now."""
        while len(self._counts) < size:
            item = self._fetch()
            if item is _END:
                break
            self._held.append(item)
        return list(islice(self._counts, size))

    def _fetch(self) -> Any:
        item = next(self._source, _END)
        if item is not _END:
            real = self.participation.real
            replay = real is not None and self._fetched >= real  # known by then: the replays look one batch ahead
            self._counts.append(Count(0.0) if replay else Count(*read_count(*self._count_of(item))))
            self._fetched += 1
        return item

    def _count_of(self, batch: Any) -> tuple[object, bool]:
        return self.counter.count_of(batch), self.counter.integer
