"""Counting a microbatch's items from the batch: plain functions, and ``ItemCounter``, their Trainer callback."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.data import extract_batch_size
from torch import Tensor
from torchmetrics import MeanMetric
from typing_extensions import override

from lightning_weighted.counts import imbalance
from lightning_weighted.window import WindowResult

__all__ = ["ItemCounter", "count_documents", "count_examples", "count_tokens", "count_weights"]

CountFn = Callable[[Any], "int | float | Tensor"]
Preset = Literal["examples", "tokens", "weights", "documents"]


def count_examples(batch: Any) -> int:
    """The batch size, found in the batch as Lightning finds it for logging.

    Example::

        >>> count_examples({"input_ids": torch.zeros(4, 7)})
        4
    """
    return extract_batch_size(batch)


def count_tokens(
    batch: Any, key: str | int, *, ignore_index: int = -100, mask: bool = False, shift: bool = False
) -> Tensor:
    """The valid tokens of a batch: labels that are not ``ignore_index``, or the ones of a 0/1 mask.

    Args:
        batch: a dict or a tuple holding the labels (or the mask).
        key: where the labels or mask sit: a dict key or a tuple index.
        ignore_index: the label that marks a token the loss ignores.
        mask: whether ``batch[key]`` is a 0/1 mask rather than labels.
        shift: count ``labels[..., 1:]``, the targets of a causal LM whose loss compares ``logits[..., :-1]``
            with ``labels[..., 1:]``, so that the count equals the loss's own denominator.

    Example::

        >>> batch = {"labels": torch.tensor([[5, 7, 9], [5, 6, -100]])}
        >>> count_tokens(batch, "labels", shift=True)  # targets [7, 9] and [6]
        tensor(3)
        >>> count_tokens(batch, "labels")  # without the shift: one more per row
        tensor(5)
    """
    values = _select(batch, key)
    valid = values.bool() if mask else values != ignore_index
    return (valid[..., 1:] if shift else valid).sum()


def count_weights(batch: Any, key: str | int) -> Tensor:
    """The sum of a batch's sample weights, ``batch[key]``.

    Example::

        >>> count_weights((torch.zeros(3), torch.tensor([0.5, 1.0, 2.0])), 1)
        tensor(3.5000)
    """
    return _select(batch, key).sum()


def count_documents(batch: Any, key: str | int = "position_ids") -> int | Tensor:
    """The documents of a packed batch: where ``position_ids`` restart at 0, or the spans of ``cu_seq_lens``.

    A packed batch holds several sequences in one row, as Hugging Face's ``DataCollatorWithFlattening`` packs them.

    Args:
        batch: a dict or a tuple holding the positions or the boundaries.
        key: where they sit: a key holding ``cu_seq_lens`` (any key with that in its name, as ``"cu_seq_lens_q"``)
            is read as the cumulative lengths ``[0, l_0, l_0 + l_1, ...]``; any other as positions.

    Example::

        >>> count_documents({"position_ids": torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])})  # 3 documents
        tensor(3)
        >>> count_documents({"cu_seq_lens_q": torch.tensor([0, 3, 5, 9])}, "cu_seq_lens_q")  # its length only
        3
    """
    values = _select(batch, key)
    if "cu_seq_lens" in str(key):
        return max(values.numel() - 1, 0)
    return (values == 0).sum()


class ItemCounter(Callback):
    """Supplies each microbatch's item count from the batch, and logs the weighted objective of every step.

    With this callback ``training_step`` may return a bare loss (the mean over the microbatch's valid items).
    The strategy then counts every batch on the host, as the loader yields it, before it reaches the device, and
    sums each window's counts before the window's first forward (see :mod:`lightning_weighted.loop`); a
    ``"count"`` that ``training_step`` still returns must agree with it. Where the batches cannot be counted ahead
    (several train dataloaders), the strategy counts each microbatch on its device batch, and a ``"count"`` that
    ``training_step`` returns takes precedence. A ``training_step`` taking ``dataloader_iter`` fetches batches the
    callback never sees: refused at setup (return the count instead).

    Args:
        count: what to count: ``"examples"`` (:func:`count_examples`), ``"tokens"`` (:func:`count_tokens`),
            ``"weights"`` (:func:`count_weights`), ``"documents"`` of packed rows (:func:`count_documents`, ``key``
            ``"position_ids"`` by default), or a function ``count_fn(batch) -> int | float | Tensor``, as
            ``ThroughputMonitor(batch_size_fn=...)``.
        key: where the labels, mask, weights or positions sit in the batch: a dict key, a tuple or list index, or
            a NamedTuple's field name.
        ignore_index: the label that marks a token the loss ignores (``"tokens"`` with labels).
        mask: whether ``key`` holds a 0/1 mask rather than labels (``"tokens"``).
        shift: count the targets of a causal LM, ``labels[..., 1:]`` (``"tokens"``).
        integer: whether counts must be whole numbers; defaults to ``True`` for examples and tokens.
        log: log per optimizer step ``train/loss`` (the global item mean of the loss, ``Σ n·loss / N``),
            ``train/items`` (``N``), ``train/items_local``, ``train/items_per_sec`` (``N`` over the wall time
            from the step's first microbatch to its end) and ``train/imbalance`` (``max_r P·n_r / N``, how far
            plain DDP would have skewed item influence), plus ``train/loss_epoch``, a torchmetrics
            ``MeanMetric`` of the step losses weighted by ``N``; and each auxiliary term ``training_step`` returns
            (``"aux"``) as ``train/aux/<name>``, its mean over the window's microbatches and ranks, on the steps
            Lightning logs (one all-reduce of the terms then).
        imbalance: also log ``train/imbalance``, at the cost of one 8-byte MAX all-reduce on the steps Lightning
            logs (every ``log_every_n_steps``); everything else reuses the strategy's count reduction.

    Example::

        >>> batch = {"labels": torch.tensor([[5, 7, 9], [5, 6, -100]])}
        >>> ItemCounter("tokens", key="labels", shift=True).count_of(batch)
        tensor(3)
    """

    def __init__(
        self,
        count: Preset | CountFn = "examples",
        *,
        key: str | int | None = None,
        ignore_index: int = -100,
        mask: bool = False,
        shift: bool = False,
        integer: bool | None = None,
        log: bool = True,
        imbalance: bool = True,
    ) -> None:
        if isinstance(count, str) and count not in ("examples", "tokens", "weights", "documents"):
            raise ValueError(
                f"count={count!r} is not a preset: use 'examples', 'tokens', 'weights', 'documents' or a function"
            )
        if count in ("tokens", "weights") and key is None:
            raise ValueError(f"count={count!r} needs `key=`, the batch key or index of the labels, mask or weights")
        self.count, self.key, self.ignore_index = count, key, ignore_index
        self.mask, self.shift, self.imbalance = mask, shift, imbalance
        self.logs = log  # not `self.log`: Lightning sets every callback's `log` to the module's `log` method
        self.integer = count in ("examples", "tokens") if integer is None else integer
        self.items_total = 0.0
        self._loss_epoch = MeanMetric(sync_on_compute=False)  # its inputs are already global
        self._last_step: int | None = None
        self._started: float | None = None  # when the window in progress began
        self._aux: dict[str, Any] = {}  # the window's auxiliary terms summed over its microbatches on this rank
        self._microbatches = 0

    def count_of(self, batch: Any) -> int | float | Tensor:
        """The count of one microbatch, as the chosen preset or function defines it."""
        if callable(self.count):
            return self.count(batch)
        if self.count == "examples":
            return count_examples(batch)
        if self.count == "documents":
            return count_documents(batch, self.key or "position_ids")
        assert self.key is not None
        if self.count == "weights":
            return count_weights(batch, self.key)
        return count_tokens(batch, self.key, ignore_index=self.ignore_index, mask=self.mask, shift=self.shift)

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if not hasattr(trainer.strategy, "last_window"):
            raise ValueError(
                f"ItemCounter supplies counts to a weighted strategy (`strategy='ddp_weighted'`), but the Trainer"
                f" uses {type(trainer.strategy).__name__}. Pass `strategy='ddp_weighted'` or drop the callback."
            )
        self._loss_epoch = self._loss_epoch.to(pl_module.device)
        if _float64(pl_module):
            self._loss_epoch.set_dtype(torch.float64)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._started is None:
            self._started = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._microbatches += 1
        terms = outputs.get("aux") if isinstance(outputs, Mapping) else None
        if isinstance(terms, Mapping) and not getattr(trainer.strategy, "padding_step", False):
            for name, term in terms.items():  # summed on the device: nothing is read per microbatch
                self._aux[name] = self._aux.get(name, 0.0) + term.detach().reshape(()).double()
        window: WindowResult | None = trainer.strategy.last_window  # type: ignore[attr-defined]
        if window is None or window.step == self._last_step:
            return  # no optimizer step ended with this batch
        self._last_step = window.step
        aux, microbatches, self._aux, self._microbatches = self._aux, self._microbatches, {}, 0
        self.items_total += window.items
        elapsed = time.perf_counter() - (self._started or math.inf)
        self._started = None
        if not self.logs:
            return
        # every value below is already global (or deliberately local): no sync_dist, no extra collective
        group = _data_parallel_group(trainer)
        shown = {"train/items_per_sec": window.items / elapsed if elapsed > 0 else math.nan}
        logged: dict[str, Any] = {"train/items": window.items, "train/items_local": window.local_items}
        if window.items > 0:
            shown["train/loss"] = window.loss
            self._loss_epoch.update(
                torch.as_tensor(loggable(window.loss, pl_module), device=pl_module.device), weight=window.items
            )
        if self.imbalance and _logs_now(trainer):
            logged["train/imbalance"] = _imbalance(window, pl_module.device, group)
        if aux and _logs_now(trainer):
            logged.update(_aux_means(aux, microbatches, window.ranks, group))
        pl_module.log_dict(
            {k: loggable(v, pl_module) for k, v in shown.items()},
            prog_bar=True,
            on_step=True,
            on_epoch=False,
            batch_size=1,
        )
        pl_module.log_dict(
            {k: loggable(v, pl_module) for k, v in logged.items()}, on_step=True, on_epoch=False, batch_size=1
        )

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.logs and self._loss_epoch.update_count > 0:
            # Already global: `sync_dist` averages equal values (exactly), and keeps Lightning from warning.
            pl_module.log("train/loss_epoch", self._loss_epoch.compute(), sync_dist=True, batch_size=1)
        self._loss_epoch.reset()

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"items_total": self.items_total}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.items_total = float(state_dict["items_total"])


def _select(batch: Any, key: str | int) -> Tensor:
    """``batch[key]``: a dict's key, a tuple's or list's index, or a NamedTuple's field name; a clear error else."""
    if isinstance(batch, tuple) and isinstance(key, str) and key in getattr(batch, "_fields", ()):
        value = getattr(batch, key)  # a NamedTuple's field
    elif isinstance(batch, Mapping):
        if key not in batch:
            raise TypeError(
                f"ItemCounter(key={key!r}) found no such key in the batch, a {_held(batch)}: pass one of them"
            )
        value = batch[key]
    elif isinstance(batch, Sequence) and not isinstance(batch, str):
        if not isinstance(key, int) or not -len(batch) <= key < len(batch):
            fix = "an int index" if not isinstance(key, int) else f"an index below {len(batch)}"
            fields = getattr(batch, "_fields", None)
            fix += f" or one of its field names {list(fields)}" if fields is not None else ""
            raise TypeError(f"ItemCounter(key={key!r}) cannot index the batch, a {_held(batch)}: pass {fix}")
        value = batch[key]
    else:
        raise TypeError(
            f"ItemCounter(key={key!r}) needs a dict, tuple or list batch, got a {type(batch).__name__}: pass a"
            " function that counts it, `ItemCounter(lambda batch: ...)`"
        )
    if not isinstance(value, Tensor):
        raise TypeError(
            f"ItemCounter(key={key!r}) found a {type(value).__name__} at that key of the batch, a {_held(batch)};"
            " expected a tensor there"
        )
    return value


def _held(batch: Any) -> str:
    """What a batch is, for an error message: its type, and its keys, fields or length."""
    name = type(batch).__name__
    if isinstance(batch, Mapping):
        return f"{name} with keys {list(batch)}"
    fields = getattr(batch, "_fields", None)
    if fields is not None:
        return f"{name} with fields {list(fields)}"
    return f"{name} of length {len(batch)}" if isinstance(batch, Sequence) else name


def _aux_means(sums: dict[str, Any], microbatches: int, ranks: int, group: Any = None) -> dict[str, Tensor]:
    """Each auxiliary term's mean over the window's microbatches and ranks, from one SUM of every rank's sums.

    The weight the strategies give the terms (each microbatch of each rank alike); a replayed batch adds 0. The SUM
    runs over ``group``, the data-parallel ranks: tensor-parallel peers hold the same terms as their rank.
    """
    names = sorted(sums)
    stacked = torch.stack([torch.as_tensor(sums[name], dtype=torch.float64) for name in names])
    if dist.is_initialized():
        dist.all_reduce(stacked, group=group)
    means = stacked / (microbatches * ranks)
    return {f"train/aux/{name}": mean for name, mean in zip(names, means, strict=True)}


def loggable(value: float | Tensor, module: LightningModule) -> float | Tensor:
    """A value for ``self.log``: a float64 tensor where the run is float64, lest Lightning round it to float32."""
    return torch.as_tensor(value, dtype=torch.float64).to(module.device) if _float64(module) else value


def _float64(module: LightningModule) -> bool:
    trainer = getattr(module, "_trainer", None)  # None outside a fit
    return trainer is not None and str(trainer.precision).startswith("64")


def _data_parallel_group(trainer: Trainer) -> Any:
    """The ranks that see different data: the group the strategy sums its counts over (``None``: every rank)."""
    return getattr(getattr(trainer.strategy, "_engine", None), "group", None)


def _logs_now(trainer: Trainer) -> bool:
    every: int = getattr(trainer, "log_every_n_steps", 50)
    return trainer.logger is not None and (trainer.global_step + 1) % every == 0


def _imbalance(window: WindowResult, device: torch.device, group: Any = None) -> float:
    """:func:`~lightning_weighted.counts.imbalance` over the window's ranks, from one MAX all-reduce of their counts.

    The MAX runs over ``group``, the data-parallel ranks, as the strategy's count reduction does.
    """
    if window.items <= 0 or not dist.is_initialized():
        return 1.0
    largest = torch.tensor(window.local_items, dtype=torch.float64, device=device)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
    return imbalance(float(largest), window.items, window.ranks)
