"""ItemCounter's presets against hand-counted batches, and its refusals; ItemMonitor and ItemMetrics (no processes)."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_weighted import ItemCounter, ItemMetrics, ItemMonitor, WindowResult, count_documents, count_tokens
from lightning_weighted.count import Count, Counts, Problem, read_count
from lightning_weighted.strategy import WeightedStrategy

LABELS = torch.tensor(
    [
        [3, 4, 5, 6],  # 4 tokens, 3 shifted targets
        [3, 4, -100, -100],  # 2 tokens, 1 shifted target
        [-100, -100, -100, -100],  # a fully masked row: 0 and 0
    ]
)


def test_tokens_count_labels_that_are_not_ignore_index():
    assert ItemCounter("tokens", key="labels").count_of({"labels": LABELS}) == 6


def test_tokens_with_the_causal_shift_count_exactly_the_targets_the_loss_averages_over():
    logits = torch.randn(3, 4, 10)
    loss_sum = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, 10), LABELS[:, 1:].reshape(-1), ignore_index=-100, reduction="sum"
    )
    mean = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 10), LABELS[:, 1:].reshape(-1))
    count = ItemCounter("tokens", key="labels", shift=True).count_of({"labels": LABELS})
    assert count == 3 + 1 + 0
    assert torch.allclose(loss_sum / count, mean)  # the loss's own denominator


def test_tokens_from_a_mask_and_a_tuple_index():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 1]])
    assert ItemCounter("tokens", key=1, mask=True).count_of((torch.zeros(3, 3), mask)) == 4
    assert ItemCounter("tokens", key=1, mask=True, shift=True).count_of((torch.zeros(3, 3), mask)) == 2


def test_examples_count_the_batch_size_and_weights_sum():
    batch = {"x": torch.zeros(5, 2), "w": torch.tensor([0.5, 1.5, 0.0, 2.0, 1.0])}
    assert ItemCounter("examples").count_of(batch) == 5
    assert ItemCounter("weights", key="w").count_of(batch) == pytest.approx(5.0)


def test_a_count_function_is_called_with_the_batch():
    counter = ItemCounter(lambda batch: len(batch["ids"]) - 1)
    assert counter.count_of({"ids": [1, 2, 3]}) == 2
    assert counter.integer is False


@pytest.mark.parametrize(
    ("counter", "batch", "problem"),
    [
        (ItemCounter(lambda b: -2), {}, Problem.NEGATIVE),
        (ItemCounter(lambda b: math.nan), {}, Problem.NOT_FINITE),
        (ItemCounter(lambda b: torch.tensor(math.inf)), {}, Problem.NOT_FINITE),
        (ItemCounter(lambda b: "3"), {}, Problem.NOT_A_NUMBER),
        (ItemCounter(lambda b: 2.5, integer=True), {}, Problem.FRACTIONAL),
        (ItemCounter("weights", key="w"), {"w": torch.tensor([1.0, -4.0])}, Problem.NEGATIVE),
    ],
)
def test_bad_counts_from_the_batch_are_named_as_problems(counter, batch, problem):
    # the strategy reads them with `read_count` (counted ahead: on the host, the batch not on the device yet) and
    # raises on every rank (tests/distributed/test_item_counter.py)
    assert read_count(counter.count_of(batch), integer=counter.integer, host=True).problem is problem


class LabeledBatch(NamedTuple):
    x: torch.Tensor
    labels: torch.Tensor
    note: str


def test_a_key_missing_from_a_dict_names_the_keys_that_are_there():
    match = r"ItemCounter\(key='labels'\) found no such key in the batch, a dict with keys \['input_ids', 'mask'\]"
    with pytest.raises(TypeError, match=match):
        ItemCounter("tokens", key="labels").count_of({"input_ids": torch.zeros(2), "mask": torch.ones(2)})


@pytest.mark.parametrize(
    ("batch", "key", "match"),
    [
        ((torch.zeros(2), LABELS), "labels", r"cannot index the batch, a tuple of length 2: pass an int index$"),
        ([torch.zeros(2), LABELS], 2, r"cannot index the batch, a list of length 2: pass an index below 2$"),
        (
            LabeledBatch(torch.zeros(2), LABELS, "n"),
            "label",
            r"cannot index the batch, a LabeledBatch with fields \['x', 'labels', 'note'\]: pass an int index or one"
            r" of its field names \['x', 'labels', 'note'\]",
        ),
        (LabeledBatch(torch.zeros(2), LABELS, "n"), "note", r"found a str at that key of the batch, a LabeledBatch"),
        (LABELS, 0, r"needs a dict, tuple or list batch, got a Tensor: pass a function that counts it"),
    ],
)
def test_a_key_the_batch_cannot_answer_says_what_the_batch_is_and_what_to_pass(batch, key, match):
    with pytest.raises(TypeError, match=match):
        ItemCounter("tokens", key=key).count_of(batch)


def test_a_named_tuples_field_names_work_as_keys():
    batch = LabeledBatch(torch.zeros(3, 4), LABELS, "n")
    assert ItemCounter("tokens", key="labels").count_of(batch) == 6  # as the tuple index 1 counts it
    assert ItemCounter("tokens", key=1).count_of(batch) == 6


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"count": "tokenz"},
            r"count='tokenz' is not a preset: use 'examples', 'tokens', 'weights', 'documents' or a function",
        ),
        ({"count": "tokens"}, r"count='tokens' needs `key=`"),
        ({"count": "weights"}, r"count='weights' needs `key=`"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ItemCounter(**kwargs)


def test_it_refuses_a_strategy_that_does_not_weight():
    trainer = Trainer(strategy="ddp", accelerator="cpu", devices=2, logger=False)
    with pytest.raises(
        ValueError,
        match=r"ItemCounter supplies counts to a weighted strategy \(`strategy='ddp_weighted'`\), but the Trainer",
    ):
        ItemCounter().setup(trainer, None, "fit")  # type: ignore[arg-type]


def test_item_counter_is_a_specification_whose_only_hook_is_the_setup_check():
    hooks = {name for name in vars(Callback) if name.startswith("on_") or name in ("teardown", "state_dict")}
    assert {name for name in vars(ItemCounter) if name in hooks | {"setup", "load_state_dict"}} == {"setup"}
    counter = ItemCounter("tokens", key="labels", shift=True)
    spec = {"count", "key", "ignore_index", "mask", "shift", "integer", "parts"}
    assert set(vars(counter)) == spec | {"_integers"}  # each count's `integer`, read from the specification once
    assert counter.parts == {} and counter.names == ()  # one loss
    assert counter.state_dict() == {}  # nothing in a checkpoint


def test_an_item_counter_holds_nothing_of_the_fit_it_counted_and_the_monitor_sums_its_items(one_process_group):
    counter, monitor = ItemCounter("examples"), ItemMonitor()
    before = dict(vars(counter))
    trainer = Trainer(
        strategy="ddp_weighted", accelerator="cpu", devices=1, max_steps=3, limit_val_batches=0, logger=False,
        callbacks=[counter, monitor], enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(BoringModel())  # batches of one example each
    assert trainer.strategy.counts_ahead  # the counter counted every batch
    after = {name: value for name, value in vars(counter).items() if name not in ("log", "log_dict")}
    assert after == before  # Lightning's `log` and `log_dict`, which it sets on every callback, aside
    assert monitor.items_total == 3.0  # 3 steps of 1 example
    assert float(trainer.callback_metrics["train/items"]) == 1.0


class _Results(WeightedStrategy):
    """A weighted strategy's results, without a fit: `last_window` set by hand."""

    _loop = None
    last_window: WindowResult | None = None  # type: ignore[assignment]


def test_items_per_sec_is_measured_over_the_step_not_since_the_monitor_was_built():
    monitor = ItemMonitor()
    time.sleep(0.5)  # the callback is built long before training starts
    logged: dict[str, float] = {}
    module = SimpleNamespace(device=torch.device("cpu"), log_dict=lambda values, **_: logged.update(values))
    strategy = _Results()
    trainer = SimpleNamespace(strategy=strategy, logger=None, global_step=0, log_every_n_steps=1)
    monitor.on_train_batch_start(trainer, module, torch.zeros(4, 2), 0)  # type: ignore[arg-type]
    strategy.last_window = WindowResult(step=0, items=1000.0, local_items=400.0, loss=0.5)
    monitor.on_train_batch_end(trainer, module, None, torch.zeros(4, 2), 0)  # type: ignore[arg-type]
    assert logged["train/items"] == 1000.0
    assert logged["train/items_per_sec"] > 1000.0 / 0.5  # the step took far less than the wait before it


def test_item_metrics_give_each_windows_values_and_the_epochs_item_weighted_loss(monkeypatch):
    metrics = ItemMetrics(imbalance=False)
    assert metrics.compute() == {}  # no window yet
    # a data-parallel group of 2 ranks, each holding these aux sums: their SUM is twice this rank's
    reduced: list[object] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, group=None, **_: reduced.append(group) or tensor.mul_(2))
    metrics.group = group = object()
    aux = {"z": torch.tensor(3.0, dtype=torch.float64), "b": torch.tensor(1.5, dtype=torch.float64)}
    metrics.update(WindowResult(step=0, items=8.0, local_items=2.0, loss=2.5), aux=aux, microbatches=3)
    values = metrics.compute()
    assert values["train/loss"] == 2.5 and values["train/items"] == 8.0 and values["train/items_local"] == 2.0
    assert "train/items_per_sec" not in values  # no wall time given
    # each term's SUM over the ranks, over M·P = 3·2 microbatches
    assert float(values["train/aux/z"]) == 2 * 3.0 / 6 and float(values["train/aux/b"]) == 2 * 1.5 / 6
    assert reduced == [group]  # one all-reduce over the data-parallel group
    assert "train/aux/z" not in metrics.compute(collectives=False)
    metrics.update(WindowResult(step=1, items=0.0, local_items=0.0, loss=math.nan), elapsed=0.0)
    assert "train/loss" not in metrics.compute() and math.isnan(metrics.compute()["train/items_per_sec"])
    metrics.update(WindowResult(step=2, items=4.0, local_items=3.0, loss=1.0), elapsed=2.0)
    assert metrics.compute()["train/items_per_sec"] == 2.0
    assert metrics.end_epoch() == {"train/loss_epoch": (2.5 * 8 + 1.0 * 4) / 12}  # the empty window weighs 0
    assert metrics.end_epoch() == {}  # a new epoch, with no window yet
    assert metrics.items_total == 12.0


def test_item_metrics_give_each_loss_parts_mean_and_items_beside_the_sum_of_the_means():
    metrics = ItemMetrics(imbalance=False)
    text = WindowResult(step=0, items=4.0, local_items=3.0, loss=2.5)
    image = WindowResult(step=0, items=0.0, local_items=0.0, loss=math.nan)  # no image this window
    metrics.update(WindowResult(step=0, items=4.0, local_items=3.0, loss=2.5, parts={"text": text, "image": image}))
    assert metrics.compute() == {
        "train/loss": 2.5,
        "train/items": 4.0,
        "train/items_local": 3.0,
        "train/loss/text": 2.5,
        "train/items/text": 4.0,
        "train/items/image": 0.0,  # its loss, NaN, is left out
    }


def test_item_monitor_refuses_a_strategy_that_does_not_weight():
    trainer = Trainer(strategy="ddp", accelerator="cpu", devices=2, logger=False)
    with pytest.raises(
        ValueError,
        match=r"ItemMonitor logs the windows of a weighted strategy \(`strategy='ddp_weighted'`\), but the Trainer"
        r" uses DDPStrategy\. Pass `strategy='ddp_weighted'` or drop the callback\.",
    ):
        ItemMonitor().setup(trainer, None, "fit")  # type: ignore[arg-type]


def test_the_monitors_items_total_round_trips_through_a_checkpoint():
    monitor = ItemMonitor()
    monitor.metrics.update(WindowResult(step=0, items=123.0, local_items=100.0, loss=0.5))
    restored = ItemMonitor()
    restored.load_state_dict(monitor.state_dict())
    assert restored.items_total == 123.0


def test_an_item_counter_of_loss_parts_counts_each_part_its_own_way_on_the_host_or_where_the_batch_lives():
    batch = {"labels": LABELS, "image_mask": torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]])}
    counter = ItemCounter(
        parts={
            "text": ItemCounter("tokens", key="labels", shift=True),
            "image": lambda batch: batch["image_mask"].sum(),
            "rows": "examples",
        }
    )
    assert counter.names == ("text", "image", "rows")
    assert counter.counts(batch, host=True) == Counts((4.0, 3.0, 3.0))  # read before it moves, checked together
    on_device = counter.counts(batch).each()
    assert [isinstance(c.value, torch.Tensor) for c in on_device] == [True, True, False]  # examples: a host int
    assert [float(c.value) for c in on_device] == [4.0, 3.0, 3.0]
    assert [float(c.problem) if c.problem is not None else 0.0 for c in on_device] == [0.0, 0.0, 0.0]
    assert [c.integer for c in counter.parts.values()] == [True, False, True]  # each part keeps its own rule
    fractional = ItemCounter(parts={"weights": ItemCounter(lambda batch: 2.5, integer=True)})
    assert fractional.counts(batch, host=True).each() == [Count(2.5, Problem.FRACTIONAL)]
    assert ItemCounter("examples").counts(batch, host=True) == Counts((3.0,))  # no parts: one count


@pytest.mark.parametrize("parts", [{}, [("text", "examples")], "examples"])
def test_loss_parts_must_be_a_dict_of_named_counters(parts):
    with pytest.raises(ValueError, match=r"parts=.* is not a dict of named parts: pass \{'name': ItemCounter"):
        ItemCounter(parts=parts)  # type: ignore[arg-type]


def test_a_preset_counts_a_combined_batch_over_each_loaders_part_and_a_function_gets_the_whole_batch():
    combined = {"a": torch.zeros(2, 3), "b": torch.zeros(3, 3)}  # a CombinedLoader's batch of two loaders
    assert ItemCounter("examples").counts(combined, host=True, combined=True) == Counts((5.0,))
    assert ItemCounter("examples").counts([torch.zeros(2), None, torch.zeros(4)], combined=True) == Counts((6.0,))
    tokens = ItemCounter("tokens", key="labels", shift=True)  # None: a loader out of batches in "max_size"
    assert tokens.counts({"x": {"labels": LABELS}, "y": {"labels": LABELS[:2]}}, host=True, combined=True) == Counts(
        (8.0,)
    )
    assert ItemCounter(lambda batch: len(batch)).counts(combined, combined=True) == Counts((2.0,))  # the whole batch
    parts = ItemCounter(parts={"rows": "examples", "loaders": lambda batch: len(batch)})
    assert parts.counts(combined, combined=True) == Counts((5.0, 2.0))


def test_a_packed_batch_counts_the_tokens_and_documents_of_its_padded_twin():
    transformers = pytest.importorskip("transformers")
    documents = [[5, 6, 7, 8, 9], [3, 4, 5], [9, 8, 7, 6, 5, 4, 3]]
    flat = transformers.DataCollatorWithFlattening()([{"input_ids": d} for d in documents])
    labels = torch.full((3, 7), -100)
    for row, document in enumerate(documents):
        labels[row, : len(document)] = torch.tensor(document)
    # the collator masks each document's first label: the causal shift counts every target token exactly once
    assert count_tokens(flat, "labels", shift=True) == count_tokens({"labels": labels}, "labels", shift=True) == 12
    assert count_documents(flat) == 3
    assert ItemCounter("documents").count_of(flat) == 3
