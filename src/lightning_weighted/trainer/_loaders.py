"""The loaders of a weighted Trainer run: each as Lightning built it, sharded without padding, kept in step."""

from __future__ import annotations

from typing import Any

import torch

from lightning_weighted._compat import LOADER_BARRIERS, extend, own_state, restore
from lightning_weighted.ahead import Lookahead
from lightning_weighted.data import Participation, Policy, participating, without_padding

__all__ = ["FitLoaders"]


class FitLoaders:
    """What the strategy does to each loader Lightning builds (train, val, test), and undoes when the fit ends.

    Lightning names the barrier it passes right before it processes a stage's loaders, which says which stage the
    loaders handed to ``process_dataloader`` belong to. A loader whose ranks hold different numbers of batches
    replays (:func:`~lightning_weighted.data.participating`); the train loader also counts its batches ahead where a
    :class:`~lightning_weighted.data.Lookahead` is given.

    Args:
        policy: what a rank whose data ran out does (``"pad"`` or ``"strict"``).
        device: where the ranks' lengths are summed.
    """

    def __init__(self, policy: Policy, device: torch.device) -> None:
        self.policy, self.device = policy, device
        self.train = Participation(policy)  # the train loader's epoch (one, for the loaders a CombinedLoader holds)
        self.evaluation: dict[str, list[Participation]] = {"val": [], "test": []}  # one per evaluation loader
        self.lookahead: Lookahead | None = None
        self.train_loaders: list[Any] = []
        self._stage = ""
        self._extended: list[Any] = []

    def at_barrier(self, name: str | None) -> None:
        """Notes which stage's loaders come next; its earlier loaders are given back (they are set up anew)."""
        self._stage = LOADER_BARRIERS.get(name or "", "")
        if self._stage == "train":
            self.release(self.train_loaders)
            self.train_loaders, self.train.replays = [], False
        elif self._stage:
            self.evaluation[self._stage] = []

    def process(self, loader: Any, counts_ahead: bool) -> Any:
        """The loader as the weighted run uses it (Lightning processes each loader of a CombinedLoader in turn)."""
        if not self._stage:
            return loader  # a predict loader: Lightning's own sampler already shards without repeats
        loader = without_padding(loader)
        if self._stage != "train":
            participation = Participation(self.policy)
            self.evaluation[self._stage].append(participation)
            return self._kept(participating(loader, participation, self.device, windows=False))
        several = bool(self.train_loaders)
        if several and self.train.replays:  # the first loader replays, and combined batches would mix replays in
            participating(self.train_loaders[0], self.train, self.device, several=True)
        loader = participating(loader, self.train, self.device, several=several)
        if self.lookahead is not None:
            if counts_ahead and several:
                raise ValueError(
                    "ItemCounter counts each window's batches ahead in one train dataloader, but the reloaded train"
                    " dataloaders are several. Keep one train dataloader, or return the count from training_step"
                    " instead of using ItemCounter."
                )
            if several:
                self.retract(self.train_loaders[0])
            else:
                loader = extend(loader, self.lookahead.iterate)
                self.lookahead.loader_state = own_state(loader)
                loader._lw.state = self.lookahead.state  # a checkpoint saves the state of what was trained
        self.train_loaders.append(self._kept(loader))
        return loader

    def alone(self, iterables: Any) -> bool:
        """Whether Lightning's train ``iterables`` are one loader, whose batches are whole as it yields them."""
        return len(self.train_loaders) == 1 and iterables is self.train_loaders[0]

    def retract(self, loader: Any) -> None:
        """Takes the lookahead out of a loader's iteration again (before it is iterated)."""
        extension = getattr(loader, "_lw", None)
        if self.lookahead is not None and extension is not None and self.lookahead.iterate in extension.stages:
            extension.stages.remove(self.lookahead.iterate)
            extension.state = None

    def release(self, loaders: list[Any] | None = None) -> None:
        """Gives back the loaders this run extended (all of them by default)."""
        for loader in list(self._extended if loaders is None else loaders):
            if loader in self._extended:
                self._extended.remove(loader)
            restore(loader)

    def _kept(self, loader: Any) -> Any:
        if hasattr(loader, "_lw") and loader not in self._extended:
            self._extended.append(loader)
        return loader
