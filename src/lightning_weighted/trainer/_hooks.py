"""The module hooks a weighted Trainer strategy runs before the module's own, and what they note of each batch.

No strategy hook sits where these do: Lightning ends an epoch only when the module's ``on_train_batch_start``
returns -1, steps LR schedulers through the module's ``lr_scheduler_step``, and names an evaluation batch's loader
only to the module's batch hooks. :func:`~lightning_weighted._compat.patched` sets them on the module for one fit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.data import extract_batch_size

from lightning_weighted.counting import ItemCounter
from lightning_weighted.counts import aux_terms, count_rule, split_output
from lightning_weighted.loop import WindowLoop
from lightning_weighted.trainer._evaluation import EvaluationLoss
from lightning_weighted.trainer._loaders import FitLoaders

__all__ = ["ModuleHooks", "add_output", "note_implicit", "window_size"]


class ModuleHooks:
    """The batch in progress, as the hooks note it: a replay or not, of a loader that replays or not, which loader.

    Args:
        loaders: the run's loaders, whose participations tell the replays.

    Attributes:
        loop: the training loop of windows, once training starts.
        evaluation: the item-mean loss of the evaluation loaders, logged at each evaluation epoch's end.
        replaying: the batch in progress (of any stage) is a replay of a rank whose data ran out.
        replays: the loader of the batch in progress replays on some rank.
        dataloader_idx: the evaluation loader of the batch in progress.
        skip_schedulers: the last window had no item: its step-interval schedulers do not step.
    """

    def __init__(self, loaders: FitLoaders) -> None:
        self.loaders = loaders
        self.loop: WindowLoop | None = None
        self.evaluation: EvaluationLoss | None = None
        self.replaying = self.replays = self.skip_schedulers = False
        self.dataloader_idx = 0

    def patches(self, trainer: Trainer, module: LightningModule) -> dict[str, Callable[..., Any]]:
        """The hooks to set on ``module`` for the fit, each calling the module's own."""
        return {
            "on_train_batch_start": self._train_batch_start(trainer, module.on_train_batch_start),
            "lr_scheduler_step": self._scheduler_step(trainer, module.lr_scheduler_step),
            "on_validation_batch_start": self._evaluation_batch_start("val", module.on_validation_batch_start),
            "on_test_batch_start": self._evaluation_batch_start("test", module.on_test_batch_start),
            "on_train_epoch_end": self._epoch_end("train", module, module.on_train_epoch_end),
            "on_validation_epoch_end": self._epoch_end("val", module, module.on_validation_epoch_end),
            "on_test_epoch_end": self._epoch_end("test", module, module.on_test_epoch_end),
        }

    def _train_batch_start(
        self, trainer: Trainer, hook: Callable[[Any, int], int | None]
    ) -> Callable[[Any, int], int | None]:
        def on_train_batch_start(batch: Any, batch_idx: int) -> int | None:
            # Runs before the strategy's own hook and the training step: the place to end the epoch.
            if self.loaders.train.stop:
                return -1  # every rank is out of data: Lightning ends the epoch here, on every rank
            assert self.loop is not None
            # the batch in progress: Lightning hands `batch_idx` one fetch late where `training_step` takes
            # `dataloader_iter`, while its epoch loop's own index counts this batch in both modes
            self.loop.begin_batch(trainer.fit_loop.epoch_loop.batch_idx)
            self.replaying, self.replays = self.loop.padding_step, self.loaders.train.replays
            response = hook(batch, batch_idx)
            if response == -1:  # the module ends the epoch: Lightning drops the half window's gradient
                self.loop.drop()
                self.replaying = False
            return response

        return on_train_batch_start

    def _scheduler_step(self, trainer: Trainer, hook: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
        def lr_scheduler_step(scheduler: Any, metric: Any) -> None:
            configs = trainer.lr_scheduler_configs
            if self.skip_schedulers and any(c.scheduler is scheduler and c.interval == "step" for c in configs):
                return
            hook(scheduler, metric)

        return lr_scheduler_step

    def _evaluation_batch_start(self, stage: str, hook: Callable[..., Any]) -> Callable[..., Any]:
        def on_batch_start(batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
            loaders = self.loaders.evaluation[stage]
            participation = loaders[dataloader_idx] if dataloader_idx < len(loaders) else None
            self.replaying = participation is not None and participation.begin_batch(batch_idx)
            self.replays = participation is not None and participation.replays
            self.dataloader_idx = dataloader_idx
            return hook(batch, batch_idx, dataloader_idx)

        return on_batch_start

    def _epoch_end(self, stage: str, module: LightningModule, hook: Callable[[], Any]) -> Callable[[], Any]:
        def on_epoch_end() -> Any:
            result = hook()
            self.replaying = False
            if stage != "train" and self.evaluation is not None:
                self.evaluation.log(stage, module)
            return result

        return on_epoch_end


def window_size(trainer: Trainer) -> Callable[[int], int]:
    """How many batches Lightning accumulates into the window that would start at a given ``batch_idx``."""

    def size_at(batch_idx: int) -> int:
        accumulate = trainer.accumulate_grad_batches
        return int(max(0, min(accumulate - batch_idx % accumulate, trainer.num_training_batches - batch_idx)))

    return size_at


def add_output(loop: WindowLoop, output: Any, batch: Any, counter: ItemCounter | None) -> Any:
    """Records what ``training_step`` returned for ``batch`` in the loop; returns what Lightning should take instead.

    ``counter`` counts the batch where nothing was counted ahead and ``training_step`` returned no ``"count"``;
    counted ahead, a returned ``"count"`` must agree (:func:`~lightning_weighted.counts.count_rule`).
    """
    loss, item_sum, problem = split_output(output)
    aux, aux_problem = aux_terms(output)
    if loss is None and not loop.padding_step:
        loop.add(None, None, False)
        return {"loss": loop.refused(None)}  # Lightning proceeds; every rank raises at the window's end
    planned = loop.planner.count if loop.planner is not None else None
    count = count_rule(output, batch, extract_batch_size, counter, planned)
    loop.add(loss, count, item_sum, problem or aux_problem, aux)
    return output


def note_implicit(name: str) -> None:
    """Says, once (rank 0), that ``training_step`` gave no count and each microbatch counts its examples."""
    rank_zero_info(
        f"{name}: training_step gave no count, so each microbatch counts its examples (the batch size). If the loss"
        " is a mean over tokens (a Hugging Face model's `out.loss` is), count them: return `{'loss': loss, 'count':"
        " n_valid_tokens}` or add `ItemCounter('tokens', key='labels', shift=True)`; counting by batch size trains"
        " like plain DDP. `ItemCounter('examples')` keeps examples and silences this."
    )
