"""What every weighted Fabric strategy adds to its Fabric strategy: ``fabric.backward(loss, count=n)`` into the loop."""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import zip_longest
from typing import Any, Literal

from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.utilities import rank_zero_info, rank_zero_warn
from lightning.fabric.utilities.types import Optimizable
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_weighted._compat import unfloored
from lightning_weighted.count import FABRIC, Counts, Problem, read_count, read_counts
from lightning_weighted.engines import Engine
from lightning_weighted.fabric._loader import FabricLoader, Yielded
from lightning_weighted.loaders import Participation, Policy
from lightning_weighted.loop import Output, WindowLoop, terms
from lightning_weighted.strategy import WeightedStrategy

WindowCounts = Sequence[object] | Mapping[str, Sequence[object]]  # a window's counts: one loss's, or each named part's


class WeightedFabricStrategy(WeightedStrategy, ParallelStrategy):
    """Put before a Fabric strategy: hooks that call into a ``WindowLoop`` (the contract: ``docs/fabric.md``)."""

    strategy_name: str
    _accumulating = False  # inside a sharded strategy's `fabric.no_backward_sync(model)`, set by `MarkWindow`

    def __init__(self, *args: Any, participation: Policy = "pad", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._policy = Participation(participation).policy  # checked now, where the user passed it
        self._loop: WindowLoop | None = None  # the last model's (what `last_window` and the like tell)
        self._models = _Models()
        self._yielded = Yielded()
        self._implicit_noted = False  # a backward without a count was said to weight microbatches alike

    @property
    @override
    def padding_step(self) -> bool:
        *_, replay = self._yielded.last()
        return replay

    def _start(self, engine: Engine, module: Module) -> None:
        self._loop = WindowLoop(engine, self.root_device, replace(FABRIC, strategy=self.strategy_name))
        self._models[id(module)] = _Windows(self._loop)

    def count_ahead(self, counts: WindowCounts, integer: bool = False, model: Module | None = None) -> None:
        """Hands over the counts of the next window's microbatches, fetched already, before its first forward.

        ``fabric.backward`` takes them in order (a ``count=`` given there must agree), a replay's counting 0.
        ``integer``: whole numbers only. A dict of named parts (``{"policy": [...], "kl": [...]}``) averages each
        over its own ``N``; a part given fewer counts than another is refused at the window's end, on every rank.
        ``model``: whose window they count, where several models are set up (as ``fabric.backward(..., model=)``).
        """
        windows = self._models.of(getattr(model, "_forward_module", model))
        named = dict(counts) if isinstance(counts, Mapping) else {"": counts}
        windows.loop.parts = tuple(name for name in named if name)  # the parts this window averages, each over its N
        replays = self._yielded.replays(max((len(c) for c in named.values()), default=0))
        rows: list[Counts] = []  # each microbatch's counts, read where they live (on the host in host memory)
        for row, replay in zip(zip_longest(*named.values()), replays, strict=True):  # a shorter part's missing: None
            host = all(not isinstance(c, Tensor) or c.device.type == "cpu" for c in row)
            rows.append(Counts((0.0,) * len(row)) if replay else read_counts(row, (integer,) * len(row), host=host))
        windows.loop.plan(rows)
        windows.planned = deque(replays)

    def _syncs(self, engine: Engine) -> bool:
        """Whether the coming backward reduces gradients across ranks (it does not inside ``no_backward_sync``)."""
        return not self._accumulating

    def _local(self, engine: Engine) -> contextlib.AbstractContextManager[Any]:
        """Keeps a backward's gradients local although it would sync: it does not end the window."""
        return contextlib.nullcontext()

    @override
    def backward(
        self,
        tensor: Tensor,
        module: Module | None,
        *args: Any,
        count: object = None,
        reduction: Literal["mean", "sum"] = "mean",
        window_end: bool | None = None,
        aux: dict[str, Tensor] | None = None,
        parts: dict[str, Tensor] | None = None,
        **kwargs: Any,
    ) -> None:
        """``fabric.backward(loss, count=n)``: backpropagates ``loss`` weighted by its count within the window.

        Args:
            tensor: the mean over the microbatch's ``count`` valid items (see ``reduction``); unused with ``parts``.
            module: what Fabric passes (the module given as ``model=``, or ``None``).
            *args: passed on to the precision plugin's backward.
            count: the number of valid items (or the sum of sample weights), finite and ``>= 0``.
            reduction: ``"mean"`` or ``"sum"``, what ``tensor`` (each part) is over the items.
            window_end: whether it ends the window; by default one outside ``fabric.no_backward_sync(model)`` does.
            aux: named auxiliary terms (a MoE load-balancing loss), averaged as plain DDP averages; counts ahead only.
            parts: named loss parts, each the mean (or sum) over its own items, counted by :meth:`count_ahead`.
            **kwargs: passed on to the precision plugin's backward.
        """
        windows = self._models.of(module)
        loop = windows.loop
        syncs = self._syncs(loop.engine)
        ends = _ends_window(syncs, window_end, reduction)
        if not loop.open:
            loop.parts = ()  # a window counted after its forwards: one loss
        planned = bool(windows.planned)
        participation, position, last_replay = self._yielded.last()  # the loader's batch yielded last
        replay = windows.planned.popleft() if planned else last_replay
        if count is None and parts is None and not planned:  # a loop written for plain DDP: microbatches alike
            count = 1
            if not self._implicit_noted:
                self._implicit_noted = True
                rank_zero_info(_IMPLICIT.format(self.strategy_name))
        self._yielded.backwards += 1
        loop.add(_step(tensor, count, reduction, parts, aux), replay)
        scaled = loop.backward_loss(tensor)
        more = participation is None or participation.has_more(position)
        if ends:
            loop.end(more)
        try:
            with self._local(loop.engine) if syncs and not ends else contextlib.nullcontext():
                super().backward(scaled, module, *args, **kwargs)
        finally:
            loop.engine.after_backward()
        if ends:
            result = loop.finish(loop.last_window.step + 1 if loop.last_window is not None else 0, more)
            windows.planned.clear()
            if participation is not None:
                participation.after_window(loop.ranks_with_more, position, loop.engine.group, self.root_device)
            if result.items == 0:  # the loop dropped the gradients: the optimizer steps after it change nothing
                rank_zero_warn(f"The global item count of window {result.step} is 0: {_SKIPPED}")

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        windows = self._models.stepped_by(optimizer)
        _check_closed(windows, "optimizer.step()")
        last = windows.loop.last_window if windows is not None else None
        if last is not None and last.items == 0:
            return None  # a window without items (its gradients dropped): no parameter, no optimizer state changes
        return super().optimizer_step(optimizer, **kwargs)

    @override
    def clip_gradients_norm(self, module: Module, optimizer: Optimizer, *args: Any, **kwargs: Any) -> Tensor:
        _check_closed(self._models.get(id(module)), "fabric.clip_gradients")
        return super().clip_gradients_norm(module, optimizer, *args, **kwargs)

    @override
    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float | int) -> None:
        _check_closed(self._models.get(id(module)), "fabric.clip_gradients")
        super().clip_gradients_value(module, optimizer, clip_val)

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        return FabricLoader(dataloader, self._policy, self.root_device, self._yielded).loader

    @override
    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True, weights_only: Any = None) -> Any:
        # Fabric's sharded FSDP loads put a saved object's state in its place, its others load it into it: here all do
        held = {key: obj for key, obj in state.items() if _holds_state(obj)} if isinstance(state, dict) else {}
        remainder = super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        for key, obj in held.items():
            if state[key] is not obj:
                obj.load_state_dict(state[key])
                state[key] = obj
        return remainder

    @override
    def all_reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        tensor = unfloored(tensor, reduce_op) if isinstance(tensor, Tensor) else tensor
        return super().all_reduce(tensor, group=group, reduce_op=reduce_op)  # type: ignore[safe-super]


class _Models(dict[int, "_Windows"]):
    """Each set-up model's windows, by the id of what ``setup_module`` returned for it."""

    def of(self, module: Module | None) -> _Windows:
        """The windows of the set-up model ``module`` (``None``: the one model set up)."""
        if module is not None and id(module) in self:
            return self[id(module)]
        if not self:
            raise RuntimeError(_NO_MODEL)
        if len(self) > 1:
            raise RuntimeError(_WHICH_MODEL.format(len(self)))
        return next(iter(self.values()))

    def stepped_by(self, optimizer: Optimizable) -> _Windows | None:
        """The windows of the model whose parameters ``optimizer`` steps (``None``: none set up)."""
        first = next((p for group in optimizer.param_groups for p in group["params"]), None)
        for windows in self.values():
            if windows.parameters is None:
                windows.parameters = {id(p) for p in windows.loop.engine.parameters()}
            if id(first) in windows.parameters:
                return windows
        return None


@dataclass
class _Windows:
    """One set-up model's windows: its loop, the replays of the window counted ahead, its parameters."""

    loop: WindowLoop
    planned: deque[bool] = field(default_factory=deque)  # counted ahead: whether each microbatch is a replay
    parameters: set[int] | None = None  # the ids of its parameters, to find the optimizer that steps it


_SKIPPED = (
    "the optimizer steps after it change nothing. A loop that steps an LR scheduler can skip it when"
    " `fabric.strategy.last_window.items == 0`."
)
_IMPLICIT = (
    "{}: fabric.backward got no count, so each microbatch's loss is weighted alike (a replay counts 0): a step follows"
    " the mean of its microbatches' losses over every rank, as plain DDP's does with one microbatch a step (a loss"
    " already divided by the number of microbatches is divided again). If the loss is a mean over tokens or sample"
    " weights, pass their number: `fabric.backward(loss, count=n)`, or the window's counts to"
    " `fabric.strategy.count_ahead`; `count=1` keeps this and silences it."
)
_WHICH_MODEL = (
    "{} models are set up, each trained in windows of its own: say which one a loss trains with"
    " `fabric.backward(loss, model=model, ...)` (and `fabric.strategy.count_ahead(counts, model=model)`), or set up"
    " the modules trained together as one `nn.Module`."
)
_NO_MODEL = (
    "fabric.backward ran before a model was set up: call `model, optimizer = fabric.setup(model, optimizer)` first."
)
_OPEN = (
    "{} was called while a window is open: the last `fabric.backward` did not end it (it ran inside"
    " `fabric.no_backward_sync(model)` or with `window_end=False`), so the gradients are this rank's own. Run the"
    " window's last backward outside `no_backward_sync` (or with `window_end=True`) before clipping and stepping."
)


def _check_closed(windows: _Windows | None, call: str) -> None:
    if windows is not None and windows.loop.open:
        raise RuntimeError(_OPEN.format(call))


def _holds_state(obj: object) -> bool:
    """Whether ``obj`` is saved by its ``state_dict`` beside the model and optimizers (a loader, a counter)."""
    loads = callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
    return loads and not isinstance(obj, (Module, Optimizer))


def _step(tensor: Tensor, count: object, reduction: str, parts: object, aux: object) -> Output:
    """What one ``fabric.backward`` hands the loop, marked where its parts or terms cannot be weighted."""
    (named, bad_parts), (extra, bad_aux) = terms(parts), terms(aux)
    problem = Problem.PARTS if bad_parts else Problem.AUX if bad_aux else None
    return Output(tensor, None if count is None else read_count(count), reduction == "sum", named, extra, problem)


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
