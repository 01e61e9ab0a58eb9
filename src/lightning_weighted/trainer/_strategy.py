"""What every weighted Trainer strategy adds to its Lightning strategy: each hook is one call into the loop."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_weighted._compat import fetched_batch, train_batch_idx, train_progress, unfloored
from lightning_weighted.count import TRAINER, Count, Problem, Wording, host_items
from lightning_weighted.counter import ItemCounter
from lightning_weighted.engines import Engine
from lightning_weighted.loaders import Policy
from lightning_weighted.loop import Output, WindowLoop, read_output
from lightning_weighted.strategy import WeightedStrategy
from lightning_weighted.trainer._loaders import FitLoaders
from lightning_weighted.trainer._seam import BatchState, Seam

_TRANSFER_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")


class WeightedTrainerStrategy(WeightedStrategy, ParallelStrategy):
    """The hooks of a weighted Trainer strategy, each a call into one :class:`~lightning_weighted.loop.WindowLoop`.

    The contract of ``training_step``, the rules and the errors: ``docs/how_it_works.md``. Put before a Lightning
    strategy, with :meth:`_make_engine`; what the fit touches beyond its hooks: :mod:`lightning_weighted.trainer._seam`.
    """

    strategy_name: str

    def __init__(self, *args: Any, participation: Policy = "pad", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._loaders = FitLoaders(participation)
        self._windows = TrainWindows(self._loaders)
        self._loop: WindowLoop | None = None
        self.item_counter: ItemCounter | None = None  # counts a batch `training_step` gives no count (None: its size)
        self._implicit_noted = self._fetches_itself = False

    def _make_engine(self) -> Engine:
        """The engine this strategy drives, once its model is set up."""
        raise NotImplementedError

    @property
    def counts_ahead(self) -> bool:
        """Whether this fit takes each window's counts from its batches ahead."""
        return self._windows.ahead

    @property
    @override
    def padding_step(self) -> bool:
        return self._windows.seam.batch.replay

    @override
    def setup(self, trainer: Trainer) -> None:
        counter, self._fetches_itself, wording = _rules(trainer, self.strategy_name)
        self.item_counter = counter
        self._loaders.device, self._loaders.trainer = self.root_device, trainer
        self._loaders.count = None if counter is None else (lambda batch: counter.counts(batch, host=True))
        super().setup(trainer)
        parts = counter.names if counter is not None else ()
        self._loop = WindowLoop(self._make_engine(), self.root_device, wording, parts)
        self._windows.seam.enter(trainer, trainer.lightning_module, self._loop, self.counts_of)

    @override
    def teardown(self) -> None:
        self._windows.seam.close()  # the loop stays: its results are read after the fit (`on_fit_end`)
        super().teardown()

    @override
    def barrier(self, name: str | None = None) -> None:
        self._loaders.at_barrier(name)
        super().barrier(name)  # type: ignore[safe-super]  # the engine's strategy, next in the MRO

    @override
    def process_dataloader(self, dataloader: object) -> object:
        return self._loaders.process(dataloader)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        assert self.lightning_module is not None
        trainer = self._windows.trainer = self.lightning_module.trainer
        ahead = self._windows.ahead = self._loaders.counts_ahead(trainer.train_dataloader)
        if self.item_counter is not None and self.item_counter.names and not ahead:
            raise ValueError(_PARTS_AFTER.format(list(self.item_counter.names)))

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        loop, module, state = self._loop, self.lightning_module, self._windows.seam.batch
        assert loop is not None and module is not None
        with self._windows.seam.step():
            output = super().training_step(*args, **kwargs)
        batch = fetched_batch(module.trainer) if self._fetches_itself else args[0]
        step = read_output(output)
        if self._windows.ahead:
            counter = self.item_counter if loop.wording.hooks and not state.replay else None
            loop.add(step, state.replay, counter.counts(batch) if counter is not None else None)
        else:
            counts = [] if state.replay else self.counts_of(step, batch)
            loop.add(replace(step, count=counts[0]) if counts else step, state.replay)
        if step.loss is None and step.parts is None:
            return {"loss": loop.refused(None)}  # Lightning proceeds; every rank raises at the window's end
        if step.loss is None and step.parts is not None and isinstance(output, Mapping):
            return {**output, "loss": torch.stack(list(step.parts.values())).sum()}  # what the parts train
        return output

    def counts_of(self, step: Output, batch: Any) -> list[Count]:
        """The count rule: a ``"count"`` returned, else each part's by ``ItemCounter``, else the batch size."""
        if step.count is not None:
            return [step.count]
        if self.item_counter is not None:
            return self.item_counter.counts(batch, combined=self._loaders.combined).each()
        if self._loaders.combined:
            return [Count(math.nan, Problem.AMBIGUOUS)]
        if not self._implicit_noted:
            self._implicit_noted = True
            rank_zero_info(_IMPLICIT.format(self.strategy_name))
        return [Count(float(extract_batch_size(batch)))]

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._windows.seam.evaluation_step(super().validation_step, args, kwargs)  # type: ignore[no-any-return]

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._windows.seam.evaluation_step(super().test_step, args, kwargs)  # type: ignore[no-any-return]

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        loop, trainer = self._loop, self._windows.trainer
        assert loop is not None and trainer is not None
        # Lightning divided the loss by `accumulate_grad_batches`: undone, the microbatch is weighted instead.
        loss = loop.backward_loss(closure_loss, trainer.accumulate_grad_batches)
        if self._windows.seam.batch.ends_window:
            loop.end(*self._windows.facts())  # the exchange overlaps the window's last backward
        try:
            return super().backward(loss, optimizer, *args, **kwargs)
        finally:
            loop.engine.after_backward()

    @override
    def optimizer_step(
        self, optimizer: Optimizer, closure: Callable[[], Any], model: LightningModule | Module | None = None, **kw: Any
    ) -> Any:
        # a window without items steps no optimizer (nor its hooks, nor clipping); LBFGS runs the closure itself
        windows = self._windows
        if isinstance(optimizer, torch.optim.LBFGS):
            return super().optimizer_step(optimizer, lambda: windows.last_batch(closure), model, **kw)
        result = windows.last_batch(closure)
        if windows.seam.batch.skipped:
            return None
        return super().optimizer_step(optimizer, lambda: result, model, **kw)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        if not isinstance(tensor, Tensor):
            return tensor
        reduce = super().reduce  # type: ignore[safe-super]
        return self._windows.seam.reduce(unfloored(tensor, reduce_op), reduce_op, group, reduce)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if self.lightning_module is not None:  # a fit's: its train loader's places
            trainer = self.lightning_module.trainer
            self._loaders.save(checkpoint, train_progress(trainer), trainer.current_epoch)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint: dict[str, Any] = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._loaders.load(checkpoint)
        return checkpoint


class TrainWindows:
    """A fit's train windows: where each batch begins (its place, its replay, its window's plan) and each ends."""

    def __init__(self, loaders: FitLoaders) -> None:
        self.loaders, self.seam = loaders, Seam(loaders, self.begin)
        self.trainer: Trainer | None = None  # set as the fit starts training
        self.ahead = False  # each window's counts are taken from its batches ahead
        self._first = (0, 0)  # the pass in progress, and its first `batch_idx`
        self._next: tuple[int, int, list[float] | None] | None = None  # counted ahead: the next window's pass, size, N

    def begin(self) -> None:
        """Begins a train batch, before the callbacks' and the module's hooks see it."""
        loop, trainer = self.seam.loop, self.trainer
        assert loop is not None and trainer is not None
        # Lightning's `batch_idx` is one fetch late under `dataloader_iter`; its epoch loop's own index never is
        index = train_batch_idx(trainer)
        stage, train, position = self.loaders.stage, self.loaders.train, index
        if stage is not None:  # a pass counts from where it started, whatever `batch_idx` Lightning starts from
            if self._first[0] != stage.passes:
                self._first = (stage.passes, index)
            position = stage.current.start + index - self._first[1]
        state = self.seam.batch = BatchState(position, train.replay(position), train.replays)
        if self.ahead and not loop.open:
            assert stage is not None
            counts = stage.take(_window_size(trainer, index))
            planned, self._next, size = self._next, None, len(counts)
            totals = planned[2] if planned is not None and planned[:2] == (stage.passes, size) and size else None
            state.plan = (counts, loop.plan(counts, totals))

    def facts(self) -> tuple[bool, list[float]]:
        """Whether this rank holds real batches after the window, and counted ahead its items of the next one."""
        assert self.trainer is not None
        more, stage = self.loaders.train.has_more(self.seam.batch.position), self.loaders.stage
        if not self.ahead:
            return more, []
        assert stage is not None
        size = _window_size(self.trainer, train_batch_idx(self.trainer) + 1)
        counts = stage.peek(size) if size > 0 else []
        self._next = (stage.passes, len(counts), None)
        return more, host_items(counts) if counts else []

    def last_batch(self, closure: Callable[[], Any]) -> Any:
        """Runs Lightning's closure (the window's last step and backward; again under LBFGS), then ends the window."""
        loop, state, trainer = self.seam.loop, self.seam.batch, self.trainer
        assert loop is not None and trainer is not None
        if state.ends_window and state.plan is not None:
            loop.plan(*state.plan)
        state.ends_window = True
        returned = closure()
        skipped = loop.skipped_steps
        result = loop.finish(trainer.global_step, *self.facts())
        self.loaders.train.after_window(loop.ranks_with_more, state.position, loop.engine.group, loop.device)
        if self.ahead and self._next is not None and self._next[1]:  # its exchange brought the next window's N
            self._next = (*self._next[:2], loop.next_totals)
        if loop.skipped_steps > skipped:
            state.skipped = True
            rank_zero_warn(f"The global item count of the window ending at step {result.step} is 0: {_SKIPPED}")
        return returned


def _rules(trainer: Trainer, name: str) -> tuple[ItemCounter | None, bool, Wording]:
    """Refuses what cannot be weighted; else the ``ItemCounter``, whether ``training_step`` fetches, the wording."""
    module = trainer.lightning_module
    if not module.automatic_optimization:
        raise MisconfigurationException(_MANUAL.format(type(module).__name__, name))
    counter = next((c for c in trainer.callbacks if isinstance(c, ItemCounter)), None)  # type: ignore[attr-defined]
    fetches_itself = is_param_in_hook_signature(module.training_step, "dataloader_iter", explicit=True)
    if counter is not None and fetches_itself:
        raise ValueError(_ITERATOR.format(type(module).__name__))
    if fetches_itself and accumulates(trainer):
        raise ValueError(_ITERATOR_ACCUMULATES.format(type(module).__name__))
    owners = (module, getattr(trainer, "datamodule", None))  # hooks that may change a batch on its way to the step
    hooks = dict.fromkeys(h for h in _TRANSFER_HOOKS for m in owners if m is not None and is_overridden(h, m))
    return counter, fetches_itself, Wording(TRAINER.source, TRAINER.fix, " and ".join(f"`{h}`" for h in hooks), name)


def accumulates(trainer: Trainer) -> bool:
    """Whether the fit accumulates gradients over several batches (now, or in an epoch a scheduler names)."""
    schedules = [c.scheduling for c in trainer.callbacks if isinstance(c, GradientAccumulationScheduler)]  # type: ignore[attr-defined]
    return trainer.accumulate_grad_batches > 1 or any(a > 1 for schedule in schedules for a in schedule.values())


def _window_size(trainer: Trainer, batch_idx: int) -> int:
    """How many batches Lightning accumulates into the window that would start at ``batch_idx``."""
    accumulate = trainer.accumulate_grad_batches
    return int(max(0, min(accumulate - batch_idx % accumulate, trainer.num_training_batches - batch_idx)))


_PARTS_AFTER = (
    "ItemCounter counts the loss parts {}, each averaged over its own count, which must be known before the window's"
    " backward; but the train batches combine several dataloaders and cannot be counted ahead. Keep one train"
    " dataloader, or one loss part."
)
_SKIPPED = "the optimizer and step-interval LR schedulers were not stepped."
_MANUAL = (
    "{} uses manual optimization (`automatic_optimization=False`), which {} does not weight. Use automatic"
    " optimization, or a plain strategy and scale the loss yourself."
)
_ITERATOR = (
    "ItemCounter counts the batches Lightning hands training_step, but {}.training_step takes `dataloader_iter` and"
    " fetches its own. Return each step's count instead, `{{'loss': loss, 'count': n}}`, and drop ItemCounter; or"
    " take `(batch, batch_idx)`."
)
_ITERATOR_ACCUMULATES = (
    "{}.training_step takes `dataloader_iter`, under which Lightning hands its optimization loop `batch_idx` one"
    " fetch late, so it zeroes the gradients accumulated in a window one microbatch late and loses some of them"
    " (under any strategy). Use accumulate_grad_batches=1, or take `(batch, batch_idx)`."
)
_IMPLICIT = (
    "{}: training_step gave no count, so each microbatch counts its examples (the batch size). If the loss is a mean"
    " over tokens (a Hugging Face model's `out.loss` is), count them: return `{{'loss': loss, 'count':"
    " n_valid_tokens}}` or add `ItemCounter('tokens', key='labels', shift=True)`; counting by batch size trains like"
    " plain DDP. `ItemCounter('examples')` keeps examples and silences this."
)
