"""``WeightedDDPStrategy``: DDP whose update is the gradient of the global item mean of each optimizer step."""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch._dynamo
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_weighted._weights import CountProblem, WindowCount, decode, read_count
from lightning_weighted.hook import WeightedReduceState, weighted_allreduce_hook
from lightning_weighted.participation import ParticipatingLoader, Participation, Policy, without_padding

__all__ = ["WeightedDDPStrategy", "WindowResult"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WindowResult:
    """What the count reduction of one optimizer step found, the same on every rank except ``local_items``.

    Attributes:
        step: ``global_step`` before the optimizer step of this window.
        items: the global item count ``N`` of the window.
        local_items: this rank's items in the window.
        loss: the global item mean of the loss, ``Σ_r Σ_m n_rm · loss_rm / N`` (NaN when ``N = 0``).
    """

    step: int
    items: float
    local_items: float
    loss: float


class WeightedDDPStrategy(DDPStrategy):
    """DDP that optimises the mean over every valid item of each optimizer step, on every rank and microbatch.

    ``training_step`` returns ``{"loss": local_mean, "count": n}``: the mean loss over the ``n`` valid items of
    the microbatch (examples, unmasked tokens, or the sum of sample weights) and ``n`` itself, an int, a
    float or a 0-dim tensor, finite and ``>= 0``. A bare tensor return counts examples (the batch size).
    The synchronized gradient is then ``(1/N) Σ_r Σ_m n_rm · ḡ_rm`` (see :mod:`lightning_weighted.hook`),
    whatever the counts on each rank and the number of microbatches in the window; Lightning's division
    by ``accumulate_grad_batches`` is undone.

    - A microbatch with ``n = 0`` contributes exactly zero, also when its mean is NaN (0/0).
    - A window whose global ``N`` is 0 changes nothing: the optimizer and step-interval LR schedulers are
      not stepped, on every rank alike, and rank 0 warns. ``skipped_steps`` counts such windows.
    - An invalid count, a ``None`` return or a loss without a graph on any rank raises the same error on
      every rank at the end of the window, before the optimizer step.

    Takes the arguments of :class:`~lightning.pytorch.strategies.DDPStrategy`, except the communication hook
    arguments: the hook is this strategy's own, and it is registered on CPU (gloo) and CUDA (NCCL) alike.

    Example::

        >>> import lightning_weighted
        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(strategy="ddp_weighted", accelerator="cpu", devices=1, logger=False)
        >>> type(trainer.strategy).__name__
        'WeightedDDPStrategy'
    """

    strategy_name = "ddp_weighted"

    def __init__(self, *args: Any, participation: Policy = "pad", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for name in ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper"):
            if getattr(self, f"_{name}") is not None:
                raise ValueError(
                    f"`{name}={getattr(self, f'_{name}')!r}` was passed to {type(self).__name__}, but its comm hook"
                    " is owned by ddp_weighted: it is what weights the gradients. Drop the argument, or use"
                    " `strategy='ddp'` to run your own hook."
                )
        self.skipped_steps = 0
        self.padding_step = False
        self._participation = Participation(participation)
        self._loading = ""
        self._hook_state = WeightedReduceState()
        self._item_sums = False
        self._window = WindowCount()
        self._factor = 0.0
        self._loss_sum: Tensor | None = None
        self._supplied: tuple[object, bool] | None = None
        self._disagreement_reported = False
        self._skip_step_schedulers = False
        self.last_window: WindowResult | None = None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        entries: tuple[tuple[str, str, dict[str, Any]], ...] = (
            ("ddp_weighted", "popen", {}),
            ("ddp_weighted_spawn", "spawn", {}),
            ("ddp_weighted_fork", "fork", {}),
            ("ddp_weighted_find_unused_parameters_true", "popen", {"find_unused_parameters": True}),
        )
        for name, start_method, extra in entries:
            strategy_registry.register(
                name,
                cls,
                description=f"Count-weighted DDP strategy with `start_method` '{start_method}' {extra or ''}".strip(),
                override=True,  # importing twice leaves the registry as it was
                start_method=start_method,
                **extra,
            )

    @override
    def setup(self, trainer: Trainer) -> None:
        module = trainer.lightning_module
        if not module.automatic_optimization:
            raise MisconfigurationException(
                f"{type(module).__name__} uses manual optimization (`automatic_optimization=False`), which"
                " ddp_weighted does not weight. Use automatic optimization, or `strategy='ddp'` and scale the"
                " loss yourself."
            )
        accumulates = trainer.accumulate_grad_batches > 1 or any(
            isinstance(callback, GradientAccumulationScheduler)
            for callback in trainer.callbacks  # type: ignore[attr-defined]
        )
        if str(getattr(torch._dynamo.config, "optimize_ddp", "")).startswith("python_reducer"):
            raise MisconfigurationException(
                "`torch._dynamo.config.optimize_ddp='python_reducer'` reduces gradients outside DDP's communication"
                " hook, so ddp_weighted could not weight them. Use the default `optimize_ddp=True`, or"
                " `strategy='ddp'`."
            )
        if self._ddp_kwargs.get("static_graph") and accumulates:
            raise MisconfigurationException(
                "`static_graph=True` with gradient accumulation is not supported by DDP in this torch version."
                " Drop `static_graph=True`, or set `accumulate_grad_batches=1`."
            )
        super().setup(trainer)
        module.lr_scheduler_step = self._wrap_scheduler_step(trainer, module.lr_scheduler_step)  # type: ignore[method-assign,assignment]
        module.on_train_batch_start = self._wrap_batch_start(module.on_train_batch_start)  # type: ignore[method-assign,assignment]

    @override
    def barrier(self, name: str | None = None) -> None:
        # Lightning names the barrier after the dataloader it is about to process.
        self._loading = name or ""
        super().barrier(name)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        if self._loading not in ("train_dataloader()", "val_dataloader()", "test_dataloader()"):
            return dataloader
        dataloader = without_padding(dataloader)
        if self._loading != "train_dataloader()":
            return dataloader
        return ParticipatingLoader(dataloader, self._participation, self.root_device)

    @override
    def _register_ddp_hooks(self) -> None:
        # `DDPStrategy` registers comm hooks on CUDA only; ours is needed wherever DDP reduces.
        assert isinstance(self.model, DistributedDataParallel)
        dtypes = [param.dtype for param in self.model.parameters() if param.requires_grad]
        self._hook_state.rides = WeightedReduceState.can_ride(dtypes, self.world_size)
        # Riding counts let every bucket divide after its SUM, so losses may be item sums, unless fp16 computes
        # the backward: there they stay mean-sized (see `lightning_weighted.hook`).
        self._item_sums = self._hook_state.rides and not _fp16_backward(self.precision_plugin)
        self._window = self._new_window()
        self.model.register_comm_hook(self._hook_state, weighted_allreduce_hook)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        self._skip_step_schedulers = False
        supplied, self._supplied = self._supplied, None
        join = getattr(self.model, "_join_config", None)
        if join is not None and join.enable:
            raise RuntimeError(
                "DistributedDataParallel.join() is active around a ddp_weighted step. ddp_weighted keeps ranks with"
                " uneven inputs matched itself (participation='pad'), and join's shadow collectives would pair with"
                " the count reduction. Remove the join() context."
            )
        output = super().training_step(*args, **kwargs)
        if self.padding_step:
            self._factor = 0.0  # a replayed batch of an exhausted rank contributes nothing
            return output
        loss = output.get("loss") if isinstance(output, Mapping) else output
        if not isinstance(loss, Tensor):
            self._reject(CountProblem.NO_LOSS)
            assert self.lightning_module is not None
            return {"loss": _zero_loss(None, self.lightning_module)}
        if loss.grad_fn is None:
            self._reject(CountProblem.NO_GRAPH)
            return output
        count, problem = self._count_of(output, args[0], supplied)
        if problem is not None:
            self._reject(problem, count)
        else:
            self._factor = self._window.add(count)
            if count > 0:
                contribution = loss.detach().double() * count
                self._loss_sum = contribution if self._loss_sum is None else self._loss_sum + contribution
        return output

    def supply_count(self, count: object, integer: bool = False) -> None:
        """Gives the count of the next microbatch, for a ``training_step`` that does not return one.

        Called by :class:`~lightning_weighted.ItemCounter` before each training step. A ``"count"`` returned by
        ``training_step`` takes precedence.

        Args:
            count: the number of valid items of the microbatch (or the sum of its sample weights).
            integer: whether the count must be a whole number (examples, tokens).
        """
        self._supplied = (count, integer)

    def _count_of(
        self, output: object, batch: Any, supplied: tuple[object, bool] | None
    ) -> tuple[float, CountProblem | None]:
        if isinstance(output, Mapping) and "count" in output:
            count, problem = read_count(output["count"])
            if supplied is not None and problem is None:
                self._report_disagreement(count, read_count(*supplied)[0])
            return count, problem
        if supplied is not None:
            return read_count(*supplied)
        if isinstance(output, Mapping):
            return math.nan, CountProblem.MISSING
        return float(extract_batch_size(batch)), None

    def _report_disagreement(self, returned: float, counted: float) -> None:
        if returned == counted or self._disagreement_reported:
            return
        self._disagreement_reported = True
        warnings.warn(
            f"On rank {self.global_rank}, training_step returned count={returned!r} but ItemCounter counted"
            f" {counted!r} for the same microbatch; the returned count is used. Make them agree (e.g. the causal"
            " shift, `ignore_index`), or drop one of them. Reported once.",
            stacklevel=2,
        )

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        assert self.lightning_module is not None
        assert isinstance(self.model, DistributedDataParallel)
        # Undo Lightning's `loss / accumulate_grad_batches` and weight the microbatch by `count / reference`.
        factor = self._factor * self.lightning_module.trainer.accumulate_grad_batches
        if factor == 0:
            closure_loss = _zero_loss(closure_loss, self.lightning_module)
        elif factor != 1:
            closure_loss = closure_loss * factor
        if self.model.require_backward_grad_sync:
            more = self._participation.has_more()
            vector = self._window.vector(self.global_rank, more)
            self._hook_state.begin_window(vector, self._window.reference, self.root_device, self._loss_sum)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: LightningModule | Module | None = None,
        **kwargs: Any,
    ) -> Any:
        def closure_then_finish_window() -> Any:
            result = closure()
            self._finish_window(optimizer)
            return result

        return super().optimizer_step(optimizer, closure_then_finish_window, model, **kwargs)

    @override
    def teardown(self) -> None:
        module = self.lightning_module
        if module is not None:
            vars(module).pop("lr_scheduler_step", None)
            vars(module).pop("on_train_batch_start", None)
        super().teardown()

    def _new_window(self) -> WindowCount:
        return WindowCount(reference=1.0) if self._item_sums else WindowCount()

    def _reject(self, problem: CountProblem, value: float = float("nan")) -> None:
        self._window.reject(problem, value)
        self._factor = 0.0

    def _finish_window(self, optimizer: Optimizer) -> None:
        """Reads the window's global count (one host read per optimizer step) and acts on it on every rank."""
        window = decode(self._hook_state.counts())
        local_items = self._window.items
        self._window, self._loss_sum = self._new_window(), None
        if window.error is not None:
            raise window.error
        assert self.lightning_module is not None
        self.last_window = WindowResult(
            step=self.lightning_module.trainer.global_step,
            items=window.items,
            local_items=local_items,
            loss=window.loss_sum / window.items if window.items > 0 else math.nan,
        )
        self._participation.after_window(window.ranks_with_more, self.root_device)
        if window.items == 0:
            # Without gradients no torch optimizer touches parameters or state (momentum, moments, steps).
            optimizer.zero_grad(set_to_none=True)
            self._skip_step_schedulers = True
            self.skipped_steps += 1
            rank_zero_warn(
                f"The global item count of the window ending at step {self.lightning_module.trainer.global_step}"
                " is 0: the optimizer and step-interval LR schedulers were not stepped."
            )

    def _wrap_batch_start(self, hook: Callable[[Any, int], int | None]) -> Callable[[Any, int], int | None]:
        def on_train_batch_start(batch: Any, batch_idx: int) -> int | None:
            # Runs before the strategy's own hook and the training step: the place to end the epoch.
            if self._participation.stop:
                return -1  # every rank is out of data: Lightning ends the epoch here, on every rank
            self.padding_step = self._participation.begin_batch(batch_idx)
            return hook(batch, batch_idx)

        return on_train_batch_start

    def _wrap_scheduler_step(self, trainer: Trainer, step: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
        def lr_scheduler_step(scheduler: Any, metric: Any) -> None:
            if self._skip_step_schedulers and any(
                config.scheduler is scheduler and config.interval == "step" for config in trainer.lr_scheduler_configs
            ):
                return
            step(scheduler, metric)

        return lr_scheduler_step


def _fp16_backward(plugin: object) -> bool:
    """Whether Lightning's precision computes in fp16 (``16-mixed``, ``16-true``, Transformer Engine fp16)."""
    precision = str(getattr(plugin, "precision", ""))
    return "16" in precision and "bf16" not in precision


def _zero_loss(loss: Tensor | None, module: Module) -> Tensor:
    """An exact zero that reaches the parameters ``loss`` depends on (all trainable ones if it has no graph).

    Backpropagating ``0 * loss`` through a fully masked mean sends ``0 * (1/0) = NaN`` into the gradient;
    touching the parameters directly gives DDP the same set of ready parameters and exact zeros.
    """
    if loss is not None and loss.grad_fn is not None:
        params = _graph_parameters(loss)
    else:
        params = [param for param in module.parameters() if param.requires_grad]
    return torch.stack([param.sum().float() * 0.0 for param in params]).sum()


def _graph_parameters(loss: Tensor) -> list[Tensor]:
    """The leaf tensors that require grad and that ``loss`` was computed from."""
    params: list[Tensor] = []
    seen: set[Any] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, Tensor):
            params.append(variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return params
