"""``WeightedDDPStrategy``: DDP whose update is the gradient of the global item mean of each optimizer step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.exceptions import _augment_message
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_weighted._counts import CountPayload
from lightning_weighted.participation import Policy
from lightning_weighted.reduce.carrier import Carrier, fits
from lightning_weighted.reduce.ddp_hook import (
    PYTHON_REDUCER,
    RIDE_LIMIT_BYTES,
    WeightedReduceState,
    fp16_backward,
    python_reducer,
)
from lightning_weighted.reduce.divisor import ReducerDivision, can_divide
from lightning_weighted.strategies._trainer import TrainerAdapter
from lightning_weighted.window import LossScale

__all__ = ["WeightedDDPStrategy"]


class WeightedDDPStrategy(TrainerAdapter, DDPStrategy):
    """DDP that optimises the mean over every valid item of each optimizer step, on every rank and microbatch.

    ``training_step`` returns ``{"loss": local_mean, "count": n}``: the mean loss over the ``n`` valid items of
    the microbatch (examples, unmasked tokens, or the sum of sample weights) and ``n`` itself, an int, a float
    or a 0-dim tensor, finite and ``>= 0``; ``"reduction": "sum"`` marks a loss summed over the items instead.
    A bare loss, or a dict without ``"count"``, counts examples (the batch size) unless an
    :class:`~lightning_weighted.ItemCounter` counts. The synchronized gradient is then the one stated in
    :mod:`lightning_weighted.window`, whatever the counts on each rank and the number of microbatches in the
    window; Lightning's division by ``accumulate_grad_batches`` is undone.

    How the counts meet the gradients is decided when training starts, the same on every rank:

    - **Counts ahead**, with an ``ItemCounter`` and one train dataloader: every batch is counted on the host as
      the loader yields it, each window's batches are fetched before its first forward, and every loss is scaled
      by ``P n / N`` before its backward (``LossScale.GLOBAL_MEAN``). DDP's own reducer does the rest: no
      communication hook, no collective of the strategy's own per step (each window hands the next one its ``N``
      in the gradient all-reduce, through one extra parameter, :class:`~lightning_weighted.reduce.carrier.Carrier`),
      no count read from the device, one host read per optimizer step.
    - **Riding counts** otherwise (counts known only once ``training_step`` has run): the strategy's
      communication hook (:mod:`lightning_weighted.reduce.ddp_hook`) SUMs every bucket and divides it by ``N``;
      with ``reducer_divides=True`` and fp32/fp64 gradients on the CPU, DDP's own reducer divides by it instead.

    - A microbatch with ``n = 0`` contributes exactly zero, also when its mean is NaN (0/0).
    - A window whose global ``N`` is 0 changes nothing: the optimizer and step-interval LR schedulers are
      not stepped, on every rank alike, and rank 0 warns. ``skipped_steps`` counts such windows.
    - An invalid count, a ``None`` return or a loss without a graph on any rank raises the same error on
      every rank at the end of the window, before the optimizer step.

    Args:
        *args: :class:`~lightning.pytorch.strategies.DDPStrategy`'s arguments, except the communication hook ones:
            the hook is this strategy's own, registered on CPU (gloo) and CUDA (NCCL) alike.
        participation: ``"pad"`` lets a rank whose data ran out step with count 0 until every rank is done;
            ``"strict"`` raises instead (see :mod:`lightning_weighted.participation`).
        loss_scale: where counts ride, ``"item_sum"`` or ``"mean_sized"`` (see
            :class:`~lightning_weighted.window.LossScale`); by default item sums, and mean-sized losses where fp16
            computes the backward or bf16/fp16 gradients keep the counts from riding.
        ride_limit_bytes: the largest first gradient bucket the counts ride in (see
            :class:`~lightning_weighted.WeightedReduceState`).
        reducer_divides: where counts ride and the gradients are fp32 or fp64 on the CPU (no fp16 backward, no
            ``loss_scale="mean_sized"``), let DDP's own reducer divide them by ``N``
            (:mod:`lightning_weighted.reduce.divisor`) instead of the strategy's communication hook: no Python per
            bucket and no second pass over the gradients, for one 48-byte all-reduce that the reducer waits for at
            the first gradient. Elsewhere the hook reduces regardless.
        carry_counts: with counts ahead, whether each window's handover rides in the gradient all-reduce (where
            :func:`~lightning_weighted.reduce.carrier.fits` says it stays exact) or takes its own 32-byte float64
            all-reduce, started before the syncing backward. ``False`` keeps ``trainer.model.module`` the
            ``LightningModule`` itself.
        **kwargs: :class:`~lightning.pytorch.strategies.DDPStrategy`'s keyword arguments.

    Example::

        >>> import lightning_weighted
        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(strategy="ddp_weighted", accelerator="cpu", devices=1, logger=False)
        >>> type(trainer.strategy).__name__
        'WeightedDDPStrategy'
    """

    strategy_name = "ddp_weighted"

    def __init__(
        self,
        *args: Any,
        participation: Policy = "pad",
        loss_scale: Literal["item_sum", "mean_sized"] | None = None,
        ride_limit_bytes: int = RIDE_LIMIT_BYTES,
        reducer_divides: bool = False,
        carry_counts: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, participation=participation, **kwargs)
        for name in ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper"):
            if getattr(self, f"_{name}") is not None:
                raise ValueError(
                    f"`{name}={getattr(self, f'_{name}')!r}` was passed to {type(self).__name__}, but its comm hook"
                    " is owned by ddp_weighted: it is what weights the gradients. Drop the argument, or use"
                    " `strategy='ddp'` to run your own hook."
                )
        self._scale = None if loss_scale is None else LossScale(loss_scale)
        self._reduce_state = WeightedReduceState(ride_limit_bytes=ride_limit_bytes)
        self._carry = carry_counts
        self._reducer_divides = reducer_divides
        self._carrier: Carrier | None = None
        self._division: ReducerDivision | None = None  # riding counts that DDP's reducer divides by

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_launchers(strategy_registry, cls, LAUNCHERS, "Count-weighted DDP strategy")

    @override
    def setup(self, trainer: Trainer) -> None:
        accumulates = trainer.accumulate_grad_batches > 1 or any(
            isinstance(callback, GradientAccumulationScheduler)
            for callback in trainer.callbacks  # type: ignore[attr-defined]
        )
        if python_reducer():
            raise MisconfigurationException(PYTHON_REDUCER)
        if self._ddp_kwargs.get("static_graph") and accumulates:
            raise MisconfigurationException(
                "`static_graph=True` with gradient accumulation is not supported by DDP in this torch version."
                " Drop `static_graph=True`, or set `accumulate_grad_batches=1`."
            )
        super().setup(trainer)

    @override
    def _setup_model(self, model: Module) -> DistributedDataParallel:
        dtypes = [param.dtype for param in model.parameters() if param.requires_grad]
        dtype = max(set(dtypes), key=dtypes.count) if dtypes else torch.float32
        if self._ahead is not None and self._carry and fits(dtype, self.world_size):
            # each window's handover rides in the gradients' bucket all-reduce (see `reduce/carrier.py`)
            model = self._carrier = Carrier(model, dtype, self.root_device, self.world_size)
        return super()._setup_model(model)

    @override
    def _register_ddp_hooks(self) -> None:
        if self._ahead is None:
            self._register_riding_hook()  # otherwise when training starts, if the counts cannot be taken ahead

    @override
    def _choose(self, ahead: bool) -> None:
        if not ahead and self._ahead is not None:
            self._register_riding_hook()

    def _register_riding_hook(self) -> None:
        # `DDPStrategy` registers comm hooks on CUDA only; ours is needed wherever DDP reduces, unless DDP's own
        # reducer is asked to divide by N: item sums (no fp16 backward) in fp32/fp64 gradients on the CPU.
        assert isinstance(self.model, DistributedDataParallel)
        fp16 = fp16_backward(self.precision_plugin)
        item_sums = self._scale in (None, LossScale.ITEM_SUM) and not fp16
        if self._reducer_divides and item_sums and can_divide(self.model.parameters()):
            self._division, self._scale = ReducerDivision(self.model), LossScale.ITEM_SUM
        else:
            self._scale = self._reduce_state.register(self.model, self._scale, fp16)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        join = getattr(self.model, "_join_config", None)
        if join is not None and join.enable:
            raise RuntimeError(
                "DistributedDataParallel.join() is active around a ddp_weighted step. ddp_weighted keeps ranks with"
                " uneven inputs matched itself (participation='pad'), and join's shadow collectives would pair with"
                " the count reduction. Remove the join() context."
            )
        if self._carrier is not None:
            self._carrier.arm(self._ends_window)  # the syncing microbatch's loss brings the rider along
        return super().training_step(*args, **kwargs)

    @override
    def on_exception(self, exception: BaseException) -> None:
        _augment_message(
            exception,
            pattern=".*Expected to have finished reduction in the prior iteration.*",
            new_message=_UNUSED_PARAMETERS,
        )

    @override
    def _loss_scale(self) -> LossScale:
        return self._scale or LossScale.ITEM_SUM

    @override
    def _divisor(self) -> int | None:
        return self.world_size  # without a communication hook, DDP's reducer divides by it as it fills a bucket

    @override
    def _zero_loss(self, loss: Tensor | None) -> Tensor:
        zero = super()._zero_loss(loss)
        if self._carrier is not None and self._carrier.active and (loss is None or loss.grad_fn is None):
            zero = zero + self._carrier.term()  # a loss without a graph never met the rider in the forward
        return zero

    @override
    def _start_sync(self, payload: CountPayload, reference: float) -> None:
        if self._division is not None:
            self._division.begin_window(payload, self.root_device)
        else:
            self._reduce_state.begin_window(payload, reference, self.root_device)

    @override
    def _summed_counts(self) -> list[float]:
        if self._carrier is not None:
            self._carrier.rider.grad = None  # it carried nothing: the counts ride in the hook or the divisor
        return self._reduce_state.counts() if self._division is None else self._division.counts()

    @override
    def _normalize(self, items: float) -> None:
        if self._division is not None:
            self._division.normalize(self.model.parameters(), items)  # type: ignore[union-attr]

    @override
    def teardown(self) -> None:
        if self._division is not None:
            self._division.close()
            self._division = None
        super().teardown()

    @override
    def _hand_over(self, handover: list[float], fill: Callable[[Tensor], None]) -> None:
        if self._carrier is None:
            super()._hand_over(handover, fill)
        else:
            self._carrier.load(handover, fill)

    @override
    def _handed_over(self, also: Tensor | None = None) -> list[float]:
        if self._carrier is None:
            return super()._handed_over(also)
        summed = self._carrier.read(also)
        if summed is None:
            raise RuntimeError(_NO_RIDER)
        return summed


_UNUSED_PARAMETERS = (
    "It looks like your LightningModule has parameters that were not used in producing the loss returned by"
    " training_step. If this is intentional, enable the detection of unused parameters in DDP, either with the"
    " strategy name `strategy='ddp_weighted_find_unused_parameters_true'` or with"
    " `strategy=WeightedDDPStrategy(find_unused_parameters=True)`."
)


_NO_RIDER = (
    "no gradient reached the count carrier in the backward that ended this window: ddp_weighted takes the"
    " window's counts from its batches ahead (ItemCounter) and brings them back through DDP's own reduction, which"
    " needs the loss returned by training_step to go through the strategy's backward"
)


Launcher = tuple[str, str, dict[str, Any]]  # a registered name, its start method, extra keyword arguments
LAUNCHERS: tuple[Launcher, ...] = (
    ("ddp_weighted", "popen", {}),
    ("ddp_weighted_spawn", "spawn", {}),
    ("ddp_weighted_fork", "fork", {}),
    ("ddp_weighted_find_unused_parameters_true", "popen", {"find_unused_parameters": True}),
)


def register_launchers(registry: _StrategyRegistry, cls: type, launchers: Sequence[Launcher], what: str) -> None:
    """Registers ``cls`` under each launcher's name, as Lightning registers ``"ddp"`` and its variants."""
    for name, start_method, extra in launchers:
        registry.register(
            name,
            cls,
            description=f"{what} with `start_method` '{start_method}' {extra or ''}".strip(),
            override=True,  # importing twice leaves the registry as it was
            start_method=start_method,
            **extra,
        )
