"""Fabric loops under `"ddp_weighted"` and `"fsdp2_weighted"`: the float64 reference of the global item mean, with
plain Fabric `"ddp"` (and FSDP2) failing it; accumulation through `no_backward_sync` or `window_end=`, uneven
ranks, empty microbatches and windows, bad counts, clipping and precision (2 gloo ranks, forked ready-imported)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from fabric_worker import FabricConfig
from harness import fabric_fit, run_worker
from scenario import identical, is_finite, max_relative_error, reference

FIX = "Pass each microbatch's count as `fabric.backward(loss, count=n)`"
ENGINES = ["ddp_weighted", "fsdp2_weighted"]
PLAIN = {"ddp_weighted": "ddp", "fsdp2_weighted": "fsdp2"}


@pytest.mark.parametrize("strategy", ENGINES)
@pytest.mark.parametrize("marking", ["no_sync", "window_end"])
def test_each_window_costs_one_count_reduction_however_it_is_marked(tmp_path, strategy, marking):
    # window_end=False outside no_backward_sync: the strategy runs that backward under DDP's `no_sync`
    config = FabricConfig(strategy=strategy, accumulate=3, batches=7, marking=marking, count_collectives=True)
    result = fabric_fit(config, tmp_path)
    assert max_relative_error(result[0]["params"], reference(config)["params"]) < 1e-5
    payload = ("all_reduce", "torch.float64", 6)
    for rank in result:
        # the window's payload, 6 float64 values, once per window (of 3, 3 and 1 microbatches), each before its
        # optimizer step; DDP's buckets are reduced in C++, unseen here
        ours = [c for c in rank["collectives"] if c[0] == "all_reduce"]
        assert ours == [payload] * 3
        assert [rank["collectives"][: s["collectives"]].count(payload) for s in rank["steps"]] == [1, 2, 3]
        # FSDP2's own traffic is seen, whatever this torch calls it (`reduce_scatter_single` from torch 2.13): one
        # reduce-scatter per FSDP unit (the 2 Linear layers) and microbatch, every microbatch (7)
        scatters = [c for c in rank["collectives"] if c[0] == "reduce_scatter_tensor"]
        gathers = [c for c in rank["collectives"] if c[0] == "all_gather_into_tensor"]
        assert len(scatters) == (2 * 7 if strategy == "fsdp2_weighted" else 0)
        assert (len(gathers) > 0) == (strategy == "fsdp2_weighted")


@pytest.mark.parametrize("strategy", ENGINES)
def test_counts_handed_over_ahead_cost_their_sum_and_the_windows_payload(tmp_path, strategy):
    config = FabricConfig(strategy=strategy, accumulate=3, batches=7, ahead=True, count_collectives=True)
    result = fabric_fit(config, tmp_path)
    assert max_relative_error(result[0]["params"], reference(config)["params"]) < 1e-5
    for rank in result:
        ours = [c for c in rank["collectives"] if c[0] == "all_reduce"]
        # per window: its counts' SUM before its first forward, then its payload before its last backward
        assert ours == [("all_reduce", "torch.float64", 1), ("all_reduce", "torch.float64", 6)] * 3


@pytest.mark.parametrize("strategy", ENGINES)
def test_item_sum_losses_passed_with_reduction_sum_match_the_reference(tmp_path, strategy):
    config = FabricConfig(strategy=strategy, accumulate=2, mode="weights", item_sum=True)
    result = fabric_fit(config, tmp_path)
    assert max_relative_error(result[0]["params"], reference(config)["params"]) < 1e-5


@pytest.mark.parametrize("strategy", ENGINES)
@pytest.mark.parametrize(
    ("lengths", "iterable"),
    [([5, 8], False), ([5, 8], True), ([0, 5], False)],  # sized, unsized, and a rank without any batch
)
def test_ranks_with_less_data_keep_stepping_with_replays_and_match_the_reference(tmp_path, strategy, lengths, iterable):
    config = FabricConfig(strategy=strategy, accumulate=2, lengths=lengths, iterable=iterable, epochs=2)
    result = fabric_fit(config, tmp_path)
    expected = reference(config)
    assert max_relative_error(result[0]["params"], expected["params"]) < 1e-5
    longest = max(lengths)
    for rank, record in enumerate(result):
        assert len(record["steps"]) == len(expected["norms"])  # every rank steps until every rank is done
        per_epoch = [False] * lengths[rank] + [True] * (longest - lengths[rank])
        assert record["padding"] == per_epoch * 2  # the replays, and only they, are marked
        assert [w[2] for w in record["windows"]] == [local[rank] for local in expected["local_items"]]


@pytest.mark.parametrize("strategy", ENGINES)
def test_setup_dataloaders_shards_without_padding_so_each_item_counts_once(tmp_path, strategy):
    # 25 items, batches of 4, 2 ranks: 13 and 12 items (4 and 3 batches); Fabric's own sampler would repeat one
    # item on rank 1
    config = FabricConfig(strategy=strategy, accumulate=2, items=25, batch_size=4, epochs=2, mode="weights")
    result = fabric_fit(config, tmp_path)
    expected = reference(config)
    assert max_relative_error(result[0]["params"], expected["params"]) < 1e-5
    # float32 weight sums: a repeated item (weights 0.1 to 2.0) would move the total by more than 2e-3
    assert sum(w[1] for w in result[0]["windows"]) == pytest.approx(sum(expected["items"]), rel=1e-6)
    # the loader Fabric hands back is the user's, with its attributes, where the ranks hold uneven batches
    for rank in result:
        sampler = "UnpaddedDistributedSampler"
        assert rank["loader"] == {"dataset": True, "sampler": sampler, "batch_size": 4, "num_workers": 0}


@pytest.mark.parametrize("strategy", ENGINES)
@pytest.mark.parametrize("python_count", [True, False])
def test_fully_masked_microbatches_given_to_fabric_backward_contribute_exactly_zero(tmp_path, strategy, python_count):
    # rank 0's microbatch 1 and rank 1's microbatch 4 have every token masked: counted on the host, their NaN means
    # (0/0) are cut out of the graph; counted on the device, the loss is multiplied by 0 and the mean is 0/1
    config = FabricConfig(
        strategy=strategy, accumulate=2, masked=[(0, 1), (1, 4)], python_count=python_count, safe_mean=not python_count
    )
    result = fabric_fit(config, tmp_path)
    assert is_finite(result[0]["params"])
    assert max_relative_error(result[0]["params"], reference(config)["params"]) < 1e-5


@pytest.mark.parametrize("strategy", ENGINES)
def test_a_window_without_items_leaves_params_and_optimizer_state_bit_identical(tmp_path, strategy):
    # windows 0, 1, 2 of A = 2; window 1 has no valid item on any rank
    config = FabricConfig(strategy=strategy, accumulate=2, empty_windows=[1], optimizer="adam", lr=0.05)
    result = fabric_fit(config, tmp_path)
    for rank in result:
        before, empty, after = rank["steps"]
        assert empty["norm"] == 0.0  # no gradient at all
        assert identical(empty["params"], before["params"])
        assert identical(empty["state"], before["state"])  # Adam moments and step counts
        assert not identical(after["params"], empty["params"])
        assert rank["skipped_steps"] == 1
    assert max_relative_error(result[0]["params"], reference(config)["params"]) < 1e-5


@pytest.mark.parametrize("strategy", ENGINES)
@pytest.mark.parametrize(
    ("value", "message"),
    [
        (-3, "ValueError: on rank 1, a microbatch's count is negative (-3)."),
        (float("nan"), "ValueError: on rank 1, a microbatch's count is not finite (nan)."),
    ],
)
def test_a_bad_count_on_one_rank_raises_the_same_error_on_every_rank_before_the_step(
    tmp_path, strategy, value, message
):
    # rank 1's microbatch 3 sits in window 1 (A = 2): window 0 steps, window 1 raises at its end
    config = FabricConfig(strategy=strategy, accumulate=2, bad_count=[1, 3, value])
    result = fabric_fit(config, tmp_path, timeout=60, expect_failure=True)
    for rank in result:
        assert rank["error"] == result[0]["error"]
        assert rank["error"].startswith(message) and FIX in rank["error"]
        assert len(rank["steps"]) == 1
        assert identical(rank["local_params"], rank["steps"][0]["local_params"])  # nothing changed after window 0


@pytest.mark.parametrize("strategy", ENGINES)
def test_a_loss_without_a_graph_on_one_rank_ends_every_rank_with_the_reason(tmp_path, strategy):
    config = FabricConfig(strategy=strategy, accumulate=2, bad_count=[1, 3, "nograd"], pg_timeout=10)
    result = fabric_fit(config, tmp_path, timeout=60, expect_failure=True)
    if strategy == "ddp_weighted":  # the flag travels with the counts: the same error on every rank
        for rank in result:
            assert rank["error"].startswith("RuntimeError: on rank 1, fabric.backward got a loss that is not attached")
            assert len(rank["steps"]) == 1
    else:  # a sharded backward needs the graph: that rank says why, its peer fails as its connections close
        assert result[1]["error"].startswith("RuntimeError: On rank 1, fabric.backward got a loss that is not")
        assert "gloo" in result[0]["error"]  # "Connection closed by peer", or "reset" as the race goes


@pytest.mark.parametrize("strategy", ENGINES)
@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_fabric_clip_gradients_sees_the_normalized_gradient(tmp_path, strategy, algorithm):
    config = FabricConfig(strategy=strategy, accumulate=2, mode="examples", clip=0.05, clip_algorithm=algorithm)
    expected = reference(config)
    assert max(expected["norms"]) > 0.05  # clipping is active
    result = fabric_fit(config, tmp_path)
    assert [s["norm"] for s in result[0]["steps"]] == pytest.approx(expected["norms"], rel=1e-5)
    assert max_relative_error(result[0]["params"], expected["params"]) < 1e-5


@pytest.mark.parametrize(
    ("strategy", "precision", "rtol"),
    [
        ("ddp_weighted", "bf16-mixed", 3e-2),  # fp32 gradients, bf16 compute
        ("ddp_weighted", "bf16-true", 5e-2),  # bf16 gradients; the counts still sum in the float64 payload
        ("ddp_weighted", "16-true", 5e-2),
        ("ddp_weighted", "64-true", 1e-7),  # Fabric hands the model's outputs back in float32: a float32 loss
        ("fsdp2_weighted", "bf16-mixed", 3e-2),
        ("fsdp2_weighted", "bf16-true", 5e-2),  # bf16 item sums reduced, then multiplied by 1/N on the shards
    ],
)
def test_every_precision_gives_the_reference_within_its_precision_and_plain_fabric_does_not(
    tmp_path, strategy, precision, rtol
):
    config = FabricConfig(strategy=strategy, accumulate=2, mode="weights", precision=precision, lr=0.05)
    result = fabric_fit(config, tmp_path)
    expected = reference(config)
    assert max_relative_error(result[0]["params"], expected["params"]) < rtol
    assert [s["norm"] for s in result[0]["steps"]] == pytest.approx(expected["norms"], rel=max(rtol, 1e-6))
    plain = fabric_fit(dataclasses.replace(config, strategy=PLAIN[strategy]), tmp_path)
    assert max_relative_error(plain[0]["params"], expected["params"]) > 0.1


@pytest.mark.parametrize(
    ("strategy", "misuse", "message"),
    [
        ("ddp_weighted", "window_end_in_no_sync", "RuntimeError: fabric.backward(..., window_end=True) ran inside"),
        ("fsdp2_weighted", "window_end_in_no_sync", "RuntimeError: fabric.backward(..., window_end=True) ran inside"),
        ("ddp_weighted", "step_in_open_window", "RuntimeError: optimizer.step() was called while a window is open"),
        ("fsdp2_weighted", "step_in_open_window", "RuntimeError: optimizer.step() was called while a window is open"),
        ("ddp_weighted", "clip_in_open_window", "RuntimeError: fabric.clip_gradients was called while a window is"),
        ("ddp_weighted", "reduction", "ValueError: fabric.backward got reduction='avg'"),
        ("ddp_weighted", "second_model", "RuntimeError: 2 models are set up, each trained in windows of its own"),
        ("fsdp2_weighted", "second_model", "RuntimeError: 2 models are set up, each trained in windows of its own"),
    ],
)
def test_uses_that_cannot_be_weighted_are_refused_on_every_rank_with_the_fix(tmp_path, strategy, misuse, message):
    config = FabricConfig(strategy=strategy, accumulate=2, misuse=misuse)
    result = fabric_fit(config, tmp_path, timeout=60, expect_failure=True)
    for rank in result:
        assert rank["error"].startswith(message), rank["error"]
        assert rank["steps"] == []


def test_fsdp2_reducing_item_sums_in_fp16_is_refused_at_setup_with_the_fix(tmp_path):
    config = FabricConfig(strategy="fsdp2_weighted", precision="16-true")
    result = fabric_fit(config, tmp_path, timeout=60, expect_failure=True)
    for rank in result:
        assert "reduces its gradients in float16" in rank["error"], rank["error"]
        assert "reduce_dtype=torch.float32" in rank["error"]


@pytest.mark.parametrize("iterable", [False, True])
def test_an_evaluation_loop_sees_replays_marked_or_ends_with_its_own_data(tmp_path, iterable):
    # after training, one pass without backward: a sized loader gives every rank the longest rank's length, the
    # replays marked by `padding_step`; an unsized one ends where the rank's own data does, as with plain Fabric
    config = FabricConfig(strategy="ddp_weighted", accumulate=2, lengths=[5, 8], iterable=iterable, evaluate=True)
    result = fabric_fit(config, tmp_path)
    for rank, length in zip(result, [5, 8], strict=True):
        marks = [replay for _, replay in rank["evaluation"]]
        assert marks == [False] * length + ([] if iterable else [True] * (8 - length))


@pytest.mark.parametrize("strategy", ENGINES)
def test_an_exception_on_one_rank_mid_window_ends_every_rank_well_before_the_timeout(tmp_path, strategy):
    # rank 1 raises at microbatch 3, inside window 1 (A = 2); rank 0 is left in that window's collectives
    config = FabricConfig(strategy=strategy, accumulate=2, fault=["raise", 1, 3], pg_timeout=10)
    out, done = run_worker("fabric_worker.py", config, tmp_path, timeout=60)
    assert done.returncode != 0
    records = [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(2)]
    assert records[1]["error"] == "RuntimeError: injected raise on rank 1"
    assert records[0]["error"] is not None  # the peer fails too, as the raising rank's connections close
    assert all(len(record["steps"]) == 1 for record in records)
    struck = re.search(r"FAULT raise (\d+\.\d+)", done.stdout)
    assert struck is not None, done.stdout[-4000:]
    assert done.ended - float(struck.group(1)) < config.pg_timeout  # every rank ended before the timeout


def test_fabric_fsdp2s_default_sharding_keeps_a_tied_weight_with_the_root_and_trains_the_reference(tmp_path):
    # two layers share one weight (a language model's embedding and output layer): sharding each on its own, as
    # torch refuses at the first forward, is what the default leaves out
    config = FabricConfig(strategy="fsdp2_weighted", tied=True, accumulate=2, batches=5, mode="tokens")
    result = fabric_fit(config, tmp_path)
    expected = reference(config)
    assert max_relative_error(result[0]["params"], expected["params"]) < 1e-5
    plain = fabric_fit(dataclasses.replace(config, strategy="fsdp2"), tmp_path)
    assert max_relative_error(plain[0]["params"], expected["params"]) > 1e-2


@pytest.mark.parametrize("strategy", ["ddp_weighted", "fsdp2_weighted"])
def test_a_loop_written_for_ddp_weights_each_microbatch_alike_and_says_so_once(tmp_path, strategy):
    # no count anywhere: each microbatch's loss counts 1 (a replay 0), as `count=1` says, and rank 0 says so once
    notice = "fabric.backward got no count, so each microbatch's loss is weighted alike"
    bare, bare_output = fabric_fit(FabricConfig(strategy=strategy, accumulate=2, counts="none"), tmp_path / "a",
                                   output=True)  # fmt: skip
    ones, ones_output = fabric_fit(FabricConfig(strategy=strategy, accumulate=2, counts="one"), tmp_path / "b",
                                   output=True)  # fmt: skip
    assert bare_output.count(notice) == 1 and ones_output.count(notice) == 0
    for a, b in zip(bare, ones, strict=True):
        assert identical(a["local_params"], b["local_params"]) and len(a["steps"]) == len(b["steps"]) > 1
