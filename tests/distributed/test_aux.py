"""Auxiliary loss terms (a MoE load-balancing loss, a router z-loss) averaged as plain DDP averages them: each
microbatch of each rank alike, beside the item-weighted loss, on every engine and integration (2 gloo ranks, against
the float64 reference of that objective; two terms, unequal counts, a short last window)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from fabric_worker import FabricConfig
from harness import fit, logged_rows
from scenario import Config, max_relative_error, reference
from sharded import ShardedConfig, fit_sharded

BASE = {"aux": "parts", "accumulate": 3, "batches": 7, "epochs": 2, "mode": "tokens"}
AHEAD = {"counter": "quiet", "bare_loss": True}  # ItemCounter counts ahead: N is known before each backward


def _fabric(config: Any, tmp_path: Path, expect_failure: bool = False) -> Any:
    return fit(config, tmp_path, script="fabric_worker.py", expect_failure=expect_failure)


ENGINES = [
    pytest.param(fit, Config(strategy="ddp_weighted", **BASE, **AHEAD), id="trainer-ddp"),
    pytest.param(fit_sharded, ShardedConfig(strategy="fsdp2_weighted", **BASE, **AHEAD), id="trainer-fsdp2"),
    pytest.param(fit_sharded, ShardedConfig(strategy="fsdp_weighted", **BASE, **AHEAD), id="trainer-fsdp1"),
    pytest.param(_fabric, FabricConfig(strategy="ddp_weighted", **BASE, ahead=True), id="fabric-ddp"),
    pytest.param(_fabric, FabricConfig(strategy="fsdp2_weighted", **BASE, ahead=True), id="fabric-fsdp2"),
]


@pytest.mark.parametrize(("train", "config"), ENGINES)
def test_auxiliary_terms_are_averaged_over_microbatches_and_ranks_beside_the_item_mean(tmp_path, train, config):
    expected = reference(config)
    result = train(config, tmp_path)
    assert max_relative_error(result[0]["params"], expected["params"]) < 1e-5
    # the control: the same terms added into the loss are weighted by the microbatch's items instead
    inside = train(dataclasses.replace(config, aux="inside"), tmp_path)
    assert max_relative_error(inside[0]["params"], expected["params"]) > 1e-3


def test_the_monitor_logs_each_term_as_its_mean_over_the_windows_microbatches_and_ranks(tmp_path):
    config = Config(strategy="ddp_weighted", **BASE, counter="mask", bare_loss=True)
    expected = reference(config)
    fit(config, tmp_path)
    for name in ("load_balance", "z"):
        rows = logged_rows(tmp_path, f"train/aux/{name}")
        logged = [float(row[f"train/aux/{name}"]) for row in rows]
        assert logged == pytest.approx([means[name] for means in expected["aux_means"]], rel=1e-5)


@pytest.mark.parametrize(
    ("train", "config"),
    [
        pytest.param(fit, Config(strategy="ddp_weighted", **BASE), id="trainer-returned-count"),
        pytest.param(_fabric, FabricConfig(strategy="ddp_weighted", **BASE), id="fabric-count-in-backward"),
    ],
)
def test_auxiliary_terms_where_counts_come_after_the_forward_are_the_same_clear_error_on_every_rank(
    tmp_path, train, config
):
    # their weight needs the window's N before its backward: a count returned by training_step comes after
    done = train(config, tmp_path, expect_failure=True)
    message = "ValueError: on 2 ranks, {} auxiliary terms ('aux'), which are averaged as plain DDP averages them"
    source = "training_step returned" if isinstance(config, Config) and not isinstance(config, FabricConfig) else ""
    assert done.stdout.count(message.format(source or "fabric.backward got")) == 2, done.stdout[-3000:]
    assert "`ItemCounter`, or `fabric.strategy.count_ahead` under Fabric" in done.stdout


def test_the_monitor_logs_each_term_once_per_data_parallel_rank_under_tensor_parallelism(tmp_path):
    # one data-parallel rank of two tensor-parallel processes: a term's SUM over every process counted it twice.
    # lr 0 keeps each step's terms those of the initial model (the load-balancing term here is computed on each
    # process's half of the hidden layer, so only the router z-loss, on the replicated output, is compared)
    config = ShardedConfig(
        strategy="fsdp2_weighted", world_size=1, tensor_parallel=2, **BASE, counter="mask", bare_loss=True, lr=0.0
    )
    expected = reference(config)
    fit_sharded(config, tmp_path)
    rows = logged_rows(tmp_path, "train/aux/z")
    assert [float(row["train/aux/z"]) for row in rows] == pytest.approx(
        [means["z"] for means in expected["aux_means"]], rel=1e-5
    )
