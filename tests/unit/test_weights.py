"""The window arithmetic, without processes."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_weighted._weights import (
    MAX_ITEMS,
    MAX_RIDING_RANKS,
    RIDE_WIDTH,
    CountProblem,
    WindowCount,
    decode,
    divisor,
    read_count,
    ride,
    unride,
)
from lightning_weighted.hook import WeightedReduceState


def _reduce(windows: list[WindowCount]) -> list[float]:
    """What the SUM all-reduce of every rank's count vector gives."""
    vectors = [w.vector(rank) for rank, w in enumerate(windows)]
    return [math.fsum(column) for column in zip(*vectors, strict=False)]


def _synchronized_gradient(counts: list[list[float]], mean_grads: list[list[float]], accumulate: int) -> float:
    """Plays the strategy and the hook for a scalar parameter: scaled microbatch grads, divide, SUM."""
    windows, buckets = [], []
    for rank_counts, rank_grads in zip(counts, mean_grads, strict=False):
        window, bucket = WindowCount(), 0.0
        for n, g in zip(rank_counts, rank_grads, strict=False):
            factor = window.add(n) * accumulate  # the strategy's loss multiplier (Lightning divided by A)
            bucket += factor * g / accumulate
        windows.append(window)
        buckets.append(bucket)
    items = torch.tensor(_reduce(windows)[0], dtype=torch.float64)
    return sum(b / float(divisor(items, w.reference)) for b, w in zip(buckets, windows, strict=False))


def test_worked_trace_gives_the_global_item_mean_where_ddp_gives_the_mean_of_means():
    # rank 0: targets [9, 9] → n = 2, mean grad 1;  rank 1: [7] * 6 → n = 6, mean grad 3
    weighted = _synchronized_gradient([[2], [6]], [[1.0], [3.0]], accumulate=1)
    plain = (1.0 + 3.0) / 2
    assert weighted == pytest.approx(2.5, abs=1e-15)  # (2·1 + 6·3) / 8
    assert plain == 2.0
    assert 10 - 0.1 * weighted == pytest.approx(9.75, abs=1e-15)
    assert 10 - 0.1 * plain == pytest.approx(9.8, abs=1e-15)


def test_worked_trace_divisors_are_the_mean_reducer_scales_half_and_one_and_a_half():
    windows = [WindowCount(), WindowCount()]
    windows[0].add(2)
    windows[1].add(6)
    items = torch.tensor(_reduce(windows)[0], dtype=torch.float64)
    world_size = 2
    # a mean reducer scales each local mean gradient by P·n_r/N: 2·2/8 = 0.5 and 2·6/8 = 1.5
    scales = [world_size / float(divisor(items, w.reference)) for w in windows]
    assert scales == [0.5, 1.5]
    assert (0.5 * 1 + 1.5 * 3) / 2 == 2.5


def test_equal_counts_reduce_to_dividing_by_the_world_size():
    windows = [WindowCount() for _ in range(4)]
    for w in windows:
        w.add(5)
    items = torch.tensor(_reduce(windows)[0], dtype=torch.float64)
    assert [float(divisor(items, w.reference)) for w in windows] == [4.0] * 4


@pytest.mark.parametrize("seed", range(20))
def test_random_counts_and_windows_match_the_weighted_mean(seed):
    rng = random.Random(seed)
    ranks, accumulate = rng.randint(1, 5), rng.randint(1, 4)
    counts = [[rng.choice([0, 0.5, 1, 3, 17, 2.25]) for _ in range(rng.randint(1, accumulate))] for _ in range(ranks)]
    grads = [[rng.uniform(-5, 5) for _ in c] for c in counts]
    total = sum(map(sum, counts))
    expected = (
        sum(n * g for cs, gs in zip(counts, grads, strict=False) for n, g in zip(cs, gs, strict=False)) / total
        if total
        else 0.0
    )
    assert _synchronized_gradient(counts, grads, accumulate) == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_a_window_without_items_divides_by_one_and_stays_zero():
    windows = [WindowCount(), WindowCount()]
    windows[0].add(0)
    summed = _reduce(windows)
    assert decode(summed).items == 0.0
    assert float(divisor(torch.tensor(summed[0], dtype=torch.float64), windows[0].reference)) == 1.0


@pytest.mark.parametrize("count", [2**24 + 1, 2**31, 2**40 + 1])
def test_large_counts_stay_exact_in_the_float64_vector(count):
    windows = [WindowCount(), WindowCount(), WindowCount()]
    for w in windows:
        w.add(count)
    summed = torch.tensor(_reduce(windows), dtype=torch.float64)
    assert int(summed[0].item()) == 3 * count


def test_float32_would_round_the_count_that_float64_keeps():
    assert torch.tensor(2.0**24 + 1, dtype=torch.float32).item() == 2**24


def test_1001_is_exact_where_bfloat16_rounds_to_1000():
    assert torch.tensor(1001.0, dtype=torch.bfloat16).item() == 1000.0
    windows = [WindowCount(), WindowCount()]
    for w in windows:
        assert read_count(torch.tensor(1001, dtype=torch.int64)) == (1001.0, None)
        w.add(1001.0)
    assert decode(_reduce(windows)).items == 2002.0


def test_the_first_positive_count_is_the_reference_and_factors_are_relative_to_it():
    window = WindowCount()
    assert window.add(0) == 0.0
    assert window.add(4) == 1.0
    assert window.add(2) == 0.5
    assert (window.items, window.reference) == (6.0, 4.0)


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


@pytest.mark.parametrize(
    ("problem", "value", "error", "match"),
    [
        (CountProblem.NEGATIVE, -3.0, ValueError, r"on rank 1, a microbatch's count is negative \(-3\.0\)\. Return"),
        (CountProblem.NOT_FINITE, math.nan, ValueError, r"on rank 1, a microbatch's count is not finite \(nan\)"),
        (CountProblem.NOT_A_NUMBER, math.nan, TypeError, r"on rank 1, a microbatch's count is not a number"),
        (CountProblem.MISSING, math.nan, ValueError, r"on rank 1, training_step returned a dict without a 'count'"),
        (CountProblem.NO_LOSS, math.nan, RuntimeError, r"on rank 1, training_step returned None instead of a loss"),
        (CountProblem.NO_GRAPH, math.nan, RuntimeError, r"training_step returned a loss that is not attached to the"),
        (CountProblem.FRACTIONAL, 2.5, ValueError, r"on rank 1, a microbatch's count of examples or tokens is fract"),
        (
            CountProblem.TOO_LARGE,
            1e20,
            ValueError,
            r"on rank 1, the window's count reaches 2\*\*53 \(1e\+20\)",
        ),
    ],
)
def test_one_bad_rank_gives_the_same_error_naming_rank_value_and_fix_everywhere(problem, value, error, match):
    windows = [WindowCount(), WindowCount()]
    windows[0].add(4)
    windows[1].reject(problem, value)
    summed = _reduce(windows)
    with pytest.raises(error, match=match):
        raise decode(summed).error  # type: ignore[misc]
    assert decode(summed).items == 4.0  # the bad count never enters N


def test_several_bad_ranks_are_counted():
    windows = [WindowCount(), WindowCount(), WindowCount()]
    windows[0].reject(CountProblem.NEGATIVE, -1.0)
    windows[2].reject(CountProblem.NOT_FINITE, math.inf)
    with pytest.raises(ValueError, match="on 2 ranks, a microbatch's count or loss is invalid"):
        raise decode(_reduce(windows)).error  # type: ignore[misc]


def test_only_the_first_problem_of_a_window_is_reported():
    window = WindowCount()
    window.reject(CountProblem.NEGATIVE, -2.0)
    window.reject(CountProblem.NOT_A_NUMBER)
    assert window.vector(0) == [0.0, 1.0, float(CountProblem.NEGATIVE), -2.0, 1.0, 0.0]


def _ride_sum(vectors: list[list[float]], dtype: torch.dtype = torch.float32) -> list[float]:
    """What the SUM all-reduce of the counts riding in a bucket of ``dtype`` gives, as the float64 vector."""
    summed = torch.zeros(RIDE_WIDTH, dtype=dtype)
    for vector in vectors:  # one rank after another, each partial sum rounded to `dtype` as a ring would
        summed += torch.tensor(ride(vector), dtype=dtype)
    return unride(summed).tolist()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2**40), min_size=1, max_size=4), min_size=1, max_size=6))
def test_integer_counts_riding_in_fp32_sum_exactly(counts):
    windows = [WindowCount() for _ in counts]
    for window, rank_counts in zip(windows, counts, strict=True):
        for n in rank_counts:
            window.add(float(n))
    summed = _ride_sum([w.vector(rank, more=rank % 2 == 0) for rank, w in enumerate(windows)])
    assert summed[0] == sum(map(sum, counts))  # exact, where an fp32 sum of the counts rounds above 2**24
    assert summed[4] == len([r for r in range(len(counts)) if r % 2 == 0])


def test_the_largest_digit_sum_over_the_most_riding_ranks_is_an_exact_fp32_integer():
    assert 255 * MAX_RIDING_RANKS <= 2**24 < 255 * (MAX_RIDING_RANKS + 1)
    digit_sum = torch.tensor(255.0, dtype=torch.float32) * MAX_RIDING_RANKS
    assert int(digit_sum.item()) == 255 * MAX_RIDING_RANKS
    # the whole part of a rank's window count spans 8 base-256 digits; the window cap is 2**53
    assert unride(torch.tensor(ride([MAX_ITEMS, 0, 0, 0, 0, 0]), dtype=torch.float32)).tolist()[0] == MAX_ITEMS


def test_weight_sums_ride_with_their_fraction_in_fp32():
    vectors = [[1000.25, 0, 0, 0, 1, 2.5], [0.1 + 0.2, 0, 0, 0, 0, 1.0]]
    summed = _ride_sum(vectors)
    # whole parts exact; each fraction (< 1) and their fp32 sum are rounded: at most P·2**-24 in all
    assert summed[0] == pytest.approx(1000.25 + 0.30000000000000004, abs=len(vectors) * 2**-24)
    assert summed[5] == 3.5  # Σ n·loss, in fp32


def test_an_invalid_count_rides_as_a_flag_and_its_details_are_left_to_float64():
    bad = WindowCount()
    bad.reject(CountProblem.NEGATIVE, -3.0)
    summed = _ride_sum([bad.vector(1)])
    assert summed[1] == 1.0 and summed[2] == summed[3] == 0.0


def test_a_window_count_beyond_2_to_the_53_is_rejected_rather_than_rounded():
    window = WindowCount()
    assert window.add(MAX_ITEMS - 1) == 1.0
    assert window.add(1.0) == 0.0
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
