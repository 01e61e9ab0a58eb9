r"""One rank's accumulation window: each microbatch's count in, its loss factor out, and the window's payload.

The objective of one optimizer step, over ranks :math:`r` and the microbatches :math:`m` of its accumulation window,
each holding :math:`n_{rm}` valid items whose mean gradient is :math:`\bar g_{rm}`:

.. math::

    N = \sum_r \sum_m n_{rm}, \qquad g = \frac{1}{N} \sum_r \sum_m n_{rm}\, \bar g_{rm}.

With named loss parts (:class:`Parts`), each part :math:`k` a mean over its own items, the gradient is that of
:math:`\sum_k \frac{1}{N_k} \sum_{r,m} n_{krm} \bar\ell_{krm}`; a part whose :math:`N_k` is 0 contributes nothing.

The engine's reduction divides the SUM of the ranks' gradients by :math:`D` (:math:`P` ranks for an average such as
DDP's; 1 for a SUM). Each microbatch's loss is multiplied by :meth:`Window.factor`, one of the **two count paths**:

- **counts ahead** (:math:`N` known before the first forward): :math:`D\,n/N`; the reduction's result is :math:`g`;
- **counts after** (known once each forward has run): :math:`n/c`, for a constant :math:`c` the same on every rank;
  the loop multiplies the reduced gradients by :math:`D\,c/N` once the window's counts are summed.

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
from collections.abc import Callable, Sequence
from functools import cache

import torch
from torch import Tensor

from lightning_weighted.count import MAX_ITEMS, Count, DeviceCount, Problem
from lightning_weighted.parts import Parts
from lightning_weighted.payload import Slot, at, host_tensor

__all__ = ["Window", "payload"]

MOST_HELD = 64  # a window holds at most this many losses (or device counts) before it weighs them (an evaluation)


class Window:
    """One rank's account of one accumulation window: one loss, or the :class:`Parts` counted ahead.

    Counted after, ``scale`` is :math:`c`; counted ahead, ``total`` is :math:`N` (a number, or still on the device),
    ``divisor`` :math:`D`, ``microbatches`` :math:`P M`, and ``parts`` the named loss parts.

    Example (rank 1 of the worked trace, counted after)::

        >>> window = Window()
        >>> window.factor(window.add(Count(6.0), loss=torch.tensor(4.0)))  # its mean loss, times 6: an item sum
        6.0
        >>> payload([window], more=False, device=torch.device("cpu")).tolist()  # MORE, ..., ITEMS, NEXT, LOSS, LOCAL
        [0.0, 0.0, 0.0, 6.0, 0.0, 24.0, 6.0]
    """

    def __init__(
        self,
        scale: float | Tensor = 1.0,
        total: float | Tensor | None = None,
        divisor: int = 1,
        microbatches: int = 1,
        parts: Parts | None = None,
    ) -> None:
        self.scale, self.total, self.divisor, self.microbatches, self.parts = scale, total, divisor, microbatches, parts
        self.ahead = total is not None or parts is not None  # whether N was known before the first forward
        self.items = 0.0  # Σ n of the counts on the host
        self.problem = parts.problem if parts is not None else None  # the first problem known on the host
        self._on_device: list[DeviceCount] = list(parts.checks) if parts is not None else []  # summed every MOST_HELD
        self._device: dict[Slot, Tensor] = {}  # fields summed on the device so far: LOSS, NAN_EMPTY, ITEMS, LOCAL
        self._losses: list[Tensor] = []  # the losses of counts on the host, weighed by one product as the window ends
        self._weights: list[float] = []  # and their weights
        self._first: Tensor | None = None  # ``[problem, value]``: the first problem of the device counts summed already

    def add(self, count: Count, loss: Tensor | None = None, item_sum: bool = False) -> float | Tensor:
        """Records one microbatch (``loss`` held detached); returns its weight, :math:`n` (1 for an item sum; or 0)."""
        n, problem = count.value, count.problem
        if isinstance(problem, Problem):
            self.reject(problem, n)
            return 0.0
        if isinstance(n, Tensor) or isinstance(problem, Tensor):  # checked on its device, its weight stays there
            if not isinstance(n, Tensor) or n.dtype is not torch.float64:  # `read_count` gives float64 already
                n = torch.as_tensor(n, dtype=torch.float64, device=problem.device if problem is not None else None)
            if problem is None:
                problem = torch.zeros_like(n)
            counted = torch.where(problem == 0, n, 0.0)  # a valid count weighs itself, 0 included
            self._hold(DeviceCount(n, problem, counted, None if loss is None else _detached(loss), item_sum))
            return (counted > 0).double() if item_sum else counted
        if n == 0:
            return 0.0  # exactly nothing, also from the NaN mean of a fully masked microbatch
        if self.items + n >= MAX_ITEMS:
            self.reject(Problem.TOO_LARGE, self.items + n)
            return 0.0
        self.items += n
        weight = 1.0 if item_sum else n
        if loss is not None:
            self._losses.append(_detached(loss))
            self._weights.append(weight)
            if len(self._losses) == MOST_HELD:
                self._weigh_losses()
        return weight

    def _weigh_losses(self) -> None:
        if not self._losses:
            return
        if len(self._losses) == 1:
            value = self._losses[0].double() * self._weights[0]
        else:
            weights = host_tensor(self._weights, self._losses[0].device)
            value = torch.dot(torch.stack(self._losses).double(), weights)
        _add(self._device, Slot.LOSS, value)
        self._losses, self._weights = [], []

    def _hold(self, count: DeviceCount) -> None:
        self._on_device.append(count)
        if len(self._on_device) >= MOST_HELD:
            self._first = _first_problem(self._on_device, self._first)
            _sum_device_counts(self._device, self._on_device)
            self._on_device = []

    def check(self, given: Count, planned: Count, problem: Problem = Problem.DISAGREES) -> None:
        """Records ``problem`` where a count taken again differs from the planned one (a tensor, on its device)."""
        if isinstance(planned.problem, Problem) or isinstance(given.problem, Problem):
            if not isinstance(planned.problem, Problem) and isinstance(given.problem, Problem):
                self.reject(given.problem, given.value)
            return
        tensor = given.value if isinstance(given.value, Tensor) else planned.value
        if isinstance(tensor, Tensor):  # compared on the device
            n = torch.as_tensor(given.value, dtype=torch.float64, device=tensor.device)
            kind = given.problem if isinstance(given.problem, Tensor) else torch.zeros_like(n)
            differs = (n != planned.value) & (kind == 0) & (planned.problem is None or planned.problem == 0)
            self._hold(DeviceCount(n, torch.where(differs, float(problem), kind)))
        elif given.value != planned.value:
            self.reject(problem, float(given.value))

    def factor(self, weight: float | Tensor) -> float | Tensor:
        """What the loss of a microbatch of weight ``weight`` is multiplied by: :math:`D w / N`, or :math:`w / c`."""
        if isinstance(weight, float) and weight == 0:
            return 0.0
        if self.total is None:  # counts after
            return weight if isinstance(self.scale, float) and self.scale == 1.0 else weight / self.scale
        if isinstance(self.total, Tensor):  # N still on the device: an epoch's first window counted ahead
            return torch.where(self.total > 0, weight * self.divisor / self.total, 0.0)
        return weight * self.divisor / self.total if self.total > 0 else 0.0

    def empty(self, loss: Tensor) -> None:
        """Notes whether an empty microbatch's loss, backpropagated all the same, is finite (``NAN_EMPTY``)."""
        _add(self._device, Slot.NAN_EMPTY, (~torch.isfinite(loss.detach())).any().double(), torch.maximum)

    def reject(self, problem: Problem, value: float | Tensor = math.nan) -> None:
        """Records a microbatch that cannot be weighted; the window reports its first problem (a tensor as NaN)."""
        if self.problem is None:
            self.problem = (problem, math.nan if isinstance(value, Tensor) else value)

    def problem_row(self, device: torch.device) -> Tensor:
        """``[problem, value]`` of this rank's first problem (``[0, 0]``: none), on ``device``."""
        if self.problem is not None:
            return torch.tensor([float(self.problem[0]), self.problem[1]], dtype=torch.float64, device=device)
        first = _first_problem(self._on_device, self._first) if self._on_device else self._first
        if first is None:
            return torch.zeros(2, dtype=torch.float64, device=device)
        items = self.device_fields().get(Slot.ITEMS)
        total = (items if items is not None else first.new_zeros(())) + self.items
        too_large = torch.stack([first.new_tensor(float(Problem.TOO_LARGE)), total])
        return torch.where((first[0] == 0) & (total >= MAX_ITEMS), too_large, first).to(device)

    def device_fields(self) -> dict[Slot, Tensor]:
        """The payload's fields that live on a device, the held device counts summed in one pass."""
        self._weigh_losses()
        fields = dict(self._device)
        invalid = self._first[0] if self._first is not None else None  # the first problem of the counts summed already
        if self._on_device:  # and the largest held
            largest = _sum_device_counts(fields, self._on_device)
            invalid = largest if invalid is None else torch.maximum(invalid, largest)
        if self.problem is None and invalid is not None:  # 1 where a count is invalid or N reaches 2**53
            items = fields.get(Slot.ITEMS)
            if items is not None:
                invalid = invalid + ((items + self.items if self.items else items) >= MAX_ITEMS)
            fields[Slot.INVALID] = invalid.clamp(max=1.0)  # which problem: `problem_row` says
        return fields


def _sum_device_counts(fields: dict[Slot, Tensor], held: list[DeviceCount]) -> Tensor:
    """Adds held device counts, and the losses held with them, into ``fields``; returns their largest problem."""
    added = [count for count in held if count.counted is not None]  # a check's count (a planned one) adds nothing
    if added:
        counted = torch.stack([count.counted for count in added])  # type: ignore[misc]  # none is None
        _add(fields, Slot.ITEMS, counted.sum())
        fields[Slot.LOCAL] = fields[Slot.ITEMS]
        if any(count.loss is not None for count in added):
            given = [counted.new_zeros(()) if count.loss is None else count.loss for count in added]
            losses = torch.stack(given).double()
            valid = counted > 0
            weights = counted  # a mean's count; a sum's 1 where it counts any
            if any(count.item_sum for count in added):
                sums = torch.tensor([count.item_sum for count in added], device=counted.device)
                weights = torch.where(sums, valid.double(), counted)
            _add(fields, Slot.LOSS, torch.dot(torch.where(valid, losses, 0.0), weights))  # an inf of no count: 0
            empty = torch.dot(torch.where(valid, 0.0, losses), counted)  # NaN where a loss counted 0 is not finite
            _add(fields, Slot.NAN_EMPTY, empty.isnan().double(), torch.maximum)
    return torch.stack([count.problem for count in held]).amax()


def _first_problem(held: list[DeviceCount], earlier: Tensor | None) -> Tensor:
    """The first ``[problem, value]`` holding a problem: ``earlier``, else the held counts' (``[0, 0]``: none)."""
    n, problems = torch.stack([count.n for count in held]), torch.stack([count.problem for count in held])
    first = (problems > 0).double().argmax()  # the first microbatch if none
    kind = torch.take(problems, first)
    later = torch.stack([kind, torch.where(kind > 0, torch.take(n, first), 0.0)])
    return later if earlier is None else torch.where(earlier[0] > 0, earlier, later)


def _add(
    fields: dict[Slot, Tensor], slot: Slot, value: Tensor, combine: Callable[[Tensor, Tensor], Tensor] = torch.add
) -> None:
    held = fields.get(slot)
    fields[slot] = value if held is None else combine(held, value)


def _detached(loss: Tensor) -> Tensor:
    return loss.detach() if loss.dim() == 0 else loss.detach().sum()


def payload(windows: Sequence[Window], more: bool, device: torch.device, next_items: Sequence[float] = ()) -> Tensor:
    """This rank's payload of a window, one float64 vector on ``device`` laid out by :class:`Slot`; nothing read back.

    ``windows``: the window, or one window of one loss per part (the evaluation loss's); ``more``: whether this rank
    holds real batches after it; ``next_items``: counted ahead, this rank's items of each part in the next window.
    """
    parts = windows[0].parts
    count = parts.count if parts is not None else len(windows)
    items = parts.items if parts is not None else [window.items for window in windows]
    invalid = any(window.problem is not None for window in windows)
    zeros = [0.0] * count
    # the host's values, by Slot: MORE, NAN_EMPTY, INVALID, then each part's ITEMS, NEXT, LOSS and LOCAL
    on_host = [float(more), 0.0, float(invalid), *items, *(next_items or zeros), *zeros, *items]
    vectors = parts.device_fields(windows[0].empty) if parts is not None else {}  # every part's values each
    scalars = [(slot, k, value) for k, window in enumerate(windows) for slot, value in window.device_fields().items()]
    layout = [(slot, -1) for slot in vectors] + [(slot, k) for slot, k, _ in scalars]  # -1: every part's values
    added = [values.to(device) for values in vectors.values()]
    if scalars:
        added.append(torch.stack([value.to(device) for _, _, value in scalars]))
    vector = host_tensor(on_host, device)
    if added:  # the device's values added into their places in one operation
        values = added[0] if len(added) == 1 else torch.cat(added)
        vector.index_add_(0, _positions(tuple(layout), count, device), values)
    return vector


@cache  # once a layout, on the device: 0.2 µs a window where building it takes 8 µs, and no copy waits for the device
def _positions(layout: tuple[tuple[Slot, int], ...], parts: int, device: torch.device) -> Tensor:
    """Where the device's values of a payload of ``parts`` parts go, each given as its field and window."""
    positions: list[int] = []
    for slot, k in layout:
        where = at(slot, parts)
        if k < 0:  # every part's values
            positions.extend(range(where.start, where.stop))
        else:  # a shared field's one value, or window k's part
            positions.append(where.start if slot < Slot.ITEMS else where.start + k)
    return torch.tensor(positions, device=device)
