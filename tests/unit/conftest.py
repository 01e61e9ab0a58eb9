"""Fixtures of the one-process tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture
def one_process_group() -> Iterator[None]:
    """Destroys the process group a one-process fit initialised (world size 1, in this process)."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
