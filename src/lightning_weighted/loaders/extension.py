"""A loader's iteration extended for one fit, the loader itself kept: the protocol every extension goes through.

Lightning seeds a ``DataLoader``'s workers, checks its settings and saves its state on the object the user gave it,
so a loader keeps its identity: its class gets a subclass in front (under the same name), which :func:`restore`
takes away. Any other iterable is wrapped instead.

Example::

    >>> from torch.utils.data import DataLoader
    >>> loader = DataLoader(range(4), batch_size=2)
    >>> doubled = extend(loader, lambda batches: (2 * batch for batch in batches))
    >>> doubled is loader, [batch.tolist() for batch in loader], type(loader).__name__
    (True, [[0, 2], [4, 6]], 'DataLoader')
    >>> restore(loader) is loader, extension(loader), [batch.tolist() for batch in loader]
    (True, None, [[0, 1], [2, 3]])
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader

__all__ = ["Extension", "Stage", "extend", "extension", "own_length", "own_state", "restore"]

Stage = Callable[[Iterator[Any]], Iterator[Any]]


class Extension:
    """What an extended loader runs: its stages, its length, and the states it saves and loads."""

    def __init__(self) -> None:
        self.stages: list[Stage] = []  # what its iteration runs through, in order
        self.length: Callable[[], int | None] | None = None  # replaces its length (where it gives None: its own)
        self.state: Callable[[], dict[str, Any] | None] | None = None  # saved in place of its own (what trained)
        self.load: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None  # loaded instead (None: nothing)


def extend(loader: Any, stage: Stage | None = None, length: Callable[[], int | None] | None = None) -> Any:
    """Runs ``loader``'s iteration through ``stage`` (after its earlier ones); ``length`` replaces its length."""
    if not isinstance(loader, (_Extended, _ExtendedIterable)):
        if isinstance(loader, DataLoader):
            loader._lw = Extension()
            loader.__class__ = _extended_class(type(loader))
        else:
            loader = _ExtendedIterable(loader)
    if stage is not None:
        loader._lw.stages.append(stage)
    if length is not None:
        loader._lw.length = length
    return loader


def extension(loader: Any) -> Extension | None:
    """What an extended loader runs; ``None`` for a loader that is not extended."""
    return loader._lw if isinstance(loader, (_Extended, _ExtendedIterable)) else None


def own_state(loader: Any) -> Callable[[], dict[str, Any]] | None:
    """The extended loader's own ``state_dict`` (a ``StatefulDataLoader``'s), past the extension; ``None`` if none."""
    owner = super(_Extended, loader) if isinstance(loader, _Extended) else getattr(loader, "iterable", loader)
    own = getattr(owner, "state_dict", None)
    return own if callable(own) else None


def own_length(loader: Any) -> int:
    """The extended loader's own length, past the extension (``TypeError`` where it has none)."""
    if isinstance(loader, _Extended):
        return super(_Extended, loader).__len__()
    return len(loader.iterable if isinstance(loader, _ExtendedIterable) else loader)


def restore(loader: Any) -> Any:
    """Gives an extended ``DataLoader`` back its own class; returns what was extended (the wrapped iterable)."""
    if isinstance(loader, _Extended):
        loader.__class__ = type(loader).__mro__[2]  # the class `_extended_class` extended
        del loader._lw
        return loader
    return loader.iterable if isinstance(loader, _ExtendedIterable) else loader


def _run(extension: Extension, iterator: Iterator[Any]) -> Iterator[Any]:
    for stage in extension.stages:
        iterator = stage(iterator)
    return iterator


class _Extended(DataLoader[Any]):
    _lw: Extension

    def __len__(self) -> int:
        length = self._lw.length() if self._lw.length is not None else None
        return length if length is not None else super().__len__()

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # a generator over DataLoader's own iterator
        return _run(self._lw, iter(super().__iter__()))


def _state_dict(loader: Any) -> dict[str, Any]:
    """The loader's state at the moment the extension names (what Lightning has consumed), else its own."""
    earlier = loader._lw.state() if loader._lw.state is not None else None
    return earlier if earlier is not None else super(_Extended, loader).state_dict()  # type: ignore[no-any-return]


def _load_state_dict(loader: Any, state_dict: dict[str, Any]) -> None:
    """Loads the state the extension names in place of ``state_dict`` (this rank's own), else ``state_dict``."""
    state = loader._lw.load(state_dict) if loader._lw.load is not None else state_dict
    if state is not None:
        super(_Extended, loader).load_state_dict(state)


def _extended_class(cls: type[DataLoader[Any]]) -> type[DataLoader[Any]]:
    if cls not in _EXTENDED:
        namespace: dict[str, Any] = {"__module__": cls.__module__}
        if hasattr(cls, "state_dict"):  # a StatefulDataLoader: Lightning saves the state of loaders with one
            namespace.update(state_dict=_state_dict, load_state_dict=_load_state_dict)
        _EXTENDED[cls] = type(cls.__name__, (_Extended, cls), namespace)
    return _EXTENDED[cls]


_EXTENDED: dict[type[DataLoader[Any]], type[DataLoader[Any]]] = {}


class _ExtendedIterable:
    """The same for a train "loader" that is not a ``DataLoader`` (any iterable Lightning accepts)."""

    def __init__(self, iterable: Any) -> None:
        self.iterable = iterable
        self._lw = Extension()

    def __len__(self) -> int:
        length = self._lw.length() if self._lw.length is not None else None
        return length if length is not None else len(self.iterable)

    def __iter__(self) -> Iterator[Any]:
        return _run(self._lw, iter(self.iterable))

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.__dict__["iterable"], name)
        if name == "state_dict" and (state := self._lw.state) is not None:
            return lambda: state() or value()
        if name == "load_state_dict" and (load := self._lw.load) is not None:
            return lambda given: None if (chosen := load(given)) is None else value(chosen)
        return value
