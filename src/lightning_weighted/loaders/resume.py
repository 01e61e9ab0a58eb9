"""Every rank's place in its train epoch, kept in a checkpoint, and the first pass of a run resumed from it.

On as many ranks, each rank resumes in its own place: its loader's state, or without one the batches before it
skipped. On another number of ranks, no item the checkpoint's steps trained is trained again in that epoch: the rest
is dealt over the new ranks by :class:`~lightning_weighted.UnpaddedDistributedSampler` or by LitData's elastic resume;
any other train loader holds each rank's own data, and such a resume is refused on every rank before any step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, cast

import torch.distributed as dist

from lightning_weighted._compat import (
    litdata_drops_last,
    litdata_loader,
    litdata_resumed,
    set_litdata_epoch,
    set_sampler_epoch,
)
from lightning_weighted.loaders.epoch import EpochBatches, Pass
from lightning_weighted.loaders.sampler import dealt_sampler, taken

__all__ = ["FORMAT", "KEY", "PLACE", "Places", "Plan", "Resumed", "whole_epoch"]

KEY = "lightning_weighted"  # the checkpoint's entry
FORMAT = 1  # what a place holds: its keys (``PLACE``) and their meaning
PLACE = ("epoch", "last", "position", "real", "at", "loader", "segment", "items", "dataset")


def whole_epoch() -> dict[str, Any]:
    """The deal of an epoch from its start: from position 0, no item of it trained before, its order whole."""
    return {"start": 0, "consumed": 0, "stream": None}


@dataclass(frozen=True)
class Plan:
    """What a resumed rank does first: its first pass, the loader state it loads, the deal that pass continues."""

    first: Pass | None = None  # None: a whole epoch
    loaded: dict[str, Any] | None = None  # loaded in place of the state Lightning gives every rank
    segment: dict[str, Any] = field(default_factory=whole_epoch)  # the deal the pass continues (see `Resumed`)
    items: int | None = None  # this rank's items in that deal where LitData deals them (None: its shard's length)
    shares: list[int] | None = None  # every rank's real batches in a pass LitData deals (its length counts the epoch)

    def lengths(self, own: list[int], same: bool, reals: list[int | None]) -> Plan:
        """The plan with its first pass's end, given every rank's loader length ``own`` (-1: unsized).

        On as many ranks (``reals``: their real batches in the epoch), each rank's loader must hold what it held;
        dealt again, the pass ends where the longest rank's share does.
        """
        if self.first is None:
            return self
        if same:
            origin, known = self.segment["start"], [r for r in reals if r is not None]
            if len(known) < len(reals) or any(n < 0 for n in own):
                return replace(self, first=replace(self.first, longest=None))  # unsized: it ends where the data does
            if [n + origin for n in own] != known:
                raise ValueError(_LENGTHS.format([r - origin for r in known], own))
            return replace(self, first=replace(self.first, longest=max(known)))
        shares, start = self.shares if self.shares is not None else own, self.first.start
        rank = dist.get_rank() if dist.is_initialized() else 0
        return replace(self, first=replace(self.first, real=start + shares[rank], longest=start + max(shares)))


@dataclass(frozen=True)
class Resumed:
    """The places a checkpoint keeps, one per rank of the run that took it, and where it stands in its epoch.

    A place's ``segment`` is the deal the epoch was in: from which position (``start``) its ranks took the order
    after its first ``consumed`` items (``stream``: the items of LitData's order). ``items`` is the rank's number of
    items in that deal, ``dataset`` its data set's length.
    """

    places: list[dict[str, Any] | None]  # None: a rank without a place
    epoch: int  # the epoch the resumed run trains first
    middle: bool  # some batch of that epoch trained, not the last

    @classmethod
    def read(cls, saved: Any, progress: tuple[int, bool], epoch: int) -> Resumed | None:
        """The places ``saved`` in a checkpoint (``None``: none); refuses a checkpoint that cannot resume here.

        ``progress``: how many batches of the epoch ``epoch`` the checkpoint's steps trained, and whether they were all.
        """
        processed, last = progress
        middle = processed > 0 and not last
        if saved is None:
            if middle:
                raise ValueError(_MISSING.format(processed))
            return None
        places = saved.get("ranks") if isinstance(saved, dict) else None
        well_formed = isinstance(places, list) and all(
            place is None or (isinstance(place, dict) and all(key in place for key in PLACE)) for place in places
        )
        if not well_formed or saved.get("format") != FORMAT:
            raise ValueError(_FORMAT.format(saved.get("format") if isinstance(saved, dict) else type(saved).__name__))
        return cls(cast("list[dict[str, Any] | None]", places), epoch + (not middle and processed > 0), middle)

    def plan(self, loader: Any, world: int, rank: int) -> Plan | None:
        """What ``loader`` of ``rank`` of ``world`` does first; deals its epoch again on another number of ranks.

        Sets every sampler's epoch before the loader is iterated. Refuses, alike on every rank, a loader that cannot
        resume where the checkpoint stands. ``None`` where the checkpoint keeps no place (several train loaders):
        Lightning's own resume.
        """
        set_sampler_epoch(loader, self.epoch)
        places, same = self.places, len(self.places) == world
        place = places[rank] if same else places[0]
        if any(p is None for p in places) or place is None:
            if self.middle and not same:
                raise ValueError(_NOT_DEALT.format(len(places), world, _COMBINED))
            return None
        if not self.middle:  # the next epoch starts whole: on as many ranks, each from its own loader's end
            if not same and litdata_loader(loader) and place["loader"] is not None:
                set_litdata_epoch(loader, place["loader"])  # LitData counts its epochs itself
            return Plan(loaded=place["loader"] if same else None)
        segment, sampler = place["segment"], dealt_sampler(loader)
        if sampler is not None and place["dataset"] is not None and len(sampler.dataset) != place["dataset"]:  # type: ignore[arg-type]
            raise ValueError(_CHANGED.format(len(sampler.dataset), place["dataset"]))  # type: ignore[arg-type]
        if same:
            if sampler is not None and segment["consumed"]:
                sampler.deal_from(self.epoch, segment["consumed"])
            first = place["at"] if place["loader"] is not None else segment["start"]
            return Plan(Pass(place["position"], first, place["real"]), place["loader"], segment, place["items"])
        start = place["position"]
        if sampler is not None:
            consumed = _taken_in_order(loader, sampler.order(), places)  # type: ignore[arg-type]
            sampler.deal_from(self.epoch, consumed)
            return Plan(Pass(start, start), None, {"start": start, "consumed": consumed, "stream": None})
        if litdata_loader(loader):
            return _litdata_plan(loader, places, world, rank)  # type: ignore[arg-type]
        raise ValueError(_NOT_DEALT.format(len(places), world, _OWN.format(type(loader).__name__)))


class Places:
    """A staged loader's places: this rank's for a checkpoint, every rank's gathered, the first pass from them."""

    def __init__(self, stage: EpochBatches, loader: Any) -> None:
        self.stage, self.loader = stage, loader
        self._deal: tuple[int, dict[str, Any], int | None] = (1, whole_epoch(), None)  # the pass, its deal, items

    def gathered(self, trained: int, last: bool, epoch: int) -> list[dict[str, Any] | None]:
        """Every rank's place, ``trained`` batches of epoch ``epoch`` trained (``last``: all of them); a collective."""
        passes, segment, items = self._deal
        if self.stage.passes != passes:  # a pass after the one a plan dealt: the epoch is dealt whole
            segment, items = whole_epoch(), None
        try:
            length: int | None = len(self.loader.dataset)  # the data set's, to refuse a changed one on resuming
        except (AttributeError, TypeError, NotImplementedError):
            length = None
        mine = {**self.stage.place(trained, last), "epoch": epoch, "last": last, "segment": segment}
        mine.update(items=items or length, dataset=length)
        ranks: list[dict[str, Any] | None] = [mine]
        if dist.is_initialized():
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine)
        return ranks

    def resume(self, resumed: Resumed, plan: Plan, lengths: list[int]) -> Plan:
        """Starts the stage's next pass where ``plan`` says, given every rank's plan-less loader ``lengths``."""
        same = len(resumed.places) == (dist.get_world_size() if dist.is_initialized() else 1)
        plan = plan.lengths(lengths, same, [place["real"] if place else None for place in resumed.places])
        if plan.first is not None:
            self.stage.resume(plan.first, plan.loaded)
        self._deal = (self.stage.passes + 1, plan.segment, plan.items)
        return plan


def _trained(place: dict[str, Any]) -> int:  # the real batches a rank trained in its deal of the epoch
    position: int = place["position"]
    real: int = place["real"] if place["real"] is not None else position
    return max(min(position, real) - int(place["segment"]["start"]), 0)


def _taken_in_order(loader: Any, order: list[int], places: list[dict[str, Any]]) -> int:
    """How many items of the epoch's ``order`` the places' steps took: their prefix, as the ranks took it in turn."""
    consumed, ranks = int(places[0]["segment"]["consumed"]), len(places)
    return consumed + sum(
        taken(loader, order[consumed + rank :: ranks], _trained(place)) for rank, place in enumerate(places)
    )


def _litdata_plan(loader: Any, places: list[dict[str, Any]], world: int, rank: int) -> Plan:
    """LitData's elastic resume, handed the items the steps took; each rank's share and the batch it skips.

    LitData's order is the ranks' batches in turn, so what they took is a prefix of it; LitData resumes from a whole
    batch of every rank, so the batches between that and the prefix's end are the first ranks' first: skipped.
    """
    batch, state, segment = int(loader.batch_size or 1), places[0]["loader"], places[0]["segment"]
    trained = segment["consumed"] + sum(min(_trained(place) * batch, place["items"]) for place in places)
    stream = segment["stream"] or segment["consumed"] + sum(place["items"] for place in places)
    resumed_from = trained - trained % (world * batch)  # LitData's own rounding, to whole batches of every rank
    ahead = trained - resumed_from  # the first ranks' first batches, trained already
    if ahead % batch:
        raise ValueError(_PARTIAL.format(trained, batch, world, len(places)))
    left = stream - resumed_from
    if litdata_drops_last(state):  # LitData deals whole rounds of every worker of every rank
        rounds = world * max(int(getattr(loader, "num_workers", 0)), 1)
        batches, short = left // (rounds * batch) * rounds, 0
    else:
        batches, short = math.ceil(left / batch), -left % batch
    own = [len(range(r, batches, world)) - (r < ahead // batch) for r in range(world)]
    items = own[rank] * batch - (short if batches and (batches - 1) % world == rank else 0)
    loaded = litdata_resumed(state, trained)
    start = places[0]["position"]
    first = start - (rank < ahead // batch)
    return Plan(Pass(start, first), loaded, {"start": start, "consumed": trained, "stream": stream}, items, own)


_MISSING = (
    "The checkpoint was taken in the middle of an epoch (after {} batches of it) by a strategy that keeps no place of"
    " each rank in its own shard: resuming it here would train some of the epoch's items twice and others never."
    " Resume it with the strategy that wrote it until the epoch ends, or resume from a checkpoint taken at an epoch's"
    " end, or from one a weighted strategy wrote."
)
_FORMAT = (
    "The checkpoint's `lightning_weighted` entry has another format ({!r}; this version reads format 1): another"
    " version of lightning_weighted wrote it. Resume with that version, or from a checkpoint this version wrote."
)
_NOT_DEALT = (
    "The checkpoint was taken in the middle of an epoch on {} ranks and this run has {}, but {}, which cannot be dealt"
    " again over another number of ranks. Resume on as many ranks as the checkpoint's, or from a checkpoint taken at"
    " an epoch's end; a map-style data set sharded by Lightning (`use_distributed_sampler=True`, the default) or"
    " LitData's `StreamingDataset` resumes mid-epoch on any number of ranks."
)
_OWN = "each rank's {} holds data of its own"
_COMBINED = "each rank's train batches combine several loaders, each holding data of its own"
_CHANGED = (
    "The train data set holds {} items where the checkpoint's held {}, so the places the checkpoint keeps no longer"
    " name the same items. Resume with the data set the checkpoint was taken with, or from a checkpoint taken at an"
    " epoch's end."
)
_LENGTHS = (
    "The train loaders hold {1} batches on the ranks where the checkpoint's held {0} in the same epoch, so the places"
    " it keeps no longer name the same batches. Resume with the data the checkpoint was taken with, or from a"
    " checkpoint taken at an epoch's end."
)
_PARTIAL = (
    "The checkpoint's steps took {} items of LitData's order in the epoch, not a whole number of batches of {} (a"
    " rank's last, short batch trained while another's still held data), and LitData resumes from a whole batch:"
    " resumed on {} ranks (the checkpoint's {}), some items would train twice. Resume on the checkpoint's number of"
    " ranks, or from the next checkpoint."
)
