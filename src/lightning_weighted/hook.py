r"""The count-weighted DDP communication hook and its state.

The objective of one optimizer step, over ranks :math:`r` and the microbatches :math:`m` of its
accumulation window, each holding :math:`n_{rm}` valid items whose mean gradient is :math:`\bar g_{rm}`:

.. math::

    N = \sum_r \sum_m n_{rm}, \qquad g = \frac{1}{N} \sum_r \sum_m n_{rm}\, \bar g_{rm}.

Each rank scales its microbatch losses so that its accumulated gradient is
:math:`\sum_m n_{rm} \bar g_{rm} / n^{\mathrm{ref}}_r` (:math:`n^{\mathrm{ref}}_r` is the rank's first positive
count of the window), the window's :math:`N` is summed exactly in float64 by one small asynchronous
all-reduce launched before the last backward, and the hook divides every bucket by
:math:`N / n^{\mathrm{ref}}_r` before the SUM all-reduce: the pre-division keeps fp16 buckets in range,
exactly as DDP's own ``allreduce_hook`` divides by the world size first.

Worked trace: ``w = 10``, per-item loss :math:`\tfrac12 (w - y)^2`; rank 0 holds targets ``[9, 9]``
(``n = 2``, mean gradient 1), rank 1 holds ``[7] * 6`` (``n = 6``, mean gradient 3).
:math:`g = (2 \cdot 1 + 6 \cdot 3) / 8 = 2.5`, where plain DDP averages means: :math:`(1 + 3) / 2 = 2`.
Against a mean-across-ranks reducer the divisors are scales :math:`P n_r / N = 0.5` and :math:`1.5`.
With equal counts on every rank and one microbatch per window the divisor is the world size :math:`P`,
and the hook reduces to ``allreduce_hook``.
"""

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket
from torch.futures import Future

from lightning_weighted._weights import LOSS, WIDTH, divisor

__all__ = ["WeightedReduceState", "weighted_allreduce_hook"]


class WeightedReduceState:
    """State shared by :func:`weighted_allreduce_hook` and the strategy for one accumulation window.

    Args:
        process_group: the group gradients are reduced over; ``None`` is the default (world) group.
    """

    __slots__ = ("_counts", "_divisor", "_reference", "_work", "process_group")

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.process_group = process_group
        # The window's count reduction, started by `start_count_reduction`.
        self._counts: torch.Tensor | None = None
        self._work: dist.Work | None = None
        self._divisor: torch.Tensor | None = None
        self._reference = 0.0

    def __getstate__(self) -> dict[str, Any]:
        # Like `PowerSGDState`: a process group, a pending collective and device tensors do not pickle.
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

    def start_count_reduction(
        self, local: Sequence[float], reference: float, device: torch.device, loss_sum: torch.Tensor | None = None
    ) -> None:
        """Launches the SUM all-reduce of this rank's count vector without waiting for it.

        Called before the backward that syncs gradients, so the reduction overlaps that backward.

        Args:
            local: this rank's count vector (see ``_weights.WindowCount.vector``).
            reference: this rank's first positive count of the window (0 if none).
            device: where the gradients live.
            loss_sum: ``Σ_m n_m · loss_m`` of this rank's window, a device tensor, summed into the last slot.
        """
        if len(local) != WIDTH:
            raise ValueError(f"expected a count vector of length {WIDTH}, got {list(local)}")
        counts = torch.tensor(local, dtype=torch.float64)
        if device.type == "cuda":
            # A pinned, non-blocking copy keeps the host from waiting for the device.
            counts = counts.pin_memory()
        counts = counts.to(device, non_blocking=True)
        if loss_sum is not None:
            counts[LOSS] += loss_sum.to(device=device, dtype=torch.float64)
        self._counts = counts
        self._work = dist.all_reduce(self._counts, group=self.process_group, async_op=True)
        self._divisor = None
        self._reference = reference

    def counts(self) -> torch.Tensor:
        """The summed count vector of the window (waits for the reduction once)."""
        if self._counts is None:
            raise RuntimeError(
                "no count reduction was started for this window: the gradient-syncing backward must run through"
                " `WeightedDDPStrategy.backward`"
            )
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._counts

    def divisor(self) -> torch.Tensor:
        """``N / reference`` as a 0-dim float64 tensor on the gradients' device (computed once per window)."""
        if self._divisor is None:
            self._divisor = divisor(self.counts()[0], self._reference)
        return self._divisor


def weighted_allreduce_hook(state: WeightedReduceState, bucket: GradBucket) -> Future[torch.Tensor]:
    """Divides the bucket by ``N / reference`` and SUM-reduces it, so every rank holds the global item mean.

    Example::

        >>> # `WeightedDDPStrategy` registers it; on a bare DDP module (where the strategy's count
        >>> # reduction must be started by hand) it would be:
        >>> # ddp_model.register_comm_hook(WeightedReduceState(), weighted_allreduce_hook)
    """
    buffer = bucket.buffer()
    buffer.div_(state.divisor())
    work = dist.all_reduce(buffer, group=state.process_group, async_op=True)
    future: Future[list[torch.Tensor]] = work.get_future()
    return future.then(lambda fut: fut.value()[0])
