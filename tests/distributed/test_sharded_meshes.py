"""FSDP2 over meshes beyond one data-parallel dimension: HSDP, and tensor parallelism under data parallelism."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from harness import logged_rows
from scenario import max_relative_error, reference
from sharded import ShardedConfig, fit_sharded


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
