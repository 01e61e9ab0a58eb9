"""The loaders of a weighted fit: as Lightning built them, sharded without padding, kept in step, counted, resumed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lightning_weighted._compat import (
    LOADER_BARRIERS,
    checkpoint_progress,
    combined_mode,
    set_sampler_epoch,
    set_train_batches,
)
from lightning_weighted.count import Counts
from lightning_weighted.loaders import EpochBatches, Participation, Policy, staged, without_padding
from lightning_weighted.loaders.epoch import combined_lengths, combined_message, lengths_of
from lightning_weighted.loaders.extension import extend, extension, restore
from lightning_weighted.loaders.resume import FORMAT, KEY, Places, Resumed


class FitLoaders:
    """What the strategy does to each loader Lightning builds (train, val, test), and undoes when the fit ends.

    Where ranks hold unequal batches they replay; the one train loader is counted ahead, keeps every rank's place in a
    checkpoint, and resumes from one (:mod:`lightning_weighted.loaders.resume`).
    """

    def __init__(self, policy: Policy) -> None:
        self.policy, self.device = policy, torch.device("cpu")  # the strategy's device once it is known
        self.train = Participation(policy)  # the train loader's epoch (one, for the loaders a CombinedLoader holds)
        self.stage: EpochBatches | None = None  # the one train loader's batches
        self.evaluation: dict[str, list[Participation]] = {"val": [], "test": []}  # one per evaluation loader
        self.count: Callable[[Any], Counts] | None = None  # counts ahead: each part's count of a batch
        self.train_loaders: list[Any] = []
        self.trainer: Any = None  # the fit's Trainer, whose fit loop names the train CombinedLoader's mode
        self._lengths: list[list[int]] = []  # every rank's length of each train loader (-1: none)
        self._stage_name = ""
        self._extended: list[Any] = []
        self._resumed: Resumed | None = None  # where the checkpoint a fit resumes from left every rank
        self._resumed_epoch: int | None = None  # the epoch it resumes, for the other loaders of a CombinedLoader
        self._places: Places | None = None  # the one train loader's places

    @property
    def combined(self) -> bool:
        """Whether a train batch combines several loaders' batches (in every mode but ``"sequential"``)."""
        return len(self.train_loaders) > 1 and combined_mode(getattr(self.trainer, "fit_loop", None)) != "sequential"

    def at_barrier(self, name: str | None) -> None:
        """Notes which stage's loaders come next; its earlier loaders are given back (they are set up anew)."""
        self._stage_name = LOADER_BARRIERS.get(name or "", "")
        if self._stage_name == "train":
            self.release(self.train_loaders)
            self.train_loaders, self.train.replays, self._lengths, self.stage = [], False, [], None
            self._resumed_epoch = None
        elif self._stage_name:
            self.evaluation[self._stage_name] = []

    def process(self, loader: Any) -> Any:
        """The loader as the weighted run uses it (Lightning processes each loader of a CombinedLoader in turn)."""
        if not self._stage_name:
            return loader  # a predict loader: Lightning's own sampler already shards without repeats
        loader = without_padding(loader)
        if self._stage_name != "train":
            participation = Participation(self.policy)
            self.evaluation[self._stage_name].append(participation)
            loader, _ = staged(loader, participation, self.device, windows=False)
            return self._kept(loader)
        loader = self._combined(loader) if self.train_loaders else self._train(loader)
        self.train_loaders.append(self._kept(loader))
        return loader

    def _train(self, loader: Any) -> Any:
        """The first train loader: planned from a checkpoint, its lengths known once, its pass staged, extended."""
        resumed, self._resumed = self._resumed, None
        world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
        plan = resumed.plan(loader, world, rank) if resumed is not None else None
        if plan is not None and plan.loaded is not None:  # here: Lightning loads no state at an epoch's end
            loader.load_state_dict(plan.loaded)
        loader, stage = staged(loader, self.train, self.device)  # the lengths as the plan deals them
        self.stage = stage
        self._lengths, self._places = [stage.lengths], Places(stage, loader)
        stage.count = self.count
        stage.on_length = lambda batches: set_train_batches(self.trainer, batches)
        extended = extension(loader)
        assert extended is not None
        extended.state = lambda: stage.state_before(stage.position)  # Lightning saves the state of what trained
        if resumed is not None and plan is not None:
            self._resumed_epoch = resumed.epoch
            self._places.resume(resumed, plan, stage.lengths)
            self.train.replays = self.train.replays or resumed.middle
            extended.load = lambda given: None  # this rank's own state is loaded already, not rank 0's
        return loader

    def _combined(self, loader: Any) -> Any:
        """One of several train loaders, refused as Lightning sizes it where the ranks' combined lengths differ."""
        if self._resumed_epoch is not None:
            set_sampler_epoch(loader, self._resumed_epoch)
        if len(self._lengths) == 1:  # the first loader is one of several: the combined batches' lengths rule
            self._reset(self.train_loaders[0])
        self._lengths.append(lengths_of(loader, self.device))
        if all(len(set(n)) == 1 for n in self._lengths) or any(n < 0 for n in self._lengths[-1]):
            return loader  # as many batches on every rank in every mode; or unsized: as under "ddp", theirs to align
        local = len(loader)

        def checked_length() -> int:
            mode = combined_mode(getattr(self.trainer, "fit_loop", None))
            combined = combined_lengths(mode, self._lengths)
            if combined is not None and len(set(combined)) > 1:
                raise ValueError(combined_message(mode, self._lengths, combined))
            return local

        return extend(loader, length=checked_length)

    def _reset(self, loader: Any) -> None:
        """Takes the replays and the counting out of the first train loader again (before it is iterated)."""
        extended = extension(loader)
        if extended is not None:
            extended.stages.clear()
            extended.length = extended.state = extended.load = None
        self.train.replays, self.stage = False, None
        self.train.new_epoch()

    def counts_ahead(self, iterables: Any) -> bool:
        """Whether each window's counts are taken ahead; else the count function is taken out again."""
        ahead = self.count is not None and len(self.train_loaders) == 1 and iterables is self.train_loaders[0]
        if not ahead and self.stage is not None:
            self.stage.count = None
        return ahead

    def save(self, checkpoint: dict[str, Any], progress: tuple[int, bool], epoch: int) -> None:
        """Saves every rank's place in ``checkpoint`` (a collective), ``progress`` of ``epoch`` trained."""
        ranks: list[dict[str, Any] | None] = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
        if self.stage is not None and self._places is not None:  # else several train loaders, each its own: no place
            ranks = self._places.gathered(*progress, epoch)
        checkpoint[KEY] = {"format": FORMAT, "ranks": ranks}

    def load(self, checkpoint: dict[str, Any]) -> None:
        """Takes every rank's place from a checkpoint; the next train loader resumes there (refuses what cannot)."""
        saved, epoch = checkpoint.pop(KEY, None), int(checkpoint.get("epoch", 0))
        self._resumed = Resumed.read(saved, checkpoint_progress(checkpoint), epoch)

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
