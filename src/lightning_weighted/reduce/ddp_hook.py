r"""The count-weighted DDP communication hook and its state: DDP's buckets divided by the window's :math:`N`.

Every bucket holds this rank's :math:`\sum_m n_m \bar g_m / c_r` (see :mod:`lightning_weighted.window`); the
hook SUM-reduces it and divides it by :math:`N` in one of two ways:

- **Riding** (fp32 and fp64 gradients): the rank's count payload rides at the end of the first bucket, in a
  kept copy 12 values longer; every bucket is SUM-reduced at once and divided by :math:`N` when it comes back
  (the later ones once the first is back, which DDP launched earlier). Mean-sized losses (:math:`c_r > 1`) are
  multiplied back by :math:`c_r` before the SUM. No extra collective; a first bucket beyond
  ``ride_limit_bytes`` is not copied and the payload takes its own 48-byte all-reduce just before it.
- **Not riding** (fp16 and bf16 gradients, whose integers are exact only to 2048 and 256): the payload is
  summed in float64 by one asynchronous all-reduce started before the syncing backward, and every bucket is
  divided by :math:`N / c_r` **before** its SUM, which keeps fp16 buckets in range, as DDP's own
  ``allreduce_hook`` divides by the world size first. With equal counts and one microbatch per window the
  divisor is the world size: this is ``allreduce_hook``.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at registration.
from collections.abc import Sequence
from typing import Any

import torch
import torch._dynamo
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel

from lightning_weighted._counts import CountPayload, Slot
from lightning_weighted.reduce.callbacks import then
from lightning_weighted.reduce.counts import sum_counts
from lightning_weighted.reduce.riding import MAX_RIDING_RANKS, RIDE_WIDTH, riding, unride
from lightning_weighted.window import LossScale

__all__ = [
    "PYTHON_REDUCER",
    "RIDE_LIMIT_BYTES",
    "WeightedReduceState",
    "fp16_backward",
    "python_reducer",
    "weighted_allreduce_hook",
]

RIDE_LIMIT_BYTES = 64 * 2**20
_RIDING_DTYPES = (torch.float32, torch.float64)


class WeightedReduceState:
    """State shared by :func:`weighted_allreduce_hook` and the adapter that hands it one window at a time.

    Args:
        process_group: the group gradients are reduced over; ``None`` is the default (world) group.
        rides: whether the counts ride in the first gradient bucket (see :meth:`can_ride`); the same on every rank.
        ride_limit_bytes: the largest first bucket the counts ride in (64 MiB). Riding copies that bucket once
            per window into a buffer kept for the next; beyond the limit (a language model's output layer, say)
            the counts take their own float64 all-reduce, launched just before the bucket's. Copying 64 MiB
            takes about as long on a GPU as one small NCCL all-reduce.
    """

    __slots__ = (
        "_device",
        "_divisor",
        "_held",
        "_payload",
        "_pending",
        "_reference",
        "_rode",
        "_sent",
        "_summed",
        "process_group",
        "ride_limit_bytes",
        "rides",
    )

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        rides: bool = False,
        ride_limit_bytes: int = RIDE_LIMIT_BYTES,
    ) -> None:
        self.process_group = process_group
        self.rides = rides
        self.ride_limit_bytes = ride_limit_bytes
        # the window in progress
        self._payload: CountPayload | None = None
        self._reference = 1.0  # c_r of the window's losses
        self._device = torch.device("cpu")
        self._pending: Future[Any] | None = None  # completes once `_summed` and `_divisor` hold the window's
        self._summed: torch.Tensor | None = None  # the summed payload, indexed by `Slot`
        self._divisor: torch.Tensor | None = None
        self._rode = False  # whether the payload rode in the first bucket
        self._held = False  # the coming backward keeps its gradients local
        # kept between windows: a fresh buffer page-faults (64 MiB: 36 ms fresh against 6.3 ms reused)
        self._sent: torch.Tensor | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Like `PowerSGDState`: a process group, a pending collective and device tensors do not pickle.
        return {"rides": self.rides, "ride_limit_bytes": self.ride_limit_bytes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    @staticmethod
    def can_ride(dtypes: Sequence[torch.dtype], world_size: int) -> bool:
        """Whether counts can ride, exactly, in gradient buckets of these dtypes over ``world_size`` ranks."""
        return all(dtype in _RIDING_DTYPES for dtype in dtypes) and world_size <= MAX_RIDING_RANKS

    def register(self, ddp: DistributedDataParallel, scale: LossScale | None, fp16: bool) -> LossScale:
        """Registers :func:`weighted_allreduce_hook` on ``ddp``; returns the windows' loss scale.

        Args:
            ddp: the wrapped model; its trainable parameters' dtypes decide whether the counts ride.
            scale: the user's choice, kept if given; else item sums where the counts ride, mean-sized losses where
                they cannot or where fp16 computes the backward (item sums could overflow it).
            fp16: whether fp16 computes the backward (:func:`fp16_backward`).
        """
        dtypes = [param.dtype for param in ddp.parameters() if param.requires_grad]
        world_size = dist.get_world_size(self.process_group)
        self.rides = self.can_ride(dtypes, world_size)
        if scale is None:
            scale = LossScale.ITEM_SUM if self.rides and not fp16 else LossScale.MEAN_SIZED
        ddp.register_comm_hook(self, weighted_allreduce_hook)
        return scale

    def begin_window(self, payload: CountPayload, reference: float, device: torch.device) -> None:
        """Hands over this rank's payload; called before the backward that syncs the window's gradients.

        When the counts ride they leave with the first bucket; otherwise their SUM starts now, without waiting,
        so it overlaps that backward.

        Args:
            payload: this rank's count payload (:meth:`lightning_weighted.window.Window.payload`).
            reference: :math:`c_r`, what this rank's losses are scaled to (:class:`~lightning_weighted.window.Window`).
            device: where the gradients live.
        """
        self._payload, self._reference, self._device = payload, reference, device
        self._summed = self._divisor = None
        self._rode = self._held = False
        self._pending = None if self.rides else self._receive_from(sum_counts(payload, device, self.process_group))

    def hold(self) -> None:
        """Keeps the coming backward's gradients on this rank: every bucket comes back unreduced, as it went.

        For a backward that DDP synchronizes but that does not end the window (a Fabric loop that marks its windows
        itself instead of using ``no_sync``): the gradients accumulate locally, as under ``no_sync``, at the cost
        of DDP's bucket copies and none of its communication. :meth:`begin_window` ends the hold.
        """
        self._held = True

    @property
    def held(self) -> bool:
        """Whether the coming backward keeps its gradients on this rank (see :meth:`hold`)."""
        return self._held

    def counts(self) -> list[float]:
        """The window's summed payload on the host (one device read per window), indexed by ``Slot``.

        When the counts rode and some rank reported an invalid count, one more float64 all-reduce (on every
        rank alike, since all see the flag) brings which rank and which value.
        """
        if self._payload is None:
            raise RuntimeError(
                "no count payload was handed over for this window: call `WeightedReduceState.begin_window` before"
                " each gradient-syncing backward"
            )
        if self._pending is None:
            raise RuntimeError(
                "It looks like your LightningModule has parameters that were not used in producing the loss returned"
                " by training_step: DDP reduces a gradient bucket only once every parameter in it has a gradient, and"
                " no bucket of this window reached weighted_allreduce_hook. If this is intentional, enable the"
                " detection of unused parameters in DDP, either with the strategy name"
                " `strategy='ddp_weighted_find_unused_parameters_true'` or with"
                " `strategy=WeightedDDPStrategy(find_unused_parameters=True)`."
            )
        self._pending.wait()
        assert self._summed is not None
        summed: list[float] = self._summed.tolist()
        if self._rode and summed[Slot.INVALID] > 0:
            summed = sum_counts(self._payload, self._device, self.process_group).wait().tolist()
        self._payload = self._pending = None
        return summed

    def divisor(self) -> torch.Tensor:
        """What a bucket is divided by before its SUM when the counts do not ride: ``N / c_r`` (1 if ``N = 0``).

        A 0-dim float64 tensor on the gradients' device, computed once per window.
        """
        if self._pending is None:
            raise _no_window()
        self._pending.wait()
        assert self._divisor is not None
        return self._divisor

    def send_first(self, buffer: torch.Tensor) -> Future[torch.Tensor]:
        """SUM-reduces the first bucket with the window's counts riding at its end; divides it by ``N`` on return."""
        payload = self._payload
        if payload is None:
            raise _no_window()
        if buffer.dtype not in _RIDING_DTYPES:
            raise TypeError(
                f"counts ride only in float32/float64 gradient buckets, but the first bucket holds {buffer.dtype}:"
                " set `WeightedReduceState.rides` from `WeightedReduceState.can_ride` over every gradient dtype"
            )
        if buffer.numel() * buffer.element_size() > self.ride_limit_bytes:
            self._pending = self._receive_from(sum_counts(payload, self._device, self.process_group), 1.0)
            return self.send_next(buffer)
        size = buffer.numel()
        sent = self._sent
        if sent is None or (sent.numel(), sent.dtype, sent.device) != (size + RIDE_WIDTH, buffer.dtype, buffer.device):
            sent = self._sent = torch.empty(size + RIDE_WIDTH, dtype=buffer.dtype, device=buffer.device)
        torch.mul(buffer, self._reference or 1.0, out=sent[:size])  # back to item sums: c_r · Σ n ḡ / c_r
        sent[size:] = riding(payload, buffer.device, buffer.dtype)

        def unpack(future: Future[list[torch.Tensor]]) -> torch.Tensor:
            summed = future.value()[0]
            return torch.div(summed[:size], self._receive(unride(summed[size:]), 1.0), out=buffer)

        work = dist.all_reduce(sent, group=self.process_group, async_op=True)
        assert work is not None
        self._pending = then(work.get_future(), unpack)
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
        assert work is not None
        future: Future[list[torch.Tensor]] = work.get_future()
        return then(future, divide)

    def _receive_from(self, counts: Future[torch.Tensor], reference: float | None = None) -> Future[torch.Tensor]:
        ratio = self._reference if reference is None else reference
        return then(counts, lambda future: self._receive(future.value(), ratio))

    def _receive(self, summed: torch.Tensor, reference: float) -> torch.Tensor:
        """Keeps the window's summed payload; returns ``N / reference`` (``N`` taken as 1 when 0), the divisor."""
        self._summed = summed
        items = summed[Slot.ITEMS]
        safe = torch.where(items > 0, items, 1.0)  # an N = 0 window holds zero gradients: no NaN
        self._divisor = safe if reference in (0.0, 1.0) else safe / reference
        return self._divisor


PYTHON_REDUCER = (
    "`torch._dynamo.config.optimize_ddp='python_reducer'` reduces gradients outside DDP's communication hook, so"
    " ddp_weighted could not weight them. Use the default `optimize_ddp=True`, or `strategy='ddp'`."
)


def python_reducer() -> bool:
    """Whether ``torch.compile`` reduces DDP's gradients in Python, out of the hook's reach."""
    return str(getattr(torch._dynamo.config, "optimize_ddp", "")).startswith("python_reducer")


def fp16_backward(plugin: object) -> bool:
    """Whether a Lightning precision plugin computes in fp16 (``16-mixed``, ``16-true``, Transformer Engine fp16)."""
    precision = str(getattr(plugin, "precision", ""))
    return "16" in precision and "bf16" not in precision


def _no_window() -> RuntimeError:
    return RuntimeError(
        "weighted_allreduce_hook reduced a bucket before the window's counts were handed over: the gradient-syncing"
        " backward must run through a weighted strategy (on a bare DDP module, call"
        " `WeightedReduceState.begin_window` before it)"
    )


def weighted_allreduce_hook(state: WeightedReduceState, bucket: GradBucket) -> Future[torch.Tensor]:
    """SUM-reduces the bucket so that every rank holds the global item mean of the window's gradient.

    Example::

        >>> # `WeightedDDPStrategy` registers it; on a bare DDP module, with `state.begin_window(...)` called
        >>> # before each syncing backward, it would be:
        >>> # ddp_model.register_comm_hook(WeightedReduceState(rides=True), weighted_allreduce_hook)
    """
    buffer = bucket.buffer()
    if state.held:
        unreduced: Future[torch.Tensor] = Future()
        unreduced.set_result(buffer)
        return unreduced
    if state.rides:
        return state.send_first(buffer) if bucket.index() == 0 else state.send_next(buffer)
    buffer.div_(state.divisor())
    work = dist.all_reduce(buffer, group=state.process_group, async_op=True)
    assert work is not None
    future: Future[list[torch.Tensor]] = work.get_future()
    return then(future, lambda fut: fut.value()[0])
