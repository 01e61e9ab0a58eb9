"""ItemCounter and ItemMonitor on 2 gloo ranks: counts from the batch (ahead), the logged objective with and without
an ItemCounter (Trainer) and ItemMetrics (Fabric), its resumed item total, bad counts, disagreements."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from fabric_worker import FabricConfig
from harness import fit, logged_rows
from scenario import Config, max_relative_error, reference


def test_counts_from_the_batch_train_the_reference_and_the_monitors_csv_holds_the_weighted_objective(tmp_path):
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


def _logged(tmp_path: Path, column: str) -> list[float]:
    return [float(row[column]) for row in logged_rows(tmp_path, column)]


def test_the_monitor_logs_the_objective_of_counts_returned_by_training_step_and_resumes_its_item_total(tmp_path):
    # no ItemCounter: each training_step returns its count; rank 1 runs out of data and replays in each last window
    config = Config(strategy="ddp_weighted", monitor=True, accumulate=2, lengths=(6, 4), epochs=2, precision="64-true")
    expected = reference(config)
    (rank, _) = fit(config, tmp_path / "u")
    assert len(expected["items"]) == 6
    # float64 run: the logged values are float64, exact to rounding against the float64 reference
    assert _logged(tmp_path / "u", "train/loss") == pytest.approx(expected["losses"], rel=1e-10)
    assert _logged(tmp_path / "u", "train/items") == expected["items"]
    assert _logged(tmp_path / "u", "train/items_local") == [local[0] for local in expected["local_items"]]
    windows = zip(expected["local_items"], expected["items"], strict=True)
    imbalance = [2 * max(local) / items for local, items in windows]
    assert _logged(tmp_path / "u", "train/imbalance") == pytest.approx(imbalance, rel=1e-12)
    assert max(imbalance) > 1.5  # uneven enough for plain DDP's mean of means to be off
    pairs = list(zip(expected["losses"], expected["items"], strict=True))
    epochs = [sum(loss * n for loss, n in part) / sum(n for _, n in part) for part in (pairs[:3], pairs[3:])]
    assert _logged(tmp_path / "u", "train/loss_epoch") == pytest.approx(epochs, rel=1e-10)
    assert rank["items_total"] == sum(expected["items"])

    # resumed from the first epoch's checkpoint: the total goes on from the items of the first 3 steps
    fit(dataclasses.replace(config, epochs=1, checkpoint=True), tmp_path / "a")
    (checkpoint,) = (tmp_path / "a").glob("*.ckpt/epoch=0-*.ckpt")
    saved = torch.load(checkpoint, weights_only=False)["callbacks"]["ItemMonitor"]
    assert saved == {"items_total": sum(expected["items"][:3])}
    (resumed, _) = fit(dataclasses.replace(config, resume=str(checkpoint)), tmp_path / "b")
    assert resumed["items_total"] == rank["items_total"]
    assert _logged(tmp_path / "b", "train/items") == expected["items"][3:]  # only the steps after the resume


def test_item_metrics_in_a_fabric_loop_give_the_weighted_objective_its_terms_and_the_item_total(tmp_path):
    # counts handed over ahead (auxiliary terms need them); rank 1's microbatches hold several times rank 0's tokens
    config = FabricConfig(
        strategy="ddp_weighted", accumulate=3, batches=7, epochs=2, mode="tokens", aux="parts", ahead=True, metrics=True
    )
    expected = reference(config)
    records = fit(config, tmp_path, script="fabric_worker.py")
    for r, record in enumerate(records):
        steps = record["metrics"]
        assert len(steps) == len(expected["items"]) == 6
        # the reference's loss holds the terms' means; the window's loss is the item mean alone
        parts = zip(expected["losses"], expected["aux_means"], strict=True)
        item_means = [loss - sum(means.values()) for loss, means in parts]
        assert [s["train/loss"] for s in steps] == pytest.approx(item_means, rel=1e-5)
        assert [s["train/items"] for s in steps] == expected["items"]
        assert [s["train/items_local"] for s in steps] == [local[r] for local in expected["local_items"]]
        imbalance = [2 * max(local) / n for local, n in zip(expected["local_items"], expected["items"], strict=True)]
        assert [s["train/imbalance"] for s in steps] == pytest.approx(imbalance, rel=1e-12)
        for name in ("load_balance", "z"):
            assert [s[f"train/aux/{name}"] for s in steps] == pytest.approx(
                [means[name] for means in expected["aux_means"]], rel=1e-5
            )
        assert all(s["train/items_per_sec"] > 0 for s in steps)
        pairs = list(zip(item_means, expected["items"], strict=True))
        epochs = [sum(loss * n for loss, n in part) / sum(n for _, n in part) for part in (pairs[:3], pairs[3:])]
        assert [e["train/loss_epoch"] for e in record["epoch_metrics"]] == pytest.approx(epochs, rel=1e-5)
        assert record["items_total"] == sum(expected["items"])
