"""Pure window arithmetic: reading counts, per-microbatch loss multipliers, the reduced count vector.

Nothing here touches ``torch.distributed``; the strategy and the hook only wire these pieces in. The
objective and the reduction it leads to are stated once, in :mod:`lightning_weighted.hook`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum

import torch

__all__ = ["CountProblem", "GlobalCount", "WindowCount", "decode", "divisor", "read_count", "ride", "unride"]

# Layout of the float64 vector every rank contributes to the window's count reduction (a SUM).
# float64 holds every integer up to 2**53 exactly, so item counts and weight sums stay exact.
ITEMS, INVALID, CODE, VALUE, MORE, LOSS, WIDTH = 0, 1, 2, 3, 4, 5, 6
_KINDS = 16  # CODE = rank * _KINDS + kind; decoded only when exactly one rank reports a problem
MAX_ITEMS = 2.0**53  # a rank's items in one window stay below it, where float64 still counts single items

# Layout of the same counts riding at the end of an fp32 (or fp64) gradient bucket: the whole part of ITEMS as
# DIGITS base-256 digits (a digit summed over P <= MAX_RIDING_RANKS ranks is at most 255·P <= 2**24, an exact
# fp32 integer, so N is exact), the fractional part of ITEMS, INVALID, MORE and LOSS. The rank and value of an
# invalid count (CODE, VALUE) are fetched by a second reduction, on the error path only.
DIGITS, RIDE_WIDTH = 8, 12
MAX_RIDING_RANKS = 2**24 // 255


class CountProblem(IntEnum):
    """Why a microbatch's count (or loss) cannot be weighted."""

    NEGATIVE = 1
    NOT_FINITE = 2
    NOT_A_NUMBER = 3
    NOT_A_SCALAR = 4
    MISSING = 5
    NO_LOSS = 6
    NO_GRAPH = 7
    FRACTIONAL = 8
    TOO_LARGE = 9


_FIX = (
    "Return `{'loss': local_mean, 'count': n}` from `training_step` (or count with `ItemCounter`), where `n` is"
    " the number of valid items (or the sum of sample weights) behind `local_mean`: an int, a float or a 0-dim"
    " tensor, finite and >= 0"
)
_MESSAGES: dict[CountProblem, tuple[type[Exception], str]] = {
    CountProblem.NEGATIVE: (ValueError, "a microbatch's count is negative ({value!r})"),
    CountProblem.NOT_FINITE: (ValueError, "a microbatch's count is not finite ({value!r})"),
    CountProblem.NOT_A_NUMBER: (TypeError, "a microbatch's count is not a number"),
    CountProblem.NOT_A_SCALAR: (TypeError, "a microbatch's count is a tensor with more than one element"),
    CountProblem.MISSING: (ValueError, "training_step returned a dict without a 'count' key"),
    CountProblem.NO_LOSS: (RuntimeError, "training_step returned None instead of a loss"),
    CountProblem.NO_GRAPH: (RuntimeError, "training_step returned a loss that is not attached to the graph"),
    CountProblem.FRACTIONAL: (ValueError, "a microbatch's count of examples or tokens is fractional ({value!r})"),
    CountProblem.TOO_LARGE: (
        ValueError,
        "the window's count reaches 2**53 ({value!r}), where one item no longer changes a float64 sum;"
        " count in coarser units or rescale the sample weights",
    ),
}
_WITH_VALUE = (CountProblem.NEGATIVE, CountProblem.NOT_FINITE, CountProblem.FRACTIONAL, CountProblem.TOO_LARGE)


def read_count(value: object, integer: bool = False) -> tuple[float, CountProblem | None]:
    """Reads a count on the host and checks it.

    Args:
        value: what ``training_step`` returned under ``"count"``: an int, a float or a 0-dim tensor.
        integer: whether the count must be a whole number (examples, tokens).

    Returns:
        ``(count, None)`` for a valid count, else ``(offending value or nan, problem)``.

    Example::

        >>> read_count(3)
        (3.0, None)
        >>> read_count(-2.5)
        (-2.5, <CountProblem.NEGATIVE: 1>)
    """
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return math.nan, CountProblem.NOT_A_SCALAR
        if value.dtype == torch.bool or value.is_complex():
            return math.nan, CountProblem.NOT_A_NUMBER
        number = float(value.item())
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        number = float(value)
    else:
        return math.nan, CountProblem.NOT_A_NUMBER
    if not math.isfinite(number):
        return number, CountProblem.NOT_FINITE
    if number < 0:
        return number, CountProblem.NEGATIVE
    if integer and not number.is_integer():
        return number, CountProblem.FRACTIONAL
    return number, None


@dataclass
class WindowCount:
    """One rank's host-side account of the accumulation window in progress.

    Microbatch losses are scaled relative to ``reference``. Left at 0 it becomes the window's first positive
    count, so the scaled losses stay near the magnitude of a mean (no overflow in fp16) and, with one
    microbatch per window, stay untouched; set to 1 it turns the losses into item sums.
    """

    items: float = 0.0
    reference: float = 0.0
    problem: tuple[CountProblem, float] | None = field(default=None)

    def add(self, count: float) -> float:
        """Records a valid count; returns the factor ``count / reference`` for that microbatch's mean loss."""
        if count == 0:
            return 0.0
        if self.items + count >= MAX_ITEMS:
            self.reject(CountProblem.TOO_LARGE, self.items + count)
            return 0.0
        if self.reference == 0:
            self.reference = count
        self.items += count
        return count / self.reference

    def reject(self, problem: CountProblem, value: float = math.nan) -> None:
        """Records a microbatch that cannot be weighted; the first one is reported for the window."""
        if self.problem is None:
            self.problem = (problem, value if problem in _WITH_VALUE else 0.0)

    def vector(self, rank: int, more: bool = True) -> list[float]:
        """This rank's contribution to the window's count reduction (summed over ranks).

        Args:
            rank: this rank's global rank.
            more: whether this rank holds real batches after this window (see :mod:`.participation`).
        """
        if self.problem is None:
            return [self.items, 0.0, 0.0, 0.0, float(more), 0.0]
        problem, value = self.problem
        return [self.items, 1.0, float(rank * _KINDS + problem), value, float(more), 0.0]


@dataclass(frozen=True)
class GlobalCount:
    """The decoded result of a window's count reduction."""

    items: float
    error: Exception | None
    ranks_with_more: int = 0
    loss_sum: float = 0.0


def decode(summed: Sequence[float]) -> GlobalCount:
    """Turns the summed count vector into the global item count ``N`` or one error, identical on every rank.

    Example::

        >>> decode([8.0, 0.0, 0.0, 0.0, 2.0, 12.0])
        GlobalCount(items=8.0, error=None, ranks_with_more=2, loss_sum=12.0)
        >>> decode([2.0, 1.0, 16 + CountProblem.NEGATIVE, -3.0, 2.0, 0.0]).error.args[0][:48]
        "on rank 1, a microbatch's count is negative (-3."
    """
    invalid, more = round(summed[INVALID]), round(summed[MORE])
    error: Exception | None = None
    if invalid == 1:
        rank, kind = divmod(round(summed[CODE]), _KINDS)
        error_type, what = _MESSAGES[CountProblem(kind)]
        error = error_type(f"on rank {rank}, {what.format(value=summed[VALUE])}. {_FIX}.")
    elif invalid > 1:
        error = ValueError(f"on {invalid} ranks, a microbatch's count or loss is invalid. {_FIX}.")
    return GlobalCount(summed[ITEMS], error, more, summed[LOSS])


def ride(vector: Sequence[float]) -> list[float]:
    """Re-encodes a rank's count vector to ride in an fp32 gradient bucket (see ``RIDE_WIDTH``).

    Example::

        >>> ride([1000.5, 0.0, 0.0, 0.0, 1.0, 0.0])
        [232.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.0, 1.0, 0.0]
    """
    whole = math.floor(vector[ITEMS])
    digits = [float((whole >> (8 * place)) & 255) for place in range(DIGITS)]
    return [*digits, vector[ITEMS] - whole, vector[INVALID], vector[MORE], vector[LOSS]]


def unride(summed: torch.Tensor) -> torch.Tensor:
    """The summed riding counts (``RIDE_WIDTH`` values) as the float64 count vector, on their device.

    One product with a fixed matrix (it runs in the reduction's completion callback, where every operation
    counts); float64 keeps the digits' place values and their sums exact below 2**53. CODE and VALUE are 0:
    they do not ride. Example::

        >>> unride(torch.tensor(ride([1000.5, 0, 0, 0, 1, 7]), dtype=torch.float32) * 2).tolist()
        [2001.0, 0.0, 0.0, 0.0, 2.0, 14.0]
    """
    decoder = _DECODERS.get(summed.device)
    if decoder is None:
        decoder = torch.zeros(RIDE_WIDTH, WIDTH, dtype=torch.float64)
        for place in range(DIGITS):
            decoder[place, ITEMS] = 256.0**place
        decoder[DIGITS, ITEMS] = decoder[DIGITS + 1, INVALID] = 1.0
        decoder[DIGITS + 2, MORE] = decoder[DIGITS + 3, LOSS] = 1.0
        decoder = _DECODERS[summed.device] = decoder.to(summed.device)
    return summed.double() @ decoder


_DECODERS: dict[torch.device, torch.Tensor] = {}


def divisor(items: torch.Tensor, reference: float) -> torch.Tensor:
    """The factor a rank divides its accumulated gradient by before the SUM across ranks: ``N / reference``.

    ``items`` is the global count ``N`` (a 0-dim tensor, kept on the device); a window with ``N = 0`` holds
    only zero gradients and divides by 1 so that nothing turns into NaN.
    """
    safe = torch.where(items > 0, items, 1.0)
    return safe if reference in (0.0, 1.0) else safe / reference
