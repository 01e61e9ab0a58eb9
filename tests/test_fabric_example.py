"""examples/fabric_lm.py at a tiny size: the Fabric loop with "ddp_weighted" sits on the reference, "ddp" drifts."""

from __future__ import annotations

import json
import sys

from launcher import ROOT, run

STEPS = 12


def test_the_fabric_lm_example_stays_on_the_reference_while_plain_fabric_ddp_drifts(tmp_path):
    command = [sys.executable, str(ROOT / "examples" / "fabric_lm.py"), "--out", str(tmp_path)]
    command += ["--steps", str(STEPS), "--batch-size", "4", "--hidden", "32", "--timeout", "30"]
    done = run(command, timeout=120)
    assert done.returncode == 0, done.stdout[-8000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == STEPS
    weighted, plain = summary["max_distance"]["ddp_weighted"], summary["final_distance"]["ddp"]
    assert weighted < 1e-4  # ‖θ − θ_ref‖ / ‖θ_ref‖ at every step: fp32 rounding only
    assert plain > 1e-3 and plain > 100 * weighted
    loss = summary["final_loss"]
    assert abs(loss["ddp_weighted"] / loss["reference"] - 1) < 1e-5
    assert abs(loss["ddp"] / loss["reference"] - 1) > 1e-3
    assert "ddp_weighted" in done.stdout.splitlines()[-1]  # the printed table ends with the weighted run
