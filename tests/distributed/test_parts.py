"""Loss parts: each part the mean over its own items, over every rank and microbatch of the optimizer step.

The oracle's scenario (`cells.SCENARIO`) with two parts (`scenario.part_means`): "tokens", the token mean of the
squared error, and "positive", a penalty over the tokens whose first feature is positive. Their counts are not
proportional across ranks and microbatches; the "positive" part holds nothing in one microbatch of rank 0 and in a
whole window on every rank. The float64 reference trains `Σ_k (1/N_k) Σ loss_k` of each window.
"""

from __future__ import annotations

import dataclasses

from cells import EVERY_PARTS_CELL, PLAIN, SCENARIO, WEIGHTED, departures, train
from fabric_worker import FabricConfig
from harness import fabric_fit, fit
from scenario import Config, max_relative_error, reference

# rank 0's microbatch 1, and the whole second window (microbatches 3-5) on both ranks, hold no "positive" item
EMPTY = ((0, 1), *((r, k) for r in (0, 1) for k in (3, 4, 5)))
PARTS = {**SCENARIO, "parts": True, "part_empty": EMPTY, "accumulate": 3}
# rank 0's microbatch 2 holds no item of any part, and its part means are 0/0 (NaN): in each epoch's first window,
# whose N is summed as it starts
MASKED = {**PARTS, "masked": ((0, 2),)}


@EVERY_PARTS_CELL
def test_every_engine_and_front_end_averages_each_part_over_its_own_global_count(tmp_path, front, engine):
    expected = reference(Config(**MASKED))
    weighted = train(front, WEIGHTED[engine], "ahead", tmp_path, **MASKED)
    assert departures(weighted, expected) == []
    assert [w[1] for w in weighted[0]["windows"]] == expected["items"]  # N_tokens + N_positive of every window
    # plain DDP trains the sum of each rank's part means: the same check fails, and not by a rounding error
    plain = train(front, PLAIN[engine], None, tmp_path, **PARTS)
    assert max_relative_error(plain[0]["params"], reference(Config(**PARTS))["params"]) > 1e-2


def test_one_part_reduces_to_the_item_mean_of_that_part(tmp_path):
    # the "positive" part empty everywhere: the objective is the token mean alone, as without parts
    every = tuple((r, k) for r in (0, 1) for k in range(7))
    with_parts = reference(Config(**{**PARTS, "part_empty": every}))
    alone = reference(Config(**{**SCENARIO, "accumulate": 3, "part_empty": every}))
    assert max_relative_error(with_parts["params"], alone["params"]) < 1e-12  # the reference agrees with itself
    trained = train("trainer", "ddp_weighted", "ahead", tmp_path, **{**PARTS, "part_empty": every})
    assert max_relative_error(trained[0]["params"], alone["params"]) < 1e-5


def test_parts_whose_counts_come_after_the_forward_are_refused_on_every_rank(tmp_path):
    # a gradient accumulated over several parts cannot be divided by each part's N after the backward
    message = "on 2 ranks, {} loss parts ('parts'), each a mean over its own items"
    done = fit(Config(strategy="ddp_weighted", **PARTS), tmp_path, expect_failure=True)  # no ItemCounter
    assert done.stdout.count("ValueError: " + message.format("training_step returned")) == 2, done.stdout[-3000:]
    records = fabric_fit(FabricConfig(strategy="ddp_weighted", **PARTS), tmp_path, expect_failure=True)
    assert all(message.format("fabric.backward got") in record["error"] for record in records)


def test_resuming_a_run_with_parts_mid_epoch_trains_the_uninterrupted_run(tmp_path):
    base = dataclasses.replace(Config(**PARTS), strategy="ddp_weighted", counter="quiet", precision="64-true")
    uninterrupted = fit(base, tmp_path / "u")
    fit(dataclasses.replace(base, epochs=1, checkpoint=True), tmp_path / "a")
    (checkpoint,) = (tmp_path / "a").glob("*.ckpt/epoch=0-step=3.ckpt")
    resumed = fit(dataclasses.replace(base, resume=str(checkpoint)), tmp_path / "b")
    assert max_relative_error(resumed[0]["params"], uninterrupted[0]["params"]) < 1e-12
    assert max_relative_error(resumed[0]["params"], reference(base)["params"]) < 1e-10
