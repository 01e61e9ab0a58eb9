"""The loaders of a weighted fit: as Lightning built them, sharded without padding, kept in step, counted, resumed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lightning_weighted._compat import LOADER_BARRIERS, combined_mode
from lightning_weighted.count import Counts
from lightning_weighted.loaders import EpochBatches, Participation, Policy, participating, without_padding
from lightning_weighted.loaders.epoch import combined_lengths, combined_message, lengths_of
from lightning_weighted.loaders.extension import extend, extension, own_state, restore

_KEY = "lightning_weighted"  # each rank's place in its train epoch, in a checkpoint


class FitLoaders:
    """What the strategy does to each loader Lightning builds (train, val, test), and undoes when the fit ends.

    Where ranks hold unequal batches they replay; one train loader is counted ahead and keeps each rank's place.

    Args:
        policy: what a rank whose data ran out does (``"pad"`` or ``"strict"``).
        device: where the ranks' lengths are summed.
    """

    def __init__(self, policy: Policy, device: torch.device) -> None:
        self.policy, self.device = policy, device
        self.train = Participation(policy)  # the train loader's epoch (one, for the loaders a CombinedLoader holds)
        self.stage: EpochBatches | None = None  # the one train loader's batches, where it was extended
        self.evaluation: dict[str, list[Participation]] = {"val": [], "test": []}  # one per evaluation loader
        self.count: Callable[[Any], Counts] | None = None  # counts ahead: each part's count of a batch
        self.train_loaders: list[Any] = []
        self.fit_loop: Any = None  # Lightning's fit loop, whose train CombinedLoader names its mode
        self._lengths: list[list[int]] = []  # every rank's length of each train loader (-1: none)
        self._stage_name = ""
        self._extended: list[Any] = []
        self._resumed: dict[str, Any] | None = None  # this rank's place in the epoch a checkpoint resumes

    @property
    def combined(self) -> bool:
        """Whether a train batch combines several loaders' batches (in every mode but ``"sequential"``)."""
        return len(self.train_loaders) > 1 and combined_mode(self.fit_loop) != "sequential"

    def at_barrier(self, name: str | None) -> None:
        """Notes which stage's loaders come next; its earlier loaders are given back (they are set up anew)."""
        self._stage_name = LOADER_BARRIERS.get(name or "", "")
        if self._stage_name == "train":
            self.release(self.train_loaders)
            self.train_loaders, self.train.replays, self._lengths, self.stage = [], False, [], None
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
            return self._kept(participating(loader, participation, self.device, windows=False)[0])
        lengths = lengths_of(loader, self.device)
        self._lengths = [*self._lengths, lengths]
        if len(self._lengths) == 1:  # one loader, so far: its own length rules
            stateful = callable(getattr(loader, "state_dict", None))
            always = bool(self.count or stateful or self._resumed)
            loader, self.stage = participating(loader, self.train, self.device, lengths=lengths, always=always)
            self._set_up(loader)
        else:
            if len(self._lengths) == 2:  # the first loader is one of several: the combined batches' lengths rule
                self._reset(self.train_loaders[0])
            loader = self._combined(loader)
        self.train_loaders.append(self._kept(loader))
        return loader

    def _set_up(self, loader: Any) -> None:
        """The one train loader's stage: its own state saved as of what was trained, and a resumed place put back."""
        stage, extended = self.stage, extension(loader)
        if stage is None or extended is None:
            return
        stage.loader_state, stage.count = own_state(loader), self.count
        extended.state = lambda: stage.state_before(stage.position)
        resumed = self._resumed
        if resumed is not None:
            stage.resume(resumed["position"], resumed["real"], resumed["at"] if stage.loader_state is not None else 0)
            extended.load = lambda given: resumed["loader"]  # this rank's own; None: nothing left to load
            self._resumed = None

    def _combined(self, loader: Any) -> Any:
        """One of several train loaders, refused as Lightning sizes it where the ranks' combined lengths differ."""
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

    def save(self, checkpoint: dict[str, Any], progress: tuple[int, bool] | None) -> None:
        """Puts every rank's place in the train epoch into ``checkpoint``, beside rank 0's loader state (a collective).

        ``progress``: how many batches of the epoch trained, and whether the last one did (``None``: no fit).
        """
        stage = self.stage
        mine = None if stage is None or progress is None else {**stage.state(progress[0]), "last": progress[1]}
        ranks: list[Any] = [mine]
        if dist.is_initialized():
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine)
        if any(rank is not None for rank in ranks):
            checkpoint[_KEY] = {"ranks": ranks}

    def load(self, checkpoint: dict[str, Any]) -> None:
        """Takes every rank's place from a checkpoint (mid-epoch: of as many ranks); the next train loader resumes."""
        ranks = checkpoint.pop(_KEY, {"ranks": []})["ranks"]
        world = dist.get_world_size() if dist.is_initialized() else 1
        middle = [r for r in ranks if r is not None and not r["last"] and r["position"] > 0]
        if not middle:
            return
        if len(ranks) != world:
            raise ValueError(
                f"The checkpoint was taken in the middle of an epoch on {len(ranks)} ranks, each at its own place in"
                f" its own shard, and the run resumes on a different number of ranks ({world}), whose shards differ."
                f" Resume on {len(ranks)} ranks, or from a checkpoint taken at an epoch's end."
            )
        self._resumed = ranks[dist.get_rank() if dist.is_initialized() else 0]

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
