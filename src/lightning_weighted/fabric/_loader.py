"""The loaders a weighted Fabric strategy sets up: each rank steps until every rank is done, and resumes in its place.

No Trainer hook marks a batch in a Fabric loop, so the loader records in :class:`Yielded` whether each batch is a
replay: a backward belongs to the batch yielded last; a window counted ahead, to the last ones, as many as it counts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from lightning_weighted._compat import set_sampler_epoch
from lightning_weighted.loaders import Participation, Policy, staged, without_padding
from lightning_weighted.loaders.epoch import lengths_of
from lightning_weighted.loaders.extension import extend, extension, own_length
from lightning_weighted.loaders.resume import FORMAT, KEY, Places, Resumed
from lightning_weighted.loaders.sampler import dealt_sampler


class Yielded:
    """The batches the set-up loaders yielded last, newest last: each one's loader, position and replay flag."""

    def __init__(self, size: int = 4096) -> None:
        self.batches: deque[tuple[Participation, int, bool]] = deque(maxlen=size)
        self.backwards = 0  # `fabric.backward` calls so far

    def replays(self, size: int) -> list[bool]:
        """Whether each of the ``size`` batches yielded last is a replay, oldest first (``False`` before the oldest)."""
        replays = [replay for *_, replay in list(self.batches)[-size:]] if size else []
        return [False] * (size - len(replays)) + replays

    def last(self) -> tuple[Participation | None, int, bool]:
        """The epoch of the loader that yielded last, that batch's position, whether it replays one (it counts 0)."""
        return self.batches[-1] if self.batches else (None, 0, False)


class FabricLoader:
    """What ``fabric.setup_dataloaders`` makes of one loader: its passes (:class:`EpochBatches`), marked as yielded.

    An epoch ends as :mod:`lightning_weighted.loaders.epoch` says, or, unsized in a loop without backward
    (evaluation), where this rank's data ends. The user's ``loader`` is extended, its attributes and class name kept;
    :meth:`place` and :meth:`resume` ride its own state (a ``StatefulDataLoader``'s, LitData's).
    """

    def __init__(self, loader: Any, policy: Policy, device: torch.device, yielded: Yielded) -> None:
        self.device, self.yielded, self.participation = device, yielded, Participation(policy)
        self.loader, self.stage = staged(without_padding(loader), self.participation, device)
        self.sized = all(n >= 0 for n in self.stage.lengths)
        extended = extension(extend(self.loader, self._marked))
        assert extended is not None
        extended.state, extended.load = self.place, self.resume
        self.places = Places(self.stage, self.loader)
        self._epochs_before = 0  # the epochs before this process's first pass (a resumed one's)

    def _marked(self, batches: Iterator[Any]) -> Iterator[Any]:
        state, yielded, backwards = self.participation, self.yielded, -1  # the backward count at the batch before
        for batch in batches:
            if state.stop:
                return  # every rank is out of data: the window that ended says so on every rank
            position = self.stage.position - 1
            replay = state.replay(position)
            if replay and not self.sized and yielded.backwards == backwards:
                return  # an unsized loader in a loop without backward (evaluation): no window ends its epoch
            yielded.batches.append((state, position, replay))
            backwards = yielded.backwards
            yield batch

    def place(self) -> dict[str, Any]:
        """The loader's state for ``fabric.save`` (a collective): rank 0's own, beside every rank's place."""
        stage = self.stage
        last = stage.longest is not None and stage.position >= stage.longest
        ranks = self.places.gathered(stage.position, last, self._epochs_before + max(stage.passes - 1, 0))
        mine = ranks[dist.get_rank() if dist.is_initialized() else 0] or {}
        return {**(mine["loader"] or {}), KEY: {"format": FORMAT, "ranks": ranks}}

    def resume(self, given: dict[str, Any]) -> dict[str, Any] | None:
        """What ``fabric.load`` puts back: this rank's place, and the loader state it loads (a collective)."""
        if KEY not in given:
            return given  # a state saved without places: the loader's own, as Fabric loads it
        first = next((place for place in given[KEY].get("ranks") or [] if isinstance(place, dict)), {})
        progress = (int(first.get("position", 0)), bool(first.get("last", True)))
        resumed = Resumed.read(given[KEY], progress, int(first.get("epoch", 0)))
        world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
        plan = resumed.plan(self.loader, world, rank) if resumed is not None else None
        if resumed is None or plan is None:
            return None
        sampler = dealt_sampler(self.loader)
        self._epochs_before = resumed.epoch  # Fabric numbers the epochs by its passes, from 0 in a resumed process
        if sampler is not None:
            sampler.epochs_before = resumed.epoch
        plan = self.places.resume(resumed, plan, lengths_of(self.loader, self.device, own_length))
        set_sampler_epoch(self.loader, 0)
        return plan.loaded
