r"""The carrier ablation: a window's counts carried in the gradient of one extra parameter, through DDP's reducer.

Before the window loop's one float64 payload all-reduce (:class:`lightning_weighted.loop.Exchange`), the shipped
counts-ahead path carried what a window must still tell every rank in DDP's own gradient all-reduce: the
:class:`Handover` (the next window's count, whether this rank found a problem, whether it has more data, its share
of the window's loss) rode in the gradient of :class:`Carrier`'s one parameter, reduced in the same bucket as the
model's gradients: no collective of its own, no Python in the reduction. It is kept here as the ablation the
benchmarks time beside the shipped path (``ddp_weighted_carrier`` and the ``carrier_*`` variants of
``raw_step.py``); :class:`CarrierLoop` runs it inside the package's own :class:`~lightning_weighted.loop.WindowLoop`.

DDP multiplies every gradient by :math:`1/P` and SUMs it. The count therefore travels as the digits of a
fixed-point number (:math:`2^{-24}` apart), each sent as :math:`P \cdot d`: the product with the rounded :math:`1/P`
comes back to :math:`d` within a rounding error, the SUM of :math:`P` digits stays an integer within less than one
half, and the decoder rounds. :func:`digit_bits` picks the widest digits that keep this exact for the gradients'
dtype and :math:`P` (23 bits, 7 values in all, for fp32 on 2 ranks; 7 bits, 14 values, for bf16); where not even
one bit does (bf16 beyond 256 ranks, fp16 beyond 2048, fp32 beyond about 2000 unless :math:`P` is a power of two),
the carrier cannot carry the count. The loss share travels as a plain value of the gradients' dtype: in bf16 and
fp16 the logged loss keeps a few significant digits. The parameter is padded with zeros to whole 64-byte lines
(16 values in fp32): DDP puts it first in its bucket, and the gradients after it stay aligned. The carrier carries
no problem's code or value, only that one was found: a problem is reported without naming its rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from enum import IntEnum
from typing import Any

import torch
from torch import Tensor, nn

from lightning_weighted.counts import TRAINER, WIDTH, Slot, Wording
from lightning_weighted.engines import Engine
from lightning_weighted.loop import WindowLoop
from lightning_weighted.window import Window

__all__ = ["Carrier", "CarrierLoop", "Handover", "decode", "digit_bits", "encode", "fits", "width"]


class Handover(IntEnum):
    """What every rank SUMs at the end of a window whose counts were known before its first forward.

    The window's own ``N`` was summed before it started; its end brings what came later, and the next window's
    ``N``.
    """

    ITEMS = 0  # Σ_m n_m over the next window on this rank
    INVALID = 1  # 1 if this rank found a problem in this window (a count, a loss, a disagreement)
    MORE = 2  # 1 if this rank holds real batches after this window
    LOSS = 3  # Σ_m n_m · loss_m / N over this window: summed over the ranks, the window's global item mean


_FRACTION = 24  # bits after the point: weight sums travel to 2**-24 per rank
_BITS = 53 + _FRACTION  # a rank's window count stays below 2**53 (`counts.MAX_ITEMS`)
_TAIL = 3  # INVALID, MORE, LOSS after the digits
_NUMPY = (torch.float64, torch.float32, torch.float16)  # gradient dtypes a host buffer can be written in directly
# the largest integer a gradient dtype holds exactly, and its unit roundoff
_EXACT = {torch.float64: (2**53, 2.0**-53), torch.float32: (2**24, 2.0**-24),
          torch.bfloat16: (2**8, 2.0**-8), torch.float16: (2**11, 2.0**-11)}  # fmt: skip


def digit_bits(dtype: torch.dtype, ranks: int) -> int:
    """The widest digits (in bits, at most 24) whose SUM over ``ranks`` ranks survives DDP's average exactly.

    ``P·d`` and the SUM of ``P`` digits must be exact integers of ``dtype``. bf16 and fp16 products are computed in
    fp32 and rounded back to the digit exactly; in fp32 and fp64 each product is within one rounding of ``d``, and
    the SUM within :math:`(P + 2) P d u` of the digits' sum, kept below a quarter (a power of two of ranks makes
    :math:`1/P`, and everything after it, exact). 0: the carrier cannot carry the count.

    Example::

        >>> digit_bits(torch.float32, 2), digit_bits(torch.bfloat16, 2), digit_bits(torch.bfloat16, 512)
        (23, 7, 0)
    """
    largest, unit = _EXACT.get(dtype, (0, 1.0))
    bound = largest // ranks  # P·d <= largest, and the SUM of P digits too
    if dtype in (torch.float32, torch.float64) and ranks & (ranks - 1):  # not a power of two: rounding
        bound = min(bound, int(0.25 / ((ranks + 2) * ranks * unit)))
    return min(24, max(0, (bound + 1).bit_length() - 1))


def fits(dtype: torch.dtype, ranks: int) -> bool:
    """Whether a handover survives DDP's average over ``ranks`` ranks exactly in a gradient of ``dtype``.

    Example::

        >>> fits(torch.float32, 8), fits(torch.bfloat16, 512), fits(torch.float32, 4096), fits(torch.float32, 4095)
        (True, False, True, False)
    """
    return digit_bits(dtype, ranks) > 0


def width(dtype: torch.dtype, ranks: int) -> int:
    """How many values the carrier holds in a gradient of ``dtype`` over ``ranks`` ranks.

    Example::

        >>> width(torch.float32, 2), width(torch.bfloat16, 2), width(torch.float32, 1000)
        (7, 14, 42)
    """
    return -(-_BITS // digit_bits(dtype, ranks)) + _TAIL


def encode(handover: Sequence[float], ranks: int, bits: int = 1) -> list[float]:
    """This rank's handover (indexed by :class:`Handover`) as the carrier's gradient.

    Example (``N = 5.5`` and the "more data" flag, over 2 ranks, 4-bit digits)::

        >>> values = encode([5.5, 0.0, 1.0, 0.0], ranks=2, bits=4)
        >>> values[4:8], values[-3:]  # 5.5 · 2**24 = 0x580_0000: hexadecimal digits 8 and 5, times P
        ([0.0, 16.0, 10.0, 0.0], [0.0, 2.0, 0.0])
    """
    fixed, mask = round(handover[Handover.ITEMS] * 2**_FRACTION), (1 << bits) - 1
    digits = [float(ranks * ((fixed >> shift) & mask)) for shift in range(0, _BITS, bits)]
    return [*digits, ranks * handover[Handover.INVALID], ranks * handover[Handover.MORE], handover[Handover.LOSS]]


def decode(received: Sequence[float], ranks: int, bits: int = 1) -> list[float]:
    """The SUM of every rank's handover from the carrier's averaged gradient.

    Example (two ranks sent ``N = 5.5`` and ``2``; the gradient is their average)::

        >>> sent = [encode([n, 0.0, 1.0, 0.25], ranks=2, bits=4) for n in (5.5, 2.0)]
        >>> decode([(a + b) / 2 for a, b in zip(*sent)], ranks=2, bits=4)
        [7.5, 0, 2, 0.5]
    """
    *digits, invalid, more, loss = received
    fixed = 0
    for value in reversed(digits):
        fixed = (fixed << bits) + round(value)
    return [fixed / 2**_FRACTION, round(invalid), round(more), loss * ranks]


class Carrier(nn.Module):
    """Wraps the module DDP reduces and adds one parameter, ``rider``, whose gradient carries a window's handover.

    The rider's value stays zero and no optimizer sees it. For a window's syncing microbatch the strategy sets
    :attr:`active` and hands the handover to :meth:`load`: the forward adds ``rider.sum()`` (zero) to the loss, so
    DDP finds the rider in the graph, and a hook replaces whatever gradient reaches it with the handover. After the
    backward, :meth:`read` returns the SUM over the ranks.

    Every window runs this once, between two passes over the model's gradients that leave the caches cold, where
    each Python attribute lookup and each tensor op costs tens of microseconds: the handover is written into one
    buffer kept for the carrier's lifetime (a pinned host staging buffer with a device copy off the CPU), and the
    hot path reads ``__dict__`` entries rather than ``nn.Module`` attributes.

    Args:
        module: the module DDP wraps (Lightning's ``LightningModule``).
        dtype: the gradients' dtype: the rider joins their bucket.
        device: where the gradients live.
        ranks: the number of ranks DDP averages over.
        line_bytes: the rider's size in bytes is a multiple of it. DDP puts the rider first in its bucket, so the
            gradients after it keep the alignment to whole cache lines they have without it.
    """

    def __init__(
        self, module: nn.Module, dtype: torch.dtype, device: torch.device, ranks: int, line_bytes: int = 64
    ) -> None:
        super().__init__()
        self.module = module
        used = width(dtype, ranks)
        per_line = max(1, line_bytes // dtype.itemsize)
        self.rider = nn.Parameter(torch.zeros(-(-used // per_line) * per_line, dtype=dtype, device=device))
        self.ranks, self.bits = ranks, digit_bits(dtype, ranks)
        self.active = False
        # the handover's values on the host (every value is exact in `dtype`), and the gradient the hook hands DDP
        host = dtype if dtype in _NUMPY else torch.float32
        staging = torch.zeros(len(self.rider), dtype=host, pin_memory=device.type == "cuda")
        sent = staging if device.type == "cpu" and host == dtype else torch.zeros_like(self.rider)
        values, tail = staging.numpy()[:used], sent[used - 1]
        self.__dict__.update(_staging=staging, _values=values, _sent=sent, _tail=tail, _used=used, _loaded=False)
        self.rider.register_hook(self._carry)  # type: ignore[no-untyped-call]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's output; with :attr:`active`, its loss plus the rider's (zero) sum."""
        output = self._modules["module"](*args, **kwargs)  # type: ignore[misc]
        if not self.active or not torch.is_grad_enabled():
            return output
        if isinstance(output, Tensor) and output.requires_grad:
            return output + self.term(output.dtype)
        if isinstance(output, Mapping):
            loss = output.get("loss")
            if isinstance(loss, Tensor) and loss.requires_grad:
                return {**output, "loss": loss + self.term(loss.dtype)}
        return output

    def arm(self, active: bool) -> None:
        """Sets :attr:`active` (every microbatch: around ``nn.Module.__setattr__``, which checks every registry)."""
        self.__dict__["active"] = active

    def term(self, dtype: torch.dtype | None = None) -> Tensor:
        """Zero, computed from the rider: added to a loss, it brings the rider into the backward."""
        total = self._parameters["rider"].sum()  # type: ignore[union-attr]
        return total if dtype is None or dtype == total.dtype else total.to(dtype)

    def load(self, handover: Sequence[float], fill: Callable[[Tensor], None] | None = None) -> None:
        """Sets the handover the rider's gradient carries in the next backward; ``fill`` adds to its loss slot."""
        self._values[:] = encode(handover, self.ranks, self.bits)
        sent = self._sent
        if sent is not self._staging:
            sent.copy_(self._staging, non_blocking=True)  # pinned: the host does not wait
        if fill is not None:
            fill(self._tail)  # a value of the gradients' dtype
        self.__dict__["_loaded"] = True

    def read(self, also: Tensor | None = None) -> list[float] | None:
        """The SUM over the ranks of what they loaded, with ``also`` (a 0-dim tensor) appended: one host read.

        ``None`` if no backward reached the rider.
        """
        rider = self._parameters["rider"]
        assert rider is not None
        grad, rider.grad = rider.grad, None
        self.__dict__["_loaded"] = False
        if grad is None:
            return None
        used = self._used
        if also is None:
            return decode(grad.tolist()[:used], self.ranks, self.bits)
        received = torch.cat([grad.double(), also.double().reshape(1)]).tolist()
        return [*decode(received[:used], self.ranks, self.bits), received[-1]]

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                raise
            return getattr(self.module, name)  # `trainer.model.module.<attribute>` as without the carrier

    def _carry(self, grad: Tensor) -> Tensor:
        return self._sent if self._loaded else grad


class CarrierLoop(WindowLoop):
    """A :class:`~lightning_weighted.loop.WindowLoop` counting ahead whose window ends through a :class:`Carrier`.

    The loop's own :meth:`~lightning_weighted.loop.WindowLoop.end` starts the window's one float64 payload
    all-reduce; here :meth:`end` loads the carrier instead (the next window's planned items, whether this rank found
    a problem, whether it has more data, its share of the window's loss), right before the syncing backward, whose
    forward ran with the carrier armed (:meth:`Carrier.arm`). :meth:`~lightning_weighted.loop.WindowLoop.finish`
    then reads the carrier's gradient once, after that backward, and ends the window from a summed payload in the
    :class:`~lightning_weighted.counts.Slot` layout built from it. Counts ahead only (a :attr:`planner`): the loss
    share divides by the window's ``N``, known before its first forward.

    Args:
        carrier: the module DDP wraps.
        engine: DDP's engine (:class:`~lightning_weighted.engines.ddp.DDPEngine`).
        device: where the gradients live.
        wording: how errors name the call that handed over the loss and its count.
        name: the strategy's name, for messages.
    """

    def __init__(
        self,
        carrier: Carrier,
        engine: Engine,
        device: torch.device,
        wording: Wording = TRAINER,
        name: str = "ddp_weighted_carrier",
    ) -> None:
        super().__init__(engine, device, wording, name)
        self.carrier = carrier

    def end(self) -> None:
        """Loads the carrier with this rank's handover; runs right before the window's syncing backward."""
        if self._exchange is not None:
            return
        if self.planner is None:
            raise RuntimeError("the carrier carries windows counted ahead: the loop needs a planner")
        window = self.window()
        handover = [0.0] * len(Handover)
        handover[Handover.ITEMS] = self.planner.plan_following()
        handover[Handover.INVALID] = float(window.problem is not None)
        handover[Handover.MORE] = float(self.participation is None or self.participation.has_more())
        self.carrier.load(handover, lambda slot: _add_share(window, slot))
        self._exchange = _Carried(self.carrier, window, self.wording)  # type: ignore[assignment]


def _add_share(window: Window, slot: Tensor) -> None:
    """Adds this rank's share of the window's loss, ``Σ n·loss / N``, to the carrier's loss slot (on the device)."""
    loss, total = window.loss_sum, window.total
    if loss is None or total is None:
        return  # no microbatch of this rank was weighted
    if isinstance(total, Tensor):  # N still on the device (an epoch's first window)
        slot.add_(torch.where(total > 0, loss / total, 0.0).to(slot.dtype))
    elif total > 0:
        slot.add_((loss / total).to(slot.dtype))


class _Carried:
    """A window's exchange through the carrier: what the loop's ``finish`` asks of an ``Exchange``."""

    def __init__(self, carrier: Carrier, window: Window, wording: Wording) -> None:
        self.carrier, self.window, self.wording = carrier, window, wording

    def items(self) -> Tensor:
        """``N``: counted ahead, summed before the window's first forward."""
        return torch.as_tensor(self.window.total, dtype=torch.float64)

    def read(self) -> list[float]:
        """The window's summed payload (``Slot`` layout), then this rank's items, from one read of the carrier."""
        total = self.window.total
        on_device = total if isinstance(total, Tensor) else None
        received = self.carrier.read(on_device)
        if received is None:
            raise RuntimeError("no backward reached the carrier: arm it for the window's syncing forward")
        items = float(received.pop() if on_device is not None else total)  # type: ignore[arg-type]
        following, invalid, more, share = received
        if invalid:
            raise ValueError(f"on {invalid} rank(s), a microbatch's count or loss is invalid. {self.wording.fix}.")
        summed = [0.0] * (WIDTH + 1)
        summed[Slot.ITEMS], summed[Slot.NEXT], summed[Slot.MORE] = items, following, more
        summed[Slot.LOSS] = share * items
        summed[WIDTH] = self.window.items
        return summed
