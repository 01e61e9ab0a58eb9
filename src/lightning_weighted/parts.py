"""A window's named loss parts (the math: ``window``), counted ahead and held as vectors: fixed tensor work a window."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch import Tensor

from lightning_weighted.count import MAX_ITEMS, Counts, DeviceCount, Problem, host_items, valid_count
from lightning_weighted.payload import Slot, host_tensor

__all__ = ["Parts"]


class Parts:
    """The :math:`K` named parts of one window counted ahead: their counts, factors and losses, made once a window.

    ``rows``: each microbatch's counts, one per part (a replay's are 0); ``totals``: each part's :math:`N` (numbers,
    or still on the device); ``divisor``: :math:`D`.
    """

    def __init__(
        self, rows: Sequence[Counts], totals: Sequence[float | Tensor] | Tensor, divisor: int, device: torch.device
    ) -> None:
        self.count, self.microbatches = len(totals), len(rows)  # K, M
        counts = [count for row in rows for count in row.each()]  # microbatch-major: row m's K counts
        found = [(c.problem, c.value) for c in counts if isinstance(c.problem, Problem)]
        self.problem: tuple[Problem, float] | None = None  # the first problem known on the host
        if found:
            problem, value = found[0]
            self.problem = (problem, value if isinstance(value, float) else math.nan)
        self.device_items: Tensor | None = None  # each part's items, where the counts are on the device
        self.checks: list[DeviceCount] = []  # the counts on a device, checked there by the window (and TOO_LARGE)
        self._device = device
        self._tables: dict[tuple[bool, torch.dtype], tuple[Tensor, Sequence[Tensor]]] = {}  # by item sum and dtype
        self._held: list[tuple[int, Tensor, Tensor]] = []  # each microbatch, its weights' table, its losses
        valid = [valid_count(count) for count in counts]
        on_host = not any(isinstance(n, Tensor) for n in valid)
        host_rows = [valid[m * self.count : (m + 1) * self.count] for m in range(self.microbatches)] if on_host else []
        self._empty = {m for m, row in enumerate(host_rows) if not any(row)}  # no item of any part (N may be on device)
        if on_host and not isinstance(totals, Tensor) and not any(isinstance(t, Tensor) for t in totals):
            self._host: list[float] | None = cast("list[float]", valid)  # every count and every N a number
            self._scale: list[float] | Tensor = [divisor / t if t > 0 else 0.0 for t in cast("list[float]", totals)]
            self.items = host_items(rows, self.count)
            if self.problem is None and max(self.items) >= MAX_ITEMS:
                self.problem = (Problem.TOO_LARGE, max(self.items))
            self.some_empty = min(self._host, default=1.0) <= 0
            return
        flat = host_tensor(cast("list[float]", valid), device) if on_host else _stack(valid, device)
        self._counts = flat.view(-1, self.count)
        total = _float64(totals, device) if isinstance(totals, Tensor) else _stack(totals, device)
        self._scale = torch.where(total > 0, divisor / total, 0.0)
        self._host, self.items, self.some_empty = None, [0.0] * self.count, True
        self.device_items = self._counts.sum(0)
        for count in counts:
            if isinstance(count.problem, Tensor):
                self.checks.append(DeviceCount(_float64(count.value, device), count.problem))
        zero, most = _float64(0.0, device), self.device_items.max()
        self.checks.append(DeviceCount(most, torch.where(most >= MAX_ITEMS, float(Problem.TOO_LARGE), zero)))

    def loss(self, microbatch: int, item_sum: bool, losses: Tensor) -> tuple[float, Tensor]:
        """The factor and loss of microbatch ``microbatch`` (``0.0`` and ``losses`` where the host knows it empty)."""
        if microbatch in self._empty:
            return 0.0, losses
        key = (item_sum, losses.dtype)
        if key not in self._tables:  # the weights (a mean's its count, a sum's 1 where it counts any) and factors
            if self._host is not None:  # made on the host, copied to the device at once
                scale = cast("list[float]", self._scale)
                host = [1.0 if n else 0.0 for n in self._host] if item_sum else self._host
                products = [w * scale[i % self.count] for i, w in enumerate(host)]  # entry i is part i % K's
                weights, scaled = host_tensor(host + products, self._device).view(2, -1, self.count).unbind(0)
            else:
                weights = (self._counts > 0).double() if item_sum else self._counts
                scaled = weights * cast("Tensor", self._scale)
            self._tables[key] = (weights, scaled.to(losses.dtype).unbind(0))
        weights, factors = self._tables[key]
        self._held.append((microbatch, weights, losses.detach()))
        return 1.0, torch.dot(losses, factors[microbatch])

    def device_fields(self, empty: Callable[[Tensor], None]) -> dict[Slot, Tensor]:
        """The payload's fields on a device, a vector each; a loss of weight 0 adds 0, and goes to ``empty``."""
        fields: dict[Slot, Tensor] = {}
        if self.device_items is not None:
            fields[Slot.ITEMS] = fields[Slot.LOCAL] = self.device_items
        if not self._held:
            return fields
        rows, tables, held = zip(*self._held, strict=True)
        losses = torch.stack(held)  # times float64 weights: float64
        if rows == tuple(range(self.microbatches)) and all(t is tables[0] for t in tables):  # each microbatch once
            weights = tables[0]
        else:
            weights = torch.stack([table[m] for m, table in zip(rows, tables, strict=True)])
        if not self.some_empty:
            fields[Slot.LOSS] = (losses * weights).sum(0)
            return fields
        valid = weights > 0
        empty(torch.where(valid, 0.0, losses))
        fields[Slot.LOSS] = torch.where(valid, losses * weights, 0.0).sum(0)
        return fields


def _stack(values: Sequence[float | Tensor], device: torch.device) -> Tensor:
    return torch.stack([_float64(value, device) for value in values])


def _float64(value: object, device: torch.device) -> Tensor:
    return torch.as_tensor(value, dtype=torch.float64, device=device)
