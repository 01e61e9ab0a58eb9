"""The oracle's cells, engine × count path × front end, and how each trains the one scenario of `scenario.Config`.

Shared by `test_oracle.py` and `test_host_reads.py`, which run every cell against the float64 reference through one
check (`departures`), and by `tests/figures.py`, which prints the measured values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fabric_worker import FabricConfig
from harness import fabric_fit, fit
from scenario import Config, identical, max_relative_error
from sharded import ShardedConfig, fit_sharded

WEIGHTED = {"ddp": "ddp_weighted", "fsdp2": "fsdp2_weighted", "fsdp1": "fsdp_weighted"}
PLAIN = {"ddp": "ddp", "fsdp2": "fsdp2", "fsdp1": "fsdp"}  # FSDP1: Lightning's FSDPStrategy, enabled on the CPU
# (front end, engine, count path)
CELLS = [(front, engine, path) for front in ("trainer", "fabric") for engine in WEIGHTED for path in ("after", "ahead")]
EVERY_CELL = pytest.mark.parametrize(("front", "engine", "path"), [pytest.param(*c, id="-".join(c)) for c in CELLS])
# loss parts are counted ahead: engine × front end
EVERY_PARTS_CELL = pytest.mark.parametrize(
    ("front", "engine"), [pytest.param(f, e, id=f"{f}-{e}") for f in ("trainer", "fabric") for e in WEIGHTED]
)
# 2 ranks holding uneven token-masked microbatches (rank 1's several times rank 0's tokens), 7 each per epoch
SCENARIO: dict[str, Any] = {"batches": 7, "epochs": 2, "mode": "tokens"}


def train(front: str, strategy: str, path: str | None, tmp_path: Path, **fields: Any) -> list[dict[str, Any]]:
    """Trains the scenario with one front end and strategy; `path` chooses how a weighted run counts (None: plain).

    Counted after, `training_step` returns `{"loss", "count"}` and a Fabric loop passes `fabric.backward(loss,
    count=n)`; counted ahead, an `ItemCounter` counts the mask and `training_step` returns a bare mean, and a Fabric
    loop hands each window's counts to `fabric.strategy.count_ahead` before its first forward.
    """
    fields = {**SCENARIO, **fields}
    if front == "fabric":
        return fabric_fit(FabricConfig(strategy=strategy, ahead=path == "ahead", **fields), tmp_path)
    if path == "ahead":
        fields = {**fields, "counter": "quiet", "bare_loss": True}
    if strategy.startswith("fsdp"):
        return fit_sharded(ShardedConfig(strategy=strategy, **fields), tmp_path)
    return fit(Config(strategy=strategy, **fields), tmp_path)


RTOL = 1e-5


def departures(records: list[dict[str, Any]], expected: dict[str, Any]) -> list[str]:
    """The oracle's checks that a run fails: none where it trains the float64 reference."""
    first = records[0]
    checks = {
        "parameters": max_relative_error(first["params"], expected["params"]) < RTOL,
        "replicas": all(identical(first["params"], rank["params"]) for rank in records[1:]),
        "gradient norms": [s["norm"] for s in first["steps"]] == pytest.approx(expected["norms"], rel=RTOL),
    }
    return [name for name, passed in checks.items() if not passed]


def counted_where_the_path_says(front: str, path: str, records: list[dict[str, Any]]) -> bool:
    """Whether the Trainer counted ahead exactly where an ItemCounter was given (a count-ahead Fabric loop passes
    no count to `fabric.backward`, which raises without one)."""
    return front == "fabric" or all(rank["counts_ahead"] is (path == "ahead") for rank in records)
