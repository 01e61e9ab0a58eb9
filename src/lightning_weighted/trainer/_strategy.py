"""What every weighted Trainer strategy adds to its Lightning strategy: each hook is one call into the loop."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_weighted._compat import fetched_batch, unfloored
from lightning_weighted.ahead import Lookahead, Planner
from lightning_weighted.counting import ItemCounter
from lightning_weighted.counts import TRAINER, aux_terms, count_rule, returned_count, split_output
from lightning_weighted.data import Policy, Replicas
from lightning_weighted.engines import Engine
from lightning_weighted.loop import LoopResults, WindowLoop
from lightning_weighted.trainer._evaluation import EvaluationLoss
from lightning_weighted.trainer._loaders import FitLoaders
from lightning_weighted.trainer._seam import Seam

__all__ = ["WeightedTrainerStrategy"]


class WeightedTrainerStrategy(LoopResults, ParallelStrategy):
    """The hooks of a weighted Trainer strategy, each a call into one :class:`~lightning_weighted.loop.WindowLoop`.

    A strategy puts it before its Lightning strategy (``class S(WeightedTrainerStrategy, DDPStrategy)``) and says
    which engine it drives in :meth:`_make_engine`. Counts are taken ahead where an
    :class:`~lightning_weighted.ItemCounter` counts the batches of one train dataloader that ``training_step`` does
    not fetch itself; else after the forward (see :mod:`lightning_weighted.loop`). What the fit touches beyond the
    strategy's own hooks is in :mod:`lightning_weighted.trainer._seam`.

    A window whose global ``N`` is 0 steps neither the optimizer nor step-interval LR schedulers
    (``skipped_steps``); ``last_window`` is the result of the last optimizer step's window.
    """

    strategy_name: str

    def __init__(self, *args: Any, participation: Policy = "pad", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._loaders = FitLoaders(participation, torch.device("cpu"))  # its device once the strategy's is known
        self._seam = Seam(self._loaders)
        self._loop: WindowLoop | None = None
        self._counter: ItemCounter | None = None
        self._implicit_noted = self._fetches_itself = False

    def _make_engine(self) -> Engine:
        """The engine this strategy drives, once its model is set up."""
        raise NotImplementedError

    @property
    def item_counter(self) -> ItemCounter | None:
        """How this fit counts a batch where ``training_step`` returns no count (``None``: the batch size)."""
        return self._counter

    @property
    def counts_ahead(self) -> bool:
        """Whether this fit takes each window's counts from its batches ahead."""
        return self._loop is not None and self._loop.counts_ahead

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = dict(super().distributed_sampler_kwargs)
        kwargs["num_replicas"] = Replicas(kwargs["num_replicas"])  # marks the sampler Lightning inserts
        return kwargs

    @override
    def setup(self, trainer: Trainer) -> None:
        module = trainer.lightning_module
        if not module.automatic_optimization:
            raise MisconfigurationException(_MANUAL.format(type(module).__name__, self.strategy_name))
        self._counter = next((c for c in trainer.callbacks if isinstance(c, ItemCounter)), None)  # type: ignore[attr-defined]
        self._loaders.device = self.root_device
        self._fetches_itself = is_param_in_hook_signature(module.training_step, "dataloader_iter", explicit=True)
        if self._counter is not None and self._fetches_itself:
            raise ValueError(_ITERATOR.format(type(module).__name__))
        if self._fetches_itself and _accumulates(trainer):
            raise ValueError(_ITERATOR_ACCUMULATES.format(type(module).__name__))
        if self._counter is not None:
            self._loaders.lookahead = Lookahead(self._counter.count_of, self._counter.integer, self._loaders.train)
        self._loaders.fit_loop = trainer.fit_loop
        super().setup(trainer)
        engine = self._make_engine()
        self._loop = WindowLoop(engine, self.root_device, TRAINER, self.strategy_name)
        self._seam.enter(trainer, module, self._loop, EvaluationLoss(self.root_device, engine.group))

    @override
    def teardown(self) -> None:
        self._seam.close()  # the loop stays: its results are read after the fit (`on_fit_end`)
        super().teardown()

    @override
    def barrier(self, name: str | None = None) -> None:
        self._loaders.at_barrier(name)
        super().barrier(name)  # type: ignore[safe-super]  # the engine's strategy, next in the MRO

    @override
    def process_dataloader(self, dataloader: object) -> object:
        return self._loaders.process(dataloader, self.counts_ahead)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer  # type: ignore[union-attr]
        loop, lookahead = self._require_loop(), self._loaders.lookahead
        loop.participation = self._loaders.train
        if lookahead is not None and self._loaders.alone(trainer.train_dataloader):
            loop.planner = Planner(lookahead, _window_size(trainer))
        elif lookahead is not None and self._loaders.train_loaders:
            self._loaders.retract(self._loaders.train_loaders[0])  # a combined batch is whole only once combined

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        loop = self._require_loop()
        if not loop.batch.dropped:
            # Lightning hands `batch_idx` one fetch late where `training_step` takes `dataloader_iter`, while its
            # epoch loop's own index counts this batch in both modes
            index = self.lightning_module.trainer.fit_loop.epoch_loop.batch_idx  # type: ignore[union-attr]
            loop.begin_batch(index, self._loaders.train.replays)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        loop, module = self._require_loop(), self.lightning_module
        assert module is not None
        with self._seam.step(module, loop.batch):
            output = super().training_step(*args, **kwargs)
        # a step taking `dataloader_iter` counts the batch it fetched: the iterator itself is never touched
        batch = fetched_batch(module.trainer) if self._fetches_itself else args[0]
        loss, item_sum, problem = split_output(output)
        aux, aux_problem = aux_terms(output)
        if loss is None and not loop.batch.replay:
            loop.add(None, None, False)
            return {"loss": loop.refused(None)}  # Lightning proceeds; every rank raises at the window's end
        if loop.counts_ahead:  # the planned count stands; a returned one must agree
            count = returned_count(output)
        else:
            count = count_rule(output, batch, extract_batch_size, self._counter)
            if count.implicit and not self._implicit_noted:
                self._implicit_noted = True
                rank_zero_info(_IMPLICIT.format(self.strategy_name))
        loop.add(loss, count, item_sum, problem or aux_problem, aux)
        return output

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._evaluation_step(super().validation_step, args, kwargs)  # type: ignore[no-any-return]

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._evaluation_step(super().test_step, args, kwargs)  # type: ignore[no-any-return]

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        loop = self._require_loop()
        assert self.lightning_module is not None
        # Lightning divided the loss by `accumulate_grad_batches`: undone, the microbatch is weighted instead.
        loss = loop.backward_loss(closure_loss, self.lightning_module.trainer.accumulate_grad_batches)
        try:
            return super().backward(loss, optimizer, *args, **kwargs)
        finally:
            loop.engine.after_backward()

    @override
    def optimizer_step(
        self, optimizer: Optimizer, closure: Callable[[], Any], model: LightningModule | Module | None = None, **kw: Any
    ) -> Any:
        # Lightning runs the window's last training step and backward inside this closure, and clips after it.
        def closure_then_finish_window() -> Any:
            loop = self._require_loop()
            loop.batch.ends_window = True
            result = closure()
            loop.finish(self.lightning_module.trainer.global_step)  # type: ignore[union-attr]
            return result

        return super().optimizer_step(optimizer, closure_then_finish_window, model, **kw)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        if not isinstance(tensor, Tensor):
            return tensor
        reduce = super().reduce  # type: ignore[safe-super]
        return self._seam.reduce(unfloored(tensor, reduce_op), reduce_op, group, reduce)

    def _evaluation_step(self, step: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        loop, module, evaluation = self._require_loop(), self.lightning_module, self._seam.evaluation
        assert module is not None and evaluation is not None
        with self._seam.step(module, loop.batch):
            output = step(*args, **kwargs)
        if not loop.batch.replay and args:
            evaluation.add(output, args[0], loop.batch.loader, self._counter)
        return output

    def _require_loop(self) -> WindowLoop:
        assert self._loop is not None, "the loop of windows is made at setup"
        return self._loop


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


def _window_size(trainer: Trainer) -> Callable[[int], int]:
    """How many batches Lightning accumulates into the window that would start at a given ``batch_idx``."""

    def size_at(batch_idx: int) -> int:
        accumulate = trainer.accumulate_grad_batches
        return int(max(0, min(accumulate - batch_idx % accumulate, trainer.num_training_batches - batch_idx)))

    return size_at


def _accumulates(trainer: Trainer) -> bool:
    """Whether the fit accumulates gradients over several batches (now, or in an epoch a scheduler names)."""
    schedules = [c.scheduling for c in trainer.callbacks if isinstance(c, GradientAccumulationScheduler)]  # type: ignore[attr-defined]
    return trainer.accumulate_grad_batches > 1 or any(a > 1 for schedule in schedules for a in schedule.values())
