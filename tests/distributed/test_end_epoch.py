"""``on_train_batch_start`` returning -1 inside a window: Lightning ends the epoch, steps no optimizer for the half
window and zeroes its gradient at the next epoch's first batch, so its counts go too (against the float64 reference)."""

from __future__ import annotations

import dataclasses

import pytest
from harness import fit
from scenario import Config, max_relative_error, reference
from sharded import ShardedConfig, fit_sharded

# 6 microbatches per rank and epoch in windows of 3; in epoch 0 the module ends the epoch at batch 4, after
# batch 3 of the second window has run its forward and backward
ENDED = Config(accumulate=3, epochs=2, end_epoch_at=(0, 4), precision="64-true")


@pytest.mark.parametrize(
    "change",
    [
        {},  # a count returned by training_step, on the device
        {"python_count": True},  # a count returned as a Python number
        {"counter": "quiet", "bare_loss": True},  # counted ahead by an ItemCounter
    ],
)
def test_an_epoch_ended_mid_window_drops_that_windows_counts_with_its_gradient(tmp_path, change):
    config = dataclasses.replace(ENDED, **change)
    records = fit(config, tmp_path)
    expected = reference(config)
    assert [w[1] for w in records[0]["windows"]] == expected["items"]  # N of each window that stepped
    for record in records:
        assert max_relative_error(record["params"], expected["params"]) < 1e-12


def test_plain_ddp_misses_the_same_reference(tmp_path):
    # the control: it divides each microbatch's mean by 3 and averages the ranks' means
    config = dataclasses.replace(ENDED, strategy="ddp")
    records = fit(config, tmp_path)
    assert max_relative_error(records[0]["params"], reference(config)["params"]) > 1e-2


def test_fsdp2_drops_the_cut_windows_counts_too(tmp_path):
    # FSDP2 reduce-scatters the half window's microbatch at once; Lightning zeroes those shards at the next epoch
    # a float64 model, which "32-true" leaves alone under FSDP2 (Lightning refuses "64-true" there)
    config = ShardedConfig(
        **{**dataclasses.asdict(ENDED), "strategy": "fsdp2_weighted", "precision": "32-true"}, float64=True
    )
    records = fit_sharded(config, tmp_path)
    expected = reference(config)
    assert [w[1] for w in records[0]["windows"]] == expected["items"]
    assert max_relative_error(records[0]["params"], expected["params"]) < 1e-12
