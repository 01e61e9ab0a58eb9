"""The strategy's surface: registration, public names, refusals, its Lightning wiring (no extra processes)."""

from __future__ import annotations

import importlib
import inspect
import math
import pickle
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities import CombinedLoader
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

import lightning_weighted
from lightning_weighted import ItemCounter, UnpaddedDistributedSampler, WeightedDDPStrategy
from lightning_weighted._compat import LOADER_BARRIERS
from lightning_weighted.count import Count, Problem
from lightning_weighted.loop import read_output

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
    public = {
        name
        for name, value in vars(lightning_weighted).items()
        if not name.startswith("_") and not inspect.ismodule(value)
    }
    assert set(lightning_weighted.__all__) == public - {"StrategyRegistry", "Any"}
    assert lightning_weighted.__all__ == sorted(lightning_weighted.__all__)
    assert len(lightning_weighted.__all__) <= 20  # WeightedFabricFSDPStrategy is the 20th
    assert "WeightedFabricFSDPStrategy" in lightning_weighted.__all__


def test_a_comm_hook_of_your_own_is_passed_on_as_under_ddp():
    # DDP's reducer averages and the weights live outside it, so a hook that averages (torch's do) keeps them exact
    strategy = WeightedDDPStrategy(ddp_comm_hook=allreduce_hook)
    assert strategy._ddp_comm_hook is allreduce_hook


def test_the_strategy_pickles_for_the_spawn_launcher():
    strategy = pickle.loads(pickle.dumps(WeightedDDPStrategy(find_unused_parameters=True)))
    assert strategy._ddp_kwargs == {"find_unused_parameters": True}
    assert strategy.skipped_steps == 0


def test_the_count_rule_takes_a_returned_count_then_the_item_counters_then_the_batch_size():
    strategy = WeightedDDPStrategy()  # no fit: its ItemCounter set as `setup` takes it from the callbacks
    batch, loss = torch.zeros(5, 3), torch.tensor(1.0)
    strategy.item_counter = ItemCounter(lambda batch: 7, integer=True)
    assert strategy.counts_of(read_output({"loss": loss, "count": 2}), batch) == [Count(2.0)]
    assert strategy.counts_of(read_output({"loss": loss}), batch) == [Count(7.0)]
    assert strategy.counts_of(read_output(loss), batch) == [Count(7.0)]
    # the counter's count keeps its own integer rule
    strategy.item_counter = ItemCounter(lambda batch: 2.5, integer=True)
    assert strategy.counts_of(read_output(loss), batch) == [Count(2.5, Problem.FRACTIONAL)]
    # nothing gave a count: the batch size (a dict without "count" too)
    strategy.item_counter = None
    assert strategy.counts_of(read_output({"loss": loss}), batch) == [Count(5.0)]
    assert strategy.counts_of(read_output(loss), batch) == [Count(5.0)]


def test_a_batch_of_several_loaders_is_counted_over_each_by_the_item_counter_or_refused_as_ambiguous():
    strategy = WeightedDDPStrategy()
    batch, loss = {"a": torch.zeros(2, 3), "b": torch.zeros(3, 3)}, torch.tensor(1.0)
    strategy._loaders.train_loaders = [object(), object()]  # two train loaders, in the default mode
    assert strategy._loaders.combined
    (count,) = strategy.counts_of(read_output(loss), batch)
    assert count.problem is Problem.AMBIGUOUS and math.isnan(count.value)  # Lightning's batch size is the first's
    assert strategy.counts_of(read_output({"loss": loss, "count": 4}), batch) == [Count(4.0)]
    strategy.item_counter = ItemCounter("examples")
    assert strategy.counts_of(read_output(loss), batch) == [Count(5.0)]  # every loader's rows
    # a sequential CombinedLoader hands one loader's batch at a time: its batch size is unambiguous
    strategy.item_counter = None
    sequential = CombinedLoader({"a": [0], "b": [1]}, mode="sequential")
    strategy._loaders.trainer = SimpleNamespace(fit_loop=SimpleNamespace(_combined_loader=sequential))
    assert not strategy._loaders.combined
    assert strategy.counts_of(read_output(loss), torch.zeros(2, 3)) == [Count(2.0)]


class _Recording(WeightedDDPStrategy):
    """Notes the barriers Lightning passes and the dataloaders the strategy hands back."""

    def __init__(self) -> None:
        super().__init__()
        self.barriers: list[str | None] = []
        self.loaders: list[object] = []

    def barrier(self, name: str | None = None) -> None:
        self.barriers.append(name)
        super().barrier(name)

    def process_dataloader(self, dataloader: object) -> object:
        self.loaders.append(super().process_dataloader(dataloader))
        return self.loaders[-1]


def test_lightning_names_the_barrier_before_each_dataloader_and_the_patches_leave_with_the_fit(one_process_group):
    # One process (world size 1, in this one): the strategy recognises each dataloader by the barrier's name.
    strategy = _Recording()
    model = BoringModel()
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_steps=2, limit_val_batches=1, limit_test_batches=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model)
    trainer.test(model, verbose=False)

    assert set(LOADER_BARRIERS) <= set(strategy.barriers)  # fails if Lightning renames them
    validation, train, test = strategy.loaders
    for loader in (validation, train, test):
        assert type(loader.sampler) is UnpaddedDistributedSampler  # Lightning's padding sampler, swapped
    assert not {"on_train_batch_start", "lr_scheduler_step"} & set(vars(model))  # the module as it was
