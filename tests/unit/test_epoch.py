"""One rank's pass over a loader without processes: its replays, its counts ahead, its resumed passes, its place."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_weighted.count import Counts
from lightning_weighted.loaders import EpochBatches, Participation, epoch, staged
from lightning_weighted.loaders.epoch import Pass, combined_lengths, combined_message, lengths_of
from lightning_weighted.loaders.extension import extension, restore

CPU = torch.device("cpu")


def _lengths(batch: str) -> Counts:
    """Counts a batch ahead: its one part's count, the batch's length."""
    return Counts((float(len(batch)),))


class Consumed:
    """A stateful loader's stand-in: its state is how many batches it yielded; it notes when it reached its end."""

    def __init__(self, batches: list[str], consumed: int = 0) -> None:
        self.batches, self.consumed, self.ended = batches, consumed, False

    def __iter__(self) -> Iterator[str]:
        while self.consumed < len(self.batches):
            self.consumed += 1
            yield self.batches[self.consumed - 1]
        self.ended = True

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.consumed}


def test_a_batch_replays_where_its_position_reaches_the_ranks_real_batches():
    participation = Participation()
    assert not any(participation.replay(p) for p in range(4))  # an unsized loader's length is not known
    assert all(participation.has_more(p) for p in range(4))
    participation.new_epoch(2)
    assert [participation.replay(p) for p in range(4)] == [False, False, True, True]
    assert [participation.has_more(p) for p in range(3)] == [True, False, False]
    participation.new_epoch(0)  # a rank without a batch this epoch only replays
    assert participation.replay(0) and not participation.has_more(0)


def test_no_rank_with_more_after_a_window_ends_the_epoch_until_the_next_one_begins():
    participation = Participation()
    participation.new_epoch(3)
    participation.after_window(0, 2, None, CPU)
    assert participation.stop
    participation.new_epoch(3)
    assert not participation.stop


def test_a_participation_policy_is_pad_or_strict():
    assert Participation().policy == "pad" and Participation("strict").policy == "strict"
    with pytest.raises(ValueError, match=r"participation='sometimes' is not a policy: choose 'pad' or 'strict'"):
        Participation("sometimes")  # type: ignore[arg-type]


def test_a_short_rank_replays_its_last_real_batch_counted_zero_until_the_longest_ranks_last():
    participation = Participation()
    stage = EpochBatches(participation, [2, 4], CPU)  # this rank (0) holds 2 batches, rank 1 holds 4
    stage.count = _lengths
    batches = stage.iterate(iter(["aa", "bbb"]))
    assert stage.take(2) == [Counts((2.0,)), Counts((3.0,))]  # the first window's, fetched before its first forward
    assert stage.peek(2) == [Counts((0.0,)), Counts((0.0,))]  # the next window's: replays, counted 0
    assert stage.take(2) == [Counts((0.0,)), Counts((0.0,))]
    handed = [(batch, stage.position, participation.replay(stage.position - 1)) for batch in batches]
    assert handed == [("aa", 1, False), ("bbb", 2, False), ("bbb", 3, True), ("bbb", 4, True)]
    assert (participation.real, stage.current.start, stage.passes) == (2, 0, 1)
    assert stage.take(1) == []  # the pass is over

    again = stage.iterate(iter(["cc"]))  # the next pass starts afresh
    assert (stage.passes, stage.position, participation.real) == (2, 0, 2)
    assert list(again) == ["cc", "cc", "cc", "cc"]  # the loader held fewer than its length: its last one replays


def test_an_unsized_loader_is_read_one_batch_ahead_to_know_its_last_and_replays_it_until_a_window_ends_the_epoch():
    participation = Participation()
    stage = EpochBatches(participation, [-1, -1], CPU)
    batches = stage.iterate(iter([1, 2, 3]))
    assert [next(batches) for _ in range(2)] == [1, 2]
    assert participation.real is None and participation.has_more(1)  # the third was read ahead: not the end yet
    assert next(batches) == 3 and participation.real == 3 and not participation.has_more(2)
    assert [next(batches) for _ in range(3)] == [3, 3, 3]  # replays, until a window's end stops the epoch
    assert participation.replay(stage.position - 1)


def test_a_pass_resumed_mid_epoch_skips_the_batches_a_loader_without_state_yields_again_and_starts_at_its_position():
    fetched: list[str] = []

    def batches() -> Iterator[str]:
        for batch in ["a", "bb", "ccc"]:
            fetched.append(batch)
            yield batch

    participation = Participation()
    stage = EpochBatches(participation, [3, 4], CPU)
    stage.count = _lengths
    stage.resume(Pass(2, 0, 3, 4))  # 2 batches trained; the loader yields from its first; 3 real ones on this rank
    handed = stage.iterate(batches())
    assert (stage.current.start, stage.position) == (2, 2)
    assert stage.take(2) == [Counts((3.0,)), Counts((0.0,))]  # its third batch, then a replay
    assert fetched == ["a", "bb", "ccc"]  # the two trained ones were read and skipped
    assert [(batch, stage.position, participation.replay(stage.position - 1)) for batch in handed] == [
        ("ccc", 3, False),
        ("ccc", 4, True),
    ]
    assert stage.place(3, False) == {"position": 3, "real": 3, "at": 2, "loader": None}  # no state of its own

    stage.resume(Pass(4, 0, 3, 4))  # a rank with no real batch left only replays its last one
    assert list(stage.iterate(iter(["a", "bb", "ccc"]))) == []  # the pass is at its length already
    longer = EpochBatches(Participation(), [3, 5], CPU)
    longer.resume(Pass(4, 0, 3, 5))
    assert list(longer.iterate(iter(["a", "bb", "ccc"]))) == ["ccc"]


def test_the_place_of_a_stateful_loader_is_its_state_before_the_first_batch_not_yet_trained():
    loader = Consumed(["a", "b", "c"])
    stage = EpochBatches(Participation(), [3, 4], CPU)
    stage.loader_state = loader.state_dict
    places = []
    for batch in stage.iterate(iter(loader)):
        places.append((batch, stage.place(stage.position, False)))
    assert places == [
        ("a", {"position": 1, "real": 3, "at": 1, "loader": {"consumed": 1}}),
        ("b", {"position": 2, "real": 3, "at": 2, "loader": {"consumed": 2}}),
        ("c", {"position": 3, "real": 3, "at": 2, "loader": {"consumed": 2}}),  # no real one left: before its last
        ("c", {"position": 4, "real": 3, "at": 2, "loader": {"consumed": 2}}),
    ]
    assert stage.place(0, False)["loader"] is not stage.place(0, False)["loader"]  # copies the loader keeps apart
    assert loader.ended and stage.place(4, True)["loader"] == {"consumed": 3}  # at the epoch's end: read to it


def test_a_pass_resumed_where_the_loaders_state_was_put_back_reads_on_from_there_and_to_the_loaders_end():
    loader = Consumed(["a", "b", "c"], consumed=2)  # put back before its third batch
    participation = Participation()
    stage = EpochBatches(participation, [3, 4], CPU)
    stage.loader_state = loader.state_dict
    stage.resume(Pass(2, 2, 3, 4), {"consumed": 2})
    assert [(batch, stage.position) for batch in stage.iterate(iter(loader))] == [("c", 3), ("c", 4)]
    assert loader.ended  # read to its end after its last real batch, so that its next epoch starts afresh

    replaying = Consumed(["a", "b", "c"], consumed=2)  # a rank with no real batch left: put back before its last
    stage = EpochBatches(Participation(), [3, 5], CPU)
    stage.loader_state = replaying.state_dict
    stage.resume(Pass(3, 2, 3, 5), {"consumed": 2})
    assert [(batch, stage.position) for batch in stage.iterate(iter(replaying))] == [("c", 4), ("c", 5)]


def test_a_loader_is_read_to_its_end_before_its_last_batch_is_handed_out():
    # Lightning asks a sized loader for no batch after its length: the longest rank's last real batch is the
    # epoch's last, and nothing is fetched after it (LitData's `restore` would stay set for the next epoch, a
    # StatefulDataLoader's state would not say it finished)
    loader = Consumed(["a", "b", "c"], consumed=2)
    stage = EpochBatches(Participation(), [3, 3], CPU)
    stage.loader_state = loader.state_dict
    stage.resume(Pass(2, 2, 3, 3), {"consumed": 2})
    batches = stage.iterate(iter(loader))
    assert next(batches) == "c"  # and Lightning stops here
    assert loader.ended

    fresh = Consumed(["a", "b"])
    stage = EpochBatches(Participation(), [2, 2], CPU)
    batches = stage.iterate(iter(fresh))
    assert [next(batches), next(batches)] == ["a", "b"] and fresh.ended  # a pass from its start alike


def test_a_loader_put_back_is_never_asked_its_state_before_it_yields_the_passs_first_batch():
    # LitData's loader holds a loaded state pending until its next pass begins, and rewrites it when asked for its
    # state before: the state before the pass's first batch is the one put back
    class Pending(Consumed):
        def state_dict(self) -> dict[str, int]:
            assert self.consumed > 2, "asked for its state before its first batch"
            return super().state_dict()

    loader = Pending(["a", "b", "c", "d"], consumed=2)
    stage = EpochBatches(Participation(), [4, 4], CPU)
    stage.loader_state = loader.state_dict
    stage.resume(Pass(2, 2, 4, 4), {"consumed": 2})
    batches = stage.iterate(iter(loader))
    assert stage.state_before(2) == {"consumed": 2}  # the state put back
    assert next(batches) == "c" and stage.place(2, False)["loader"] == {"consumed": 2}
    assert stage.state_before(3) == {"consumed": 3}


def test_a_pass_after_a_resumed_one_takes_every_ranks_length_again_and_says_where_the_epochs_length_changed():
    told: list[int] = []
    stage = EpochBatches(Participation(), [3, 3], CPU)
    stage.relength = lambda: [5, 4]  # the loaders' own, asked again
    stage.on_length = told.append
    stage.resume(Pass(2, 2, 3, 4))  # dealt over other ranks: this rank's share ends at 3, the longest at 4
    assert list(stage.iterate(iter(["c"]))) == ["c", "c"] and stage.longest == 4
    assert list(stage.iterate(iter("abcde"))) == list("abcde")  # a whole epoch: 5 here, as many as the longest
    assert (stage.current, told) == (Pass(0, 0, 5, 5), [5])
    assert list(stage.iterate(iter("abcde"))) == list("abcde") and told == [5]  # the same length: nothing to say


def test_a_staged_loader_is_the_same_object_and_a_shorter_one_reports_the_longest(monkeypatch):
    loader = DataLoader(range(4), batch_size=2)
    same, even = staged(loader, Participation(), CPU)  # one process: every rank alike, its batches as they are
    try:
        assert same is loader and extension(loader) is not None and not even.participation.replays
        assert len(loader) == 2 and [batch.tolist() for batch in loader] == [[0, 1], [2, 3]]
    finally:
        restore(loader)
    monkeypatch.setattr(epoch, "lengths_of", lambda *args: [2, 3])  # this rank (0) holds 2 batches, rank 1 3
    participation = Participation()
    _, stage = staged(loader, participation, CPU)
    try:
        assert isinstance(stage, EpochBatches) and stage.lengths == [2, 3]
        assert len(loader) == 3 and participation.replays
        assert [batch.tolist() for batch in loader] == [[0, 1], [2, 3], [2, 3]]
    finally:
        restore(loader)
    assert len(loader) == 2 and extension(loader) is None


def test_a_staged_iterable_that_is_no_dataloader_is_wrapped_and_the_wrapper_replays(monkeypatch):
    batches = [torch.tensor([0, 1]), torch.tensor([2, 3])]  # any iterable Lightning accepts as a loader
    monkeypatch.setattr(epoch, "lengths_of", lambda *args: [2, 3])
    wrapped, stage = staged(batches, Participation(), CPU)
    assert wrapped is not batches and extension(wrapped) is not None and stage.lengths == [2, 3]
    assert len(wrapped) == 3 and [batch.tolist() for batch in wrapped] == [[0, 1], [2, 3], [2, 3]]
    assert restore(wrapped) is batches


def test_the_strict_policy_refuses_ranks_that_hold_different_numbers_of_batches_naming_each(monkeypatch):
    loader = DataLoader(range(4), batch_size=2)
    match = (
        r"participation='strict' needs every rank to hold the same number of batches, but they differ in their"
        r" dataloaders \(rank 0: 2, rank 1: 3\)\. Even out the shards, or use participation='pad'"
    )
    monkeypatch.setattr(epoch, "lengths_of", lambda *args: [2, 3])
    with pytest.raises(ValueError, match=match):
        staged(loader, Participation("strict"), CPU)
    assert extension(loader) is None


def test_every_ranks_length_of_a_loader_is_gathered_and_an_unsized_ones_is_minus_one():
    assert lengths_of(DataLoader(range(5), batch_size=2), CPU) == [3]  # one process: its own
    assert lengths_of(iter([1, 2]), CPU) == [-1]


def test_combined_batches_are_counted_by_the_loaders_mode_and_their_refusal_names_each_ranks():
    lengths = [[2, 1], [4, 4]]
    assert combined_lengths("sequential", lengths) == [6, 5]
    assert combined_lengths("max_size", lengths) == [4, 4]
    assert combined_lengths("min_size", [[2, 1], [-1, 4]]) is None  # one loader is unsized
    message = combined_message("min_size", lengths, [2, 1])
    assert message.startswith("the loaders of a CombinedLoader in mode 'min_size' give the ranks different numbers")
    assert "(rank 0: 2, rank 1: 1; each loader: loader 0: rank 0: 2, rank 1: 1; loader 1: rank 0: 4, rank 1: 4)" in (
        message
    )
