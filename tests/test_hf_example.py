"""examples/hf_lm.py at a tiny size: a Hugging Face GPT-2 (tied embeddings) with an auxiliary z-loss, padded and
packed: the weighted strategy sits on the float64 reference, the plain one, with the term inside its loss, drifts."""

from __future__ import annotations

import json
import re
import sys
from typing import Any

import pytest
from launcher import ROOT, free_port, run

pytest.importorskip("transformers")

pytestmark = pytest.mark.examples


OPTIONS = {"ddp": ["--engine", "ddp"], "fsdp2_packed": ["--engine", "fsdp2", "--packed"]}


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, dict[str, Any]]]:
    """Both variants, run side by side (each on its own port): what each printed and its summary.json."""
    outs = {name: tmp_path_factory.mktemp(name) for name in OPTIONS}
    script = [sys.executable, str(ROOT / "examples" / "hf_lm.py")]
    commands = [
        [*script, "--out", str(outs[name]), "--steps", "4", *options, "--timeout", "60"]
        for name, options in OPTIONS.items()
    ]
    done = run(commands, timeout=360, env=[{"MASTER_PORT": str(free_port())} for _ in commands])
    assert done.returncode == 0, done.stdout[-8000:]
    printed = re.split(r"^--- .* \(exit -?\d+\)\n", done.stdout, flags=re.M)[1:]  # each command's, in order
    return {name: (printed[i], json.loads((outs[name] / "summary.json").read_text())) for i, name in enumerate(OPTIONS)}


@pytest.mark.parametrize("name", OPTIONS)
def test_the_hugging_face_example_stays_on_the_reference_padded_and_packed(hf_runs, name):
    stdout, summary = hf_runs[name]
    assert (summary["engine"], summary["packed"]) == (OPTIONS[name][1], "--packed" in OPTIONS[name])
    assert summary["weighted"] < 5e-5  # fp32 rounding through 4 Adam steps (measured 5e-6 to 7e-6)
    assert summary["plain"] > 1e-2  # measured 2.3e-2
    lines = stdout.splitlines()
    assert any("max|θ − θ_ref| / max|θ_ref|" in line for line in lines)  # the printed distances say their unit
    printed = {line.split()[0]: float(line.split()[1]) for line in lines if line.startswith(("weighted ", "plain "))}
    assert printed == pytest.approx({run: summary[run] for run in ("weighted", "plain")}, rel=1e-2)
