"""The README's first command: the worked trace on 2 CPU processes, weighted against plain DDP."""

from __future__ import annotations

import sys

from launcher import ROOT, run


def test_worked_trace_example_gives_9_75_with_ddp_weighted_and_9_8_with_ddp():
    done = run([sys.executable, str(ROOT / "examples" / "worked_trace.py")], timeout=240)
    assert done.returncode == 0, done.stdout[-4000:]
    rows = {line.split()[0]: float(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("ddp")}
    assert rows["ddp_weighted_fork"] == 9.75  # 10 − 0.1 · (2·1 + 6·3)/8, exact in fp32
    assert abs(rows["ddp_fork"] - 9.8) < 1e-6  # 10 − 0.1 · (1 + 3)/2, printed to 6 decimals
