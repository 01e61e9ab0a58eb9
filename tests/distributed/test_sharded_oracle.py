"""FSDP2 and FSDP1: the synchronized update equals the float64 single-process gradient of the global item mean."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from harness import logged_rows, strategy_reads
from scenario import max_relative_error, reference
from sharded import ShardedConfig, fit_sharded

PLAIN = {"fsdp2_weighted": "fsdp2", "fsdp_weighted": "fsdp"}  # ModelParallelStrategy; FSDPStrategy enabled on CPU


@pytest.mark.parametrize("accumulate", [1, 3])
@pytest.mark.parametrize("strategy", ["fsdp2_weighted", "fsdp_weighted"])
def test_sharded_strategies_match_the_float64_reference_and_their_plain_counterparts_do_not(
    tmp_path, strategy, accumulate
):
    # counts returned by training_step, and counts taken ahead by ItemCounter from a bare mean's batches, which
    # reach the "device" as DeviceTensor: a host read of one of them would be a device sync on a GPU
    config = ShardedConfig(strategy=strategy, accumulate=accumulate, batches=7, epochs=2, mode="tokens")
    ahead_config = dataclasses.replace(config, counter="quiet", bare_loss=True, host_reads=True)
    expected = reference(config)
    weighted = fit_sharded(config, tmp_path)
    ahead = fit_sharded(ahead_config, tmp_path)
    plain = fit_sharded(dataclasses.replace(config, strategy=PLAIN[strategy]), tmp_path)

    for result in (weighted, ahead):
        assert max_relative_error(result[0]["params"], expected["params"]) < 1e-5
        assert all(torch.equal(a, b) for a, b in zip(result[0]["params"], result[1]["params"], strict=True))
        assert [s["norm"] for s in result[0]["steps"]] == pytest.approx(expected["norms"], rel=1e-5)
        assert [items for _, items, _ in result[0]["windows"]] == expected["items"]
    steps = len(expected["items"])
    for rank in ahead:
        assert rank["counts_ahead"] is True
        assert strategy_reads(rank, "device") == Counter()  # counted on the host, as the loader yielded them
        assert strategy_reads(rank, "other", ours=True) == Counter(range(steps))  # one host read per step
    assert weighted[0]["counts_ahead"] is False
    # the same check fails for the plain strategy: its mean of rank means re-weights the items
    assert max_relative_error(plain[0]["params"], expected["params"]) > 1e-2


def test_hsdp_over_a_two_by_two_mesh_matches_the_reference(tmp_path):
    # 4 data-parallel ranks: shards of 2, replicated twice; counts summed over all 4 (replicate × shard)
    config = ShardedConfig(strategy="fsdp2_weighted", world_size=4, hsdp=True, accumulate=2, batches=4, epochs=2)
    expected = reference(config)
    weighted = fit_sharded(config, tmp_path, timeout=300)
    plain = fit_sharded(dataclasses.replace(config, strategy="fsdp2"), tmp_path, timeout=300)
    assert max_relative_error(weighted[0]["params"], expected["params"]) < 1e-5
    assert all(
        torch.equal(a, b) for rank in weighted[1:] for a, b in zip(weighted[0]["params"], rank["params"], strict=True)
    )
    assert max_relative_error(plain[0]["params"], expected["params"]) > 1e-2


def test_tensor_parallel_peers_are_counted_once_through_the_data_parallel_group(tmp_path):
    # 2 data-parallel ranks × 2 tensor-parallel ranks: each batch is seen by both tensor-parallel peers
    config = ShardedConfig(strategy="fsdp2_weighted", tensor_parallel=2, accumulate=2, batches=4, epochs=2)
    expected = reference(config)
    weighted = fit_sharded(dataclasses.replace(config, counter="mask"), tmp_path, timeout=300)
    assert all(rank["counts_ahead"] for rank in weighted)  # summed over the data-parallel group before each window
    assert [items for _, items, _ in weighted[0]["windows"]] == pytest.approx(expected["items"])
    assert max_relative_error(weighted[0]["params"], expected["params"]) < 1e-5
    # ItemMonitor's imbalance, P · max_r n_r / N, over the P = 2 data-parallel ranks (not the 4 processes)
    logged = [float(row["train/imbalance"]) for row in logged_rows(tmp_path, "train/imbalance")]
    windows = zip(expected["local_items"], expected["items"], strict=True)
    imbalances = [2 * max(local) / items for local, items in windows]
    assert logged == pytest.approx(imbalances, rel=1e-6) and max(imbalances) > 1.1
    # counting over every process instead sees each item twice: N doubles and every step is half as long
    world = fit_sharded(dataclasses.replace(config, world_counts=True), tmp_path, timeout=300)
    assert [items for _, items, _ in world[0]["windows"]] == pytest.approx([2 * n for n in expected["items"]])
    assert max_relative_error(world[0]["params"], expected["params"]) > 1e-2
