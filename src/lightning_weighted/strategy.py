"""``WeightedDDPStrategy``: DDP whose update is the gradient of the global item mean of each optimizer step."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.data import _update_dataloader, extract_batch_size
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from torch.utils.data import DataLoader, DistributedSampler
from typing_extensions import override

from lightning_weighted._weights import CountProblem, WindowCount, decode, read_count
from lightning_weighted.hook import WeightedReduceState, weighted_allreduce_hook
from lightning_weighted.participation import ParticipatingLoader, Participation, Policy, UnpaddedDistributedSampler

__all__ = ["WeightedDDPStrategy"]

log = logging.getLogger(__name__)


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
        self._batch_idx = 0
        self._hook_state = WeightedReduceState()
        self._window = WindowCount()
        self._factor = 0.0
        self._skip_step_schedulers = False

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
        dataloader = _without_padding(dataloader)
        if self._loading != "train_dataloader()":
            return dataloader
        return ParticipatingLoader(dataloader, self._participation, self.root_device)

    @override
    def _register_ddp_hooks(self) -> None:
        # `DDPStrategy` registers comm hooks on CUDA only; ours is needed wherever DDP reduces.
        assert isinstance(self.model, DistributedDataParallel)
        self.model.register_comm_hook(self._hook_state, weighted_allreduce_hook)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        self._skip_step_schedulers = False
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
        if isinstance(output, Mapping):
            count, problem = read_count(output["count"]) if "count" in output else (0.0, CountProblem.MISSING)
        else:
            count, problem = float(extract_batch_size(args[0])), None
        if problem is not None:
            self._reject(problem, count)
        else:
            self._factor = self._window.add(count)
        return output

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
            more = self._participation.has_more(self._batch_idx)
            vector = self._window.vector(self.global_rank, more)
            self._hook_state.start_count_reduction(vector, self._window.reference, self.root_device)
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

    def _reject(self, problem: CountProblem, value: float = float("nan")) -> None:
        self._window.reject(problem, value)
        self._factor = 0.0

    def _finish_window(self, optimizer: Optimizer) -> None:
        """Reads the window's global count (one host read per optimizer step) and acts on it on every rank."""
        window = decode(self._hook_state.counts().tolist())
        self._window = WindowCount()
        if window.error is not None:
            raise window.error
        self._participation.after_window(window.ranks_with_more, self._batch_idx, self.root_device)
        if window.items == 0:
            # Without gradients no torch optimizer touches parameters or state (momentum, moments, steps).
            optimizer.zero_grad(set_to_none=True)
            self._skip_step_schedulers = True
            self.skipped_steps += 1
            assert self.lightning_module is not None
            rank_zero_warn(
                f"The global item count of the window ending at step {self.lightning_module.trainer.global_step}"
                " is 0: the optimizer and step-interval LR schedulers were not stepped."
            )

    def _wrap_batch_start(self, hook: Callable[[Any, int], int | None]) -> Callable[[Any, int], int | None]:
        def on_train_batch_start(batch: Any, batch_idx: int) -> int | None:
            # Runs before the strategy's own hook and the training step: the place to end the epoch.
            if self._participation.stop:
                return -1  # every rank is out of data: Lightning ends the epoch here, on every rank
            self._batch_idx = batch_idx
            self.padding_step = self._participation.is_padding(batch_idx)
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


def _without_padding(dataloader: object) -> object:
    """Swaps a padding ``DistributedSampler`` for one that repeats no item: the objective counts each item once."""
    if not isinstance(dataloader, DataLoader):
        return dataloader
    sampler = dataloader.sampler
    if type(sampler) is not DistributedSampler or sampler.drop_last:
        return dataloader
    unpadded = UnpaddedDistributedSampler(
        sampler.dataset,
        num_replicas=sampler.num_replicas,
        rank=sampler.rank,
        shuffle=sampler.shuffle,
        seed=sampler.seed,
    )
    return _update_dataloader(dataloader, unpadded)


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
