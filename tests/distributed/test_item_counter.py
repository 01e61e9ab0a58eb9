"""ItemCounter on 2 gloo ranks: counts from the batch (ahead), the logged objective, bad counts, disagreements."""

from __future__ import annotations

import pytest
from harness import fit, logged_rows
from scenario import Config, max_relative_error, reference


def test_counts_from_the_batch_train_the_reference_and_the_csv_holds_the_weighted_objective(tmp_path):
    config = Config(strategy="ddp_weighted", counter="mask", bare_loss=True, accumulate=2, lengths=(6, 4))
    expected = reference(config)
    result, output = fit(config, tmp_path, output=True)
    assert max_relative_error(result[0]["params"], expected["params"]) < 1e-5
    assert "It is recommended to use `self.log(" not in output  # the values are global already: no advice to act on

    rows = logged_rows(tmp_path, "train/items")
    assert len(rows) == len(expected["losses"]) == 3
    steps = zip(rows, expected["losses"], expected["items"], expected["local_items"], strict=True)
    for row, loss, items, local in steps:
        # the loss before each step, as the float64 reference computes Σ w·ℓ / Σ w over both ranks
        assert float(row["train/loss"]) == pytest.approx(loss, rel=1e-5)
        assert float(row["train/items"]) == items
        assert float(row["train/items_local"]) == local[0]  # rank 0 writes the log
        assert float(row["train/imbalance"]) == pytest.approx(2 * max(local) / items, rel=1e-6)  # logged as fp32
        assert float(row["train/items_per_sec"]) > 0
    (epoch_row,) = logged_rows(tmp_path, "train/loss_epoch")
    pairs = zip(expected["losses"], expected["items"], strict=True)
    weighted = sum(loss * n for loss, n in pairs) / sum(expected["items"])
    assert float(epoch_row["train/loss_epoch"]) == pytest.approx(weighted, rel=1e-5)


def test_a_bad_count_from_count_fn_on_one_rank_raises_on_every_rank(tmp_path):
    config = Config(strategy="ddp_weighted", counter="bad", bare_loss=True, accumulate=2)
    done = fit(config, tmp_path, timeout=90, expect_failure=True)
    assert done.stdout.count("ValueError: on rank 1, a microbatch's count is negative (-1)") == 2, done.stdout[-3000:]


def test_a_returned_count_that_disagrees_with_item_counter_is_an_error_on_every_rank(tmp_path):
    # ItemCounter counts examples ahead, training_step returns its token count: the window's N holds the former
    config = Config(strategy="ddp_weighted", counter="examples", mode="tokens")
    done = fit(config, tmp_path, timeout=90, expect_failure=True)
    message = "ValueError: on 2 ranks, training_step returned a count that differs from the one ItemCounter took"
    assert done.stdout.count(message) == 2, done.stdout[-3000:]
