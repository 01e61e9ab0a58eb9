"""The loop of windows on one in-process rank: a step's output read once, the exchange decoded, a window's decision."""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_weighted.count import FABRIC, TRAINER, Count, Counts, Problem, Wording, read_count, read_counts
from lightning_weighted.engines.ddp import DDPEngine
from lightning_weighted.loop import Exchange, WindowLoop, read_output, terms
from lightning_weighted.payload import Slot, at, window_result
from lightning_weighted.window import Window

CPU = torch.device("cpu")


def test_read_output_finds_the_loss_whether_it_is_an_item_sum_and_a_bad_reduction():
    loss = torch.tensor(1.0)
    for output, item_sum, problem in [
        (loss, False, None),
        ({"loss": loss}, False, None),
        ({"loss": loss, "reduction": "mean"}, False, None),
        ({"loss": loss, "reduction": "sum"}, True, None),
        ({"loss": loss, "reduction": "none"}, False, Problem.REDUCTION),
    ]:
        step = read_output(output)
        assert (step.loss, step.item_sum, step.problem) == (loss, item_sum, problem), output
    assert (read_output(None).loss, read_output(None).problem) == (None, None)
    assert (read_output({"count": 3}).loss, read_output({"count": 3}).problem) == (None, None)
    assert read_output({"loss": 3.0}).loss is None  # a float is no loss: nothing to backpropagate


def test_read_output_reads_a_returned_count_once_and_checked():
    assert read_output({"loss": torch.tensor(6.0), "count": 3, "reduction": "sum"}).count == Count(3.0)
    assert read_output({"loss": torch.tensor(1.0), "count": -2}).count == Count(-2.0, Problem.NEGATIVE)
    assert read_output({"loss": torch.tensor(1.0), "count": None}).count == Count(math.nan, Problem.NOT_A_NUMBER)
    assert read_output({"loss": torch.tensor(1.0)}).count is None
    assert read_output(torch.tensor(1.0)).count is None
    on_device = read_output({"loss": torch.tensor(1.0), "count": torch.tensor(4)}).count
    assert on_device is not None and isinstance(on_device.value, Tensor) and isinstance(on_device.problem, Tensor)


def test_read_output_names_the_parts_and_aux_terms_as_scalars_and_refuses_what_is_not_a_dict_of_scalars():
    parts = {"text": torch.tensor([2.0]), "image": torch.tensor(3.0)}
    step = read_output({"loss": torch.tensor(5.0), "parts": parts, "aux": {"z": torch.tensor([[0.5]])}})
    assert step.problem is None
    assert step.parts is not None and {name: part.shape for name, part in step.parts.items()} == {
        "text": torch.Size([]),
        "image": torch.Size([]),
    }
    assert step.aux is not None and step.aux["z"].shape == torch.Size([]) and float(step.aux["z"]) == 0.5
    assert (read_output(torch.tensor(1.0)).parts, read_output(torch.tensor(1.0)).aux) == (None, None)
    for output, problem in [
        ({"loss": torch.tensor(1.0), "aux": torch.tensor(0.5)}, Problem.AUX),  # not named
        ({"loss": torch.tensor(1.0), "aux": {"z": torch.ones(2)}}, Problem.AUX),  # not one element
        ({"loss": torch.tensor(1.0), "aux": {"z": 0.5}}, Problem.AUX),  # not a tensor
        ({"loss": torch.tensor(1.0), "parts": [torch.tensor(1.0)]}, Problem.PARTS),
        ({"loss": torch.tensor(1.0), "parts": {"text": torch.ones(2)}}, Problem.PARTS),
        ({"loss": torch.tensor(1.0), "parts": 3, "aux": 3}, Problem.AUX),  # the aux's problem is named first
        ({"loss": torch.tensor(1.0), "aux": 3, "reduction": "none"}, Problem.REDUCTION),  # the reduction's first
    ]:
        step = read_output(output)
        assert (step.problem, step.parts, step.aux) == (problem, None, None), output


def test_terms_are_named_scalars_none_where_none_were_given_and_refused_otherwise():
    named, bad = terms({"a": torch.tensor([1.0]), 2: torch.tensor(2.0)})
    assert not bad and named is not None and list(named) == ["a", "2"] and named["a"].dim() == 0
    assert terms(None) == (None, False)
    assert terms({"a": torch.zeros(3)}) == (None, True)
    assert terms(torch.tensor(1.0)) == (None, True)


def test_a_healthy_window_never_gathers_the_problem_rows(one_rank, monkeypatch):
    def gathered(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a window gathered the problem rows")

    monkeypatch.setattr(dist, "all_gather", gathered)
    window = Window()
    window.add(Count(2.0))
    window.add(read_count(torch.tensor(6)))
    summed = Exchange([window], True, CPU, None).read(TRAINER)
    assert window_result(summed, step=0).items == 8.0
    bad = Window()  # the control: a window with a problem does gather them, a collective every rank joins
    bad.reject(Problem.NEGATIVE, -1.0)
    with pytest.raises(AssertionError, match="a window gathered the problem rows"):
        Exchange([bad], True, CPU, None).read(TRAINER)


def test_the_exchange_sums_every_parts_payload_at_once_and_keeps_each_parts_local_items(one_rank):
    text, image = Window(), Window()
    text.add(Count(3.0), loss=torch.tensor(2.0))
    image.add(read_count(torch.tensor(2)), loss=torch.tensor(1.5))
    exchange = Exchange([text, image], False, CPU, None, next_items=[4.0, 1.0])
    assert exchange.items().tolist() == [3.0, 2.0]  # each part's N, on the device
    summed = exchange.read(TRAINER)
    fields = [summed[at(slot, 2)] for slot in (Slot.ITEMS, Slot.NEXT, Slot.LOSS, Slot.LOCAL)]
    assert (summed[Slot.MORE], fields) == (0.0, [[3.0, 2.0], [4.0, 1.0], [6.0, 3.0], [3.0, 2.0]])
    assert len(summed) == 3 + 4 * 2  # three shared fields, then one value per part of each other one


def test_the_exchange_raises_the_error_of_the_first_part_with_a_problem_in_the_callers_wording(one_rank):
    text, image = Window(), Window()
    text.add(Count(3.0))
    image.add(read_count(torch.tensor(-4)))  # found on the device, read only now that some rank found a problem
    match = r"on rank 0, a microbatch's count is negative \(-4\)\. Pass each microbatch's count as `fabric\.backward"
    with pytest.raises(ValueError, match=match):
        Exchange([text, image], True, CPU, None).read(FABRIC)


class _Engine:
    """An engine whose reduction over its one rank is the SUM (D = 1), over the given parameters."""

    divisor, group, mean_sized, needs_graph = 1, None, False, False

    def __init__(self, *parameters: Tensor) -> None:
        self._parameters = parameters

    def empty(self, loss: Tensor | None) -> Tensor:
        if loss is None or loss.grad_fn is None:  # a refused microbatch's: a zero that reaches the parameters
            return torch.stack([param.sum() for param in self._parameters]).sum() * 0.0
        return loss.sum() * 0.0

    def after_backward(self) -> None:
        pass

    def parameters(self) -> Iterable[Tensor]:
        return self._parameters


def _mean(w: Tensor, targets: list[float]) -> Tensor:
    return (0.5 * (w - torch.tensor(targets)) ** 2).mean()


def test_a_window_counted_ahead_trains_the_item_mean_and_a_batch_changed_on_its_way_fails_it_naming_the_hooks(
    one_rank,
):
    w = nn.Parameter(torch.tensor(10.0))
    wording = Wording(TRAINER.source, TRAINER.fix, "`on_after_batch_transfer`")
    loop = WindowLoop(_Engine(w), CPU, wording)
    loop.plan([Counts((2.0,)), Counts((6.0,))])  # the worked trace's two microbatches, on one rank
    for targets in ([9.0] * 2, [7.0] * 6):
        loss = _mean(w, targets)
        loop.add(read_output(loss), recount=read_counts([torch.tensor(len(targets))], [True]))  # counted again
        loop.backward_loss(loss).backward()
    result = loop.finish(step=0)
    assert float(w.grad) == pytest.approx(2.5, abs=1e-12)  # (2 · 1 + 6 · 3) / 8
    assert (result.items, result.local_items, result.loss) == (8.0, 8.0, pytest.approx((2 * 0.5 + 6 * 4.5) / 8))

    w.grad = None
    loop.plan([Counts((2.0,))])
    loss = _mean(w, [9.0, 9.0, 9.0])  # a transfer hook added a row: the step received 3 where 2 were counted
    loop.add(read_output(loss), recount=read_counts([torch.tensor(3)], [True]))
    loop.backward_loss(loss).backward()
    match = (
        r"on rank 0, the batch training_step received holds 3 items where ItemCounter counted another number in the"
        r" batch the loader yielded: `on_after_batch_transfer` changed it on its way to the step"
    )
    with pytest.raises(ValueError, match=match):
        loop.finish(step=1)


def test_a_count_returned_beside_the_plan_must_agree_with_it(one_rank):
    w = nn.Parameter(torch.tensor(10.0))
    loop = WindowLoop(_Engine(w), CPU, TRAINER)
    loop.plan([Counts((2.0,))])
    loss = _mean(w, [9.0, 9.0])
    loop.add(read_output({"loss": loss, "count": 3}))
    loop.backward_loss(loss).backward()
    with pytest.raises(ValueError, match=r"on rank 0, training_step returned a count \(3\) that differs from the one"):
        loop.finish(step=0)


def test_each_loss_part_is_averaged_over_its_own_count_and_the_result_holds_each_parts_mean(one_rank):
    w = nn.Parameter(torch.tensor(1.0))
    loop = WindowLoop(_Engine(w), CPU, TRAINER, parts=("text", "image"))
    loop.plan([Counts((3.0, 0.0)), Counts((1.0, 2.0))])  # each microbatch's counts of the two parts
    for text, image in ((2.0, 5.0), (4.0, 1.0)):  # each part's mean loss at w = 1 (and its gradient)
        parts = {"text": w * text, "image": w * image} if text < 3 else {"image": w * image, "text": w * text}
        loop.add(read_output({"loss": parts["text"] + parts["image"], "parts": parts}))
        loop.backward_loss(None).backward()
    result = loop.finish(step=0)
    # text: (3 · 2 + 1 · 4) / 4 = 2.5; image: the first microbatch counts 0, (2 · 1) / 2 = 1
    assert float(w.grad) == pytest.approx(3.5, abs=1e-12)
    assert (result.items, result.local_items, result.loss) == (6.0, 6.0, pytest.approx(3.5))
    assert {name: (part.items, part.loss) for name, part in result.parts.items()} == {
        "text": (4.0, pytest.approx(2.5)),
        "image": (2.0, pytest.approx(1.0)),
    }


@pytest.mark.parametrize("seed", range(12))
def test_parts_counted_on_the_host_or_the_device_means_or_sums_each_train_and_log_their_own_mean(one_rank, seed):
    rng = random.Random(seed)
    parts, microbatches, on_device = rng.randint(1, 4), rng.randint(1, 3), seed % 2 == 1
    counts = [[rng.choice([0, 1, 2, 5]) for _ in range(microbatches)] for _ in range(parts)]
    means = [[rng.uniform(-2, 2) for _ in range(microbatches)] for _ in range(parts)]
    item_sums = [rng.random() < 0.5 for _ in range(microbatches)]  # each microbatch returns means or item sums
    w = nn.Parameter(torch.tensor(1.0, dtype=torch.float64))
    names = tuple("abcd"[:parts])
    loop = WindowLoop(_Engine(w), CPU, TRAINER, names)
    rows = [[torch.tensor(n) if on_device else n for n in row] for row in zip(*counts, strict=True)]
    planned = [read_counts(row, [True] * parts) for row in rows]  # each microbatch's counts of every part
    loop.plan(planned, None if seed % 3 else [float(sum(part)) for part in counts])  # N brought, or summed now
    for m, item_sum in enumerate(item_sums):
        losses = {name: w * means[k][m] * (counts[k][m] if item_sum else 1) for k, name in enumerate(names)}
        output = {"loss": sum(losses.values()), "parts": losses, "reduction": "sum" if item_sum else "mean"}
        loop.add(read_output(output))
        loop.backward_loss(None).backward()
    result = loop.finish(step=0)
    totals = [sum(part) for part in counts]
    expected = [
        sum(n * x for n, x in zip(c, xs, strict=True)) / t if t else math.nan
        for c, xs, t in zip(counts, means, totals, strict=True)
    ]
    grad = sum(e for e in expected if e == e)
    assert (0.0 if w.grad is None else float(w.grad)) == pytest.approx(grad, rel=1e-12, abs=1e-12)
    assert [(r.items, r.loss) for r in result.parts.values()] == [
        (float(t), pytest.approx(e, rel=1e-12, nan_ok=True)) for t, e in zip(totals, expected, strict=True)
    ]


@pytest.mark.parametrize("totals", [None, [4.0, 2.0]])  # N summed as the window starts (on the device), or brought
def test_a_microbatch_holding_no_item_of_any_part_contributes_exactly_zero_even_where_its_part_means_are_nan(
    one_rank, totals
):
    # the fully masked microbatch's part means are 0/0, whose backward sends NaN towards the parameters: the engine
    # cuts it, as it cuts a single loss counted 0
    w = nn.Parameter(torch.tensor(1.0))
    model = nn.Module()
    model.w = w
    loop = WindowLoop(DDPEngine(model, model), CPU, TRAINER, parts=("text", "image"))  # one rank: no DDP wrapper
    loop.plan([Counts((3.0, 0.0)), Counts((0.0, 0.0)), Counts((1.0, 2.0))], totals)
    nothing = torch.zeros(2)
    means = [(2.0, 0.0), None, (4.0, 1.0)]  # each part's mean (and gradient) at w = 1; None: 0/0 over no item
    for held in means:
        if held is None:
            parts = {name: (w * nothing).sum() / nothing.sum() for name in ("text", "image")}
        else:
            parts = {"text": w * held[0], "image": w * held[1]}
        loop.add(read_output({"loss": parts["text"] + parts["image"], "parts": parts}))
        loop.backward_loss(None).backward()
        loop.engine.after_backward()
    result = loop.finish(step=0)
    # text: (3 · 2 + 1 · 4) / 4 = 2.5; image: (2 · 1) / 2 = 1
    assert float(w.grad) == pytest.approx(3.5, abs=1e-12)
    assert {name: (part.items, part.loss) for name, part in result.parts.items()} == {
        "text": (4.0, pytest.approx(2.5)),
        "image": (2.0, pytest.approx(1.0)),
    }


def test_loss_parts_whose_names_differ_from_the_counted_ones_or_that_came_counted_after_fail_the_window(one_rank):
    w = nn.Parameter(torch.tensor(1.0))
    loop = WindowLoop(_Engine(w), CPU, TRAINER, parts=("text", "image"))
    loop.plan([Counts((1.0, 1.0))])
    parts = {"text": w * 1.0, "audio": w * 2.0}
    loop.add(read_output({"loss": w * 3.0, "parts": parts}))
    loop.backward_loss(None).backward()
    with pytest.raises(ValueError, match=r"on rank 0, training_step returned loss parts whose names differ from"):
        loop.finish(step=0)

    after = WindowLoop(_Engine(w), CPU, TRAINER)  # no plan: counts after the forwards
    after.add(read_output({"loss": w * 3.0, "parts": {"text": w * 1.0, "image": w * 2.0}, "count": 2}))
    after.backward_loss(w * 3.0).backward()
    with pytest.raises(ValueError, match=r"on rank 0, training_step returned loss parts \('parts'\), each a mean"):
        after.finish(step=0)


@pytest.mark.parametrize(
    ("wording", "counted", "fix", "not_said"),
    [
        (TRAINER, (), "with `ItemCounter(parts={name: ItemCounter(...), ...})`", "differ"),
        (FABRIC, (), "with `fabric.strategy.count_ahead({name: [n, ...], ...})`", "ItemCounter"),
        (FABRIC, ("text", "image"), "differ from the parts fabric.strategy.count_ahead counts", "ItemCounter"),
    ],
    ids=["trainer-one-count", "fabric-one-count", "fabric-other-names"],
)
def test_loss_parts_the_counts_do_not_match_are_refused_with_the_fix_of_the_front_end_that_counted(
    one_rank, wording, counted, fix, not_said
):
    w = nn.Parameter(torch.tensor(1.0))
    loop = WindowLoop(_Engine(w), CPU, wording, parts=counted)
    loop.plan([Counts((1.0,) * max(len(counted), 1))])
    loop.add(read_output({"loss": w * 3.0, "parts": {"text": w * 1.0, "audio": w * 2.0}}))
    loop.backward_loss(None).backward()
    with pytest.raises(ValueError) as raised:
        loop.finish(step=0)
    assert fix in str(raised.value) and not_said not in str(raised.value), raised.value


def test_every_loss_part_must_be_attached_to_the_graph(one_rank):
    w = nn.Parameter(torch.tensor(1.0))
    loop = WindowLoop(_Engine(w), CPU, TRAINER, parts=("text", "image"))
    loop.plan([Counts((2.0, 1.0)), Counts((2.0, 1.0))])
    for image in (w * 3.0, torch.zeros(())):  # the second microbatch's image part a constant
        parts = {"text": w * 1.0, "image": image}
        loop.add(read_output({"loss": parts["text"] + parts["image"], "parts": parts}))
        loop.backward_loss(None).backward()
    with pytest.raises(RuntimeError, match=r"on rank 0, training_step returned a loss that is not attached to the"):
        loop.finish(step=0)
