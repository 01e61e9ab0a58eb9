"""The window core without processes: counts in, loss factors out, the summed payload decoded into N or one error."""

from __future__ import annotations

import math
import random
import sys
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_weighted.count import (
    MAX_ITEMS,
    TRAINER,
    Count,
    Counts,
    Problem,
    Wording,
    host_items,
    problem_error,
    read_count,
    read_counts,
)
from lightning_weighted.payload import SUMMED, Slot, WindowResult, at, window_result
from lightning_weighted.window import Window, payload

CPU = torch.device("cpu")


class Unreadable(torch.Tensor):
    """A tensor standing for one on a GPU: reading it on the host (a device synchronisation there) fails the test."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in ("item", "tolist", "__float__", "__int__", "__bool__", "numpy"):
            raise AssertionError(f"a device value was read on the host: {func.__name__}")
        return super().__torch_function__(func, types, args, kwargs or {})


Tensor = torch.Tensor


def device(value: float, dtype: torch.dtype = torch.int64) -> Tensor:
    return torch.tensor(value, dtype=dtype).as_subclass(Unreadable)


def _factor(window: Window, count: Count, **kwargs: Any) -> float | Tensor:
    """What the loop multiplies the microbatch's loss by: the factor of the weight the window recorded."""
    return window.factor(window.add(count, **kwargs))


def _summed(windows: list[Window], own: int = 0, more: Any = True, next_items: Any = 0.0) -> list[float]:
    """What the loop reads on rank ``own`` after the SUM of every rank's float64 payload (its own LOCAL kept)."""
    payloads = [
        payload(
            [w],
            more[r] if isinstance(more, list) else more,
            CPU,
            [next_items[r]] if isinstance(next_items, tuple) else (),
        ).as_subclass(Tensor)
        for r, w in enumerate(windows)
    ]
    summed = torch.stack(payloads).sum(0).tolist()
    return [*summed[:SUMMED], float(payloads[own][Slot.LOCAL])]


def _read(windows: list[Window], own: int = 0, wording: Wording = TRAINER, **payloads: Any) -> list[float]:
    """Rank ``own``'s summed payload, read as the loop's exchange reads it (``loop.Exchange.read``).

    Where some rank found a problem, every rank raises the one error of every rank's problem row, in rank order.
    """
    summed = _summed(windows, own, **payloads)
    if summed[Slot.INVALID] > 0:
        raise problem_error([w.problem_row(CPU).as_subclass(Tensor).tolist() for w in windows], wording)
    return summed


def _finish(windows: list[Window], own: int = 0, step: int = 0, **payloads: Any) -> WindowResult:
    """Rank ``own``'s window result, or the error every rank raises."""
    return window_result(_read(windows, own, **payloads), step)


def _gradient(counts: list[list[float]], mean_grads: list[list[float]], ahead: bool, divisor: int) -> float:
    """Plays an engine for a scalar parameter whose reduction divides the SUM of the ranks' gradients by ``divisor``.

    Counted ahead, each factor is D·n/N and the reduction's result is final; counted after, the reduced gradient is
    multiplied by D·c/N, the loop's one pass.
    """
    total = sum(map(sum, counts))
    windows = [Window(total=total, divisor=divisor) if ahead else Window() for _ in counts]
    local = [
        sum(float(_factor(window, Count(float(n)))) * g for n, g in zip(cs, gs, strict=True))
        for window, cs, gs in zip(windows, counts, mean_grads, strict=True)
    ]
    reduced = sum(local) / divisor
    if ahead:
        return reduced
    items = _finish(windows).items
    return reduced * divisor * windows[0].scale / items if items > 0 else 0.0


@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("divisor", [2, 1])  # DDP's average over the 2 ranks, or FSDP's SUM
def test_worked_trace_gives_the_global_item_mean_where_ddp_gives_the_mean_of_means(ahead, divisor):
    # rank 0: targets [9, 9] → n = 2, mean grad 1;  rank 1: [7] * 6 → n = 6, mean grad 3
    weighted = _gradient([[2], [6]], [[1.0], [3.0]], ahead, divisor)
    plain = (1.0 + 3.0) / 2
    assert weighted == pytest.approx(2.5, abs=1e-15)  # (2·1 + 6·3) / 8
    assert plain == 2.0
    assert 10 - 0.1 * weighted == pytest.approx(9.75, abs=1e-15)
    assert 10 - 0.1 * plain == pytest.approx(9.8, abs=1e-15)


def test_worked_trace_factors_counted_ahead_are_the_mean_reducer_scales_half_and_one_and_a_half():
    # a mean reducer scales each local mean gradient by P·n_r/N: 2·2/8 = 0.5 and 2·6/8 = 1.5
    assert [_factor(Window(total=8.0, divisor=2), Count(n)) for n in (2.0, 6.0)] == [0.5, 1.5]
    assert (0.5 * 1 + 1.5 * 3) / 2 == 2.5


def test_equal_counts_and_one_microbatch_per_window_are_plain_ddps_average():
    assert [_factor(Window(total=4 * 5.0, divisor=4), Count(5.0)) for _ in range(4)] == [1.0] * 4  # losses untouched


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize(("ahead", "divisor"), [(False, 3), (True, 3), (False, 1), (True, 1)])
def test_random_counts_and_windows_match_the_weighted_mean(seed, ahead, divisor):
    rng = random.Random(seed)
    ranks, accumulate = rng.randint(1, 5), rng.randint(1, 4)
    counts = [[rng.choice([0, 0.5, 1, 3, 17, 2.25]) for _ in range(rng.randint(1, accumulate))] for _ in range(ranks)]
    grads = [[rng.uniform(-5, 5) for _ in c] for c in counts]
    total = sum(map(sum, counts))
    pairs = ((n, g) for cs, gs in zip(counts, grads, strict=True) for n, g in zip(cs, gs, strict=True))
    expected = sum(n * g for n, g in pairs) / total if total else 0.0
    assert _gradient(counts, grads, ahead, divisor) == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_factors_counted_after_are_the_counts_over_the_scale():
    assert [Window().add(Count(n)) for n in (0.0, 4.0, 2.0)] == [0.0, 4.0, 2.0]
    assert [_factor(Window(scale=4.0), Count(n)) for n in (0.0, 4.0, 2.0)] == [0.0, 1.0, 0.5]  # mean-sized


def test_a_loss_marked_as_an_item_sum_is_scaled_by_one_over_the_scale_not_by_its_count():
    window = Window()
    assert window.add(Count(3.0), loss=torch.tensor(6.0), item_sum=True) == 1.0  # already Σ over 3 items
    assert window.add(Count(2.0), loss=torch.tensor(1.5)) == 2.0  # a mean over 2 items
    assert payload([window], True, CPU)[Slot.LOSS] == 6.0 + 2 * 1.5  # Σ n·mean, whichever way each loss came
    assert _factor(Window(total=10.0, divisor=2), Count(4.0), loss=torch.tensor(8.0), item_sum=True) == 0.2  # D/N


def test_a_one_element_loss_of_any_shape_is_summed_into_the_window_loss():
    window = Window()
    window.add(Count(2.0), loss=torch.tensor([[1.5]]))
    assert payload([window], True, CPU)[Slot.LOSS] == 3.0


@pytest.mark.parametrize("microbatches", [1, 4, 64, 150])  # the losses held, weighed at the end or in blocks
def test_the_window_loss_weighs_every_microbatchs_loss_once_whatever_its_shape_dtype_or_number(microbatches):
    rng = random.Random(microbatches)
    window, expected = Window(), 0.0
    for m in range(microbatches):
        n, item_sum = float(rng.choice([0, 1, 3, 17])), rng.random() < 0.3
        dtype, shape = rng.choice([torch.float32, torch.float16, torch.float64]), rng.choice([(), (1,), (1, 1)])
        loss = torch.full(shape, math.nan if n == 0 else rng.uniform(-4, 4), dtype=dtype)  # 0/0 where nothing counts
        weight = window.add(Count(n), loss=loss, item_sum=item_sum)
        expected += 0.0 if n == 0 else float(loss.sum()) * (1.0 if item_sum else n)
        assert weight == (0.0 if n == 0 else 1.0 if item_sum else n), m
    first, again = payload([window], True, CPU)[Slot.LOSS], payload([window], True, CPU)[Slot.LOSS]
    assert float(first) == float(again) == pytest.approx(expected, rel=1e-13, abs=1e-13)
    assert first.dtype == torch.float64


def test_a_window_without_items_gives_n_zero_and_a_nan_loss():
    window = Window()
    assert window.add(Count(0.0), loss=torch.tensor(math.nan)) == 0.0  # a fully masked microbatch: 0/0
    result = _finish([window, Window()], step=7)
    assert (result.step, result.items, result.local_items) == (7, 0.0, 0.0)
    assert math.isnan(result.loss)


def test_the_window_result_holds_the_global_item_mean_of_the_loss_and_the_summed_payload_the_ranks_with_more_data():
    windows = [Window(), Window()]
    windows[0].add(Count(2.0), loss=torch.tensor(1.0))  # Σ n·loss = 2
    windows[1].add(Count(6.0), loss=torch.tensor(3.0))  # 18
    summed = _read(windows, own=1, more=[True, False])
    result = window_result(summed, step=0)
    assert (result.items, result.local_items, result.loss, summed[Slot.MORE]) == (8.0, 6.0, 2.5, 1.0)
    assert result.parts == {}  # one unnamed loss


def test_an_infinite_loss_spike_leaves_the_counts_exact():
    # a loss that turns inf on one rank (SpikeDetection's case): only the loss slot is inf, N and the flags stay
    window = Window()
    window.add(Count(3.0), loss=torch.tensor(math.inf))
    window.add(read_count(device(2.0)), loss=torch.tensor(math.inf))
    summed = _read([window, Window()])
    result = window_result(summed, step=0)
    assert (result.items, summed[Slot.MORE], result.loss) == (5.0, 2.0, math.inf)
    assert summed[Slot.NAN_EMPTY] == 0.0  # counted microbatches: nothing to check after the backward


def test_counts_ahead_carry_the_next_windows_items():
    windows = [Window(total=8.0, divisor=2) for _ in range(2)]
    assert _read(windows, next_items=(3.0, 9.0))[Slot.NEXT] == 12.0


@pytest.mark.parametrize("count", [2**24 + 1, 2**31, 2**40 + 1])
def test_large_counts_stay_exact_in_the_float64_payload(count):
    windows = [Window() for _ in range(3)]
    for window in windows:
        window.add(Count(float(count)))
        window.add(read_count(device(count)))
    assert _finish(windows).items == 3 * 2 * count


def test_1001_is_exact_where_bfloat16_rounds_to_1000():
    assert torch.tensor(1001.0, dtype=torch.bfloat16).item() == 1000.0
    windows = [Window(), Window()]
    windows[0].add(read_count(device(1001)))
    windows[1].add(Count(1001.0))
    assert _finish(windows).items == 2002.0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2**40), min_size=1, max_size=4), min_size=1, max_size=6))
def test_integer_counts_on_the_host_and_the_device_sum_exactly(counts):
    windows = [Window() for _ in counts]
    for rank, (window, rank_counts) in enumerate(zip(windows, counts, strict=True)):
        for k, n in enumerate(rank_counts):
            window.add(read_count(device(n)) if (rank + k) % 2 else Count(float(n)))
    summed = _read(windows, more=[r % 2 == 0 for r in range(len(windows))])
    assert window_result(summed, step=0).items == sum(map(sum, counts))
    assert summed[Slot.MORE] == len([r for r in range(len(counts)) if r % 2 == 0])


def test_a_count_on_the_device_is_checked_weighted_and_summed_there_without_a_read():
    window = Window()
    factor = window.add(read_count(device(4.0, torch.float32), integer=True), loss=torch.tensor(1.5))
    assert isinstance(factor, Unreadable)  # the factor stays on the device too
    zero = window.add(read_count(device(0)), loss=torch.tensor(math.nan))  # masked: 0, and its NaN stays out
    bad = window.add(read_count(device(-2)), loss=torch.tensor(1.0))
    vector = payload([window], True, CPU).as_subclass(Tensor)
    assert float(factor.as_subclass(Tensor)) == 4.0 and float(zero.as_subclass(Tensor)) == 0.0
    assert float(bad.as_subclass(Tensor)) == 0.0
    assert vector[Slot.ITEMS] == 4.0 and vector[Slot.LOSS] == 6.0  # the bad and the masked add nothing
    assert vector[Slot.INVALID] == 1.0 and vector[Slot.NAN_EMPTY] == 1.0  # a NaN loss counted 0 on the device
    assert window.problem_row(CPU).as_subclass(Tensor).tolist() == [Problem.NEGATIVE, -2.0]  # gathered on error


@pytest.mark.parametrize("sums", [(False, False), (True, True), (True, False)])
def test_device_counts_weigh_a_mean_by_its_count_a_sum_by_one_and_a_check_adds_no_item(sums):
    window, given = Window(), list(zip([(3.0, 6.0), (2.0, 1.5)], sums, strict=True))
    for (n, loss), item_sum in given:
        window.add(read_count(device(n)), loss=torch.tensor(loss), item_sum=item_sum)
    window.check(read_count(device(5)), read_count(device(5)))  # a count taken again, agreeing: checked, not counted
    vector = payload([window], True, CPU).as_subclass(Tensor)
    expected = sum(loss if item_sum else n * loss for (n, loss), item_sum in given)  # a sum weighs 1, a mean n
    assert (vector[Slot.ITEMS], vector[Slot.LOSS], vector[Slot.INVALID]) == (5.0, expected, 0.0)


@pytest.mark.parametrize("microbatches", [1, 63, 64, 150])  # an evaluation epoch's device counts: weighed in blocks
def test_device_counts_held_for_a_whole_epoch_stay_few_and_sum_flag_and_name_their_first_problem_exactly(microbatches):
    rng = random.Random(microbatches)
    window, items, loss, nan_empty = Window(), 0.0, 0.0, 0.0
    for m in range(microbatches):
        n, item_sum = float(rng.choice([0, 1, 3, 17])), rng.random() < 0.3
        value = math.nan if n == 0 and m % 5 == 0 else rng.uniform(-4, 4)  # some NaN losses counted 0
        window.add(read_count(device(n)), loss=torch.tensor(value, dtype=torch.float64), item_sum=item_sum)
        items += n
        loss += 0.0 if n == 0 else value * (1.0 if item_sum else n)
        nan_empty = max(nan_empty, float(n == 0 and math.isnan(value)))
        assert len(window._on_device) < 64, m  # held until the window weighs them: never the whole epoch
    vector = payload([window], True, CPU).as_subclass(Tensor)
    assert (vector[Slot.ITEMS], vector[Slot.LOCAL], vector[Slot.INVALID]) == (items, items, 0.0)
    assert (float(vector[Slot.LOSS]), float(vector[Slot.NAN_EMPTY])) == (pytest.approx(loss, abs=1e-9), nan_empty)
    assert window.problem_row(CPU).as_subclass(Tensor).tolist() == [0.0, 0.0]
    for bad in (-3, math.nan):  # the first of two problems, a block apart
        window.add(read_count(device(bad, torch.float64)), loss=torch.tensor(0.5))
        for _ in range(70):
            window.add(read_count(device(1)), loss=torch.tensor(0.5))
    assert payload([window], True, CPU).as_subclass(Tensor)[Slot.INVALID] == 1.0
    assert window.problem_row(CPU).as_subclass(Tensor).tolist() == [Problem.NEGATIVE, -3.0]
    large = Window()
    for _ in range(100):  # 2**53 reached across blocks: the window's count, not one block's
        large.add(read_count(device(2**47)), loss=torch.tensor(1.0))
    assert payload([large], True, CPU).as_subclass(Tensor)[Slot.INVALID] == 1.0
    assert large.problem_row(CPU).as_subclass(Tensor).tolist() == [Problem.TOO_LARGE, 100 * 2**47]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (3, Count(3.0)),
        (2.5, Count(2.5)),
        (0, Count(0.0)),
        (-1, Count(-1.0, Problem.NEGATIVE)),
        (math.inf, Count(math.inf, Problem.NOT_FINITE)),
        (2.5, Count(2.5)),
    ],
)
def test_read_count_checks_numbers_on_the_host(value, expected):
    assert read_count(value) == expected


@pytest.mark.parametrize(
    ("value", "integer", "problem"),
    [
        (torch.tensor(7), False, 0),
        (torch.tensor(0.25, dtype=torch.float64), False, 0),
        (torch.tensor(-1), False, Problem.NEGATIVE),
        (torch.tensor(-math.inf), False, Problem.NOT_FINITE),
        (torch.tensor(math.nan), False, Problem.NOT_FINITE),
        (torch.tensor(math.inf), False, Problem.NOT_FINITE),
        (torch.tensor(-sys.float_info.max, dtype=torch.float64), False, Problem.NEGATIVE),  # the most negative float
        (torch.tensor(sys.float_info.max, dtype=torch.float64), False, 0),
        (torch.tensor(-0.0), False, 0),
        (torch.tensor(-1e-300, dtype=torch.float64), False, Problem.NEGATIVE),
        (torch.tensor(4.0, requires_grad=True), False, 0),  # read detached
        (torch.tensor(2.5), True, Problem.FRACTIONAL),
        (torch.tensor(3.0), True, 0),
        (torch.tensor([[4]]), False, 0),  # one element, any shape
    ],
)
def test_read_count_checks_tensors_where_they_live(value, integer, problem):
    count = read_count(value.as_subclass(Unreadable), integer=integer)
    assert isinstance(count.value, Unreadable) and isinstance(count.problem, Unreadable)
    assert float(count.problem.as_subclass(Tensor)) == problem and not count.value.requires_grad
    assert read_count(value, integer=integer, host=True).problem == (Problem(problem) if problem else None)


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("3", Problem.NOT_A_NUMBER),
        (None, Problem.NOT_A_NUMBER),
        (True, Problem.NOT_A_NUMBER),
        (torch.tensor([1, 2]), Problem.NOT_A_SCALAR),
        (torch.tensor(True), Problem.NOT_A_NUMBER),
        (2.5, None),
    ],
)
def test_read_count_rejects_what_is_not_a_scalar_number(value, problem):
    assert read_count(value).problem is problem


_ANY_COUNT = st.one_of(
    st.integers(-3, 2**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([True, None, "3", 2.5, -0.0, torch.tensor(4), torch.tensor(1.5), torch.tensor([1, 2])]),
)


def _kind(problem: Problem | Tensor | None) -> Problem | None:
    """A count's problem, read (a tensor's, checked on its device, too)."""
    return Problem(int(problem)) if isinstance(problem, Tensor) and problem else problem or None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_ANY_COUNT, st.booleans()), min_size=1, max_size=5), st.booleans())
def test_a_microbatchs_counts_read_together_are_each_count_read_alone(given_counts, host):
    values, integer = [v for v, _ in given_counts], [i for _, i in given_counts]
    counts = read_counts(values, integer, host=host)
    alone = [read_count(v, i, host=host) for v, i in given_counts]
    assert len(counts.values) == len(alone)
    for together, each in zip(counts.each(), alone, strict=True):
        assert _kind(together.problem) == _kind(each.problem)
        assert float(together.value) == float(each.value) or math.isnan(float(each.value))
    valid_on_host = all(c.problem is None and isinstance(c.value, float) for c in alone)
    assert (counts.problems is None) == valid_on_host  # None: every count a valid number on the host
    host_valid = [c.value if c.problem is None and isinstance(c.value, float) else 0.0 for c in alone]
    assert host_items([counts, counts], len(alone)) == [2 * v for v in host_valid]  # a device count adds 0 here


def test_counts_read_together_are_each_checked_and_valid_numbers_on_the_host_carry_no_problems():
    assert read_counts([3, 2.0, 0], [True, True, False]) == Counts((3.0, 2.0, 0.0))
    assert read_counts([3, 2.5], [False, True]).each() == [Count(3.0), Count(2.5, Problem.FRACTIONAL)]
    assert read_counts([True, 1], [True, True]).each() == [Count(math.nan, Problem.NOT_A_NUMBER), Count(1.0)]
    assert read_counts([torch.tensor(5), 1], [True, True], host=True) == Counts((5.0, 1.0))  # read before it moves
    on_device = read_counts([torch.tensor(5).as_subclass(Unreadable), 1], [True, True])  # never read on the host
    assert isinstance(on_device.values[0], Unreadable) and on_device.problems is not None
    assert host_items([], 3) == [0.0, 0.0, 0.0] and host_items([on_device]) == [0.0, 1.0]


def test_read_count_requires_whole_numbers_for_examples_and_tokens():
    assert read_count(2.5, integer=True) == Count(2.5, Problem.FRACTIONAL)
    assert read_count(torch.tensor(3.0), integer=True, host=True) == Count(3.0)


@pytest.mark.parametrize(
    ("problem", "value", "error", "match"),
    [
        (Problem.NEGATIVE, -3.0, ValueError, r"on rank 1, a microbatch's count is negative \(-3\)\. Return"),
        (Problem.NOT_FINITE, math.nan, ValueError, r"on rank 1, a microbatch's count is not finite \(nan\)"),
        (Problem.NOT_A_NUMBER, math.nan, TypeError, r"on rank 1, a microbatch's count is not a number"),
        (Problem.NO_LOSS, math.nan, RuntimeError, r"on rank 1, training_step returned None instead of a loss"),
        (Problem.NO_GRAPH, math.nan, RuntimeError, r"training_step returned a loss that is not attached to the"),
        (Problem.FRACTIONAL, 2.5, ValueError, r"on rank 1, a microbatch's count of examples or tokens is fract"),
        (Problem.TOO_LARGE, 1e20, ValueError, r"on rank 1, the window's count reaches 2\*\*53 \(1e\+20\)"),
        (Problem.REDUCTION, math.nan, ValueError, r"on rank 1, training_step returned a 'reduction' that is"),
        (Problem.MISSING, math.nan, TypeError, r"on rank 1, training_step returned no count"),
        (Problem.DISAGREES, 99.0, ValueError, r"on rank 1, training_step returned a count \(99\) that differs"),
        (Problem.AUX, math.nan, TypeError, r"on rank 1, training_step returned an 'aux' that is not a dict of"),
        (
            Problem.CHANGED,
            99.0,
            ValueError,
            r"on rank 1, the batch training_step received holds 99 items where ItemCounter counted another number in"
            r" the batch the loader yielded: a transfer hook changed it on its way to the step\.",
        ),
        (Problem.AMBIGUOUS, math.nan, ValueError, r"on rank 1, training_step returned no count for a batch that comb"),
        (Problem.PARTS, math.nan, ValueError, r"on rank 1, training_step returned loss parts whose names differ"),
        (Problem.PARTS_AFTER, math.nan, ValueError, r"on rank 1, training_step returned loss parts \('parts'\), each"),
    ],
)
def test_one_bad_rank_gives_the_same_error_naming_rank_value_and_fix_everywhere(problem, value, error, match):
    good, bad = Window(), Window()
    good.add(Count(4.0))
    bad.reject(problem, value)
    for own in (0, 1):  # every rank raises the same error from the same sum and the same gathered rows
        with pytest.raises(error, match=match):
            _finish([good, bad], own=own)
    assert _summed([good, bad])[Slot.ITEMS] == 4.0  # the bad count never enters N


def test_a_message_that_says_what_to_do_itself_does_not_end_with_the_count_fix():
    for problem in (Problem.PARTS, Problem.PARTS_AFTER, Problem.CHANGED, Problem.AUX_AFTER, Problem.AMBIGUOUS):
        message = str(problem_error([[float(problem), math.nan]]))
        assert TRAINER.fix not in message and message.endswith("."), message
    assert str(problem_error([[float(Problem.MISSING), math.nan]])).endswith(f"no count. {TRAINER.fix}.")


@pytest.mark.parametrize(
    ("value", "quoted"),
    [(-29, r"\(-29\)\."), (-29.0, r"\(-29\)\."), (-2.5, r"\(-2\.5\)\."), (-(2.0**60), r"\(-1\.15292\d+e\+18\)\.")],
)
def test_a_count_is_quoted_as_given_a_whole_number_without_a_decimal_point(value, quoted):
    window = Window()
    window.reject(Problem.NEGATIVE, value)
    with pytest.raises(ValueError, match=r"on rank 0, a microbatch's count is negative " + quoted):
        _finish([window])  # the problem's row carries it as a float64


def test_an_invalid_count_becomes_the_windows_problem_and_adds_nothing():
    window = Window()
    assert window.add(Count(-2.0, Problem.NEGATIVE)) == 0.0
    assert (window.items, window.problem) == (0.0, (Problem.NEGATIVE, -2.0))


def test_several_bad_ranks_are_counted_and_their_one_problem_named():
    windows = [Window(), Window(), Window()]
    windows[0].reject(Problem.NEGATIVE, -1.0)
    windows[2].add(read_count(device(-2)))  # found on the device
    with pytest.raises(ValueError, match=r"on 2 ranks, a microbatch's count is negative\. Return"):
        _finish(windows, own=1)


def test_only_the_first_problem_of_a_window_is_reported():
    window = Window()
    window.reject(Problem.NEGATIVE, -2.0)
    window.reject(Problem.NOT_A_NUMBER)
    window.add(read_count(device(-5)))
    assert window.problem_row(CPU).tolist() == [Problem.NEGATIVE, -2.0]
    on_device = Window()
    on_device.add(read_count(device(-5)))
    on_device.add(read_count(device(math.nan, torch.float32)))
    assert payload([on_device], True, CPU).as_subclass(Tensor)[Slot.INVALID] == 1.0
    assert on_device.problem_row(CPU).as_subclass(Tensor).tolist() == [Problem.NEGATIVE, -5.0]


def test_a_window_count_reaching_2_to_the_53_is_rejected_rather_than_rounded():
    window = Window()
    assert window.add(Count(MAX_ITEMS - 1)) == MAX_ITEMS - 1
    assert window.add(Count(1.0)) == 0.0
    assert window.problem == (Problem.TOO_LARGE, MAX_ITEMS)
    assert window.items == MAX_ITEMS - 1
    on_device = Window()
    on_device.add(read_count(device(2**52)))
    on_device.add(read_count(device(2**52)))
    assert payload([on_device], True, CPU).as_subclass(Tensor)[Slot.INVALID] == 1.0
    assert on_device.problem_row(CPU).as_subclass(Tensor).tolist() == [Problem.TOO_LARGE, MAX_ITEMS]


def test_the_payload_has_one_named_slot_per_field_and_sums_all_but_the_local_one():
    assert [slot.name for slot in Slot] == ["MORE", "NAN_EMPTY", "INVALID", "ITEMS", "NEXT", "LOSS", "LOCAL"]
    assert SUMMED == Slot.LOCAL == len(Slot) - 1
    # with K parts: the three shared fields once, then K values of each other field, LOCAL last and not summed
    assert [at(slot, 4) for slot in Slot] == [slice(0, 1), slice(1, 2), slice(2, 3)] + [
        slice(3 + 4 * f, 7 + 4 * f) for f in range(4)
    ]


def test_one_problem_on_several_ranks_is_named_and_different_ones_are_counted():
    same = [Window(), Window()]
    for window in same:
        window.reject(Problem.AUX_AFTER)
    with pytest.raises(ValueError, match=r"on 2 ranks, training_step returned auxiliary terms \('aux'\)"):
        _finish(same, own=0)
    mixed = [Window(), Window(), Window()]
    mixed[0].reject(Problem.NEGATIVE, -1.0)  # 1
    mixed[1].reject(Problem.FRACTIONAL, 2.5)  # 7
    mixed[2].reject(Problem.NOT_FINITE, math.inf)  # 2, and 1 + 7 = 2 · 4: the squares tell them apart
    with pytest.raises(ValueError, match="on 3 ranks, a microbatch's count or loss is invalid"):
        _finish(mixed, own=0)


def _checked(given: Count, planned: Count, problem: Problem = Problem.DISAGREES) -> tuple[Problem, float] | None:
    """The host problem a window holds once ``given`` was checked against ``planned``."""
    window = Window(total=4.0)
    window.check(given, planned, problem)
    return window.problem


def test_a_count_checked_against_the_planned_one_is_the_windows_problem_only_where_they_differ():
    planned = Count(4.0)
    assert _checked(read_count(4), planned) is None
    assert _checked(read_count(5), planned) == (Problem.DISAGREES, 5.0)
    assert _checked(read_count(5), planned, Problem.CHANGED) == (Problem.CHANGED, 5.0)
    assert _checked(read_count(-1), planned, Problem.CHANGED) == (Problem.NEGATIVE, -1.0)  # its own problem first
    assert _checked(read_count("4"), planned) == (Problem.NOT_A_NUMBER, pytest.approx(math.nan, nan_ok=True))
    assert _checked(read_count(5), Count(-1.0, Problem.NEGATIVE)) is None  # the plan's own problem: the add's
    window = Window(total=8.0, divisor=2)
    window.check(read_count(4), planned)
    assert _factor(window, planned) == 1.0 and window.problem_row(CPU).tolist() == [0.0, 0.0]  # D n / N of the plan


def test_a_count_on_the_device_is_checked_there_and_a_changed_batch_becomes_the_windows_error():
    planned = Count(4.0)  # counted ahead on the host, as the loader yielded the batch
    window = Window(total=8.0, divisor=2)
    window.check(read_count(device(4)), planned, Problem.CHANGED)  # counted again as the step received it
    assert payload([window], True, CPU).as_subclass(Tensor)[Slot.INVALID] == 0.0  # agreeing: healthy
    assert _factor(window, planned, loss=torch.tensor(1.0)) == 1.0  # the planned count keeps its factor
    window.check(read_count(device(5)), planned, Problem.CHANGED)  # a transfer hook changed this one
    assert _factor(window, planned, loss=torch.tensor(1.0)) == 1.0
    assert window.problem is None  # compared on the device: nothing is known on the host
    vector = payload([window], True, CPU).as_subclass(Tensor)
    assert vector[Slot.ITEMS] == 8.0 and vector[Slot.INVALID] == 1.0
    assert window.problem_row(CPU).as_subclass(Tensor).tolist() == [Problem.CHANGED, 5.0]
    wording = Wording(TRAINER.source, TRAINER.fix, "`on_after_batch_transfer`")
    match = (
        r"on rank 0, the batch training_step received holds 5 items where ItemCounter counted another number in the"
        r" batch the loader yielded: `on_after_batch_transfer` changed it on its way to the step\. Make the change"
    )
    with pytest.raises(ValueError, match=match):
        _finish([window], wording=wording)
    negative = Window(total=8.0, divisor=2)
    negative.check(read_count(device(-1)), planned, Problem.CHANGED)  # a bad count again: its own problem
    assert negative.problem_row(CPU).as_subclass(Tensor).tolist() == [Problem.NEGATIVE, -1.0]


def test_a_window_result_holds_its_step_items_local_items_loss_and_parts_only():
    import dataclasses

    assert [f.name for f in dataclasses.fields(WindowResult)] == ["step", "items", "local_items", "loss", "parts"]
    part = WindowResult(step=3, items=2.0, local_items=1.0, loss=0.5)
    combined = WindowResult(step=3, items=2.0, local_items=1.0, loss=0.5, parts={"text": part})
    assert part.parts == {} and combined.parts["text"] is part


def test_the_core_imports_no_integration_and_no_lightning_and_the_loaders_and_callbacks_no_front_end():
    # count ← payload ← parts ← window ← loop ← engines: the core; loaders ← trainer, fabric: the loop is the same
    # object for both front ends
    import ast
    from pathlib import Path

    import lightning_weighted

    root = Path(lightning_weighted.__file__).parent

    def imports(name: str) -> set[str]:
        tree = ast.parse((root / name).read_text())
        found = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        return found | {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}

    layers = ["count.py", "payload.py", "parts.py", "window.py", "loop.py"]  # each imports only those before it
    engines = [f"engines/{p.name}" for p in sorted((root / "engines").glob("*.py"))]
    core = [*layers, *engines]
    integrations = ("loaders", "trainer", "fabric", "counter", "monitor", "audit", "strategy")
    for name in core:
        found = imports(name)
        assert not {m for m in found if m.startswith(tuple(f"lightning_weighted.{i}" for i in integrations))}, name
        assert not {m for m in found if m == "lightning" or m.startswith("lightning.")}, name
    for k, name in enumerate(layers):
        later = {f"lightning_weighted.{layer.removesuffix('.py')}" for layer in layers[k:]}
        assert not imports(name) & later, name
    for name in core:  # one job a file, short enough to read in one sitting
        assert len((root / name).read_text().splitlines()) < 400, name
    loaders = [f"loaders/{p.name}" for p in sorted((root / "loaders").glob("*.py"))]
    assert {"loaders/epoch.py", "loaders/sampler.py", "loaders/extension.py"} <= set(loaders)
    front_ends = ("lightning_weighted.trainer", "lightning_weighted.fabric")
    for name in loaders:
        assert not {m for m in imports(name) if m.startswith(front_ends)}, name
    for name in ("counter.py", "monitor.py"):  # callbacks outside a front end's room read a strategy as `strategy`
        assert not {m for m in imports(name) if m.startswith(front_ends)}, name
