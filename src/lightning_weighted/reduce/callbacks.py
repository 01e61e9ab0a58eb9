"""Python callbacks on collective futures, which a process lets go of before it exits.

The thread that completes a collective's future (one of gloo's workers, say) runs its Python callbacks, wakes
whoever waits, and then takes the GIL once more to release the callbacks. A process that ends in between aborts:
its interpreter is finalizing, and a thread taking the GIL then is stopped inside a destructor ("terminate called
without an active exception", exit code -6, after training finished). :func:`then` counts each callback until it is
released; at exit the process waits until every completed future's callbacks are, usually a few milliseconds.
"""

from __future__ import annotations

import atexit
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from torch.futures import Future

__all__ = ["then"]

T = TypeVar("T")
S = TypeVar("S")

EXIT_WAIT_S = 5.0  # the longest the exit waits; a future still running then (a peer died mid-collective) is left

_live: dict[int, Future[Any]] = {}  # id of each callback not yet released: the future it runs after


def then(future: Future[T], callback: Callable[[Future[T]], S]) -> Future[S]:
    """``future.then(callback)``, the callback counted until the thread that ran it has released it."""
    return future.then(_Counted(callback, future))


class _Counted(Generic[T, S]):
    __slots__ = ("callback",)

    def __init__(self, callback: Callable[[Future[T]], S], future: Future[T]) -> None:
        self.callback = callback
        _live[id(self)] = future

    def __call__(self, future: Future[T]) -> S:
        return self.callback(future)

    def __del__(self, live: dict[int, Future[Any]] = _live) -> None:  # bound now: usable while the module is torn down
        live.pop(id(self), None)


def _release_at_exit() -> None:
    """Sleeps (without the GIL) while a completed future's callback is not released yet."""
    deadline = time.monotonic() + EXIT_WAIT_S
    while any(future.done() for future in list(_live.values())) and time.monotonic() < deadline:
        time.sleep(0.001)


atexit.register(_release_at_exit)  # returns at once where no callback is live
