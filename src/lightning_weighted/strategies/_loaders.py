"""The loaders of a weighted fit: samplers that repeat no item, replays for uneven ranks, the train lookahead."""

from __future__ import annotations

from typing import Any

import torch

from lightning_weighted._loader import extend, restore, retract
from lightning_weighted.lookahead import Lookahead
from lightning_weighted.participation import Participation, participating, release, without_padding

__all__ = ["LOADER_BARRIERS", "FitLoaders"]

# Lightning names the barrier it passes right before processing a dataloader after that dataloader's hook.
LOADER_BARRIERS = {"train_dataloader()": "train", "val_dataloader()": "val", "test_dataloader()": "test"}


class FitLoaders:
    """What the strategy does to each loader Lightning builds, and undoes when the fit ends.

    Args:
        participation: the rank's epoch, which replays where ranks hold unequal data.
        lookahead: counts each train batch on the host and fetches windows early, where counts are taken ahead.
    """

    def __init__(self, participation: Participation, lookahead: Lookahead | None = None) -> None:
        self.participation, self.lookahead = participation, lookahead
        self.stage = ""  # the loaders Lightning is processing now: "train", "val", "test" or ""
        self.ahead = False  # once training runs with counts ahead, its loader must stay alone
        self._extended: list[Any] = []

    def at_barrier(self, name: str | None) -> None:
        """Notes which loaders come next (Lightning passes a named barrier before it processes them)."""
        self.stage = LOADER_BARRIERS.get(name or "", "")
        if self.stage == "train":
            self.release()  # the train loaders are set up anew

    def process(self, loader: Any, device: torch.device, strategy_name: str) -> Any:
        """The loader as the weighted fit uses it (Lightning processes each loader of a CombinedLoader in turn)."""
        if not self.stage:
            return loader
        loader = without_padding(loader)
        if self.stage != "train":
            return loader
        loader = participating(loader, self.participation, device)
        if self.lookahead is not None:
            if self.ahead and self.participation.loaders > 1:
                raise ValueError(
                    f"{strategy_name} counts each window's batches ahead (ItemCounter) in one train dataloader, but"
                    " the reloaded train dataloaders are several. Keep one train dataloader, or return the count from"
                    " training_step instead of using ItemCounter."
                )
            if self.participation.loaders == 1:
                loader = extend(loader, self.lookahead.iterate)
            elif self._extended:  # several loaders: their batch is whole only once Lightning combines them
                retract(self._extended[0], self.lookahead.iterate)
        self._extended.append(loader)
        return loader

    def alone(self, iterables: Any) -> bool:
        """Whether Lightning's train ``iterables`` are one loader, whose batches are whole as it yields them.

        Not so for several loaders, nor for one inside a dict or list: Lightning builds their batch as it combines.
        """
        return self.participation.loaders == 1 and bool(self._extended) and iterables is self._extended[-1]

    def release(self) -> None:
        """Gives back every loader this fit extended."""
        loaders, self._extended = self._extended, []
        release(self.participation)
        for loader in loaders:
            restore(loader)
