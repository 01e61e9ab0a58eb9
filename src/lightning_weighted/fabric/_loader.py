"""Loaders set up by a weighted Fabric strategy: the rules of :mod:`lightning_weighted.participation` in a Fabric loop.

No Trainer hook marks each batch there, so the loader does: its position, and whether it is a replay.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from lightning_weighted.participation import Participation

__all__ = ["FabricLoader"]


class _Stepping(Protocol):
    """The strategy side of a :class:`FabricLoader`."""

    backwards: int

    def begin_batch(self, participation: Participation | None, replay: bool) -> None:
        """Takes note of the batch about to be yielded (``None``: the loader is done)."""


class FabricLoader:
    """Yields a rank's batches until every rank is done; an exhausted rank replays a batch, counted as 0.

    ``fabric.setup_dataloaders`` returns it (inside Fabric's own wrapper) under a weighted strategy where the ranks'
    batch counts differ. Each batch it yields is marked with its position, and the strategy learns whether it is a
    replay (``padding_step``). An epoch ends where :func:`~lightning_weighted.participation.participating` says: a
    sized loader after the longest rank's last batch; an unsized one at the first window end where no rank has data
    left, or, in a loop that runs no backward between its batches (evaluation), where this rank's own data ends, as
    with plain Fabric. Attributes (``sampler``, ``batch_sampler``, ...) are the wrapped loader's, so Fabric's
    ``set_epoch`` calls reach its sampler.
    """

    def __init__(self, loader: Any, participation: Participation, strategy: _Stepping) -> None:
        self.loader = loader
        self.participation = participation
        self.strategy = strategy
        try:
            self.sized = len(loader) >= 0
        except (TypeError, NotImplementedError):
            self.sized = False

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        loader = self.__dict__.get("loader")
        if loader is None:
            raise AttributeError(name)
        return getattr(loader, name)

    def __iter__(self) -> Iterator[Any]:
        state = self.participation
        backwards = -1  # the strategy's backward count when the previous batch was yielded
        try:
            for index, batch in enumerate(self.loader):
                if state.stop:
                    return  # every rank is out of data: the window that ended says so on every rank
                replay = state.begin_batch(index)
                if replay and not self.sized and self.strategy.backwards == backwards:
                    return  # an unsized loader in a loop without backward (evaluation): no window ends its epoch
                self.strategy.begin_batch(state, replay)
                backwards = self.strategy.backwards
                yield batch
        finally:
            self.strategy.begin_batch(None, replay=False)
