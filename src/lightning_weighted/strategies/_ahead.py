"""The Trainer adapter's windows when their counts are taken from the batches ahead (see :mod:`..lookahead`).

Each window is planned before its first forward: an epoch's first window at its first batch, with its counts
summed there and then (one float64 all-reduce per epoch); every later one at the syncing microbatch of the window
before it, whose handover (:class:`~lightning_weighted._counts.Handover`) brings its ``N`` back with the gradients.
So every factor :math:`P n / N` is a number on the host before the microbatch's forward.
"""

from __future__ import annotations

from collections.abc import Callable

from lightning_weighted._counts import Count, Handover, settled
from lightning_weighted.lookahead import BatchCounter, Lookahead
from lightning_weighted.participation import Participation
from lightning_weighted.window import LossScale, Window

__all__ = ["WindowsAhead"]


class WindowsAhead:
    """The window in progress, the one after it, and the planned count of the batch in progress.

    Args:
        counter: how a batch is counted on the host.
        participation: the rank's epoch (which batches are replays).
        ranks: the ranks the counts are summed over, and the gradients averaged over.
    """

    def __init__(self, counter: BatchCounter, participation: Participation, ranks: int) -> None:
        self.lookahead = Lookahead(counter, participation)
        self.ranks = ranks
        self.window: Window | None = None  # in progress; its N received
        self.following: Window | None = None  # planned at the syncing microbatch of `window`
        self.count = Count(0.0)  # the planned count of the batch in progress
        self._epoch = 0  # the loader pass `window` belongs to

    def begin_batch(self, size: int, sum_now: Callable[[float], float]) -> Window:
        """Takes the count of the batch about to be trained; returns its window.

        Args:
            size: the number of batches of the window that would start with this batch.
            sum_now: the SUM over the ranks of a window's items, on the host (at an epoch's first window).
        """
        self.count = self.lookahead.advance()
        if self.window is None or self._epoch != self.lookahead.epoch:
            window = Window(LossScale.GLOBAL_MEAN)
            window.plan([self.count, *self.lookahead.ahead(size - 1)])
            window.receive(sum_now(window.items), self.ranks)
            self.window, self.following, self._epoch = window, None, self.lookahead.epoch
        return self.window

    def plan_following(self, size: int) -> float:
        """Plans the ``size`` batches after the one in progress as the next window; returns their items."""
        counts = self.lookahead.ahead(size) if size > 0 else []
        self.following = Window(LossScale.GLOBAL_MEAN) if counts else None
        if self.following is None:
            return 0.0
        self.following.plan(counts)
        return self.following.items

    def end_window(self, summed: list[float]) -> tuple[Window, list[float]]:
        """The window in progress and its summed payload (indexed by ``Slot``) from the SUM of the handovers at its end.

        The next window becomes the one in progress, with its ``N``.
        """
        window = self.window
        assert window is not None and window.total is not None
        if self.following is not None:
            self.following.receive(summed[Handover.ITEMS], self.ranks)
        self.window, self.following = self.following, None
        return window, settled(window.total, summed)
