"""FSDP2 and FSDP1: empty microbatches and windows, uneven ranks, bad counts, clipping, precision, collectives."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter

import pytest
from scenario import identical, is_finite, max_relative_error, reference
from sharded import ShardedConfig, fit_sharded

STRATEGIES = ["fsdp2_weighted", "fsdp_weighted"]
PLAIN = {"fsdp2_weighted": "fsdp2", "fsdp_weighted": "fsdp"}


@pytest.mark.parametrize(
    ("strategy", "every_microbatch"), [("fsdp2_weighted", False), ("fsdp_weighted", False), ("fsdp_weighted", True)]
)
@pytest.mark.parametrize("python_count", [True, False])
def test_fully_masked_microbatches_contribute_exactly_zero_whenever_fsdp_reduces(
    tmp_path, strategy, every_microbatch, python_count
):
    # rank 0's microbatch 1 and rank 1's microbatch 4 have every token masked. Counted on the host, their means are
    # 0/0 = NaN: FSDP2 zeroes them in its reduce-scatter, FSDP1 before they accumulate (once per window, or every
    # microbatch, here with activation checkpointing: the backward recomputes the forward). Counted on the device,
    # the loss is multiplied by 0, and the mean is finite (0/1) where nothing is counted.
    config = ShardedConfig(
        strategy=strategy,
        accumulate=2,
        masked=[(0, 1), (1, 4)],
        sync_every_microbatch=every_microbatch,
        checkpointing=every_microbatch,
        python_count=python_count,
        safe_mean=not python_count,
    )
    result = fit_sharded(config, tmp_path)
    assert is_finite(result[0]["params"])
    assert max_relative_error(result[0]["params"], reference(config)["params"]) < 1e-5


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_nan_mean_counted_0_on_the_device_is_the_same_clear_error_on_every_rank(tmp_path, strategy):
    config = ShardedConfig(strategy=strategy, accumulate=2, masked=[(1, 2)])
    done = fit_sharded(config, tmp_path, timeout=90, expect_failure=True)
    message = "RuntimeError: On 1 rank(s), a microbatch whose count is 0 has a non-finite loss"
    assert done.stdout.count(message) == 2, done.stdout[-4000:]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_window_without_items_leaves_every_shard_of_params_optimizer_and_scheduler_bit_identical(tmp_path, strategy):
    # windows 0, 1, 2 of A = 2; window 1 has no valid item on any rank
    config = ShardedConfig(
        strategy=strategy, accumulate=2, empty_windows=[1], optimizer="adam", scheduler=True, lr=0.05
    )
    result = fit_sharded(config, tmp_path)
    for rank in result:
        before, empty, after = rank["steps"]
        assert [step["stepped"] for step in rank["steps"]] == [True, False, True]  # no optimizer step
        assert identical(empty["params"], before["params"])
        assert identical(empty["state"], before["state"])  # this rank's shards of the Adam moments and step counts
        assert empty["lr"] == before["lr"] == 0.05 * 0.5 and after["lr"] == 0.05 * 0.25
        assert not identical(after["params"], empty["params"])
        assert rank["skipped_steps"] == 1
    assert max_relative_error(result[0]["params"], reference(config)["params"]) < 1e-5


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(("lengths", "iterable"), [((5, 3), True), ((4, 0), False)])
def test_uneven_batch_counts_under_fsdp_train_the_global_item_mean_with_every_rank_in_step(
    tmp_path, strategy, lengths, iterable
):
    # the unsized run counts with ItemCounter (the mask) and returns a bare mean
    config = ShardedConfig(
        strategy=strategy,
        lengths=lengths,
        iterable=iterable,
        accumulate=2,
        epochs=2,
        counter="mask" if iterable else None,
        bare_loss=iterable,
    )
    result = fit_sharded(config, tmp_path)
    assert max_relative_error(result[0]["params"], reference(config)["params"]) < 1e-5
    steps = -(-max(lengths) // 2)
    ran = steps * 2 if iterable else max(lengths)
    for rank, held in zip(result, lengths, strict=True):
        assert rank["counts_ahead"] is iterable  # ItemCounter and one loader: each window counted before it starts
        assert rank["global_step"] == 2 * steps  # the same step on every rank
        assert rank["padding"] == ([False] * held + [True] * (ran - held)) * 2  # replays of an exhausted rank


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_counted_ahead_masked_microbatches_exhausted_ranks_and_empty_windows_contribute_nothing(tmp_path, strategy):
    # ItemCounter counts ahead; rank 1 runs out after 3 batches and replays, rank 0's microbatch 1 is fully masked
    # (a NaN mean), and window 1 holds no item on any rank
    config = ShardedConfig(
        strategy=strategy,
        accumulate=2,
        lengths=(6, 3),
        masked=[(0, 1)],
        empty_windows=[1],
        epochs=2,
        optimizer="adam",
        lr=0.05,
        counter="quiet",
        bare_loss=True,
    )
    result = fit_sharded(config, tmp_path)
    assert max_relative_error(result[0]["params"], reference(config)["params"]) < 1e-5
    for rank, held in zip(result, config.lengths, strict=True):
        assert rank["counts_ahead"] is True
        assert rank["padding"] == ([False] * held + [True] * (6 - held)) * 2
        assert rank["skipped_steps"] == 2  # the empty window, in each epoch
        assert identical(rank["steps"][1]["params"], rank["steps"][0]["params"])


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(
    ("change", "error"),
    [
        # ItemCounter's count of rank 1's batch 3 is negative: known on the host before the window starts
        ({"counter": "bad"}, "ValueError: on rank 1, a microbatch's count is negative (-1)"),
        # found after the window's counts were summed ahead: the payload names the rank and the value
        (
            {"counter": "quiet", "bad_count": [1, 3, 99]},
            "ValueError: on rank 1, training_step returned a count (99) that differs from the one ItemCounter",
        ),
    ],
)
def test_a_bad_count_taken_ahead_raises_the_same_error_on_every_rank(tmp_path, strategy, change, error):
    config = dataclasses.replace(ShardedConfig(strategy=strategy, accumulate=2), **change)
    done = fit_sharded(config, tmp_path, timeout=90, expect_failure=True)
    assert done.stdout.count(error) == 2, done.stdout[-4000:]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_data_set_not_divisible_by_ranks_batch_and_window_counts_each_item_once(tmp_path, strategy):
    # 37 items, batch 4, 2 ranks, A = 3: Lightning's padding sampler (swapped here) would train one item twice
    config = ShardedConfig(strategy=strategy, items=37, batch_size=4, accumulate=3, epochs=2, mode="weights")
    result = fit_sharded(config, tmp_path)
    assert max_relative_error(result[0]["params"], reference(config)["params"]) < 1e-5
    assert result[0]["global_step"] == result[1]["global_step"] == 2 * 2  # 5 batches: windows of 3 and 2


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strict_participation_under_fsdp_names_each_ranks_batch_count(tmp_path, strategy):
    config = ShardedConfig(strategy=strategy, lengths=(5, 3), participation="strict")
    done = fit_sharded(config, tmp_path, timeout=90, expect_failure=True)
    message = "participation='strict' needs every rank to hold the same number of batches, but they differ in"
    assert done.stdout.count(message) == 2, done.stdout[-3000:]
    assert "(rank 0: 5, rank 1: 3)" in done.stdout


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (-3, "ValueError", "on rank 1, a microbatch's count is negative (-3)"),
        (float("inf"), "ValueError", "on rank 1, a microbatch's count is not finite (inf)"),
        ("many", "TypeError", "on rank 1, a microbatch's count is not a number"),
    ],
)
def test_a_bad_returned_count_on_one_sharded_rank_raises_the_same_error_on_every_rank_before_the_step(
    tmp_path, strategy, value, error, message
):
    config = ShardedConfig(strategy=strategy, accumulate=2, bad_count=[1, 3, value])
    done = fit_sharded(config, tmp_path, timeout=90, expect_failure=True)
    assert done.stdout.count(f"{error}: {message}") == 2, done.stdout[-4000:]  # raised on both ranks


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("kind", ["raise", "kill"])
def test_a_rank_failing_mid_window_ends_every_rank_well_within_the_timeout(tmp_path, strategy, kind):
    # rank 1 fails in the middle microbatch of the second window; rank 0 waits in a collective until it is gone
    config = ShardedConfig(strategy=strategy, accumulate=3, fault=[kind, 1, 4], pg_timeout=10)
    started = time.monotonic()
    done = fit_sharded(config, tmp_path, timeout=60, expect_failure=True)
    assert time.monotonic() - started < 10 + 10  # the fault catalogue's T: timeout + 10 s
    assert kind == "kill" or "injected raise on rank 1" in done.stdout


@pytest.mark.parametrize("kind", ["none", "nograd"])
def test_a_step_without_a_loss_graph_ends_every_rank_with_the_reason(tmp_path, kind):
    # the rank has no graph to run the sharded backward with, whose collectives its peer waits in
    config = ShardedConfig(strategy="fsdp2_weighted", accumulate=2, fault=[kind, 1, 2], pg_timeout=10)
    done = fit_sharded(config, tmp_path, timeout=60, expect_failure=True)
    what = "None" if kind == "none" else "a loss that is not attached to the graph"
    assert f"RuntimeError: On rank 1, training_step returned {what}. Under fsdp2_weighted" in done.stdout


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(("algorithm", "clip"), [("norm", 0.05), ("value", 0.02)])
def test_clipping_sees_the_normalized_gradient(tmp_path, strategy, algorithm, clip):
    config = ShardedConfig(strategy=strategy, accumulate=2, clip=clip, clip_algorithm=algorithm, mode="examples")
    expected = reference(config)
    assert max(expected["norms"]) > 0.05  # clipping is active
    result = fit_sharded(config, tmp_path)
    assert [s["norm"] for s in result[0]["steps"]] == pytest.approx(expected["norms"], rel=1e-5)
    assert max_relative_error(result[0]["params"], expected["params"]) < 1e-5
    unclipped = reference(dataclasses.replace(config, clip=None))
    assert max_relative_error(unclipped["params"], expected["params"]) > 1e-3  # the clip changes the result


def test_norm_clipping_under_fsdp1_is_fsdps_own_where_lightnings_fsdp_refuses_it(tmp_path):
    # the control: Lightning's FSDPStrategy (on the CPU, otherwise unchanged) refuses `gradient_clip_algorithm="norm"`
    config = ShardedConfig(strategy="fsdp", accumulate=2, clip=0.05, clip_algorithm="norm", mode="examples")
    done = fit_sharded(config, tmp_path, expect_failure=True)
    assert "`gradient_clip_algorithm='norm'` is currently not supported for `FSDPPrecision`" in done.stdout


@pytest.mark.parametrize(("strategy", "scatters"), [("fsdp2_weighted", 7), ("fsdp_weighted", 3)])
def test_one_tiny_collective_per_optimizer_step_is_all_it_adds(tmp_path, strategy, scatters):
    config = ShardedConfig(strategy=strategy, accumulate=3, batches=7, count_collectives=True)
    weighted = fit_sharded(config, tmp_path)[0]
    plain = fit_sharded(dataclasses.replace(config, strategy=PLAIN[strategy]), tmp_path)[0]
    assert len(weighted["steps"]) == 3  # windows of 3, 3 and 1 microbatches
    ours = Counter(weighted["collectives"]) - Counter(plain["collectives"])
    assert ours == {("all_reduce", "torch.float64", 6): 3}  # the window's payload: 48 bytes per optimizer step
    assert not Counter(plain["collectives"]) - Counter(weighted["collectives"])
    # the plain strategy's reduce-scatters, per FSDP unit (2 Linear layers): FSDP2 every microbatch (7), FSDP1
    # once per window (3)
    reduced = [c for c in weighted["collectives"] if c[0] == "reduce_scatter_tensor"]
    assert len(reduced) == 2 * scatters and {c[1] for c in reduced} == {"torch.float32"}


@pytest.mark.parametrize(
    ("strategy", "precision", "mixed", "rtol"),
    [
        ("fsdp2_weighted", "32-true", "float64", 1e-10),  # a float64 model: Lightning's 32-true keeps its dtype
        # measured: 4.9e-4, 7.2e-3, 4.9e-4, 4.1e-4; FSDP1 2.2e-3, 3.7e-3, 1.8e-3 (plain strategies: ~0.3)
        ("fsdp2_weighted", "bf16-mixed", None, 5e-3),
        ("fsdp2_weighted", "bf16-true", None, 3e-2),
        ("fsdp2_weighted", "32-true", "bf16/fp32", 5e-3),  # MixedPrecisionPolicy(param bf16, reduce fp32)
        ("fsdp2_weighted", "32-true", "bf16/bf16", 5e-3),
        ("fsdp_weighted", "bf16-mixed", None, 1e-2),  # FSDP1 computes and reduces in bf16
        ("fsdp_weighted", "bf16-true", None, 3e-2),
        ("fsdp_weighted", "32-true", "bf16/fp32", 1e-2),  # MixedPrecision(param bf16, reduce fp32)
    ],
)
def test_every_precision_and_fsdp_mixed_precision_policy_gives_the_reference_within_its_precision(
    tmp_path, strategy, precision, mixed, rtol
):
    float64 = mixed == "float64"
    config = ShardedConfig(
        strategy=strategy,
        accumulate=2,
        mode="weights",
        precision=precision,
        mixed=None if float64 else mixed,
        float64=float64,
        lr=0.05,
        epochs=2,
    )
    result = fit_sharded(config, tmp_path)
    expected = reference(config)
    assert max_relative_error(result[0]["params"], expected["params"]) < rtol
    # a bf16 gradient holds about 3 significant digits (measured up to 6e-3 off in its norm)
    assert [s["norm"] for s in result[0]["steps"]] == pytest.approx(expected["norms"], rel=max(4 * rtol, 1e-9))


@pytest.mark.parametrize(
    ("strategy", "precision", "mixed", "message"),
    [
        ("fsdp2_weighted", "16-true", None, "fsdp2_weighted would compute in float16 (precision='16-true')"),
        (
            "fsdp2_weighted",
            "32-true",
            "fp16/fp32",
            "module 'model.0' computes or reduces its gradients in float16: Mixed",
        ),
        (
            "fsdp2_weighted",
            "32-true",
            "bf16/fp16",
            "module 'model.0' computes or reduces its gradients in float16: Mixed",
        ),
        ("fsdp_weighted", "16-mixed", None, "fsdp_weighted would compute or reduce in float16 (MixedPrecision("),
        ("fsdp_weighted", "32-true", "bf16/fp16", "fsdp_weighted would compute or reduce in float16 (MixedPrecision("),
        # Lightning's own refusal: FSDP1 converts the module to its precision, ModelParallelStrategy refuses it
        ("fsdp2_weighted", "64-true", None, "does not support `Fabric(..., precision='64-true')`"),
        ("fsdp_weighted", "64-true", None, "`precision='64-true')` is not supported in FSDP"),
    ],
)
def test_float16_and_lightnings_unsupported_precisions_are_refused_at_setup_on_every_rank(
    tmp_path, strategy, precision, mixed, message
):
    config = ShardedConfig(strategy=strategy, precision=precision, mixed=mixed)
    done = fit_sharded(config, tmp_path, timeout=90, expect_failure=True)
    assert done.stdout.count(message) == 2, done.stdout[-4000:]
    if "float16" in message:
        assert "Compute and reduce in bfloat16 or float32" in done.stdout


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_audit_passes_the_weighted_strategy_and_flags_the_plain_one(tmp_path, strategy):
    # uneven token counts and a replaying rank (lengths 5 and 3): every step of the weighted run is the reference's
    config = ShardedConfig(strategy=strategy, accumulate=2, lengths=(5, 3), audit=True)
    weighted = fit_sharded(config, tmp_path)
    reports = weighted[0]["audits"]
    assert len(reports) == 3 and reports == weighted[1]["audits"]  # the same verdict on every rank
    assert all(r["passed"] and r["objective_error"] < 1e-5 for r in reports)
    expected = reference(config)
    assert [r["expected_norm"] for r in reports] == pytest.approx(expected["norms"], rel=1e-5)
    assert max_relative_error(weighted[0]["params"], expected["params"]) < 1e-5  # the audit only observes
    plain = dataclasses.replace(config, strategy=PLAIN[strategy], lengths=(4, 4))  # plain needs even ranks
    done = fit_sharded(plain, tmp_path, expect_failure=True)  # on_mismatch="raise"
    assert done.stdout.count("ObjectiveMismatchError: ObjectiveAudit at step 0:") == 2, done.stdout[-3000:]
