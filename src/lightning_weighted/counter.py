"""Counting a microbatch's items from the batch: plain functions, and ``ItemCounter``, the Trainer's specification."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, get_args

import torch  # noqa: F401  (the examples in the docstrings build their batches with it)
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.data import extract_batch_size
from torch import Tensor
from typing_extensions import override

from lightning_weighted.count import Counts, read_counts
from lightning_weighted.strategy import weighted

__all__ = ["ItemCounter", "count_documents", "count_examples", "count_tokens", "count_weights"]

CountFn = Callable[[Any], int | float | Tensor]
Preset = Literal["examples", "tokens", "weights", "documents"]


def count_examples(batch: Any) -> int:
    """The batch size, found in the batch as Lightning finds it for logging."""
    return extract_batch_size(batch)


def count_tokens(
    batch: Any, key: str | int, *, ignore_index: int = -100, mask: bool = False, shift: bool = False
) -> Tensor:
    """The valid tokens of ``batch[key]``: labels that are not ``ignore_index``, or (``mask``) the ones of a 0/1 mask.

    ``shift`` counts ``labels[..., 1:]``, the targets of a causal LM (the loss's own denominator)::

        >>> count_tokens({"labels": torch.tensor([[5, 7, 9], [5, 6, -100]])}, "labels", shift=True)  # [7, 9], [6]
        tensor(3)
    """
    values = _select(batch, key)
    valid = values.bool() if mask else values != ignore_index
    return (valid[..., 1:] if shift else valid).sum()


def count_weights(batch: Any, key: str | int) -> Tensor:
    """The sum of a batch's sample weights, ``batch[key]``."""
    return _select(batch, key).sum()


def count_documents(batch: Any, key: str | int = "position_ids") -> int | Tensor:
    """The documents of a packed batch: where ``position_ids`` restart at 0, or the spans of ``cu_seq_lens``.

    A ``key`` with ``cu_seq_lens`` in its name holds cumulative lengths ``[0, l_0, ...]``. Example::

        >>> count_documents({"position_ids": torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])})  # 3 documents
        tensor(3)
    """
    values = _select(batch, key)
    if "cu_seq_lens" in str(key):
        return max(values.numel() - 1, 0)
    return (values == 0).sum()


class ItemCounter(Callback):
    """How a weighted strategy counts each microbatch's items from the batch: a specification, with no state of a fit.

    ``training_step`` may then return a bare loss (a ``"count"`` still returned must agree); each batch is counted on
    the host as the loader yields it. A callback, so that ``Trainer(callbacks=[...])`` hands it to the strategy.

    Args:
        count: ``"examples"``, ``"tokens"``, ``"weights"``, ``"documents"`` (the ``count_*`` functions) or a
            function ``count_fn(batch) -> int | float | Tensor``; a preset counts each loader's part of a batch.
        key: where the labels, mask, weights or positions sit: a dict key, a tuple index or a NamedTuple field.
        ignore_index: the label that marks a token the loss ignores (``"tokens"`` with labels).
        mask: whether ``key`` holds a 0/1 mask rather than labels (``"tokens"``).
        shift: count the targets of a causal LM, ``labels[..., 1:]`` (``"tokens"``).
        integer: whether counts must be whole numbers; defaults to ``True`` for examples and tokens.
        parts: named loss parts, each counted its own way (an ``ItemCounter``, a preset or a function) and averaged
            over its own ``N``; ``training_step`` returns ``{"loss": total, "parts": {name: mean, ...}}``.

    Example::

        >>> batch = {"labels": torch.tensor([[5, 7, 9], [5, 6, -100]]), "image_mask": torch.tensor([[1, 1, 0]])}
        >>> image = lambda batch: batch["image_mask"].sum()
        >>> parts = ItemCounter(parts={"text": ItemCounter("tokens", key="labels"), "image": image})
        >>> parts.counts(batch, host=True).values
        (5.0, 2.0)
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
        parts: Mapping[str, ItemCounter | Preset | CountFn] | None = None,
    ) -> None:
        if isinstance(count, str) and count not in get_args(Preset):
            raise ValueError(
                f"count={count!r} is not a preset: use 'examples', 'tokens', 'weights', 'documents' or a function"
            )
        if count in ("tokens", "weights") and key is None:
            raise ValueError(f"count={count!r} needs `key=`, the batch key or index of the labels, mask or weights")
        if parts is not None and (not isinstance(parts, Mapping) or not parts):
            raise ValueError(f"parts={parts!r} is not a dict of named parts: pass {{'name': ItemCounter(...), ...}}")
        self.count, self.key, self.ignore_index, self.mask, self.shift = count, key, ignore_index, mask, shift
        self.integer = count in ("examples", "tokens") if integer is None else integer
        self.parts = {str(n): p if isinstance(p, ItemCounter) else ItemCounter(p) for n, p in (parts or {}).items()}
        self._integers = [c.integer for c in self.parts.values()] or [self.integer]  # each count's rule, once

    @property
    def names(self) -> tuple[str, ...]:
        """The names of the loss parts (``()``: one loss)."""
        return tuple(self.parts)

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

    def counts(self, batch: Any, host: bool = False, combined: bool = False) -> Counts:
        """Each part's count of ``batch`` (one, without parts), checked together.

        ``host``: read on the host (a batch the loader yielded); ``combined``: several loaders' batches, presets each.
        """
        counters = self.parts.values() or (self,)
        values = [c._combined(batch) if combined else c.count_of(batch) for c in counters]
        return read_counts(values, self._integers, host)

    def _combined(self, batch: Any) -> int | float | Tensor:
        if callable(self.count):  # a function counts the combined batch whole; a preset, each loader's batch
            return self.count(batch)
        subs = batch.values() if isinstance(batch, Mapping) else batch
        return sum((self.count_of(sub) for sub in subs if sub is not None), 0)  # None: a loader out of batches

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        weighted(trainer.strategy, "ItemCounter supplies counts to")


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
