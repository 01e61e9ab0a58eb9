"""Prints the oracle figures of every engine: the parameter error of weighted and plain training against the
float64 single-process reference of the global item mean (uneven token-masked data, 2 ranks, 2 epochs).

    PYTHONPATH=tests:tests/distributed:examples python tests/figures.py

The tests assert bounds on the same runs (`test_oracle.py`, `test_sharded_oracle.py`, `test_fabric.py`); this
prints the measured values: max |θ − θ_ref| / max |θ_ref| after training, and whether the ranks agree exactly.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from fabric_worker import FabricConfig
from harness import fit
from scenario import Config, max_relative_error, reference
from sharded import ShardedConfig, fit_sharded

Fit = Callable[[Any, Path], list[dict[str, Any]]]


def _fabric(config: Any, tmp: Path) -> list[dict[str, Any]]:
    return fit(config, tmp, script="fabric_worker.py")  # type: ignore[no-any-return]


AHEAD = {"counter": "quiet", "bare_loss": True}  # an ItemCounter counts the batches: counts ahead

ENGINES: list[tuple[str, Any, Fit, str, str, dict[str, Any]]] = [
    # name, config class, how to train it, weighted strategy, plain strategy, the weighted run's settings
    ("Trainer DDP", Config, fit, "ddp_weighted", "ddp", {}),
    ("Trainer DDP ahead", Config, fit, "ddp_weighted", "ddp", AHEAD),
    ("Trainer FSDP2", ShardedConfig, fit_sharded, "fsdp2_weighted", "fsdp2", {}),
    ("Trainer FSDP1", ShardedConfig, fit_sharded, "fsdp_weighted", "fsdp", {}),
    ("Fabric DDP", FabricConfig, _fabric, "ddp_weighted", "ddp", {}),
    ("Fabric FSDP2", FabricConfig, _fabric, "fsdp2_weighted", "fsdp2", {}),
]


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="figures-"))
    print(f"{'engine':<20}{'A':>3}{'weighted':>12}{'plain':>12}  replicas equal")
    for name, config_class, train, weighted, plain, settings in ENGINES:
        for accumulate in (1, 3):
            config = config_class(strategy=plain, accumulate=accumulate, batches=7, epochs=2, mode="tokens")
            expected = reference(config)["params"]
            ours = train(dataclasses.replace(config, strategy=weighted, **settings), tmp)
            theirs = train(config, tmp)
            same = all(torch.equal(a, b) for a, b in zip(ours[0]["params"], ours[1]["params"], strict=True))
            errors = (max_relative_error(run[0]["params"], expected) for run in (ours, theirs))
            print(f"{name:<20}{accumulate:>3}" + "".join(f"{error:>12.2e}" for error in errors) + f"  {same}")


if __name__ == "__main__":
    main()
