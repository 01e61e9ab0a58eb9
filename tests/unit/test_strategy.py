"""The strategy's surface: registration, public names, refusals (no processes)."""

from __future__ import annotations

import importlib
import pickle

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import StrategyRegistry
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

import lightning_weighted
from lightning_weighted import WeightedDDPStrategy, WeightedReduceState

NAMES = {
    "ddp_weighted": ("popen", False),
    "ddp_weighted_spawn": ("spawn", False),
    "ddp_weighted_fork": ("fork", False),
    "ddp_weighted_find_unused_parameters_true": ("popen", True),
}


def test_import_registers_every_name_and_reimport_changes_nothing():
    before = {name: StrategyRegistry[name] for name in NAMES}
    importlib.reload(lightning_weighted)
    for name, (start_method, find_unused) in NAMES.items():
        entry = StrategyRegistry[name]
        assert entry["strategy"].__name__ == "WeightedDDPStrategy"
        assert entry["init_params"]["start_method"] == start_method
        assert entry["init_params"].get("find_unused_parameters", False) is find_unused
        assert entry["init_params"] == before[name]["init_params"]


@pytest.mark.parametrize("name", sorted(NAMES))
def test_trainer_builds_the_strategy_from_its_name(name):
    trainer = Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, WeightedDDPStrategy)
    assert trainer.strategy._start_method == NAMES[name][0]
    assert trainer.strategy._ddp_kwargs.get("find_unused_parameters", False) is NAMES[name][1]


def test_public_names_are_exactly_all():
    public = {name for name in vars(lightning_weighted) if not name.startswith("_")}
    modules = {"audit", "hook", "strategy", "callback", "participation"}
    assert set(lightning_weighted.__all__) == public - modules - {"StrategyRegistry"}
    assert lightning_weighted.__all__ == sorted(lightning_weighted.__all__)


@pytest.mark.parametrize("argument", ["ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper"])
def test_a_user_comm_hook_is_refused_because_the_hook_is_owned_by_ddp_weighted(argument):
    value = allreduce_hook if argument == "ddp_comm_hook" else object()
    with pytest.raises(ValueError, match=rf"`{argument}=.*comm hook is owned by ddp_weighted.*strategy='ddp'"):
        WeightedDDPStrategy(**{argument: value})


def test_hook_state_pickles_without_its_process_group_or_pending_work():
    state = pickle.loads(pickle.dumps(WeightedReduceState(rides=True)))
    assert state.process_group is None
    assert state.rides
    with pytest.raises(RuntimeError, match="no count reduction was started"):
        state.counts()


def test_the_strategy_pickles_for_the_spawn_launcher():
    strategy = pickle.loads(pickle.dumps(WeightedDDPStrategy(find_unused_parameters=True)))
    assert strategy._ddp_kwargs == {"find_unused_parameters": True}
    assert strategy.skipped_steps == 0
