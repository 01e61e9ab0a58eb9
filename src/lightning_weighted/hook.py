r"""The count-weighted DDP communication hook and its state.

The objective of one optimizer step, over ranks :math:`r` and the microbatches :math:`m` of its
accumulation window, each holding :math:`n_{rm}` valid items whose mean gradient is :math:`\bar g_{rm}`:

.. math::

    N = \sum_r \sum_m n_{rm}, \qquad g = \frac{1}{N} \sum_r \sum_m n_{rm}\, \bar g_{rm}.

Each rank scales its microbatch losses so that its accumulated gradient is
:math:`\sum_m n_{rm} \bar g_{rm} / c_r`, and the window's :math:`N` reaches every rank in one of two ways:

- fp32 and fp64 gradients: the counts ride at the end of the first bucket, in the copy riding needs anyway,
  and every bucket is SUM-reduced at once and divided by :math:`N` as it comes back (the later ones once the
  first is back). The losses are item sums, :math:`c_r = 1`, unless fp16 computes the backward (``16-mixed``),
  where :math:`c_r = n^{\mathrm{ref}}_r`, the rank's first positive count of the window, keeps them mean-sized
  and each bucket is multiplied back by it before the SUM. No extra collective: the first bucket grows by 12
  values (beyond ``WeightedReduceState.ride_limit_bytes`` the counts take their own all-reduce instead).
- fp16 and bf16 gradients, whose integers are exact only to 2048 and 256: :math:`c_r = n^{\mathrm{ref}}_r`,
  the counts are summed in float64 by one small asynchronous all-reduce launched before the syncing backward,
  and every bucket is divided by :math:`N / n^{\mathrm{ref}}_r` before its SUM. The pre-division keeps fp16
  buckets in range, exactly as DDP's own ``allreduce_hook`` divides by the world size first.

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

from lightning_weighted._weights import INVALID, ITEMS, MAX_RIDING_RANKS, RIDE_WIDTH, WIDTH, divisor, ride, unride

__all__ = ["WeightedReduceState", "weighted_allreduce_hook"]

_RIDING_DTYPES = (torch.float32, torch.float64)


class WeightedReduceState:
    """State shared by :func:`weighted_allreduce_hook` and the strategy for one accumulation window.

    Args:
        process_group: the group gradients are reduced over; ``None`` is the default (world) group.
        rides: whether the counts ride in the first gradient bucket (fp32/fp64 gradients, at most
            65793 ranks; see :meth:`can_ride`) instead of a separate float64 all-reduce. The same on every rank.

    Attributes:
        ride_limit_bytes: the largest first bucket the counts ride in (64 MiB). Riding copies that bucket
            once per window into a buffer kept for the next; beyond the limit (a language model's output
            layer, say) the counts take their own float64 all-reduce, launched just before the bucket's, and
            every bucket is still divided on return. Copying 64 MiB takes about as long on a GPU as one small
            NCCL all-reduce.
    """

    ride_limit_bytes = 64 * 2**20

    __slots__ = (
        "_device",
        "_divisor",
        "_local",
        "_loss_sum",
        "_pending",
        "_reference",
        "_rode",
        "_sent",
        "_summed",
        "process_group",
        "rides",
    )

    def __init__(self, process_group: dist.ProcessGroup | None = None, rides: bool = False) -> None:
        self.process_group = process_group
        self.rides = rides
        self._local: list[float] | None = None  # this rank's count vector for the window in progress
        self._reference = 0.0
        self._device = torch.device("cpu")
        self._loss_sum: torch.Tensor | None = None
        self._pending: Future[Any] | None = None  # completes when `_summed` holds the summed count vector
        self._summed: torch.Tensor | None = None
        self._divisor: torch.Tensor | None = None
        self._rode = False  # whether this window's counts rode in the first bucket
        self._sent: torch.Tensor | None = None  # the first bucket and its counts, kept: a fresh one page-faults

    def __getstate__(self) -> dict[str, Any]:
        # Like `PowerSGDState`: a process group, a pending collective and device tensors do not pickle.
        return {"rides": self.rides}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(rides=state.get("rides", False))  # type: ignore[misc]

    @staticmethod
    def can_ride(dtypes: Sequence[torch.dtype], world_size: int) -> bool:
        """Whether counts can ride, exactly, in gradient buckets of these dtypes over ``world_size`` ranks."""
        return all(dtype in _RIDING_DTYPES for dtype in dtypes) and world_size <= MAX_RIDING_RANKS

    def begin_window(
        self, local: Sequence[float], reference: float, device: torch.device, loss_sum: torch.Tensor | None = None
    ) -> None:
        """Hands over this rank's counts for the window; called before the backward that syncs gradients.

        When the counts ride, they leave with the first bucket; otherwise their SUM all-reduce starts now,
        without waiting, so it overlaps that backward.

        Args:
            local: this rank's count vector (see ``_weights.WindowCount.vector``).
            reference: what this rank's losses were scaled relative to: its first positive count of the window
                (0 if none), or 1 when they are item sums.
            device: where the gradients live.
            loss_sum: ``Σ_m n_m · loss_m`` of this rank's window, a device tensor, summed into the last slot.
        """
        if len(local) != WIDTH:
            raise ValueError(f"expected a count vector of length {WIDTH}, got {list(local)}")
        self._local, self._reference, self._device, self._loss_sum = list(local), reference, device, loss_sum
        self._pending = self._summed = self._divisor = None
        self._rode = False
        if self.rides:
            return
        self._summed = self._to_device(self._local)
        self._pending = dist.all_reduce(self._summed, group=self.process_group, async_op=True).get_future()

    def counts(self) -> list[float]:
        """The summed count vector of the window, on the host (one device read per window).

        When the counts rode and some rank reported an invalid count, one more float64 all-reduce (on every
        rank alike, since all see the flag) brings which rank and which value.
        """
        summed = self._wait().tolist()
        if self._rode and summed[INVALID] > 0:
            assert self._local is not None
            details = self._to_device(self._local)
            dist.all_reduce(details, group=self.process_group)
            summed = details.tolist()
        return summed

    def divisor(self) -> torch.Tensor:
        """What a bucket is divided by before its SUM when the counts do not ride: ``N / reference``.

        A 0-dim float64 tensor on the gradients' device, computed once per window.
        """
        if self._divisor is None:
            self._divisor = divisor(self._wait()[ITEMS], self._reference)
        return self._divisor

    def send_first(self, buffer: torch.Tensor) -> Future[torch.Tensor]:
        """SUM-reduces the first bucket with the window's counts riding at its end; divides it by ``N`` on return."""
        if self._local is None:
            raise _no_window()
        if buffer.dtype not in _RIDING_DTYPES:
            raise TypeError(
                f"counts ride only in float32/float64 gradient buckets, but the first bucket holds {buffer.dtype}:"
                " set `WeightedReduceState.rides` from `WeightedReduceState.can_ride` over every gradient dtype"
            )
        if buffer.numel() * buffer.element_size() > self.ride_limit_bytes:
            counts = self._to_device(self._local)

            def unpack_counts(future: Future[list[torch.Tensor]]) -> None:
                self._receive(future.value()[0])

            work = dist.all_reduce(counts, group=self.process_group, async_op=True)
            self._pending = work.get_future().then(unpack_counts)
            return self.send_next(buffer)
        size = buffer.numel()
        sent = self._sent
        if (
            sent is None
            or sent.numel() != size + RIDE_WIDTH
            or (sent.dtype, sent.device) != (buffer.dtype, buffer.device)
        ):
            sent = self._sent = torch.empty(size + RIDE_WIDTH, dtype=buffer.dtype, device=buffer.device)
        torch.mul(buffer, self._reference or 1.0, out=sent[:size])
        sent[size:] = self._to_device(ride(self._local))

        def unpack(future: Future[list[torch.Tensor]]) -> torch.Tensor:
            summed = future.value()[0]
            return torch.div(summed[:size], self._receive(unride(summed[size:])), out=buffer)

        work = dist.all_reduce(sent, group=self.process_group, async_op=True)
        self._pending = work.get_future().then(unpack)
        self._rode = True
        return self._pending

    def send_next(self, buffer: torch.Tensor) -> Future[torch.Tensor]:
        """SUM-reduces a bucket at once; divides it by ``N`` when both it and the window's counts are back."""
        first = self._pending
        if first is None:
            raise _no_window()
        if self._reference not in (0.0, 1.0):
            buffer.mul_(self._reference)

        def divide(future: Future[list[torch.Tensor]]) -> torch.Tensor:
            first.wait()  # the counts: launched before this bucket, so done by now or soon (never a deadlock)
            assert self._divisor is not None
            return future.value()[0].div_(self._divisor)

        work = dist.all_reduce(buffer, group=self.process_group, async_op=True)
        future: Future[list[torch.Tensor]] = work.get_future()
        return future.then(divide)

    def _receive(self, summed: torch.Tensor) -> torch.Tensor:
        """Keeps the summed count vector of a riding window; returns ``N`` (1 if 0), what every bucket divides by."""
        self._summed = summed
        self._divisor = divisor(summed[ITEMS], 1.0)
        return self._divisor

    def _to_device(self, values: list[float]) -> torch.Tensor:
        vector = torch.tensor(values, dtype=torch.float64)
        if self._device.type == "cuda":
            # A pinned, non-blocking copy keeps the host from waiting for the device.
            vector = vector.pin_memory()
        vector = vector.to(self._device, non_blocking=True)
        if self._loss_sum is not None:
            vector[-1] += self._loss_sum.to(device=self._device, dtype=torch.float64)
        return vector

    def _wait(self) -> torch.Tensor:
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
        if self._summed is None:
            raise _no_window()
        return self._summed


def _no_window() -> RuntimeError:
    return RuntimeError(
        "no count reduction was started for this window: the gradient-syncing backward must run through"
        " `WeightedDDPStrategy.backward` (on a bare DDP module: `WeightedReduceState.begin_window`)"
    )


def weighted_allreduce_hook(state: WeightedReduceState, bucket: GradBucket) -> Future[torch.Tensor]:
    """SUM-reduces the bucket so that every rank holds the global item mean of the window's gradient.

    Example::

        >>> # `WeightedDDPStrategy` registers it; on a bare DDP module, with the strategy's
        >>> # `begin_window` called before each syncing backward, it would be:
        >>> # ddp_model.register_comm_hook(WeightedReduceState(rides=True), weighted_allreduce_hook)
    """
    buffer = bucket.buffer()
    if state.rides:
        return state.send_first(buffer) if bucket.index() == 0 else state.send_next(buffer)
    buffer.div_(state.divisor())
    work = dist.all_reduce(buffer, group=state.process_group, async_op=True)
    future: Future[list[torch.Tensor]] = work.get_future()
    return future.then(lambda fut: fut.value()[0])
