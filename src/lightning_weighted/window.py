r"""A microbatch's count and one rank's accumulation window: counts in, loss factors out, one payload, one result.

The objective of one optimizer step, over ranks :math:`r` and the microbatches :math:`m` of its accumulation
window, each holding :math:`n_{rm}` valid items whose mean gradient is :math:`\bar g_{rm}`:

.. math::

    N = \sum_r \sum_m n_{rm}, \qquad g = \frac{1}{N} \sum_r \sum_m n_{rm}\, \bar g_{rm}.

With named loss parts, each part :math:`k` is a mean over its own items and the gradient is that of
:math:`\sum_k \frac{1}{N_k} \sum_{r,m} n_{krm} \bar\ell_{krm}`: the window holds the :math:`K` counts of each
microbatch as one vector (:class:`Parts`), and a part whose :math:`N_k` is 0 contributes nothing.

The engine's reduction divides the SUM of the ranks' gradients by :math:`D` (:math:`P`, the number of ranks, for an
average such as DDP's; 1 for a SUM). Each microbatch's loss is multiplied by the factor :meth:`Window.factor` returns,
one of two ways (the **two count paths**):

- **counts ahead** (the window's :math:`N` is known before its first forward): the factor is :math:`D\,n/N`, and
  the reduction's result is :math:`g` itself;
- **counts after** (known only once each forward has run): the factor is :math:`n/c`, for a constant :math:`c` the
  same on every rank, and the loop multiplies the reduced gradients by :math:`D\,c/N` once the window's counts are
  summed.

Worked trace: ``w = 10``, per-item loss :math:`\tfrac12 (w - y)^2`; rank 0 holds targets ``[9, 9]`` (``n = 2``, mean
gradient 1), rank 1 holds ``[7] * 6`` (``n = 6``, mean gradient 3). :math:`g = (2 \cdot 1 + 6 \cdot 3) / 8 = 2.5`,
where plain DDP averages means, :math:`(1 + 3) / 2 = 2`; one SGD step with lr 0.1 lands on ``9.75``, not ``9.8``.
Counted ahead, DDP's average (:math:`D = 2`) of the losses scaled by :math:`2 n_r / 8 = 0.5` and :math:`1.5` gives
:math:`(0.5 + 4.5) / 2 = 2.5`; counted after (:math:`c = 1`), the average :math:`(2 + 18) / 2 = 10` times
:math:`D c / N = 1/4` gives the same. With equal counts and one microbatch per window, either is plain DDP's average.

Pure: nothing here touches ``torch.distributed`` or Lightning, and no count on a device is read on the host.
"""

from __future__ import annotations

import math
import numbers
import struct
import sys
from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from functools import cache, partial, reduce
from itertools import chain, compress, cycle, repeat
from operator import add, attrgetter, mul, truediv
from typing import NamedTuple, cast

import torch
from torch import Tensor

__all__ = ["Count", "Counts", "Parts", "Problem", "Slot", "Window", "WindowResult", "Wording", "host_items", "payload"]
__all__ += ["problem_error", "read_count", "read_counts", "valid_count", "window_result"]

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


@dataclass(frozen=True)
class Wording:
    """How count errors name the call that handed over a loss and its count, and the fix they give."""

    source: str  # the call and its verb, as in "training_step returned"
    fix: str  # the sentence that says what a valid count is and where it goes
    hooks: str = "a transfer hook"  # the hooks that change a batch between the loader and the step
    strategy: str = "a weighted strategy"  # the strategy's name
    ahead: str = "ItemCounter took from the same batch"  # what took a count ahead


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
)
_MESSAGES: dict[Problem, str] = {  # a ValueError each, but for the types of `_TYPES`
    Problem.NEGATIVE: "a microbatch's count is negative ({value!r})",
    Problem.NOT_FINITE: "a microbatch's count is not finite ({value!r})",
    Problem.NOT_A_NUMBER: "a microbatch's count is not a number",
    Problem.NOT_A_SCALAR: "a microbatch's count is a tensor with more than one element",
    Problem.NO_LOSS: "{source} None instead of a loss",
    Problem.NO_GRAPH: "{source} a loss that is not attached to the graph",
    Problem.FRACTIONAL: "a microbatch's count of examples or tokens is fractional ({value!r})",
    Problem.TOO_LARGE: "the window's count reaches 2**53 ({value!r}), where one item no longer changes a float64 sum;"
    " count in coarser units or rescale the sample weights",
    Problem.REDUCTION: "{source} a 'reduction' that is neither 'mean' nor 'sum'; use 'sum' with a loss summed over"
    " the microbatch's items, or leave it out for a mean",
    Problem.MISSING: "{source} no count",
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
    Problem.PARTS: "{source} loss parts whose names differ from the parts ItemCounter counts (or no 'parts' where it"
    " counts several); return `{{'loss': total, 'parts': {{name: mean, ...}}}}` with one mean per counted part",
    Problem.PARTS_AFTER: "{source} loss parts ('parts'), each a mean over its own items, whose gradients cannot be"
    " divided by their own counts once they are accumulated together. Count each part ahead: `ItemCounter(parts="
    "{{name: ItemCounter(...), ...}})`, or `fabric.strategy.count_ahead({{name: [n, ...], ...}})` under Fabric",
}
_TYPES: dict[Problem, type[Exception]] = {
    **dict.fromkeys((Problem.NOT_A_NUMBER, Problem.NOT_A_SCALAR, Problem.MISSING, Problem.AUX), TypeError),
    **dict.fromkeys((Problem.NO_LOSS, Problem.NO_GRAPH), RuntimeError),
}
_WITH_VALUE = (Problem.NEGATIVE, Problem.NOT_FINITE, Problem.FRACTIONAL, Problem.TOO_LARGE, Problem.DISAGREES)
_OWN_FIX = frozenset(Problem) - {  # a message that says what to do itself; the others end with the wording's fix
    Problem.NEGATIVE, Problem.NOT_FINITE, Problem.NOT_A_NUMBER, Problem.NOT_A_SCALAR, Problem.NO_LOSS,
    Problem.NO_GRAPH, Problem.FRACTIONAL, Problem.MISSING,
}  # fmt: skip


class Count(NamedTuple):
    """One microbatch's count, checked."""

    value: float | Tensor  # valid items (or weights' sum): a float, or a float64 0-dim tensor never read on the host
    problem: Problem | Tensor | None = None  # for a tensor count, a float64 0-dim tensor of its Problem (0: valid)
    implicit: bool = False  # the batch size was counted only because nothing gave a count


def read_count(value: object, integer: bool = False, host: bool = False) -> Count:
    """Checks a count: on the host for a number, on its device for a tensor (nothing is read back).

    Args:
        value: an int, a float or a one-element tensor.
        integer: whether the count must be a whole number (examples, tokens).
        host: read a tensor on the host (a count taken from a batch before it moves to the device).
    """
    if isinstance(value, Tensor):
        if value.numel() != 1:
            return Count(math.nan, Problem.NOT_A_SCALAR)
        if value.dtype == torch.bool or value.is_complex():
            return Count(math.nan, Problem.NOT_A_NUMBER)
        if host:
            return read_count(value.item(), integer)
        tensor = value if value.dim() == 0 else value.reshape(())
        tensor = (tensor.detach() if tensor.requires_grad else tensor).double()
        edges, codes = _buckets(tensor.device)  # -inf, [-max, 0), [0, inf), then inf and NaN
        problem = codes.take(torch.searchsorted(edges, tensor, right=True))
        if integer and value.is_floating_point():  # the first failing check wins
            problem = torch.where((problem == 0) & (tensor != tensor.floor()), float(Problem.FRACTIONAL), problem)
        return Count(tensor, problem)
    if isinstance(value, bool) or not isinstance(value, (int, float, numbers.Real)):  # exact types before the ABC
        return Count(math.nan, Problem.NOT_A_NUMBER)
    number = float(value)
    if not math.isfinite(number):
        return Count(number, Problem.NOT_FINITE)
    if number < 0:
        return Count(number, Problem.NEGATIVE)
    if integer and not number.is_integer():
        return Count(number, Problem.FRACTIONAL)
    return Count(number)


@cache
def _buckets(device: torch.device) -> tuple[Tensor, Tensor]:
    """Where a count lies among ``[-max, 0, inf]`` (NaN past them all), and each interval's problem code."""
    edges = torch.tensor([-sys.float_info.max, 0.0, math.inf], dtype=torch.float64, device=device)
    codes = [Problem.NOT_FINITE, Problem.NEGATIVE, 0, Problem.NOT_FINITE]
    return edges, torch.tensor(codes, dtype=torch.float64, device=device)


def valid_count(count: Count | None) -> float | Tensor:
    """A count's value where it is valid, else 0 (a count on a device is checked there)."""
    if count is None or isinstance(count.problem, Problem):
        return 0.0
    return count.value if count.problem is None else torch.where(count.problem == 0, count.value, 0.0)


class Counts(NamedTuple):
    """One microbatch's count of each loss part (one count, for one loss), checked together as it is taken."""

    values: tuple[float | Tensor, ...]  # as each part's :class:`Count` holds it
    problems: tuple[Problem | Tensor | None, ...] | None = None  # ``None``: every count a valid number on the host

    def part(self, k: int) -> Count:
        """Part ``k``'s count."""
        return Count(self.values[k], None if self.problems is None else self.problems[k])

    def each(self) -> list[Count]:
        """Every part's count."""
        return list(map(Count, self.values, self.problems or repeat(None)))


_NUMBERS, _INT = frozenset((int, float)), frozenset((int,))  # exactly: a bool is not a count


def read_counts(values: Sequence[object], integer: Sequence[bool], host: bool = False) -> Counts:
    """Checks one microbatch's count of each part: valid numbers in one pass, else each as :func:`read_count` does.

    Args:
        values: each part's count: an int, a float or a one-element tensor.
        integer: whether each part's count must be a whole number.
        host: read the tensors on the host (a batch counted before it moves to the device).
    """
    if host:
        values = [v.item() if isinstance(v, Tensor) and v.numel() == 1 else v for v in values]
    types = set(map(type, values))
    if types == _INT and min(cast("Sequence[int]", values)) >= 0:  # whole and finite (an int is some count)
        return Counts(tuple(map(float, cast("Sequence[int]", values))))
    if types <= _NUMBERS:
        floats = tuple(map(float, cast("Sequence[float]", values)))
        whole = all(map(float.is_integer, compress(floats, integer)))
        if math.isfinite(sum(floats)) and min(floats, default=0.0) >= 0 and whole:  # a finite sum: no NaN, no inf
            return Counts(floats)
    each = list(map(read_count, values, integer, repeat(host)))
    problems = tuple(map(attrgetter("problem"), each))
    return Counts(tuple(map(attrgetter("value"), each)), problems if any(p is not None for p in problems) else None)


def host_items(rows: Sequence[Counts], parts: int = 1) -> list[float]:
    """Each part's sum of the ``rows``' valid counts on the host (a count on a device, or invalid, adds 0 here)."""
    if any(map(attrgetter("problems"), rows)):
        rows = [Counts(tuple(v if isinstance(v, float) else 0.0 for v in map(valid_count, row.each()))) for row in rows]
    values = map(attrgetter("values"), rows)  # each row's counts added to the sum of the rows before it, part by part
    return cast("list[float]", list(reduce(partial(map, add), values))) if rows else [0.0] * parts


@dataclass(frozen=True)
class WindowResult:
    """What one optimizer step's window summed to, the same on every rank except ``local_items``."""

    step: int  # the optimizer step (global_step) the window ended at
    items: float  # the global item count N (with several parts, the sum of theirs); 0: the step changed nothing
    local_items: float  # this rank's items in the window
    loss: float  # Σ_r Σ_m n_rm · loss_rm / N (with parts, the sum of their means; NaN where N = 0)
    parts: Mapping[str, WindowResult] = field(default_factory=dict)  # each named part's own result (empty for one loss)


class _PartResults(Mapping[str, WindowResult]):
    """Each named part's :class:`WindowResult`, made as it is read (a log reads it; the step itself does not)."""

    def __init__(self, step: int, names: Sequence[str], *values: Sequence[float]) -> None:
        self._step, self._names, self._values = step, names, values  # each part's items, local items and mean

    def __getitem__(self, name: str) -> WindowResult:
        if name not in self._names:
            raise KeyError(name)
        items, local, mean = (values[self._names.index(name)] for values in self._values)
        return WindowResult(self._step, items, local, mean)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class Slot(IntEnum):
    """The fields of a window's float64 payload (exact counts up to 2**53): three shared, then K of each other one.

    One value per loss part of each field from ``ITEMS`` on; all but ``LOCAL`` are summed over the ranks. For one
    part, the vector is indexed by :class:`Slot`; :func:`at` finds a field's values for ``K`` parts.
    """

    MORE = 0  # 1 if this rank holds real batches after this window
    NAN_EMPTY = 1  # 1 if a microbatch counted 0 had a non-finite loss (its backward ran through its graph)
    INVALID = 2  # 1 if this rank found a problem
    ITEMS = 3  # each part's Σ_m n_m over this rank's window
    NEXT = 4  # counted ahead: each part's Σ_m n_m over this rank's next window
    LOSS = 5  # each part's Σ_m n_m · loss_m (the item sum, for a loss that is one)
    LOCAL = 6  # each part's items of this rank again, not summed: one host read brings both


SUMMED = len(Slot) - 1  # the summed values of one part's payload
_SHARED = Slot.ITEMS  # the fields before it hold one value whatever the number of parts


def at(slot: Slot, parts: int = 1) -> slice:
    """Where ``slot``'s values (one shared, else one per part) lie in the payload of a window of ``parts`` parts."""
    shared = slot < _SHARED
    start = slot if shared else _SHARED + (slot - _SHARED) * parts
    return slice(start, start + (1 if shared else parts))


# a device count: n, its problem, what it adds to N (None: a check's count), its loss, an item sum
_Held = tuple[Tensor, Tensor, Tensor | None, Tensor | None, bool | None]
_MOST_HELD = 64  # a window holds at most this many losses (or device counts) before it weighs them (an evaluation)


def _detached(loss: Tensor) -> Tensor:
    """A one-element loss as the window holds it: detached, 0-dim (summed only where it has dimensions)."""
    return loss.detach() if loss.dim() == 0 else loss.detach().sum()


class Window:
    """One rank's account of one accumulation window: one loss, or the :class:`Parts` counted ahead.

    Args:
        scale: counts after: :math:`c`, what each loss is divided by beside being multiplied by its count.
        total: counts ahead: the window's :math:`N` (a number, or still on the device), summed before it started.
        divisor: counts ahead: :math:`D`, what the engine's reduction divides the SUM of the gradients by.
        microbatches: counts ahead: :math:`P M`, every rank's microbatches of the window (:meth:`aux_factor`).
        parts: the window's named loss parts, counted ahead (their counts, factors and losses, as vectors).

    Example (rank 1 of the worked trace, counted after)::

        >>> window = Window()
        >>> window.factor(window.add(Count(6.0), loss=torch.tensor(4.0)))  # its mean loss, times 6: an item sum
        6.0
        >>> payload([window], more=False, device=torch.device("cpu")).tolist()  # MORE, ..., ITEMS, NEXT, LOSS, LOCAL
        [0.0, 0.0, 0.0, 6.0, 0.0, 24.0, 6.0]
    """

    __slots__ = (
        "_device", "_first", "_held", "_tensors", "divisor", "items", "microbatches", "parts", "problem", "scale",
        "total",
    )  # fmt: skip

    def __init__(
        self,
        scale: float | Tensor = 1.0,
        total: float | Tensor | None = None,
        divisor: int = 1,
        microbatches: int = 1,
        parts: Parts | None = None,
    ) -> None:
        self.scale, self.total, self.divisor, self.microbatches, self.parts = scale, total, divisor, microbatches, parts
        self.items = 0.0  # Σ n of host counts
        self.problem = parts.problem if parts is not None else None  # the first problem known on the host
        self._device: dict[Slot, Tensor] = {}  # fields summed on the device so far: Σ n·loss, NAN_EMPTY, ITEMS
        self._held: tuple[list[Tensor], list[float]] = ([], [])  # host counts' losses, weighted as the window ends
        self._tensors: list[_Held] = list(parts.checks) if parts is not None else []  # a checked count: no loss
        self._first: Tensor | None = None  # the first [problem, value] of the device counts weighed already

    @property
    def ahead(self) -> bool:
        """Whether the window's ``N`` was known before its first forward."""
        return self.total is not None or self.parts is not None

    def add(self, count: Count, loss: Tensor | None = None, item_sum: bool = False) -> float | Tensor:
        """Records one microbatch; returns its weight, :math:`n` (1 for an item sum; ``0.0``: it contributes nothing).

        Args:
            count: the microbatch's count (counted ahead: the one the window's ``N`` holds).
            loss: the microbatch's loss, kept detached for the window's loss (never read on the host).
            item_sum: whether ``loss`` is a sum over the items rather than their mean.
        """
        n, problem = count.value, count.problem
        if isinstance(problem, Problem):
            self.reject(problem, n if isinstance(n, float) else math.nan)
            return 0.0
        if isinstance(n, Tensor) or isinstance(problem, Tensor):
            if not isinstance(n, Tensor) or n.dtype is not torch.float64:  # `read_count` gives float64 already
                n = torch.as_tensor(n, dtype=torch.float64, device=problem.device if problem is not None else None)
            problem = problem if problem is not None else torch.zeros_like(n)
            counted = torch.where(problem == 0, n, 0.0)  # a valid count weighs itself, 0 included
            self._hold((n, problem, counted, None if loss is None else _detached(loss), item_sum))
            return (counted > 0).double() if item_sum else counted
        if n == 0:
            return 0.0  # exactly nothing, also from the NaN mean of a fully masked microbatch
        if self.items + n >= MAX_ITEMS:
            self.reject(Problem.TOO_LARGE, self.items + n)
            return 0.0
        self.items += n
        weight = 1.0 if item_sum else n
        if loss is not None:
            losses, weights = self._held
            losses.append(_detached(loss))
            weights.append(weight)
            if len(losses) == _MOST_HELD:
                self._weigh_held()
        return weight

    def _weigh_held(self) -> None:
        """Adds the held losses, times their weights, into the window's loss: one product for the lot."""
        losses, weights = self._held
        if not losses:
            return
        if len(losses) == 1:
            value = losses[0].double() * weights[0]
        else:  # the losses cast once and weighted by a float64 vector of the weights
            value = torch.dot(torch.stack(losses).double(), host_tensor(weights, losses[0].device))
        _into(self._device, Slot.LOSS, value)
        self._held = ([], [])

    def _hold(self, count: _Held) -> None:
        """Holds a device count; the window weighs them where it holds :data:`_MOST_HELD`, keeping the first problem."""
        self._tensors.append(count)
        if len(self._tensors) >= _MOST_HELD:
            self._first = _first_of(self._first, _first_problem(self._tensors))
            _add_counts(self._device, self._tensors)
            self._tensors = []

    def check(self, given: Count, planned: Count, problem: Problem = Problem.DISAGREES) -> None:
        """Records ``problem`` where a count taken again differs from the planned one (a tensor, on its device)."""
        if isinstance(planned.problem, Problem) or isinstance(given.problem, Problem):
            if not isinstance(planned.problem, Problem) and isinstance(given.problem, Problem):
                self.reject(given.problem, given.value if isinstance(given.value, float) else math.nan)
            return
        tensor = next((v for v in (given.value, planned.value) if isinstance(v, Tensor)), None)
        if tensor is not None:  # compared on the device
            n = torch.as_tensor(given.value, dtype=torch.float64, device=tensor.device)
            kind = given.problem if isinstance(given.problem, Tensor) else torch.zeros_like(n)
            differs = (n != planned.value) & (kind == 0) & (planned.problem is None or planned.problem == 0)
            self._hold((n, torch.where(differs, float(problem), kind), None, None, None))
        elif given.value != planned.value:
            self.reject(problem, float(given.value))

    def aux_factor(self) -> float | None:
        """An auxiliary term's factor, :math:`D / (P M)`; ``None`` counted after, where ``N`` would divide it too."""
        return self.divisor / self.microbatches if self.ahead else None

    def factor(self, weight: float | Tensor) -> float | Tensor:
        """What the loss of a microbatch of weight ``weight`` is multiplied by: :math:`D w / N`, or :math:`w / c`."""
        if isinstance(weight, float) and weight == 0:
            return 0.0
        if self.total is None:
            return weight if isinstance(self.scale, float) and self.scale == 1.0 else weight / self.scale
        if isinstance(self.total, Tensor):  # N still on the device: an epoch's first window counted ahead
            return torch.where(self.total > 0, weight * self.divisor / self.total, 0.0)
        return weight * self.divisor / self.total if self.total > 0 else 0.0

    def empty(self, loss: Tensor) -> None:
        """Notes whether an empty microbatch's loss, backpropagated all the same, is finite (``NAN_EMPTY``)."""
        _into(self._device, Slot.NAN_EMPTY, (~torch.isfinite(loss.detach())).any().double(), torch.maximum)

    def reject(self, problem: Problem, value: float = math.nan) -> None:
        """Records a microbatch that cannot be weighted; the window reports its first problem."""
        if self.problem is None:
            self.problem = (problem, value)

    def problem_row(self, device: torch.device) -> Tensor:
        """``[problem, value]`` of this rank's first problem (``[0, 0]``: none), on ``device``."""
        if self.problem is not None:
            return torch.tensor([float(self.problem[0]), self.problem[1]], dtype=torch.float64, device=device)
        first = _first_of(self._first, _first_problem(self._tensors)) if self._tensors else self._first
        if first is None:
            return torch.zeros(2, dtype=torch.float64, device=device)
        items = self.device_fields().get(Slot.ITEMS)
        total = (items if items is not None else first.new_zeros(())) + self.items
        too_large = torch.stack([first.new_tensor(float(Problem.TOO_LARGE)), total])
        return torch.where((first[0] == 0) & (total >= MAX_ITEMS), too_large, first).to(device)

    def device_fields(self) -> dict[Slot, Tensor]:
        """The payload's fields that live on a device, in one pass over the window's device counts."""
        self._weigh_held()
        fields = dict(self._device)
        problems = [self._first[0]] if self._first is not None else []
        problems += [_add_counts(fields, self._tensors)] if self._tensors else []
        if self.problem is None and problems:  # 1 where a count is invalid or N reaches 2**53: `problem_row` says which
            invalid = problems[0] if len(problems) == 1 else torch.maximum(*problems)
            items = fields.get(Slot.ITEMS)
            if items is not None:
                invalid = invalid + ((items + self.items if self.items else items) >= MAX_ITEMS)
            fields[Slot.INVALID] = invalid.clamp(max=1.0)
        return fields


def _add_counts(fields: dict[Slot, Tensor], tensors: list[_Held]) -> Tensor:
    """Adds held device counts, and the losses held with them, into ``fields``; returns their largest problem."""
    held = [t for t in tensors if t[2] is not None]  # a check's count (a planned one) adds nothing
    if held:
        counted = torch.stack(cast("list[Tensor]", [t[2] for t in held]))
        _into(fields, Slot.ITEMS, counted.sum())
        fields[Slot.LOCAL] = fields[Slot.ITEMS]
        given = [t[3] for t in held]
        if any(x is not None for x in given):
            losses = torch.stack([counted.new_zeros(()) if x is None else x for x in given]).double()
            sums, valid = [t[4] for t in held], counted > 0
            weights = counted  # a mean's count; a sum's 1 where it counts any
            if any(sums):
                weights = torch.where(torch.tensor(sums, device=counted.device), valid.double(), counted)
            _into(fields, Slot.LOSS, torch.dot(torch.where(valid, losses, 0.0), weights))  # an inf of no count: 0
            empty = torch.dot(torch.where(valid, 0.0, losses), counted)  # NaN where a loss counted 0 is not finite
            _into(fields, Slot.NAN_EMPTY, empty.isnan().double(), torch.maximum)
    return torch.stack([t[1] for t in tensors]).amax()


def _first_problem(tensors: list[_Held]) -> Tensor:
    """The first held device count's ``[problem, value]`` (``[0, 0]``: none)."""
    n, problems = torch.stack([t[0] for t in tensors]), torch.stack([t[1] for t in tensors])
    first = (problems > 0).double().argmax()  # the first microbatch if none
    kind = torch.take(problems, first)
    return torch.stack([kind, torch.where(kind > 0, torch.take(n, first), 0.0)])


def _first_of(earlier: Tensor | None, later: Tensor) -> Tensor:
    """The first of two ``[problem, value]`` rows that holds a problem (``later`` where neither does)."""
    return later if earlier is None else torch.where(earlier[0] > 0, earlier, later)


def _into(fields: dict[Slot, Tensor], slot: Slot, value: Tensor, combine: Callable[..., Tensor] = torch.add) -> None:
    """Adds ``value`` into a field of ``fields`` (or keeps the larger, with ``torch.maximum``)."""
    held = fields.get(slot)
    fields[slot] = value if held is None else combine(held, value)


class Parts:
    r"""The :math:`K` named parts of one window counted ahead, held as vectors: a fixed number of tensor operations.

    Microbatch :math:`m` backpropagates :math:`\sum_k f_{mk} \ell_{mk}`, the factors :math:`D w_{mk} / N_k` of
    :meth:`Window.factor` (:math:`w` the count of a mean, 1 for a sum over items that holds some) copied to the device
    once per window, as are each part's items and problems (a replay is planned with a count of 0); each part's
    :math:`\sum_m w_{mk} \ell_{mk}` is summed once per window.

    Args:
        rows: each microbatch's counts, one per part.
        totals: each part's :math:`N` (numbers, or still on the device).
        divisor: :math:`D`, what the engine's reduction divides the SUM of the gradients by.
        device: where the gradients live.
    """

    def __init__(
        self, rows: Sequence[Counts], totals: Sequence[float | Tensor] | Tensor, divisor: int, device: torch.device
    ) -> None:
        self.count = parts = len(totals)
        self.microbatches = len(rows)
        self.problem: tuple[Problem, float] | None = None  # the first problem known on the host
        valid: list[float | Tensor] = list(chain.from_iterable(map(attrgetter("values"), rows)))  # microbatch-major
        flat: list[Count] = []
        if any(map(attrgetter("problems"), rows)):  # some count was checked on its device, or found invalid
            flat = list(chain.from_iterable(map(Counts.each, rows)))
            valid = list(map(valid_count, flat))
            found = [(p, n if isinstance(n, float) else math.nan) for n, p, _ in flat if isinstance(p, Problem)]
            self.problem = found[0] if found else None
        self.device_items: Tensor | None = None
        self.checks: list[_Held] = []  # the counts on a device, checked there by the window (and TOO_LARGE)
        self._device = device
        self._tables: dict[tuple[bool, torch.dtype], tuple[Tensor, Sequence[Tensor]]] = {}  # by item sum and dtype
        self._held: list[tuple[int, Tensor, Tensor]] = []  # each microbatch, its weights' table, its losses
        host = not flat or set(map(type, valid)) <= {float}  # every count a number on the host
        if host and not isinstance(totals, Tensor) and set(map(type, totals)) <= {float}:  # the N too
            self._host: list[float] | None = cast("list[float]", valid)  # then each part's D / N_k
            self._scale: list[float] | Tensor = [divisor / t if t > 0 else 0.0 for t in cast("list[float]", totals)]
            self.items = host_items(rows, parts)
            if self.problem is None and max(self.items) >= MAX_ITEMS:
                self.problem = (Problem.TOO_LARGE, max(self.items))
            self.some_empty = min(self._host, default=1.0) <= 0
            return
        as_tensor = partial(torch.as_tensor, dtype=torch.float64, device=device)
        counts = host_tensor(cast("list[float]", valid), device) if host else torch.stack(list(map(as_tensor, valid)))
        self._counts = counts.view(-1, parts)  # copied at once where they are numbers, as the N where it is a vector
        total = as_tensor(totals) if isinstance(totals, Tensor) else torch.stack(list(map(as_tensor, totals)))
        self._scale = torch.where(total > 0, divisor / total, 0.0)
        self.items, self._host, self.some_empty = [0.0] * parts, None, True
        self.device_items = self._counts.sum(0)
        zero, most = as_tensor(0.0), self.device_items.max()
        self.checks = [(as_tensor(n), p, None, None, None) for n, p, _ in flat if isinstance(p, Tensor)]
        self.checks.append((most, torch.where(most >= MAX_ITEMS, float(Problem.TOO_LARGE), zero), None, None, None))

    def loss(self, window: Window, microbatch: int, item_sum: bool, losses: Tensor) -> tuple[float, Tensor]:
        """The factor and loss microbatch ``microbatch`` backpropagates, from its stacked ``losses`` (means or sums).

        ``0.0`` and ``losses`` where no part holds an item (``window`` notes whether they are finite): the engine's 0.
        """
        host, size = self._host, self.count
        if self.some_empty and host is not None and not any(host[microbatch * size : (microbatch + 1) * size]):
            window.empty(losses)
            return 0.0, losses
        weights, factors = self._table(item_sum, losses.dtype)
        self._held.append((microbatch, weights, losses.detach()))
        return 1.0, torch.dot(losses, factors[microbatch])

    def _table(self, item_sum: bool, dtype: torch.dtype) -> tuple[Tensor, Sequence[Tensor]]:
        """The weights (a mean's its count, a sum's 1 where it counts any) and each microbatch's factors, once."""
        table = self._tables.get((item_sum, dtype))
        if table is None:
            if self._host is not None:  # the weights and factors copied to the device at once
                host = list(map(float, map(bool, self._host))) if item_sum else self._host
                factors = list(map(mul, host, cycle(cast("list[float]", self._scale))))
                weights, scaled = host_tensor(host + factors, self._device).view(2, -1, self.count).unbind(0)
            else:
                weights = (self._counts > 0).double() if item_sum else self._counts
                scaled = weights * cast("Tensor", self._scale)
            table = self._tables[item_sum, dtype] = (weights, scaled.to(dtype).unbind(0))
        return table

    def device_fields(self, window: Window) -> dict[Slot, Tensor]:
        """The payload's fields on a device, a vector each; a loss of weight 0 adds 0 (``window`` notes it)."""
        fields: dict[Slot, Tensor] = {}
        if self.device_items is not None:
            fields[Slot.ITEMS] = fields[Slot.LOCAL] = self.device_items
        if not self._held:
            return fields
        rows, tables, held = zip(*self._held, strict=True)
        losses, table = torch.stack(held), tables[0]  # times float64 weights: float64
        whole = rows == tuple(range(self.microbatches)) and all(t is table for t in tables)  # each microbatch once
        weights = table if whole else torch.stack([t[m] for m, t in zip(rows, tables, strict=True)])
        if not self.some_empty:
            fields[Slot.LOSS] = (losses * weights).sum(0)
            return fields
        valid = weights > 0
        window.empty(torch.where(valid, 0.0, losses))
        fields[Slot.LOSS] = torch.where(valid, losses * weights, 0.0).sum(0)
        return fields


def payload(windows: Sequence[Window], more: bool, device: torch.device, next_items: Sequence[float] = ()) -> Tensor:
    """This rank's payload of a window, one float64 vector on ``device`` laid out by :class:`Slot`; nothing read back.

    Args:
        windows: the window; or one window of one loss per part, as the evaluation loss keeps them.
        more: whether this rank holds real batches after the window.
        device: where the gradients live.
        next_items: counted ahead: this rank's items of each part in the next window.
    """
    parts = windows[0].parts
    count = parts.count if parts is not None else len(windows)
    items = parts.items if parts is not None else [w.items for w in windows]
    invalid = any(w.problem is not None for w in windows)
    fields = [float(more), 0.0, float(invalid), *items, *(next_items or [0.0] * count), *[0.0] * count, *items]
    layout: list[tuple[Slot, int]] = []  # each device value's field, and its window (-1: every part's values)
    added: list[Tensor] = []
    for slot, values in (parts.device_fields(windows[0]) if parts is not None else {}).items():
        layout.append((slot, -1))
        added.append(values.to(device))
    scalars = []
    for k, window in enumerate(windows):
        for slot, value in window.device_fields().items():
            layout.append((slot, k))
            scalars.append(value.to(device))
    if scalars:
        added.append(torch.stack(scalars))
    vector = host_tensor(fields, device)
    if added:
        vector.index_add_(0, _index(tuple(layout), count, device), added[0] if len(added) == 1 else torch.cat(added))
    return vector


def window_result(values: Sequence[float], step: int, names: Sequence[str] = ()) -> WindowResult:
    """The window's result from its summed payload: of one loss, or of the parts ``names``."""
    count = max(len(names), 1)
    items, losses, local = (values[at(slot, count)] for slot in (Slot.ITEMS, Slot.LOSS, Slot.LOCAL))
    if min(items) > 0:
        means: Sequence[float] = list(map(truediv, losses, items))
    else:
        means = [loss / n if n > 0 else math.nan for loss, n in zip(losses, items, strict=True)]
    if not names:
        return WindowResult(step, items[0], local[0], means[0])
    loss = sum(compress(means, items)) if any(items) else math.nan  # the means of the parts that hold items
    return WindowResult(step, sum(items), sum(local), loss, _PartResults(step, names, items, local, means))


def host_tensor(values: list[float], device: torch.device) -> Tensor:
    """A float64 vector of host values on ``device``: on a CPU the packed values, else a non-blocking copy."""
    packed = array("d", _packer(len(values))(*values))  # packed whole: torch takes no float of a list in turn
    vector = torch.frombuffer(packed, dtype=torch.float64) if packed else torch.zeros(0, dtype=torch.float64)
    if device.type == "cpu":
        return vector
    return (vector.pin_memory() if device.type == "cuda" else vector).to(device, non_blocking=True)


@cache
def _packer(size: int) -> Callable[..., bytes]:  # `size` floats as doubles in one C pass (an array parses each)
    return struct.Struct(f"{size}d").pack


@cache
def _index(layout: tuple[tuple[Slot, int], ...], count: int, device: torch.device) -> Tensor:
    """Where a payload's device values go, on ``device``, made once per layout (no copy to the device per window)."""
    positions: list[int] = []
    for slot, k in layout:
        where = at(slot, count)
        positions += range(where.start, where.stop) if k < 0 else [where.start + (k if slot >= _SHARED else 0)]
    return torch.tensor(positions, device=device)


def problem_error(rows: Sequence[Sequence[float]], wording: Wording = TRAINER) -> Exception:
    """The one error every rank raises, from every rank's ``[problem, value]`` (``0``: none), in rank order.

    One rank's problem names the rank and quotes its value; one several ranks share is named once; others counted.
    """
    found = [(rank, Problem(round(kind)), value) for rank, (kind, value) in enumerate(rows) if kind > 0]
    kinds = {problem for _, problem, _ in found}
    if len(found) == 1:
        rank, problem, value = found[0]
        error_type, what = _TYPES.get(problem, ValueError), _MESSAGES[problem]
        whole = abs(value) < 2**53 and value.is_integer()  # quoted as an int (`-29`, not `-29.0`)
        quoted = (int(value) if whole else value) if problem in (*_WITH_VALUE, Problem.CHANGED) else None
        return error_type(f"on rank {rank}, {_format(problem, what, quoted, wording)}")
    if len(kinds) == 1:
        kind = kinds.pop()
        error_type, what = _TYPES.get(kind, ValueError), _MESSAGES[kind]
        what = what.replace(" ({value!r})", "").replace(" {value!r}", "")  # the values differ
        return error_type(f"on {len(found)} ranks, {_format(kind, what, None, wording)}")
    return ValueError(f"on {len(found)} ranks, a microbatch's count or loss is invalid. {wording.fix}.")


def _format(problem: Problem, what: str, value: object, wording: Wording) -> str:
    text = what.format(value=value, source=wording.source, hooks=wording.hooks, ahead=wording.ahead)
    return f"{text}." if problem in _OWN_FIX else f"{text}. {wording.fix}."


def imbalance(largest: float, items: float, ranks: int) -> float:
    """``max_r P·n_r / N``: how much more weight the items of the rank with most get than plain DDP gives them."""
    return ranks * largest / items if items > 0 else 1.0
