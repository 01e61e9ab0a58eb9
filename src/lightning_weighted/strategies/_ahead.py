"""The Trainer adapter's windows when their counts are taken from the batches ahead (see :mod:`..lookahead`).

Each window is planned before its first forward. An epoch's first window is planned at its first batch and its
counts summed there by one float64 all-reduce, whose result stays on the device: its factors :math:`P n / N` (or
:math:`n / N` for a reduction that sums) are device tensors, and its ``N`` reaches the host with the read at its
end. Every later window is planned at the syncing microbatch of the window before it, whose handover
(:class:`~lightning_weighted._counts.Handover`) brings its ``N`` back with the gradients or in a float64 all-reduce
of its own: its factors are numbers on the host before its first forward. Nothing is read from the device but one
handover per optimizer step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

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
        divisor: what the engine's reduction divides the SUM of the gradients by: ``P``, the ranks the counts are
            summed over, where it averages (DDP); 1 where it sums (FSDP, as the sharded strategies configure it).
        size_at: how many batches the window that would start at a given ``batch_idx`` holds.
        start_sum: starts the SUM over the ranks of a float64 vector; returns it and the work to wait for.
    """

    def __init__(
        self,
        counter: BatchCounter,
        participation: Participation,
        divisor: int,
        size_at: Callable[[int], int],
        start_sum: Callable[[list[float]], tuple[Tensor, Any]],
    ) -> None:
        self.lookahead = Lookahead(counter, participation)
        self.divisor, self.size_at, self.start_sum = divisor, size_at, start_sum
        self.window: Window | None = None  # in progress; its N received
        self.following: Window | None = None  # planned at the syncing microbatch of `window`
        self.count = Count(0.0)  # the planned count of the batch in progress
        self._epoch = 0  # the loader pass `window` belongs to

    def begin_batch(self, batch_idx: int) -> Window:
        """Takes the count of the batch about to be trained; returns its window (planned now at an epoch's first)."""
        self.count = self.lookahead.advance()
        if self.window is None or self._epoch != self.lookahead.epoch:
            window = Window(LossScale.GLOBAL_MEAN)
            window.plan([self.count, *self.lookahead.ahead(self.size_at(batch_idx) - 1)])
            summed, work = self.start_sum([window.items])
            work.wait()  # on a GPU the stream waits, not the host
            window.receive(summed[0], self.divisor)
            self.window, self.following, self._epoch = window, None, self.lookahead.epoch
        return self.window

    def plan_following(self, batch_idx: int) -> float:
        """Plans the next window, from the batch after ``batch_idx``, at the syncing microbatch; returns its items."""
        size = self.size_at(batch_idx + 1)
        counts = self.lookahead.ahead(size) if size > 0 else []
        self.following = Window(LossScale.GLOBAL_MEAN) if counts else None
        if self.following is None:
            return 0.0
        self.following.plan(counts)
        return self.following.items

    def end_window(self, read: Callable[[Tensor | None], list[float]]) -> tuple[Window, list[float]]:
        """The window in progress and its summed payload (indexed by ``Slot``), after its last backward.

        Args:
            read: the SUM of every rank's handover, on the host, with the given device value appended (one read).

        The next window becomes the one in progress, with its ``N``.
        """
        window = self.window
        assert window is not None and window.total is not None
        on_device = window.total if isinstance(window.total, Tensor) else None
        summed = read(on_device)
        items = summed.pop() if on_device is not None else window.total
        assert isinstance(items, float)
        if self.following is not None:
            self.following.receive(summed[Handover.ITEMS], self.divisor)
        self.window, self.following = self.following, None
        return window, settled(items, summed)
