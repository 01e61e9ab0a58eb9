"""Replacing methods of one module instance for a while, where Lightning offers no hook to do it otherwise."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from torch.nn import Module

__all__ = ["patched"]

_MISSING = object()


@contextlib.contextmanager
def patched(module: Module, **methods: Callable[..., Any]) -> Iterator[None]:
    """Sets ``methods`` as attributes of ``module`` for the length of the block; the class is never touched.

    Example::

        >>> from torch import nn
        >>> layer = nn.Identity()
        >>> with patched(layer, extra_repr=lambda: "patched"):
        ...     print(layer)
        Identity(patched)
        >>> print(layer)
        Identity()
    """
    saved = {name: vars(module).get(name, _MISSING) for name in methods}
    for name, method in methods.items():
        setattr(module, name, method)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is _MISSING:
                delattr(module, name)
            else:
                setattr(module, name, value)
