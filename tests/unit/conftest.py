"""Fixtures of the one-process tests."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist


@pytest.fixture
def one_process_group() -> Iterator[None]:
    """Destroys the process group a one-process fit initialised (world size 1, in this process)."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    """A gloo process group of one rank (this process), destroyed afterwards."""
    assert not dist.is_initialized(), "a process group leaked from an earlier test"
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=30))
    try:
        yield
    finally:
        dist.destroy_process_group()
