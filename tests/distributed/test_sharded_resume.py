"""Sharded and full checkpoints of FSDP2 and FSDP1 save and resume; at a window boundary the run is uninterrupted."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from scenario import max_relative_error, reference
from sharded import ShardedConfig, fit_sharded


def _checkpoint(tmp_path: Path, name: str) -> str:
    (path,) = tmp_path.glob(f"*.ckpt/{name}")
    return str(path)


TOLERANCE = {
    "fsdp2_weighted": 1e-12,  # a float64 model: FSDP2 keeps its dtype (measured: 0.0, sharded and full)
    "fsdp_weighted": 1e-7,  # FSDP1 converts the model to float32 (measured: 0.0, sharded and full)
}


@pytest.mark.parametrize(
    ("strategy", "full", "counts_ahead"),
    [
        *((strategy, full, False) for strategy in TOLERANCE for full in (False, True)),
        *((strategy, False, True) for strategy in TOLERANCE),  # ItemCounter: the counts taken ahead
    ],
)
def test_resuming_fsdp_from_a_sharded_or_full_epoch_end_checkpoint_matches_the_uninterrupted_run(
    tmp_path, strategy, full, counts_ahead
):
    tolerance = TOLERANCE[strategy]
    base = ShardedConfig(
        strategy=strategy,
        accumulate=3,
        batches=7,
        epochs=2,
        lengths=(7, 5),
        float64=strategy == "fsdp2_weighted",
        full_checkpoint=full,
        counter="quiet" if counts_ahead else None,
        bare_loss=counts_ahead,
    )
    uninterrupted = fit_sharded(base, tmp_path / "u")
    fit_sharded(dataclasses.replace(base, epochs=1, checkpoint=True), tmp_path / "a")
    saved = _checkpoint(tmp_path / "a", "epoch=0-step=3.ckpt")
    assert Path(saved).is_file() is full  # a full checkpoint is one file, a sharded one a folder
    resumed = fit_sharded(dataclasses.replace(base, resume=saved), tmp_path / "b")
    difference = max(
        float((a.double() - b.double()).abs().max())
        for a, b in zip(resumed[0]["params"], uninterrupted[0]["params"], strict=True)
    )
    assert difference < tolerance
    assert all(rank["counts_ahead"] is counts_ahead for rank in resumed + uninterrupted)
    assert resumed[0]["global_step"] == uninterrupted[0]["global_step"] == 6
    assert max_relative_error(resumed[0]["params"], reference(base)["params"]) < tolerance * 10
