"""Pins every entry of ``lightning_weighted._compat``: the private symbol it rests on, and the behaviour relied on.

Each test checks that the Lightning or PyTorch symbol is still there with the shape the package uses, then runs the
entry on the CPU in this one process. A failure names the entry and the symbol (``_compat.<entry>: <symbol>
changed ...``), so a release that moves one says what moved.
"""

from __future__ import annotations

import contextlib
import inspect
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Callback
from pinning import VERSIONS, Pins
from torch import Tensor, nn
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

from lightning_weighted import _compat

PINS = Pins("_compat.")
pinned, exercising, source_says = PINS.pinned, PINS.exercising, PINS.source_says
PINNED: set[str] = set()  # the entries a test of this file pins (checked against `_compat.__all__`)
MISSING = object()


def pins(*entries: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Marks a test as the pin of ``entries``."""
    PINNED.update(entries)
    return lambda test: test


def attribute(entry: str, owner: Any, name: str, where: str) -> Any:
    """``owner.<name>``, which must exist."""
    value = getattr(owner, name, MISSING)
    pinned(entry, value is not MISSING, f"{where}.{name}", "it is gone")
    return value


def takes(entry: str, function: Callable[..., Any], names: list[str], symbol: str) -> None:
    """``function`` takes the parameters ``names``, in that order (others may follow)."""
    parameters = [name for name in inspect.signature(function).parameters if name != "self"]
    pinned(entry, parameters[: len(names)] == names, symbol, f"parameters {parameters}, expected {names} first")


def test_every_entry_of_compat_is_pinned_here() -> None:
    exported = set(_compat.__all__)
    assert exported == PINNED, (
        f"_compat.__all__ and the pins of tests/unit/test_compat.py differ: not pinned {sorted(exported - PINNED)},"
        f" pinned but not exported {sorted(PINNED - exported)}"
    )
    for name in exported:
        assert hasattr(_compat, name), f"_compat.__all__ names {name!r}, which _compat does not define"


# --------------------------------------------------------------------------------------- Lightning's types


@pins("StrategyRegistry")
def test_strategy_registry_is_lightnings_registry_type_and_registers_with_init_params() -> None:
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.fabric.strategies import registry as fabric_registry
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.strategies import StrategyRegistry as TrainerRegistry

    symbol = "lightning.fabric.strategies.registry._StrategyRegistry"
    cls = attribute("StrategyRegistry", fabric_registry, "_StrategyRegistry", "lightning.fabric.strategies.registry")
    pinned("StrategyRegistry", _compat.StrategyRegistry is cls, symbol)
    pinned("StrategyRegistry", isinstance(TrainerRegistry, cls), symbol, "the Trainer's registry is not one")
    pinned("StrategyRegistry", isinstance(STRATEGY_REGISTRY, cls), symbol, "Fabric's registry is not one")
    takes("StrategyRegistry", cls.register, ["name", "strategy", "description", "override"], f"{symbol}.register")
    takes("StrategyRegistry", DDPStrategy.register_strategies, ["strategy_registry"], "Strategy.register_strategies")

    registry = cls()
    with exercising("StrategyRegistry", f"{symbol}.register"):
        for _ in range(2):  # `override=True`: a second import registers the same name again
            registry.register("x_weighted", DDPStrategy, description="d", override=True, start_method="spawn")
        entry = registry["x_weighted"]
    pinned("StrategyRegistry", entry["strategy"] is DDPStrategy, symbol, f"a registered entry reads {entry}")
    pinned("StrategyRegistry", entry["init_params"] == {"start_method": "spawn"}, symbol, f"init_params {entry}")
    pinned("StrategyRegistry", entry["description"] == "d", symbol, f"description {entry}")


@pins("register")
def test_register_registers_each_name_with_its_keyword_arguments_and_again_on_reimport() -> None:
    from lightning.fabric.strategies.registry import _StrategyRegistry
    from lightning.pytorch.strategies import DDPStrategy

    symbol = "lightning.fabric.strategies.registry._StrategyRegistry"
    takes("register", _StrategyRegistry.get, ["name", "default"], f"{symbol}.get")
    registry = _StrategyRegistry()
    names = [("x_weighted", {}), ("x_weighted_spawn", {"start_method": "spawn"})]
    with exercising("register", f"{symbol}.register"):
        for _ in range(2):  # importing twice leaves the registry as it was (`override=True`)
            _compat.register(registry, DDPStrategy, "Count-weighted", *names)
    pinned("register", sorted(registry) == ["x_weighted", "x_weighted_spawn"], f"{symbol}.register", f"{registry}")
    spawn = registry["x_weighted_spawn"]
    pinned("register", spawn["init_params"] == {"start_method": "spawn"}, f"{symbol}.register", f"init_params {spawn}")
    pinned("register", spawn["description"] == "Count-weighted (start_method='spawn')", f"{symbol}.register")
    pinned("register", registry["x_weighted"]["description"] == "Count-weighted", f"{symbol}.register")
    # Lightning builds a named strategy from the registry with the registered keyword arguments.
    with exercising("register", f"{symbol}.get"):
        built = registry.get("x_weighted_spawn")
    pinned("register", type(built) is DDPStrategy, f"{symbol}.get", f"built {type(built).__name__}")
    pinned("register", getattr(built, "_start_method", None) == "spawn", f"{symbol}.get", "the init_params")


@pins("unfloored")
def test_unfloored_turns_integer_tensors_to_float64_only_for_the_mean_lightnings_logging_asks_for() -> None:
    from lightning.pytorch.trainer.connectors.logger_connector import result

    # Lightning's logging syncs its integer batch-size sum with the op named after `reduce_fx` ("mean"), which
    # floors an integer mean (Lightning issue #21859): what the strategies' reduce passes through `unfloored`.
    source_says("unfloored", result._Metadata.sync.fset, "sync.op = self.reduce_fx.__name__", "_Metadata.sync")
    source_says("unfloored", result._ResultMetric, '"cumulated_batch_size", torch.tensor(0)', "_ResultMetric")
    source_says("unfloored", result._ResultMetric.compute, "self.meta.sync(self.cumulated_batch_size)", "compute")
    pinned("unfloored", torch.mean.__name__ == "mean", "torch.mean.__name__")
    # ... and `_sync_ddp` takes "mean" for "avg", and copies an integer mean back into the integer tensor (floored).
    from lightning.fabric.utilities import distributed

    sync = attribute("unfloored", distributed, "_sync_ddp", "lightning.fabric.utilities.distributed")
    source_says("unfloored", sync, 'reduce_op = "avg" if reduce_op == "mean" else reduce_op', "_sync_ddp")
    source_says("unfloored", sync, "result.copy_(result / world_size)", "_sync_ddp (the floored integer mean)")

    for op in ["mean", "avg", "MEAN", "Avg"]:
        for dtype in (torch.int64, torch.int32):
            out = _compat.unfloored(torch.tensor([7], dtype=dtype), op)
            exact = out.dtype == torch.float64 and out.tolist() == [float(torch.tensor([7], dtype=dtype).item())]
            pinned("unfloored", exact, "Lightning's integer mean", f"{dtype} under {op!r} gave {out!r}")
    integers, floats = torch.tensor([7]), torch.tensor([7.0])
    for op in ["sum", "max", dist.ReduceOp.SUM, None]:
        pinned("unfloored", _compat.unfloored(integers, op) is integers, "Lightning's reduce", f"{op!r}: not a mean")
    for op in ["mean", "sum", dist.ReduceOp.AVG]:
        pinned("unfloored", _compat.unfloored(floats, op) is floats, "Lightning's reduce", f"{op!r}: a float tensor")


def test_unfloored_also_unfloors_an_integer_mean_asked_for_by_the_reduce_op_enum() -> None:
    pinned("unfloored", _compat.unfloored(torch.tensor([7]), dist.ReduceOp.AVG).dtype == torch.float64, "ReduceOp.AVG")
    pinned("unfloored", _compat.unfloored(torch.tensor([7]), dist.ReduceOp.SUM).dtype == torch.int64, "ReduceOp.SUM")


@pins("BackwardSyncControl")
def test_backward_sync_control_is_the_abstract_control_fabric_asks_its_strategy_for() -> None:
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy
    from lightning.fabric.strategies import strategy as fabric_strategy

    symbol = "lightning.fabric.strategies.strategy._BackwardSyncControl"
    cls = attribute("BackwardSyncControl", fabric_strategy, "_BackwardSyncControl", "lightning.fabric.strategies")
    pinned("BackwardSyncControl", _compat.BackwardSyncControl is cls, symbol)
    pinned("BackwardSyncControl", cls.__abstractmethods__ == {"no_backward_sync"}, symbol, "its abstract methods")
    takes("BackwardSyncControl", cls.no_backward_sync, ["module", "enabled"], f"{symbol}.no_backward_sync")
    source_says(
        "BackwardSyncControl",
        Fabric.no_backward_sync,
        "self._strategy._backward_sync_control.no_backward_sync(",
        "Fabric.no_backward_sync (through Strategy._backward_sync_control)",
    )
    strategy = ModelParallelStrategy(parallelize_fn=lambda module, mesh: module)
    control = attribute("BackwardSyncControl", strategy, "_backward_sync_control", "ModelParallelStrategy")
    pinned("BackwardSyncControl", isinstance(control, cls), "ModelParallelStrategy._backward_sync_control")

    class Marking(_compat.BackwardSyncControl):
        def __init__(self) -> None:
            self.calls: list[bool] = []

        def no_backward_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager[None]:
            self.calls.append(enabled)
            return contextlib.nullcontext()

    marking = Marking()
    strategy._backward_sync_control = marking  # what the Fabric FSDP2 strategy does
    with strategy._backward_sync_control.no_backward_sync(nn.Linear(1, 1), True):
        pass
    pinned("BackwardSyncControl", marking.calls == [True], "Strategy._backward_sync_control", "the control asked")


# --------------------------------------------------------------------------------------- the Trainer's loaders


@pins("LOADER_BARRIERS")
def test_loader_barriers_are_the_names_lightning_passes_right_before_it_processes_each_stages_loaders() -> None:
    from lightning.pytorch.loops import evaluation_loop, fit_loop
    from lightning.pytorch.trainer.states import RunningStage

    expected = {"train_dataloader()": "train", "val_dataloader()": "val", "test_dataloader()": "test"}
    pinned("LOADER_BARRIERS", expected == _compat.LOADER_BARRIERS, "the loops' barrier names", "the entry itself")
    # Lightning's loops name the barrier (`trainer/connectors/data_connector.py` only processes the loaders).
    evaluation = 'trainer.strategy.barrier(f"{stage.dataloader_prefix}_dataloader()")'
    for module, call in [
        (fit_loop._FitLoop.setup_data, 'trainer.strategy.barrier("train_dataloader()")'),
        (evaluation_loop._EvaluationLoop.setup_data, evaluation),
    ]:
        source = inspect.getsource(module)
        where = f"{module.__qualname__} ({call})"
        pinned("LOADER_BARRIERS", call in source, where, "the barrier's name")
        pinned("LOADER_BARRIERS", source.find(call) < source.find("_process_dataloader("), where, "the order")
    prefixes = {stage: stage.dataloader_prefix for stage in RunningStage}
    for stage, prefix in [("VALIDATING", "val"), ("SANITY_CHECKING", "val"), ("TESTING", "test")]:
        pinned("LOADER_BARRIERS", prefixes[RunningStage[stage]] == prefix, f"RunningStage.{stage}.dataloader_prefix")

    # And in a run: each loader's processing comes right after the barrier LOADER_BARRIERS maps to its stage.
    from lightning.pytorch import Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.strategies import SingleDeviceStrategy

    class Recording(SingleDeviceStrategy):
        def __init__(self) -> None:
            super().__init__(device=torch.device("cpu"))
            self.last, self.seen = "", []  # the last barrier's name; (that name, the stage) of each loader

        def barrier(self, name: str | None = None) -> None:
            self.last = name or ""
            super().barrier(name)

        def process_dataloader(self, dataloader: object) -> object:
            stage = self.lightning_module.trainer.state.stage  # type: ignore[union-attr]
            self.seen.append((self.last, stage.dataloader_prefix))
            return super().process_dataloader(dataloader)

    strategy = Recording()
    trainer = Trainer(
        strategy=strategy, max_steps=1, limit_val_batches=1, limit_test_batches=1, num_sanity_val_steps=0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(BoringModel())
    trainer.test(BoringModel(), verbose=False)
    seen = strategy.seen
    mapped = all(_compat.LOADER_BARRIERS.get(name) == stage for name, stage in seen)
    pinned("LOADER_BARRIERS", mapped, "Strategy.barrier(name) before Strategy.process_dataloader", f"seen {seen}")
    pinned("LOADER_BARRIERS", {stage for _, stage in seen} == {"train", "val", "test"}, "the loops", f"seen {seen}")


@pins("set_sampler")
def test_set_sampler_swaps_the_sampler_of_a_built_loader_which_dataloader_refuses_to_set() -> None:
    data = list(range(6))

    def collate(batch: list[int]) -> list[int]:
        return batch

    loader = DataLoader(data, batch_size=2, collate_fn=collate)
    reverse = list(reversed(range(6)))
    with pytest.raises(ValueError, match="sampler"):  # why `set_sampler` goes past DataLoader.__setattr__
        loader.sampler = reverse  # type: ignore[assignment]
    with exercising("set_sampler", "DataLoader.batch_sampler.sampler"):
        _compat.set_sampler(loader, reverse)
    pinned("set_sampler", loader.sampler is reverse, "DataLoader.sampler")
    pinned("set_sampler", loader.batch_sampler.sampler is reverse, "BatchSampler.sampler")  # type: ignore[union-attr]
    same = (loader.batch_size, loader.collate_fn, loader.num_workers) == (2, collate, 0)
    pinned("set_sampler", same, "DataLoader", "batch_size, collate_fn and num_workers are kept")
    pinned("set_sampler", list(loader) == [[5, 4], [3, 2], [1, 0]], "DataLoader's index sampler", "iteration order")

    unbatched = DataLoader(data, batch_size=None)  # no batch sampler: the sampler yields the indices itself
    _compat.set_sampler(unbatched, reverse)
    pinned("set_sampler", [int(x) for x in unbatched] == reverse, "DataLoader._index_sampler", "without batches")

    kept = DataLoader(data, batch_size=2, collate_fn=collate)
    own = kept.sampler
    with exercising("set_sampler", "DataLoader.batch_sampler.sampler"):
        _compat.set_sampler(kept, reverse, keep=True)  # only in the batch sampler
    pinned("set_sampler", kept.sampler is own, "DataLoader.sampler", "keep=True replaced it")
    pinned("set_sampler", kept.batch_sampler.sampler is reverse, "BatchSampler.sampler")  # type: ignore[union-attr]
    pinned("set_sampler", list(kept) == [[5, 4], [3, 2], [1, 0]], "DataLoader.batch_sampler", "iteration order")


@pins("set_sampler")
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")  # torchdata 0.11's, on torch 2.13
def test_set_sampler_keeps_a_stateful_loaders_sampler_whose_batch_sampler_holds_lightnings() -> None:
    from lightning.pytorch.utilities.data import _update_dataloader
    from torch.utils.data import DistributedSampler
    from torchdata.stateful_dataloader import StatefulDataLoader

    # Lightning rebuilds a StatefulDataLoader around its DistributedSampler, which torchdata keeps in the batch
    # sampler alone: `loader.sampler` is another one, the loader iterates the batch sampler's (why `keep=True`).
    data = list(range(6))
    inserted = DistributedSampler(data, num_replicas=2, rank=0, shuffle=False)
    loader = _update_dataloader(StatefulDataLoader(data, batch_size=2), inserted)
    batches = loader.batch_sampler
    symbol = "torchdata StatefulDataLoader.batch_sampler.sampler"
    pinned("set_sampler", batches.sampler is inserted and loader.sampler is not inserted, symbol, "where it is")
    pinned("set_sampler", [b.tolist() for b in loader] == [[0, 2], [4]], symbol, "the sampler it iterates")
    own, reverse = loader.sampler, [5, 3, 1]
    with exercising("set_sampler", symbol):
        _compat.set_sampler(loader, reverse, keep=True)
    pinned("set_sampler", loader.sampler is own and batches.sampler is reverse, symbol, "what was replaced")
    pinned("set_sampler", [b.tolist() for b in loader] == [[5, 3], [1]], symbol, "the replaced sampler iterates")


@pins("rebuild_loader")
def test_rebuild_loader_builds_the_loader_again_around_the_new_sampler_and_batch_sampler() -> None:
    from lightning.pytorch.utilities import data as lightning_data

    symbol = "lightning.pytorch.utilities.data._update_dataloader"
    update = attribute("rebuild_loader", lightning_data, "_update_dataloader", "lightning.pytorch.utilities.data")
    takes("rebuild_loader", update, ["dataloader", "sampler"], symbol)

    def collate(batch: list[int]) -> list[int]:
        return batch

    class Batches(BatchSampler):  # a custom batch sampler: why `data.py` rebuilds instead of swapping
        pass

    data = list(range(6))
    reverse = list(reversed(range(6)))
    loader = DataLoader(data, batch_size=2, collate_fn=collate, num_workers=0)
    custom = DataLoader(data, batch_sampler=Batches(SequentialSampler(data), 3, False), collate_fn=collate)
    with exercising("rebuild_loader", symbol):
        rebuilt = _compat.rebuild_loader(loader, reverse)
        rebuilt_custom = _compat.rebuild_loader(custom, reverse)
    pinned("rebuild_loader", rebuilt is not loader and type(rebuilt) is DataLoader, symbol, "a new DataLoader")
    pinned("rebuild_loader", rebuilt.sampler is reverse, symbol, "the sampler")
    same = (rebuilt.batch_size, rebuilt.collate_fn, rebuilt.num_workers) == (2, collate, 0)
    pinned("rebuild_loader", same, symbol, "batch_size, collate_fn and num_workers are kept")
    pinned("rebuild_loader", list(rebuilt) == [[5, 4], [3, 2], [1, 0]], symbol, "iteration order")
    batches = rebuilt_custom.batch_sampler
    pinned("rebuild_loader", type(batches) is Batches and batches.sampler is reverse, symbol, "the batch sampler")
    pinned("rebuild_loader", list(rebuilt_custom) == [[5, 4, 3], [2, 1, 0]], symbol, "custom batches' order")


@pins("augment_message")
def test_augment_message_replaces_a_matching_message_of_an_exception() -> None:
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.utilities import exceptions

    symbol = "lightning.pytorch.utilities.exceptions._augment_message"
    augment = attribute("augment_message", exceptions, "_augment_message", "lightning.pytorch.utilities.exceptions")
    takes("augment_message", augment, ["exception", "pattern", "new_message"], symbol)
    source_says("augment_message", DDPStrategy.on_exception, "_augment_message(", "DDPStrategy.on_exception")

    pattern = ".*Expected to have finished reduction in the prior iteration.*"  # what `WeightedDDPStrategy` passes
    error = RuntimeError("DDP:\nExpected to have finished reduction in the prior iteration before starting", 3)
    with exercising("augment_message", symbol):
        _compat.augment_message(error, pattern, "use find_unused_parameters")
    pinned("augment_message", error.args == ("use find_unused_parameters", 3), symbol, f"args {error.args}")
    other = RuntimeError("something else")
    _compat.augment_message(other, pattern, "use find_unused_parameters")
    pinned("augment_message", other.args == ("something else",), symbol, "a message that does not match is kept")


@pins("forward_redirection")
def test_forward_redirection_runs_a_method_of_the_module_through_its_wrappers_forward() -> None:
    from lightning.pytorch.strategies import SingleDeviceStrategy, Strategy
    from lightning.pytorch.strategies import strategy as strategy_module

    symbol = "lightning.pytorch.strategies.Strategy._forward_redirection"
    strategy = SingleDeviceStrategy(device=torch.device("cpu"))
    redirection = attribute("forward_redirection", strategy, "_forward_redirection", "Strategy")
    cls = attribute("forward_redirection", strategy_module, "_ForwardRedirection", "lightning.pytorch.strategies")
    pinned("forward_redirection", isinstance(redirection, cls), symbol, f"it is a {type(redirection).__name__}")
    takes("forward_redirection", cls.__call__, ["wrapper_module", "original_module", "method_name"], symbol)
    source_says("forward_redirection", Strategy.training_step, "self._forward_redirection(self.model", symbol)

    class Inner(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x + 100

        def training_step(self, x: Tensor, y: Tensor) -> Tensor:
            return x * y

    class Wrapper(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner, self.calls = inner, 0

        def forward(self, *args: Any) -> Any:
            self.calls += 1  # FSDP1's root gathers its parameters here
            return self.inner(*args)

    inner = Inner()
    wrapper = Wrapper(inner)
    with exercising("forward_redirection", symbol):
        out = _compat.forward_redirection(
            strategy, wrapper, inner, "training_step", torch.tensor(3.0), torch.tensor(4.0)
        )
    pinned("forward_redirection", float(out) == 12.0 and wrapper.calls == 1, symbol, "through the wrapper's forward")
    pinned("forward_redirection", float(inner(torch.tensor(1.0))) == 101.0, symbol, "the module's forward is put back")


@pins("join_enabled")
def test_join_enabled_reads_ddps_join_config(one_rank: None) -> None:
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel

    pinned("join_enabled", _compat.join_enabled(nn.Linear(2, 2)) is False, "_join_config", "a plain module")
    ddp = DistributedDataParallel(nn.Linear(2, 2))
    config = attribute("join_enabled", ddp, "_join_config", "DistributedDataParallel")
    attribute("join_enabled", config, "enable", "DistributedDataParallel._join_config")
    pinned("join_enabled", _compat.join_enabled(ddp) is False, "DistributedDataParallel._join_config.enable")
    with exercising("join_enabled", "DistributedDataParallel._join_config"), Join([ddp]):
        pinned("join_enabled", _compat.join_enabled(ddp) is True, "DistributedDataParallel._join_config.enable")
    with ddp.join(enable=False):
        pinned("join_enabled", _compat.join_enabled(ddp) is False, "DistributedDataParallel._join_config.enable")


# --------------------------------------------------------------------------------------- tensors and metrics


@pins("multiply")
def test_multiply_multiplies_a_list_of_tensors_in_place_by_a_tensor_or_a_float() -> None:
    attribute("multiply", torch, "_foreach_mul_", "torch")
    tensors = [torch.ones(3), torch.full((2, 2), 2.0)]
    storages = [t.data_ptr() for t in tensors]
    with exercising("multiply", "torch._foreach_mul_"):
        _compat.multiply(tensors, torch.tensor(0.5, dtype=torch.float64))  # the loop's float64 factor (0-d)
    pinned("multiply", [t.data_ptr() for t in tensors] == storages, "torch._foreach_mul_", "not in place")
    pinned("multiply", all(t.dtype == torch.float32 for t in tensors), "torch._foreach_mul_", "the dtype changed")
    halved = torch.equal(tensors[0], torch.full((3,), 0.5)) and torch.equal(tensors[1], torch.ones(2, 2))
    pinned("multiply", halved, "torch._foreach_mul_", "by a 0-dim float64 tensor")
    _compat.multiply(tensors, 4.0)
    quadrupled = torch.equal(tensors[0], torch.full((3,), 2.0)) and torch.equal(tensors[1], torch.full((2, 2), 4.0))
    pinned("multiply", quadrupled, "torch._foreach_mul_", "by a float")
    halves = [torch.ones(2, dtype=torch.bfloat16)]
    _compat.multiply(halves, torch.tensor(0.25, dtype=torch.float64))
    pinned("multiply", torch.equal(halves[0], torch.full((2,), 0.25, dtype=torch.bfloat16)), "torch._foreach_mul_")


@pins("metric_snapshot", "metric_restore")
def test_metric_snapshot_and_restore_undo_updates_their_count_and_the_cached_result() -> None:
    from torchmetrics import Metric
    from torchmetrics.aggregation import CatMetric, MeanMetric

    for name in ["_update_count", "_computed"]:
        pinned("metric_snapshot", name in vars(MeanMetric()), f"torchmetrics.Metric.{name}", "it is gone")
    pinned("metric_snapshot", isinstance(getattr(Metric, "metric_state", None), property), "Metric.metric_state")

    mean = MeanMetric()
    mean.update(torch.tensor([1.0, 2.0]))
    mean.update(torch.tensor(3.0))
    computed = mean.compute()
    snapshot = _compat.metric_snapshot(mean)
    mean.update(torch.tensor(100.0))  # a replay's update
    pinned("metric_snapshot", mean._update_count == 3, "torchmetrics.Metric._update_count", "counts the updates")
    with exercising("metric_restore", "torchmetrics.Metric._update_count"):
        _compat.metric_restore(mean, snapshot)
    pinned("metric_restore", mean._update_count == 2, "torchmetrics.Metric._update_count", "put back")
    pinned("metric_restore", mean._computed is computed, "torchmetrics.Metric._computed", "put back")
    mean.reset()
    mean.update(torch.tensor([1.0, 2.0, 3.0]))
    pinned("metric_restore", float(mean.compute()) == 2.0, "torchmetrics.Metric.metric_state", "restored state works")

    mean = MeanMetric()
    mean.update(torch.tensor([1.0, 3.0]))
    snapshot = _compat.metric_snapshot(mean)
    mean.update(torch.tensor(100.0))
    _compat.metric_restore(mean, snapshot)
    pinned("metric_restore", float(mean.compute()) == 2.0, "torchmetrics.Metric.metric_state", "the mean is undone")

    cat = CatMetric()  # a list state
    cat.update(torch.tensor([1.0, 2.0]))
    snapshot = _compat.metric_snapshot(cat)
    cat.update(torch.tensor([9.0]))
    _compat.metric_restore(cat, snapshot)
    pinned("metric_restore", cat.compute().tolist() == [1.0, 2.0], "Metric.metric_state", "a list state is undone")
    pinned("metric_restore", cat._update_count == 1, "torchmetrics.Metric._update_count", "of a list state")


# --------------------------------------------------------------------------------------- FSDP and collectives


@pins("move_metrics", "setup_checkpointing")
def test_move_metrics_and_setup_checkpointing_are_lightnings_fsdp1_setup_functions() -> None:
    from lightning.fabric.strategies import fsdp
    from lightning.pytorch.strategies import FSDPStrategy
    from torchmetrics.aggregation import MeanMetric

    symbols = {
        "move_metrics": ("_move_torchmetrics_to_device", ["module", "device"]),
        "setup_checkpointing": ("_setup_activation_checkpointing", ["module"]),
    }
    for entry, (name, parameters) in symbols.items():
        helper = getattr(_compat, entry)
        pinned(entry, callable(helper), f"lightning.fabric.strategies.fsdp.{name}")
        pinned(entry, helper is getattr(fsdp, name, None), f"lightning.fabric.strategies.fsdp.{name}")
        takes(entry, helper, parameters, f"lightning.fabric.strategies.fsdp.{name}")
        source_says(entry, FSDPStrategy._setup_model, f"{name}(", "FSDPStrategy._setup_model")
    # The package passes the strategy's own checkpointing arguments (`WeightedFSDPStrategy`).
    kwargs = attribute("setup_checkpointing", FSDPStrategy(), "_activation_checkpointing_kwargs", "FSDPStrategy")
    pinned("setup_checkpointing", kwargs == {}, "FSDPStrategy._activation_checkpointing_kwargs", f"{kwargs}")

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    model = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 1))
    model.metric = MeanMetric()
    with exercising("move_metrics", "lightning.fabric.strategies.fsdp helpers"):
        _compat.move_metrics(model, torch.device("cpu"))
        _compat.setup_checkpointing(model, {})  # nothing configured: nothing done
        none = not any(isinstance(m, CheckpointWrapper) for m in model.modules())
        pinned("setup_checkpointing", none, "_setup_activation_checkpointing", "with no arguments, nothing")
        _compat.setup_checkpointing(model, {"check_fn": lambda m: isinstance(m, nn.Linear)})
    wrapped = [m for m in model.modules() if isinstance(m, CheckpointWrapper)]
    pinned("setup_checkpointing", len(wrapped) == 2, "_setup_activation_checkpointing", "wraps the chosen layers")
    pinned("move_metrics", model.metric.device.type == "cpu", "_move_torchmetrics_to_device")


@pins("reduce_scatter")
def test_reduce_scatter_sums_into_the_output_synchronously_and_asynchronously(one_rank: None) -> None:
    single = getattr(dist, "reduce_scatter_single", None)
    tensor = getattr(dist, "reduce_scatter_tensor", None)
    pinned("reduce_scatter", single or tensor, "torch.distributed.reduce_scatter_single/reduce_scatter_tensor")
    # the branch of torch 2.13 on calls the newer name, the one of 2.9-2.12 the older
    newer = _compat.TORCH < (2, 13) or single is not None
    pinned("reduce_scatter", newer, "torch.distributed.reduce_scatter_single", "it is gone")
    for name, function in [("reduce_scatter_single", single), ("reduce_scatter_tensor", tensor)]:
        if function is not None:  # called by keyword (the first) or by position (the second)
            takes("reduce_scatter", function, ["output", "input", "op", "group", "async_op"], f"dist.{name}")

    output, source = torch.zeros(3), torch.arange(3.0)
    with exercising("reduce_scatter", "torch.distributed.reduce_scatter_single"):
        result = _compat.reduce_scatter(output, source, dist.group.WORLD, dist.ReduceOp.SUM)
    pinned("reduce_scatter", result is None and torch.equal(output, source), "dist.reduce_scatter_single", "SUM")
    with exercising("reduce_scatter", "torch.distributed.reduce_scatter_single"):
        work = _compat.reduce_scatter(output, source * 2, None, dist.ReduceOp.SUM, async_op=True)
        work.wait()
    pinned("reduce_scatter", torch.equal(output, source * 2), "dist.reduce_scatter_single", "async_op=True")


@pins("flatten_mesh")
def test_flatten_mesh_gives_one_dimension_over_several_of_a_device_mesh(one_rank: None) -> None:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    attribute("flatten_mesh", DeviceMesh, "_flatten", "torch.distributed.device_mesh.DeviceMesh")
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    with exercising("flatten_mesh", "DeviceMesh._flatten"):
        flat = _compat.flatten_mesh(mesh, ("replicate", "shard"))
        group = flat.get_group()
    pinned("flatten_mesh", isinstance(flat, DeviceMesh) and flat.ndim == 1, "DeviceMesh._flatten", f"gave {flat}")
    pinned("flatten_mesh", dist.get_world_size(group) == 1, "DeviceMesh._flatten", "its group")


def before(release: tuple[int, int]) -> pytest.MarkDecorator:
    """Skips a test of a version branch for torch older than ``release`` where the installed torch is not."""
    needed = ".".join(map(str, release))
    return pytest.mark.skipif(release <= _compat.TORCH, reason=f"a branch for torch < {needed}; {VERSIONS}")


def since(release: tuple[int, int]) -> pytest.MarkDecorator:
    """Skips a test of a version branch for torch ``release`` and later where the installed torch is older."""
    needed = ".".join(map(str, release))
    return pytest.mark.skipif(release > _compat.TORCH, reason=f"a branch for torch >= {needed}; {VERSIONS}")


def fsdp2_linear(**kwargs: Any) -> nn.Module:
    """An ``nn.Linear(2, 2)`` sharded by FSDP2 over a one-rank mesh (``kwargs`` go to ``fully_shard``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    module = nn.Linear(2, 2)
    fully_shard(module, mesh=init_device_mesh("cpu", (1,)), **kwargs)
    return module


@pins("fsdp2_param_groups")
def test_fsdp2_param_groups_exposes_each_groups_parameters_and_mesh_info(one_rank: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    symbol = "FSDPModule._get_fsdp_state()._fsdp_param_group(s)"
    attribute("fsdp2_param_groups", FSDPModule, "_get_fsdp_state", "torch.distributed.fsdp.FSDPModule")
    module = fsdp2_linear()
    with exercising("fsdp2_param_groups", symbol):
        groups = _compat.fsdp2_param_groups(module)
    pinned("fsdp2_param_groups", isinstance(groups, list) and len(groups) == 1, symbol, f"gave {groups!r}")
    group = groups[0]
    params = [param.sharded_param for param in attribute("fsdp2_param_groups", group, "fsdp_params", symbol)]
    pinned("fsdp2_param_groups", params == list(module.parameters()), f"{symbol}[i].fsdp_params")
    mesh_info = attribute("fsdp2_param_groups", group, "mesh_info", symbol)
    # `engines/fsdp2.py` reads these through getattr with a default of 1: they must be there to mean anything.
    pinned("fsdp2_param_groups", getattr(mesh_info, "shard_mesh_size", None) == 1, f"{symbol}[i].mesh_info")

    hybrid = nn.Linear(2, 2)
    fully_shard(hybrid, mesh=init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard")))
    info = _compat.fsdp2_param_groups(hybrid)[0].mesh_info
    sizes = (getattr(info, "replicate_mesh_size", None), getattr(info, "shard_mesh_size", None))
    pinned("fsdp2_param_groups", sizes == (1, 1), f"{symbol}[i].mesh_info.replicate_mesh_size", f"HSDP: {sizes}")

    empty = nn.Sequential(nn.ReLU())
    fully_shard(empty, mesh=init_device_mesh("cpu", (1,)))
    pinned("fsdp2_param_groups", _compat.fsdp2_param_groups(empty) == [], symbol, "a module without parameters")


@pins("fsdp2_shard_sizes")
def test_fsdp2_shard_sizes_are_the_shard_and_replicate_sizes_of_a_groups_mesh_info(one_rank: None) -> None:
    from types import SimpleNamespace

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    symbol = "FSDPParamGroup.mesh_info"
    info = attribute("fsdp2_shard_sizes", _compat.fsdp2_param_groups(fsdp2_linear())[0], "mesh_info", symbol)
    attribute("fsdp2_shard_sizes", info, "shard_mesh_size", f"{symbol} (FSDP)")
    hybrid = nn.Linear(2, 2)
    fully_shard(hybrid, mesh=init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard")))
    group = _compat.fsdp2_param_groups(hybrid)[0]
    attribute("fsdp2_shard_sizes", group.mesh_info, "shard_mesh_size", f"{symbol} (HSDP)")
    attribute("fsdp2_shard_sizes", group.mesh_info, "replicate_mesh_size", f"{symbol} (HSDP)")
    with exercising("fsdp2_shard_sizes", symbol):
        sizes = _compat.fsdp2_shard_sizes(group)
    pinned("fsdp2_shard_sizes", sizes == (1, 1), symbol, f"gave {sizes} on one rank")
    # which is which, on a stand-in of 4 shards and 2 replicas (one rank has 1 of each); FSDP's own replicates none
    hsdp = SimpleNamespace(shard_mesh_size=4, replicate_mesh_size=2)
    sizes = _compat.fsdp2_shard_sizes(SimpleNamespace(mesh_info=hsdp))
    pinned("fsdp2_shard_sizes", sizes == (4, 2), symbol, f"gave {sizes}")
    sizes = _compat.fsdp2_shard_sizes(SimpleNamespace(mesh_info=SimpleNamespace(shard_mesh_size=4)))
    pinned("fsdp2_shard_sizes", sizes == (4, 1), symbol, f"without replicas gave {sizes}")


@pins("fsdp2_param_groups")
@before((2, 12))
def test_fsdp2_param_groups_before_torch_2_12_is_the_states_one_group(one_rank: None) -> None:
    state = fsdp2_linear()._get_fsdp_state()
    symbol = "FSDPState._fsdp_param_group"
    pinned("fsdp2_param_groups", not hasattr(state, "_fsdp_param_groups"), "FSDPState._fsdp_param_groups", "is here")
    group = attribute("fsdp2_param_groups", state, "_fsdp_param_group", "FSDPState")
    pinned("fsdp2_param_groups", group is not None, symbol, "None for a module with parameters")


@pins("fsdp2_param_groups")
@since((2, 12))
def test_fsdp2_param_groups_from_torch_2_12_is_the_states_list_of_groups(one_rank: None) -> None:
    state = fsdp2_linear()._get_fsdp_state()
    groups = attribute("fsdp2_param_groups", state, "_fsdp_param_groups", "FSDPState")
    pinned("fsdp2_param_groups", isinstance(groups, list) and len(groups) == 1, "FSDPState._fsdp_param_groups")


@pins("fsdp2_policies")
@before((2, 15))
def test_fsdp2_policies_before_torch_2_15_are_the_groups_one_policy(one_rank: None) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    group = _compat.fsdp2_param_groups(fsdp2_linear(mp_policy=policy))[0]
    attribute("fsdp2_policies", group, "mp_policy", "FSDPParamGroup")
    with exercising("fsdp2_policies", "FSDPParamGroup.mp_policy"):
        policies = _compat.fsdp2_policies(group)
    pinned("fsdp2_policies", policies == [policy], "FSDPParamGroup.mp_policy", f"gave {policies}")


@pins("fsdp2_policies")
@since((2, 15))
def test_fsdp2_policies_from_torch_2_15_are_each_parameters_resolved_policy(one_rank: None) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    # 2.15 moved the policy from the group to each parameter: the bias keeps its float32 here, the weight does not
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        param_dtype_override_fn=lambda param: torch.float32 if param.ndim == 1 else None,
    )
    group = _compat.fsdp2_param_groups(fsdp2_linear(mp_policy=policy))[0]
    pinned("fsdp2_policies", not hasattr(group, "mp_policy"), "FSDPParamGroup.mp_policy", "is back: a group policy")
    with exercising("fsdp2_policies", "FSDPParam.mp_policy"):
        policies = _compat.fsdp2_policies(group)
    dtypes = [(p.param_dtype, p.reduce_dtype, p.param_dtype_override_fn) for p in policies]
    expected = [(torch.bfloat16, torch.float32, None), (torch.float32, torch.float32, None)]  # weight, bias
    pinned("fsdp2_policies", dtypes == expected, "FSDPParam.mp_policy", f"gave {dtypes}")


@pins("require_torch")
def test_require_torch_names_the_installed_and_the_needed_torch_and_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    _compat.require_torch(_compat.TORCH, "anything")  # the installed torch meets itself
    installed = torch.__version__
    monkeypatch.setattr(_compat, "TORCH", (2, 8))
    with pytest.raises(RuntimeError, match=rf"fsdp2 needs torch>=2\.9, and torch {re.escape(installed)} is installed"):
        _compat.require_torch((2, 9), "fsdp2")
    with pytest.raises(RuntimeError, match=r"Upgrade torch: `pip install 'torch>=2\.9'`"):
        _compat.require_torch((2, 9), "fsdp2")


@pins("require_torch")
def test_the_fsdp2_floor_is_the_first_torch_with_every_public_fsdp2_method_the_engine_calls() -> None:
    from torch.distributed.fsdp import FSDPModule

    from lightning_weighted.engines import fsdp2

    engine = inspect.getsource(fsdp2)
    called = {"set_all_reduce_hook", "set_gradient_divide_factor", "set_force_sum_reduction_for_comms"}
    called.add("set_custom_reduce_scatter")  # the latest of them: torch 2.9
    assert all(f"fsdp.{name}(" in engine for name in called)
    missing = sorted(name for name in called if not hasattr(FSDPModule, name))
    pinned("require_torch", not missing, "FSDPModule", f"lacks {missing} on the installed torch")
    assert _compat.TORCH >= _compat.FSDP2_TORCH == (2, 9)


@pins("flat_parameters")
def test_flat_parameters_lists_each_fsdp1_units_flat_parameter(one_rank: None) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    symbol = "FullyShardedDataParallel._flat_param"
    attribute("flat_parameters", FullyShardedDataParallel, "fsdp_modules", "FullyShardedDataParallel")
    # As `WeightedFSDPStrategy` wraps on the CPU; NO_SHARD, which FSDP1 switches to (with a warning) on one rank.
    kwargs: dict[str, Any] = {"device_id": torch.device("cpu"), "sharding_strategy": ShardingStrategy.NO_SHARD}
    inner = FullyShardedDataParallel(nn.Linear(2, 3), **kwargs)
    root = FullyShardedDataParallel(nn.Sequential(inner, nn.Linear(3, 1)), **kwargs)
    only = FullyShardedDataParallel(nn.Sequential(FullyShardedDataParallel(nn.Linear(2, 3), **kwargs)), **kwargs)
    with exercising("flat_parameters", symbol):
        flat = _compat.flat_parameters(root)
        nested = _compat.flat_parameters(only)
    pinned("flat_parameters", sorted(p.numel() for p in flat) == [4, 9], symbol, f"sizes {[p.numel() for p in flat]}")
    pinned("flat_parameters", all(isinstance(p, nn.Parameter) for p in flat), symbol, "not parameters")
    pinned("flat_parameters", only._flat_param is None and len(nested) == 1, symbol, "a unit without its own")
    pinned("flat_parameters", _compat.flat_parameters(nn.Linear(2, 2)) == [], "fsdp_modules", "a plain module")

    # The gradient accumulates on the flat parameter (where `engines/fsdp1.py` hooks its zeroing).
    root(torch.ones(1, 2)).sum().backward()
    pinned("flat_parameters", all(p.grad is not None for p in flat), f"{symbol}.grad", "no gradient reached it")


def test_pinned_names_the_entry_and_the_symbol_that_moved() -> None:
    with pytest.raises(pytest.fail.Exception, match=r"_compat\.multiply: torch\._foreach_mul_ changed \(gone\)"):
        pinned("multiply", False, "torch._foreach_mul_", "gone")
    moved = r"_compat\.flatten_mesh: DeviceMesh\._flatten changed \(AttributeError"
    with pytest.raises(pytest.fail.Exception, match=moved), exercising("flatten_mesh", "DeviceMesh._flatten"):
        raise AttributeError("_flatten")


# --------------------------------------------------------------------------------------- strategies' stored arguments


@pins("ddp_kwargs")
def test_ddp_kwargs_are_what_lightnings_ddp_strategy_passes_to_distributed_data_parallel() -> None:
    from lightning.pytorch.strategies import DDPStrategy

    strategy = DDPStrategy(static_graph=True, bucket_cap_mb=7)
    with exercising("ddp_kwargs", "DDPStrategy._ddp_kwargs"):
        kwargs = _compat.ddp_kwargs(strategy)
    pinned("ddp_kwargs", kwargs == {"static_graph": True, "bucket_cap_mb": 7}, "DDPStrategy._ddp_kwargs", f"{kwargs}")
    source_says("ddp_kwargs", DDPStrategy._setup_model, "**self._ddp_kwargs", "DDPStrategy._setup_model")


@pins("parallel_sizes", "set_parallel_sizes")
def test_parallel_sizes_are_read_and_set_where_model_parallel_strategy_builds_its_mesh() -> None:
    from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallel
    from lightning.pytorch.strategies import ModelParallelStrategy

    for cls, args in ((ModelParallelStrategy, ()), (FabricModelParallel, (lambda module, mesh: module,))):
        symbol = f"{cls.__module__}.ModelParallelStrategy._data_parallel_size/_tensor_parallel_size"
        strategy = cls(*args, data_parallel_size="auto", tensor_parallel_size=2)
        with exercising("parallel_sizes", symbol):
            sizes = _compat.parallel_sizes(strategy)
        pinned("parallel_sizes", sizes == ("auto", 2), symbol, f"read {sizes}")
        with exercising("set_parallel_sizes", symbol):
            _compat.set_parallel_sizes(strategy, 4, 2)
        pinned("set_parallel_sizes", _compat.parallel_sizes(strategy) == (4, 2), symbol)
        source_says("set_parallel_sizes", cls.setup_environment, "self._data_parallel_size", symbol)


@pins("fsdp1_options")
def test_fsdp1_options_are_the_state_dict_type_and_fsdp1_and_checkpointing_kwargs_fsdp_strategy_stores() -> None:
    from lightning.fabric.strategies import FSDPStrategy as FabricFSDPStrategy
    from lightning.pytorch.strategies import FSDPStrategy

    for cls, where, name in [
        (FSDPStrategy, "lightning.pytorch.strategies.FSDPStrategy", "kwargs"),
        (FabricFSDPStrategy, "lightning.fabric.strategies.FSDPStrategy", "_fsdp_kwargs"),
    ]:
        symbol = f"{where}._state_dict_type/.{name}/._activation_checkpointing_kwargs"
        strategy = cls(state_dict_type="sharded", activation_checkpointing_policy={nn.Linear}, limit_all_gathers=True)
        attribute("fsdp1_options", strategy, name, where)
        with exercising("fsdp1_options", symbol):
            state_dict_type, kwargs, checkpointing = _compat.fsdp1_options(strategy)
        pinned("fsdp1_options", state_dict_type == "sharded", symbol, f"state_dict_type {state_dict_type!r}")
        pinned("fsdp1_options", kwargs.get("limit_all_gathers") is True, f"{where}.{name}", f"kwargs {kwargs}")
        pinned("fsdp1_options", kwargs is getattr(strategy, name), f"{where}.{name}", "not the stored dict itself")
        pinned("fsdp1_options", isinstance(checkpointing, dict) and checkpointing, symbol, f"kwargs {checkpointing}")
    # each wraps the model with the FSDP1 keyword arguments it stores
    source_says("fsdp1_options", FSDPStrategy._setup_model, "**self.kwargs,", "FSDPStrategy._setup_model")
    source_says("fsdp1_options", FabricFSDPStrategy.setup_module, "**self._fsdp_kwargs,", "FSDPStrategy.setup_module")


@pins("set_backward_sync_control")
def test_set_backward_sync_control_replaces_what_fabric_no_backward_sync_asks_for() -> None:
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    class Marker(_compat.BackwardSyncControl):
        def no_backward_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager[None]:
            return contextlib.nullcontext()

    strategy, marker = ModelParallelStrategy(lambda module, mesh: module), Marker()
    with exercising("set_backward_sync_control", "Strategy._backward_sync_control"):
        _compat.set_backward_sync_control(strategy, marker)
    pinned("set_backward_sync_control", strategy._backward_sync_control is marker, "Strategy._backward_sync_control")
    source_says(
        "set_backward_sync_control", Fabric.no_backward_sync, "_backward_sync_control", "Fabric.no_backward_sync"
    )


@pins("combined_mode")
def test_combined_mode_is_the_mode_of_the_combined_loader_the_fit_loop_built() -> None:
    from lightning.pytorch.loops.fit_loop import _FitLoop
    from lightning.pytorch.utilities import CombinedLoader

    loader = CombinedLoader({"a": [1, 2], "b": [3]}, mode="min_size")
    with exercising("combined_mode", "CombinedLoader._mode"):
        mode = attribute("combined_mode", loader, "_mode", "CombinedLoader")
    pinned("combined_mode", mode == "min_size", "CombinedLoader._mode", f"mode {mode!r}")
    source_says("combined_mode", _FitLoop.setup_data, "self._combined_loader = combined_loader", "_FitLoop")


class _Progress(Callback):
    """Records, at each train batch's start and end, what the accessors of the fit's progress read."""

    def __init__(self) -> None:
        self.started: list[tuple[int, int, bool]] = []  # the hook's batch_idx, train_batch_idx, trainer_of's
        self.ended: list[tuple[int, tuple[int, bool]]] = []  # the hook's batch_idx, train_progress

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.started.append((batch_idx, _compat.train_batch_idx(trainer), _compat.trainer_of(pl_module) is trainer))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.ended.append((batch_idx, _compat.train_progress(trainer)))


def _fit_three_batches(module: Any) -> _Progress:
    from lightning.pytorch import Trainer

    progress = _Progress()
    trainer = Trainer(
        accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=3, limit_val_batches=0, callbacks=[progress],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module)
    return progress


@pins("train_batch_idx", "train_progress", "trainer_of")
def test_train_batch_idx_progress_and_trainer_of_read_the_epoch_loop_and_the_modules_trainer() -> None:
    from lightning.pytorch import LightningModule
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    loop = "lightning.pytorch.loops.training_epoch_loop._TrainingEpochLoop"
    pinned("train_batch_idx", isinstance(getattr(_TrainingEpochLoop, "batch_idx", None), property), f"{loop}.batch_idx")
    source_says("train_progress", _TrainingEpochLoop.advance, "self.batch_progress.increment_processed()", loop)
    module = BoringModel()
    pinned("trainer_of", "_trainer" in vars(module), "LightningModule._trainer", "it is gone")
    pinned("trainer_of", _compat.trainer_of(module) is None, "LightningModule._trainer", "set outside a fit")
    with pytest.raises(RuntimeError, match="not attached to a `Trainer`"):  # why the accessor reads `_trainer`
        LightningModule.trainer.fget(module)  # type: ignore[attr-defined]
    with exercising("train_batch_idx", f"{loop}.batch_idx / batch_progress"):
        progress = _fit_three_batches(module)
    started = progress.started == [(0, 0, True), (1, 1, True), (2, 2, True)]
    pinned("train_batch_idx", started, f"{loop}.batch_idx", f"the hook's, ours and trainer_of's: {progress.started}")
    ended = progress.ended == [(0, (1, False)), (1, (2, False)), (2, (3, True))]
    pinned("train_progress", ended, f"{loop}.batch_progress", f"processed, last at each batch's end: {progress.ended}")


@pins("train_batch_idx")
@pytest.mark.filterwarnings("ignore:You are using the `dataloader_iter` step flavor")
@pytest.mark.filterwarnings("ignore:Found `dataloader_iter` argument in the `training_step`")
def test_train_batch_idx_counts_the_batch_in_progress_where_the_hooks_come_one_fetch_late() -> None:
    from lightning.pytorch.demos.boring_classes import BoringModel

    class FetchesItself(BoringModel):
        def training_step(self, dataloader_iter: Any) -> Any:  # type: ignore[override]
            batch, batch_idx, _ = next(dataloader_iter)
            return super().training_step(batch, batch_idx)

    progress = _fit_three_batches(FetchesItself())
    late = [hook for hook, _, _ in progress.started] == [0, 0, 1]  # why the accessor reads the epoch loop's
    pinned("train_batch_idx", late, "_TrainingEpochLoop.advance (dataloader_iter)", f"hooks got {progress.started}")
    counted = [index for _, index, _ in progress.started] == [0, 1, 2]
    pinned("train_batch_idx", counted, "_TrainingEpochLoop.batch_idx (dataloader_iter)", f"{progress.started}")
    last = progress.ended[-1][1] == (3, True)
    pinned("train_progress", last, "_TrainingEpochLoop.batch_progress (dataloader_iter)", f"{progress.ended}")


@pins("fetched_batch")
def test_fetched_batch_is_what_lightnings_iterator_fetcher_yielded_last() -> None:
    from lightning.pytorch.loops.fetchers import _DataLoaderIterDataFetcher
    from lightning.pytorch.utilities import CombinedLoader

    fetcher = _DataLoaderIterDataFetcher()
    fetcher.setup(CombinedLoader([{"x": 1}, {"x": 2}]))
    with exercising("fetched_batch", "_DataLoaderIterDataFetcher._batch"):
        wrapper = next(iter(fetcher))
        batch, _, _ = next(wrapper)
        held = attribute("fetched_batch", fetcher, "_batch", "_DataLoaderIterDataFetcher")
    pinned("fetched_batch", held is batch, "_DataLoaderIterDataFetcher._batch", f"held {held!r}, yielded {batch!r}")


# ----------------------------------------------------------------------------------------------- resuming


class _Saves(Callback):
    """Keeps the checkpoint Lightning would write at the end of each train batch."""

    def __init__(self) -> None:
        self.saved: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.saved.append(trainer._checkpoint_connector.dump_checkpoint())


@pins("checkpoint_progress")
def test_checkpoint_progress_reads_the_batches_of_the_epoch_a_checkpoint_holds() -> None:
    from lightning.pytorch import Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel

    saves = _Saves()
    trainer = Trainer(
        accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=3, limit_val_batches=0, callbacks=[saves],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with exercising("checkpoint_progress", "checkpoint['loops']['fit_loop']['epoch_loop.batch_progress']"):
        trainer.fit(BoringModel())
        progress = [_compat.checkpoint_progress(saved) for saved in saves.saved]
    pinned("checkpoint_progress", progress == [(1, False), (2, False), (3, True)], "batch_progress", f"{progress}")
    pinned("checkpoint_progress", _compat.checkpoint_progress({}) == (0, False), "a checkpoint without loops")


@pins("set_train_batches")
def test_set_train_batches_sets_the_epochs_batches_where_the_fit_loop_and_its_iterator_read_them() -> None:
    from lightning.pytorch import Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.loops.fit_loop import _FitLoop
    from lightning.pytorch.trainer.connectors import data_connector
    from lightning.pytorch.utilities.combined_loader import CombinedLoader

    attribute("set_train_batches", data_connector, "_parse_num_batches", "data_connector")
    source_says("set_train_batches", _FitLoop.setup_data, "combined_loader.limits = limits", "_FitLoop.setup_data")
    source_says("set_train_batches", _FitLoop.setup_data, "self.max_batches = ", "_FitLoop.setup_data")
    source_says("set_train_batches", CombinedLoader.__iter__, "cls(self.flattened, self._limits)", "CombinedLoader")
    trainer = Trainer(
        accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=6, val_check_interval=0.5,
        limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(BoringModel())
    limits = trainer.fit_loop._combined_loader.limits
    with exercising("set_train_batches", "_FitLoop.max_batches / CombinedLoader.limits"):
        _compat.set_train_batches(trainer, 4)
    pinned("set_train_batches", trainer.num_training_batches == 4, "Trainer.num_training_batches")
    same = trainer.fit_loop._combined_loader.limits is limits and limits == [4]
    pinned("set_train_batches", same, "CombinedLoader.limits", f"set in place: {limits}")
    pinned("set_train_batches", trainer.val_check_batch == 2, "Trainer.val_check_batch", f"{trainer.val_check_batch}")
    _compat.set_train_batches(trainer, 9)  # limit_train_batches=6 applies as at setup
    pinned("set_train_batches", trainer.num_training_batches == 6, "_parse_num_batches", "limit_train_batches")


@pins("set_sampler_epoch")
def test_set_sampler_epoch_sets_the_epoch_of_a_loaders_sampler_and_its_batch_samplers() -> None:
    from lightning.fabric.utilities import data

    attribute("set_sampler_epoch", data, "_set_sampler_epoch", "lightning.fabric.utilities.data")
    inner, outer = (torch.utils.data.DistributedSampler(range(8), 2, rank) for rank in (0, 1))
    loader = DataLoader(range(8), batch_sampler=BatchSampler(inner, 2, False))
    with exercising("set_sampler_epoch", "lightning.fabric.utilities.data._set_sampler_epoch"):
        _compat.set_sampler_epoch(loader, 3)
        _compat.set_sampler_epoch(DataLoader(range(8), sampler=outer), 5)
    epochs = (inner.epoch, outer.epoch)
    pinned("set_sampler_epoch", epochs == (3, 5), "_set_sampler_epoch", f"the samplers' epochs: {epochs}")


@pins("litdata_loader", "litdata_resumed", "litdata_drops_last", "set_litdata_epoch")
def test_litdatas_loader_its_state_and_its_elastic_resume_are_read_and_set_where_litdata_keeps_them() -> None:
    pinned("litdata_loader", not _compat.litdata_loader(DataLoader(range(4))), "a DataLoader", "taken for LitData's")
    pytest.importorskip("litdata", reason="LitData is not installed (`pip install --no-deps litdata==0.2.76`)")
    import litdata_items
    from litdata.streaming import dataloader, elastic

    source_says("litdata_resumed", elastic.sample_in_epoch_from_state, 'state["sample_in_epoch"]', "litdata elastic")
    source_says("litdata_resumed", dataloader.StreamingDataLoader.load_state_dict, "topology_changed", "LitData")
    litdata_items.ensure(37)
    options = {"items": 37, "batch_size": 4, "shuffle": True, "drop_last": False, "mode": "examples", "num_workers": 0}
    with litdata_items._rank_environment(2, 0):
        loader = litdata_items.loader(options)
        pinned("litdata_loader", _compat.litdata_loader(loader), "litdata.StreamingDataLoader", "not recognized")
        batches = iter(loader)
        ids = [int(i) for i in next(batches)[3]]
        state = loader.state_dict()  # mid-epoch, after rank 0's first batch
    pinned("litdata_drops_last", not _compat.litdata_drops_last(state), "StreamingDataset.state_dict()['drop_last']")
    resumed = _compat.litdata_resumed(state, 12)  # rank 0's first two batches and rank 1's first (LitData's order)
    pinned("litdata_resumed", state["dataset"]["sample_in_epoch"] == 8, "the state", "changed in place")
    with litdata_items._rank_environment(1, 0):  # another number of ranks: LitData's elastic resume
        elastic_loader = litdata_items.loader(options)
        elastic_loader.load_state_dict(resumed)
        left = [int(i) for batch in elastic_loader for i in batch[3]]
        fresh = litdata_items.loader(options)
        _compat.set_litdata_epoch(fresh, state)
        again = [int(i) for batch in fresh for i in batch[3]]
    pinned("litdata_resumed", len(left) == 37 - 12, "StreamingDataLoader.load_state_dict", f"{len(left)} items left")
    pinned("litdata_resumed", not set(ids) & set(left), "StreamingDataset (elastic)", "rank 0's first batch again")
    pinned("set_litdata_epoch", sorted(again) == list(range(37)), "StreamingDataLoader.current_epoch", "the epoch")
    pinned("set_litdata_epoch", fresh.current_epoch == state["current_epoch"] + 1, "StreamingDataLoader.__iter__")


@pins("fsdp1_checkpoints")
def test_fsdp1_checkpoints_mends_the_helpers_fsdp1s_save_and_load_call_by_name_for_the_block_only() -> None:
    from lightning.fabric.strategies import fsdp, model_parallel
    from lightning.pytorch.strategies import fsdp as trainer_fsdp
    from torch.distributed.checkpoint import optimizer

    context = attribute("fsdp1_checkpoints", fsdp, "_get_full_state_dict_context", "lightning.fabric.strategies.fsdp")
    rekey = attribute("fsdp1_checkpoints", model_parallel, "_rekey_optimizer_state_if_needed", "model_parallel")
    loading = attribute("fsdp1_checkpoints", optimizer, "load_sharded_optimizer_state_dict", "dcp.optimizer")
    save, load = fsdp.FSDPStrategy.save_checkpoint, fsdp.FSDPStrategy.load_checkpoint
    source_says("fsdp1_checkpoints", save, "_get_full_state_dict_context(module, world_size=", "FSDPStrategy.save")
    source_says("fsdp1_checkpoints", load, "_rekey_optimizer_state_if_needed(checkpoint.pop(", "FSDPStrategy.load")
    source_says("fsdp1_checkpoints", load, "import load_sharded_optimizer_state_dict", "FSDPStrategy.load_checkpoint")
    trainer_load = trainer_fsdp.FSDPStrategy.load_checkpoint
    source_says("fsdp1_checkpoints", trainer_load, "import load_sharded_optimizer_state_dict", "the Trainer's load")
    source_says("fsdp1_checkpoints", context, "offload_to_cpu=True", "_get_full_state_dict_context")  # why mended

    def in_place(*args: Any) -> None:
        return None

    with exercising("fsdp1_checkpoints", "the mended helpers"), _compat.fsdp1_checkpoints(in_place):
        mended = (fsdp._get_full_state_dict_context, model_parallel._rekey_optimizer_state_if_needed)
        kept = model_parallel._rekey_optimizer_state_if_needed({"state": {}, "param_groups": []}, nn.Linear(1, 1))
        swapped = optimizer.load_sharded_optimizer_state_dict is not loading
    pinned("fsdp1_checkpoints", mended[0] is in_place and mended[1] is not rekey and swapped, "the helpers")
    pinned("fsdp1_checkpoints", kept == {"state": {}, "param_groups": []}, "_rekey_optimizer_state_if_needed")
    restored = (fsdp._get_full_state_dict_context, model_parallel._rekey_optimizer_state_if_needed)
    pinned("fsdp1_checkpoints", restored == (context, rekey), "the helpers", "not put back after the block")
    pinned("fsdp1_checkpoints", optimizer.load_sharded_optimizer_state_dict is loading, "load_sharded_optimizer_state")
    with pytest.raises(IndexError):  # Lightning's own, which the block mends: a full checkpoint's empty state
        rekey({"state": {}, "param_groups": []}, nn.Linear(1, 1))
