r"""The loop of windows of one fit or one Fabric loop: a microbatch in, its loss factor out, one exchange per window.

The Trainer and Fabric integrations drive one :class:`WindowLoop` each, and hold no window rule of their own:

1. :meth:`WindowLoop.add` records a
   microbatch's loss and count in the window (:mod:`lightning_weighted.window`) and keeps its loss factor;
2. :meth:`WindowLoop.backward_loss` is the loss to backpropagate: times the factor, or the engine's exact zero;
   before the backward that ends the window it starts the window's one :class:`Exchange`: an asynchronous float64
   SUM of every rank's payload (:class:`~lightning_weighted.window.Slot`) over the data-parallel ranks, which
   overlaps that backward;
3. :class:`Batch` is what the front end's hooks note of the batch in progress (a replay, the window's last);
4. :meth:`WindowLoop.finish`, after it, waits for the SUM; where the counts came after the forwards it multiplies
   the reduced gradients by :math:`D c / N` on the device (one fused pass), then reads the SUM on the host, the
   step's one read of a device value, and decides, the same on every rank: the error, or the step, or no step at
   all where :math:`N = 0` (every gradient dropped, so no optimizer changes a parameter or its state).

Counts ahead (:mod:`lightning_weighted.ahead`): each window's counts are known before its first forward, so every
factor is :math:`D n / N` and nothing is multiplied afterwards; the exchange carries the next window's counts, whose
:math:`N` reaches the host with the read.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lightning_weighted._compat import multiply
from lightning_weighted.ahead import Planner, summed
from lightning_weighted.counts import Count, Problem, Wording, agreed
from lightning_weighted.data import Participation
from lightning_weighted.engines import Engine
from lightning_weighted.window import SUMMED, Window, WindowResult

__all__ = ["Batch", "Exchange", "LoopResults", "Reference", "WindowLoop", "weighted"]


@dataclass
class Batch:
    """The batch in progress, as the front end's hooks note it: one new object per batch, read by the others.

    Attributes:
        index: its ``batch_idx`` in the epoch of its loader.
        replay: it replays a batch of a rank whose data ran out: it counts 0, and its logs and metrics leave no trace.
        replays: its loader replays on some rank: values logged across ranks weigh each rank by whether its batch
            was real.
        loader: an evaluation batch's ``dataloader_idx``.
        ends_window: its backward ends the window (the Trainer runs that batch inside ``optimizer_step``).
        dropped: the epoch ends before it trains (``on_train_batch_start`` returned -1).
        skipped: the window it ended had no item (``N = 0``): step-interval LR schedulers do not step after it.
    """

    index: int = 0
    replay: bool = False
    replays: bool = False
    loader: int = 0
    ends_window: bool = False
    dropped: bool = False
    skipped: bool = False


class Exchange:
    """A window's payload summed over ``group``, started at once without waiting; read on the host once.

    Where a rank found a problem, every rank learns which in one more collective (:meth:`Window.finish`): a healthy
    window costs the SUM alone.
    """

    def __init__(
        self, window: Window, more: bool, device: torch.device, group: dist.ProcessGroup | None, following: float = 0.0
    ) -> None:
        self.window, self.group = window, group
        self.vector = window.payload(more, device, following)
        self.work = dist.all_reduce(self.vector[:SUMMED], group=group, async_op=True)

    def items(self) -> Tensor:
        """``N``, on the device (the device's stream waits for the SUM, not the host)."""
        self.work.wait()
        return Window.items_of(self.vector)

    def result(self, step: int, wording: Wording, ranks: int) -> WindowResult:
        """The window's result from the summed payload, the one host read; raises its error on every rank alike."""
        self.items()
        return self.window.finish(self.vector.tolist(), step, wording, ranks, rows=self._rows)

    def _rows(self) -> Sequence[Sequence[float]]:
        row = self.window.problem_row(self.vector.device)
        rows = [torch.empty_like(row) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(rows, row, group=self.group)
        return [gathered.tolist() for gathered in rows]


class WindowLoop:
    """The windows of one fit or one Fabric loop, over one engine (see the module docstring).

    Args:
        engine: how the engine's reduction meets the counts (:mod:`lightning_weighted.engines`).
        device: where the gradients live.
        wording: how errors name the call that handed over the loss and its count.
        name: the strategy's name, for messages.

    Attributes:
        batch: the batch in progress (:class:`Batch`).
        participation: the train loader's epoch, where ranks may run out of data (``None``: every rank has data).
        planner: counts ahead, where the Trainer's batches are counted before their forward.
        last_window: the result of the last window.
        skipped_steps: how many windows had no item (``N = 0``) and changed nothing.
        factor, aux: the microbatch in progress's loss factor and weighted auxiliary terms (``None``: none).
    """

    def __init__(self, engine: Engine, device: torch.device, wording: Wording, name: str) -> None:
        self.engine, self.device, self.wording, self.name = engine, device, wording, name
        self.ranks = dist.get_world_size(engine.group)
        self.batch = Batch()
        self.participation: Participation | None = None
        self.planner: Planner | None = None
        self.last_window: WindowResult | None = None
        self.skipped_steps = 0
        self.factor: float | Tensor = 0.0
        self.aux: Tensor | None = None
        self._window: Window | None = None
        self._planned: deque[Count] = deque()  # the window's counts, handed over ahead (`plan`), in order
        self._exchange: Exchange | None = None
        self._backward = False  # the window ran a backward
        self._reference = Reference(engine.mean_sized)

    @property
    def counts_ahead(self) -> bool:
        """Whether each window's counts are taken before its first forward (the Trainer's, with a planner)."""
        return self.planner is not None

    @property
    def open(self) -> bool:
        """Whether a window has microbatches that no exchange has ended yet."""
        return self._window is not None

    def begin_batch(self, index: int, replays: bool = False) -> None:
        """Takes the train loader's batch ``index``: whether it is a replay; counted ahead, the window it opens.

        Args:
            index: its ``batch_idx`` in the epoch.
            replays: whether the train loader replays on some rank.
        """
        replay = self.participation is not None and self.participation.begin_batch(index)
        self.batch = Batch(index, replay, replays)
        if self.planner is not None and self._window is None:
            self.plan(*self.planner.window(index))

    def plan(self, counts: list[Count], total: float | Tensor | None = None) -> None:
        """Counts the next window ahead from its microbatches' counts; :meth:`add` takes them in order.

        Every loss of the window is then scaled by :math:`D n / N` before its backward. ``total`` is the window's
        :math:`N` where an earlier exchange brought it; else one SUM now, left on the device.
        """
        if self._window is not None:
            raise RuntimeError("a window's counts were handed over while a window is open: once per window, first")
        total = summed(counts, self.device, self.engine.group) if total is None else total
        self._window = Window(total=total, divisor=self.engine.divisor, shares=self.ranks * len(counts))
        self._planned = deque(counts)

    def add(
        self,
        loss: Tensor | None,
        count: Count | None,
        item_sum: bool,
        problem: Problem | None = None,
        aux: dict[str, Tensor] | None = None,
    ) -> None:
        """Records one microbatch's loss, count and auxiliary terms: sets :attr:`factor` and :attr:`aux`.

        Counted ahead, the planned count stands and a ``count`` given here must agree with it.
        """
        replay = self.batch.replay
        self._reference.take(None if replay else count, self.device, self.engine.group)
        window = self.window()
        planned = self._planned.popleft() if self._planned else None
        self.factor, self.aux = 0.0, None
        if replay:
            return  # a replay of an exhausted rank contributes nothing
        if planned is not None:
            count = planned if count is None else agreed(count.value, planned)
        if problem is None:
            problem = Problem.NO_LOSS if loss is None else Problem.NO_GRAPH if loss.grad_fn is None else None
        if problem is not None or count is None:
            window.reject(problem or Problem.MISSING)
            return
        self.factor = window.add(count, loss, item_sum)
        if aux:
            share = window.aux_factor()
            if share is None:
                window.reject(Problem.AUX_AFTER)
            else:
                self.aux = torch.stack([term.reshape(()) for term in aux.values()]).sum() * share

    def drop(self) -> None:
        """Forgets the window in progress: Lightning ends the epoch before the next batch and drops its gradient.

        ``on_train_batch_start`` returned -1: Lightning steps no optimizer for a half window, and the next epoch's
        first batch zeroes its gradient, so its counts must not reach the next window either. No exchange has
        started (it starts at a window's last backward). Counted ahead, the next epoch's first window is planned
        anew.
        """
        assert self._exchange is None
        self._window, self._planned, self._backward = None, deque(), False
        self.batch = Batch(dropped=True)
        self._reference.microbatches = 0

    def window(self) -> Window:
        """The window in progress (a new one, counted after, where none is)."""
        if self._window is None:
            self._window = Window(self._reference.value)
        return self._window

    def backward_loss(self, loss: Tensor, multiplier: float = 1.0, ends: bool | None = None) -> Tensor:
        """The loss to backpropagate for the microbatch :meth:`add` took; the exchange starts first at a window's end.

        ``ends``: whether this backward ends the window, by default the batch's :attr:`Batch.ends_window`.

        The loss is ``loss · factor · multiplier``, plus the microbatch's weighted auxiliary terms. A factor 0 (a
        count of 0 on the host, a replay) gives the engine's ``0 · loss``, whose backward runs through the
        microbatch's own graph and adds nothing of its own (:meth:`Engine.empty`).
        """
        factor = self.factor
        if isinstance(factor, Tensor):  # a count on the device: never compared on the host
            scaled = loss * (factor if multiplier == 1 else factor * multiplier)
        elif factor == 0 and loss.grad_fn is None:
            scaled = self.refused(loss)
        elif factor == 0:  # its backward runs through its own graph, adding nothing of its own
            self.window().empty(loss)
            scaled = self.engine.empty(loss)
        else:
            scaled = loss if factor * multiplier == 1 else loss * (factor * multiplier)
        self._backward = True
        if self.batch.ends_window if ends is None else ends:
            self.end()
        return scaled if self.aux is None else scaled + self.aux

    def refused(self, loss: Tensor | None) -> Tensor:
        """A zero loss for a microbatch that cannot be weighted; raises where the engine needs the model's graph."""
        if self.engine.needs_graph:
            raise RuntimeError(_NEEDS_GRAPH.format(dist.get_rank(), self.wording.source, _what(loss), self.name))
        return self.engine.empty(loss)

    def end(self) -> None:
        """Starts the window's exchange; runs right before the backward that ends the window (once per window)."""
        if self._exchange is None:
            more = self.participation is None or self.participation.has_more()
            following = self.planner.following(self.batch.index + 1) if self.planner is not None else 0.0
            self._exchange = Exchange(self.window(), more, self.device, self.engine.group, following)

    def finish(self, step: int) -> WindowResult:
        """Ends the window after its last backward: brings ``N`` to the gradients and decides, on every rank alike.

        A window that ran no backward (a step that only recomputes statistics) leaves its gradients as they are.

        Args:
            step: the optimizer step the window ends at.

        Returns:
            The window's result; ``items == 0`` means the step must change nothing.
        """
        self.end()
        window, self._window, self._planned = self.window(), None, deque()
        exchange, self._exchange = self._exchange, None
        backward, self._backward = self._backward, False
        assert exchange is not None
        if backward and not window.ahead:
            items = exchange.items()
            scale = torch.where(items > 0, self.engine.divisor / items, 0.0)  # D c / N, with c = window.reference
            multiply_gradients(self.engine.parameters(), scale, window.reference)
        result = self.last_window = exchange.result(step, self.wording, self.ranks)
        if self.participation is not None:
            self.participation.after_window(result.ranks_with_more, self.device, self.engine.group)
        if self.planner is not None:
            self.planner.received(result.following)
        if result.uncut and result.items > 0 and backward:
            _check_uncut(self.engine, result.uncut, self.device)
        self._reference.after(result.items, self.ranks)
        if result.items == 0 and backward:
            for param in self.engine.parameters():
                param.grad = None  # without gradients no torch optimizer touches a parameter or its state
            self.skipped_steps += 1
            self.batch.skipped = True
            rank_zero_warn(f"The global item count of the window ending at step {step} is 0: {self.wording.skipped}")
        return result


class LoopResults:
    """What a weighted strategy tells of its loop of windows, Trainer and Fabric alike.

    Callbacks and loops that read a window's result check ``isinstance(strategy, LoopResults)``.
    """

    _loop: WindowLoop | None

    @property
    def padding_step(self) -> bool:
        """The batch in progress is a replay of a rank whose data ran out (it counts for nothing)."""
        return self._loop is not None and self._loop.batch.replay

    @property
    def data_parallel_group(self) -> dist.ProcessGroup | None:
        """The ranks a window's counts are summed over, the ones that see different data (``None``: every rank)."""
        return self._loop.engine.group if self._loop is not None else None

    @property
    def skipped_steps(self) -> int:
        """Windows whose global ``N`` was 0: optimizer steps that changed nothing."""
        return self._loop.skipped_steps if self._loop is not None else 0

    @property
    def last_window(self) -> WindowResult | None:
        """The result of the last window."""
        return self._loop.last_window if self._loop is not None else None


def weighted(strategy: object, role: str) -> LoopResults:
    """``strategy`` where it is a weighted one; else a clear error, opening with what ``role`` says the caller does."""
    if not isinstance(strategy, LoopResults):
        raise ValueError(
            f"{role} a weighted strategy (`strategy='ddp_weighted'`), but the Trainer uses {type(strategy).__name__}."
            " Pass `strategy='ddp_weighted'` or drop the callback."
        )
    return strategy


_NEEDS_GRAPH = (
    "On rank {}, {} {}. Under {} every rank runs each microbatch's backward through the sharded model, whose"
    " collectives the other ranks wait in: give the loss of the model's forward (with a count of 0 for a microbatch"
    " that holds no item)."
)


def _what(loss: Tensor | None) -> str:
    return "None" if loss is None else "a loss that is not attached to the graph"


def multiply_gradients(parameters: Iterable[Tensor], factor: Tensor, reference: float | Tensor = 1.0) -> None:
    """Multiplies every local gradient (a shard, for a sharded parameter) by ``factor · reference``.

    One fused pass per device and dtype.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for param in parameters:
        grad = param.grad
        if grad is not None:
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            if local.numel():
                groups.setdefault((local.device, local.dtype), []).append(local)
    with torch.no_grad():
        for grads in groups.values():
            multiply(grads, factor * reference)


class Reference:
    """:math:`c` of the windows counted after: 1, or the size of one microbatch's count where losses stay mean-sized.

    Mean-sized (an fp16 backward, where item sums could overflow): the first window takes the largest first count
    over the ranks (one MAX all-reduce, once), each later one the mean count per microbatch of the window before.
    """

    def __init__(self, mean_sized: bool) -> None:
        self.mean_sized, self.microbatches = mean_sized, 0
        self._value: float | Tensor | None = None if mean_sized else 1.0

    @property
    def value(self) -> float | Tensor:
        """:math:`c` of the window in progress."""
        return 1.0 if self._value is None else self._value

    def take(self, count: Count | None, device: torch.device, group: dist.ProcessGroup | None) -> None:
        """Notes a microbatch of the window (its count, at the first window of mean-sized losses)."""
        if self._value is None:
            self._value = _first_reference(count, device, group)
        self.microbatches += 1

    def after(self, items: float, ranks: int) -> None:
        """Takes the next window's :math:`c` from the window that ended with ``items``."""
        if self.mean_sized and items > 0:
            self._value = items / (ranks * max(self.microbatches, 1))
        self.microbatches = 0


def _first_reference(count: Count | None, device: torch.device, group: dist.ProcessGroup | None) -> Tensor:
    """The largest first count over the ranks, 1 where none is positive."""
    first = torch.zeros((), dtype=torch.float64, device=device)
    if count is not None and not isinstance(count.problem, Problem):
        first = first + count.value
        if isinstance(count.problem, Tensor):  # a count on the device, checked there
            first = torch.where(count.problem == 0, first, 0.0)
    dist.all_reduce(first, op=dist.ReduceOp.MAX, group=group)
    return torch.where(first > 0, first, 1.0)


def _check_uncut(engine: Engine, ranks: int, device: torch.device) -> None:
    """Raises on every rank where a microbatch counted 0 with a non-finite loss put non-finite values into gradients.

    Counted 0 on the host (or a replay), its backward runs through its own graph and the engine cuts its own NaN
    (0/0) out of its gradients: exact, unless a collective of the model's backward carried the NaN to the other
    ranks. Counted 0 on the device, its loss was multiplied by 0, not cut: exact for a loss whose gradient is finite
    where nothing is counted (PyTorch's losses with ``ignore_index`` or weights are), NaN for a mean that divides by
    the count (0/0).
    """
    flag = torch.zeros(1, dtype=torch.float64, device=device)
    for param in engine.parameters():
        grad = param.grad
        if grad is not None:
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            flag += (~torch.isfinite(local._values() if local.is_sparse else local)).any()
    dist.all_reduce(flag, group=engine.group)
    if flag.item() == 0:
        return
    raise RuntimeError(
        f"On {ranks} rank(s), a microbatch whose count is 0 has a non-finite loss (the mean of a fully masked batch,"
        " 0/0), and NaN reached the gradients; nothing was stepped. Either a collective in the model's backward"
        " (SyncBatchNorm, `all_gather(..., sync_grads=True)`) carried it to the other ranks, or its count was a"
        " tensor, which the strategy does not read on the host (a device synchronisation), so the loss was"
        " multiplied by 0 rather than cut out of the gradients. Make the loss finite where nothing is counted: divide"
        " by `n.clamp(min=1)` (`max(n, 1)`), return the sum with `'reduction': 'sum'`, or use"
        " `F.cross_entropy(..., ignore_index=-100)`, whose gradient is then 0."
    )
