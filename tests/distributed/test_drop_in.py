"""A LightningModule, its loaders and callbacks written for `"ddp"` run unchanged under `"ddp_weighted"`."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from drop_in_worker import Config
from harness import fit
from scenario import Config as Scenario
from scenario import max_relative_error, reference


def run(config: Config, tmp_path: Path, expect_failure: bool = False) -> Any:
    if expect_failure:
        return fit(config, tmp_path, timeout=150, expect_failure=True, script="drop_in_worker.py").stdout
    return fit(config, tmp_path, timeout=150, output=True, script="drop_in_worker.py")


@pytest.mark.parametrize(("precision", "rtol"), [("32-true", 1e-5), ("bf16-mixed", 2e-2)])
def test_a_docs_style_module_with_lightnings_callbacks_trains_like_ddp_when_every_rank_counts_the_same(
    tmp_path, precision, rtol
):
    # 64 items over 2 ranks in batches of 8: every microbatch counts 8 examples, so the objectives coincide
    (weighted, _), (plain, _) = (
        run(Config(strategy=strategy, scenario="docs", precision=precision), tmp_path / strategy)
        for strategy in ("ddp_weighted", "ddp")
    )
    for mine, theirs in zip(weighted, plain, strict=True):
        assert mine["fit"]["global_step"] == theirs["fit"]["global_step"]
        assert mine["after"]["stopped_epoch"] == theirs["after"]["stopped_epoch"] > 0  # EarlyStopping fired
        theirs_params = [p.double() for p in theirs["fit"]["params"]]  # SWA's and EMA's averages
        assert max_relative_error(mine["fit"]["params"], theirs_params) < rtol
        assert mine["after"]["best_score"] == pytest.approx(theirs["after"]["best_score"], rel=rtol)
        for stage in ("validate", "test"):
            assert mine["after"][stage][0] == pytest.approx(theirs["after"][stage][0], rel=rtol, abs=rtol)
        assert len(mine["after"]["predict"]) == len(theirs["after"]["predict"]) > 0
        saved = mine["after"]["saved"]  # torch.save of the module after the fit, loaded back
        assert not {"on_train_batch_start", "lr_scheduler_step"} & set(saved["attributes"])
        assert all(torch.equal(a, b) for a, b in zip(saved["params"], mine["fit"]["params"], strict=True))


def _draws(records: list[dict[str, Any]]) -> list[list[float]]:
    return [sorted(v for batch in r["seen"]["train"] for row in batch for v in row) for r in records]


@pytest.mark.parametrize(
    ("strategy", "uneven", "counter"),
    [("ddp_weighted", False, False), ("ddp_weighted", True, False), ("ddp_weighted", True, True), ("ddp", 0, False)],
)
def test_seeded_loader_workers_draw_differently_on_every_rank(tmp_path, strategy, uneven, counter):
    records, _ = run(Config(strategy=strategy, scenario="seeding", uneven=uneven, counter=counter), tmp_path)
    rank0, rank1 = _draws(records)
    assert rank0 and rank1
    assert not set(rank0) & set(rank1)  # Lightning's worker_init_fn seeds each rank's workers apart
    assert records[0]["fit"]["loader"] == records[1]["fit"]["loader"] == "DataLoader"
    assert records[0]["fit"]["counts_ahead"] is (None if strategy == "ddp" else counter)


def test_lightnings_worker_checks_see_the_train_loader_of_uneven_ranks(tmp_path):
    _, output = run(Config(scenario="seeding", uneven=True, spawn_workers=True), tmp_path)
    assert "Consider setting `persistent_workers=True` in 'train_dataloader'" in output


def test_a_loader_subclass_that_keeps_no_init_argument_shards_train_val_and_test_without_repeats(tmp_path):
    records, _ = run(Config(scenario="subclass"), tmp_path)
    for stage, items, scale in (("train", 12, 10.0), ("val", 9, 1.0), ("test", 7, 1.0)):
        values = sorted(v for r in records for batch in r["seen"][stage] for row in batch for v in row)
        assert values == [i * scale for i in range(items)], stage  # every item once over the ranks


@pytest.mark.parametrize("mode", ["max_size_cycle", "max_size", "min_size"])
def test_every_combined_loader_mode_gives_the_batches_plain_ddp_gives(tmp_path, mode):
    weighted, plain = (
        run(Config(strategy=strategy, scenario="combined", mode=mode), tmp_path / strategy)[0]
        for strategy in ("ddp_weighted", "ddp")
    )
    for mine, theirs in zip(weighted, plain, strict=True):
        assert mine["seen"]["train"] == theirs["seen"]["train"]
        assert mine["fit"]["global_step"] == theirs["fit"]["global_step"]
    if mode == "max_size":
        assert len(weighted[0]["seen"]["train"]) == 4  # the longer loader's 4 batches, the shorter one then None


def test_a_bare_loss_of_a_combined_batch_is_refused_on_every_rank_before_any_step(tmp_path):
    # Lightning's batch size of {"first": ..., "second": ...} is the first loader's rows alone: never guessed
    output = run(Config(scenario="combined", bare=True), tmp_path, expect_failure=True)
    message = "training_step returned no count for a batch that combines several dataloaders"
    assert output.count(f"ValueError: on 2 ranks, {message}") == 2, output[-3000:]
    assert "ItemCounter('examples')" in output


def test_an_item_counter_with_a_combined_loader_counts_the_combined_batch_after_it_is_combined(tmp_path):
    # the batch is whole only once Lightning combines the two loaders: it is counted then, on the device batch
    weighted, plain = (
        run(Config(strategy=strategy, scenario="combined", counter=counter), tmp_path / strategy)[0]
        for strategy, counter in (("ddp_weighted", True), ("ddp", False))
    )
    for mine, theirs in zip(weighted, plain, strict=True):
        assert mine["fit"]["counts_ahead"] is False
        assert mine["fit"]["comm_hook"] is None
        assert mine["seen"]["train"] == theirs["seen"]["train"]
        assert all(torch.isfinite(p).all() for p in mine["fit"]["params"])


def test_loaders_of_a_combined_loader_that_differ_across_ranks_are_refused_on_every_rank(tmp_path):
    output = run(Config(scenario="combined", uneven=True), tmp_path, expect_failure=True)
    message = "the loaders of a CombinedLoader in mode 'max_size' give the ranks different numbers of batches"
    assert output.count(message) == 2, output[-3000:]
    each = "loader 0: rank 0: 2, rank 1: 2; loader 1: rank 0: 4, rank 1: 5"
    assert f"(rank 0: 4, rank 1: 5; each loader: {each})" in output


@pytest.mark.parametrize("shape", [[1], [1, 1]])
@pytest.mark.parametrize("bare", [False, True])
def test_a_one_element_loss_of_any_shape_trains_the_reference(tmp_path, shape, bare):
    config = Scenario(accumulate=2, mode="examples", loss_shape=shape, bare_loss=bare)
    assert max_relative_error(fit(config, tmp_path)[0]["params"], reference(config)["params"]) < 1e-5


@pytest.mark.parametrize(("accumulate", "precision"), [(1, "32-true"), (3, "32-true"), (3, "bf16-true")])
def test_item_sum_losses_marked_as_sums_train_the_reference_and_plain_ddp_does_not(tmp_path, accumulate, precision):
    config = Scenario(accumulate=accumulate, batches=7, epochs=2, mode="tokens", item_sum=True, precision=precision)
    expected = reference(config)
    rtol = 1e-5 if precision == "32-true" else 5e-2
    assert max_relative_error(fit(config, tmp_path)[0]["params"], expected["params"]) < rtol
    plain = fit(dataclasses.replace(config, strategy="ddp"), tmp_path)  # sums averaged over ranks: P times the step
    assert max_relative_error(plain[0]["params"], expected["params"]) > 1e-2


def test_a_dict_without_count_counts_examples_and_says_so_once_on_rank_zero(tmp_path):
    config = Scenario(accumulate=2, mode="examples", no_count=True)
    result, output = fit(config, tmp_path, output=True)
    assert max_relative_error(result[0]["params"], reference(config)["params"]) < 1e-5
    assert output.count("training_step gave no count, so each microbatch counts its examples") == 1
    assert "ItemCounter('tokens', key='labels', shift=True)" in output


def test_choosing_examples_explicitly_with_item_counter_silences_the_notice(tmp_path):
    config = Scenario(accumulate=2, mode="examples", bare_loss=True, counter="examples")
    result, output = fit(config, tmp_path, output=True)
    assert max_relative_error(result[0]["params"], reference(config)["params"]) < 1e-5
    assert "training_step gave no count" not in output


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_an_unused_parameter_names_the_weighted_strategy_that_finds_unused_parameters(tmp_path, precision):
    config = Scenario(unused_layer=True, precision=precision, accumulate=2)
    done = fit(config, tmp_path, expect_failure=True)
    hint = "`strategy='ddp_weighted_find_unused_parameters_true'`"
    assert done.stdout.count(hint) == 2, done.stdout[-4000:]  # on every rank
    assert "no count payload" not in done.stdout and "ddp_find_unused_parameters_true" not in done.stdout
