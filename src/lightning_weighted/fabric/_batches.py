"""The batches a loader set up by a weighted Fabric strategy yields: each rank stepping until every rank is done.

No Trainer hook marks each batch in a Fabric loop, so the loader does (:class:`FabricLoader`): its position, and
whether it is a replay; :class:`Yielded` keeps those of the batches not backpropagated yet in order, so that a loop
that fetches its window first (``count_ahead``) counts a replayed batch as 0.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

from lightning_weighted.data import Participation

__all__ = ["FabricLoader", "Yielded"]


class Yielded:
    """The batches the set-up loaders yielded and ``fabric.backward`` has not taken yet, oldest first.

    Attributes:
        participation: the epoch of the loader that yielded the last batch.
        padding: the last batch yielded is a replay.
        backwards: ``fabric.backward`` calls so far.
    """

    def __init__(self) -> None:
        self.participation: Participation | None = None
        self.padding = False
        self.backwards = 0
        self._replays: deque[bool] = deque()

    def begin_batch(self, participation: Participation | None, replay: bool) -> None:
        """Called by a set-up loader as it yields a batch (whether it is a replay), and with ``None`` at its end."""
        if participation is None:
            self.padding = False
            return
        if participation is not self.participation or participation.position == 0:
            self._replays.clear()  # a new pass over a loader: what an earlier one left (evaluation) goes
        self.participation, self.padding = participation, replay
        self._replays.append(replay)

    def backward(self) -> bool:
        """Takes the oldest batch yielded for a backward; returns whether it is a replay."""
        self.backwards += 1
        return self._replays.popleft() if self._replays else False

    def replays(self) -> list[bool]:
        """Whether each batch yielded and not backpropagated yet is a replay, oldest first."""
        return list(self._replays)


class FabricLoader:
    """Yields a rank's batches until every rank is done; an exhausted rank replays a batch, counted as 0.

    ``fabric.setup_dataloaders`` returns it (inside Fabric's own wrapper) under a weighted strategy where the ranks'
    batch counts differ. Each batch it yields is marked with its position, and the strategy learns whether it is a
    replay (``padding_step``). An epoch ends where :func:`~lightning_weighted.data.participating` says: a sized
    loader after the longest rank's last batch; an unsized one at the first window end where no rank has data
    left, or, in a loop that runs no backward between its batches (evaluation), where this rank's own data ends, as
    with plain Fabric. Attributes (``sampler``, ``batch_sampler``, ...) are the wrapped loader's, so Fabric's
    ``set_epoch`` calls reach its sampler.
    """

    def __init__(self, loader: Any, participation: Participation, yielded: Yielded) -> None:
        self.loader, self.participation, self.yielded = loader, participation, yielded
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
        state, yielded = self.participation, self.yielded
        backwards = -1  # the strategy's backward count when the previous batch was yielded
        try:
            for index, batch in enumerate(self.loader):
                if state.stop:
                    return  # every rank is out of data: the window that ended says so on every rank
                replay = state.begin_batch(index)
                if replay and not self.sized and yielded.backwards == backwards:
                    return  # an unsized loader in a loop without backward (evaluation): no window ends its epoch
                yielded.begin_batch(state, replay)
                backwards = yielded.backwards
                yield batch
        finally:
            yielded.begin_batch(None, replay=False)
