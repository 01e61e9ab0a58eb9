"""Counts: reading and checking one, the count rule, and the one error every rank raises for a bad one.

Pure: nothing here touches ``torch.distributed`` or Lightning. A count is a host number (an ``int``/``float``, or a
count taken ahead on the host) or a tensor, typically on the device; a tensor is checked and summed on its device and
never read back here, so a count returned by ``training_step`` costs no device synchronisation.
:mod:`lightning_weighted.window` states the objective the counts weight.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "FABRIC",
    "TRAINER",
    "Count",
    "Problem",
    "Wording",
    "agreed",
    "aux_terms",
    "count_rule",
    "imbalance",
    "problem_error",
    "read_count",
    "returned_count",
    "split_output",
]

MAX_ITEMS = 2.0**53  # a rank's items in one window stay below it, where float64 still counts single items


class Problem(IntEnum):
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
    AUX = 12
    AUX_AFTER = 13


@dataclass(frozen=True)
class Wording:
    """How count errors name the call that handed over a loss and its count, and the fix they give.

    Attributes:
        source: the call and its verb, as in ``"training_step returned"``.
        fix: the sentence that says what a valid count is and where it goes.
        skipped: what rank 0's warning says of a window without items.
    """

    source: str
    fix: str
    skipped: str = "the optimizer and step-interval LR schedulers were not stepped."


TRAINER = Wording(
    "training_step returned",
    "Return `{'loss': local_mean, 'count': n}` from `training_step` (or count with `ItemCounter`), where `n` is"
    " the number of valid items (or the sum of sample weights) behind `local_mean`: an int, a float or a 0-dim"
    " tensor, finite and >= 0",
)
FABRIC = Wording(
    "fabric.backward got",
    "Pass each microbatch's count as `fabric.backward(loss, count=n)`, where `loss` is the mean over the"
    " microbatch's `n` valid items (or their sum, with `reduction='sum'`) and `n` is their number (or the sum of"
    " their sample weights): an int, a float or a 0-dim tensor, finite and >= 0",
    "the optimizer steps after it change nothing. A loop that steps an LR scheduler can skip it when"
    " `fabric.strategy.last_window.items == 0`.",
)
_MESSAGES: dict[Problem, tuple[type[Exception], str]] = {
    Problem.NEGATIVE: (ValueError, "a microbatch's count is negative ({value!r})"),
    Problem.NOT_FINITE: (ValueError, "a microbatch's count is not finite ({value!r})"),
    Problem.NOT_A_NUMBER: (TypeError, "a microbatch's count is not a number"),
    Problem.NOT_A_SCALAR: (TypeError, "a microbatch's count is a tensor with more than one element"),
    Problem.NO_LOSS: (RuntimeError, "{source} None instead of a loss"),
    Problem.NO_GRAPH: (RuntimeError, "{source} a loss that is not attached to the graph"),
    Problem.FRACTIONAL: (ValueError, "a microbatch's count of examples or tokens is fractional ({value!r})"),
    Problem.TOO_LARGE: (
        ValueError,
        "the window's count reaches 2**53 ({value!r}), where one item no longer changes a float64 sum;"
        " count in coarser units or rescale the sample weights",
    ),
    Problem.REDUCTION: (
        ValueError,
        "{source} a 'reduction' that is neither 'mean' nor 'sum'; use 'sum' with a loss summed over the"
        " microbatch's items, or leave it out for a mean",
    ),
    Problem.MISSING: (TypeError, "{source} no count"),
    Problem.DISAGREES: (
        ValueError,
        "{source} a count ({value!r}) that differs from the one ItemCounter took from the same batch; make them"
        " agree (e.g. the causal shift, `ignore_index`), or drop one of them",
    ),
    Problem.AUX: (
        TypeError,
        "{source} an 'aux' that is not a dict of one-element tensors; give each auxiliary term a name:"
        " `'aux': {{'load_balance': lb, 'z': z}}`",
    ),
    Problem.AUX_AFTER: (
        ValueError,
        "{source} auxiliary terms ('aux'), which are averaged as plain DDP averages them, over the window's"
        " microbatches and ranks; that needs the window's N before its backward, and its counts came after its"
        " forwards. Count the batches ahead (`ItemCounter`, or `fabric.strategy.count_ahead` under Fabric), or add"
        " the terms into 'loss' with the weight you want",
    ),
}
_WITH_VALUE = (Problem.NEGATIVE, Problem.NOT_FINITE, Problem.FRACTIONAL, Problem.TOO_LARGE, Problem.DISAGREES)


@dataclass(frozen=True)
class Count:
    """One microbatch's count, checked.

    Attributes:
        value: the number of valid items (or the sum of sample weights): a float, or a float64 0-dim tensor on the
            count's device (never read on the host); the offending value when invalid.
        problem: why it cannot be weighted: a :class:`Problem`, ``None``, or for a tensor count a float64 0-dim
            tensor holding the problem's number (0: valid).
        implicit: the batch size was counted only because nothing gave a count.
    """

    value: float | Tensor
    problem: Problem | Tensor | None = None
    implicit: bool = False


def read_count(value: object, integer: bool = False, host: bool = False) -> Count:
    """Checks a count: on the host for a number, on its device for a tensor (nothing is read back).

    Args:
        value: an int, a float or a one-element tensor (``training_step``'s ``"count"``, a count function's result).
        integer: whether the count must be a whole number (examples, tokens).
        host: read a tensor on the host (a count taken from a batch before it moves to the device).

    Example::

        >>> read_count(3)
        Count(value=3.0, problem=None, implicit=False)
        >>> read_count(-2.5).problem
        <Problem.NEGATIVE: 1>
        >>> count = read_count(torch.tensor(-2))  # checked where it lives
        >>> float(count.value), float(count.problem)
        (-2.0, 1.0)
    """
    if isinstance(value, Tensor):
        if value.numel() != 1:
            return Count(math.nan, Problem.NOT_A_SCALAR)
        if value.dtype == torch.bool or value.is_complex():
            return Count(math.nan, Problem.NOT_A_NUMBER)
        if host:
            return read_count(value.item(), integer)
        tensor = value.detach().reshape(()).double()
        finite = tensor.abs() < math.inf  # NaN too is not
        negative = torch.where(tensor < 0, float(Problem.NEGATIVE), torch.zeros_like(tensor))
        problem = torch.where(finite, negative, float(Problem.NOT_FINITE))
        if integer and value.is_floating_point():  # the first failing check wins
            problem = torch.where((problem == 0) & (tensor != tensor.floor()), float(Problem.FRACTIONAL), problem)
        return Count(tensor, problem)
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return Count(math.nan, Problem.NOT_A_NUMBER)
    number = float(value)
    if not math.isfinite(number):
        return Count(number, Problem.NOT_FINITE)
    if number < 0:
        return Count(number, Problem.NEGATIVE)
    if integer and not number.is_integer():
        return Count(number, Problem.FRACTIONAL)
    return Count(number)


def split_output(output: object) -> tuple[Tensor | None, bool, Problem | None]:
    """``(loss, is_item_sum, problem)`` of what ``training_step`` returned: a tensor or a dict with ``"loss"``.

    ``{"reduction": "sum"}`` marks a loss summed over the microbatch's items (Hugging Face's
    ``num_items_in_batch``, fairseq, Megatron); without it the loss is their mean.

    Example::

        >>> split_output({"loss": torch.tensor(6.0), "count": 3, "reduction": "sum"})
        (tensor(6.), True, None)
    """
    if not isinstance(output, Mapping):
        return (output if isinstance(output, Tensor) else None), False, None
    loss = output.get("loss")
    loss = loss if isinstance(loss, Tensor) else None
    reduction = output.get("reduction", "mean")
    if reduction not in ("mean", "sum"):
        return loss, False, Problem.REDUCTION
    return loss, reduction == "sum", None


def aux_terms(output: object) -> tuple[dict[str, Tensor], Problem | None]:
    """The named auxiliary terms of what ``training_step`` returned (``"aux"``), and a problem with them.

    Example::

        >>> aux_terms({"loss": torch.tensor(1.0), "aux": {"z": torch.tensor(0.5)}})
        ({'z': tensor(0.5000)}, None)
        >>> aux_terms({"loss": torch.tensor(1.0), "aux": torch.tensor(0.5)})[1]
        <Problem.AUX: 12>
    """
    terms = output.get("aux") if isinstance(output, Mapping) else None
    if terms is None:
        return {}, None
    if not isinstance(terms, Mapping) or not all(isinstance(t, Tensor) and t.numel() == 1 for t in terms.values()):
        return {}, Problem.AUX
    return {str(name): term for name, term in terms.items()}, None


def count_rule(output: object, batch: Any, batch_size: Callable[[Any], int], counter: Any = None) -> Count:
    """The one count rule: a ``"count"`` returned by ``training_step``, else a counter's, else the batch size.

    Args:
        output: what ``training_step`` returned (a dict with ``"count"``, or anything else).
        batch: the microbatch, whose size is counted when nothing else gives a count.
        batch_size: how the batch size is found (Lightning's ``extract_batch_size``).
        counter: an :class:`~lightning_weighted.ItemCounter` (``count_of(batch)`` and ``integer``), whose choice is
            explicit; or ``(count, integer)``, already counted.

    Example::

        >>> count_rule({"loss": torch.tensor(1.0), "count": 5}, None, len)
        Count(value=5.0, problem=None, implicit=False)
        >>> count_rule(torch.tensor(1.0), [0, 0, 0, 0], len)  # a bare loss: examples
        Count(value=4.0, problem=None, implicit=True)
    """
    returned = returned_count(output)
    if returned is not None:
        return returned
    if isinstance(counter, tuple):
        return read_count(*counter)
    if counter is not None:
        return read_count(counter.count_of(batch), counter.integer)
    return Count(float(batch_size(batch)), implicit=True)


def returned_count(output: object) -> Count | None:
    """The ``"count"`` ``training_step`` returned, checked; ``None`` where it returned none."""
    return read_count(output["count"]) if isinstance(output, Mapping) and "count" in output else None


def agreed(returned: object, planned: Count) -> Count:
    """The count taken ahead, checked against one given for the same microbatch too (they must agree).

    Example::

        >>> agreed(4, Count(4.0))
        Count(value=4.0, problem=None, implicit=False)
        >>> agreed(5, Count(4.0)).problem
        <Problem.DISAGREES: 11>
    """
    if planned.problem is not None:
        return planned
    given = read_count(returned)
    if isinstance(given.problem, Problem):
        return given
    if isinstance(given.value, Tensor):  # compared on its device
        assert isinstance(given.problem, Tensor)
        differs = (given.value != planned.value) & (given.problem == 0)
        problem = torch.where(differs, float(Problem.DISAGREES), given.problem)
        return Count(torch.where(problem > 0, given.value, float(planned.value)), problem)
    return planned if given.value == planned.value else Count(given.value, Problem.DISAGREES)


def problem_error(rows: Sequence[Sequence[float]], wording: Wording = TRAINER) -> Exception:
    """The one error every rank raises, from every rank's ``[problem, value]`` (``0``: none), in rank order.

    Every rank gathers the same rows, so every rank raises the same error: one rank's problem names the rank and
    quotes its value; a problem several ranks share is named once; different ones are counted.

    Example::

        >>> problem_error([[0.0, 0.0], [float(Problem.NEGATIVE), -3.0]]).args[0][:48]
        "on rank 1, a microbatch's count is negative (-3)"
    """
    found = [(rank, Problem(round(kind)), value) for rank, (kind, value) in enumerate(rows) if kind > 0]
    kinds = {problem for _, problem, _ in found}
    if len(found) == 1:
        rank, problem, value = found[0]
        error_type, what = _MESSAGES[problem]
        what = what.format(value=shown(value) if problem in _WITH_VALUE else None, source=wording.source)
        return error_type(f"on rank {rank}, {what}. {wording.fix}.")
    if len(kinds) == 1:
        error_type, what = _MESSAGES[kinds.pop()]
        what = what.replace(" ({value!r})", "").format(value=None, source=wording.source)  # the values differ
        return error_type(f"on {len(found)} ranks, {what}. {wording.fix}.")
    return ValueError(f"on {len(found)} ranks, a microbatch's count or loss is invalid. {wording.fix}.")


def shown(value: float) -> int | float:
    """A count as a message quotes it: a whole number as an int (``-29``, not ``-29.0``), any other as it is.

    The payload carries every count as a float64, exact for whole numbers below 2**53; from there on a float
    is quoted as a float (``1e+20``).

    Example::

        >>> shown(-29.0), shown(2.5), shown(float("nan")), shown(1e20)
        (-29, 2.5, nan, 1e+20)
    """
    return int(value) if abs(value) < 2**53 and value.is_integer() else value


def imbalance(largest: float, items: float, ranks: int) -> float:
    """``max_r P·n_r / N``: how much more weight the items of the rank with most get than plain DDP gives them.

    Plain DDP's mean of per-rank means weighs them less than the global item mean does; 1 if ``N = 0``.

    Example (the worked trace: 2 and 6 items)::

        >>> imbalance(largest=6, items=8, ranks=2)
        1.5
    """
    return ranks * largest / items if items > 0 else 1.0
