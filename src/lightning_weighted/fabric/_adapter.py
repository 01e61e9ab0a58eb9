"""The window rules wired into a Fabric loop: ``fabric.backward(loss, count=n)``, clipping and ``optimizer.step()``."""

from __future__ import annotations

from typing import Any, Literal

import torch.distributed as dist
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.utilities import rank_zero_warn
from lightning.fabric.utilities.types import Optimizable
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_weighted._counts import Count, CountPayload, CountProblem, Wording, read_count
from lightning_weighted.fabric._loader import FabricLoader
from lightning_weighted.participation import Participation, Policy, participating, without_padding
from lightning_weighted.window import LossScale, Window, WindowResult

__all__ = ["FABRIC", "FabricAdapter"]

FABRIC = Wording(
    "fabric.backward got",
    "Pass each microbatch's count as `fabric.backward(loss, count=n)`, where `loss` is the mean over the"
    " microbatch's `n` valid items (or their sum, with `reduction='sum'`) and `n` is their number (or the sum of"
    " their sample weights): an int, a float or a 0-dim tensor, finite and >= 0",
)


class FabricAdapter(ParallelStrategy):
    """Reads each microbatch's count in ``backward``, scales its loss, and ends the window with the backward that syncs.

    Subclasses put it before their Fabric strategy (``class S(FabricAdapter, DDPStrategy)``) and say how the
    window's counts meet their gradients, as the Trainer's adapter does: :meth:`_loss_scale`, :meth:`_start_sync`
    (before the backward that ends a window), :meth:`_summed_counts` (after it) and :meth:`_normalize`; and how a
    backward relates to the window: :meth:`_syncs`, :meth:`_hold`, :meth:`_trained_module`, :meth:`_zero_loss`,
    :meth:`_count_group`.
    """

    strategy_name: str

    def __init__(self, *args: Any, participation: Policy = "pad", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        Participation(participation)  # checks the policy now, where the user passed it
        self.skipped_steps = 0
        self.padding_step = False
        self.last_window: WindowResult | None = None
        self.backwards = 0  # fabric.backward calls so far
        self._policy: Policy = participation
        self._participation: Participation | None = None  # of the loader that gave the current batch
        self._window: Window | None = None
        self._windows = 0  # windows ended so far
        self._skip_step = False  # the last window had no item: optimizer steps change nothing

    # ------------------------------------------------------------------------------------------- engine hooks
    def _loss_scale(self) -> LossScale:
        """What microbatch losses are scaled to; read once per window."""
        return LossScale.ITEM_SUM

    def _syncs(self) -> bool:
        """Whether the coming backward reduces gradients across ranks (it does not inside ``no_backward_sync``)."""
        raise NotImplementedError

    def _hold(self) -> None:
        """Keeps the coming backward's gradients local, although it would sync: it does not end the window."""
        raise NotImplementedError

    def _start_sync(self, payload: CountPayload, reference: float) -> None:
        """Hands the window's payload to the reduction; runs right before the backward that ends the window."""
        raise NotImplementedError

    def _summed_counts(self) -> list[float]:
        """The SUM of every rank's payload, on the host; runs after the backward that ends the window."""
        raise NotImplementedError

    def _normalize(self, items: float) -> None:
        """Brings ``N`` to gradients the reduction left as item sums; nothing where the reduction did it."""

    def _count_group(self) -> dist.ProcessGroup | None:
        """The group a window's counts are summed over: the ranks that see different data (``None``: all)."""
        return None

    def _trained_module(self) -> Module:
        """The module set up for training, whose gradients the window weights."""
        raise NotImplementedError

    def _zero_loss(self, loss: Tensor) -> Tensor:
        """An exact zero standing for ``loss``, whose own mean may be NaN (0/0 over a fully masked microbatch)."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------- Fabric hooks
    @override
    def backward(
        self,
        tensor: Tensor,
        module: Module | None,
        *args: Any,
        count: object = None,
        reduction: Literal["mean", "sum"] = "mean",
        window_end: bool | None = None,
        **kwargs: Any,
    ) -> None:
        """``fabric.backward(loss, count=n)``: backpropagates ``loss`` weighted by its count within the window.

        Args:
            tensor: the microbatch's mean over its ``count`` valid items (their sum with ``reduction="sum"``).
            module: what Fabric passes (the module given as ``model=``, or ``None``).
            *args: passed on to the precision plugin's backward.
            count: the number of valid items (or the sum of sample weights): an int, a float or a 0-dim tensor,
                finite and ``>= 0``; an invalid or missing one raises on every rank when the window ends.
            reduction: ``"mean"`` or ``"sum"``, what ``tensor`` is over the items.
            window_end: whether this backward ends the window; by default the one outside
                ``fabric.no_backward_sync(model)`` does (``False`` keeps a syncing backward local).
            **kwargs: passed on to the precision plugin's backward.
        """
        syncs = self._syncs()
        ends = _ends_window(syncs, window_end, reduction)
        if self._window is None:
            self._window, self._skip_step = Window(self._loss_scale()), False
        window = self._window
        self.backwards += 1
        factor = _record(window, tensor, count, reduction == "sum", replay=self.padding_step)
        if factor == 0:
            tensor = self._zero_loss(tensor)
        elif factor != 1:
            tensor = tensor * factor
        if ends:
            more = self._participation is None or self._participation.has_more()
            assert isinstance(window.reference, float)  # Fabric's windows are never planned ahead
            self._start_sync(window.payload(dist.get_rank(self._count_group()), more), window.reference)
        elif syncs:
            self._hold()
        super().backward(tensor, module, *args, **kwargs)
        if ends:
            self._finish_window()

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        self._check_closed("optimizer.step()")
        if self._skip_step:
            return None  # a window without items: no parameter, no optimizer state changes
        return super().optimizer_step(optimizer, **kwargs)

    @override
    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        self._check_closed("fabric.clip_gradients")
        return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)

    @override
    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float | int) -> None:
        self._check_closed("fabric.clip_gradients")
        super().clip_gradients_value(module, optimizer, clip_val)

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        # Each item once per epoch (no padding sampler); where the ranks' batch counts differ, every rank yields
        # batches until every rank is done. A loader with as many batches everywhere is left as it is.
        participation = Participation(self._policy)
        loader = participating(without_padding(dataloader), participation, self.root_device)
        return loader if participation.replaying is None else FabricLoader(loader, participation, self)

    def begin_batch(self, participation: Participation | None, replay: bool) -> None:
        """Called by a set-up loader as it yields a batch (whether it is a replay), and with ``None`` at its end."""
        self._participation, self.padding_step = participation, replay

    # ------------------------------------------------------------------------------------------- internals
    def _finish_window(self) -> None:
        """Reads the window's global count (one host read per window) and acts on it, the same on every rank."""
        window, self._window = self._window, None
        assert window is not None
        step, self._windows = self._windows, self._windows + 1
        group = self._count_group()
        result = self.last_window = window.finish(self._summed_counts(), step, FABRIC, dist.get_world_size(group))
        if self._participation is not None:
            self._participation.after_window(result.ranks_with_more, self.root_device, group)
        if result.items > 0:
            self._normalize(result.items)
            return
        # Without gradients no torch optimizer touches parameters or state, and the next step is skipped anyway.
        for param in self._trained_module().parameters():
            param.grad = None
        self._skip_step = True
        self.skipped_steps += 1
        rank_zero_warn(
            f"The global item count of window {step} is 0: the optimizer steps after it change nothing. A loop"
            " that steps an LR scheduler can skip it when `fabric.strategy.last_window.items == 0`."
        )

    def _check_closed(self, what: str) -> None:
        if self._window is not None:
            raise _still_open(what)


def _ends_window(syncs: bool, window_end: bool | None, reduction: str) -> bool:
    """Whether a backward ends its window; refuses arguments that cannot be weighted."""
    if reduction not in ("mean", "sum"):
        raise ValueError(
            f"fabric.backward got reduction={reduction!r}: pass 'mean' when the loss is the mean over the"
            " microbatch's valid items (the default), or 'sum' when it is their sum."
        )
    if window_end and not syncs:
        raise RuntimeError(
            "fabric.backward(..., window_end=True) ran inside `fabric.no_backward_sync(model)`, which keeps this"
            " backward from synchronizing gradients, so it cannot end the window. Run the window's last microbatch"
            " outside the context (with `enabled=False`), or leave `window_end` out."
        )
    return syncs if window_end is None else window_end


def _record(window: Window, loss: Tensor, count: object, item_sum: bool, replay: bool) -> float:
    """Records one microbatch in the window; returns its loss factor (0: it contributes nothing)."""
    if replay:
        return 0.0  # a replayed batch of an exhausted rank: its count is 0
    if loss.grad_fn is None:
        window.reject(CountProblem.NO_GRAPH)
        return 0.0
    if count is None:
        window.reject(CountProblem.MISSING)
        return 0.0
    factor = window.add(Count(*read_count(count)), loss, item_sum)
    assert isinstance(factor, float)  # a window planned ahead would give a device tensor
    return factor


def _still_open(what: str) -> RuntimeError:
    return RuntimeError(
        f"{what} was called while a window is open: the last `fabric.backward` did not end it (it ran inside"
        " `fabric.no_backward_sync(model)` or with `window_end=False`), so the gradients are this rank's own. Run"
        " the window's last backward outside `no_backward_sync` (or with `window_end=True`) before clipping and"
        " stepping."
    )
