"""Logging the weighted objective of each optimizer step: ``ItemMetrics``, and ``ItemMonitor``, its Trainer callback."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor
from typing_extensions import override

from lightning_weighted._compat import trainer_of
from lightning_weighted.payload import WindowResult
from lightning_weighted.strategy import weighted

__all__ = ["ItemMetrics", "ItemMonitor", "imbalance", "loggable"]

_SHOWN = ("train/loss", "train/items_per_sec")  # in the progress bar
_ROLE = "ItemMonitor logs the windows of"  # the opening of the error of a strategy that is not weighted


class ItemMetrics:
    """The weighted objective of each optimizer step, from its window's result: a plain object, for a Fabric loop.

    Its values are named as in ``docs/fabric.md``, to log.

    Args:
        group: the data-parallel ranks (``strategy.data_parallel_group``; ``None``: every rank).
        device: where the collectives' tensors live (``fabric.device``).
        imbalance: compute ``train/imbalance``.

    Example (one process, no collective)::

        >>> metrics = ItemMetrics(imbalance=False)
        >>> metrics.update(WindowResult(step=0, items=8.0, local_items=2.0, loss=2.5), elapsed=0.5)
        >>> metrics.compute()
        {'train/items_per_sec': 16.0, 'train/loss': 2.5, 'train/items': 8.0, 'train/items_local': 2.0}
    """

    def __init__(
        self, group: dist.ProcessGroup | None = None, device: torch.device | None = None, imbalance: bool = True
    ) -> None:
        self.group, self.device, self.imbalance = group, device or torch.device("cpu"), imbalance
        self.items_total = 0.0
        self._window: WindowResult | None = None
        self._elapsed: float | None = None
        self._aux: Mapping[str, Tensor] = {}
        self._microbatches = 1
        self._epoch = [0.0, 0.0]  # Σ N·loss and Σ N over the epoch's windows with items

    def update(
        self,
        window: WindowResult,
        *,
        elapsed: float | None = None,
        aux: Mapping[str, Tensor] | None = None,
        microbatches: int = 1,
    ) -> None:
        """Takes ``strategy.last_window`` once its last backward returned, and its wall time ``elapsed`` in seconds.

        ``aux``: each auxiliary term summed over this rank's ``microbatches`` of the window (replays add nothing to it).
        """
        self._window, self._elapsed, self._aux, self._microbatches = window, elapsed, aux or {}, microbatches
        self.items_total += window.items
        if window.items > 0:
            self._epoch[0] += window.loss * window.items
            self._epoch[1] += window.items

    def compute(self, collectives: bool = True) -> dict[str, float | Tensor]:
        """The last window's values by logged name; ``collectives``: with the all-reduced ones (every rank calls)."""
        window = self._window
        if window is None:
            return {}
        values: dict[str, float | Tensor] = {}
        if self._elapsed is not None:
            values["train/items_per_sec"] = window.items / self._elapsed if self._elapsed > 0 else math.nan
        if window.items > 0:
            values["train/loss"] = window.loss
        values["train/items"], values["train/items_local"] = window.items, window.local_items
        for name, part in window.parts.items():
            if part.items > 0:
                values[f"train/loss/{name}"] = part.loss
            values[f"train/items/{name}"] = part.items
        if collectives and self.imbalance:
            values["train/imbalance"] = self._imbalance(window)
        if collectives and self._aux:
            values.update(self._aux_means())
        return values

    def end_epoch(self) -> dict[str, float]:
        """Ends the epoch: returns its ``train/loss_epoch`` (nothing where every ``N`` was 0)."""
        total, items = self._epoch
        self._epoch = [0.0, 0.0]
        return {"train/loss_epoch": total / items} if items > 0 else {}

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: :attr:`items_total`."""
        return {"items_total": self.items_total}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resumes :attr:`items_total` from :meth:`state_dict`."""
        self.items_total = float(state_dict["items_total"])

    def _imbalance(self, window: WindowResult) -> float:
        """:func:`imbalance` over the window's ranks, from one MAX of their counts."""
        if window.items <= 0 or not dist.is_initialized():
            return 1.0
        largest = torch.tensor(window.local_items, dtype=torch.float64, device=self.device)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=self.group)
        return imbalance(float(largest), window.items, dist.get_world_size(self.group))

    def _aux_means(self) -> dict[str, Tensor]:
        """Each auxiliary term's mean over the window's microbatches and ranks, as the strategies weigh them."""
        names = sorted(self._aux)
        stacked = torch.stack([torch.as_tensor(self._aux[name], dtype=torch.float64) for name in names])
        ranks = 1
        if dist.is_initialized():
            dist.all_reduce(stacked, group=self.group)
            ranks = dist.get_world_size(self.group)
        means = stacked / (self._microbatches * ranks)
        return {f"train/aux/{name}": mean for name, mean in zip(names, means, strict=True)}


class ItemMonitor(Callback):
    """Logs the weighted objective of every optimizer step of a weighted strategy, as :class:`ItemMetrics` computes it.

    The loss and the rate show in the progress bar; ``train/imbalance`` and the ``"aux"`` terms ``training_step``
    returns only on the steps Lightning logs. Every value is global (no ``sync_dist``); :attr:`items_total` is saved.
    """

    def __init__(self, imbalance: bool = True) -> None:
        self.metrics = ItemMetrics(imbalance=imbalance)
        self._last_step: int | None = None
        self._started: float | None = None  # when the window in progress began
        self._aux: dict[str, Tensor] = {}  # the window's auxiliary terms summed over its microbatches on this rank
        self._microbatches = 0

    @property
    def items_total(self) -> float:
        """Every optimizer step's global item count ``N``, summed over the fit (and the fits it resumes)."""
        return self.metrics.items_total

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        weighted(trainer.strategy, _ROLE)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._started is None:
            self._started = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        strategy = weighted(trainer.strategy, _ROLE)
        self._microbatches += 1
        terms = outputs.get("aux") if isinstance(outputs, Mapping) else None
        if isinstance(terms, Mapping) and not strategy.padding_step:
            for name, term in terms.items():  # summed on the device: nothing is read per microbatch
                self._aux[name] = self._aux.get(name, 0.0) + term.detach().reshape(()).double()
        window = strategy.last_window
        if window is None or window.step == self._last_step:
            return  # no optimizer step ended with this batch
        self._last_step = window.step
        elapsed = time.perf_counter() - (self._started or math.inf)
        self.metrics.group, self.metrics.device = strategy.data_parallel_group, pl_module.device
        self.metrics.update(window, elapsed=elapsed, aux=self._aux, microbatches=self._microbatches)
        self._aux, self._microbatches, self._started = {}, 0, None
        every: int = trainer.log_every_n_steps  # type: ignore[attr-defined]  # set by the Trainer's logger connector
        logs_now = trainer.logger is not None and (trainer.global_step + 1) % every == 0
        values = {k: loggable(v, pl_module) for k, v in self.metrics.compute(collectives=logs_now).items()}
        for shown in (True, False):  # the progress bar's values, then the others
            logged = {k: v for k, v in values.items() if (k in _SHOWN) == shown}
            pl_module.log_dict(logged, prog_bar=shown, on_step=True, on_epoch=False, batch_size=1)

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for name, value in self.metrics.end_epoch().items():
            # Already global: `sync_dist` averages equal values (exactly), and keeps Lightning from warning.
            pl_module.log(name, loggable(value, pl_module), sync_dist=True, batch_size=1)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.metrics.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.metrics.load_state_dict(state_dict)


def loggable(value: float | Tensor, module: LightningModule) -> float | Tensor:
    """A value for ``self.log``: a float64 tensor where the run is float64, lest Lightning round it to float32."""
    trainer = trainer_of(module)  # None outside a fit
    float64 = trainer is not None and str(trainer.precision).startswith("64")
    return torch.as_tensor(value, dtype=torch.float64).to(module.device) if float64 else value


def imbalance(largest: float, items: float, ranks: int) -> float:
    """``max_r P·n_r / N``: how much more weight the items of the rank with most get than plain DDP gives them."""
    return ranks * largest / items if items > 0 else 1.0
