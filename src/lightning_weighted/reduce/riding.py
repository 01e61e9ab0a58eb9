"""The count payload as it rides at the end of an fp32 (or fp64) gradient bucket in the riding hook.

The whole part of the window's items is split into 8 base-256 digits: a digit summed over P <=
``MAX_RIDING_RANKS`` ranks is at most 255·P <= 2**24, an exact fp32 integer, so ``N`` stays exact where an fp32
sum of the counts rounds above 2**24. ``CODE`` and ``VALUE`` do not ride: an error fetches them with a float64 SUM.
"""

from __future__ import annotations

import math
from enum import IntEnum

import torch
from torch import Tensor

from lightning_weighted._counts import WIDTH, CountPayload, Slot, on_device

__all__ = ["MAX_RIDING_RANKS", "RIDE_WIDTH", "Ride", "riding", "unride"]


class Ride(IntEnum):
    """Where the payload's fields sit when it rides at the end of a gradient bucket."""

    DIGIT0 = 0  # DIGIT0 .. DIGIT0 + DIGITS - 1: base-256 digits of the whole part of ITEMS
    FRACTION = 8  # the fractional part of ITEMS (weight sums)
    INVALID = 9
    MORE = 10
    LOSS = 11


DIGITS = Ride.FRACTION - Ride.DIGIT0
RIDE_WIDTH = Ride.LOSS + 1
MAX_RIDING_RANKS = 2**24 // 255


def riding(payload: CountPayload, device: torch.device, dtype: torch.dtype) -> Tensor:
    """The payload as it rides in a bucket of ``dtype`` on ``device``, indexed by :class:`Ride`.

    Example::

        >>> riding(CountPayload(1000.5, None, rank=0, more=True), torch.device("cpu"), torch.float32).tolist()
        [232.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.0, 1.0, 0.0]
    """
    whole = math.floor(payload.items)
    digits = [float((whole >> (8 * place)) & 255) for place in range(DIGITS)]
    values = [*digits, payload.items - whole, float(payload.problem is not None), float(payload.more), 0.0]
    return on_device(values, device, Ride.LOSS, payload.loss_sum, dtype)


def unride(summed: Tensor) -> Tensor:
    """The summed riding payload (``RIDE_WIDTH`` values) as the float64 vector indexed by :class:`Slot`.

    One product with a fixed matrix, on the payload's device (it runs in a reduction's completion callback, where
    every operation counts); float64 keeps the digits' place values and their sums exact below 2**53. Example::

        >>> payload = CountPayload(1000.5, None, rank=0, more=True, loss_sum=torch.tensor(7.0))
        >>> unride(riding(payload, torch.device("cpu"), torch.float32) * 2).tolist()
        [2001.0, 0.0, 0.0, 0.0, 2.0, 14.0]
    """
    decoder = _DECODERS.get(summed.device)
    if decoder is None:
        decoder = torch.zeros(RIDE_WIDTH, WIDTH, dtype=torch.float64)
        for place in range(DIGITS):
            decoder[Ride.DIGIT0 + place, Slot.ITEMS] = 256.0**place
        for ride, slot in ((Ride.FRACTION, Slot.ITEMS), (Ride.INVALID, Slot.INVALID), (Ride.MORE, Slot.MORE)):
            decoder[ride, slot] = 1.0
        decoder[Ride.LOSS, Slot.LOSS] = 1.0
        decoder = _DECODERS[summed.device] = decoder.to(summed.device)
    return summed.double() @ decoder


_DECODERS: dict[torch.device, Tensor] = {}
