r"""Riding counts divided by DDP's own reducer: no communication hook, :math:`N` as the reducer's divisor.

``WeightedDDPStrategy(reducer_divides=True)`` takes this path instead of the communication hook
(:mod:`lightning_weighted.reduce.ddp_hook`) where the gradients are fp32 or fp64 on the CPU.

Where the counts are known only once ``training_step`` has run, every loss is scaled to its item sum
(:attr:`~lightning_weighted.window.LossScale.ITEM_SUM`), so the buckets hold :math:`\sum_m n_m \bar g_m` and need
dividing by :math:`N` rather than by the world size. DDP's C++ reducer divides every gradient by a divisor as it
copies it into its bucket, and takes that divisor, once per backward, from a work handle it waits on at the first
gradient (the one ``DistributedDataParallel.join`` sets to count the ranks still running). :class:`ReducerDivision`
sets it to the window's own count SUM: one float64 all-reduce of the payload, started right before the syncing
backward, whose ``N`` becomes the divisor. No Python runs per bucket and nothing divides the gradients again.
The gradients must be on the CPU: the reducer reads its divisor on the host, and a device value read there
would stall the backward until the device caught up.

The divisor is an integer. A window whose ``N`` is not one (sample weights), is 0 or is beyond ``2**31 - 1`` is
divided by 1, leaving the SUM :math:`\sum_r \sum_m n_{rm} \bar g_{rm}`, and :meth:`ReducerDivision.normalize`
divides the gradients by ``N`` after the backward.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch._C._distributed_c10d import _create_work_from_future  # type: ignore[attr-defined]
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel

from lightning_weighted._counts import CountPayload, Slot
from lightning_weighted.reduce.callbacks import then
from lightning_weighted.reduce.counts import sum_counts

__all__ = ["ReducerDivision", "can_divide", "divides"]

_DIVIDED = frozenset({torch.float32, torch.float64})  # gradients whose item sums the reducer divides by N
_LARGEST = 2**31 - 1  # the reducer keeps its divisor in a C++ int


def can_divide(parameters: Iterable[Tensor]) -> bool:
    """Whether DDP's reducer can divide the gradients of these parameters by ``N``: fp32 or fp64, on the CPU.

    Example::

        >>> from torch.nn import Parameter
        >>> can_divide([Parameter(torch.zeros(2))]), can_divide([Parameter(torch.zeros(2, dtype=torch.bfloat16))])
        (True, False)
    """
    return all(p.dtype in _DIVIDED and p.device.type == "cpu" for p in parameters if p.requires_grad)


def divides(items: float) -> bool:
    """Whether the reducer divided a window's gradients by ``N = items`` itself (else by 1).

    Example::

        >>> divides(12.0), divides(7.5), divides(0.0), divides(2.0**31)
        (True, False, False, False)
    """
    return items.is_integer() and 1 <= items <= _LARGEST


class ReducerDivision:
    """Hands a window's ``N`` to DDP's reducer as its divisor, and reads the window's summed payload back.

    Args:
        ddp: the model DDP wraps, with no communication hook (the reducer divides only without one).
        group: the group the counts are summed over; ``None`` is the default (world) group.
    """

    def __init__(self, ddp: DistributedDataParallel, group: dist.ProcessGroup | None = None) -> None:
        self.ddp, self.group = ddp, group
        self._pending: Future[Tensor] | None = None

    def begin_window(self, payload: CountPayload, device: torch.device) -> None:
        """Starts the SUM of this rank's payload and makes its ``N`` the divisor of the coming syncing backward."""
        self._pending = sum_counts(payload, device, self.group)
        divisor = _create_work_from_future(then(self._pending, _divisor))
        self.ddp.reducer._set_forward_pass_work_handle(divisor, False)

    def counts(self) -> list[float]:
        """The window's summed payload on the host (one read per window), indexed by ``Slot``."""
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("no count payload was handed over for this window: call `begin_window` first")
        summed: list[float] = pending.wait().tolist()
        return summed

    @staticmethod
    def normalize(parameters: Iterable[Tensor], items: float) -> None:
        """Divides the gradients by ``N`` where the reducer could not (see :func:`divides`); ``N > 0``."""
        if divides(items):
            return
        grads = [p.grad for p in parameters if p.grad is not None]
        if grads:
            torch._foreach_div_(grads, items)

    def close(self) -> None:
        """Gives the reducer back its own divisor, the world size."""
        done: Future[list[Tensor]] = Future()
        done.set_result([torch.ones(1)])
        self.ddp.reducer._set_forward_pass_work_handle(_create_work_from_future(done), True)


def _divisor(future: Future[Tensor]) -> list[Tensor]:
    """The reducer's divisor from the summed payload (on the CPU): ``N`` where :func:`divides` holds, else 1."""
    items = float(future.value()[Slot.ITEMS])
    return [torch.tensor([int(items) if divides(items) else 1])]
