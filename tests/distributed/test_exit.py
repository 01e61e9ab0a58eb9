"""A process whose gloo threads ran the weighted hook's Python callbacks exits cleanly (2 gloo processes).

The thread that completes a collective's future takes the GIL once more after waking the waiter, to release its
Python callbacks; a process that exits in between aborts ("terminate called without an active exception"). Without
the wait at exit of `lightning_weighted.reduce.callbacks`, about one run of four of ``exit_worker.py`` does. Eight
runs (four per test) all end with exit code 0.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from launcher import run

WORKER = Path(__file__).parent / "exit_worker.py"
RUNS = 4  # per test: with the abort one run in four, both tests pass by chance once in ten (0.75 ** 8)


@pytest.mark.parametrize("rides", [True, False], ids=["riding", "own-all-reduce"])
def test_processes_exit_cleanly_right_after_the_last_weighted_window(rides: bool) -> None:
    command = [sys.executable, str(WORKER), *(["--rides"] if rides else [])]
    for attempt in range(RUNS):
        done = run([command, command], 60, env=[{"RANK": "0", "WORLD_SIZE": "2"}, {"RANK": "1", "WORLD_SIZE": "2"}])
        assert done.returncode == 0, (attempt, done.stdout[-4000:])
