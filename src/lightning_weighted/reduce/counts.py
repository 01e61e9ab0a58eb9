"""Count payloads summed on their own: one float64 all-reduce each, started without waiting."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.futures import Future

from lightning_weighted._counts import CountPayload, on_device
from lightning_weighted.reduce.callbacks import then

__all__ = ["start_sum", "sum_counts"]


def sum_counts(
    payload: CountPayload, device: torch.device, group: dist.ProcessGroup | None = None
) -> Future[torch.Tensor]:
    """Starts the SUM of every rank's payload over ``group``; the future's value is the summed float64 vector.

    48 bytes: the way the counts travel wherever they cannot ride in a gradient reduction (fp16/bf16 DDP buckets,
    FSDP's reduce-scatters), and the way an invalid count's rank and value travel after its flag rode.
    """
    summed = payload.tensor(device)
    work = dist.all_reduce(summed, group=group, async_op=True)
    assert work is not None
    future: Future[torch.Tensor] = then(work.get_future(), lambda _: summed)
    return future


def start_sum(
    values: list[float],
    device: torch.device,
    fill: Callable[[torch.Tensor], None] | None = None,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, dist.Work]:
    """Starts the SUM over ``group`` of a float64 vector; ``fill`` adds to its last value, on the device, first.

    Returns the vector, which holds the SUM once the returned work is waited on.
    """
    summed = on_device(values, device, len(values) - 1, None)
    if fill is not None:
        fill(summed[-1])
    work = dist.all_reduce(summed, group=group, async_op=True)
    assert work is not None
    return summed, work
