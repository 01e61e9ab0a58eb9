r"""Counts carried through DDP's own reducer: one extra parameter whose gradient holds a window's handover.

When each window's counts are known before its first forward (:class:`~lightning_weighted.window.LossScale`
``GLOBAL_MEAN``), every loss is scaled before its backward and DDP's C++ reducer, with no communication hook,
averages the gradients into :math:`g` (:mod:`lightning_weighted.window`). What a window must still tell every rank
(:class:`~lightning_weighted._counts.Handover`: the next window's count, a problem found after the counts were
summed, whether the rank has more data, its share of the loss) rides in the gradient of :class:`Carrier`'s one
parameter, reduced in the same bucket all-reduce as the model's gradients: no collective of its own, no Python in
the reduction.

DDP multiplies every gradient by :math:`1/P` and SUMs it. The count therefore travels as bits of a fixed-point
number (:math:`2^{-24}` apart), each sent as :math:`P \cdot b`: the product with the rounded :math:`1/P` comes
back to :math:`b` within a rounding error, the SUM of :math:`P` bits stays an exact small integer, and the decoder
rounds. That is exact where :func:`fits` says so (bf16 to 256 ranks, fp16 to 2048, fp32 to 1024 or any power of
two to :math:`2^{20}`); elsewhere the handover takes its own float64 all-reduce.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_weighted._counts import Handover

__all__ = ["WIDTH", "Carrier", "decode", "encode", "fits"]

_FRACTION = 24  # bits after the point: weight sums travel to 2**-24 per rank
_BITS = 53 + _FRACTION  # a rank's window count stays below 2**53 (`_counts.MAX_ITEMS`)
_INVALID, _MORE, _LOSS = _BITS, _BITS + 1, _BITS + 2
WIDTH = _BITS + 3
_LIMITS = {torch.float64: 2**20, torch.float32: 1024, torch.bfloat16: 256, torch.float16: 2048}


def fits(dtype: torch.dtype, ranks: int) -> bool:
    """Whether a handover survives DDP's average over ``ranks`` ranks exactly in a gradient of ``dtype``.

    Example::

        >>> fits(torch.float32, 8), fits(torch.bfloat16, 512), fits(torch.float32, 4096)
        (True, False, True)
    """
    limit = _LIMITS.get(dtype, 0)
    power_of_two = ranks & (ranks - 1) == 0 and dtype in (torch.float32, torch.float64)
    return 0 < ranks <= limit or (power_of_two and ranks <= 2**20)


def encode(handover: Sequence[float], ranks: int) -> list[float]:
    """This rank's handover (indexed by :class:`~lightning_weighted._counts.Handover`) as the carrier's gradient.

    Example (``N = 5.5`` and the "more data" flag, over 2 ranks)::

        >>> values = encode([5.5, 0.0, 1.0, 0.0], ranks=2)
        >>> [values[k] for k in (23, 24, 26)], values[-3:]
        ([2.0, 2.0, 2.0], [0.0, 2.0, 0.0])
    """
    fixed = round(handover[Handover.ITEMS] * 2**_FRACTION)
    values = [float(ranks * ((fixed >> place) & 1)) for place in range(_BITS)]
    return [*values, ranks * handover[Handover.INVALID], ranks * handover[Handover.MORE], handover[Handover.LOSS]]


def decode(received: Sequence[float], ranks: int) -> list[float]:
    """The SUM of every rank's handover from the carrier's averaged gradient.

    Example (two ranks sent ``N = 5.5`` and ``2``; the gradient is their average)::

        >>> sent = [encode([n, 0.0, 1.0, 0.25], ranks=2) for n in (5.5, 2.0)]
        >>> decode([(a + b) / 2 for a, b in zip(*sent)], ranks=2)
        [7.5, 0, 2, 0.5]
    """
    fixed = sum(round(value) << place for place, value in enumerate(received[:_BITS]))
    return [fixed / 2**_FRACTION, round(received[_INVALID]), round(received[_MORE]), received[_LOSS] * ranks]


class Carrier(nn.Module):
    """Wraps the module DDP reduces and adds one parameter, ``rider``, whose gradient carries a window's handover.

    The rider's value stays zero and no optimizer sees it. For a window's syncing microbatch the strategy sets
    :attr:`active` and hands the handover to :meth:`load`: the forward adds ``rider.sum()`` (zero) to the loss, so
    DDP finds the rider in the graph, and a hook replaces whatever gradient reaches it with the handover. After the
    backward, :meth:`read` returns the SUM over the ranks.

    Args:
        module: the module DDP wraps (Lightning's ``LightningModule``).
        dtype: the gradients' dtype: the rider joins their bucket.
        device: where the gradients live.
        ranks: the number of ranks DDP averages over.
    """

    def __init__(self, module: nn.Module, dtype: torch.dtype, device: torch.device, ranks: int) -> None:
        super().__init__()
        self.module = module
        self.rider = nn.Parameter(torch.zeros(WIDTH, dtype=dtype, device=device))
        self.ranks = ranks
        self.active = False
        self._sent: Tensor | None = None
        self.rider.register_hook(self._carry)  # type: ignore[no-untyped-call]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's output; with :attr:`active`, its loss plus the rider's (zero) sum."""
        output = self.module(*args, **kwargs)
        if not self.active or not torch.is_grad_enabled():
            return output
        if isinstance(output, Tensor) and output.requires_grad:
            return output + self.term(output.dtype)
        if isinstance(output, Mapping):
            loss = output.get("loss")
            if isinstance(loss, Tensor) and loss.requires_grad:
                return {**output, "loss": loss + self.term(loss.dtype)}
        return output

    def term(self, dtype: torch.dtype | None = None) -> Tensor:
        """Zero, computed from the rider: added to a loss, it brings the rider into the backward."""
        total = self.rider.sum()
        return total if dtype is None or dtype == total.dtype else total.to(dtype)

    def load(self, handover: Sequence[float], loss: Tensor | None = None) -> None:
        """Sets what the rider's gradient carries in the next backward; ``loss`` (on the device) fills the loss slot."""
        values = torch.tensor(encode(handover, self.ranks), dtype=self.rider.dtype)
        if self.rider.device.type == "cuda":
            values = values.pin_memory()  # a pinned, non-blocking copy keeps the host from waiting
        values = values.to(self.rider.device, non_blocking=True)
        if loss is not None:
            values[_LOSS] += loss.to(values.dtype)
        self._sent = values

    def read(self) -> list[float] | None:
        """The SUM over the ranks of what they loaded (one host read), or ``None`` if no backward reached the rider."""
        grad, self.rider.grad, self._sent = self.rider.grad, None, None
        return None if grad is None else decode(grad.tolist(), self.ranks)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                raise
            return getattr(self.module, name)  # `trainer.model.module.<attribute>` as without the carrier

    def _carry(self, grad: Tensor) -> Tensor:
        return grad if self._sent is None else self._sent
