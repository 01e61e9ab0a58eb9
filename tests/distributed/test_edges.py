"""Exact and lossless where users look: logged epoch values, evaluation on uneven ranks, mid-epoch resume, a loss
spike, SWA (2 and 3 gloo ranks, against the exact answer computed in one process: each item once)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from edges_worker import EdgeConfig, make_model, token_data, token_losses
from harness import run_worker

ABOUT = 1e-5  # fp32 forwards in batches of different sizes, summed in another order


def edges(config: EdgeConfig, tmp_path: Path, expect_failure: bool = False, timeout: float = 180) -> Any:
    out, done = run_worker("edges_worker.py", config, tmp_path, timeout)
    assert (done.returncode != 0) == expect_failure, done.stdout[-8000:]
    if expect_failure:
        return done
    return [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(config.world_size)], done.stdout


def exact(items: int, seed: int) -> dict[str, float]:
    """The answer over the whole set, each item once: the mean of the items' token means, and the token mean."""
    x, y, mask, _ = token_data(items, seed).tensors
    with torch.no_grad():
        losses = token_losses(make_model(), x, y).double()
    mask = mask.double()
    return {
        "batch_mean": float(((losses * mask).sum(-1) / mask.sum(-1)).mean()),
        "token_mean": float((losses * mask).sum() / mask.sum()),
    }


STAGES = {"fit": ("train", 1), "validate": ("val", 2), "test": ("test", 3)}


def logged(record: dict[str, Any], stage: str, name: str) -> float:
    prefix, _ = STAGES[stage]
    metrics = record["metrics"][stage]
    return metrics.get(f"{prefix}/{name}", metrics.get(f"{prefix}/{name}_epoch", float("nan")))


@pytest.mark.parametrize(
    ("strategy", "items", "world_size"),
    [
        ("ddp_weighted", 7, 2),
        ("ddp_weighted", 9, 2),
        ("ddp_weighted", 7, 3),
        ("fsdp2_weighted", 7, 2),
        ("fsdp_weighted", 9, 2),
    ],
)
def test_every_logged_epoch_value_is_the_exact_mean_over_each_item_once(tmp_path, strategy, items, world_size):
    # `self.log(..., sync_dist=True)` of a batch mean (batch size inferred), of a token mean with an int and a float
    # `batch_size`, a MeanMetric weighted by tokens, and `val/loss`, `test/loss` from the returned loss
    records, _ = edges(EdgeConfig(strategy=strategy, items=items, world_size=world_size), tmp_path)
    for stage, (prefix, seed) in STAGES.items():
        answer = exact(items, seed)
        for record in records:  # the same on every rank
            assert logged(record, stage, "batch_mean") == pytest.approx(answer["batch_mean"], rel=ABOUT)
            for name in ("token_mean", "token_mean_f", "metric"):
                assert logged(record, stage, name) == pytest.approx(answer["token_mean"], rel=ABOUT), (stage, name)
            if prefix != "train":
                assert record["metrics"][stage][f"{prefix}/loss"] == pytest.approx(answer["token_mean"], rel=ABOUT)
        seen = sorted(i for record in records for i in record["seen"][prefix])
        assert seen == list(range(items))  # each item once over the ranks
    predictions = sorted(i for record in records for i in record["predictions"])
    assert predictions == list(range(items))


@pytest.mark.parametrize(("strategy", "items"), [("ddp", 7), ("fsdp2", 9)])
def test_the_plain_strategies_miss_the_same_answers(tmp_path, strategy, items):
    # a padding sampler repeats items, and Lightning floors the mean of its integer batch-size sums
    records, output = edges(EdgeConfig(strategy=strategy, items=items), tmp_path)
    answer = exact(items, 2)
    assert "replicates some samples" in output  # Lightning's own warning, which the weighted strategies need not give
    assert logged(records[0], "validate", "batch_mean") != pytest.approx(answer["batch_mean"], rel=1e-3)
    assert logged(records[0], "validate", "token_mean") != pytest.approx(answer["token_mean"], rel=1e-3)
    assert len(sorted(i for record in records for i in record["seen"]["val"])) > items  # one item twice


@pytest.mark.parametrize(("world_size", "batch_size"), [(2, 3), (3, 2)])
def test_per_batch_collectives_in_validation_step_keep_pace_on_ranks_with_fewer_batches(
    tmp_path, world_size, batch_size
):
    # 7 items: ranks hold 2 and 1 batches (or 2, 1, 1): an on-step synced value and an all_gather every step
    config = EdgeConfig(items=7, world_size=world_size, batch_size=batch_size, on_step=True)
    records, output = edges(config, tmp_path)
    answer = exact(7, 2)
    for record in records:
        assert logged(record, "validate", "token_mean") == pytest.approx(answer["token_mean"], rel=ABOUT)
        assert record["metrics"]["validate"]["val/loss"] == pytest.approx(answer["token_mean"], rel=ABOUT)
    assert sorted(i for record in records for i in record["seen"]["val"]) == list(range(7))
    assert "replicates some samples" not in output  # the sampler Lightning inserted repeats none


@pytest.mark.parametrize("strategy", ["ddp_weighted", "fsdp2_weighted", "ddp"])
@pytest.mark.parametrize("counter", [False, True])
@pytest.mark.parametrize("stop_at", [2, 5])
def test_a_mid_epoch_resume_trains_exactly_the_batches_of_the_uninterrupted_run(tmp_path, strategy, counter, stop_at):
    # 8 steps of A = 2 over a StatefulDataLoader with the user's own DistributedSampler; the checkpoint at
    # `stop_at` holds the loader state of what was trained, also where ItemCounter fetched a window ahead
    if counter and strategy == "ddp":
        pytest.skip("ItemCounter needs a weighted strategy")
    base = EdgeConfig(scenario="resume", strategy=strategy, counter=counter)
    whole, _ = edges(base, tmp_path / "whole")
    first, _ = edges(dataclasses.replace(base, stop_at=stop_at), tmp_path / "first")
    checkpoint = first[0]["checkpoint"]
    assert checkpoint and first[0]["global_step"] == stop_at
    resumed, _ = edges(dataclasses.replace(base, stop_at=stop_at, resume=checkpoint), tmp_path / "resumed")
    for a, b, c in zip(whole, first, resumed, strict=True):
        assert c["global_step"] == a["global_step"] == 8
        assert b["seen"]["train"] + c["seen"]["train"] == a["seen"]["train"]  # no batch skipped, none twice
        for name, value in a["full"].items():
            assert torch.equal(c["full"][name], value), name  # bit for bit


@pytest.mark.parametrize(("strategy", "counter"), [("ddp_weighted", False), ("ddp_weighted", True), ("ddp", False)])
def test_a_loss_spike_on_one_rank_is_left_to_spike_detection_as_under_ddp(tmp_path, strategy, counter):
    # rank 1's loss turns inf at one step: the counts stay exact, and SpikeDetection stops every rank
    records, _ = edges(EdgeConfig(scenario="spike", strategy=strategy, counter=counter), tmp_path)
    assert [record["outcome"] for record in records] == ["TrainingSpikeException"] * 2


@pytest.mark.parametrize("counter", [False, True])
def test_stochastic_weight_averaging_recomputes_batch_norm_statistics_as_under_ddp(tmp_path, counter):
    # SWA's last epoch runs training steps without a backward, and one optimizer step: it is taken, as under ddp
    weighted, _ = edges(EdgeConfig(scenario="swa", counter=counter), tmp_path)
    plain, _ = edges(EdgeConfig(scenario="swa", strategy="ddp"), tmp_path)
    assert weighted[0]["global_step"] == plain[0]["global_step"]
    assert all(torch.isfinite(value).all() for value in weighted[0]["full"].values())
