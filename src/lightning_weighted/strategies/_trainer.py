"""The window rules wired into Lightning's training loop, shared by every weighted Trainer strategy."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_weighted._counts import (
    Count,
    CountPayload,
    CountProblem,
    Slot,
    agreed,
    count_of,
    read_count,
    split_output,
)
from lightning_weighted._patch import patched
from lightning_weighted.lookahead import BatchCounter
from lightning_weighted.participation import Participation, Policy
from lightning_weighted.reduce.counts import start_sum, sum_counts
from lightning_weighted.strategies._ahead import WindowsAhead
from lightning_weighted.strategies._loaders import LOADER_BARRIERS, FitLoaders
from lightning_weighted.strategies._zero import zero_loss
from lightning_weighted.window import LossScale, Window, WindowResult

__all__ = ["LOADER_BARRIERS", "TrainerAdapter"]


class TrainerAdapter(ParallelStrategy):
    """Reads each microbatch's count, scales its loss, ends its window, and keeps uneven ranks stepping.

    Subclasses put it before their Lightning strategy (``class S(TrainerAdapter, DDPStrategy)``) and say how
    the window's counts meet their gradients: :meth:`_loss_scale`, :meth:`_start_sync` (before the backward that
    ends a window), :meth:`_summed_counts` (after it), and optionally :meth:`_normalize`, :meth:`_zero_loss` and
    :meth:`_count_group` (the ranks whose counts are summed, when not all of them).

    Counts ahead: where a :class:`~lightning_weighted.lookahead.BatchCounter` (``ItemCounter``) counts the batches
    and the engine's reduction, left as it is, divides the SUM of the gradients by a known number (:meth:`_divisor`),
    every window is planned before its first forward and its losses scaled by that number times ``n / N``
    (``LossScale.GLOBAL_MEAN``, see ``_ahead.py``); the engine then only carries each window's handover
    (:meth:`_hand_over`, :meth:`_handed_over`).
    """

    strategy_name: str

    def __init__(self, *args: Any, participation: Policy = "pad", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.skipped_steps = 0
        self.padding_step = False
        self.last_window: WindowResult | None = None
        self.counts_ahead = False  # whether this fit takes each window's counts from its batches ahead
        self._participation = Participation(participation)
        self._loaders = FitLoaders(self._participation)
        self._ahead: WindowsAhead | None = None  # where counts ahead are possible
        self._window: Window | None = None
        self._factor: float | Tensor = 0.0  # the current microbatch's loss multiplier
        self._supplied: tuple[object, bool] | None = None  # the next microbatch's count, from `ItemCounter`
        self._ends_window = False  # inside `optimizer_step`: the next backward ends the window
        self._batch_idx = 0
        self._skip_schedulers = False
        self._handover: tuple[Tensor, Any] | None = None  # a handover's SUM in flight (the default carriage)
        self._said: set[str] = set()  # notices already given
        self._patches = contextlib.ExitStack()

    # ------------------------------------------------------------------------------------------- engine hooks
    def _loss_scale(self) -> LossScale:
        """What microbatch losses are scaled to where counts ride; read once per window."""
        return LossScale.ITEM_SUM

    def _start_sync(self, payload: CountPayload, reference: float) -> None:
        """Hands the window's payload to the reduction; runs right before the backward that ends the window."""
        raise NotImplementedError

    def _summed_counts(self) -> list[float]:
        """The SUM of every rank's payload, on the host; runs after the backward that ends the window."""
        raise NotImplementedError

    def _normalize(self, items: float) -> None:
        """Brings ``N`` to gradients the reduction left as item sums; nothing where the reduction did it.

        Not called where the counts were taken ahead: the losses were scaled by ``N`` before their backward.
        """

    def _zero_loss(self, loss: Tensor | None) -> Tensor:
        """An exact zero standing for ``loss``, whose own mean may be NaN (0/0 over a fully masked microbatch)."""
        assert self.lightning_module is not None
        return zero_loss(loss, self.lightning_module)

    def _count_group(self) -> dist.ProcessGroup | None:
        """The group a window's counts are summed over: the ranks that see different data (``None``: all)."""
        return None

    def _divisor(self) -> int | None:
        """What the engine's reduction, left without a hook, divides the SUM of the gradients by.

        The number of counting ranks where it averages, 1 where it sums; ``None`` where it does neither, and counts
        are never taken ahead.
        """
        return None

    def _choose(self, ahead: bool) -> None:
        """Sets the engine up for counts ahead or not; runs once training starts, the same on every rank."""

    def _hand_over(self, handover: list[float], fill: Callable[[Tensor], None]) -> None:
        """Starts the SUM of this rank's handover right before the backward that ends a window (counts ahead).

        ``fill`` adds this rank's share of the loss to the handover's loss slot, on the device. By default one
        float64 all-reduce over the counting ranks.
        """
        self._handover = self._start_sum(handover, fill)

    def _handed_over(self, also: Tensor | None = None) -> list[float]:
        """The SUM of every rank's handover after the backward that ends the window, on the host (one read).

        ``also``, a 0-dim tensor on the device, is read along and appended.
        """
        assert self._handover is not None
        (summed, work), self._handover = self._handover, None
        work.wait()
        values: list[float] = (summed if also is None else torch.cat([summed, also.double().reshape(1)])).tolist()
        return values

    # ------------------------------------------------------------------------------------------- Lightning hooks
    @override
    def setup(self, trainer: Trainer) -> None:
        module = trainer.lightning_module
        if not module.automatic_optimization:
            raise MisconfigurationException(
                f"{type(module).__name__} uses manual optimization (`automatic_optimization=False`), which"
                f" {self.strategy_name} does not weight. Use automatic optimization, or a plain strategy and scale"
                " the loss yourself."
            )
        counter = next((c for c in trainer.callbacks if isinstance(c, BatchCounter)), None)  # type: ignore[attr-defined]
        fetches_itself = is_param_in_hook_signature(module.training_step, "dataloader_iter", explicit=True)
        divisor = self._divisor()
        if counter is not None and divisor is not None and not fetches_itself:
            self._ahead = WindowsAhead(counter, self._participation, divisor, self._window_size, self._start_sum)
            self._loaders.lookahead = self._ahead.lookahead
        super().setup(trainer)
        # No Strategy hook fits either: Lightning ends an epoch only when the module's `on_train_batch_start`
        # returns -1 (the strategy's return is ignored), and steps LR schedulers through the module's
        # `lr_scheduler_step`, with no strategy hook between the optimizer step and it.
        self._patches.enter_context(
            patched(
                module,
                on_train_batch_start=self._wrap_batch_start(module.on_train_batch_start),
                lr_scheduler_step=self._wrap_scheduler_step(trainer, module.lr_scheduler_step),
            )
        )

    @override
    def teardown(self) -> None:
        self._patches.close()
        self._loaders.release()
        super().teardown()

    @override
    def barrier(self, name: str | None = None) -> None:
        self._loaders.at_barrier(name)
        super().barrier(name)  # type: ignore[safe-super]  # the engine's strategy, next in the MRO

    @override
    def process_dataloader(self, dataloader: object) -> object:
        return self._loaders.process(dataloader, self.root_device, self.strategy_name)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer  # type: ignore[union-attr]
        ahead = self._ahead is not None and self._loaders.alone(trainer.train_dataloader)
        self.counts_ahead = self._loaders.ahead = ahead
        self._choose(self.counts_ahead)

    def supply_count(self, count: object, integer: bool = False) -> None:
        """Gives the count of the next microbatch, for a ``training_step`` that does not return one.

        Called by :class:`~lightning_weighted.ItemCounter` before each training step where counts are not taken
        ahead. A ``"count"`` returned by ``training_step`` takes precedence.

        Args:
            count: the number of valid items of the microbatch (or the sum of its sample weights).
            integer: whether the count must be a whole number (examples, tokens).
        """
        self._supplied = (count, integer)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        self._skip_schedulers = False
        supplied, self._supplied = self._supplied, None
        output = super().training_step(*args, **kwargs)
        window = self._window = self._window or Window(self._loss_scale())
        self._factor = 0.0
        if self.padding_step:
            return output  # a replayed batch of an exhausted rank contributes nothing
        loss, item_sum, problem = split_output(output)
        if loss is None:
            window.reject(CountProblem.NO_LOSS)
            return {"loss": self._zero_loss(None)}
        if problem is not None or loss.grad_fn is None:
            window.reject(problem or CountProblem.NO_GRAPH)
            return output
        if self._ahead is not None and self.counts_ahead:
            count = agreed(output, self._ahead.count)
        else:
            count = count_of(output, args[0], supplied)
            self._notice(count, supplied)
        self._factor = window.add(count, loss, item_sum)
        return output

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        assert self.lightning_module is not None
        # Undo Lightning's `loss / accumulate_grad_batches`, then weight the microbatch.
        factor = self._factor * self.lightning_module.trainer.accumulate_grad_batches
        if isinstance(factor, Tensor):  # on the device (an epoch's first window, counted ahead): never compared
            closure_loss = closure_loss * factor
        elif factor == 0:
            closure_loss = self._zero_loss(closure_loss)
        elif factor != 1:
            closure_loss = closure_loss * factor
        if self._ends_window:
            window = self._window or Window(self._loss_scale())
            more = self._participation.has_more()
            if self._ahead is not None and self.counts_ahead:
                following = self._ahead.plan_following(self._batch_idx)
                self._hand_over(window.handover(following, more), window.add_share)
            else:
                assert isinstance(window.reference, float)  # riding windows never wait for their N
                self._start_sync(window.payload(dist.get_rank(self._count_group()), more), window.reference)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: LightningModule | Module | None = None,
        **kwargs: Any,
    ) -> Any:
        # Lightning runs the window's last training step and backward inside this closure, and then clips.
        def closure_then_finish_window() -> Any:
            self._ends_window = True
            try:
                result = closure()
            finally:
                self._ends_window = False
            self._finish_window(optimizer)
            return result

        return super().optimizer_step(optimizer, closure_then_finish_window, model, **kwargs)

    # ------------------------------------------------------------------------------------------- internals
    def _finish_window(self, optimizer: Optimizer) -> None:
        """Reads the window's global count (one host read per optimizer step) and acts on it on every rank."""
        assert self.lightning_module is not None
        step = self.lightning_module.trainer.global_step
        group = self._count_group()
        if self._ahead is not None and self.counts_ahead:
            window, summed = self._ahead.end_window(self._handed_over)
            self._window = self._ahead.window
            if summed[Slot.INVALID] > 0:  # which rank and which value: one more SUM, on every rank alike
                payload = window.payload(dist.get_rank(group), False)
                summed = sum_counts(payload, self.root_device, group).wait().tolist()
        else:
            window, self._window = self._window or Window(self._loss_scale()), None
            summed = self._summed_counts()
        result = self.last_window = window.finish(summed, step, ranks=dist.get_world_size(group))
        self._participation.after_window(result.ranks_with_more, self.root_device, group)
        if result.items > 0:
            if not self.counts_ahead:  # counted ahead, the losses were scaled by N already
                self._normalize(result.items)
            return
        # Without gradients no torch optimizer touches parameters or state (momentum, moments, steps).
        optimizer.zero_grad(set_to_none=True)
        self._skip_schedulers = True
        self.skipped_steps += 1
        rank_zero_warn(
            f"The global item count of the window ending at step {step} is 0: the optimizer and step-interval LR"
            " schedulers were not stepped."
        )

    def _start_sum(self, values: list[float], fill: Callable[[Tensor], None] | None = None) -> tuple[Tensor, dist.Work]:
        """Starts the SUM of a float64 vector over the counting ranks (see :func:`~.reduce.counts.start_sum`)."""
        return start_sum(values, self.root_device, fill, self._count_group())

    def _window_size(self, batch_idx: int) -> int:
        """How many batches Lightning accumulates into the window that would start at ``batch_idx``."""
        trainer = self.lightning_module.trainer  # type: ignore[union-attr]
        accumulate = trainer.accumulate_grad_batches
        return int(max(0, min(accumulate - batch_idx % accumulate, trainer.num_training_batches - batch_idx)))

    def _notice(self, count: Count, supplied: tuple[object, bool] | None) -> None:
        if count.implicit and "implicit" not in self._said:
            self._said.add("implicit")
            rank_zero_info(
                f"{self.strategy_name}: training_step gave no count, so each microbatch counts its examples (the"
                " batch size). If the loss is a mean over tokens (a Hugging Face model's `out.loss` is), count"
                " them: return `{'loss': loss, 'count': n_valid_tokens}` or add"
                " `ItemCounter('tokens', key='labels', shift=True)`; counting by batch size trains like plain DDP."
                " `ItemCounter('examples')` keeps examples and silences this."
            )
        if supplied is None or count.implicit or "disagreement" in self._said:
            return
        counted = read_count(*supplied)[0]
        if counted != count.value:
            self._said.add("disagreement")
            warnings.warn(
                f"On rank {self.global_rank}, training_step returned count={count.value!r} but ItemCounter counted"
                f" {counted!r} for the same microbatch; the returned count is used. Make them agree (e.g. the"
                " causal shift, `ignore_index`), or drop one of them. Reported once.",
                stacklevel=2,
            )

    def _wrap_batch_start(self, hook: Callable[[Any, int], int | None]) -> Callable[[Any, int], int | None]:
        def on_train_batch_start(batch: Any, batch_idx: int) -> int | None:
            # Runs before the strategy's own hook and the training step: the place to end the epoch.
            if self._participation.stop:
                return -1  # every rank is out of data: Lightning ends the epoch here, on every rank
            self.padding_step = self._participation.begin_batch(batch_idx)
            self._batch_idx = batch_idx
            if self._ahead is not None and self.counts_ahead:
                self._window = self._ahead.begin_batch(batch_idx)
            return hook(batch, batch_idx)

        return on_train_batch_start

    def _wrap_scheduler_step(self, trainer: Trainer, step: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
        def lr_scheduler_step(scheduler: Any, metric: Any) -> None:
            if self._skip_schedulers and any(
                config.scheduler is scheduler and config.interval == "step" for config in trainer.lr_scheduler_configs
            ):
                return
            step(scheduler, metric)

        return lr_scheduler_step
