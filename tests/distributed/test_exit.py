"""A process that exits right after its last collective exits cleanly (2 gloo processes).

The thread that completes a collective takes the GIL once more after waking the waiter, to release the work, which
holds the Python context of the code that launched it. A process that exits in between aborts ("terminate called
without an active exception"). Without the exit settle of `lightning_weighted._compat`, 14 of 40 runs of
``exit_worker.py --path backward`` did; eight runs (four per path) all end with exit code 0.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from launcher import run

WORKER = Path(__file__).parent / "exit_worker.py"
RUNS = 4  # per path; with the abort back, the four backward runs would all pass once in six (0.65 ** 4)


@pytest.mark.parametrize("path", ["window", "backward"])
def test_processes_exit_cleanly_right_after_the_last_collective(path: str) -> None:
    command = [sys.executable, str(WORKER), "--path", path]
    for attempt in range(RUNS):
        done = run([command, command], 60, env=[{"RANK": "0", "WORLD_SIZE": "2"}, {"RANK": "1", "WORLD_SIZE": "2"}])
        assert done.returncode == 0, (attempt, done.stdout[-4000:])
