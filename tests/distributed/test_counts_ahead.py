"""Counts ahead (an ItemCounter counts each batch on the host): DDP's own reducer, against the float64 reference.

With an `ItemCounter` and one train loader the strategy counts every batch where the loader yields it, plans each
window before its first forward, scales every loss by P·n/N and leaves the reduction to DDP's C++ reducer; each
window's payload (the next window's N, late problems, the loss) is summed once, overlapping the syncing backward.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from harness import fit, strategy_reads
from scenario import Config, max_relative_error, reference

AHEAD = Config(strategy="ddp_weighted", counter="mask", bare_loss=True)
SIGTERM_FLAG = ("broadcast", "torch.int64", 1)  # Lightning broadcasts it before every batch, whatever the strategy


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _ahead(records: list[dict]) -> None:
    for rank in records:
        assert rank["counts_ahead"] is True
        assert rank["comm_hook"] is None  # no communication hook: DDP's own reducer averages the buckets


@pytest.mark.parametrize(("precision", "rtol"), [("bf16-true", 5e-2), ("64-true", 1e-10)])
def test_every_gradient_dtype_carries_the_counts_exactly(tmp_path, precision, rtol):
    config = dataclasses.replace(AHEAD, accumulate=2, precision=precision, lr=0.05)
    result = fit(config, tmp_path)
    _ahead(result)
    expected = reference(config)
    assert [w[1] for w in result[0]["windows"]] == expected["items"]  # N exact, in a bf16 bucket too
    assert max_relative_error(result[0]["params"], expected["params"]) < rtol


@pytest.mark.parametrize("iterable", [False, True])
def test_masked_microbatches_exhausted_ranks_and_empty_windows_contribute_nothing(tmp_path, iterable):
    # rank 1 runs out of data after 3 batches and replays; rank 0's microbatch 1 is fully masked (a NaN mean)
    config = dataclasses.replace(
        AHEAD, accumulate=2, lengths=(6, 3), iterable=iterable, masked=[(0, 1)], epochs=2, optimizer="adam", lr=0.05
    )
    result = fit(config, tmp_path)
    _ahead(result)
    assert max_relative_error(result[0]["params"], reference(config)["params"]) < 1e-5
    for rank, held in zip(result, config.lengths, strict=True):
        assert rank["padding"] == ([False] * held + [True] * (6 - held)) * 2  # unsized too: "more" rode along


def test_a_window_without_items_changes_nothing_on_any_rank(tmp_path):
    config = dataclasses.replace(AHEAD, accumulate=2, empty_windows=[1], optimizer="adam", scheduler=True, lr=0.05)
    result = fit(config, tmp_path)
    for rank in result:
        before, empty, after = rank["steps"]
        assert [step["stepped"] for step in rank["steps"]] == [True, False, True]  # no optimizer step
        assert _same(empty["params"], before["params"])
        assert all(_same(list(empty["state"][k].values()), list(before["state"][k].values())) for k in before["state"])
        assert empty["lr"] == before["lr"] and rank["skipped_steps"] == 1
        assert not _same(after["params"], empty["params"])
    assert max_relative_error(result[0]["params"], reference(config)["params"]) < 1e-5


def test_short_last_windows_and_an_accumulation_schedule_are_planned_as_lightning_runs_them(tmp_path):
    config = dataclasses.replace(AHEAD, schedule={0: 2, 1: 4}, batches=7, epochs=2)
    result = fit(config, tmp_path)
    _ahead(result)
    assert len(result[0]["steps"]) == 4 + 2  # windows of 2,2,2,1 then 4,3
    assert max_relative_error(result[0]["params"], reference(config)["params"]) < 1e-5


def test_parameters_unused_in_the_loss_train_the_reference_with_find_unused_parameters(tmp_path):
    config = dataclasses.replace(AHEAD, accumulate=2, find_unused=True, unused_layer=True, masked=[(1, 4)])
    result = fit(config, tmp_path)
    _ahead(result)
    assert max_relative_error(result[0]["params"], reference(config)["params"]) < 1e-5


def test_one_payload_per_step_beyond_the_epochs_first_count(tmp_path):
    config = dataclasses.replace(AHEAD, accumulate=3, batches=7, epochs=2, count_collectives=True, counter="quiet")
    result = fit(config, tmp_path)
    first, payload = ("all_reduce", "torch.float64", 1), ("all_reduce", "torch.float64", 6)
    for rank in result:
        assert len(rank["steps"]) == 6
        # each epoch's first window sums its own count at its first batch; every window then sums one payload,
        # started before its syncing backward, which carries the next window's count
        assert [c for c in rank["collectives"] if c != SIGTERM_FLAG] == ([first] + [payload] * 3) * 2


@pytest.mark.parametrize(
    ("change", "error"),
    [
        # ItemCounter's count of rank 1's batch 3 is negative: known on the host before the window starts
        ({"counter": "bad"}, "ValueError: on rank 1, a microbatch's count is negative (-1)"),
        # training_step returns a count that disagrees with ItemCounter's on rank 1 only
        (
            {"bare_loss": False, "bad_count": [1, 3, 99]},
            "ValueError: on rank 1, training_step returned a count (99) that differs from the one ItemCounter",
        ),
        # found once the window's counts were summed: the window's payload brings them
        ({"fault": ["none", 1, 3]}, "RuntimeError: on rank 1, training_step returned None instead of a loss"),
        ({"fault": ["nograd", 1, 3]}, "RuntimeError: on rank 1, training_step returned a loss that is not attached"),
    ],
)
def test_a_problem_on_one_rank_is_the_same_error_on_every_rank_before_the_step(tmp_path, change, error):
    config = dataclasses.replace(AHEAD, accumulate=2, **change)
    done = fit(config, tmp_path, timeout=90, expect_failure=True)
    assert done.stdout.count(error) == 2, done.stdout[-4000:]


def test_a_returned_count_that_agrees_with_item_counter_trains_the_reference(tmp_path):
    config = dataclasses.replace(AHEAD, accumulate=2, bare_loss=False)  # returns its token count, as counted ahead
    result = fit(config, tmp_path)
    _ahead(result)
    assert max_relative_error(result[0]["params"], reference(config)["params"]) < 1e-5


def test_no_count_is_read_back_from_the_device_and_the_strategy_reads_the_host_once_per_step(tmp_path):
    # batches reach the "device" as DeviceTensor: a host read of one of them would be a sync on a GPU
    config = dataclasses.replace(AHEAD, accumulate=2, lengths=(5, 3), epochs=2, host_reads=True, counter="quiet")
    result = fit(config, tmp_path)
    _ahead(result)
    assert max_relative_error(result[0]["params"], reference(config)["params"]) < 1e-5
    for rank in result:
        assert (
            strategy_reads(rank, "device") == Counter()
        )  # ItemCounter counted the host batches as the loader gave them
        # one read per optimizer step: the payload, after the window's last backward (at an epoch's first window
        # with the window's own N, which stayed on the device until then)
        assert strategy_reads(rank, "other", ours=True) == Counter({step: 1 for step in range(6)})


def test_returned_device_counts_are_never_read_back_where_counts_come_after_the_forward(tmp_path):
    # the counterpart: the count returned by training_step (no ItemCounter) stays on the device, checked and summed
    # there; the one read per optimizer step is the window's payload
    config = dataclasses.replace(AHEAD, counter=None, bare_loss=False, accumulate=2, lengths=(5, 3), host_reads=True)
    result = fit(config, tmp_path)
    assert result[0]["counts_ahead"] is False
    assert max_relative_error(result[0]["params"], reference(config)["params"]) < 1e-5
    for rank in result:
        assert strategy_reads(rank, "device") == Counter()
        assert strategy_reads(rank, "other", ours=True) == Counter({step: 1 for step in range(len(rank["steps"]))})
