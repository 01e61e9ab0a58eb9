"""Ranks with different amounts of data: every rank steps until all are done, each item counted once."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from harness import fit
from scenario import Config, max_relative_error, reference


def _steps_per_epoch(config: Config) -> int:
    longest = max(config.lengths or [config.batches])
    return -(-longest // config.accumulate)


@pytest.mark.parametrize("lengths", [(5, 3), (4, 0), (2, 6)])
@pytest.mark.parametrize("iterable", [False, True])
def test_uneven_batch_counts_under_ddp_train_the_global_item_mean_over_two_epochs(tmp_path, lengths, iterable):
    config = Config(
        strategy="ddp_weighted", lengths=lengths, iterable=iterable, accumulate=2, epochs=2, log_sync_dist=True
    )
    result = fit(config, tmp_path)
    assert max_relative_error(result[0]["params"], reference(config)["params"]) < 1e-5
    # sized: every rank runs the longest rank's batches; unsized: the epoch ends at the window boundary where
    # no rank has data left, so the last window may hold up to A - 1 padding microbatches on every rank
    ran = _steps_per_epoch(config) * config.accumulate if iterable else max(lengths)
    for rank, held in zip(result, lengths, strict=True):
        assert rank["global_step"] == 2 * _steps_per_epoch(config)  # the same step on every rank
        # the exhausted rank replays batches flagged as padding until every rank is done
        assert rank["padding"] == ([False] * held + [True] * (ran - held)) * 2


def test_a_dataset_not_divisible_by_ranks_batch_and_window_counts_each_item_once(tmp_path):
    # 37 items, batch 4, 2 ranks, A = 3: Lightning's sampler would pad to 38 and train one item twice
    config = Config(strategy="ddp_weighted", items=37, batch_size=4, accumulate=3, epochs=2, mode="weights")
    expected = reference(config)
    result = fit(config, tmp_path)
    assert max_relative_error(result[0]["params"], expected["params"]) < 1e-5
    assert result[0]["global_step"] == result[1]["global_step"] == 2 * 2  # 5 batches: windows of 3 and 2


def test_plain_ddp_on_the_same_shards_trains_a_different_objective(tmp_path):
    config = Config(strategy="ddp", items=37, batch_size=4, accumulate=3, epochs=2, mode="weights")
    result = fit(config, tmp_path)
    # one repeated item, the mean of rank means and the loss / A of the short window all move the result
    assert max_relative_error(result[0]["params"], reference(config)["params"]) > 1e-3


@pytest.mark.parametrize("iterable", [False, True])
def test_plain_ddp_with_uneven_batch_counts_crashes_or_trains_wrong(tmp_path, iterable):
    config = Config(strategy="ddp", lengths=(5, 3), iterable=iterable, epochs=2)
    done = fit(config, tmp_path, timeout=120, expect_failure=None)
    if isinstance(done, list):  # it finished: the ranks stepped different numbers of times, on the wrong data
        steps = [rank["global_step"] for rank in done]
        assert steps[0] != steps[1] or max_relative_error(done[0]["params"], reference(config)["params"]) > 1e-2
    else:
        assert done.returncode != 0


def test_strict_participation_under_ddp_names_each_ranks_batch_count(tmp_path):
    config = Config(strategy="ddp_weighted", lengths=(5, 3), participation="strict")
    done = fit(config, tmp_path, timeout=90, expect_failure=True)
    message = "participation='strict' needs every rank to hold the same number of batches, but they differ in"
    assert done.stdout.count(message) == 2, done.stdout[-3000:]
    assert "(rank 0: 5, rank 1: 3)" in done.stdout


def test_strict_participation_on_unsized_data_stops_at_the_first_uneven_window(tmp_path):
    config = Config(strategy="ddp_weighted", lengths=(5, 3), iterable=True, participation="strict")
    done = fit(config, tmp_path, timeout=90, expect_failure=True)
    assert done.stdout.count("but they differ after loader position 2 (rank 0: ?, rank 1: 3)") == 2, done.stdout[-3000:]


def test_strict_participation_with_even_shards_trains_normally(tmp_path):
    config = dataclasses.replace(Config(strategy="ddp_weighted", participation="strict"), lengths=(4, 4))
    result = fit(config, tmp_path)
    assert max_relative_error(result[0]["params"], reference(config)["params"]) < 1e-5


def _single_process_validation(config: Config, params: list) -> float:
    from scenario import item_losses, make_model, validation_set

    model = make_model(config.seed).double()
    for p, value in zip(model.parameters(), params, strict=True):
        p.data.copy_(value.double())
    x, y, w = (t.double() for t in validation_set(config).tensors)
    with torch.no_grad():
        return float((item_losses(model, x, y) * w).sum() / w.sum())


@pytest.mark.parametrize(("strategy", "exact"), [("ddp_weighted", True), ("ddp", False)])
def test_a_weighted_mean_metric_over_unpadded_validation_shards_equals_one_process(tmp_path, strategy, exact):
    # 9 validation items over 2 ranks in batches of 4: rank 0 holds 5 items (2 batches), rank 1 holds 4 (1 batch)
    config = Config(strategy=strategy, items=12, val_items=9, epochs=1)
    result = fit(config, tmp_path)
    expected = _single_process_validation(config, result[0]["validation_params"])
    value = result[0]["validation"][-1]
    assert result[1]["validation"][-1] == value
    if exact:
        assert value == pytest.approx(expected, rel=1e-6)
    else:  # Lightning's padding sampler scores item 0 twice
        assert value != pytest.approx(expected, rel=1e-6)
