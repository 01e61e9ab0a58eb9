"""The strategy's surface: registration, public names, refusals, its Lightning wiring (no extra processes)."""

from __future__ import annotations

import importlib
import inspect
import pickle

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import StrategyRegistry
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

import lightning_weighted
from lightning_weighted import UnpaddedDistributedSampler, WeightedDDPStrategy
from lightning_weighted._compat import LOADER_BARRIERS

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
    assert len(lightning_weighted.__all__) <= 19


def test_a_comm_hook_of_your_own_is_passed_on_as_under_ddp():
    # DDP's reducer averages and the weights live outside it, so a hook that averages (torch's do) keeps them exact
    strategy = WeightedDDPStrategy(ddp_comm_hook=allreduce_hook)
    assert strategy._ddp_comm_hook is allreduce_hook


def test_the_strategy_pickles_for_the_spawn_launcher():
    strategy = pickle.loads(pickle.dumps(WeightedDDPStrategy(find_unused_parameters=True)))
    assert strategy._ddp_kwargs == {"find_unused_parameters": True}
    assert strategy.skipped_steps == 0


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
