"""The window core without processes: counts in, loss scales out, the summed payload decoded into N or one error."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_weighted._counts import (
    MAX_ITEMS,
    Count,
    CountPayload,
    CountProblem,
    Slot,
    count_of,
    decode,
    read_count,
    split_output,
)
from lightning_weighted.reduce.ddp_hook import WeightedReduceState
from lightning_weighted.reduce.riding import MAX_RIDING_RANKS, RIDE_WIDTH, Ride, riding, unride
from lightning_weighted.window import LossScale, Window

CPU = torch.device("cpu")


def _sum(payloads: list[CountPayload]) -> list[float]:
    """What the SUM all-reduce of every rank's float64 payload gives."""
    return torch.stack([p.tensor(CPU) for p in payloads]).sum(0).tolist()


def _windows(counts: list[list[float]], scale: LossScale = LossScale.ITEM_SUM) -> list[tuple[Window, list[float]]]:
    """One window per rank, with the loss factor of each of its microbatches.

    ``GLOBAL_MEAN`` windows are planned first and receive the SUM of their planned items, as counts ahead do.
    """
    windows = [Window(scale) for _ in counts]
    if scale is LossScale.GLOBAL_MEAN:
        for window, rank_counts in zip(windows, counts, strict=True):
            window.plan(Count(n) for n in rank_counts)
        for window in windows:
            window.receive(sum(w.items for w in windows), divisor=len(windows))
    return [(w, [w.add(Count(n)) for n in c]) for w, c in zip(windows, counts, strict=True)]


def _synchronized_gradient(counts: list[list[float]], mean_grads: list[list[float]], scale: LossScale) -> float:
    """Plays an engine for a scalar parameter: scaled microbatch gradients, one SUM, one division by N / c_r
    (``GLOBAL_MEAN``: nothing to divide, the reduction averages over the ranks, as DDP's own does)."""
    windows = _windows(counts, scale)
    summed = _sum([window.payload(rank) for rank, (window, _) in enumerate(windows)])
    items = decode(summed).items
    total = 0.0
    for (window, factors), grads in zip(windows, mean_grads, strict=True):
        local = sum(f * g for f, g in zip(factors, grads, strict=True))  # Σ_m n_m ḡ_m / c_r
        if scale is LossScale.GLOBAL_MEAN:
            total += local / len(windows)
        else:
            total += local / ((items or 1.0) / (window.reference or 1.0))
    return total


@pytest.mark.parametrize("scale", list(LossScale))
def test_worked_trace_gives_the_global_item_mean_where_ddp_gives_the_mean_of_means(scale):
    # rank 0: targets [9, 9] → n = 2, mean grad 1;  rank 1: [7] * 6 → n = 6, mean grad 3
    weighted = _synchronized_gradient([[2], [6]], [[1.0], [3.0]], scale)
    plain = (1.0 + 3.0) / 2
    assert weighted == pytest.approx(2.5, abs=1e-15)  # (2·1 + 6·3) / 8
    assert plain == 2.0
    assert 10 - 0.1 * weighted == pytest.approx(9.75, abs=1e-15)
    assert 10 - 0.1 * plain == pytest.approx(9.8, abs=1e-15)


def test_worked_trace_mean_sized_divisors_are_the_mean_reducer_scales_half_and_one_and_a_half():
    windows = _windows([[2], [6]], LossScale.MEAN_SIZED)
    items = decode(_sum([w.payload(r) for r, (w, _) in enumerate(windows)])).items
    world_size = 2
    # a mean reducer scales each local mean gradient by P·n_r/N: 2·2/8 = 0.5 and 2·6/8 = 1.5
    assert [world_size * w.reference / items for w, _ in windows] == [0.5, 1.5]
    assert (0.5 * 1 + 1.5 * 3) / 2 == 2.5


def test_equal_counts_with_mean_sized_losses_reduce_to_dividing_by_the_world_size():
    windows = _windows([[5]] * 4, LossScale.MEAN_SIZED)
    items = decode(_sum([w.payload(r) for r, (w, _) in enumerate(windows)])).items
    assert [items / w.reference for w, _ in windows] == [4.0] * 4
    assert all(factors == [1.0] for _, factors in windows)  # one microbatch per window: losses untouched


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("scale", list(LossScale))
def test_random_counts_and_windows_match_the_weighted_mean(seed, scale):
    rng = random.Random(seed)
    ranks, accumulate = rng.randint(1, 5), rng.randint(1, 4)
    counts = [[rng.choice([0, 0.5, 1, 3, 17, 2.25]) for _ in range(rng.randint(1, accumulate))] for _ in range(ranks)]
    grads = [[rng.uniform(-5, 5) for _ in c] for c in counts]
    total = sum(map(sum, counts))
    pairs = ((n, g) for cs, gs in zip(counts, grads, strict=True) for n, g in zip(cs, gs, strict=True))
    expected = sum(n * g for n, g in pairs) / total if total else 0.0
    assert _synchronized_gradient(counts, grads, scale) == pytest.approx(expected, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("seed", range(10))
def test_global_mean_factors_against_a_sum_reduction_give_the_weighted_mean_with_nothing_to_divide(seed):
    # the sharded strategies' reductions SUM: N is received with a divisor of 1, each factor is n / N
    rng = random.Random(seed)
    counts = [[rng.choice([0, 1, 3, 17, 2.5]) for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(1, 5))]
    grads = [[rng.uniform(-5, 5) for _ in c] for c in counts]
    total = sum(map(sum, counts))
    windows = [Window(LossScale.GLOBAL_MEAN) for _ in counts]
    for window, rank_counts in zip(windows, counts, strict=True):
        window.plan(Count(n) for n in rank_counts)
        window.receive(total, divisor=1)
    summed = sum(
        window.add(Count(n)) * g
        for window, cs, gs in zip(windows, counts, grads, strict=True)
        for n, g in zip(cs, gs, strict=True)
    )
    pairs = ((n, g) for cs, gs in zip(counts, grads, strict=True) for n, g in zip(cs, gs, strict=True))
    expected = sum(n * g for n, g in pairs) / total if total else 0.0
    assert summed == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_item_sum_factors_are_the_counts_and_mean_sized_ones_are_relative_to_the_first_positive_count():
    item_sums = Window(LossScale.ITEM_SUM)
    assert [item_sums.add(Count(n)) for n in (0, 4, 2)] == [0.0, 4.0, 2.0]
    mean_sized = Window(LossScale.MEAN_SIZED)
    assert [mean_sized.add(Count(n)) for n in (0, 4, 2)] == [0.0, 1.0, 0.5]
    assert (mean_sized.items, mean_sized.reference) == (6.0, 4.0)


def test_a_loss_marked_as_an_item_sum_is_scaled_by_one_over_the_reference_not_by_its_count():
    window = Window(LossScale.ITEM_SUM)
    assert window.add(Count(3.0), loss=torch.tensor(6.0), item_sum=True) == 1.0  # already Σ over 3 items
    assert window.add(Count(2.0), loss=torch.tensor(1.5)) == 2.0  # a mean over 2 items
    assert float(window.payload(0).loss_sum) == 6.0 + 2 * 1.5  # Σ n·mean, whichever way each loss came
    mean_sized = Window(LossScale.MEAN_SIZED)
    assert mean_sized.add(Count(4.0), loss=torch.tensor(8.0), item_sum=True) == 0.25  # 8 / 4 = the mean
    assert mean_sized.add(Count(2.0), loss=torch.tensor(1.0), item_sum=True) == 0.25  # 1 / 4


def test_a_one_element_loss_of_any_shape_is_summed_into_the_window_loss():
    window = Window()
    window.add(Count(2.0), loss=torch.tensor([[1.5]]))
    assert window.payload(0).loss_sum.shape == ()  # type: ignore[union-attr]
    assert float(window.payload(0).loss_sum) == 3.0


def test_a_window_without_items_gives_n_zero_and_a_nan_loss():
    window = Window()
    assert window.add(Count(0.0), loss=torch.tensor(math.nan)) == 0.0  # a fully masked microbatch: 0/0
    result = window.finish(_sum([window.payload(0), Window().payload(1)]), step=7)
    assert (result.step, result.items, result.local_items) == (7, 0.0, 0.0)
    assert math.isnan(result.loss)


def test_the_window_result_holds_the_global_item_mean_of_the_loss_and_the_ranks_with_more_data():
    windows = [Window(), Window()]
    windows[0].add(Count(2.0), loss=torch.tensor(1.0))  # Σ n·loss = 2
    windows[1].add(Count(6.0), loss=torch.tensor(3.0))  # 18
    result = windows[1].finish(_sum([windows[0].payload(0, more=True), windows[1].payload(1, more=False)]))
    assert (result.items, result.local_items, result.loss, result.ranks_with_more) == (8.0, 6.0, 2.5, 1)


@pytest.mark.parametrize("count", [2**24 + 1, 2**31, 2**40 + 1])
def test_large_counts_stay_exact_in_the_float64_payload(count):
    windows = _windows([[count]] * 3)
    assert decode(_sum([w.payload(r) for r, (w, _) in enumerate(windows)])).items == 3 * count


def test_float32_would_round_the_count_that_float64_keeps():
    assert torch.tensor(2.0**24 + 1, dtype=torch.float32).item() == 2**24


def test_1001_is_exact_where_bfloat16_rounds_to_1000():
    assert torch.tensor(1001.0, dtype=torch.bfloat16).item() == 1000.0
    assert read_count(torch.tensor(1001, dtype=torch.int64)) == (1001.0, None)
    windows = _windows([[1001.0], [1001.0]])
    assert decode(_sum([w.payload(r) for r, (w, _) in enumerate(windows)])).items == 2002.0


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (3, (3.0, None)),
        (2.5, (2.5, None)),
        (torch.tensor(7), (7.0, None)),
        (torch.tensor(0.25, dtype=torch.float64), (0.25, None)),
        (0, (0.0, None)),
        (-1, (-1.0, CountProblem.NEGATIVE)),
        (math.inf, (math.inf, CountProblem.NOT_FINITE)),
        (torch.tensor(-math.inf), (-math.inf, CountProblem.NOT_FINITE)),
    ],
)
def test_read_count_accepts_numbers_and_scalar_tensors(value, expected):
    assert read_count(value) == expected


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("3", CountProblem.NOT_A_NUMBER),
        (None, CountProblem.NOT_A_NUMBER),
        (True, CountProblem.NOT_A_NUMBER),
        (torch.tensor([1, 2]), CountProblem.NOT_A_SCALAR),
        (torch.tensor(True), CountProblem.NOT_A_NUMBER),
    ],
)
def test_read_count_rejects_what_is_not_a_scalar_number(value, problem):
    assert read_count(value)[1] is problem


def test_read_count_requires_whole_numbers_for_examples_and_tokens():
    assert read_count(2.5, integer=True) == (2.5, CountProblem.FRACTIONAL)
    assert read_count(torch.tensor(3.0), integer=True) == (3.0, None)
    assert read_count(2.5) == (2.5, None)


def test_read_count_flags_nan_as_not_finite():
    value, problem = read_count(float("nan"))
    assert math.isnan(value) and problem is CountProblem.NOT_FINITE


def test_the_count_rule_takes_a_returned_count_then_a_supplied_one_then_the_batch_size():
    batch = torch.zeros(5, 3)
    loss = torch.tensor(1.0)
    assert count_of({"loss": loss, "count": 2}, batch, supplied=(7, True)) == Count(2.0)
    assert count_of({"loss": loss}, batch, supplied=(7, True)) == Count(7.0)
    assert count_of(loss, batch, supplied=(7, True)) == Count(7.0)
    # nothing gave a count: the batch size, marked as an implicit choice (a dict without "count" too)
    assert count_of({"loss": loss}, batch) == Count(5.0, implicit=True)
    assert count_of(loss, batch) == Count(5.0, implicit=True)
    # the supplied count keeps its own integer rule
    assert count_of(loss, batch, supplied=(2.5, True)) == Count(2.5, CountProblem.FRACTIONAL)


def test_split_output_finds_the_loss_and_whether_it_is_an_item_sum():
    loss = torch.tensor(1.0)
    assert split_output(loss) == (loss, False, None)
    assert split_output({"loss": loss}) == (loss, False, None)
    assert split_output({"loss": loss, "reduction": "mean"}) == (loss, False, None)
    assert split_output({"loss": loss, "reduction": "sum"}) == (loss, True, None)
    assert split_output({"loss": loss, "reduction": "none"}) == (loss, False, CountProblem.REDUCTION)
    assert split_output(None) == (None, False, None)
    assert split_output({"count": 3}) == (None, False, None)


@pytest.mark.parametrize(
    ("problem", "value", "error", "match"),
    [
        (CountProblem.NEGATIVE, -3.0, ValueError, r"on rank 1, a microbatch's count is negative \(-3\.0\)\. Return"),
        (CountProblem.NOT_FINITE, math.nan, ValueError, r"on rank 1, a microbatch's count is not finite \(nan\)"),
        (CountProblem.NOT_A_NUMBER, math.nan, TypeError, r"on rank 1, a microbatch's count is not a number"),
        (CountProblem.NO_LOSS, math.nan, RuntimeError, r"on rank 1, training_step returned None instead of a loss"),
        (CountProblem.NO_GRAPH, math.nan, RuntimeError, r"training_step returned a loss that is not attached to the"),
        (CountProblem.FRACTIONAL, 2.5, ValueError, r"on rank 1, a microbatch's count of examples or tokens is fract"),
        (CountProblem.TOO_LARGE, 1e20, ValueError, r"on rank 1, the window's count reaches 2\*\*53 \(1e\+20\)"),
        (CountProblem.REDUCTION, math.nan, ValueError, r"on rank 1, training_step returned a 'reduction' that is"),
    ],
)
def test_one_bad_rank_gives_the_same_error_naming_rank_value_and_fix_everywhere(problem, value, error, match):
    good, bad = Window(), Window()
    good.add(Count(4.0))
    bad.reject(problem, value)
    summed = _sum([good.payload(0), bad.payload(1)])
    for window in (good, bad):  # every rank raises the same error from the same sum
        with pytest.raises(error, match=match):
            window.finish(summed)
    assert decode(summed).items == 4.0  # the bad count never enters N


def test_an_invalid_count_becomes_the_windows_problem_and_adds_nothing():
    window = Window()
    assert window.add(Count(-2.0, CountProblem.NEGATIVE)) == 0.0
    assert (window.items, window.problem) == (0.0, (CountProblem.NEGATIVE, -2.0))


def test_several_bad_ranks_are_counted():
    windows = [Window(), Window(), Window()]
    windows[0].reject(CountProblem.NEGATIVE, -1.0)
    windows[2].reject(CountProblem.NOT_FINITE, math.inf)
    with pytest.raises(ValueError, match="on 2 ranks, a microbatch's count or loss is invalid"):
        windows[1].finish(_sum([w.payload(r) for r, w in enumerate(windows)]))


def test_only_the_first_problem_of_a_window_is_reported():
    window = Window()
    window.reject(CountProblem.NEGATIVE, -2.0)
    window.reject(CountProblem.NOT_A_NUMBER)
    fields = window.payload(0).fields()
    assert (fields[Slot.INVALID], fields[Slot.CODE], fields[Slot.VALUE]) == (1.0, float(CountProblem.NEGATIVE), -2.0)


def _ride_sum(payloads: list[CountPayload], dtype: torch.dtype = torch.float32) -> list[float]:
    """What the SUM all-reduce of payloads riding in a bucket of ``dtype`` gives, as the float64 payload."""
    summed = torch.zeros(RIDE_WIDTH, dtype=dtype)
    for payload in payloads:  # one rank after another, each partial sum rounded to `dtype` as a ring would
        summed += riding(payload, CPU, dtype)
    return unride(summed).tolist()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2**40), min_size=1, max_size=4), min_size=1, max_size=6))
def test_integer_counts_riding_in_fp32_sum_exactly(counts):
    windows = _windows([[float(n) for n in c] for c in counts])
    summed = _ride_sum([w.payload(rank, more=rank % 2 == 0) for rank, (w, _) in enumerate(windows)])
    assert summed[Slot.ITEMS] == sum(map(sum, counts))  # exact, where an fp32 sum rounds above 2**24
    assert summed[Slot.MORE] == len([r for r in range(len(counts)) if r % 2 == 0])


def test_the_largest_digit_sum_over_the_most_riding_ranks_is_an_exact_fp32_integer():
    assert 255 * MAX_RIDING_RANKS <= 2**24 < 255 * (MAX_RIDING_RANKS + 1)
    digit_sum = torch.tensor(255.0, dtype=torch.float32) * MAX_RIDING_RANKS
    assert int(digit_sum.item()) == 255 * MAX_RIDING_RANKS
    # the whole part of a rank's window count spans 8 base-256 digits; the window cap is 2**53
    assert _ride_sum([CountPayload(MAX_ITEMS, None, 0, False)])[Slot.ITEMS] == MAX_ITEMS


def test_weight_sums_ride_with_their_fraction_in_fp32():
    payloads = [
        CountPayload(1000.25, None, 0, True, loss_sum=torch.tensor(2.5)),
        CountPayload(0.1 + 0.2, None, 1, False, loss_sum=torch.tensor(1.0)),
    ]
    summed = _ride_sum(payloads)
    # whole parts exact; each fraction (< 1) and their fp32 sum are rounded: at most P·2**-24 in all
    assert summed[Slot.ITEMS] == pytest.approx(1000.25 + 0.30000000000000004, abs=len(payloads) * 2**-24)
    assert summed[Slot.LOSS] == 3.5  # Σ n·loss, in fp32


def test_an_invalid_count_rides_as_a_flag_and_its_details_are_left_to_float64():
    bad = Window()
    bad.reject(CountProblem.NEGATIVE, -3.0)
    summed = _ride_sum([bad.payload(1)])
    assert summed[Slot.INVALID] == 1.0 and summed[Slot.CODE] == summed[Slot.VALUE] == 0.0
    assert riding(bad.payload(1), CPU, torch.float32)[Ride.INVALID] == 1.0


def test_a_window_count_beyond_2_to_the_53_is_rejected_rather_than_rounded():
    window = Window()
    assert window.add(Count(MAX_ITEMS - 1)) == MAX_ITEMS - 1
    assert window.add(Count(1.0)) == 0.0
    assert window.problem == (CountProblem.TOO_LARGE, MAX_ITEMS)
    assert window.items == MAX_ITEMS - 1


@pytest.mark.parametrize(
    ("dtypes", "world_size", "rides"),
    [
        ([torch.float32], 2, True),
        ([torch.float64, torch.float32], 8, True),
        ([torch.float32], MAX_RIDING_RANKS, True),
        ([torch.float32], MAX_RIDING_RANKS + 1, False),
        ([torch.bfloat16], 2, False),
        ([torch.float32, torch.float16], 2, False),
    ],
)
def test_counts_ride_only_where_they_stay_exact(dtypes, world_size, rides):
    assert WeightedReduceState.can_ride(dtypes, world_size) is rides
