r"""One rank's accumulation window, whatever the engine: counts in, loss factors out, one payload, one result.

The objective of one optimizer step, over ranks :math:`r` and the microbatches :math:`m` of its accumulation
window, each holding :math:`n_{rm}` valid items whose mean gradient is :math:`\bar g_{rm}`:

.. math::

    N = \sum_r \sum_m n_{rm}, \qquad g = \frac{1}{N} \sum_r \sum_m n_{rm}\, \bar g_{rm}.

The engine's reduction divides the SUM of the ranks' gradients by :math:`D` (:math:`P`, the number of ranks, for
an average such as DDP's; 1 for a SUM). Each microbatch's loss is multiplied by the factor :meth:`Window.add`
returns, in one of two ways:

- **counts ahead** (the window's :math:`N` is known before its first forward): the factor is :math:`D\,n/N`, and
  the reduction's result is :math:`g` itself;
- **counts after** (known only once each forward has run): the factor is :math:`n/c`, for a constant :math:`c` the
  same on every rank, and the engine multiplies the reduced gradients by :math:`D\,c/N` once the window's counts
  are summed (:meth:`lightning_weighted.loop.WindowLoop.finish`).

Worked trace: ``w = 10``, per-item loss :math:`\tfrac12 (w - y)^2`; rank 0 holds targets ``[9, 9]``
(``n = 2``, mean gradient 1), rank 1 holds ``[7] * 6`` (``n = 6``, mean gradient 3).
:math:`g = (2 \cdot 1 + 6 \cdot 3) / 8 = 2.5`, where plain DDP averages means: :math:`(1 + 3) / 2 = 2`, and one
SGD step with lr 0.1 lands on ``9.75`` instead of ``9.8``. Counted ahead, DDP's average (:math:`D = 2`) of the
losses scaled by :math:`2 n_r / 8 = 0.5` and :math:`1.5` gives :math:`(0.5 + 4.5) / 2 = 2.5`; counted after
(:math:`c = 1`), the average :math:`(2 + 18) / 2 = 10` times :math:`D c / N = 1/4` gives the same. With equal
counts and one microbatch per window, either is plain DDP's average.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum

import torch
from torch import Tensor

from lightning_weighted.counts import MAX_ITEMS, TRAINER, Count, Problem, Wording, problem_error

__all__ = ["SUMMED", "Slot", "Window", "WindowResult"]


class Slot(IntEnum):
    """The fields of one rank's float64 payload: written by :meth:`Window.payload`, read by :meth:`Window.finish`.

    The first :data:`SUMMED` are summed over the ranks once per window; float64 holds every integer up to 2**53, so
    item counts and weight sums stay exact, and every field is a value of its own, so a non-finite loss never touches
    the counts. Which problem a rank found travels only where some rank found one (:meth:`Window.problem_row`).
    """

    ITEMS = 0  # Σ_m n_m over this rank's window
    NEXT = 1  # counted ahead: Σ_m n_m over this rank's next window
    MORE = 2  # 1 if this rank holds real batches after this window
    LOSS = 3  # Σ_m n_m · loss_m over this rank's window (the item sum, for a loss that is one)
    UNCUT = 4  # 1 if a microbatch counted 0 had a non-finite loss (its backward ran: see `loop`)
    INVALID = 5  # 1 if this rank found a problem
    LOCAL = 6  # this rank's own items again, not summed: one host read brings both


SUMMED = Slot.LOCAL  # the fields summed over the ranks: every one before LOCAL

Rows = Callable[[], Sequence[Sequence[float]]]  # every rank's problem row, gathered where some rank found one


@dataclass(frozen=True)
class WindowResult:
    """What the count reduction of one optimizer step found, the same on every rank except ``local_items``.

    Attributes:
        step: the optimizer step (``global_step``) the window ended at.
        items: the global item count ``N`` of the window; 0 means the step changed nothing.
        local_items: this rank's items in the window.
        loss: the global item mean of the loss, ``Σ_r Σ_m n_rm · loss_rm / N`` (NaN when ``N = 0``).
        ranks_with_more: how many ranks hold real batches after this window.
        ranks: :math:`P`, the ranks whose counts were summed (the data-parallel ones).
        following: counted ahead: the next window's ``N`` (0 where there is none).
        uncut: how many ranks backpropagated a non-finite loss whose count was 0.
    """

    step: int
    items: float
    local_items: float
    loss: float
    ranks_with_more: int = 0
    ranks: int = 1
    following: float = 0.0
    uncut: int = 0


class Window:
    """One rank's account of one accumulation window.

    Args:
        reference: counts after: :math:`c`, what each loss is divided by beside being multiplied by its count.
        total: counts ahead: the window's :math:`N` (a number, or still on the device), summed before it started.
        divisor: counts ahead: :math:`D`, what the engine's reduction divides the SUM of the gradients by.
        shares: counts ahead: :math:`P M`, the ranks times the window's microbatches, over which auxiliary terms
            (:meth:`aux_factor`) are averaged as plain DDP averages its losses.

    Example (rank 1 of the worked trace, counted after)::

        >>> window = Window()
        >>> window.add(Count(6.0), loss=torch.tensor(4.0))  # its mean loss, times 6: an item sum
        6.0
        >>> window.payload(more=False, device=torch.device("cpu")).tolist()  # ITEMS, NEXT, MORE, LOSS, ..., LOCAL
        [6.0, 0.0, 0.0, 24.0, 0.0, 0.0, 6.0]
    """

    __slots__ = ("_device", "_tensors", "divisor", "items", "problem", "reference", "shares", "total")

    def __init__(
        self,
        reference: float | Tensor = 1.0,
        total: float | Tensor | None = None,
        divisor: int = 1,
        shares: int = 1,
    ) -> None:
        self.reference, self.total, self.divisor, self.shares = reference, total, divisor, shares
        self.items = 0.0  # Σ n of host counts
        self.problem: tuple[Problem, float] | None = None  # the first problem known on the host
        self._device: dict[Slot, Tensor] = {}  # Σ n · loss of host counts, on the loss's device
        # the counts that live on a device, as given: (n, its problem, the detached loss, whether an item sum)
        self._tensors: list[tuple[Tensor, Tensor | None, Tensor | None, bool]] = []

    @property
    def ahead(self) -> bool:
        """Whether the window's ``N`` was known before its first forward."""
        return self.total is not None

    def add(self, count: Count, loss: Tensor | None = None, item_sum: bool = False) -> float | Tensor:
        """Records one microbatch; returns the factor its loss is multiplied by (``0.0``: it contributes nothing).

        Args:
            count: the microbatch's count (counted ahead: the one the window's ``N`` holds).
            loss: the microbatch's loss, kept detached for the window's loss (never read on the host).
            item_sum: whether ``loss`` is a sum over the items rather than their mean.
        """
        if isinstance(count.problem, Problem):
            self.reject(count.problem, count.value if isinstance(count.value, float) else math.nan)
            return 0.0
        n = count.value
        if isinstance(n, Tensor):
            return self._add_tensor(n, count.problem, loss, item_sum)
        if n == 0:
            return 0.0  # exactly nothing, also from the NaN mean of a fully masked microbatch
        if self.items + n >= MAX_ITEMS:
            self.reject(Problem.TOO_LARGE, self.items + n)
            return 0.0
        self.items += n
        weight = 1.0 if item_sum else n
        if loss is not None:
            self._accumulate(Slot.LOSS, loss.detach().sum().double() * weight)
        return self._factor(weight)

    def _add_tensor(self, n: Tensor, problem: Tensor | None, loss: Tensor | None, item_sum: bool) -> Tensor:
        # Kept as it is: the window's device fields are computed once, by ``payload``, over all its microbatches.
        self._tensors.append((n, problem, None if loss is None else loss.detach(), item_sum))
        if item_sum:  # 1 for a counted microbatch, 0 for an empty one or a bad count
            weight = (n > 0 if problem is None else (problem == 0) & (n > 0)).double()
        else:  # n, or 0 for a bad count (a count of 0 is 0 already)
            weight = torch.where(n > 0 if problem is None else problem == 0, n, 0.0)
        factor = self._factor(weight)
        assert isinstance(factor, Tensor)
        return factor

    def aux_factor(self) -> float | None:
        """What an auxiliary term is multiplied by (:math:`D / (P M)`: each microbatch of each rank weighs alike).

        ``None`` where the window was counted after its forwards: its :math:`N`, which divides every gradient after
        the reduction, is unknown to the auxiliary terms' backward.

        Example (the 2 ranks of DDP's average, windows of 3 microbatches)::

            >>> Window(total=8.0, divisor=2, shares=2 * 3).aux_factor()
            0.3333333333333333
        """
        return self.divisor / self.shares if self.ahead else None

    def _factor(self, weight: float | Tensor) -> float | Tensor:
        if self.total is None:
            return weight if isinstance(self.reference, float) and self.reference == 1.0 else weight / self.reference
        if isinstance(self.total, Tensor):  # N still on the device: an epoch's first window counted ahead
            return torch.where(self.total > 0, weight * self.divisor / self.total, 0.0)
        return weight * self.divisor / self.total if self.total > 0 else 0.0

    def empty(self, loss: Tensor) -> None:
        """Notes the loss of a microbatch that holds nothing and backpropagates all the same: whether it is finite.

        Its own NaN never reaches the gradients (:mod:`lightning_weighted.engines`); a collective of the model's
        backward may carry it to the other ranks, which the window's end then checks (``UNCUT``).
        """
        self._flag((~torch.isfinite(loss.detach())).any().double())

    def _flag(self, value: Tensor) -> None:
        held = self._device.get(Slot.UNCUT)
        self._device[Slot.UNCUT] = value if held is None else torch.maximum(held, value)

    def _accumulate(self, slot: Slot, value: Tensor) -> None:
        held = self._device.get(slot)
        self._device[slot] = value if held is None else held + value

    def reject(self, problem: Problem, value: float = math.nan) -> None:
        """Records a microbatch that cannot be weighted; the window reports its first problem."""
        if self.problem is None:
            self.problem = (problem, value)

    def payload(self, more: bool, device: torch.device, following: float = 0.0) -> Tensor:
        """This rank's payload, a float64 vector on ``device`` indexed by :class:`Slot`; nothing read from the device.

        Args:
            more: whether this rank holds real batches after this window.
            device: where the gradients live.
            following: counted ahead: this rank's items in the next window.
        """
        fields = [0.0] * len(Slot)
        fields[Slot.ITEMS] = fields[Slot.LOCAL] = self.items
        fields[Slot.NEXT], fields[Slot.MORE] = following, float(more)
        fields[Slot.INVALID] = float(self.problem is not None)
        vector = torch.tensor(fields, dtype=torch.float64)
        if device.type == "cuda":
            vector = vector.pin_memory()  # a pinned, non-blocking copy keeps the host from waiting
        vector = vector.to(device, non_blocking=True)
        parts = self._device_fields()
        if parts:
            values = torch.stack([part.to(device) for part in parts.values()])
            vector.index_add_(0, _index(tuple(parts), device), values)
        return vector

    @staticmethod
    def items_of(summed: Tensor) -> Tensor:
        """``N`` in the summed payload, on its device."""
        return summed[Slot.ITEMS]

    def problem_row(self, device: torch.device) -> Tensor:
        """``[problem, value]`` of this rank's first problem (``[0, 0]``: none), on ``device``.

        The host's first problem if there is one, else the first found on the device, read there.
        """
        if self.problem is not None:
            return torch.tensor([float(self.problem[0]), self.problem[1]], dtype=torch.float64, device=device)
        return torch.stack(self._device_problem()).to(device)

    def finish(
        self, summed: Sequence[float], step: int, wording: Wording = TRAINER, ranks: int = 1, rows: Rows | None = None
    ) -> WindowResult:
        """The window's result from its summed payload; raises its error, the same on every rank.

        Args:
            summed: the payload after the SUM (its first :data:`SUMMED` fields summed over the ranks).
            step: the optimizer step the window ends at.
            wording: how the error names the call that handed over the counts, and the fix.
            ranks: how many ranks' payloads were summed.
            rows: where some rank found a problem, every rank's :meth:`problem_row`, in rank order (a collective
                every rank joins, as each reads the same sum); this rank's own alone by default.
        """
        if summed[Slot.INVALID] > 0:
            found = rows() if rows is not None else [self.problem_row(torch.device("cpu")).tolist()]
            raise problem_error(found, wording)
        items = summed[Slot.ITEMS]
        loss = summed[Slot.LOSS] / items if items > 0 else math.nan
        return WindowResult(
            step,
            items,
            summed[Slot.LOCAL],
            loss,
            round(summed[Slot.MORE]),
            ranks,
            summed[Slot.NEXT],
            round(summed[Slot.UNCUT]),
        )

    def _device_fields(self) -> dict[Slot, Tensor]:
        """The payload's fields that live on a device, in one pass over the window's device counts."""
        fields = dict(self._device)
        if not self._tensors:
            return fields
        _, _, given, sums = zip(*self._tensors, strict=True)
        n, problems = self._stacked()
        zero = n.new_zeros(())
        valid = (problems == 0) & (n > 0)
        counted = torch.where(valid, n, 0.0)
        items = counted.sum()
        fields[Slot.ITEMS] = fields[Slot.LOCAL] = items
        if any(loss is not None for loss in given):
            losses = torch.stack([zero if loss is None else loss if loss.dim() == 0 else loss.sum() for loss in given])
            losses = losses.double()
            if all(sums):  # item sums: each counted microbatch once
                weights = valid.double()
            elif not any(sums):  # means: each by its count
                weights = counted
            else:
                weights = torch.where(torch.tensor(sums, device=n.device), valid.double(), counted)
            loss = torch.where(valid, losses * weights, 0.0).sum()  # an inf loss of no count: 0
            fields[Slot.LOSS] = loss if Slot.LOSS not in fields else fields[Slot.LOSS] + loss
            uncut = (~torch.isfinite(torch.where(valid, 0.0, losses).sum())).double()
            held = fields.get(Slot.UNCUT)
            fields[Slot.UNCUT] = uncut if held is None else torch.maximum(held, uncut)
        if self.problem is None:
            fields[Slot.INVALID] = (_first_problem(n, problems, items + self.items)[0] > 0).double()
        return fields

    def _stacked(self) -> tuple[Tensor, Tensor]:
        """The device counts, and each one's problem (0: valid), stacked in the window's order."""
        n = torch.stack([count for count, *_ in self._tensors])
        zero = n.new_zeros(())
        return n, torch.stack([zero if problem is None else problem for _, problem, *_ in self._tensors])

    def _device_problem(self) -> tuple[Tensor, Tensor]:
        """The first problem among the device counts and its value (``0, 0``: none), with the window's total checked."""
        if not self._tensors:
            zero = torch.zeros((), dtype=torch.float64)
            return zero, zero
        n, problems = self._stacked()
        return _first_problem(n, problems, torch.where((problems == 0) & (n > 0), n, 0.0).sum() + self.items)


def _first_problem(n: Tensor, problems: Tensor, total: Tensor) -> tuple[Tensor, Tensor]:
    """The first of ``problems`` and its count, else :attr:`Problem.TOO_LARGE` and ``total`` where it reaches 2**53."""
    first = (problems > 0).double().argmax()  # the window's first problem (the first microbatch if none)
    kind, value = torch.take(problems, first), torch.take(n, first)
    too_large = (kind == 0) & (total >= MAX_ITEMS)
    kind = torch.where(too_large, float(Problem.TOO_LARGE), kind)
    return kind, torch.where(too_large, total, torch.where(kind > 0, value, 0.0))


_INDICES: dict[tuple[tuple[Slot, ...], torch.device], Tensor] = {}


def _index(slots: tuple[Slot, ...], device: torch.device) -> Tensor:
    """The payload positions of ``slots`` on ``device``, made once per layout (no copy to the device per window)."""
    index = _INDICES.get((slots, device))
    if index is None:
        index = _INDICES[(slots, device)] = torch.tensor([int(slot) for slot in slots], device=device)
    return index
