"""Trains a `scenario.Config` on its ranks (see `launcher.ranks`) and loads what every rank recorded."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from launcher import ROOT, Done, ranks, run
from scenario import Config

HERE = Path(__file__).parent
__all__ = ["HERE", "ROOT", "fabric_fit", "fit", "logged_rows", "run_worker", "strategy_reads"]


def logged_rows(tmp_path: Path, column: str) -> list[dict[str, str]]:
    """The rows of the run's CSV log (rank 0's, under ``<out>.logs``) where ``column`` holds a value."""
    (path,) = tmp_path.glob("*.logs/metrics.csv")
    with path.open() as handle:
        return [row for row in csv.DictReader(handle) if row.get(column)]


def strategy_reads(record: dict[str, Any], kind: str, ours: bool = False) -> Counter[int]:
    """Host reads of ``kind`` tensors (``reads.ReadSpy``) per optimizer step; ``ours``: by lightning_weighted only."""
    return Counter(
        mark[0]
        for read_kind, _, module, mark in record["reads"]
        if read_kind == kind and mark is not None and (not ours or module.startswith("lightning_weighted"))
    )


def run_worker(
    script: str, config: Any, tmp_path: Path, timeout: float, check_leftovers: bool = False, lightning: bool = False
) -> tuple[Path, Done]:
    """Runs a rank script of this folder on `config` (a dataclass); returns its output prefix and the run.

    The ranks are forked ready-imported (`launcher.ranks`), or, with `lightning=True`, started by Lightning's own
    launcher for the strategy's name (the script re-executed per rank, or forked) from one fresh process.
    """
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / f"{Path(script).stem}-{config.strategy}-{os.urandom(4).hex()}"
    arguments = ["--config", json.dumps(dataclasses.asdict(config)), "--out", str(out)]
    if lightning:
        return out, run([sys.executable, str(HERE / script), *arguments], timeout, check_leftovers=check_leftovers)
    return out, ranks(HERE / script, arguments, config.world_size, timeout, check_leftovers=check_leftovers)


def fit(
    config: Config,
    tmp_path: Path,
    timeout: float = 180,
    expect_failure: bool | None = False,
    output: bool = False,
    lightning: bool = False,
    script: str = "worker.py",
) -> Any:
    """Trains `config` on its ranks with a rank script of this folder; returns each rank's record (what it saved
    with `torch.save` to `<out>.rank<r>`), or the finished run when it must fail.

    With `expect_failure=None` either may happen: the records when every rank saved one, else the run.
    With `output=True` a successful run returns `(records, output)`; `lightning` as in `run_worker`.
    """
    out, done = run_worker(script, config, tmp_path, timeout, lightning=lightning)
    if expect_failure is None:
        if done.returncode == 0 and all(Path(f"{out}.rank{r}").exists() for r in range(config.world_size)):
            return [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(config.world_size)]
        return done
    if expect_failure:
        assert done.returncode != 0, done.stdout[-4000:]
        return done
    assert done.returncode == 0, done.stdout[-8000:]
    records = [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(config.world_size)]
    return (records, done.stdout) if output else records


def fabric_fit(
    config: Any, tmp_path: Path, timeout: float = 120, expect_failure: bool = False, output: bool = False
) -> Any:
    """Runs `fabric_worker.py` on the config's ranks; returns every rank's record (with `error` when one raised),
    and with `output=True` what the ranks printed too."""
    out, done = run_worker("fabric_worker.py", config, tmp_path, timeout)
    assert (done.returncode != 0) == expect_failure, done.stdout[-8000:]
    records = [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(config.world_size)]
    return (records, done.stdout) if output else records
