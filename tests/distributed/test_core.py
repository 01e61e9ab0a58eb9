"""Empty microbatches, empty windows, precision, clipping, the hook's wiring and refusals (2 gloo ranks)."""

from __future__ import annotations

import dataclasses
import re

import pytest
from harness import fit
from scenario import Config, identical, is_finite, max_relative_error, reference


@pytest.mark.parametrize("find_unused", [False, True])
def test_fully_masked_microbatches_with_nan_means_contribute_exactly_zero(tmp_path, find_unused):
    # rank 0's microbatch 1 and rank 1's microbatch 4 have every token masked: their means are 0/0 = NaN
    config = Config(
        strategy="ddp_weighted",
        accumulate=2,
        masked=[(0, 1), (1, 4)],
        find_unused=find_unused,
        unused_layer=find_unused,
    )
    result = fit(config, tmp_path)
    assert is_finite(result[0]["params"])
    assert max_relative_error(result[0]["params"], reference(config)["params"]) < 1e-5


def test_a_window_without_items_leaves_params_optimizer_and_scheduler_bit_identical(tmp_path):
    # windows 0, 1, 2 of A = 2; window 1 has no valid item on any rank
    config = Config(strategy="ddp_weighted", accumulate=2, empty_windows=[1], optimizer="adam", scheduler=True, lr=0.05)
    result = fit(config, tmp_path)
    for rank in result:
        before, empty, after = rank["steps"]
        assert identical(empty["params"], before["params"])
        assert identical(empty["state"], before["state"])  # Adam moments and step counts
        assert empty["lr"] == before["lr"] == 0.05 * 0.5 and after["lr"] == 0.05 * 0.25
        assert not identical(after["params"], empty["params"])
        assert rank["skipped_steps"] == 1
        assert rank["global_step"] == 3
    assert max_relative_error(result[0]["params"], reference(config)["params"]) < 1e-5


@pytest.mark.parametrize(
    ("precision", "reducer_divides", "hook", "ours"),
    [
        # fp32 gradients: the counts ride at the end of the one bucket (21 gradients + 12 count values)
        ("32-true", None, "weighted_allreduce_hook", [("all_reduce", "torch.float32", 21 + 12)]),
        # reducer_divides: a 6 × 8-byte float64 count vector before the syncing backward, whose N DDP's own reducer
        # divides the one bucket by (no communication hook; its bucket all-reduce runs in C++, unseen here)
        ("32-true", True, None, [("all_reduce", "torch.float64", 6)]),
        # bf16 gradients: the float64 count vector before the syncing backward, then the bucket (the hook regardless)
        (
            "bf16-true",
            True,
            "weighted_allreduce_hook",
            [("all_reduce", "torch.float64", 6), ("all_reduce", "torch.bfloat16", 21)],
        ),
    ],
)
def test_the_reduction_on_cpu_and_its_collectives_per_optimizer_step_are(
    tmp_path, precision, reducer_divides, hook, ours
):
    config = Config(
        strategy="ddp_weighted",
        accumulate=3,
        batches=7,
        count_collectives=True,
        precision=precision,
        reducer_divides=reducer_divides,
    )
    result = fit(config, tmp_path)
    for rank in result:
        assert rank["comm_hook"] == hook
        steps = len(rank["steps"])
        assert steps == 3  # windows of 3, 3 and 1 microbatches
        # Lightning itself broadcasts its SIGTERM flag once per batch, with any strategy
        lightning = [c for c in rank["collectives"] if c == ("broadcast", "torch.int64", 1)]
        assert len(lightning) == 7
        assert [c for c in rank["collectives"] if c not in lightning] == ours * steps
    rtol = 5e-2 if precision == "bf16-true" else 1e-5
    assert max_relative_error(result[0]["params"], reference(config)["params"]) < rtol


@pytest.mark.parametrize(("precision", "rtol"), [("32-true", 1e-5), ("64-true", 1e-10)])
@pytest.mark.parametrize("mode", ["tokens", "weights"])
def test_ddps_reducer_divides_every_one_of_several_buckets_by_n(tmp_path, precision, rtol, mode):
    # one bucket per parameter once DDP has rebuilt them, each divided as it is copied into its bucket; sample
    # weights sum to an N that is not an integer, which the reducer cannot divide by: it divides by 1 and the
    # strategy by N after the backward
    config = Config(
        strategy="ddp_weighted",
        accumulate=2,
        precision=precision,
        mode=mode,
        bucket_cap_mb=1e-6,
        count_collectives=True,
        reducer_divides=True,
    )
    result = fit(config, tmp_path)
    expected = reference(config)
    assert result[0]["comm_hook"] is None
    assert max_relative_error(result[0]["params"], expected["params"]) < rtol
    assert [s["norm"] for s in result[0]["steps"]] == pytest.approx(expected["norms"], rel=max(rtol, 1e-6))
    # the buckets' all-reduces run in DDP's C++ reducer, unseen here: the count vector is the only collective
    ours = [c for c in result[0]["collectives"] if c[0] == "all_reduce"]
    assert ours == [("all_reduce", "torch.float64", 6)] * len(result[0]["steps"])


@pytest.mark.parametrize(
    ("precision", "fp16_backward", "rtol"),
    [("32-true", False, 1e-5), ("64-true", False, 1e-10), ("bf16-mixed", False, 3e-2), ("32-true", True, 1e-5)],
)
def test_counts_riding_in_the_first_of_several_buckets_reach_every_bucket(tmp_path, precision, fp16_backward, rtol):
    # one bucket per parameter once DDP has rebuilt them (from the second window): the later buckets are summed
    # at once and divided when the first is back (fp16 backward: mean-sized losses, multiplied back before the SUM)
    config = Config(
        strategy="ddp_weighted",
        accumulate=2,
        precision=precision,
        bucket_cap_mb=1e-6,
        count_collectives=True,
        fp16_backward=fp16_backward,
    )
    result = fit(config, tmp_path)
    expected = reference(config)
    assert max_relative_error(result[0]["params"], expected["params"]) < rtol
    assert [s["norm"] for s in result[0]["steps"]] == pytest.approx(expected["norms"], rel=max(rtol, 1e-6))
    dtype = "torch.float64" if precision == "64-true" else "torch.float32"
    ours = [c for c in result[0]["collectives"] if c[0] == "all_reduce"]
    assert {c[1] for c in ours} == {dtype}
    sizes = [c[2] for c in ours]
    assert sizes[0] == 21 + 12  # the first window: DDP's one initial bucket, counts riding at its end
    windows = [sizes[k : k + 4] for k in range(1, len(sizes), 4)]  # then 4 buckets (ready order) per window
    assert len(windows) == len(result[0]["steps"]) - 1
    for window in windows:
        assert sorted([window[0] - 12, *window[1:]]) == [1, 4, 4, 12]  # the counts ride in the first only


def test_a_first_bucket_beyond_the_ride_limit_sends_the_counts_just_before_it(tmp_path):
    config = Config(
        strategy="ddp_weighted", accumulate=2, bucket_cap_mb=1e-6, count_collectives=True, ride_limit_bytes=0
    )
    result = fit(config, tmp_path)
    assert max_relative_error(result[0]["params"], reference(config)["params"]) < 1e-5
    ours = [c for c in result[0]["collectives"] if c[0] == "all_reduce"]
    count = ("all_reduce", "torch.float64", 6)
    assert ours[:2] == [count, ("all_reduce", "torch.float32", 21)]  # DDP's one initial bucket
    windows = [ours[k : k + 5] for k in range(2, len(ours), 5)]
    assert len(windows) == len(result[0]["steps"]) - 1
    for window in windows:  # the counts, then 4 buckets (ready order) with nothing riding
        assert window[0] == count and sorted(c[2] for c in window[1:]) == [1, 4, 4, 12]


@pytest.mark.parametrize(
    ("precision", "rtol"),
    [("64-true", 1e-10), ("32-true", 1e-5), ("bf16-mixed", 3e-2), ("16-mixed", 3e-2), ("bf16-true", 5e-2)],
)
def test_every_precision_gives_the_reference_within_its_precision(tmp_path, precision, rtol):
    config = Config(strategy="ddp_weighted", accumulate=2, mode="weights", precision=precision, lr=0.05)
    result = fit(config, tmp_path)
    expected = reference(config)
    assert max_relative_error(result[0]["params"], expected["params"]) < rtol
    assert [s["norm"] for s in result[0]["steps"]] == pytest.approx(expected["norms"], rel=max(rtol, 1e-6))


def test_clipping_and_on_before_optimizer_step_see_the_normalized_gradient(tmp_path):
    config = Config(strategy="ddp_weighted", accumulate=2, clip=0.05, mode="examples")
    expected = reference(config)
    assert max(expected["norms"]) > 0.05  # clipping is active
    result = fit(config, tmp_path)
    assert [s["norm"] for s in result[0]["steps"]] == pytest.approx(expected["norms"], rel=1e-5)
    assert max_relative_error(result[0]["params"], expected["params"]) < 1e-5


def test_accumulation_scheduler_windows_and_short_last_windows_are_weighted(tmp_path):
    config = Config(strategy="ddp_weighted", schedule={0: 2, 1: 4}, batches=7, epochs=2, mode="weights")
    result = fit(config, tmp_path)
    assert len(result[0]["steps"]) == 4 + 2  # windows of 2,2,2,1 then 4,3
    assert max_relative_error(result[0]["params"], reference(config)["params"]) < 1e-5


@pytest.mark.parametrize("strategy", ["ddp_weighted", "ddp_weighted_fork"])
def test_lightnings_own_popen_and_fork_launchers_match_the_reference(tmp_path, strategy):
    config = Config(strategy=strategy, accumulate=2, mode="examples")
    result = fit(config, tmp_path, lightning=True)  # one process; Lightning starts the other rank
    assert max_relative_error(result[0]["params"], reference(config)["params"]) < 1e-5


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"static_graph": True, "accumulate": 2}, r"`static_graph=True` with gradient accumulation is not supported"),
        ({"manual": True}, r"uses manual optimization \(`automatic_optimization=False`\), which ddp_weighted"),
        ({"python_reducer": True}, r"`torch._dynamo.config.optimize_ddp='python_reducer'` reduces gradients outside"),
    ],
)
def test_unsupported_combinations_are_refused_at_setup_on_every_rank(tmp_path, change, message):
    # the popen launcher shares one output stream between the ranks, so both tracebacks are seen
    config = dataclasses.replace(Config(strategy="ddp_weighted"), **change)
    done = fit(config, tmp_path, timeout=90, expect_failure=True)
    assert len(re.findall(message, done.stdout)) == 2, done.stdout[-4000:]  # raised on both ranks


@pytest.mark.parametrize(
    ("value", "error", "message", "precision"),
    [
        # fp32 gradients: the invalid flag rides in the first bucket, then one float64 all-reduce brings the details
        (-3, "ValueError", "on rank 1, a microbatch's count is negative (-3.0)", "32-true"),
        (float("nan"), "ValueError", "on rank 1, a microbatch's count is not finite (nan)", "32-true"),
        ("many", "TypeError", "on rank 1, a microbatch's count is not a number", "32-true"),
        (1e20, "ValueError", "on rank 1, the window's count reaches 2**53 (1e+20)", "32-true"),
        # DDP's reducer dividing: the details travel in the float64 count vector whose N is its divisor
        (-3, "ValueError", "on rank 1, a microbatch's count is negative (-3.0)", "reducer"),
        (1e20, "ValueError", "on rank 1, the window's count reaches 2**53 (1e+20)", "reducer"),
        # bf16 gradients, or a first bucket beyond the ride limit: the details travel in the float64 count vector
        (-3, "ValueError", "on rank 1, a microbatch's count is negative (-3.0)", "bf16-true"),
        (-3, "ValueError", "on rank 1, a microbatch's count is negative (-3.0)", "ride limit 0"),
    ],
)
def test_a_bad_count_on_one_rank_raises_the_same_error_on_every_rank_before_the_step(
    tmp_path, value, error, message, precision
):
    limit = 0 if precision == "ride limit 0" else None
    reducer = precision == "reducer"
    config = Config(
        strategy="ddp_weighted",
        accumulate=2,
        bad_count=[1, 3, value],
        precision="32-true" if precision in ("ride limit 0", "reducer") else precision,
        ride_limit_bytes=limit,
        reducer_divides=True if reducer else None,
    )
    done = fit(config, tmp_path, timeout=90, expect_failure=True)
    assert done.stdout.count(f"{error}: {message}") == 2, done.stdout[-4000:]  # raised on both ranks
