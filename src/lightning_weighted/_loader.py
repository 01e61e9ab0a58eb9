"""A train loader's iteration extended for the length of one fit, without replacing the loader.

Lightning seeds a ``DataLoader``'s workers and checks its settings by looking at the object the user gave it, so a
``DataLoader`` keeps its identity: its class is extended in place (under the same name) and given back at the end
of the fit. Any other iterable is wrapped. Stages compose: the replays of an exhausted rank, then the lookahead
that counts each window's batches on the host.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader

__all__ = ["Stage", "extend", "restore", "retract"]

Stage = Callable[[Iterator[Any]], Iterator[Any]]  # turns the loader's iterator into the one Lightning sees


def extend(loader: Any, stage: Stage, length: Callable[[], int] | None = None) -> Any:
    """Runs ``loader``'s iteration through ``stage`` (after the stages it already has); ``length`` replaces its length.

    Returns the same object for a ``DataLoader``, a wrapper for any other iterable.
    """
    if not isinstance(loader, (_Extended, _ExtendedIterable)):
        if isinstance(loader, DataLoader):
            loader._lw_stages, loader._lw_length = [], None
            loader.__class__ = _extended_class(type(loader))
        else:
            loader = _ExtendedIterable(loader)
    loader._lw_stages.append(stage)
    if length is not None:
        loader._lw_length = length
    return loader


def retract(loader: Any, stage: Stage) -> None:
    """Takes ``stage`` out of ``loader``'s iteration again (before the loader is iterated)."""
    if isinstance(loader, (_Extended, _ExtendedIterable)) and stage in loader._lw_stages:
        loader._lw_stages.remove(stage)


def restore(loader: Any) -> Any:
    """Gives an extended ``DataLoader`` back its own class; returns what was extended (the wrapped iterable)."""
    if isinstance(loader, _Extended):
        loader.__class__ = type(loader).__mro__[2]  # the class `_extended_class` extended
        del loader._lw_stages, loader._lw_length
        return loader
    if isinstance(loader, _ExtendedIterable):
        return loader.iterable
    return loader


def _run(stages: list[Stage], iterator: Iterator[Any]) -> Iterator[Any]:
    for stage in stages:
        iterator = stage(iterator)
    return iterator


class _Extended(DataLoader[Any]):
    """Placed before a ``DataLoader``'s own class for one fit; the instance keeps its attributes and workers."""

    _lw_stages: list[Stage]
    _lw_length: Callable[[], int] | None

    def __len__(self) -> int:
        return self._lw_length() if self._lw_length is not None else super().__len__()

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # a generator over DataLoader's own iterator
        return _run(self._lw_stages, iter(super().__iter__()))


def _extended_class(cls: type[DataLoader[Any]]) -> type[DataLoader[Any]]:
    """``cls`` extended by ``_Extended``, under its own name (one class per loader class)."""
    if cls not in _EXTENDED:
        _EXTENDED[cls] = type(cls.__name__, (_Extended, cls), {"__module__": cls.__module__})
    return _EXTENDED[cls]


_EXTENDED: dict[type[DataLoader[Any]], type[DataLoader[Any]]] = {}


class _ExtendedIterable:
    """The same for a train "loader" that is not a ``DataLoader`` (any iterable Lightning accepts)."""

    def __init__(self, iterable: Any) -> None:
        self.iterable = iterable
        self._lw_stages: list[Stage] = []
        self._lw_length: Callable[[], int] | None = None

    def __len__(self) -> int:
        return self._lw_length() if self._lw_length is not None else len(self.iterable)

    def __iter__(self) -> Iterator[Any]:
        return _run(self._lw_stages, iter(self.iterable))
