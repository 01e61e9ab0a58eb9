"""Every touch of Lightning's and the user's objects in a weighted fit, in one object, undone at ``teardown``.

A weighted Trainer strategy works through Lightning's strategy hooks wherever Lightning has one
(``on_train_batch_start``, ``training_step``, ``backward``, ``optimizer_step``, ``reduce``, ``process_dataloader``).
Where it has none, :class:`Seam` touches another object, each touch named here with its reason; each is pinned by
``tests/unit/test_seam.py``, which fails on a Lightning that changes the reason:

- :data:`EPOCH_END`, the module's ``on_train_batch_start``: Lightning ends an epoch early only where the module's
  hook returns -1; the strategy's own hook runs after it, its return ignored. The epoch ends there where every rank
  is out of data, and a -1 of the user's drops the half window (:meth:`WindowLoop.drop`).
- :data:`SCHEDULERS`, the module's ``lr_scheduler_step``: Lightning steps LR schedulers only through it. After a
  window without items, step-interval schedulers do not step.
- :data:`EVALUATION`, a callback put first in ``trainer.callbacks``: an evaluation batch's loader index and position
  reach only the batch hooks of callbacks and the module, and an evaluation epoch's end only their epoch hooks.
  There the replays of evaluation loaders are noted and the item-mean evaluation loss is logged.
- :data:`REPLAY_LOGS`, the module's ``log`` during a replayed step: Lightning adds every ``self.log`` call into the
  epoch's values; a replay's add nothing (a mean's batch size is 0, a sum's value 0).
- :data:`METRICS`, the states of the module's torchmetrics around a replayed step: put back after it, update count
  included (torchmetrics has no public setter for it).
- :data:`CLIP`, ``FSDPPrecision.clip_grad_by_norm`` under ``fsdp_weighted``: Lightning's refuses norm clipping for
  FSDP1; FSDP1's own ``clip_grad_norm_`` over the shards takes its place.
- :data:`SAMPLER_WARNING`, the warnings filter: Lightning warns that its ``DistributedSampler`` repeats items, and
  the one it inserts here (:class:`~lightning_weighted.UnpaddedDistributedSampler`) repeats none.
- :data:`LOADERS`, each loader Lightning processes: extended for the fit (:mod:`lightning_weighted.extension`); the
  stage of a loader is read from the barrier Lightning names right before it processes a stage's loaders.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.warnings import PossibleUserWarning
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor
from torchmetrics import Metric

from lightning_weighted._compat import metric_restore, metric_snapshot
from lightning_weighted.loop import Batch, WindowLoop
from lightning_weighted.trainer._evaluation import EvaluationLoss
from lightning_weighted.trainer._loaders import FitLoaders

__all__ = [
    "CLIP",
    "EPOCH_END",
    "EVALUATION",
    "LOADERS",
    "METRICS",
    "REPLAY_LOGS",
    "SAMPLER_WARNING",
    "SCHEDULERS",
    "Seam",
    "logs_ignored",
    "patched",
]

EPOCH_END = "LightningModule.on_train_batch_start"
SCHEDULERS = "LightningModule.lr_scheduler_step"
EVALUATION = "Trainer.callbacks"
REPLAY_LOGS = "LightningModule.log"
METRICS = "torchmetrics.Metric._update_count"
CLIP = "FSDPPrecision.clip_grad_by_norm"
SAMPLER_WARNING = "warnings.filters"
LOADERS = "Strategy.barrier"

_SAMPLER_WARNING = "Using `DistributedSampler` with the dataloaders"  # the start of Lightning's message
_WEIGHTED = ("mean", "avg", "sum")


class Seam:
    """The touches of one weighted fit, over its loop of windows and its loaders (see the module docstring).

    Args:
        loaders: the fit's loaders, whose participations tell which batches are replays.

    Attributes:
        loop: the loop of windows, from ``setup`` on; the batch in progress is its :attr:`WindowLoop.batch`.
        weight: inside the step of a loader that replays, 1.0 for a real batch and 0.0 for a replay; ``None``
            elsewhere (Lightning's reductions as they are).
    """

    def __init__(self, loaders: FitLoaders) -> None:
        self.loaders = loaders
        self.loop: WindowLoop | None = None
        self.evaluation: EvaluationLoss | None = None
        self.weight: float | None = None
        self._touches = contextlib.ExitStack()

    def enter(self, trainer: Trainer, module: LightningModule, loop: WindowLoop, evaluation: EvaluationLoss) -> None:
        """Makes the fit's touches: each undone by :meth:`close`, also where a later one fails."""
        self.loop, self.evaluation = loop, evaluation
        self._touches.enter_context(_silenced(_SAMPLER_WARNING, PossibleUserWarning))
        self._touches.enter_context(
            patched(
                module,
                on_train_batch_start=self._epoch_end(module.on_train_batch_start),
                lr_scheduler_step=self._scheduler_step(trainer, module.lr_scheduler_step),
            )
        )
        callback = _Evaluation(self)
        trainer.callbacks.insert(0, callback)  # type: ignore[attr-defined]
        self._touches.callback(trainer.callbacks.remove, callback)  # type: ignore[attr-defined]

    def clip_fsdp1(self, plugin: Any, clip: Callable[[Any, float | int], None]) -> None:
        """Norm clipping through FSDP1's own ``clip_grad_norm_`` (:data:`CLIP`), for the fit."""
        self._touches.enter_context(patched(plugin, clip_grad_by_norm=clip))

    def close(self) -> None:
        """Undoes every touch, the loaders' included."""
        self._touches.close()
        self.loaders.release()

    @contextlib.contextmanager
    def step(self, module: LightningModule, batch: Batch) -> Iterator[None]:
        """A step of ``batch``: a replay's logs and metrics leave no trace (:data:`REPLAY_LOGS`, :data:`METRICS`)."""
        self.weight = (0.0 if batch.replay else 1.0) if batch.replays else None
        metrics = [m for m in module.modules() if isinstance(m, Metric)] if batch.replay else []
        saved = [metric_snapshot(m) for m in metrics]
        try:
            with patched(module, log=_logged_as_nothing(module.log)) if batch.replay else contextlib.nullcontext():
                yield
        finally:
            self.weight = None
            for metric, state in zip(metrics, saved, strict=True):
                metric_restore(metric, state)

    def reduce(self, tensor: Tensor, reduce_op: Any, group: Any, fallback: Callable[..., Any]) -> Any:
        """A mean or sum over the ranks that held a real batch, where :attr:`weight` is set; else ``fallback``.

        In the step of a loader that replays, values logged with ``sync_dist=True`` are reduced as they are logged:
        each rank weighs by whether its batch was real.
        """
        op = str(reduce_op).lower().rsplit(".", 1)[-1]  # "mean", "sum", or an enum's "RedOpType.SUM"
        if self.weight is None or op not in _WEIGHTED or not dist.is_initialized():
            return fallback(tensor, group=group, reduce_op=reduce_op)
        weight = torch.full((1,), self.weight, dtype=torch.float64, device=tensor.device)
        weighted = torch.cat([tensor.detach().reshape(-1).double() * self.weight, weight])
        dist.all_reduce(weighted, group=group)
        total = weighted[:-1] if op == "sum" else weighted[:-1] / weighted[-1].clamp(min=1.0)
        return total.reshape(tensor.shape).to(tensor.dtype if tensor.is_floating_point() else torch.float64)

    def _epoch_end(self, hook: Callable[[Any, int], int | None]) -> Callable[[Any, int], int | None]:
        def on_train_batch_start(batch: Any, batch_idx: int) -> int | None:
            assert self.loop is not None
            # every rank is out of data (decided alike at the last window's end): Lightning ends the epoch here
            response = -1 if self.loaders.train.stop else hook(batch, batch_idx)
            if response == -1:  # Lightning drops the half window's gradient: so do its counts
                self.loop.drop()
            return response

        return on_train_batch_start

    def _scheduler_step(self, trainer: Trainer, hook: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
        def lr_scheduler_step(scheduler: Any, metric: Any) -> None:
            assert self.loop is not None
            configs = trainer.lr_scheduler_configs
            if self.loop.batch.skipped and any(c.scheduler is scheduler and c.interval == "step" for c in configs):
                return
            hook(scheduler, metric)

        return lr_scheduler_step


class _Evaluation(Callback):
    """The evaluation batches' hooks of a weighted fit (:data:`EVALUATION`): their replays, and the loss logged."""

    def __init__(self, seam: Seam) -> None:
        self.seam = seam

    def on_validation_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._begin("val", batch_idx, dataloader_idx)

    def on_test_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._begin("test", batch_idx, dataloader_idx)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._end()

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._end("val", pl_module)

    def on_test_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._end("test", pl_module)

    def _begin(self, stage: str, batch_idx: int, dataloader_idx: int) -> None:
        assert self.seam.loop is not None
        loaders = self.seam.loaders.evaluation[stage]
        participation = loaders[dataloader_idx] if dataloader_idx < len(loaders) else None
        replay = participation is not None and participation.begin_batch(batch_idx)
        replays = participation is not None and participation.replays
        self.seam.loop.batch = Batch(batch_idx, replay, replays, loader=dataloader_idx)

    def _end(self, stage: str = "", module: LightningModule | None = None) -> None:
        assert self.seam.loop is not None
        self.seam.loop.batch = Batch()
        if stage and module is not None and self.seam.evaluation is not None:
            self.seam.evaluation.log(stage, module)


@contextlib.contextmanager
def patched(target: Any, **methods: Callable[..., Any]) -> Iterator[None]:
    """Sets ``methods`` on one instance for the length of the block; its class is never touched.

    Example::

        >>> layer = torch.nn.Identity()
        >>> with patched(layer, extra_repr=lambda: "patched"):
        ...     print(layer)
        Identity(patched)
        >>> print(layer)
        Identity()
    """
    missing = object()
    saved = {name: vars(target).get(name, missing) for name in methods}
    for name, method in methods.items():
        setattr(target, name, method)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is missing:
                delattr(target, name)
            else:
                setattr(target, name, value)


def logs_ignored(module: LightningModule) -> contextlib.AbstractContextManager[None]:
    """``self.log`` and ``self.log_dict`` of the module do nothing for the length of the block (the audit re-run)."""

    def ignore(*args: Any, **kwargs: Any) -> None:
        return None

    return patched(module, log=ignore, log_dict=ignore)


def _logged_as_nothing(log: Callable[..., None]) -> Callable[..., None]:
    def log_nothing(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if not isinstance(value, Metric):  # a Metric's state is put back after the step instead
            if kwargs.get("reduce_fx", "mean") in ("sum", torch.sum):
                value = torch.zeros_like(torch.as_tensor(value, dtype=torch.float64))
            else:
                kwargs["batch_size"] = 0
        log(name, value, *args, **kwargs)

    return log_nothing


@contextlib.contextmanager
def _silenced(message: str, category: type[Warning]) -> Iterator[None]:
    """Ignores one warning (by the start of its message) for the length of the block (:data:`SAMPLER_WARNING`)."""
    filters: list[Any] = warnings.filters  # type: ignore[assignment]
    before = list(filters)
    warnings.filterwarnings("ignore", message=message, category=category)
    entry = filters[0]
    try:
        yield
    finally:
        if entry not in before:  # an identical filter of someone else's stays
            with contextlib.suppress(ValueError):
                filters.remove(entry)
