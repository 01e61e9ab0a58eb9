"""How batches reach the step, against the float64 reference of each step's item mean over every rank (2 gloo
ranks, `64-true`, each rank its own uneven batches): `training_step(self, dataloader_iter)`, several train loaders
combined, and logged values kept in float64."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from harness import logged_rows, run_worker
from loaders_worker import LoaderConfig, reference
from scenario import max_relative_error

EXACT = 1e-12  # float64 throughout, summed in another order


def train(config: LoaderConfig, tmp_path: Path, expect_failure: bool = False) -> Any:
    out, done = run_worker("loaders_worker.py", config, tmp_path, timeout=180)
    assert (done.returncode != 0) == expect_failure, done.stdout[-8000:]
    if expect_failure:
        return done.stdout
    return [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(config.world_size)]


def test_logged_losses_of_a_float64_run_are_float64_and_exact(tmp_path):
    # ItemCounter's train/loss at each step and val/loss after training, against the float64 reference
    config = LoaderConfig(scenario="logging", lengths=((3, 2),), count="bare")
    expected = reference(config)
    records = train(config, tmp_path)
    for record in records:
        val_loss = record["metrics"]["val/loss"]
        assert val_loss.dtype == torch.float64
        assert float(val_loss) == pytest.approx(expected["val_loss"], rel=EXACT)
        assert max_relative_error(record["params"], expected["params"]) < EXACT
    logged = [float(row["train/loss"]) for row in logged_rows(tmp_path, "train/loss")]
    assert logged == pytest.approx(expected["losses"], rel=EXACT)
