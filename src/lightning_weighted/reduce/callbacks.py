"""Python objects that communication threads hold, which a process lets them release before it exits.

A thread that finishes a collective (one of gloo's workers, say) takes the GIL once more after waking the waiter:
to release the future's Python callbacks, and to release the work itself, which holds the Python context of the
backward pass that launched it (torch stashes a ``contextvars.Context`` for the autograd threads, and every
collective started inside a backward, DDP's bucket all-reduces included, keeps a copy). A process that ends in
between aborts: its interpreter is finalizing, and a thread taking the GIL then is stopped inside a destructor
("terminate called without an active exception", exit code -6, after training finished). At exit the process
therefore waits until every completed future that :func:`then` counts has released its callbacks, and, while a
process group exists, first hands the GIL over for ``EXIT_SETTLE_S``: a thread that waits for it to release a
work takes it then.
"""

from __future__ import annotations

import atexit
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch.distributed as dist
from torch.futures import Future

__all__ = ["then"]

T = TypeVar("T")
S = TypeVar("S")

EXIT_SETTLE_S = 0.05  # how long the exit hands the GIL to communication threads while a process group exists
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
    """Sleeps (without the GIL) briefly where a process group exists, then while a completed future's callback lives."""
    if dist.is_available() and dist.is_initialized():
        time.sleep(EXIT_SETTLE_S)
    deadline = time.monotonic() + EXIT_WAIT_S
    while any(future.done() for future in list(_live.values())) and time.monotonic() < deadline:
        time.sleep(0.001)


atexit.register(_release_at_exit)  # returns at once where no process group and no callback is live
