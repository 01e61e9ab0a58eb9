"""The batches a loader set up by a weighted Fabric strategy yields, each rank stepping until every rank is done.

No Trainer hook marks a batch in a Fabric loop, so the loader records in :class:`Yielded` whether each batch is a
replay: a backward belongs to the batch yielded last; a window counted ahead, to the last ones, as many as it counts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

from lightning_weighted.loaders import Participation


class Yielded:
    """The batches the set-up loaders yielded last, newest last: each one's loader, position and replay flag."""

    def __init__(self, size: int = 4096) -> None:
        self.batches: deque[tuple[Participation, int, bool]] = deque(maxlen=size)
        self.backwards = 0  # `fabric.backward` calls so far

    @property
    def replay(self) -> bool:
        """The batch yielded last replays a batch of a rank whose data ran out (it counts 0)."""
        return bool(self.batches) and self.batches[-1][2]

    def replays(self, size: int) -> list[bool]:
        """Whether each of the ``size`` batches yielded last is a replay, oldest first (``False`` before the oldest)."""
        replays = [replay for *_, replay in list(self.batches)[-size:]] if size else []
        return [False] * (size - len(replays)) + replays

    def last(self) -> tuple[Participation | None, int]:
        """The epoch of the loader that yielded last, and that batch's position in it."""
        return self.batches[-1][:2] if self.batches else (None, 0)


class FabricLoader:
    """What ``fabric.setup_dataloaders`` returns where the ranks' batch counts differ (see the module docstring).

    An epoch ends as :mod:`lightning_weighted.loaders.epoch` says, or, unsized in a loop without backward
    (evaluation), where this rank's data ends. Attributes are the wrapped loader's (Fabric's ``set_epoch`` reaches it).
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
        for position, batch in enumerate(self.loader):
            if state.stop:
                return  # every rank is out of data: the window that ended says so on every rank
            replay = state.replay(position)
            if replay and not self.sized and yielded.backwards == backwards:
                return  # an unsized loader in a loop without backward (evaluation): no window ends its epoch
            yielded.batches.append((state, position, replay))
            backwards = yielded.backwards
            yield batch
