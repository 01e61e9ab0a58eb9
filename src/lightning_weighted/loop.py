"""The loop of windows of one fit or one Fabric loop: a microbatch in, its loss to backpropagate out, one exchange.

The front ends (``trainer/``, ``fabric/``) hand it each microbatch's facts as arguments and keep no window rule of
their own. The objective and the two count paths: :mod:`lightning_weighted.window`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import cycle

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_weighted._compat import multiply
from lightning_weighted.engines import Engine
from lightning_weighted.window import (
    SUMMED,
    Count,
    Problem,
    Slot,
    Window,
    WindowResult,
    Wording,
    host_tensor,
    payload,
    problem_error,
    read_count,
)

__all__ = ["Exchange", "Output", "WindowLoop", "combined_result", "read_output", "summed_counts", "terms"]


@dataclass(frozen=True)
class Output:
    """What one microbatch handed over: its loss (or named parts), its count, and how to read them."""

    loss: Tensor | None  # the mean over the microbatch's valid items (their sum with `item_sum`)
    count: Count | None = None  # the count given with it (read once)
    item_sum: bool = False  # `loss` (each part) is a sum over the items rather than their mean
    parts: Mapping[str, Tensor] | None = None  # each the mean (or sum) over its own items; `loss` is what DDP trains
    aux: Mapping[str, Tensor] | None = None  # averaged over the window's microbatches and ranks as plain DDP averages
    problem: Problem | None = None  # what is wrong with the output itself (a bad `reduction`, `aux` or `parts`)


def read_output(output: object) -> Output:
    """What a step returned: a loss, or a dict of ``"loss"``, ``"count"``, ``"reduction"``, ``"parts"``, ``"aux"``."""
    if not isinstance(output, Mapping):
        return Output(output if isinstance(output, Tensor) else None)
    loss = output.get("loss")
    reduction = output.get("reduction", "mean")
    (parts, bad_parts), (aux, bad_aux) = terms(output.get("parts")), terms(output.get("aux"))
    problem = Problem.AUX if bad_aux else Problem.PARTS if bad_parts else None
    if reduction not in ("mean", "sum"):
        problem = Problem.REDUCTION
    count = read_count(output["count"]) if "count" in output else None
    return Output(loss if isinstance(loss, Tensor) else None, count, reduction == "sum", parts, aux, problem)


def terms(given: object) -> tuple[dict[str, Tensor] | None, bool]:
    """Named one-element tensors (``"parts"``, ``"aux"``), and whether ``given`` is something else."""
    if given is None:
        return None, False
    if not isinstance(given, Mapping) or not all(isinstance(t, Tensor) and t.numel() == 1 for t in given.values()):
        return None, True
    return {str(name): term.reshape(()) for name, term in given.items()}, False


class Exchange:
    """Every part's payload summed over ``group``, started at once without waiting; read on the host once.

    Where a rank found a problem, every rank learns which in one more collective: a healthy window costs the SUM.
    """

    def __init__(
        self,
        windows: Sequence[Window],
        more: bool,
        device: torch.device,
        group: dist.ProcessGroup | None,
        next_items: Sequence[float] = (),
        losses: Tensor | None = None,
    ) -> None:
        self.windows, self.group = windows, group
        self.vector = payload(windows, more, device, next_items, losses)  # the summed fields first: one SUM
        self.work = dist.all_reduce(self.vector[: SUMMED * len(windows)], group=group, async_op=True)

    def items(self) -> Tensor:
        """Each part's ``N``, on the device (the device's stream waits for the SUM, not the host)."""
        self.work.wait()
        return self.vector[Slot.ITEMS : SUMMED * len(self.windows) : SUMMED]

    def read(self, wording: Wording) -> list[list[float]]:
        """Each part's summed payload, the one host read; raises the window's error on every rank alike."""
        self.items()
        values, parts = self.vector.tolist(), len(self.windows)
        summed = [[*values[k * SUMMED : (k + 1) * SUMMED], values[parts * SUMMED + k]] for k in range(parts)]
        if any(s[Slot.INVALID] > 0 for s in summed):
            raise problem_error(self._rows(), wording)
        return summed

    def _rows(self) -> list[list[float]]:
        rows = [w.problem_row(self.vector.device) for w in self.windows]
        row = next((r for r in rows if float(r[0]) > 0), rows[0])
        if not dist.is_initialized():
            return [row.tolist()]
        gathered = [torch.empty_like(row) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(gathered, row, group=self.group)
        return [g.tolist() for g in gathered]


class WindowLoop:
    """The windows of one fit or one Fabric loop, over one engine (see the module docstring).

    Args:
        engine: how the engine's reduction meets the counts (:mod:`lightning_weighted.engines`).
        device: where the gradients live.
        wording: how errors name the call that handed over the loss and its count.
        parts: the names of the loss parts, each counted ahead into a window of its own; ``()``: one loss.
    """

    def __init__(self, engine: Engine, device: torch.device, wording: Wording, parts: Sequence[str] = ()) -> None:
        self.engine, self.device, self.wording, self.parts = engine, device, wording, tuple(parts)
        self.ranks = dist.get_world_size(engine.group)
        self.last_window: WindowResult | None = None
        self.skipped_steps = 0  # the windows that had no item (N = 0) and changed nothing
        self.ranks_with_more = 0  # from the last exchange: how many ranks hold real batches after its window
        self.next_totals: list[float] = []  # counted ahead: each part's N of the next window, from the last exchange
        self._windows: list[Window] = []
        self._planned: list[deque[Count]] = []  # each part's planned counts, taken in order by `add`
        self._exchange: Exchange | None = None
        self._backward = False  # the window ran a backward
        self._loss: tuple[float | Tensor, Tensor | None, Tensor | None] = (0.0, None, None)  # factor, parts, aux
        self._typical = TypicalCount(engine.mean_sized)
        self._parts: PartLosses | None = None  # the window's named parts, counted ahead

    @property
    def open(self) -> bool:
        """Whether a window has microbatches that no exchange has ended yet."""
        return bool(self._windows)

    def plan(
        self, counts: Sequence[Sequence[Count]], totals: Sequence[float | Tensor] | None = None
    ) -> Sequence[float | Tensor]:
        """Counts the next window ahead: each part's counts and N (``totals``, else one SUM now); returns the N."""
        if self._windows:
            raise RuntimeError("a window's counts were handed over while a window is open: once per window, first")
        if totals is None:
            totals = list(summed_counts(counts, self.device, self.engine.group))
        microbatches = self.ranks * max((len(c) for c in counts), default=0)
        self._windows = [Window(total=t, divisor=self.engine.divisor, microbatches=microbatches) for t in totals]
        self._planned = [deque(c) for c in counts]
        self._parts = PartLosses(counts, totals, self.engine.divisor, self.device) if self.parts else None
        return totals

    def add(self, output: Output, replay: bool = False, recount: Sequence[Count] = ()) -> None:
        """Records one microbatch: its loss factor, or its problem, in the window.

        Args:
            output: what the microbatch handed over.
            replay: it replays a batch of a rank whose data ran out: it contributes nothing.
            recount: counted ahead, each part's count of the batch the step received, which must agree with the plan.
        """
        windows = self._open(None if replay else output.count)
        self._typical.microbatches += 1
        planned = [p.popleft() for p in self._planned] if self._planned and self._planned[0] else None
        losses = [(output.parts or {}).get(name) for name in self.parts] if self.parts else [output.loss]
        problem = None if replay else _problem(output, losses, self.parts, planned is not None)
        counts = planned or ([output.count] if output.count is not None else [])
        if planned is not None and problem is None and not replay:  # a count given, or counted again, must agree
            if output.count is not None:
                windows[0].check(output.count, planned[0])
            for window, again, count in zip(windows, recount, planned, strict=False):
                window.check(again, count, Problem.CHANGED)
        if replay or problem is not None or len(counts) < len(windows):
            if not replay:
                windows[0].reject(problem or Problem.MISSING)
            graph = _total(losses) if self.parts else losses[0]
            if replay and graph is not None and graph.grad_fn is not None:
                windows[0].empty(graph)
            self._loss = (0.0, graph if self.parts else None, None)
            return
        kept = [None] * len(windows) if self.parts else losses  # the parts' losses are summed by `PartLosses`
        weights = [w.add(c, x, output.item_sum) for w, c, x in zip(windows, counts, kept, strict=True)]
        share = windows[0].aux_factor()
        if output.aux and share is None:
            windows[0].reject(Problem.AUX_AFTER)
        aux = torch.stack(list(output.aux.values())).sum() * share if output.aux and share is not None else None
        if not self.parts:
            factor = windows[0].factor(weights[0])
            if isinstance(factor, float) and factor == 0 and losses[0] is not None:
                windows[0].empty(losses[0])  # it backpropagates all the same; whether its loss is finite is checked
            self._loss = (factor, None, aux)
            return
        stacked = torch.stack(losses)  # type: ignore[arg-type]  # none is None (`_problem`)
        if all(isinstance(w, float) and w == 0 for w in weights):
            windows[0].empty(stacked)
            self._loss = (0.0, stacked, aux)  # nothing in any part: the engine's exact zero
        else:
            assert self._parts is not None
            row = self._parts.microbatches - len(self._planned[0]) - 1
            self._loss = (1.0, self._parts.loss(row, output.item_sum, stacked), aux)

    def _open(self, count: Count | None) -> list[Window]:
        """The window in progress (new ones, counted after, where none is)."""
        if not self._windows:
            self._typical.take(count, self.device, self.engine.group)
            self._windows = [Window(self._typical.value) for _ in self.parts or ("",)]
        return self._windows

    def drop(self) -> None:
        """Forgets the window in progress (before its exchange), whose gradient Lightning drops as it ends an epoch."""
        assert self._exchange is None
        self._windows, self._planned, self._backward, self._parts = [], [], False, None
        self._typical.microbatches = 0

    def backward_loss(self, loss: Tensor | None, multiplier: float = 1.0) -> Tensor:
        """The loss to backpropagate: ``loss · factor · multiplier`` (each part its own) plus the auxiliary terms."""
        factor, parts, aux = self._loss
        self._backward = True
        graph = parts if self.parts else loss
        if isinstance(factor, Tensor):  # a count on the device: never compared on the host
            scaled = graph * (factor if multiplier == 1 else factor * multiplier)  # type: ignore[operator]
        elif factor == 0:
            scaled = self.engine.empty(graph) if graph is not None and graph.grad_fn else self.refused(graph)
        else:
            assert graph is not None
            scaled = graph if self.parts or factor * multiplier == 1 else graph * (factor * multiplier)
        return scaled if aux is None else scaled + aux

    def refused(self, loss: Tensor | None) -> Tensor:
        """A zero loss for a microbatch that cannot be weighted; raises where the engine needs the model's graph."""
        if self.engine.needs_graph:
            what = "None" if loss is None else "a loss that is not attached to the graph"
            raise RuntimeError(_NEEDS_GRAPH.format(dist.get_rank(), self.wording.source, what, self.wording.strategy))
        return self.engine.empty(loss)

    def end(self, more: bool, next_items: Sequence[float] = ()) -> None:
        """Starts the window's exchange, right before the backward that ends it, so that the two overlap.

        Args:
            more: whether this rank holds real batches after the window.
            next_items: counted ahead, this rank's items of each part in the next window.
        """
        if self._exchange is None:
            windows = self._open(None)
            losses = self._parts.sums(windows[0]) if self._parts is not None else None
            self._exchange = Exchange(windows, more, self.device, self.engine.group, next_items, losses)

    def finish(self, step: int, more: bool = True, next_items: Sequence[float] = ()) -> WindowResult:
        """Ends the window after its last backward: brings ``N`` to the gradients and decides, on every rank alike.

        A window that ran no backward leaves its gradients as they are; ``more`` and ``next_items`` as for :meth:`end`.
        """
        self.end(more, next_items)
        windows, exchange, backward = self._windows, self._exchange, self._backward
        self._windows, self._planned, self._exchange, self._backward, self._parts = [], [], None, False, None
        assert exchange is not None
        if backward and not windows[0].ahead:  # one part, counted after: the gradients times D c / N
            items = exchange.items()[0]
            scale = torch.where(items > 0, self.engine.divisor / items, 0.0) * windows[0].scale
            multiply_gradients(self.engine.parameters(), scale)
        summed = exchange.read(self.wording)
        results = [w.result(s, step) for w, s in zip(windows, summed, strict=True)]
        result = self.last_window = combined_result(step, self.parts, results)
        self.ranks_with_more, self.next_totals = round(summed[0][Slot.MORE]), [s[Slot.NEXT] for s in summed]
        nan_empty = round(max(s[Slot.NAN_EMPTY] for s in summed))
        if nan_empty and result.items > 0 and backward:
            _check_nan_empty(self.engine, nan_empty, self.device)
        self._typical.after(result.items, self.ranks)
        if result.items == 0 and backward:
            for param in self.engine.parameters():
                param.grad = None  # without gradients no torch optimizer touches a parameter or its state
            self.skipped_steps += 1
        return result


def _problem(output: Output, losses: list[Tensor | None], parts: tuple[str, ...], ahead: bool) -> Problem | None:
    """What keeps a microbatch's output from being weighted, if anything."""
    if output.problem is not None:
        return output.problem
    if (output.parts is not None or parts) and not ahead:
        return Problem.PARTS_AFTER
    names = set(output.parts) if output.parts is not None else None
    if (names is not None or parts) and (names != set(parts) or output.count is not None):
        return Problem.PARTS
    if any(loss is None for loss in losses):
        return Problem.NO_LOSS
    return Problem.NO_GRAPH if any(loss is not None and loss.grad_fn is None for loss in losses) else None


def _total(tensors: Iterable[Tensor | None]) -> Tensor | None:
    present = [t for t in tensors if t is not None]
    return torch.stack([t.reshape(()) for t in present]).sum() if present else None


def combined_result(step: int, names: tuple[str, ...], results: list[WindowResult]) -> WindowResult:
    """The result of a window: its one part's, or for several their items summed and the sum of their means."""
    if not names:
        return results[0]
    means = [r.loss for r in results if r.items > 0]
    parts = dict(zip(names, results, strict=True))
    local = sum(r.local_items for r in results)
    return WindowResult(step, sum(r.items for r in results), local, sum(means) if means else math.nan, parts)


def summed_counts(counts: Sequence[Sequence[Count]], device: torch.device, group: dist.ProcessGroup | None) -> Tensor:
    """Each part's SUM over ``group`` of every rank's valid ``counts``, left on the device (one all-reduce)."""
    total = torch.zeros(max(len(counts), 1), dtype=torch.float64, device=device)
    for k, part in enumerate(counts):
        for count in part:
            total[k] += _valid(count)  # an invalid one's problem is reported at the window's end
    dist.all_reduce(total, group=group)
    return total


def _valid(count: Count | None) -> float | Tensor:
    """A count's value where it is valid, else 0 (a count on a device is checked there)."""
    if count is None or isinstance(count.problem, Problem):
        return 0.0
    return count.value if count.problem is None else torch.where(count.problem == 0, count.value, 0.0)


def multiply_gradients(parameters: Iterable[Tensor], factor: Tensor | float) -> None:
    """Multiplies every local gradient (a shard, for a sharded parameter) by ``factor``, one fused pass per dtype."""
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for local in _local_gradients(parameters):
        if local.numel():
            groups.setdefault((local.device, local.dtype), []).append(local)
    with torch.no_grad():
        for grads in groups.values():
            multiply(grads, factor)


def _local_gradients(parameters: Iterable[Tensor]) -> Iterator[Tensor]:
    for param in parameters:
        if param.grad is not None:
            yield param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad


class PartLosses:
    r"""The named parts of one window counted ahead, all :math:`K` at once: a fixed number of tensor operations.

    Microbatch :math:`m` backpropagates :math:`\sum_k f_{mk} \ell_{mk}`, with the factors and weights of
    :meth:`Window.factor` and :meth:`Window.add` made at the plan, one copy to the device per window; each part's
    :math:`\sum_m w_{mk} \ell_{mk}` for its log is summed once, as the window's payload is built.
    """

    def __init__(
        self, counts: Sequence[Sequence[Count]], totals: Sequence[float | Tensor], divisor: int, device: torch.device
    ) -> None:
        self.microbatches = len(counts[0]) if counts else 0
        valid = [_valid(part[m]) for m in range(self.microbatches) for part in counts]  # weights of a mean, m-major
        weights = valid + [(v > 0).double() if isinstance(v, Tensor) else float(v > 0) for v in valid]  # of a sum
        parts = len(counts)
        if all(isinstance(v, float) for v in (*valid, *totals)):
            factors = [w * divisor / t if t > 0 else 0.0 for w, t in zip(weights, cycle(totals))]  # Window.factor
            table = host_tensor(weights + factors, device).view(2, -1, parts)  # type: ignore[arg-type]  # floats
            self.weights, self.factors = table[0], table[1]
        else:
            as_tensor = partial(torch.as_tensor, dtype=torch.float64, device=device)
            self.weights = torch.stack([as_tensor(w) for w in weights]).view(-1, parts)
            total = torch.stack([as_tensor(t) for t in totals])
            self.factors = torch.where(total > 0, self.weights * divisor / total, 0.0)
        self.some_empty = not all(isinstance(v, float) and v > 0 for v in valid)
        self._weight_rows = self.weights.unbind(0)
        self._rows: dict[torch.dtype, Sequence[Tensor]] = {}
        self._held: list[tuple[int, Tensor]] = []

    def loss(self, microbatch: int, item_sum: bool, losses: Tensor) -> Tensor:
        """What microbatch ``microbatch`` backpropagates, from its stacked ``losses`` (a mean each, or an item sum)."""
        row = microbatch + (self.microbatches if item_sum else 0)
        rows = self._rows.get(losses.dtype)
        if rows is None:
            rows = self._rows[losses.dtype] = self.factors.to(losses.dtype).unbind(0)
        self._held.append((row, losses.detach()))
        return (losses * rows[row]).sum()

    def sums(self, window: Window) -> Tensor | None:
        """Each part's ``Σ_m w_mk · loss_mk``, or ``None``; a loss of weight 0 adds 0 (``window`` notes it)."""
        if not self._held:
            return None
        losses = torch.stack([loss for _, loss in self._held]).double()
        weights = torch.stack([self._weight_rows[row] for row, _ in self._held])
        if not self.some_empty:
            return (losses * weights).sum(0)
        valid = weights > 0
        window.empty(torch.where(valid, 0.0, losses))
        return torch.where(valid, losses * weights, 0.0).sum(0)


class TypicalCount:
    """:math:`c` of the windows counted after: 1, or where losses stay mean-sized (fp16) one microbatch's count.

    That is the largest first count over the ranks (one MAX, once), then the mean per microbatch of the window before.
    """

    def __init__(self, mean_sized: bool) -> None:
        self.mean_sized, self.microbatches = mean_sized, 0
        self._value: float | Tensor | None = None if mean_sized else 1.0

    @property
    def value(self) -> float | Tensor:
        """:math:`c` of the window in progress."""
        return 1.0 if self._value is None else self._value

    def take(self, count: Count | None, device: torch.device, group: dist.ProcessGroup | None) -> None:
        """Notes a window's first microbatch (its count, at the first window of mean-sized losses)."""
        if self._value is None:
            first = torch.zeros((), dtype=torch.float64, device=device) + _valid(count)
            dist.all_reduce(first, op=dist.ReduceOp.MAX, group=group)
            self._value = torch.where(first > 0, first, 1.0)

    def after(self, items: float, ranks: int) -> None:
        """Takes the next window's :math:`c` from the window that ended with ``items``."""
        if self.mean_sized and items > 0:
            self._value = items / (ranks * max(self.microbatches, 1))
        self.microbatches = 0


def _check_nan_empty(engine: Engine, ranks: int, device: torch.device) -> None:
    """Raises on every rank where a microbatch counted 0 with a non-finite loss put non-finite values into gradients."""
    flag = torch.zeros(1, dtype=torch.float64, device=device)
    for local in _local_gradients(engine.parameters()):
        flag += (~torch.isfinite(local.coalesce().values() if local.is_sparse else local)).any()
    dist.all_reduce(flag, group=engine.group)
    if flag.item() == 0:
        return
    raise RuntimeError(
        f"On {ranks} rank(s), a microbatch whose count is 0 has a non-finite loss (the mean of a fully masked batch,"
        " 0/0), and NaN reached the gradients; nothing was stepped. Either a collective in the model's backward"
        " (SyncBatchNorm, `all_gather(..., sync_grads=True)`) carried it to the other ranks, or the loss was"
        " multiplied by 0 rather than cut out of the gradients: a count on the device is never read on the host,"
        " and a loss part counted 0 beside others still runs its backward. Make the loss finite where nothing is"
        " counted: divide by `n.clamp(min=1)` (`max(n, 1)`), return the sum with `'reduction': 'sum'`, or use"
        " `F.cross_entropy(..., ignore_index=-100)`, whose gradient is then 0."
    )


_NEEDS_GRAPH = (
    "On rank {}, {} {}. Under {} every rank runs each microbatch's backward through the sharded model, whose"
    " collectives the other ranks wait in: give the loss of the model's forward (with a count of 0 for a microbatch"
    " that holds no item)."
)
