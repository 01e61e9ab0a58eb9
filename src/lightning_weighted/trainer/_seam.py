"""Every touch of Lightning's and the user's objects in a weighted fit, in one object, undone at ``teardown``.

A weighted strategy works through Lightning's strategy hooks wherever there is one. Where there is none,
:class:`Seam` touches another object, each touch named here with its reason (pinned by ``tests/unit/test_seam.py``):

- :data:`EPOCH_END`, the module's ``on_train_batch_start``: only its -1 ends an epoch early (the strategy's hook's
  return is ignored). The epoch ends there where every rank is out of data; a user's -1 drops the half window.
- :data:`SCHEDULERS`, the module's ``lr_scheduler_step``, the only way LR schedulers step: see ``BatchState.skipped``.
- :data:`BATCHES`, the seam, put first: the strategy's ``on_train_batch_start`` runs after the callbacks' and the
  module's, which read ``padding_step``; an evaluation batch's loader index and epoch end reach only callbacks.
- :data:`REPLAY_LOGS`, the module's ``log`` in a replayed step: a replay's logs add nothing to the epoch's values.
- :data:`METRICS`, the module's torchmetrics around a replayed step: put back after it, update count included.
- :data:`CLIP`, ``FSDPPrecision.clip_grad_by_norm``, which refuses norm clipping: FSDP1's own ``clip_grad_norm_`` clips.
- :data:`SAMPLER_WARNING`, the warnings filter: Lightning warns that its sampler repeats items; the one put in its
  place (:class:`~lightning_weighted.UnpaddedDistributedSampler`) repeats none.
- :data:`LOADERS`, each loader Lightning processes, extended for the fit (:mod:`lightning_weighted.loaders`); its
  stage is the one of the barrier Lightning names right before.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.warnings import PossibleUserWarning
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor
from torchmetrics import Metric

from lightning_weighted._compat import metric_restore, metric_snapshot
from lightning_weighted.count import TRAINER, Count, Counts, Problem, Wording
from lightning_weighted.loop import Exchange, Output, WindowLoop, read_output
from lightning_weighted.monitor import loggable
from lightning_weighted.payload import window_result
from lightning_weighted.trainer._loaders import FitLoaders
from lightning_weighted.window import Window

EPOCH_END = "LightningModule.on_train_batch_start"
SCHEDULERS = "LightningModule.lr_scheduler_step"
BATCHES = "Trainer.callbacks"
REPLAY_LOGS = "LightningModule.log"
METRICS = "torchmetrics.Metric._update_count"
CLIP = "FSDPPrecision.clip_grad_by_norm"
SAMPLER_WARNING = "warnings.filters"
LOADERS = "Strategy.barrier"

_SAMPLER_WARNING = "Using `DistributedSampler` with the dataloaders"  # the start of Lightning's message
Counted = Callable[[Output, Any], "list[Count]"]  # the training count rule: each part's count of a step and its batch


@dataclass
class BatchState:
    """What a weighted fit's hooks note of the batch in progress: one new object per batch."""

    position: int = 0  # its place in its epoch (replays follow a rank's real batches)
    replay: bool = False  # it replays a batch of a rank out of data: it counts 0, its logs and metrics leave no trace
    replays: bool = False  # its loader replays on some rank: logged values weigh each rank by its batch's realness
    loader: int = 0  # an evaluation batch's `dataloader_idx`
    ends_window: bool = False  # its backward ends the window (the Trainer runs that batch inside `optimizer_step`)
    skipped: bool = False  # the window it ended had no item (N = 0): step-interval LR schedulers do not step after it
    # counted ahead: its window's counts and N, planned again where the optimizer re-evaluates (LBFGS)
    plan: tuple[list[Counts], Sequence[float | Tensor] | Tensor] | None = None


class Seam(Callback):
    """The touches of one weighted fit (see the module docstring), itself the first callback (:data:`BATCHES`).

    It begins each batch before every other hook sees it (a train one by ``begin_train()``; a test one as validation).
    """

    def __init__(self, loaders: FitLoaders, begin_train: Callable[[], None]) -> None:
        self.loaders, self.begin_train = loaders, begin_train
        self.batch = BatchState()
        self.loop: WindowLoop | None = None
        self.module: LightningModule | None = None
        self.evaluation: EvaluationLoss | None = None
        self.weight: float | None = None  # in the step of a loader that replays: 1.0 for a real batch, 0.0 for a replay
        self._touches = contextlib.ExitStack()

    def enter(self, trainer: Trainer, module: LightningModule, loop: WindowLoop, counted: Counted) -> None:
        """Makes the fit's touches: each undone by :meth:`close`, also where a later one fails."""
        self.loop, self.module, self.evaluation = loop, module, EvaluationLoss(loop, counted)
        self._touches.enter_context(_silenced(_SAMPLER_WARNING, PossibleUserWarning))
        epoch_end = partial(self._epoch_end, module.on_train_batch_start)
        scheduler_step = partial(self._scheduler_step, trainer, module.lr_scheduler_step)
        self._touches.enter_context(patched(module, on_train_batch_start=epoch_end, lr_scheduler_step=scheduler_step))
        trainer.callbacks.insert(0, self)  # type: ignore[attr-defined]
        self._touches.callback(trainer.callbacks.remove, self)  # type: ignore[attr-defined]

    def clip_fsdp1(self, plugin: Any, clip: Callable[[Any, float | int], None]) -> None:
        """Norm clipping through FSDP1's own ``clip_grad_norm_`` (:data:`CLIP`), for the fit."""
        self._touches.enter_context(patched(plugin, clip_grad_by_norm=clip))

    def close(self) -> None:
        """Undoes every touch, the loaders' included."""
        self._touches.close()
        self.loaders.release()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """The step of the batch in progress: a replay's logs and metrics leave no trace."""
        batch, module = self.batch, self.module
        assert module is not None
        self.weight = (0.0 if batch.replay else 1.0) if batch.replays else None
        saved = [(m, metric_snapshot(m)) for m in module.modules() if isinstance(m, Metric)] if batch.replay else []
        try:
            with patched(module, log=partial(_log_nothing, module.log)) if batch.replay else contextlib.nullcontext():
                yield
        finally:
            self.weight = None
            for metric, state in saved:
                metric_restore(metric, state)

    def evaluation_step(self, step: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """An evaluation step of the batch in progress, its loss added to the epoch's (a replay's left out)."""
        assert self.evaluation is not None
        with self.step():
            output = step(*args, **kwargs)
        if not self.batch.replay and args:
            self.evaluation.add(output, args[0], self.batch.loader)
        return output

    def reduce(self, tensor: Tensor, reduce_op: Any, group: Any, fallback: Callable[..., Any]) -> Any:
        """A mean or sum over the ranks that held a real batch, where :attr:`weight` is set; else ``fallback``."""
        op = str(reduce_op).lower().rsplit(".", 1)[-1]  # "mean", "sum", or an enum's "RedOpType.SUM"
        if self.weight is None or op not in ("mean", "avg", "sum") or not dist.is_initialized():
            return fallback(tensor, group=group, reduce_op=reduce_op)
        weight = torch.full((1,), self.weight, dtype=torch.float64, device=tensor.device)
        weighted = torch.cat([tensor.detach().reshape(-1).double() * self.weight, weight])
        dist.all_reduce(weighted, group=group)
        total = weighted[:-1] if op == "sum" else weighted[:-1] / weighted[-1].clamp(min=1.0)
        return total.reshape(tensor.shape).to(tensor.dtype if tensor.is_floating_point() else torch.float64)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self.begin_train()

    def on_validation_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        loaders = self.loaders.evaluation["test" if trainer.testing else "val"]
        replays = dataloader_idx < len(loaders) and loaders[dataloader_idx].replays
        replay = replays and loaders[dataloader_idx].replay(batch_idx)
        self.batch = BatchState(batch_idx, replay, replays, loader=dataloader_idx)

    on_test_batch_start = on_validation_batch_start

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.batch = BatchState()

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.batch = BatchState()
        if self.evaluation is not None:
            self.evaluation.log("test" if trainer.testing else "val", pl_module)

    on_test_epoch_end = on_validation_epoch_end

    def _epoch_end(self, hook: Callable[[Any, int], int | None], batch: Any, batch_idx: int) -> int | None:
        assert self.loop is not None
        response = -1 if self.loaders.train.stop else hook(batch, batch_idx)
        if response == -1:  # Lightning drops the half window's gradient: so do its counts
            self.loop.drop()
            self.batch = BatchState()
        return response

    def _scheduler_step(self, trainer: Trainer, hook: Callable[[Any, Any], None], scheduler: Any, metric: Any) -> None:
        configs = trainer.lr_scheduler_configs
        if not (self.batch.skipped and any(c.scheduler is scheduler and c.interval == "step" for c in configs)):
            hook(scheduler, metric)


class EvaluationLoss:
    """The item mean over every rank of the loss each evaluation step returns (``val/loss``), counted as in training."""

    def __init__(self, loop: WindowLoop, counted: Counted) -> None:
        self.device, self.group, self.parts, self.counted = loop.device, loop.engine.group, loop.parts, counted
        self.windows: dict[int, list[Window]] = {}

    def add(self, output: Any, batch: Any, dataloader_idx: int) -> None:
        """Records what a step returned for ``batch``: nothing unless it is a loss, or a dict with one."""
        step = read_output(output)
        losses = [step.parts.get(p) if step.parts else None for p in self.parts] if self.parts else [step.loss]
        if all(loss is None for loss in losses):
            return
        windows = self.windows.setdefault(dataloader_idx, [Window() for _ in self.parts or ("",)])
        counts = self.counted(step, batch)
        problem = step.problem or (Problem.PARTS if any(loss is None for loss in losses) else None)
        if problem is not None:
            windows[0].reject(problem)
            return
        for window, count, loss in zip(windows, counts, losses, strict=True):
            assert loss is not None
            window.add(count, loss.detach(), step.item_sum)

    def log(self, stage: str, module: LightningModule) -> None:
        """Logs each loader's item-mean loss (the same on every rank); one float64 all-reduce per loader."""
        step = "validation_step" if stage == "val" else "test_step"
        wording = Wording(f"{step} returned", TRAINER.fix.replace("training_step", step))
        for index, windows in sorted(self.windows.items()):
            result = window_result(Exchange(windows, True, self.device, self.group).read(wording), 0, self.parts)
            suffix = f"/dataloader_idx_{index}" if len(self.windows) > 1 else ""
            values = {f"{stage}/loss/{p}{suffix}": r.loss for p, r in result.parts.items()}
            values[f"{stage}/loss{suffix}"] = result.loss
            for name, value in values.items():
                if value == value:  # a part without items (NaN) logs nothing; the value is global, its max exact
                    module.log(name, loggable(value, module), reduce_fx="max", sync_dist=True, batch_size=1,
                               add_dataloader_idx=False)  # fmt: skip
        self.windows = {}


@contextlib.contextmanager
def patched(target: Any, **methods: Callable[..., Any]) -> Iterator[None]:
    """Sets ``methods`` on one instance for the length of the block; its class is never touched."""
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


def _log_nothing(log: Callable[..., None], name: str, value: Any, *args: Any, **kwargs: Any) -> None:
    if not isinstance(value, Metric):  # a Metric's state is put back after the step instead
        if kwargs.get("reduce_fx", "mean") in ("sum", torch.sum):
            value = torch.zeros_like(torch.as_tensor(value))  # the dtype the real ranks log
        else:
            kwargs["batch_size"] = 0
    log(name, value, *args, **kwargs)


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
