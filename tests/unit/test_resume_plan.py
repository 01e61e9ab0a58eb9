"""Where a checkpoint leaves every rank, and the first pass of a run resumed from it, without processes."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from torch.utils.data import DataLoader, DistributedSampler

from lightning_weighted._compat import checkpoint_progress
from lightning_weighted.loaders.epoch import Pass
from lightning_weighted.loaders.resume import FORMAT, KEY, Plan, Resumed, _litdata_plan, whole_epoch
from lightning_weighted.loaders.sampler import InsertedReplicas, without_padding


def place(position: int, real: int | None, **changes: Any) -> dict[str, Any]:
    """One rank's place as a weighted fit saves it, mid-epoch by default."""
    return {"epoch": 1, "last": False, "position": position, "real": real, "at": position, "loader": None,
            "segment": whole_epoch(), "items": None, "dataset": 37, **changes}  # fmt: skip


def checkpoint(places: list[Any] | None, processed: int = 4, last: bool = False, epoch: int = 1) -> dict[str, Any]:
    """A checkpoint of Lightning's as far as resuming reads it: its epoch, its batch progress, the places."""
    progress = {"current": {"processed": processed}, "is_last_batch": last}
    saved: dict[str, Any] = {"epoch": epoch, "loops": {"fit_loop": {"epoch_loop.batch_progress": progress}}}
    if places is not None:
        saved[KEY] = {"format": FORMAT, "ranks": places}
    return saved


def read(saved: dict[str, Any]) -> Resumed | None:
    """The places of a checkpoint, as the Trainer's strategy reads them."""
    return Resumed.read(saved.pop(KEY, None), checkpoint_progress(saved), saved.get("epoch", 0))


def inserted(items: int = 37, world: int = 1, rank: int = 0, batch_size: int = 3) -> DataLoader[Any]:
    """A loader through the sampler Lightning inserts (replaced by the unpadded one), not shuffled."""
    sampler = DistributedSampler(range(items), InsertedReplicas(world), rank, shuffle=False)
    return without_padding(DataLoader(range(items), batch_size=batch_size, sampler=sampler))  # type: ignore[return-value]


def test_a_mid_epoch_checkpoint_without_places_is_refused_and_one_at_an_epochs_end_resumes_as_lightnings():
    with pytest.raises(ValueError, match=r"after 4 batches of it\) by a strategy that keeps no place of each rank"):
        read(checkpoint(None))
    assert read(checkpoint(None, processed=7, last=True)) is None
    assert read({}) is None  # no loops at all: a checkpoint of weights


def test_places_of_another_format_are_refused_naming_the_format():
    saved = checkpoint([place(4, 7)])
    saved[KEY]["format"] = 2
    with pytest.raises(ValueError, match=r"another format \(2; this version reads format 1\)"):
        read(saved)
    partial = checkpoint([{k: v for k, v in place(4, 7).items() if k != "segment"}])
    with pytest.raises(ValueError, match="another format"):
        read(partial)
    with pytest.raises(ValueError, match=r"another format \('list';"):
        read({**checkpoint(None), KEY: [1]})


def test_a_checkpoint_mid_epoch_resumes_that_epoch_and_one_at_its_end_the_next():
    middle = read(checkpoint([place(4, 7)]))
    end = read(checkpoint([place(7, 7, last=True)], processed=7, last=True))
    assert middle is not None and (middle.epoch, middle.middle) == (1, True)
    assert end is not None and (end.epoch, end.middle) == (2, False)
    saved = checkpoint([place(4, 7)])
    read(saved)
    assert KEY not in saved  # taken out: Lightning restores the rest


def test_on_as_many_ranks_each_rank_resumes_from_its_own_place_and_its_loader_from_its_own_state():
    places = [place(4, 7, at=4, loader={"consumed": 4}), place(4, 6, at=4, loader={"consumed": 4, "rank": 1})]
    resumed = read(checkpoint(places))
    assert resumed is not None
    plan = resumed.plan(inserted(world=2, rank=1), world=2, rank=1)
    assert plan is not None and (plan.first, plan.loaded) == (Pass(4, 4, 6), {"consumed": 4, "rank": 1})
    assert plan.lengths([7, 6], True, [7, 6]).first == Pass(4, 4, 6, 7)  # the longest rank's real batches
    stateless = read(checkpoint([place(4, 7), place(4, 6)]))
    assert stateless is not None
    plan = stateless.plan(inserted(world=2), world=2, rank=0)
    assert plan is not None and plan.first == Pass(4, 0, 7)  # read again from its start, the trained ones skipped
    with pytest.raises(ValueError, match=r"hold \[7, 5\] batches on the ranks where the checkpoint's held \[7, 6\]"):
        plan.lengths([7, 5], True, [7, 6])


def test_on_another_number_of_ranks_the_sampler_deals_the_items_no_step_took():
    # 2 ranks took 4 batches of 3 items each: items 0 to 23 of the epoch's order; 1 rank takes the other 13
    resumed = read(checkpoint([place(4, 7), place(4, 6)]))
    assert resumed is not None
    loader = inserted(world=1)
    plan = resumed.plan(loader, world=1, rank=0)
    assert plan is not None and plan.loaded is None  # no rank's own loader state: the sampler deals
    assert [int(i) for batch in loader for i in batch] == list(range(24, 37))
    assert plan.segment == {"start": 4, "consumed": 24, "stream": None}
    assert plan.lengths([len(loader)], False, [7, 6]).first == Pass(4, 4, 9, 9)  # 5 batches from position 4

    replaying = read(checkpoint([place(6, 7), place(6, 6)]))  # rank 1 ran out: took its 18, rank 0 its 18
    assert replaying is not None
    shares = []
    for rank in range(3):
        loader = inserted(world=3, rank=rank)
        replaying.plan(loader, world=3, rank=rank)
        shares.append([int(i) for batch in loader for i in batch])
    assert shares == [[36], [], []]


def test_a_resume_on_another_number_of_ranks_is_refused_where_the_data_changed_or_cannot_be_dealt_again():
    resumed = read(checkpoint([place(4, 7), place(4, 6)]))
    assert resumed is not None
    with pytest.raises(ValueError, match=r"The train data set holds 36 items where the checkpoint's held 37"):
        resumed.plan(inserted(items=36), world=1, rank=0)
    own = DataLoader(range(10), batch_size=3)  # each rank's own data: no sampler of Lightning's
    with pytest.raises(ValueError, match=r"each rank's DataLoader holds data of its own, which cannot be dealt again"):
        resumed.plan(own, world=1, rank=0)
    several = read(checkpoint([None, None]))
    assert several is not None
    with pytest.raises(ValueError, match=r"combine several loaders, each holding data of its own"):
        several.plan(own, world=1, rank=0)
    assert several.plan(own, world=2, rank=0) is None  # as many ranks: Lightning's own resume


class _Loader:
    """LitData's loader as the plan reads it: its batch size and workers."""

    batch_size, num_workers = 4, 0


def _litdata_place(position: int, real: int, items: int) -> dict[str, Any]:
    state = {"current_epoch": 2, "dataset": {"drop_last": False, "sample_in_epoch": 0}}
    return place(position, real, loader=copy.deepcopy(state), items=items, dataset=items)


def test_litdata_resumes_from_the_items_the_steps_took_and_the_first_ranks_skip_the_batch_past_its_rounding():
    # 1 rank took 3 batches of 4 (12 items); LitData resumes 2 ranks from whole batches of both (8 items), so the
    # batch of items 8 to 11, rank 0's first of the 29 left (8 batches: 4 of them rank 0's, the last one short on
    # rank 1), trained already: rank 0 skips it
    plan = _litdata_plan(_Loader(), [_litdata_place(3, 10, 37)], world=2, rank=0)
    assert plan.first == Pass(3, 2) and plan.shares == [3, 4] and plan.items == 12
    assert plan.loaded is not None and plan.loaded["dataset"]["sample_in_epoch"] == 12
    assert plan.segment == {"start": 3, "consumed": 12, "stream": 37}
    other = _litdata_plan(_Loader(), [_litdata_place(3, 10, 37)], world=2, rank=1)
    assert other.first == Pass(3, 3) and other.items == 4 * 4 - 3  # its last batch holds 1 item
    assert Plan(first=Pass(3, 2), shares=[3, 4]).lengths([10, 10], False, [10]).first == Pass(3, 2, 6, 7)


def test_litdata_cannot_resume_past_a_short_batch_on_another_number_of_ranks():
    # rank 0's 17 items end in a batch of 1; 5 steps took 17 + 20 items, not a whole number of batches of 4
    places = [_litdata_place(5, 5, 17), _litdata_place(5, 6, 24)]
    with pytest.raises(ValueError, match=r"took 37 items of LitData's order in the epoch, not a whole number"):
        _litdata_plan(_Loader(), places, world=1, rank=0)
