"""Pins: checks that what the package rests on in Lightning or torch is still there, each failure naming what moved.

``Pins("_compat.")`` makes the checks of one pinned module; every failure reads ``<prefix><entry>: <symbol> changed
(<detail>), on <versions>``, so a release that moves a symbol says which entry it broke.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import lightning
import pytest
import torch

VERSIONS = f"Lightning {lightning.__version__}, torch {torch.__version__}"


class Pins:
    """The checks of one pinned module, their failures named ``<prefix><entry>``."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def pinned(self, entry: str, condition: object, symbol: str, detail: str = "") -> None:
        """Fails, naming the entry and the symbol it rests on, unless ``condition`` holds."""
        if not condition:
            pytest.fail(f"{self.prefix}{entry}: {symbol} changed{f' ({detail})' if detail else ''}, on {VERSIONS}")

    @contextlib.contextmanager
    def exercising(self, entry: str, symbol: str) -> Iterator[None]:
        """Runs the block; an error raised in it fails the test with the entry's and the symbol's names."""
        try:
            yield
        except Exception as error:
            pytest.fail(f"{self.prefix}{entry}: {symbol} changed ({type(error).__name__}: {error}), on {VERSIONS}")

    def source_says(self, entry: str, obj: Any, text: str, symbol: str) -> None:
        """The source of ``obj`` holds ``text`` (what the package relies on Lightning or torch doing there)."""
        self.pinned(entry, text in inspect.getsource(obj), symbol, f"its source no longer holds {text!r}")
