r"""Counts carried through DDP's own reducer: one extra parameter whose gradient holds a window's handover.

When each window's counts are known before its first forward (:class:`~lightning_weighted.window.LossScale`
``GLOBAL_MEAN``), every loss is scaled before its backward and DDP's C++ reducer, with no communication hook,
averages the gradients into :math:`g` (:mod:`lightning_weighted.window`). What a window must still tell every rank
(:class:`~lightning_weighted._counts.Handover`: the next window's count, a problem found after the counts were
summed, whether the rank has more data, its share of the loss) rides in the gradient of :class:`Carrier`'s one
parameter, reduced in the same bucket all-reduce as the model's gradients: no collective of its own, no Python in
the reduction.

DDP multiplies every gradient by :math:`1/P` and SUMs it. The count therefore travels as the digits of a
fixed-point number (:math:`2^{-24}` apart), each sent as :math:`P \cdot d`: the product with the rounded :math:`1/P`
comes back to :math:`d` within a rounding error, the SUM of :math:`P` digits stays an integer within less than one
half, and the decoder rounds. :func:`digit_bits` picks the widest digits that keep this exact for the gradients'
dtype and :math:`P` (23 bits, 7 values in all, for fp32 on 2 ranks; 7 bits, 14 values, for bf16); where not even
one bit does (bf16 beyond 256 ranks, fp16 beyond 2048, fp32 beyond about 2000 unless :math:`P` is a power of two),
the handover takes its own float64 all-reduce. The loss share travels as a plain value of the gradients' dtype: in
bf16 and fp16 the logged loss keeps a few significant digits. The parameter is padded with zeros to whole 64-byte
lines (16 values in fp32): DDP puts it first in its bucket, and the gradients after it stay aligned.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_weighted._counts import Handover

__all__ = ["Carrier", "decode", "digit_bits", "encode", "fits", "width"]

_FRACTION = 24  # bits after the point: weight sums travel to 2**-24 per rank
_BITS = 53 + _FRACTION  # a rank's window count stays below 2**53 (`_counts.MAX_ITEMS`)
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
    """This rank's handover (indexed by :class:`~lightning_weighted._counts.Handover`) as the carrier's gradient.

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
