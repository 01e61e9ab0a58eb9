"""Runs `sharded_worker.py` on its processes (`launcher.ranks`) and loads what every process recorded."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch
from harness import HERE
from launcher import ranks
from sharded_worker import ShardedConfig

__all__ = ["ShardedConfig", "fit_sharded"]


def fit_sharded(config: ShardedConfig, tmp_path: Path, timeout: float = 180, expect_failure: bool = False) -> Any:
    """Trains `config`; returns every process's record, or the finished run when it must fail."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / f"sharded-{config.strategy}-{os.urandom(4).hex()}"
    arguments = ["--config", json.dumps(dataclasses.asdict(config)), "--out", str(out)]
    done = ranks(HERE / "sharded_worker.py", arguments, config.processes, timeout)
    if expect_failure is None:
        return done
    if expect_failure:
        assert done.returncode != 0, done.stdout[-4000:]
        return done
    assert done.returncode == 0, done.stdout[-8000:]
    return [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(config.processes)]
