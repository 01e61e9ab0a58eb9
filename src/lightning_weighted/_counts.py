"""Counts: reading one, the rule for where it comes from, and the count payload every rank sums.

Nothing here touches ``torch.distributed``; :mod:`lightning_weighted.window` states the objective the counts
weight, and the engine adapters move the payload.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch
from lightning.pytorch.utilities.data import extract_batch_size
from torch import Tensor

__all__ = [
    "Count",
    "CountPayload",
    "CountProblem",
    "GlobalCount",
    "Handover",
    "Slot",
    "Wording",
    "agreed",
    "count_of",
    "decode",
    "imbalance",
    "on_device",
    "read_count",
    "settled",
    "split_output",
]

MAX_ITEMS = 2.0**53  # a rank's items in one window stay below it, where float64 still counts single items


class CountProblem(IntEnum):
    """Why a microbatch's count (or loss) cannot be weighted."""

    NEGATIVE = 1
    NOT_FINITE = 2
    NOT_A_NUMBER = 3
    NOT_A_SCALAR = 4
    NO_LOSS = 5
    NO_GRAPH = 6
    FRACTIONAL = 7
    TOO_LARGE = 8
    REDUCTION = 9
    MISSING = 10
    DISAGREES = 11


FIX = (
    "Return `{'loss': local_mean, 'count': n}` from `training_step` (or count with `ItemCounter`), where `n` is"
    " the number of valid items (or the sum of sample weights) behind `local_mean`: an int, a float or a 0-dim"
    " tensor, finite and >= 0"
)


@dataclass(frozen=True)
class Wording:
    """How an engine's count errors name the call that handed over a loss and its count, and the fix they give.

    Attributes:
        source: the call and its verb, as in ``"training_step returned"``.
        fix: the sentence that says what a valid count is and where it goes.
    """

    source: str
    fix: str


TRAINER = Wording("training_step returned", FIX)
_MESSAGES: dict[CountProblem, tuple[type[Exception], str]] = {
    CountProblem.NEGATIVE: (ValueError, "a microbatch's count is negative ({value!r})"),
    CountProblem.NOT_FINITE: (ValueError, "a microbatch's count is not finite ({value!r})"),
    CountProblem.NOT_A_NUMBER: (TypeError, "a microbatch's count is not a number"),
    CountProblem.NOT_A_SCALAR: (TypeError, "a microbatch's count is a tensor with more than one element"),
    CountProblem.NO_LOSS: (RuntimeError, "{source} None instead of a loss"),
    CountProblem.NO_GRAPH: (RuntimeError, "{source} a loss that is not attached to the graph"),
    CountProblem.FRACTIONAL: (ValueError, "a microbatch's count of examples or tokens is fractional ({value!r})"),
    CountProblem.TOO_LARGE: (
        ValueError,
        "the window's count reaches 2**53 ({value!r}), where one item no longer changes a float64 sum;"
        " count in coarser units or rescale the sample weights",
    ),
    CountProblem.REDUCTION: (
        ValueError,
        "{source} a 'reduction' that is neither 'mean' nor 'sum'; use 'sum' with a loss summed over the"
        " microbatch's items, or leave it out for a mean",
    ),
    CountProblem.MISSING: (TypeError, "{source} no count"),
    CountProblem.DISAGREES: (
        ValueError,
        "{source} count={value!r}, which differs from the count ItemCounter took from the same batch"
        " before the window's first forward (the one the window's N holds); make them agree (e.g. the causal shift,"
        " `ignore_index`), or drop one of them",
    ),
}
_WITH_VALUE = (
    CountProblem.NEGATIVE,
    CountProblem.NOT_FINITE,
    CountProblem.FRACTIONAL,
    CountProblem.TOO_LARGE,
    CountProblem.DISAGREES,
)


def read_count(value: object, integer: bool = False) -> tuple[float, CountProblem | None]:
    """Reads a count on the host and checks it.

    Args:
        value: an int, a float or a 0-dim tensor (``training_step``'s ``"count"``, or a count function's result).
        integer: whether the count must be a whole number (examples, tokens).

    Returns:
        ``(count, None)`` for a valid count, else ``(offending value or nan, problem)``.

    Example::

        >>> read_count(3)
        (3.0, None)
        >>> read_count(-2.5)
        (-2.5, <CountProblem.NEGATIVE: 1>)
    """
    if isinstance(value, Tensor):
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


@dataclass(frozen=True)
class Count:
    """One microbatch's count, checked.

    Attributes:
        value: the number of valid items (or the sum of sample weights); the offending value when invalid.
        problem: why it cannot be weighted, or ``None``.
        implicit: the batch size was counted only because nothing gave a count.
    """

    value: float
    problem: CountProblem | None = None
    implicit: bool = False


def split_output(output: object) -> tuple[Tensor | None, bool, CountProblem | None]:
    """``(loss, is_item_sum, problem)`` of what ``training_step`` returned: a tensor or a dict with ``"loss"``.

    ``{"reduction": "sum"}`` marks a loss summed over the microbatch's items (Hugging Face's
    ``num_items_in_batch``, fairseq, Megatron); without it the loss is their mean.

    Example::

        >>> loss = torch.tensor(6.0)
        >>> split_output({"loss": loss, "count": 3, "reduction": "sum"})
        (tensor(6.), True, None)
    """
    if not isinstance(output, Mapping):
        return (output if isinstance(output, Tensor) else None), False, None
    loss = output.get("loss")
    reduction = output.get("reduction", "mean")
    if reduction not in ("mean", "sum"):
        return (loss if isinstance(loss, Tensor) else None), False, CountProblem.REDUCTION
    return (loss if isinstance(loss, Tensor) else None), reduction == "sum", None


def count_of(output: object, batch: Any, supplied: tuple[object, bool] | None = None) -> Count:
    """The one count rule: a ``"count"`` returned by ``training_step``, else a supplied one, else the batch size.

    Args:
        output: what ``training_step`` returned (a dict with ``"count"``, or anything else).
        batch: the microbatch, whose size is counted when nothing else gives a count.
        supplied: ``(count, integer)`` from :class:`~lightning_weighted.ItemCounter`, whose choice of what to
            count is explicit.

    Example::

        >>> count_of({"loss": torch.tensor(1.0), "count": 5}, batch=None)
        Count(value=5.0, problem=None, implicit=False)
        >>> count_of(torch.tensor(1.0), batch=torch.zeros(4, 2))  # a bare loss: examples
        Count(value=4.0, problem=None, implicit=True)
    """
    if isinstance(output, Mapping) and "count" in output:
        return Count(*read_count(output["count"]))
    if supplied is not None:
        return Count(*read_count(*supplied))
    return Count(float(extract_batch_size(batch)), implicit=True)


def agreed(output: object, planned: Count) -> Count:
    """The count rule where the window's counts were taken from its batches ahead: the planned count, checked.

    A ``"count"`` that ``training_step`` still returns must be valid and equal the planned one: the window's ``N``
    already holds the planned count.

    Example::

        >>> agreed({"loss": torch.tensor(1.0), "count": 4}, planned=Count(4.0))
        Count(value=4.0, problem=None, implicit=False)
        >>> agreed({"loss": torch.tensor(1.0), "count": 5}, planned=Count(4.0)).problem
        <CountProblem.DISAGREES: 11>
    """
    if not isinstance(output, Mapping) or "count" not in output or planned.problem is not None:
        return planned
    value, problem = read_count(output["count"])
    if problem is None and value != planned.value:
        problem = CountProblem.DISAGREES
    return planned if problem is None else Count(value, problem)


class Slot(IntEnum):
    """The named fields of the float64 count payload each rank contributes to the window's SUM.

    float64 holds every integer up to 2**53 exactly, so item counts and weight sums stay exact.
    """

    ITEMS = 0  # Σ_m n_m over this rank's window
    INVALID = 1  # 1 if this rank found a problem
    CODE = 2  # rank · _KINDS + problem: decoded when exactly one rank reports
    VALUE = 3  # the offending value
    MORE = 4  # 1 if this rank holds real batches after this window
    LOSS = 5  # Σ_m n_m · loss_m, the window's item-sum loss


class Handover(IntEnum):
    """What every rank SUMs at the end of a window whose counts were known before its first forward.

    The window's own ``N`` was summed before it started; its end brings what came later, and the next window's
    ``N`` (at an epoch's first window, the handover holds that window's count alone). The SUM travels in DDP's
    gradient all-reduce (:mod:`lightning_weighted.reduce.carrier`) or in a float64 all-reduce of its own.
    """

    ITEMS = 0  # Σ_m n_m over the next window on this rank
    INVALID = 1  # 1 if this rank found a problem in this window (a count, a loss, a disagreement)
    MORE = 2  # 1 if this rank holds real batches after this window
    LOSS = 3  # Σ_m n_m · loss_m / N over this window: summed over the ranks, the window's global item mean


def settled(items: float, summed: Sequence[float]) -> list[float]:
    """A window's summed payload (indexed by :class:`Slot`) from its ``N`` and the SUM of the handovers at its end.

    Example::

        >>> settled(8.0, [12.0, 0.0, 2.0, 1.5])  # N = 8; the next window's 12 items are not this window's
        [8.0, 0.0, 0.0, 0.0, 2.0, 12.0]
    """
    return [items, summed[Handover.INVALID], 0.0, 0.0, summed[Handover.MORE], summed[Handover.LOSS] * items]


_KINDS = 16
WIDTH = len(Slot)


@dataclass(frozen=True)
class CountPayload:
    """This rank's contribution to the SUM that gives every rank the window's ``N`` (or one error).

    Attributes:
        items: the rank's items in the window.
        problem: the first problem of the window on this rank and its value, or ``None``.
        rank: this rank's index in the group the counts are summed over.
        more: whether this rank holds real batches after this window (see :mod:`.participation`).
        loss_sum: ``Σ_m n_m · loss_m``, on the loss's device (never read on the host here), or ``None``.
    """

    items: float
    problem: tuple[CountProblem, float] | None
    rank: int
    more: bool
    loss_sum: Tensor | None = None

    def fields(self) -> list[float]:
        """The payload as a float64 vector indexed by :class:`Slot` (the loss slot holds 0 here)."""
        vector = [0.0] * WIDTH
        vector[Slot.ITEMS], vector[Slot.MORE] = self.items, float(self.more)
        if self.problem is not None:
            problem, value = self.problem
            vector[Slot.INVALID], vector[Slot.CODE] = 1.0, float(self.rank * _KINDS + problem)
            vector[Slot.VALUE] = value if problem in _WITH_VALUE else 0.0
        return vector

    def tensor(self, device: torch.device) -> Tensor:
        """The payload as a float64 vector on ``device``, with ``loss_sum`` added into its loss slot there."""
        return on_device(self.fields(), device, Slot.LOSS, self.loss_sum)


def on_device(
    values: Sequence[float], device: torch.device, slot: int, add: Tensor | None, dtype: torch.dtype = torch.float64
) -> Tensor:
    """``values`` as a ``dtype`` vector on ``device`` (no host wait), with ``add`` (already there) added at ``slot``."""
    vector = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        vector = vector.pin_memory()  # a pinned, non-blocking copy keeps the host from waiting
    vector = vector.to(device, non_blocking=True)
    if add is not None:
        vector[slot] += add.to(device=device, dtype=dtype)
    return vector


@dataclass(frozen=True)
class GlobalCount:
    """The decoded SUM of every rank's payload: the same on every rank.

    Attributes:
        items: ``N``, the global item count of the window.
        error: the one error every rank raises, or ``None``.
        ranks_with_more: how many ranks hold real batches after this window.
        loss_sum: ``Σ_r Σ_m n_rm · loss_rm``.
    """

    items: float
    error: Exception | None
    ranks_with_more: int = 0
    loss_sum: float = 0.0


def decode(summed: Sequence[float], wording: Wording = TRAINER) -> GlobalCount:
    """Turns the summed payload (indexed by :class:`Slot`) into ``N`` or one error, identical on every rank.

    ``wording`` says, in the error, where the loss and its count came from and what the fix is.

    Example::

        >>> decode([8.0, 0.0, 0.0, 0.0, 2.0, 12.0])
        GlobalCount(items=8.0, error=None, ranks_with_more=2, loss_sum=12.0)
        >>> decode([2.0, 1.0, 16 + CountProblem.NEGATIVE, -3.0, 2.0, 0.0]).error.args[0][:48]
        "on rank 1, a microbatch's count is negative (-3."
    """
    invalid, more = round(summed[Slot.INVALID]), round(summed[Slot.MORE])
    error: Exception | None = None
    if invalid == 1:
        rank, kind = divmod(round(summed[Slot.CODE]), _KINDS)
        error_type, what = _MESSAGES[CountProblem(kind)]
        what = what.format(value=summed[Slot.VALUE], source=wording.source)
        error = error_type(f"on rank {rank}, {what}. {wording.fix}.")
    elif invalid > 1:
        error = ValueError(f"on {invalid} ranks, a microbatch's count or loss is invalid. {wording.fix}.")
    return GlobalCount(summed[Slot.ITEMS], error, more, summed[Slot.LOSS])


def imbalance(largest: float, items: float, ranks: int) -> float:
    """``max_r P·n_r / N``: how many times more weight plain DDP gives the items of the rank with most; 1 if N = 0.

    Example (the worked trace: 2 and 6 items)::

        >>> imbalance(largest=6, items=8, ranks=2)
        1.5
    """
    return ranks * largest / items if items > 0 else 1.0
