"""Empty microbatches, empty windows, precision, clipping, the collectives per step and refusals (2 gloo ranks)."""

from __future__ import annotations

import dataclasses
import re

import pytest
from harness import fit
from scenario import Config, identical, is_finite, max_relative_error, reference


@pytest.mark.parametrize("find_unused", [False, True])
@pytest.mark.parametrize(
    ("python_count", "safe_mean"),
    [
        (True, False),  # a count on the host: the microbatch is cut out of the graph, its NaN mean (0/0) too
        (False, True),  # a count on the device: its loss times 0, exact where the mean's gradient is finite
    ],
)
def test_fully_masked_microbatches_contribute_exactly_zero_under_ddp_with_or_without_unused_parameters(
    tmp_path, find_unused, python_count, safe_mean
):
    # rank 0's microbatch 1 and rank 1's microbatch 4 have every token masked
    config = Config(
        strategy="ddp_weighted",
        accumulate=2,
        masked=[(0, 1), (1, 4)],
        find_unused=find_unused,
        unused_layer=find_unused,
        python_count=python_count,
        safe_mean=safe_mean,
    )
    result = fit(config, tmp_path)
    assert is_finite(result[0]["params"])
    assert max_relative_error(result[0]["params"], reference(config)["params"]) < 1e-5


def test_a_nan_mean_counted_0_on_the_device_is_the_same_clear_error_on_every_rank_before_the_step(tmp_path):
    # the count stays on the device (no host read), so the NaN mean's backward reaches the gradients: refused
    config = Config(strategy="ddp_weighted", accumulate=2, masked=[(1, 2)])
    done = fit(config, tmp_path, timeout=90, expect_failure=True)
    message = "RuntimeError: On 1 rank(s), a microbatch whose count is 0 has a non-finite loss"
    assert done.stdout.count(message) == 2, done.stdout[-4000:]
    assert "divide by `n.clamp(min=1)`" in done.stdout


def test_a_window_without_items_leaves_ddps_params_optimizer_and_scheduler_bit_identical(tmp_path):
    # windows 0, 1, 2 of A = 2; window 1 has no valid item on any rank
    config = Config(strategy="ddp_weighted", accumulate=2, empty_windows=[1], optimizer="adam", scheduler=True, lr=0.05)
    result = fit(config, tmp_path)
    for rank in result:
        before, empty, after = rank["steps"]
        assert [step["stepped"] for step in rank["steps"]] == [True, False, True]  # no optimizer step
        assert identical(empty["params"], before["params"])
        assert identical(empty["state"], before["state"])  # Adam moments and step counts
        assert empty["lr"] == before["lr"] == 0.05 * 0.5 and after["lr"] == 0.05 * 0.25
        assert not identical(after["params"], empty["params"])
        assert rank["skipped_steps"] == 1
        assert rank["global_step"] == 3
    assert max_relative_error(result[0]["params"], reference(config)["params"]) < 1e-5


@pytest.mark.parametrize("precision", ["32-true", "bf16-true", "64-true"])
def test_the_one_collective_of_ours_per_optimizer_step_is_a_float64_payload_and_no_comm_hook(tmp_path, precision):
    config = Config(strategy="ddp_weighted", accumulate=3, batches=7, count_collectives=True, precision=precision)
    result = fit(config, tmp_path)
    for rank in result:
        assert rank["comm_hook"] is None  # DDP's own reducer averages every bucket, in C++ (unseen here)
        steps = len(rank["steps"])
        assert steps == 3  # windows of 3, 3 and 1 microbatches
        # Lightning itself broadcasts its SIGTERM flag once per batch, with any strategy
        lightning = [c for c in rank["collectives"] if c == ("broadcast", "torch.int64", 1)]
        assert len(lightning) == 7
        # the window's payload: 6 float64 values (items, next items, more, loss, uncut, invalid); which problem a
        # rank found travels only where some rank found one
        assert [c for c in rank["collectives"] if c not in lightning] == [("all_reduce", "torch.float64", 6)] * steps
    rtol = 5e-2 if precision == "bf16-true" else 1e-10 if precision == "64-true" else 1e-5
    assert max_relative_error(result[0]["params"], reference(config)["params"]) < rtol


@pytest.mark.parametrize(
    ("precision", "mode", "rtol"),
    [
        ("32-true", "tokens", 1e-5),
        ("64-true", "tokens", 1e-10),
        ("64-true", "weights", 1e-10),  # an N that is not an integer
        ("bf16-mixed", "tokens", 3e-2),
        ("16-true", "tokens", 3e-3),  # an fp16 backward: losses kept the size of a mean, c = the last mean count
    ],
)
def test_every_one_of_several_buckets_is_multiplied_by_p_c_over_n_after_the_reduction(tmp_path, precision, mode, rtol):
    # one bucket per parameter once DDP has rebuilt them (from the second window)
    config = Config(strategy="ddp_weighted", accumulate=2, precision=precision, mode=mode, bucket_cap_mb=1e-6)
    result = fit(config, tmp_path)
    expected = reference(config)
    assert max_relative_error(result[0]["params"], expected["params"]) < rtol
    assert [s["norm"] for s in result[0]["steps"]] == pytest.approx(expected["norms"], rel=max(rtol, 1e-6))


@pytest.mark.parametrize(
    ("precision", "rtol"),
    [("64-true", 1e-10), ("32-true", 1e-5), ("bf16-mixed", 3e-2), ("16-mixed", 3e-2), ("bf16-true", 5e-2)],
)
def test_every_trainer_precision_under_ddp_gives_the_reference_within_its_precision(tmp_path, precision, rtol):
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
        (-3, "ValueError", "on rank 1, a microbatch's count is negative (-3)", "32-true"),
        (float("nan"), "ValueError", "on rank 1, a microbatch's count is not finite (nan)", "32-true"),
        ("many", "TypeError", "on rank 1, a microbatch's count is not a number", "32-true"),
        (1e20, "ValueError", "on rank 1, the window's count reaches 2**53 (1e+20)", "32-true"),
        (-3, "ValueError", "on rank 1, a microbatch's count is negative (-3)", "bf16-true"),
    ],
)
def test_a_bad_returned_count_on_one_ddp_rank_raises_the_same_error_on_every_rank_before_the_step(
    tmp_path, value, error, message, precision
):
    config = Config(strategy="ddp_weighted", accumulate=2, bad_count=[1, 3, value], precision=precision)
    done = fit(config, tmp_path, timeout=90, expect_failure=True)
    assert done.stdout.count(f"{error}: {message}") == 2, done.stdout[-4000:]  # raised on both ranks
