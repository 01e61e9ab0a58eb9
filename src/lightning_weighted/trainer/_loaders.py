"""The loaders of a weighted Trainer run: each as Lightning built it, sharded without padding, kept in step."""

from __future__ import annotations

from typing import Any

import torch

from lightning_weighted._compat import LOADER_BARRIERS, combined_mode
from lightning_weighted.ahead import Lookahead
from lightning_weighted.data import (
    Participation,
    Policy,
    combined_lengths,
    combined_message,
    lengths_of,
    participating,
    without_padding,
)
from lightning_weighted.extension import extend, extension, own_state, restore

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
        self.fit_loop: Any = None  # Lightning's fit loop, whose train CombinedLoader names its mode
        self._lengths: list[list[int]] = []  # every rank's length of each train loader (-1: none)
        self._stage = ""
        self._extended: list[Any] = []

    def at_barrier(self, name: str | None) -> None:
        """Notes which stage's loaders come next; its earlier loaders are given back (they are set up anew)."""
        self._stage = LOADER_BARRIERS.get(name or "", "")
        if self._stage == "train":
            self.release(self.train_loaders)
            self.train_loaders, self.train.replays, self._lengths = [], False, []
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
        lengths = lengths_of(loader, self.device)
        self._lengths = [*self._lengths, lengths] if self.train_loaders else [lengths]
        if len(self._lengths) == 1:  # one loader, so far: its own length rules
            loader = participating(loader, self.train, self.device, lengths=lengths)
        else:
            if len(self._lengths) == 2:  # the first loader is one of several: the combined batches' lengths rule
                self._reset(self.train_loaders[0])
            loader = self._combined(loader)
        if self.lookahead is not None:
            if counts_ahead and len(self._lengths) > 1:
                raise ValueError(
                    "ItemCounter counts each window's batches ahead in one train dataloader, but the reloaded train"
                    " dataloaders are several. Keep one train dataloader, or return the count from training_step"
                    " instead of using ItemCounter."
                )
            if len(self._lengths) == 1:
                loader = extend(loader, self.lookahead.iterate)
                self.lookahead.loader_state = own_state(loader)
                extended = extension(loader)
                assert extended is not None
                extended.state = self.lookahead.state  # a checkpoint saves the state of what was trained
        self.train_loaders.append(self._kept(loader))
        return loader

    def _combined(self, loader: Any) -> Any:
        """One of several train loaders, as it is; checked, where the ranks' lengths differ, when Lightning sizes it.

        What plain DDP trains in lockstep trains as it is: the ranks' numbers of combined batches, which the
        ``CombinedLoader``'s mode decides (a shorter loader cycles under ``"max_size_cycle"``), are equal. Where
        they differ, DDP's ranks would fall out of step: refused on every rank alike (each knows every rank's
        lengths) when Lightning first asks for the loaders' lengths, after it processed them all, the mode known.
        """
        if all(len(set(n)) == 1 for n in self._lengths) or any(n < 0 for n in self._lengths[-1]):
            return loader  # as many batches on every rank in every mode; or unsized: as under "ddp", theirs to align
        local = len(loader)

        def checked_length() -> int:
            mode = combined_mode(self.fit_loop)
            combined = combined_lengths(mode, self._lengths)
            if combined is not None and len(set(combined)) > 1:
                raise ValueError(combined_message(mode, self._lengths, combined))
            return local

        return extend(loader, length=checked_length)

    def _reset(self, loader: Any) -> None:
        """Takes the replays and the lookahead out of the first train loader again (before it is iterated)."""
        extended = extension(loader)
        if extended is not None:
            extended.stages.clear()
            extended.length = extended.state = None
        self.train.replays = False
        self.train.new_epoch()

    def alone(self, iterables: Any) -> bool:
        """Whether Lightning's train ``iterables`` are one loader, whose batches are whole as it yields them."""
        return len(self.train_loaders) == 1 and iterables is self.train_loaders[0]

    def retract(self, loader: Any) -> None:
        """Takes the lookahead out of a loader's iteration again (before it is iterated)."""
        extended = extension(loader)
        if self.lookahead is not None and extended is not None and self.lookahead.iterate in extended.stages:
            extended.stages.remove(self.lookahead.iterate)
            extended.state = None

    def release(self, loaders: list[Any] | None = None) -> None:
        """Gives back the loaders this run extended (all of them by default)."""
        for loader in list(self._extended if loaders is None else loaders):
            if loader in self._extended:
                self._extended.remove(loader)
            restore(loader)

    def _kept(self, loader: Any) -> Any:
        if extension(loader) is not None and loader not in self._extended:
            self._extended.append(loader)
        return loader
