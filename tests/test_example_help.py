"""Every example answers `--help` with its usage and exits at once: nothing trains, nothing is written."""

from __future__ import annotations

import pytest
from launcher import ROOT, ranks

# the scripts a user runs; a module they import (cpu_fsdp.py, plain FSDP1 on the CPU) has no `__main__`
EXAMPLES = sorted(path.name for path in (ROOT / "examples").glob("*.py") if "__main__" in path.read_text())


def test_the_examples_folder_holds_the_examples_the_readme_names():
    assert {"worked_trace.py", "tiny_lm.py", "fabric_lm.py", "hf_lm.py", "cli.py"} <= set(EXAMPLES)


@pytest.mark.parametrize("example", EXAMPLES)
def test_each_example_prints_its_help_and_exits_without_training(example, tmp_path):
    out = tmp_path / "out"
    options = ["--help"] if example in ("cli.py", "worked_trace.py") else ["--out", str(out), "--help"]
    # As `python examples/<example> --help` runs it, in a process that has imported torch and Lightning already
    done = ranks(ROOT / "examples" / example, options, world_size=1, timeout=90)
    assert done.returncode == 0, done.stdout[-4000:]
    assert "usage:" in done.stdout, done.stdout[-4000:]
    assert "w after one step" not in done.stdout  # worked_trace.py's table: it trained
    assert not out.exists()  # the other examples write their results into --out
