"""The Fabric strategies' surface: registration in Fabric's registry, their error wording, pickling (no processes)."""

from __future__ import annotations

import importlib
import math
import pickle

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import STRATEGY_REGISTRY

import lightning_weighted
from lightning_weighted import (
    WeightedFabricDDPStrategy,
    WeightedFabricFSDPStrategy,
    WeightedFabricModelParallelStrategy,
)
from lightning_weighted.count import FABRIC, Count, Problem, problem_error
from lightning_weighted.loop import Output
from lightning_weighted.payload import Slot
from lightning_weighted.window import Window, payload

NAMES = {
    "ddp_weighted": ("popen", False),
    "ddp_weighted_spawn": ("spawn", False),
    "ddp_weighted_fork": ("fork", False),
    "ddp_weighted_notebook": ("fork", False),
    "ddp_weighted_find_unused_parameters_true": ("popen", True),
}


def test_import_registers_every_fabric_name_and_reimport_changes_nothing():
    before = {name: STRATEGY_REGISTRY[name] for name in NAMES}
    importlib.reload(lightning_weighted)
    for name, (start_method, find_unused) in NAMES.items():
        entry = STRATEGY_REGISTRY[name]
        assert entry["strategy"].__name__ == "WeightedFabricDDPStrategy"
        assert entry["init_params"]["start_method"] == start_method
        assert entry["init_params"].get("find_unused_parameters", False) is find_unused
        assert entry["init_params"] == before[name]["init_params"]
    assert STRATEGY_REGISTRY["fsdp2_weighted"]["strategy"] is WeightedFabricModelParallelStrategy
    assert STRATEGY_REGISTRY["fsdp_weighted"]["strategy"] is WeightedFabricFSDPStrategy
    assert STRATEGY_REGISTRY["fsdp_weighted"]["init_params"] == {}
    assert "ddp" in STRATEGY_REGISTRY and "fsdp" in STRATEGY_REGISTRY  # Fabric's own names stay


def test_fabric_builds_the_fsdp2_strategy_from_its_name_and_no_backward_sync_marks_the_window():
    fabric = Fabric(strategy="fsdp2_weighted", accelerator="cpu", devices=2)
    assert isinstance(fabric.strategy, WeightedFabricModelParallelStrategy)
    with fabric.strategy._backward_sync_control.no_backward_sync(torch.nn.Linear(1, 1), True):  # what Fabric enters
        assert not fabric.strategy._syncs(None)  # type: ignore[arg-type]  # FSDP2 marks windows by the context alone
    assert fabric.strategy._syncs(None)  # type: ignore[arg-type]


def test_fabric_builds_the_fsdp1_strategy_from_its_name_and_a_sharding_that_does_not_shard_is_refused():
    fabric = Fabric(strategy="fsdp_weighted", accelerator="cpu", devices=2)
    assert isinstance(fabric.strategy, WeightedFabricFSDPStrategy)
    assert fabric.strategy.sharding_strategy.name == "FULL_SHARD"
    assert not fabric.strategy._accumulating  # outside `fabric.no_backward_sync(model)`
    with pytest.raises(ValueError, match=r"`sharding_strategy='NO_SHARD'` replicates the model"):
        WeightedFabricFSDPStrategy(sharding_strategy="NO_SHARD")


@pytest.mark.parametrize("name", sorted(NAMES))
def test_fabric_builds_the_strategy_from_its_name(name):
    fabric = Fabric(strategy=name, accelerator="cpu", devices=2)
    assert isinstance(fabric.strategy, WeightedFabricDDPStrategy)
    assert fabric.strategy._start_method == NAMES[name][0]
    assert fabric.strategy._ddp_kwargs.get("find_unused_parameters", False) is NAMES[name][1]


@pytest.mark.parametrize(
    ("problem", "value", "error", "match"),
    [
        (Problem.MISSING, math.nan, TypeError, r"on rank 1, fabric\.backward got no count\. Pass each micro"),
        (Problem.NEGATIVE, -3.0, ValueError, r"count is negative \(-3\)\. Pass .* `fabric\.backward\(loss, c"),
        (Problem.NO_GRAPH, math.nan, RuntimeError, r"on rank 1, fabric\.backward got a loss that is not attac"),
    ],
)
def test_fabric_errors_name_fabric_backward_and_its_count_argument(problem, value, error, match):
    good, bad = Window(), Window()
    good.add(Count(4.0))
    bad.reject(problem, value)
    cpu = torch.device("cpu")
    summed = (payload([good], True, cpu) + payload([bad], True, cpu)).tolist()
    assert summed[Slot.INVALID] == 1.0  # every rank reads that a rank found a problem, and gathers every rank's row
    rows = [good.problem_row(cpu).tolist(), bad.problem_row(cpu).tolist()]
    with pytest.raises(error, match=match):
        raise problem_error(rows, FABRIC)  # what `loop.Exchange.read(FABRIC)` raises on every rank


def test_a_bad_participation_policy_is_refused_where_it_is_passed():
    with pytest.raises(ValueError, match=r"participation='sometimes' is not a policy: choose 'pad' or 'strict'"):
        WeightedFabricDDPStrategy(participation="sometimes")  # type: ignore[arg-type]


def test_the_fabric_strategy_pickles_for_the_spawn_launcher():
    strategy = pickle.loads(pickle.dumps(WeightedFabricDDPStrategy(find_unused_parameters=True)))
    assert strategy._ddp_kwargs == {"find_unused_parameters": True}
    assert (strategy.skipped_steps, strategy.last_window, strategy.padding_step) == (0, None, False)


def test_fabric_backward_before_a_model_is_set_up_says_so():
    with pytest.raises(RuntimeError, match=r"fabric\.backward ran before a model was set up: call `model, optimizer"):
        WeightedFabricDDPStrategy().backward(torch.ones((), requires_grad=True), None, count=1)


def test_a_part_handed_fewer_counts_than_another_is_refused_at_the_windows_end(one_rank):
    class Engine:  # a SUM over this one rank
        divisor, group, mean_sized, needs_graph = 1, None, False, False

    strategy, w = WeightedFabricDDPStrategy(parallel_devices=[torch.device("cpu")]), torch.ones((), requires_grad=True)
    strategy._start(Engine(), torch.nn.Linear(1, 1))  # type: ignore[arg-type]
    loop = strategy._loop
    assert loop is not None
    strategy.count_ahead({"policy": [3, 2], "kl": [1]})  # the second microbatch's "kl" count is missing
    for policy, kl in ((3.0, 1.0), (2.0, 0.0)):
        loop.add(Output(None, parts={"policy": w * policy, "kl": w * kl}))
    loop.end(True)
    with pytest.raises(TypeError, match=r"on rank 0, a microbatch's count is not a number\. Pass each microbatch's"):
        loop.finish(step=0)
