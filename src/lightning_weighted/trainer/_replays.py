"""A replayed batch counts for nothing where users look: Lightning's logged values and torchmetrics states.

A rank whose loader ran out replays a batch (see :mod:`lightning_weighted.data`) so that every collective of the
user's step stays matched; the step runs as written, inside :meth:`Replays.step`. A replay's ``self.log`` calls
add nothing to epoch values (a mean's batch size is 0, a sum's value 0) and every torchmetrics ``Metric`` of the
module is put back as it was after it; and in the step of any loader that replays, the cross-rank means and sums of
on-step values (``sync_dist=True``, reduced as they are logged) weigh each rank by whether its batch was real
(:meth:`Replays.reduce`). Epoch values reduce after the steps, as Lightning reduces them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from torch import Tensor
from torchmetrics import Metric

from lightning_weighted._compat import metric_restore, metric_snapshot, patched

__all__ = ["Replays"]

_WEIGHTED = ("mean", "avg", "sum")


class Replays:
    """The weight of this rank's step in Lightning's cross-rank reductions, and the context of a replayed step.

    Attributes:
        weight: inside the step of a loader that replays, 1.0 for a real batch and 0.0 for a replay; ``None``
            elsewhere (Lightning's reductions as they are).
    """

    def __init__(self) -> None:
        self.weight: float | None = None

    @contextlib.contextmanager
    def step(self, module: LightningModule, replays: bool, replay: bool) -> Iterator[None]:
        """Runs a step of a loader (``replays``: one that replays); a replay's logs and metrics leave no trace."""
        self.weight = (0.0 if replay else 1.0) if replays else None
        metrics = [m for m in module.modules() if isinstance(m, Metric)] if replay else []
        saved = [metric_snapshot(m) for m in metrics]
        try:
            with patched(module, log=_logged_as_nothing(module.log)) if replay else contextlib.nullcontext():
                yield
        finally:
            self.weight = None
            for metric, snapshot in zip(metrics, saved, strict=True):
                metric_restore(metric, snapshot)

    def reduce(self, tensor: Tensor, reduce_op: Any, group: Any, fallback: Callable[..., Any]) -> Any:
        """A mean or sum over the ranks that held a real batch, where :attr:`weight` is set; else ``fallback``."""
        op = str(reduce_op).lower().rsplit(".", 1)[-1]  # "mean", "sum", or an enum's "RedOpType.SUM"
        if self.weight is None or op not in _WEIGHTED or not dist.is_initialized():
            return fallback(tensor, group=group, reduce_op=reduce_op)
        weight = torch.full((1,), self.weight, dtype=torch.float64, device=tensor.device)
        weighted = torch.cat([tensor.detach().reshape(-1).double() * self.weight, weight])
        dist.all_reduce(weighted, group=group)
        total = weighted[:-1] if op == "sum" else weighted[:-1] / weighted[-1].clamp(min=1.0)
        return total.reshape(tensor.shape).to(tensor.dtype if tensor.is_floating_point() else torch.float64)


def _logged_as_nothing(log: Callable[..., None]) -> Callable[..., None]:
    def log_nothing(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if not isinstance(value, Metric):  # a Metric's state is put back after the step instead
            if kwargs.get("reduce_fx", "mean") in ("sum", torch.sum):
                value = torch.zeros_like(torch.as_tensor(value, dtype=torch.float64))
            else:
                kwargs["batch_size"] = 0
        log(name, value, *args, **kwargs)

    return log_nothing
