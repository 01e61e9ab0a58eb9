"""The windows of one fit or Fabric loop: a microbatch's facts in, its loss to backpropagate out (math: ``window``)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_weighted._compat import multiply
from lightning_weighted.count import Count, Counts, Problem, Wording, host_items, problem_error, read_count, valid_count
from lightning_weighted.engines import Engine
from lightning_weighted.parts import Parts
from lightning_weighted.payload import Slot, WindowResult, at, host_tensor, window_result
from lightning_weighted.window import Window, payload

__all__ = ["Exchange", "Output", "WindowLoop", "read_output", "terms"]


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
    parts, bad_parts = terms(output.get("parts"))
    aux, bad_aux = terms(output.get("aux"))
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
    return {str(name): term if term.dim() == 0 else term.reshape(()) for name, term in given.items()}, False


class Exchange:
    """A window's payload summed over ``group`` (one SUM; one more collective if a rank found a problem), read once."""

    def __init__(
        self,
        windows: Sequence[Window],
        more: bool,
        device: torch.device,
        group: dist.ProcessGroup | None,
        next_items: Sequence[float] = (),
    ) -> None:
        self.windows, self.group = windows, group
        self.parts = windows[0].parts.count if windows[0].parts is not None else len(windows)
        self.vector = payload(windows, more, device, next_items)  # the summed fields first: one SUM
        self.work = dist.all_reduce(self.vector[: at(Slot.LOCAL, self.parts).start], group=group, async_op=True)

    def items(self) -> Tensor:
        """Each part's ``N``, on the device (the device's stream waits for the SUM, not the host)."""
        self.work.wait()
        return self.vector[at(Slot.ITEMS, self.parts)]

    def read(self, wording: Wording) -> list[float]:
        """The summed payload (this rank's own ``LOCAL``), the one host read; raises any problem on every rank."""
        self.items()
        values: list[float] = self.vector.tolist()
        if values[Slot.INVALID] > 0:  # gather every rank's first problem
            rows = [w.problem_row(self.vector.device) for w in self.windows]
            row = next((r for r in rows if float(r[0]) > 0), rows[0])
            gathered = [row]
            if dist.is_initialized():
                gathered = [torch.empty_like(row) for _ in range(dist.get_world_size(self.group))]
                dist.all_gather(gathered, row, group=self.group)
            raise problem_error([g.tolist() for g in gathered], wording)
        return values


class WindowLoop:
    """The windows of one fit or Fabric loop over one engine; ``parts``: the loss parts' names (``()``: one loss)."""

    def __init__(self, engine: Engine, device: torch.device, wording: Wording, parts: Sequence[str] = ()) -> None:
        self.engine, self.device, self.wording, self.parts = engine, device, wording, tuple(parts)
        self.ranks = dist.get_world_size(engine.group)
        self.last_window: WindowResult | None = None
        self.skipped_steps = 0  # the windows that had no item (N = 0) and changed nothing
        self.ranks_with_more = 0  # from the last exchange: how many ranks hold real batches after its window
        self.next_totals: list[float] = []  # counted ahead: each part's N of the next window, from the last exchange
        self._window: Window | None = None
        self._planned: deque[Counts] = deque()  # each microbatch's planned counts, one per part, in order
        self._exchange: Exchange | None = None
        self._backward = False  # the window ran a backward
        self._loss: tuple[float | Tensor, Tensor | None, Tensor | None] = (0.0, None, None)  # factor, parts, aux
        self._microbatches = 0  # the window's microbatches so far, for the next window's c
        # c of the windows counted after: 1, or where losses stay mean-sized (fp16) one microbatch's count: the largest
        # first count over the ranks (one MAX, once; None until then), then the mean per microbatch of the window before
        self._typical: float | Tensor | None = None if engine.mean_sized else 1.0

    @property
    def open(self) -> bool:
        """Whether a window has microbatches that no exchange has ended yet."""
        return self._window is not None

    def plan(
        self, rows: Sequence[Counts], totals: Sequence[float | Tensor] | Tensor | None = None
    ) -> Sequence[float | Tensor] | Tensor:
        """Counts the next window ahead; returns each part's N (``totals``, else one SUM now, left on the device)."""
        if self._window is not None:
            raise RuntimeError("a window's counts were handed over while a window is open: once per window, first")
        if totals is None:  # every rank's valid counts summed
            totals = host_tensor(host_items(rows, len(self.parts) or 1), self.device)
            for row in rows:
                for k, count in enumerate(row.each() if row.problems is not None else ()):
                    if isinstance(count.value, Tensor) or isinstance(count.problem, Tensor):  # checked on its device
                        totals[k] += valid_count(count)  # an invalid one's problem is reported at the window's end
            dist.all_reduce(totals, group=self.engine.group)
        divisor, size = self.engine.divisor, self.ranks * len(rows)  # P M
        parts = Parts(rows, totals, divisor, self.device) if self.parts else None
        self._window = Window(total=None if parts else totals[0], divisor=divisor, microbatches=size, parts=parts)
        self._planned = deque(rows)
        return totals

    def add(self, output: Output, replay: bool = False, recount: Counts | None = None) -> None:
        """Records one microbatch's loss factor, or its problem, in the window.

        ``replay``: it replays a batch of a rank whose data ran out, and contributes nothing; ``recount``: counted
        ahead, each part's count of the batch the step received, which must agree with the plan.
        """
        window = self._open(None if replay else output.count)
        self._microbatches += 1
        planned = self._planned.popleft() if self._planned else None
        given = output.parts or {}  # each counted part's loss, in the counted order (None where one is missing)
        losses = [given.get(name) for name in self.parts] if self.parts else [output.loss]
        problem = None if replay else _problem(output, losses, len(self.parts), planned is not None)
        count = planned.each()[0] if planned is not None and not self.parts else output.count
        if planned is not None and problem is None and not replay:  # a count given, or counted again, must agree
            if output.count is not None:
                window.check(output.count, planned.each()[0])
            for again, planned_count in zip(recount.each() if recount else (), planned.each(), strict=False):
                window.check(again, planned_count, Problem.CHANGED)
        if replay or problem is not None or (count is None and planned is None):
            if not replay:
                window.reject(problem or Problem.MISSING)
            graph = losses[0]
            if self.parts:  # the parts' total, of those given
                present = [loss.reshape(()) for loss in losses if loss is not None]
                graph = torch.stack(present).sum() if present else None
            if replay and graph is not None and graph.grad_fn is not None:
                window.empty(graph)
            self._loss = (0.0, graph if self.parts else None, None)
            return
        parts = window.parts
        weight = window.add(count, losses[0], output.item_sum) if parts is None and count is not None else 0.0
        aux = None
        if output.aux and not window.ahead:  # counted after, N would divide the terms too
            window.reject(Problem.AUX_AFTER)
        elif output.aux:  # the terms' factor: D / (P M)
            aux = torch.stack(list(output.aux.values())).sum() * (window.divisor / window.microbatches)
        if parts is None:
            factor, loss = window.factor(weight), losses[0]
        else:
            microbatch = parts.microbatches - len(self._planned) - 1
            factor, loss = parts.loss(microbatch, output.item_sum, torch.stack(losses))  # type: ignore[arg-type]
        if isinstance(factor, float) and factor == 0 and loss is not None:  # no item (of any part)
            window.empty(loss)  # it backpropagates all the same; whether its loss is finite is checked
        self._loss = (factor, None if parts is None else loss, aux)

    def _open(self, count: Count | None) -> Window:
        """The window in progress (a new one, counted after, where none is)."""
        if self._window is None:
            if self._typical is None:
                first = torch.zeros((), dtype=torch.float64, device=self.device) + valid_count(count)
                dist.all_reduce(first, op=dist.ReduceOp.MAX, group=self.engine.group)
                self._typical = torch.where(first > 0, first, 1.0)
            self._window = Window(self._typical)
        return self._window

    def drop(self) -> None:
        """Forgets the window in progress (before its exchange), whose gradient Lightning drops as it ends an epoch."""
        assert self._exchange is None
        self._window, self._planned, self._backward, self._microbatches = None, deque(), False, 0

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
            raise RuntimeError(
                f"On rank {dist.get_rank()}, {self.wording.source} {what}. Under {self.wording.strategy} every rank"
                " runs each microbatch's backward through the sharded model, whose collectives the other ranks wait in:"
                " give the loss of the model's forward (with a count of 0 for a microbatch that holds no item)."
            )
        return self.engine.empty(loss)

    def end(self, more: bool, next_items: Sequence[float] = ()) -> None:
        """Starts the window's exchange (:func:`payload`) right before the backward that ends it, to overlap them."""
        if self._exchange is None:
            self._exchange = Exchange([self._open(None)], more, self.device, self.engine.group, next_items)

    def finish(self, step: int, more: bool = True, next_items: Sequence[float] = ()) -> WindowResult:
        """Ends the window after its last backward (if any): brings N to the gradients, decides on every rank alike."""
        self.end(more, next_items)
        window, exchange, backward = self._window, self._exchange, self._backward
        self._window, self._planned, self._exchange, self._backward = None, deque(), None, False
        assert window is not None and exchange is not None
        if backward and not window.ahead:  # one loss, counted after: the gradients times D c / N (N = 0: dropped)
            multiply_gradients(self.engine.parameters(), self.engine.divisor * window.scale / exchange.items()[0])
        values = exchange.read(self.wording)
        names = self.parts if window.parts is not None else ()
        result = self.last_window = window_result(values, step, names)
        self.ranks_with_more, self.next_totals = round(values[Slot.MORE]), values[at(Slot.NEXT, max(len(names), 1))]
        nan_empty = round(values[Slot.NAN_EMPTY])
        if nan_empty and result.items > 0 and backward:
            _check_nan_empty(self.engine, nan_empty, self.device)
        if self.engine.mean_sized and result.items > 0:  # the next window's c
            self._typical = result.items / (self.ranks * max(self._microbatches, 1))
        self._microbatches = 0
        if result.items == 0 and backward:
            for param in self.engine.parameters():
                param.grad = None  # without gradients no torch optimizer touches a parameter or its state
            self.skipped_steps += 1
        return result


def _problem(output: Output, losses: list[Tensor | None], parts: int, ahead: bool) -> Problem | None:
    """What keeps a microbatch's output from being weighted, if anything."""
    if output.problem is not None:
        return output.problem
    named = output.parts is not None or parts > 0
    if named and not ahead:
        return Problem.PARTS_AFTER
    if output.parts is not None and not parts:
        return Problem.PARTS_UNCOUNTED
    if named and (output.parts is None or len(output.parts) != parts or output.count is not None):
        return Problem.PARTS
    if not all(isinstance(loss, Tensor) for loss in losses):  # as many names as counted: one lost, one new
        return Problem.PARTS if parts else Problem.NO_LOSS
    if parts:  # each part needs a gradient
        return None if all(loss.requires_grad for loss in losses) else Problem.NO_GRAPH  # type: ignore[union-attr]
    return Problem.NO_GRAPH if losses[0].grad_fn is None else None  # type: ignore[union-attr]  # a Tensor


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


def _check_nan_empty(engine: Engine, ranks: int, device: torch.device) -> None:
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
