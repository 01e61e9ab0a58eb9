"""Pins every touch of :mod:`lightning_weighted.trainer._seam`: Lightning's reason for it, and that it is undone.

Each touch is named in the seam's docstring with the reason no strategy hook serves; each test here checks that
reason on the installed Lightning (a source it rests on, or a behaviour), so a release that offers a hook, or moves
the one the seam uses, fails here with the touch's name.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loops.evaluation_loop import _EvaluationLoop
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.trainer import call
from pinning import Pins
from torch import nn

from lightning_weighted.trainer._seam import (
    BATCHES,
    CLIP,
    EPOCH_END,
    REPLAY_LOGS,
    SAMPLER_WARNING,
    SCHEDULERS,
    Seam,
    _silenced,
    patched,
)

PINS = Pins("_seam ")
pinned, source_says = PINS.pinned, PINS.source_says


def test_the_epoch_ends_early_only_where_the_modules_batch_start_hook_returns_minus_one() -> None:
    source = inspect.getsource(_TrainingEpochLoop.advance)
    module_hook = 'response = call._call_lightning_module_hook(trainer, "on_train_batch_start", batch, batch_idx)'
    strategy_hook = 'call._call_strategy_hook(trainer, "on_train_batch_start", batch, batch_idx)'
    pinned(EPOCH_END, module_hook in source, "_TrainingEpochLoop.advance", "the module's response is read")
    pinned(EPOCH_END, "should_skip_rest_of_epoch = response == -1" in source, "_TrainingEpochLoop.advance")
    # the strategy's hook runs after the module's, and what it returns is dropped: no strategy hook ends an epoch
    after = strategy_hook in source and source.index(strategy_hook) > source.index(module_hook)
    pinned(EPOCH_END, after, "_TrainingEpochLoop.advance", "the strategy's hook runs after, unread")
    pinned(EPOCH_END, f"= {strategy_hook}" not in source, "_TrainingEpochLoop.advance", "its return is read now")


def test_lr_schedulers_step_only_through_the_modules_hook() -> None:
    pinned(SCHEDULERS, not [n for n in dir(Strategy) if "scheduler_step" in n], "Strategy", "it has a scheduler hook")
    source_says(SCHEDULERS, _TrainingEpochLoop._update_learning_rates, '"lr_scheduler_step",', "_update_learning_rates")
    source_says(SCHEDULERS, _TrainingEpochLoop._update_learning_rates, "call._call_lightning_module_hook(", "its call")
    source_says(SCHEDULERS, call._call_lightning_module_hook, "getattr(pl_module, hook_name)", "the instance's hook")


def test_evaluation_batches_and_epoch_ends_reach_callbacks_and_the_module_only() -> None:
    for hook in ("on_validation_batch_start", "on_test_batch_start", "on_validation_epoch_end", "on_test_epoch_end"):
        pinned(BATCHES, not hasattr(Strategy, hook), f"Strategy.{hook}", "the strategy has the hook now")
        pinned(BATCHES, hasattr(Callback, hook), f"Callback.{hook}", "gone")
    source = inspect.getsource(_EvaluationLoop._evaluation_step)
    pinned(BATCHES, "call._call_callback_hooks(trainer, hook_name, *hook_kwargs.values())" in source, "its call")
    pinned(
        BATCHES,
        "_call_strategy_hook(trainer, hook_name, *hook_kwargs" not in source,
        "_evaluation_step",
        "a strategy hook is called",
    )
    source_says(BATCHES, call._call_callback_hooks, "callbacks = trainer.callbacks", "the callbacks it calls")


def test_a_train_batch_reaches_the_callbacks_in_order_then_the_module_and_only_then_the_strategy() -> None:
    source = inspect.getsource(_TrainingEpochLoop.advance)
    hooks = [
        'call._call_callback_hooks(trainer, "on_train_batch_start", batch, batch_idx)',
        'call._call_lightning_module_hook(trainer, "on_train_batch_start", batch, batch_idx)',
        'call._call_strategy_hook(trainer, "on_train_batch_start", batch, batch_idx)',
    ]
    found = [source.find(hook) for hook in hooks]
    pinned(BATCHES, -1 not in found, "_TrainingEpochLoop.advance", f"a hook's call is gone: {found}")
    pinned(BATCHES, found == sorted(found), "_TrainingEpochLoop.advance", "callbacks, module, strategy: the order")
    source_says(BATCHES, call._call_callback_hooks, "for callback in callbacks:", "the callbacks in their order")


def test_a_logged_mean_weighs_each_call_by_its_batch_size_so_a_replay_logs_with_weight_zero() -> None:
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

    parameters = inspect.signature(LightningModule.log).parameters
    pinned(REPLAY_LOGS, {"batch_size", "reduce_fx"} <= set(parameters), "LightningModule.log", "its parameters")
    results = _ResultCollection(training=True)
    for value, size in ((2.0, 3), (100.0, 0), (4.0, 1)):  # the call with batch size 0 is a replay's
        results.log("training_step", "loss", torch.tensor(value), on_step=False, on_epoch=True, batch_size=size)
        results.update_metrics("training_step.loss", torch.tensor(value), batch_size=size)
    epoch = float(results["training_step.loss"].compute())
    pinned(REPLAY_LOGS, epoch == pytest.approx((2.0 * 3 + 4.0) / 4), "_ResultMetric", f"a weighted mean: {epoch}")


def test_fsdp1_precision_still_refuses_norm_clipping() -> None:
    from lightning.fabric.utilities.exceptions import MisconfigurationException
    from lightning.pytorch.plugins.precision import FSDPPrecision, Precision

    with pytest.raises(MisconfigurationException, match="gradient_clip_algorithm='norm'"):
        FSDPPrecision("32-true").clip_grad_by_norm(torch.optim.SGD([nn.Parameter(torch.ones(1))]), 1.0)
    source_says(CLIP, Precision.clip_gradients, "self.clip_grad_by_norm(", "Precision.clip_gradients")


class _Sees(Callback):
    """Records, during the fit, what the seam touched, and the batch each train batch's hooks see."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, int, bool]] = []  # batch_idx, the seam's position of it, and padding_step

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.during = (set(vars(pl_module)), [type(c).__name__ for c in trainer.callbacks], list(warnings.filters))

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: object, batch_idx: int) -> None:
        strategy = trainer.strategy
        self.batches.append((batch_idx, strategy._windows.seam.batch.position, strategy.padding_step))  # type: ignore[attr-defined]


def test_every_touch_is_made_at_setup_and_undone_at_teardown(one_process_group):
    import lightning_weighted  # noqa: F401  (registers the strategy names)

    module, sees, before = BoringModel(), _Sees(), list(warnings.filters)
    trainer = Trainer(
        strategy="ddp_weighted", accelerator="cpu", devices=1, max_steps=2, limit_val_batches=1, callbacks=[sees],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    callbacks = list(trainer.callbacks)
    trainer.fit(module)
    attributes, names, filters = sees.during
    assert {"on_train_batch_start", "lr_scheduler_step"} <= attributes  # EPOCH_END, SCHEDULERS
    assert names[0] == "Seam"  # BATCHES: first, before the user's callbacks
    assert sees.batches == [(0, 0, False), (1, 1, False)]  # each batch begun before a callback of the user's sees it
    assert len(filters) == len(before) + 1  # SAMPLER_WARNING
    assert not {"on_train_batch_start", "lr_scheduler_step", "log"} & set(vars(module))  # the module as it was
    assert trainer.callbacks == callbacks and warnings.filters == before
    assert isinstance(trainer.strategy._windows.seam, Seam)


def test_patched_sets_methods_on_the_instance_only_and_puts_back_what_was_there_also_on_an_error() -> None:
    class Module(nn.Module):
        def hook(self) -> str:
            return "own"

    module, other = Module(), Module()
    module.kept = lambda: "instance's own"  # type: ignore[attr-defined]
    with patched(module, hook=lambda: "patched", kept=lambda: "patched too"):
        inside = (module.hook(), module.kept(), other.hook()) == ("patched", "patched too", "own")  # type: ignore[operator]
        pinned("patched", inside, "nn.Module.__setattr__", "the instance's methods are set, no other's")
        pinned("patched", Module.hook(module) == "own", "nn.Module.__setattr__", "the class is untouched")
    after = module.hook() == "own" and "hook" not in vars(module) and module.kept() == "instance's own"  # type: ignore[operator]
    pinned("patched", after, "nn.Module.__dict__", "what the instance had is put back, nothing else left")

    with pytest.raises(KeyError), patched(module, hook=lambda: "patched"):
        raise KeyError("inside")
    pinned("patched", module.hook() == "own" and "hook" not in vars(module), "nn.Module.__dict__", "on an error")


def test_silenced_ignores_exactly_the_matching_warning_for_the_block() -> None:
    from lightning.pytorch.trainer.connectors import data_connector
    from lightning.pytorch.utilities import rank_zero_warn
    from lightning.pytorch.utilities.warnings import PossibleUserWarning

    text = "Using `DistributedSampler` with the dataloaders"  # what the Trainer strategies silence
    source_says(SAMPLER_WARNING, data_connector, f'f"{text}.', "data_connector's DistributedSampler warning")
    source_says(SAMPLER_WARNING, data_connector, "category=PossibleUserWarning", "data_connector's warning category")

    def shown(message: str, category: type[Warning]) -> bool:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with _silenced(text, PossibleUserWarning):
                rank_zero_warn(message, category=category)
            return bool(caught)

    pinned(SAMPLER_WARNING, not shown(f"{text}. During `trainer.validate()`", PossibleUserWarning), "warnings.filters")
    pinned(SAMPLER_WARNING, shown(f"{text}. During", UserWarning), "warnings.filters", "another category is shown")
    pinned(SAMPLER_WARNING, shown(f"Not {text}", PossibleUserWarning), "warnings.filters", "matched at the start only")
    pinned(SAMPLER_WARNING, shown("another warning", PossibleUserWarning), "warnings.filters", "another is shown")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        before = list(warnings.filters)
        with _silenced(text, PossibleUserWarning):
            rank_zero_warn(f"{text}. Inside", category=PossibleUserWarning)
        pinned(SAMPLER_WARNING, warnings.filters == before, "warnings.filters", "its filter is gone after the block")
        with pytest.raises(KeyError), _silenced(text, PossibleUserWarning):
            raise KeyError("inside")
        pinned(SAMPLER_WARNING, warnings.filters == before, "warnings.filters", "its filter is gone after an error")
        rank_zero_warn(f"{text}. After", category=PossibleUserWarning)
    messages = [str(warning.message) for warning in caught]
    pinned(
        SAMPLER_WARNING, messages == [f"{text}. After"], "warnings.filters", f"shown again after the block: {messages}"
    )
