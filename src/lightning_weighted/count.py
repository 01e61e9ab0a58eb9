"""A microbatch's count: what a valid one is, how it is read and checked, and the one error every rank raises."""

from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from enum import IntEnum
from functools import cache
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["FABRIC", "MAX_ITEMS", "TRAINER", "Count", "Counts", "DeviceCount", "Problem", "Wording", "host_items"]
__all__ += ["problem_error", "read_count", "read_counts", "valid_count"]

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
    CHANGED = 14
    AMBIGUOUS = 15
    PARTS = 16
    PARTS_AFTER = 17
    PARTS_UNCOUNTED = 18


@dataclass(frozen=True)
class Wording:
    """How count errors name the call that handed over a loss and its count, and the fix they give."""

    source: str  # the call and its verb, as in "training_step returned"
    fix: str  # the sentence that says what a valid count is and where it goes
    hooks: str = "a transfer hook"  # the hooks that change a batch between the loader and the step
    strategy: str = "a weighted strategy"  # the strategy's name
    ahead: str = "ItemCounter took from the same batch"  # what took a count ahead
    counter: str = "ItemCounter"  # what counts ahead
    parts: str = "return `{'loss': total, 'parts': {name: mean, ...}}`"  # how parts are handed over
    count_parts: str = "`ItemCounter(parts={name: ItemCounter(...), ...})`"  # how each part is counted ahead


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
    ahead="fabric.strategy.count_ahead was given for the same microbatch",
    counter="fabric.strategy.count_ahead",
    parts="pass `fabric.backward(total, parts={name: mean, ...})`",
    count_parts="`fabric.strategy.count_ahead({name: [n, ...], ...})`",
)
_MESSAGES: dict[Problem, str] = {  # a ValueError each, but for the types of `_TYPES`
    Problem.NEGATIVE: "a microbatch's count is negative ({value!r}). {fix}",
    Problem.NOT_FINITE: "a microbatch's count is not finite ({value!r}). {fix}",
    Problem.NOT_A_NUMBER: "a microbatch's count is not a number. {fix}",
    Problem.NOT_A_SCALAR: "a microbatch's count is a tensor with more than one element. {fix}",
    Problem.NO_LOSS: "{source} None instead of a loss. {fix}",
    Problem.NO_GRAPH: "{source} a loss that is not attached to the graph. {fix}",
    Problem.FRACTIONAL: "a microbatch's count of examples or tokens is fractional ({value!r}). {fix}",
    Problem.TOO_LARGE: "the window's count reaches 2**53 ({value!r}), where one item no longer changes a float64 sum;"
    " count in coarser units or rescale the sample weights",
    Problem.REDUCTION: "{source} a 'reduction' that is neither 'mean' nor 'sum'; use 'sum' with a loss summed over"
    " the microbatch's items, or leave it out for a mean",
    Problem.MISSING: "{source} no count. {fix}",
    Problem.DISAGREES: "{source} a count ({value!r}) that differs from the one {ahead}; make them agree (e.g. the"
    " causal shift, `ignore_index`), or drop one of them",
    Problem.AUX: "{source} an 'aux' that is not a dict of one-element tensors; give each auxiliary term a name:"
    " `'aux': {{'load_balance': lb, 'z': z}}`",
    Problem.AUX_AFTER: "{source} auxiliary terms ('aux'), which are averaged as plain DDP averages them, over the"
    " window's microbatches and ranks; that needs the window's N before its backward, and its counts came after its"
    " forwards. Count the batches ahead (`ItemCounter`, or `fabric.strategy.count_ahead` under Fabric), or add the"
    " terms into 'loss' with the weight you want",
    Problem.CHANGED: "the batch training_step received holds {value!r} items where ItemCounter counted another number"
    " in the batch the loader yielded: {hooks} changed it on its way to the step. Make the change in the dataset or"
    " the collate_fn, so that ItemCounter counts it, or return `{{'loss': loss, 'count': n}}` from training_step and"
    " drop ItemCounter",
    Problem.AMBIGUOUS: "{source} no count for a batch that combines several dataloaders, whose number of examples is"
    " ambiguous (Lightning's batch size is the first loader's). Return `{{'loss': loss, 'count': n}}`, or count with"
    " `ItemCounter('examples')` (every loader's rows) or `ItemCounter(lambda batch: ...)`",
    Problem.PARTS: "{source} loss parts whose names differ from the parts {counter} counts (or no 'parts' where it"
    " counts several); {parts} with one mean per counted part",
    Problem.PARTS_UNCOUNTED: "{source} loss parts ('parts') where {counter} counts one loss; count each part ahead"
    " with {count_parts}, or hand over their total as the one loss",
    Problem.PARTS_AFTER: "{source} loss parts ('parts'), each a mean over its own items, whose gradients cannot be"
    " divided by their own counts once they are accumulated together. Count each part ahead: `ItemCounter(parts="
    "{{name: ItemCounter(...), ...}})`, or `fabric.strategy.count_ahead({{name: [n, ...], ...}})` under Fabric",
}
_TYPES: dict[Problem, type[Exception]] = {
    **dict.fromkeys((Problem.NOT_A_NUMBER, Problem.NOT_A_SCALAR, Problem.MISSING, Problem.AUX), TypeError),
    **dict.fromkeys((Problem.NO_LOSS, Problem.NO_GRAPH), RuntimeError),
}


class Count(NamedTuple):
    """One microbatch's count, checked."""

    value: float | Tensor  # valid items (or weights' sum): a float, or a float64 0-dim tensor never read on the host
    problem: Problem | Tensor | None = None  # for a tensor count, a float64 0-dim tensor of its Problem (0: valid)


def read_count(value: object, integer: bool = False, host: bool = False) -> Count:
    """Checks a count: on the host for a number, on its device for a tensor (nothing is read back).

    ``integer``: the count must be a whole number (examples, tokens); ``host``: read a tensor on the host (a count
    taken from a batch before it moves to the device).
    """
    if isinstance(value, Tensor):
        if value.numel() != 1:
            return Count(math.nan, Problem.NOT_A_SCALAR)
        if value.dtype == torch.bool or value.is_complex():
            return Count(math.nan, Problem.NOT_A_NUMBER)
        if host:
            return read_count(value.item(), integer)
        n = value.reshape(()) if value.dim() else value  # checked on its device: its Problem's code beside it
        n = (n.detach() if n.requires_grad else n).double()
        edges, codes = _problem_table(n.device)  # two operations where comparisons take four (3.6 µs a count, not 18)
        problem = codes.take(torch.searchsorted(edges, n, right=True))
        if integer and value.is_floating_point():  # the first failing check wins
            problem = torch.where((problem == 0) & (n != n.floor()), float(Problem.FRACTIONAL), problem)
        return Count(n, problem)

    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # True is an int, but no count
        return Count(math.nan, Problem.NOT_A_NUMBER)
    number = float(value)
    if not math.isfinite(number):
        return Count(number, Problem.NOT_FINITE)
    if number < 0:
        return Count(number, Problem.NEGATIVE)
    if integer and not number.is_integer():
        return Count(number, Problem.FRACTIONAL)
    return Count(number)


@cache  # one table a device: made on the device once, not copied there for each count
def _problem_table(device: torch.device) -> tuple[Tensor, Tensor]:
    """The edges ``[-max, 0, inf]`` between which a count lies (NaN past them all), and each interval's problem."""
    edges = torch.tensor([-sys.float_info.max, 0.0, math.inf], dtype=torch.float64, device=device)
    codes = [Problem.NOT_FINITE, Problem.NEGATIVE, 0, Problem.NOT_FINITE]
    return edges, torch.tensor(codes, dtype=torch.float64, device=device)


def valid_count(count: Count | None) -> float | Tensor:
    """A count's value where it is valid, else 0 (a count on a device is checked there)."""
    if count is None or isinstance(count.problem, Problem):
        return 0.0
    if count.problem is None:
        return count.value
    return torch.where(count.problem == 0, count.value, 0.0)


class Counts(NamedTuple):
    """One microbatch's count of each loss part (one count, for one loss), checked together as it is taken."""

    values: tuple[float | Tensor, ...]  # as each part's :class:`Count` holds it
    problems: tuple[Problem | Tensor | None, ...] | None = None  # ``None``: every count a valid number on the host

    def each(self) -> list[Count]:
        """Every part's count."""
        problems = self.problems or (None,) * len(self.values)
        return [Count(value, problem) for value, problem in zip(self.values, problems, strict=True)]


def read_counts(values: Sequence[object], integer: Sequence[bool], host: bool = False) -> Counts:
    """Checks one microbatch's count of each part (``values``), each as :func:`read_count` does, ``integer`` a part."""
    counts = [read_count(value, whole, host) for value, whole in zip(values, integer, strict=False)]
    problems = tuple(count.problem for count in counts)
    on_host = all(problem is None for problem in problems)  # every count a valid number
    return Counts(tuple(count.value for count in counts), None if on_host else problems)


def host_items(rows: Sequence[Counts], parts: int = 1) -> list[float]:
    """Each part's sum of the ``rows``' valid counts on the host (a count on a device, or invalid, adds 0 here)."""
    sums = [0.0] * (len(rows[0].values) if rows else parts)
    for row in rows:
        for k, count in enumerate(row.each()):  # every row holds one count a part
            value = valid_count(count)
            sums[k] += 0.0 if isinstance(value, Tensor) else value
    return sums


class DeviceCount(NamedTuple):
    """A count on a device, held with its microbatch's loss until its window sums them there."""

    n: Tensor  # float64, 0-dim
    problem: Tensor  # its :class:`Problem` as a float64 (0: valid)
    counted: Tensor | None = None  # what it adds to N: n where it is valid, else 0 (``None``: a check, adding nothing)
    loss: Tensor | None = None  # its microbatch's loss, detached
    item_sum: bool = False  # whether that loss is a sum over the items rather than their mean


def problem_error(rows: Sequence[Sequence[float]], wording: Wording = TRAINER) -> Exception:
    """The one error every rank raises, from every rank's ``[problem, value]`` (``0``: none), in rank order."""
    found = [(rank, Problem(round(kind)), value) for rank, (kind, value) in enumerate(rows) if kind > 0]
    kinds = {problem for _, problem, _ in found}
    if len(found) == 1:
        rank, problem, value = found[0]
        quoted = int(value) if abs(value) < 2**53 and value.is_integer() else value  # `-29`, not `-29.0`
        return _TYPES.get(problem, ValueError)(f"on rank {rank}, {_message(problem, wording, quoted)}")

    if len(kinds) == 1:
        problem = kinds.pop()
        return _TYPES.get(problem, ValueError)(f"on {len(found)} ranks, {_message(problem, wording)}")
    return ValueError(f"on {len(found)} ranks, a microbatch's count or loss is invalid. {wording.fix}.")


def _message(problem: Problem, wording: Wording, value: object = None) -> str:
    what = _MESSAGES[problem]
    if value is None:
        what = what.replace(" ({value!r})", "").replace(" {value!r}", "")
    return what.format(value=value, **asdict(wording)) + "."
