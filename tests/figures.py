"""Prints the oracle figures of every engine: the parameter error of weighted and plain training against the
float64 single-process reference of the global item mean (uneven token-masked data, 2 ranks, 2 epochs).

    PYTHONPATH=tests:tests/distributed:examples python tests/figures.py

The oracle asserts bounds on the same runs, cell by cell (`distributed/cells.py`, `distributed/test_oracle.py`);
this prints the measured values: max |θ − θ_ref| / max |θ_ref| after training, and whether the ranks agree exactly.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from cells import CELLS, PLAIN, SCENARIO, WEIGHTED, train
from scenario import Config, max_relative_error, reference


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="figures-"))
    print(f"{'cell':<22}{'A':>3}{'weighted':>12}{'plain':>12}  replicas equal")
    for front, engine, path in CELLS:
        for accumulate in (1, 3):
            expected = reference(Config(accumulate=accumulate, **SCENARIO))["params"]
            ours = train(front, WEIGHTED[engine], path, tmp, accumulate=accumulate)
            theirs = train(front, PLAIN[engine], None, tmp, accumulate=accumulate)
            same = all(torch.equal(a, b) for a, b in zip(ours[0]["params"], ours[1]["params"], strict=True))
            errors = (max_relative_error(run[0]["params"], expected) for run in (ours, theirs))
            name = f"{front} {engine} {path}"
            print(f"{name:<22}{accumulate:>3}" + "".join(f"{error:>12.2e}" for error in errors) + f"  {same}")


if __name__ == "__main__":
    main()
