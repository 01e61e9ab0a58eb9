"""A process that exits right after its last collective exits cleanly (2 gloo processes).

The thread that completes a collective takes the GIL once more after waking the waiter, to release the work, which
holds the Python context of the code that launched it. A process that exits in between aborts ("terminate called
without an active exception"). Without the exit settle the launched ranks register (`launcher.settle_at_exit`), 14
of 40 runs of ``exit_worker.py --path backward`` did; eight runs (four per path) all end with exit code 0.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from pathlib import Path

import launcher
import pytest
import torch.distributed as dist
from launcher import run

WORKER = Path(__file__).parent / "exit_worker.py"
RUNS = 4  # per path; with the abort back, the four backward runs would all pass once in six (0.65 ** 4)


@pytest.mark.repeat
@pytest.mark.parametrize("path", ["window", "backward"])
def test_processes_exit_cleanly_right_after_the_last_collective(path: str) -> None:
    command = [sys.executable, str(WORKER), "--path", path]
    for attempt in range(RUNS):
        done = run([command, command], 60, env=[{"RANK": "0", "WORLD_SIZE": "2"}, {"RANK": "1", "WORLD_SIZE": "2"}])
        assert done.returncode == 0, (attempt, done.stdout[-4000:])


def test_the_exit_settle_waits_only_while_a_process_group_exists(tmp_path: Path) -> None:
    assert isinstance(launcher.EXIT_SETTLE_S, float) and 0 < launcher.EXIT_SETTLE_S < 1
    start = time.perf_counter()
    launcher._settle()
    assert time.perf_counter() - start < launcher.EXIT_SETTLE_S  # no process group: no wait
    assert not dist.is_initialized()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=30))
    try:
        start = time.perf_counter()
        launcher._settle()
        assert time.perf_counter() - start >= launcher.EXIT_SETTLE_S
    finally:
        dist.destroy_process_group()
