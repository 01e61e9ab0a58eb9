"""The GPU check's FSDP2 checks (NCCL on one rank on a GPU), dry-run on CPU with gloo, and their verdicts."""

from __future__ import annotations

import sys

import pytest
from launcher import ROOT, run
from test_launch import _load_script


def test_gpu_check_dry_run_on_cpu_passes_the_one_rank_fsdp2_traces() -> None:
    only = ["--only", "trace-fsdp2_weighted-1", "--only", "trace-fsdp2-1"]
    done = run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--device", "cpu", *only], 240)

    assert done.returncode == 0, done.stdout[-8000:]
    verdicts = [line.split()[:3] for line in done.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert verdicts == [["PASS", "trace", "fsdp2_weighted"], ["PASS", "trace", "fsdp2"]], done.stdout[-8000:]
    assert "w = 9.750000" in done.stdout and "w = 9.800000" in done.stdout


def test_gpu_check_fails_an_fsdp2_run_that_is_not_sharded_or_lands_where_plain_fsdp2_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpu_check = _load_script(monkeypatch, ROOT / "scripts" / "gpu_check.py")
    right = {"backend": "nccl", "world_size": 1, "device": "cuda:0", "comm_hook": "1 FSDP2 modules", "params": [9.75]}
    trace = gpu_check.Check("trace", "fsdp2_weighted", 1)

    assert gpu_check.judge(trace, "cuda", [{**right, "steps": 1}])[0] is True
    assert gpu_check.judge(trace, "cuda", [{**right, "steps": 1, "params": [9.8]}])[0] is False
    assert gpu_check.judge(trace, "cuda", [{**right, "steps": 1, "comm_hook": "0 FSDP2 modules"}])[0] is False
    assert gpu_check.judge(trace, "cuda", [{**right, "steps": 1, "backend": "gloo"}])[0] is False
