"""The oracle: every engine, count path and front end trains the float64 gradient of the global item mean.

One scenario (`cells.SCENARIO`: 2 ranks holding uneven token-masked microbatches, rank 1's several times rank 0's
tokens, 2 epochs) and one float64 single-process reference (`scenario.reference`) for every cell of engine (DDP,
FSDP2, FSDP1) × count path (after: a count returned by `training_step` or given to `fabric.backward(loss,
count=n)`; ahead: `ItemCounter` or `fabric.strategy.count_ahead`) × front end (Trainer, Fabric; Fabric has no
FSDP1). Each cell's plain counterpart (`"ddp"`, `ModelParallelStrategy`, FSDP1 on the CPU, plain Fabric) fails the
same check: its mean of rank means re-weights the items.
"""

from __future__ import annotations

from cells import EVERY_CELL, PLAIN, SCENARIO, WEIGHTED, counted_where_the_path_says, departures, train
from harness import fit
from scenario import Config, max_relative_error, reference


@EVERY_CELL
def test_every_engine_count_path_and_front_end_trains_the_float64_reference_and_its_plain_counterpart_does_not(
    tmp_path, front, engine, path
):
    # windows of 3 microbatches of 7, the short last window of each epoch (1 microbatch) included
    expected = reference(Config(accumulate=3, **SCENARIO))
    weighted = train(front, WEIGHTED[engine], path, tmp_path, accumulate=3)
    plain = train(front, PLAIN[engine], None, tmp_path, accumulate=3)

    assert departures(weighted, expected) == []
    assert [w[1] for w in weighted[0]["windows"]] == expected["items"]  # N of every window, the short ones too
    assert counted_where_the_path_says(front, path, weighted)
    if front == "trainer" and engine == "ddp":
        assert all(rank["comm_hook"] is None for rank in weighted)  # DDP's own reducer averages the buckets
    if front == "fabric":  # fabric.all_reduce(..., "mean") of an integer does not floor (Lightning's does)
        assert [rank["mean_of_ints"] for rank in weighted] == [3.5, 3.5]
        assert [rank["mean_of_ints"] for rank in plain] == [3.0, 3.0]
    # the same check fails for the plain counterpart, and not by a rounding error
    assert {"parameters", "gradient norms"} <= set(departures(plain, expected))
    assert max_relative_error(plain[0]["params"], expected["params"]) > 1e-2


@EVERY_CELL
def test_windows_of_one_microbatch_train_the_same_reference(tmp_path, front, engine, path):
    # every microbatch its own optimizer step (the plain counterparts fail this check in the test above)
    expected = reference(Config(accumulate=1, **SCENARIO))
    weighted = train(front, WEIGHTED[engine], path, tmp_path, accumulate=1)
    assert departures(weighted, expected) == []
    assert [w[1] for w in weighted[0]["windows"]] == expected["items"]
    assert counted_where_the_path_says(front, path, weighted)


def test_the_objective_does_not_depend_on_the_number_of_ranks(tmp_path):
    # the same items per optimizer step, held by 3 ranks or merged into 1: both train the float64 reference
    three = Config(strategy="ddp_weighted", world_size=3, accumulate=2, batches=4, epochs=2, mode="weights")
    one = Config(**{**vars(three), "world_size": 1, "merged_from": 3})
    expected = reference(three)
    assert max_relative_error(reference(one)["params"], expected["params"]) < 1e-12  # the same objective
    spread = [fit(config, tmp_path)[0]["params"] for config in (three, one)]
    assert max_relative_error(spread[0], expected["params"]) < 1e-5
    assert max_relative_error(spread[1], expected["params"]) < 1e-5
    assert max_relative_error(spread[0], [p.double() for p in spread[1]]) < 1e-5
