"""Checkpoint and resume: the window bookkeeping never trains on a stale or double-counted N."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from harness import fit
from scenario import Config, max_relative_error, reference

BASE = Config(strategy="ddp_weighted", accumulate=3, batches=7, epochs=2, precision="64-true", lengths=(7, 5))


def _checkpoint(tmp_path: Path, name: str) -> str:
    (path,) = tmp_path.glob(f"*.ckpt/{name}")
    return str(path)


@pytest.mark.parametrize("counts_ahead", [False, True])
def test_resuming_ddp_from_an_epoch_end_checkpoint_matches_the_uninterrupted_run(tmp_path, counts_ahead):
    # counts ahead: an ItemCounter counts the batches; the checkpoint holds the module's parameters only
    base = dataclasses.replace(BASE, counter="quiet", bare_loss=True) if counts_ahead else BASE
    uninterrupted = fit(base, tmp_path / "u")
    assert uninterrupted[0]["counts_ahead"] is counts_ahead
    fit(dataclasses.replace(base, epochs=1, checkpoint=True), tmp_path / "a")
    saved = torch.load(_checkpoint(tmp_path / "a", "epoch=0-step=3.ckpt"), weights_only=False)
    assert not [key for key in saved["state_dict"] if "rider" in key]
    assert len(saved["optimizer_states"][0]["param_groups"][0]["params"]) == len(uninterrupted[0]["params"])
    resumed = fit(dataclasses.replace(base, resume=_checkpoint(tmp_path / "a", "epoch=0-step=3.ckpt")), tmp_path / "b")
    difference = max(
        float((a - b).abs().max()) for a, b in zip(resumed[0]["params"], uninterrupted[0]["params"], strict=True)
    )
    assert difference < 1e-8  # fp64
    assert resumed[0]["global_step"] == uninterrupted[0]["global_step"] == 6
    assert max_relative_error(resumed[0]["params"], reference(BASE)["params"]) < 1e-10


def test_resuming_mid_window_restarts_the_window_and_counts_only_the_items_seen_after(tmp_path):
    # rank 0 and 1 fail in batch 4, the middle of the window of batches 3, 4, 5; batch 3's gradient is lost
    crashed = fit(dataclasses.replace(BASE, checkpoint=True, raise_at=[0, 4]), tmp_path / "a", expect_failure=True)
    assert "injected failure at epoch 0, batch 4" in crashed.stdout
    resumed = fit(dataclasses.replace(BASE, resume=_checkpoint(tmp_path / "a", "on_exception.ckpt")), tmp_path / "b")
    seen: dict[int, float] = defaultdict(float)
    for rank in resumed:
        for (step, items), padding in zip(rank["batches"], rank["padding"], strict=True):
            seen[step] += 0.0 if padding else items  # a replay of an exhausted rank counts nothing
    windows = resumed[0]["windows"]
    assert windows[0][0] == 1  # the checkpoint holds one completed step
    for step, items, _ in windows:
        assert items == seen[step]  # N is exactly the items trained after the resume, nothing stale
    assert resumed[0]["global_step"] == 6
    assert all(torch.isfinite(p).all() for p in resumed[0]["params"])


def test_resuming_on_one_rank_keeps_the_objective_of_two(tmp_path):
    fit(dataclasses.replace(BASE, epochs=1, checkpoint=True), tmp_path / "a")
    # one process holding, as microbatch k, both ranks' microbatch k: the same items in every window
    single = dataclasses.replace(
        BASE, world_size=1, merged_from=2, resume=_checkpoint(tmp_path / "a", "epoch=0-step=3.ckpt")
    )
    resumed = fit(single, tmp_path / "b")
    assert max_relative_error(resumed[0]["params"], reference(BASE)["params"]) < 1e-10


SHARED = dataclasses.replace(BASE, items=37, batch_size=3, accumulate=2, lengths=None)


def _refused_on_every_rank(config: Config, tmp_path: Path, message: str) -> None:
    done = fit(config, tmp_path, expect_failure=True)
    assert done.stdout.count(message) == 2, done.stdout[-4000:]  # the same error on both ranks, before a step
    assert "injected failure" not in done.stdout


def test_a_mid_epoch_checkpoint_of_a_plain_strategy_is_refused_on_every_rank_before_any_step(tmp_path):
    # plain DDP keeps rank 0's loader state alone: which items each rank trained of the epoch is lost
    crashed = fit(dataclasses.replace(SHARED, strategy="ddp", checkpoint=True, raise_at=[0, 4]), tmp_path / "a",
                  expect_failure=True)  # fmt: skip
    assert "injected failure at epoch 0, batch 4" in crashed.stdout
    resumed = dataclasses.replace(SHARED, resume=_checkpoint(tmp_path / "a", "on_exception.ckpt"))
    _refused_on_every_rank(resumed, tmp_path / "b", "by a strategy that keeps no place of each rank in its own shard")


def test_a_mid_epoch_checkpoint_of_a_data_set_of_another_length_is_refused_on_every_rank(tmp_path):
    fit(dataclasses.replace(SHARED, checkpoint=True, raise_at=[0, 4]), tmp_path / "a", expect_failure=True)
    resumed = dataclasses.replace(SHARED, items=36, resume=_checkpoint(tmp_path / "a", "on_exception.ckpt"))
    _refused_on_every_rank(resumed, tmp_path / "b", "The train data set holds 36 items where the checkpoint's held 37")
