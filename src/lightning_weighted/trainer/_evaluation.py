"""The item mean of the loss a ``validation_step`` or ``test_step`` returns, over every rank (``val/loss``).

Each evaluation batch is counted by the training count rule (a returned ``"count"``, else an
:class:`~lightning_weighted.ItemCounter`'s count of the batch, else the batch size) into one window per loader
(:mod:`lightning_weighted.window`), whose payload is summed once at the epoch's end: exact whatever the ranks hold,
each item once (a replayed batch counts 0).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.data import extract_batch_size

from lightning_weighted.counts import TRAINER, Wording, count_rule, split_output
from lightning_weighted.loop import Exchange
from lightning_weighted.monitor import loggable
from lightning_weighted.window import Window

__all__ = ["EvaluationLoss"]


class EvaluationLoss:
    """One window per evaluation loader of the epoch in progress, logged as ``{stage}/loss`` when it ends.

    Args:
        device: where the losses live.
        group: the ranks that see different data.
    """

    def __init__(self, device: torch.device, group: dist.ProcessGroup | None) -> None:
        self.device, self.group = device, group
        self.windows: dict[int, Window] = {}

    def add(self, output: Any, batch: Any, dataloader_idx: int, counter: Any = None) -> None:
        """Records what a step returned for ``batch``: nothing unless it is a loss, or a dict with one."""
        loss, item_sum, problem = split_output(output)
        if loss is None:
            return
        counted = None if counter is None else (counter.count_of(batch), counter.integer)
        window = self.windows.setdefault(dataloader_idx, Window())
        if problem is not None:
            window.reject(problem)
        else:
            window.add(count_rule(output, batch, extract_batch_size, counted), loss.detach(), item_sum)

    def log(self, stage: str, module: LightningModule) -> None:
        """Logs each loader's item-mean loss (the same on every rank); one float64 all-reduce per loader."""
        several = len(self.windows) > 1
        ranks = dist.get_world_size(self.group)
        for index, window in sorted(self.windows.items()):
            result = Exchange(window, True, self.device, self.group).result(0, _wording(stage), ranks)
            if result.items == 0:
                continue
            name = f"{stage}/loss/dataloader_idx_{index}" if several else f"{stage}/loss"
            # already global: the max of equal values is the value itself, exactly, on any number of ranks
            loss = loggable(result.loss, module)  # float64 in a float64 run
            module.log(name, loss, reduce_fx="max", sync_dist=True, add_dataloader_idx=False, batch_size=1)
        self.windows = {}


def _wording(stage: str) -> Wording:
    step = "validation_step" if stage == "val" else "test_step"
    return Wording(f"{step} returned", TRAINER.fix.replace("training_step", step))
