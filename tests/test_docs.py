"""Every ```python block of README.md and docs/*.md runs as copied, each under a hard timeout, so none can drift;
README's quoted errors are the ones Lightning prints."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

import pytest
from launcher import ROOT, ranks
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import StrategyRegistry

import lightning_weighted  # noqa: F401  (registers "ddp_weighted", which the test below takes out again)

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^( *)```python\n(.*?)^\1```$", re.S | re.M)


def python_blocks() -> list[Any]:
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in BLOCK.finditer(text):
            line = text[: match.start()].count("\n") + 1
            found.append(pytest.param(textwrap.dedent(match.group(2)), id=f"{page.name}:{line}"))
    return found


BLOCKS = python_blocks()


def test_the_readme_and_docs_hold_the_runnable_trainer_and_fabric_examples():
    pages = {param.id.split(":")[0] for param in BLOCKS}
    assert {"README.md", "fabric.md", "cluster.md", "example_and_audit.md"} <= pages
    codes = [param.values[0] for param in BLOCKS]
    assert any("Trainer(" in code and ".fit(" in code for code in codes)  # a Trainer that trains
    assert any("Fabric(" in code and "optimizer.step()" in code for code in codes)  # a Fabric loop that steps


def test_the_architecture_page_names_only_files_that_exist():
    package = ROOT / "src" / "lightning_weighted"
    files = {path.relative_to(package).as_posix() for path in package.rglob("*.py")}
    named = set(re.findall(r"`([\w/]+\.py)`", (ROOT / "docs" / "architecture.md").read_text()))
    assert {"loop.py", "window.py", "trainer/_seam.py"} <= named  # what the page is about
    missing = sorted(
        name
        for name in named
        if not (ROOT / name).exists() and not any(f == name or f.endswith(f"/{name}") for f in files)
    )
    assert missing == [], f"docs/architecture.md names files that do not exist: {missing}"


@pytest.mark.parametrize("code", BLOCKS)
def test_each_python_block_of_the_readme_and_docs_runs_as_copied(code: str, tmp_path: Path):
    # Each block runs as its own script, on as many ranks as its `devices=` asks for (the ranks forked ready-
    # imported, as a launcher outside Lightning starts them), in a folder of its own for what it writes.
    script = tmp_path / "snippet.py"
    script.write_text(f"import os\nos.chdir({str(tmp_path)!r})\n{code}")
    world_size = 2 if "devices=2" in code else 1
    done = ranks(script, [], world_size=world_size, timeout=120)
    assert done.returncode == 0, done.stdout[-6000:]


def test_readme_quotes_the_error_lightning_gives_when_the_import_is_missing():
    readme = (ROOT / "README.md").read_text()
    quoted = re.search(r"^ValueError: You selected an invalid strategy name: .*$", readme, re.M)
    assert quoted is not None
    # as before `import lightning_weighted` registers it; not `monkeypatch.delitem`, which saves the entry through the
    # registry's own `get`, a built strategy, and puts that back in place of the entry
    entry = StrategyRegistry.pop("ddp_weighted")
    try:
        with pytest.raises(ValueError) as raised:
            Trainer(strategy="ddp_weighted", accelerator="cpu", devices=2)
    finally:
        StrategyRegistry["ddp_weighted"] = entry
    assert f"ValueError: {raised.value}" == quoted.group(0)
