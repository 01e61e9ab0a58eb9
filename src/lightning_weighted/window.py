r"""One rank's accumulation window, whatever the engine: counts in, loss scales out, one result on every rank.

The objective of one optimizer step, over ranks :math:`r` and the microbatches :math:`m` of its accumulation
window, each holding :math:`n_{rm}` valid items whose mean gradient is :math:`\bar g_{rm}`:

.. math::

    N = \sum_r \sum_m n_{rm}, \qquad g = \frac{1}{N} \sum_r \sum_m n_{rm}\, \bar g_{rm}.

Each rank multiplies microbatch :math:`m`'s loss by :meth:`Window.add`'s scale, so that its accumulated gradient
is :math:`\sum_m n_{rm} \bar g_{rm} / c_r` (:class:`LossScale` names :math:`c_r`), and sends
:meth:`Window.payload` to a SUM over ranks. The engine's adapter brings :math:`N` to the gradients (inside DDP's
communication hook, as one division of FSDP's gradient shards, or, where the counts are known before the window's
first forward, in the loss scales themselves) and hands the summed payload to :meth:`Window.finish`, which gives
every rank the same result, or the same error.

Worked trace: ``w = 10``, per-item loss :math:`\tfrac12 (w - y)^2`; rank 0 holds targets ``[9, 9]``
(``n = 2``, mean gradient 1), rank 1 holds ``[7] * 6`` (``n = 6``, mean gradient 3).
:math:`g = (2 \cdot 1 + 6 \cdot 3) / 8 = 2.5`, where plain DDP averages means: :math:`(1 + 3) / 2 = 2`, and one
SGD step with lr 0.1 lands on ``9.75`` instead of ``9.8``. Against a mean-across-:math:`P`-ranks reducer the
weights are the scales :math:`P n_r / N = 0.5` and :math:`1.5`; with equal counts everywhere and one
microbatch per window, dividing by :math:`N / c_r` is dividing by :math:`P`, plain DDP's average.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum

import torch
from torch import Tensor

from lightning_weighted._counts import MAX_ITEMS, TRAINER, Count, CountPayload, CountProblem, Wording, decode

__all__ = ["LossScale", "Window", "WindowResult"]


class LossScale(Enum):
    r"""What a rank's microbatch losses are scaled to, :math:`c_r` in the objective's terms.

    - ``ITEM_SUM``: :math:`c_r = 1`; losses are sums over items, the gradients are divided by :math:`N` once
      (after their SUM or before it).
    - ``MEAN_SIZED``: :math:`c_r = n^{\mathrm{ref}}_r`, the rank's first positive count of the window: losses stay
      of the size of a mean, for reductions that would overflow with item sums (fp16), and are untouched with
      one microbatch per window.
    - ``GLOBAL_MEAN``: :math:`c_r = N / D`, the same on every rank: each loss enters its backward weighted as in
      :math:`g`, times :math:`D`, what the reduction divides the SUM of the gradients by, so that it gives
      :math:`g` with nothing left to divide, at any precision: :math:`D = P` for a reduction that averages over the
      :math:`P` ranks (DDP's own), 1 for one that SUMs (FSDP's, as the sharded strategies configure it). The
      window's counts must be summed before its first backward: :meth:`Window.plan` them from the batches ahead,
      :meth:`Window.receive` their SUM.
    """

    ITEM_SUM = "item_sum"
    MEAN_SIZED = "mean_sized"
    GLOBAL_MEAN = "global_mean"


@dataclass(frozen=True)
class WindowResult:
    """What the count reduction of one optimizer step found, the same on every rank except ``local_items``.

    Attributes:
        step: the optimizer step (``global_step``) the window ended at.
        items: the global item count ``N`` of the window; 0 means the step changed nothing.
        local_items: this rank's items in the window.
        loss: the global item mean of the loss, ``Σ_r Σ_m n_rm · loss_rm / N`` (NaN when ``N = 0``).
        ranks_with_more: how many ranks hold real batches after this window.
        ranks: :math:`P`, the ranks whose counts were summed (the data-parallel ones; tensor-parallel peers share
            their counts).
    """

    step: int
    items: float
    local_items: float
    loss: float
    ranks_with_more: int = 0
    ranks: int = 1


class Window:
    """One rank's account of one accumulation window.

    Args:
        scale: what the losses are scaled to (see :class:`LossScale`).

    Example (rank 1 of the worked trace, whose one microbatch holds 6 items)::

        >>> import torch
        >>> window = Window(LossScale.ITEM_SUM)
        >>> window.add(Count(6.0), loss=torch.tensor(4.0))  # its mean loss, times 6: an item sum
        6.0
        >>> payload = window.payload(rank=1, more=False)
        >>> (payload.items, float(payload.loss_sum))
        (6.0, 24.0)
    """

    __slots__ = ("_losses", "items", "problem", "reference", "scale", "total")

    def __init__(self, scale: LossScale = LossScale.ITEM_SUM) -> None:
        self.scale = scale
        self.items = 0.0
        self.reference: float | Tensor = 1.0 if scale is LossScale.ITEM_SUM else 0.0  # c_r; 0 until known
        self.total: float | Tensor | None = None  # N, once received (GLOBAL_MEAN)
        self.problem: tuple[CountProblem, float] | None = None
        self._losses: list[tuple[Tensor, float]] = []  # (loss, n or 1) per weighted microbatch, kept on the device

    def plan(self, counts: Iterable[Count]) -> None:
        """Records the counts of the window's microbatches before its first forward (``GLOBAL_MEAN``)."""
        for count in counts:
            self._record(count)

    def receive(self, items: float | Tensor, divisor: int) -> None:
        """Takes ``N``, the SUM of the planned counts over the ranks, and :math:`D` (see ``GLOBAL_MEAN``).

        ``N`` may still be on the device (a 0-dim tensor): the factors are then tensors too, and nothing is read.
        """
        self.total = items
        if isinstance(items, Tensor):
            self.reference = torch.where(items > 0, items, torch.ones_like(items)) / divisor
        else:
            self.reference = (items if items > 0 else 1.0) / divisor  # N = 0: every factor is 0 anyway

    def add(self, count: Count, loss: Tensor | None = None, item_sum: bool = False) -> float | Tensor:
        """Records one microbatch; returns the factor its loss is multiplied by (0.0: it contributes nothing).

        Args:
            count: the microbatch's count (under ``GLOBAL_MEAN`` the planned one, or its problem); an invalid one is
                recorded as the window's problem.
            loss: the microbatch's loss (kept detached for the window's loss, never read on the host).
            item_sum: whether ``loss`` is a sum over the items rather than their mean.
        """
        if self.scale is not LossScale.GLOBAL_MEAN:
            weighted = self._record(count)
        elif self.total is None:
            raise RuntimeError("the window's planned counts were not summed: call `Window.receive` before `add`")
        else:
            weighted = count.problem is None and count.value > 0
            if count.problem is not None:
                self.reject(count.problem, count.value)
        if not weighted:
            return 0.0  # exactly nothing, also from the NaN mean of a fully masked microbatch
        as_sum = 1.0 if item_sum else count.value
        if loss is not None:
            self._losses.append((loss.detach(), as_sum))
        return as_sum / self.reference

    @property
    def loss_sum(self) -> Tensor | None:
        """``Σ_m n_m · loss_m`` over the weighted microbatches, in float64 on the losses' device (no host read)."""
        sums = [loss.double().sum() * as_sum for loss, as_sum in self._losses]
        return torch.stack(sums).sum() if len(sums) > 1 else (sums[0] if sums else None)

    def _record(self, count: Count) -> bool:
        """Adds a microbatch's items, or its problem; returns whether it has items to weigh."""
        if count.problem is not None:
            self.reject(count.problem, count.value)
            return False
        n = count.value
        if n == 0:
            return False
        if self.items + n >= MAX_ITEMS:
            self.reject(CountProblem.TOO_LARGE, self.items + n)
            return False
        if self.reference == 0 and self.scale is LossScale.MEAN_SIZED:
            self.reference = n
        self.items += n
        return True

    def reject(self, problem: CountProblem, value: float = math.nan) -> None:
        """Records a microbatch that cannot be weighted; the window reports its first one."""
        if self.problem is None:
            self.problem = (problem, value)

    def payload(self, rank: int, more: bool = True) -> CountPayload:
        """This rank's contribution to the window's count SUM.

        Args:
            rank: this rank's index in the group the counts are summed over.
            more: whether this rank holds real batches after this window (see :mod:`.participation`).
        """
        return CountPayload(self.items, self.problem, rank, more, self.loss_sum)

    def handover(self, following: float, more: bool) -> list[float]:
        """This rank's :class:`~lightning_weighted._counts.Handover` at the end of a ``GLOBAL_MEAN`` window.

        Its loss slot holds 0: the share of the loss is on the device, and :meth:`add_share` adds it there.

        Args:
            following: the planned items of the next window (0 if there is none).
            more: whether this rank holds real batches after this window.
        """
        return [following, float(self.problem is not None), float(more), 0.0]

    def add_share(self, slot: Tensor) -> None:
        """Adds this rank's share of the window's loss, ``Σ n·loss / N``, to ``slot`` (a 0-dim tensor on the device).

        One in-place op per weighted microbatch, in the slot's dtype (the handover's loss slot); nothing is read.
        """
        total = self.total
        assert total is not None, "the window's planned counts were not summed: call `Window.receive` first"
        for loss, as_sum in self._losses:  # N > 0 here: the microbatch was weighted
            part = loss if loss.dim() == 0 else loss.sum()
            weight = as_sum / total
            if isinstance(weight, Tensor):  # N still on the device (an epoch's first window)
                slot.add_(part * weight)
            else:
                slot.add_(part, alpha=weight)

    def finish(
        self, summed: Sequence[float], step: int = 0, wording: Wording = TRAINER, ranks: int = 1
    ) -> WindowResult:
        """The window's result from the SUM of every rank's payload; raises its error, the same on every rank.

        Args:
            summed: the SUM of every rank's :meth:`payload`, indexed by :class:`~lightning_weighted._counts.Slot`.
            step: the optimizer step the window ends at.
            wording: how the error names the call that handed over the counts, and the fix.
            ranks: how many ranks' payloads were summed.
        """
        total = decode(summed, wording)
        if total.error is not None:
            raise total.error
        loss = total.loss_sum / total.items if total.items > 0 else math.nan
        return WindowResult(step, total.items, self.items, loss, total.ranks_with_more, ranks)
