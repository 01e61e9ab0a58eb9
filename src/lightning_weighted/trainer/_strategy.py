"""What every weighted Trainer strategy adds to its Lightning strategy: each hook is one call into the loop."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.fabric.utilities.warnings import PossibleUserWarning
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_weighted._compat import patched, silenced
from lightning_weighted.counting import ItemCounter
from lightning_weighted.counts import TRAINER
from lightning_weighted.data import Lookahead, Policy, Replicas
from lightning_weighted.engines import Engine
from lightning_weighted.loop import Planner, WindowLoop
from lightning_weighted.trainer._evaluation import EvaluationLoss
from lightning_weighted.trainer._loaders import FitLoaders
from lightning_weighted.trainer._replays import Replays
from lightning_weighted.window import WindowResult

__all__ = ["WeightedTrainerStrategy"]


class WeightedTrainerStrategy(ParallelStrategy):
    """The hooks of a weighted Trainer strategy, each a call into one :class:`~lightning_weighted.loop.WindowLoop`.

    A strategy puts it before its Lightning strategy (``class S(WeightedTrainerStrategy, DDPStrategy)``) and says
    which engine it drives in :meth:`_make_engine`. Counts are taken ahead where an
    :class:`~lightning_weighted.ItemCounter` counts the batches of one train dataloader that ``training_step`` does
    not fetch itself; else after the forward (see :mod:`lightning_weighted.loop`).

    Attributes:
        skipped_steps: windows whose global ``N`` was 0 (no optimizer or step-interval scheduler step).
        padding_step: the batch in progress is a replay of a rank whose data ran out (it counts for nothing).
        last_window: the result of the last optimizer step's window.
        counts_ahead: whether this fit takes each window's counts from its batches ahead.
    """

    strategy_name: str

    def __init__(self, *args: Any, participation: Policy = "pad", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._policy: Policy = participation
        self._loaders = FitLoaders(participation, torch.device("cpu"))  # its device once the strategy's is known
        self._loop: WindowLoop | None = None
        self._engine: Engine | None = None
        self._counter: ItemCounter | None = None
        self._replays = Replays()
        self._evaluation: EvaluationLoss | None = None
        self._replaying = False  # the batch in progress (of any stage) is a replay
        self._stage_replays = False  # the loader of the batch in progress replays
        self._dataloader_idx = 0  # of the evaluation batch in progress
        self._ends_window = False  # inside `optimizer_step`: the next backward ends the window
        self._backward_ran = False
        self._skip_schedulers = False
        self._implicit_noted = False
        self._patches = contextlib.ExitStack()

    def _make_engine(self) -> Engine:
        """The engine this strategy drives, once its model is set up."""
        raise NotImplementedError

    @property
    def skipped_steps(self) -> int:
        return self._loop.skipped_steps if self._loop is not None else 0

    @property
    def padding_step(self) -> bool:
        return self._replaying

    @property
    def last_window(self) -> WindowResult | None:
        return self._loop.last_window if self._loop is not None else None

    @property
    def counts_ahead(self) -> bool:
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
            raise MisconfigurationException(
                f"{type(module).__name__} uses manual optimization (`automatic_optimization=False`), which"
                f" {self.strategy_name} does not weight. Use automatic optimization, or a plain strategy and scale"
                " the loss yourself."
            )
        self._counter = next((c for c in trainer.callbacks if isinstance(c, ItemCounter)), None)  # type: ignore[attr-defined]
        self._loaders.device = self.root_device
        fetches_itself = is_param_in_hook_signature(module.training_step, "dataloader_iter", explicit=True)
        if self._counter is not None and not fetches_itself:
            counter = self._counter
            count = lambda batch: (counter.count_of(batch), counter.integer)  # noqa: E731
            self._loaders.lookahead = Lookahead(count, self._loaders.train)
        super().setup(trainer)
        self._engine = self._make_engine()
        self._evaluation = EvaluationLoss(self.root_device, self._engine.group)
        # Lightning's warning that its DistributedSampler repeats items: the one it inserts here repeats none
        self._patches.enter_context(silenced("Using `DistributedSampler` with the dataloaders", PossibleUserWarning))
        self._patches.enter_context(patched(module, **self._module_hooks(trainer, module)))

    @override
    def teardown(self) -> None:
        self._patches.close()
        self._loaders.release()  # the loop stays: its results are read after the fit (`on_fit_end`)
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
        assert self._engine is not None
        loop = self._loop = WindowLoop(self._engine, self.root_device, TRAINER, self.strategy_name)
        loop.participation = self._loaders.train
        lookahead = self._loaders.lookahead
        if lookahead is not None and self._loaders.alone(trainer.train_dataloader):
            group, divisor = self._engine.group, self._engine.divisor
            loop.planner = Planner(lookahead, self._window_size, divisor, group, self.root_device)
        elif lookahead is not None and self._loaders.train_loaders:
            self._loaders.retract(self._loaders.train_loaders[0])  # a combined batch is whole only once combined

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        self._skip_schedulers = False
        assert self._loop is not None and self.lightning_module is not None
        with self._replays.step(self.lightning_module, self._stage_replays, self._replaying):
            output = super().training_step(*args, **kwargs)
        counter = None if self._loop.counts_ahead else self._counter
        output = self._loop.add_output(output, args[0], extract_batch_size, counter)
        self._note_implicit(output, counter)
        return output  # type: ignore[no-any-return]

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._evaluation_step(super().validation_step, args, kwargs)  # type: ignore[no-any-return]

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._evaluation_step(super().test_step, args, kwargs)  # type: ignore[no-any-return]

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        loop = self._loop
        assert loop is not None and self.lightning_module is not None
        # Lightning divided the loss by `accumulate_grad_batches`: undone, the microbatch is weighted instead.
        loss = loop.scaled(closure_loss, self.lightning_module.trainer.accumulate_grad_batches)
        if self._ends_window:
            loop.end()
        self._backward_ran = True
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
            self._ends_window = True
            try:
                result = closure()
            finally:
                self._ends_window = False
            assert self._loop is not None and self.lightning_module is not None
            ran, self._backward_ran = self._backward_ran, False
            window = self._loop.finish(self.lightning_module.trainer.global_step, backward=ran)
            self._skip_schedulers = ran and window.items == 0
            return result

        return super().optimizer_step(optimizer, closure_then_finish_window, model, **kw)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        # Lightning's logging mean-reduces its integer batch-size sums, and an integer mean floors (7 items on 2
        # ranks: 3): the mean of an integer tensor is taken in float64 (Lightning issue #21859).
        if not isinstance(tensor, Tensor):
            return tensor
        if not tensor.is_floating_point() and str(reduce_op).lower() in ("mean", "avg"):
            tensor = tensor.double()
        return self._replays.reduce(tensor, reduce_op, group, super().reduce)  # type: ignore[safe-super]

    def _evaluation_step(self, step: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        assert self.lightning_module is not None and self._evaluation is not None
        with self._replays.step(self.lightning_module, self._stage_replays, self._replaying):
            output = step(*args, **kwargs)
        if not self._replaying and args:
            self._evaluation.add(output, args[0], self._dataloader_idx, self._counter)
        return output

    def _window_size(self, batch_idx: int) -> int:
        """How many batches Lightning accumulates into the window that would start at ``batch_idx``."""
        trainer = self.lightning_module.trainer  # type: ignore[union-attr]
        accumulate = trainer.accumulate_grad_batches
        return int(max(0, min(accumulate - batch_idx % accumulate, trainer.num_training_batches - batch_idx)))

    def _note_implicit(self, output: Any, counter: ItemCounter | None) -> None:
        if self._implicit_noted or counter is not None or self.counts_ahead:
            return
        if isinstance(output, dict) and "count" in output:
            return
        self._implicit_noted = True
        rank_zero_info(
            f"{self.strategy_name}: training_step gave no count, so each microbatch counts its examples (the"
            " batch size). If the loss is a mean over tokens (a Hugging Face model's `out.loss` is), count"
            " them: return `{'loss': loss, 'count': n_valid_tokens}` or add"
            " `ItemCounter('tokens', key='labels', shift=True)`; counting by batch size trains like plain DDP."
            " `ItemCounter('examples')` keeps examples and silences this."
        )

    def _module_hooks(self, trainer: Trainer, module: LightningModule) -> dict[str, Callable[..., Any]]:
        """The module hooks the strategy runs before the module's own: no strategy hook sits where they do."""
        batch_start, scheduler_step = module.on_train_batch_start, module.lr_scheduler_step

        def on_train_batch_start(batch: Any, batch_idx: int) -> int | None:
            # Runs before the strategy's own hook and the training step: the place to end the epoch.
            if self._loaders.train.stop:
                return -1  # every rank is out of data: Lightning ends the epoch here, on every rank
            assert self._loop is not None
            self._loop.begin_batch(batch_idx)
            self._replaying, self._stage_replays = self._loop.padding_step, self._loaders.train.replays
            return batch_start(batch, batch_idx)

        def lr_scheduler_step(scheduler: Any, metric: Any) -> None:
            configs = trainer.lr_scheduler_configs
            if self._skip_schedulers and any(c.scheduler is scheduler and c.interval == "step" for c in configs):
                return
            scheduler_step(scheduler, metric)

        def evaluation_batch_start(stage: str, hook: Callable[..., Any]) -> Callable[..., Any]:
            def on_batch_start(batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
                loaders = self._loaders.evaluation[stage]
                participation = loaders[dataloader_idx] if dataloader_idx < len(loaders) else None
                self._replaying = participation is not None and participation.begin_batch(batch_idx)
                self._dataloader_idx = dataloader_idx
                self._stage_replays = participation is not None and participation.replays
                return hook(batch, batch_idx, dataloader_idx)

            return on_batch_start

        def epoch_end(stage: str, hook: Callable[[], Any]) -> Callable[[], Any]:
            def on_epoch_end() -> Any:
                result = hook()
                self._replaying = False
                if stage != "train" and self._evaluation is not None:
                    self._evaluation.log(stage, module)
                return result

            return on_epoch_end

        return {
            "on_train_batch_start": on_train_batch_start,
            "lr_scheduler_step": lr_scheduler_step,
            "on_validation_batch_start": evaluation_batch_start("val", module.on_validation_batch_start),
            "on_test_batch_start": evaluation_batch_start("test", module.on_test_batch_start),
            "on_train_epoch_end": epoch_end("train", module.on_train_epoch_end),
            "on_validation_epoch_end": epoch_end("val", module.on_validation_epoch_end),
            "on_test_epoch_end": epoch_end("test", module.on_test_epoch_end),
        }
