"""The bad-input catalogue: exact counts at any scale and precision, interactions, and clear refusals."""

from __future__ import annotations

import subprocess
import sys

import pytest
from harness import ROOT, fit
from scenario import Config, is_finite, max_relative_error, reference


@pytest.mark.parametrize(
    ("count", "precision"),
    [
        (2**24 + 1, "32-true"),  # fp32 would round it to 2**24
        (2**31, "32-true"),  # int32 overflow bait
        (2**24 + 1, "bf16-mixed"),
        (1001, "bf16-true"),  # bf16 holds 1001 as 1000
        (1001.0, "bf16-true"),  # as a weight sum
        (40000.0, "16-true"),  # fp16 tops out at 65504: two ranks would be inf
    ],
)
def test_the_global_count_is_exact_at_any_scale_and_precision(tmp_path, count, precision):
    config = Config(strategy="ddp_weighted", count_override=count, precision=precision, lr=0.01, batches=3)
    result = fit(config, tmp_path)
    for rank in result:
        assert [items for _, items, _ in rank["windows"]] == [2 * count] * 3  # N == P · count, exactly
        assert is_finite(rank["params"])


def test_large_fp16_counts_keep_gradients_finite_and_on_the_reference(tmp_path):
    # every microbatch weighs 40000 items: the fp16 losses stay mean-sized (n / c, c = 40000); nothing overflows
    config = Config(
        strategy="ddp_weighted", mode="examples", count_override=40000.0, precision="16-true", batches=4, lr=0.05
    )
    result = fit(config, tmp_path)
    # with equal counts everywhere the objective is the mean of microbatch means
    equal = Config(strategy="ddp_weighted", mode="examples", batches=4, lr=0.05, count_override=1.0)
    expected = fit(equal, tmp_path)[0]["params"]
    assert is_finite(result[0]["params"])
    assert max_relative_error(result[0]["params"], [e.double() for e in expected]) < 1e-2  # fp16 steps


def test_gradient_clipping_by_value_clips_the_normalized_gradient(tmp_path):
    config = Config(strategy="ddp_weighted", clip=0.02, clip_algorithm="value", accumulate=2)
    result = fit(config, tmp_path)
    assert max_relative_error(result[0]["params"], reference(config)["params"]) < 1e-5


@pytest.mark.parametrize("python_reducer", [False, True])
def test_a_compiled_model_trains_the_reference(tmp_path, python_reducer):
    # `optimize_ddp="python_reducer"`: compiled autograd averages the buckets instead of DDP's reducer; the weights
    # sit in the losses and in the one multiply after the backward, which any averaging reduction leaves exact
    config = Config(strategy="ddp_weighted", compile=True, accumulate=2, python_reducer=python_reducer)
    result = fit(config, tmp_path, timeout=300)
    assert max_relative_error(result[0]["params"], reference(config)["params"]) < 1e-5


def test_ddp_join_around_training_is_refused_on_every_rank(tmp_path):
    done = fit(Config(strategy="ddp_weighted", join=True), tmp_path, timeout=90, expect_failure=True)
    assert done.stdout.count("RuntimeError: DistributedDataParallel.join() is active around a ddp_weighted") == 2


def test_a_rank_whose_whole_window_is_masked_still_steps_and_the_result_is_defined(tmp_path):
    # rank 1 has no valid item in window 1 (microbatches 2 and 3): it contributes zero, rank 0's items decide
    config = Config(strategy="ddp_weighted", accumulate=2, masked=[(1, 2), (1, 3)], python_count=True)
    result = fit(config, tmp_path)
    assert result[1]["windows"][1][2] == 0.0  # rank 1's local count in that window
    assert max_relative_error(result[0]["params"], reference(config)["params"]) < 1e-5


def test_the_strategy_name_before_the_package_is_imported_is_lightnings_unknown_strategy_error():
    code = "from lightning.pytorch import Trainer; Trainer(strategy='ddp_weighted', accelerator='cpu')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode != 0
    assert "You selected an invalid strategy name: `strategy='ddp_weighted'`" in done.stderr, done.stderr[-2000:]
