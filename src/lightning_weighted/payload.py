"""A window's payload: the float64 vector (exact to 2**53 items) every rank adds into in one all-reduce, and its sum."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum

import torch
from torch import Tensor

__all__ = ["SUMMED", "Slot", "WindowResult", "at", "host_tensor", "window_result"]


class Slot(IntEnum):
    """The payload's fields, in order; for one part, each field's index (:func:`at` finds them for ``K`` parts)."""

    MORE = 0  # 1 if this rank holds real batches after this window
    NAN_EMPTY = 1  # 1 if a microbatch counted 0 had a non-finite loss (its backward ran through its graph)
    INVALID = 2  # 1 if this rank found a problem (which one: the rows every rank gathers then)
    ITEMS = 3  # each part's Σ_m n_m over this rank's window: summed, the window's N
    NEXT = 4  # counted ahead: each part's Σ_m n_m over this rank's next window
    LOSS = 5  # each part's Σ_m n_m · loss_m (the item sum, for a loss that is one)
    LOCAL = 6  # each part's items of this rank again, not summed: the one host read brings both


SUMMED = len(Slot) - 1  # one part's payload: the values summed over the ranks, all but LOCAL


def at(slot: Slot, parts: int = 1) -> slice:
    """Where ``slot``'s values (one shared, else one per part) lie in the payload of a window of ``parts`` parts."""
    if slot < Slot.ITEMS:  # a shared field: one value
        return slice(slot, slot + 1)
    start = Slot.ITEMS + (slot - Slot.ITEMS) * parts
    return slice(start, start + parts)


def host_tensor(values: list[float], device: torch.device) -> Tensor:
    """A float64 vector of host numbers on ``device``, copied there without waiting for the device."""
    vector = torch.tensor(values, dtype=torch.float64)
    if device.type == "cpu":
        return vector
    # a copy from pinned memory leaves the host free; from pageable memory it waits for the device's queued work
    return (vector.pin_memory() if device.type == "cuda" else vector).to(device, non_blocking=True)


@dataclass(frozen=True)
class WindowResult:
    """What one optimizer step's window summed to, the same on every rank except ``local_items``."""

    step: int  # the optimizer step (global_step) the window ended at
    items: float  # the global item count N (with several parts, the sum of theirs); 0: the step changed nothing
    local_items: float  # this rank's items in the window
    loss: float  # Σ_r Σ_m n_rm · loss_rm / N (with parts, the sum of their means; NaN where N = 0)
    parts: Mapping[str, WindowResult] = field(default_factory=dict)  # each named part's own result (empty for one loss)


def window_result(values: Sequence[float], step: int, names: Sequence[str] = ()) -> WindowResult:
    """The window's result from its summed payload: of one loss, or of the parts ``names``."""
    count = max(len(names), 1)
    items, losses, local = (values[at(slot, count)] for slot in (Slot.ITEMS, Slot.LOSS, Slot.LOCAL))
    means = [loss / n if n > 0 else math.nan for loss, n in zip(losses, items, strict=True)]
    if not names:
        return WindowResult(step, items[0], local[0], means[0])
    parts = {name: WindowResult(step, items[k], local[k], means[k]) for k, name in enumerate(names)}
    held = [mean for mean, n in zip(means, items, strict=True) if n > 0]  # the means of the parts that hold items
    loss = sum(held) if held else math.nan
    return WindowResult(step, sum(items), sum(local), loss, parts)
