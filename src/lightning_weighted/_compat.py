"""Every private Lightning and PyTorch symbol this package uses, read or set through an accessor, in one place.

Each entry says why no public API serves; where torch moved a symbol, it branches here alone, on :data:`TORCH`;
``tests/unit/test_compat.py`` pins each. What a fit patches: :mod:`lightning_weighted.trainer._seam`; the one
protected method overridden: ``FSDPStrategy._setup_model``, to wrap a module on the CPU (``trainer/strategies.py``).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from lightning.fabric.strategies.fsdp import _move_torchmetrics_to_device as move_metrics  # FSDPStrategy._setup_model's
from lightning.fabric.strategies.fsdp import _setup_activation_checkpointing as setup_checkpointing  # likewise
from lightning.fabric.strategies.registry import _StrategyRegistry as StrategyRegistry  # Lightning's registry type
from lightning.fabric.strategies.strategy import _BackwardSyncControl as BackwardSyncControl  # no public base class
from lightning.fabric.utilities.data import _set_sampler_epoch as set_sampler_epoch  # the epoch of a loader's samplers
from lightning.pytorch.utilities.data import _update_dataloader as rebuild_loader  # a loader rebuilt with a sampler
from lightning.pytorch.utilities.exceptions import _augment_message as augment_message  # as DDPStrategy.on_exception
from torch import Tensor, nn
from torch import _foreach_mul_ as multiply  # tensors of one device and dtype multiplied in place, as torch.optim does
from torch.utils.data import DataLoader

# fmt: off
__all__ = [
    "LOADER_BARRIERS", "BackwardSyncControl", "StrategyRegistry", "augment_message", "checkpoint_progress",
    "combined_mode", "ddp_kwargs", "fetched_batch", "flat_parameters", "flatten_mesh", "forward_redirection",
    "fsdp1_checkpoints", "fsdp1_options", "fsdp2_param_groups", "fsdp2_policies", "fsdp2_shard_sizes",
    "join_enabled", "litdata_drops_last", "litdata_loader", "litdata_resumed", "metric_restore", "metric_snapshot",
    "move_metrics", "multiply", "parallel_sizes", "rebuild_loader", "reduce_scatter", "register", "require_torch",
    "set_backward_sync_control", "set_litdata_epoch", "set_parallel_sizes", "set_sampler", "set_sampler_epoch",
    "set_train_batches", "setup_checkpointing", "train_batch_idx", "train_progress", "trainer_of", "unfloored",
]
# fmt: on

TORCH = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])  # the installed (major, minor)
FSDP2_TORCH = (2, 9)  # the first torch with every public `FSDPModule` method FSDP2's engine calls


def require_torch(minimum: tuple[int, int], what: str) -> None:
    """Raises ``RuntimeError`` unless the installed torch is at least ``minimum``, naming both and the fix."""
    if minimum > TORCH:
        needed = ".".join(map(str, minimum))
        raise RuntimeError(
            f"{what} needs torch>={needed}, and torch {torch.__version__} is installed. Upgrade torch:"
            f" `pip install 'torch>={needed}'` (README, Supported versions)."
        )


def register(registry: StrategyRegistry, cls: type, what: str, *names: tuple[str, dict[str, Any]]) -> None:
    """Registers ``cls`` under each name with its keyword arguments, as Lightning registers ``"ddp"``'s variants."""
    for name, kwargs in names:
        extra = ", ".join(f"{key}={value!r}" for key, value in kwargs.items())
        description = f"{what} ({extra})" if extra else what
        registry.register(name, cls, description=description, override=True, **kwargs)  # importing twice: as it was


def set_backward_sync_control(strategy: Any, control: Any) -> None:
    """Sets what ``fabric.no_backward_sync`` runs for ``strategy`` (Fabric reads ``_backward_sync_control``)."""
    strategy._backward_sync_control = control


def ddp_kwargs(strategy: Any) -> dict[str, Any]:
    """The keyword arguments a Lightning ``DDPStrategy`` passes to ``DistributedDataParallel`` (no public view)."""
    return cast("dict[str, Any]", strategy._ddp_kwargs)


def parallel_sizes(strategy: Any) -> tuple[Any, Any]:
    """A ``ModelParallelStrategy``'s ``(data_parallel_size, tensor_parallel_size)`` as given, ``"auto"`` included."""
    return strategy._data_parallel_size, strategy._tensor_parallel_size


def set_parallel_sizes(strategy: Any, data: int, tensor: int) -> None:
    """Sets them before the strategy builds its device mesh (``setup_environment``), where it reads them."""
    strategy._data_parallel_size, strategy._tensor_parallel_size = data, tensor


def fsdp1_options(strategy: Any) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """An ``FSDPStrategy``'s ``state_dict_type``, FSDP1 and checkpointing arguments (the Trainer's or Fabric's)."""
    kwargs = strategy._fsdp_kwargs if hasattr(strategy, "_fsdp_kwargs") else strategy.kwargs
    return strategy._state_dict_type, kwargs, strategy._activation_checkpointing_kwargs


# The barrier Lightning's loops pass right before they process a stage's loaders (`process_dataloader` is not told).
LOADER_BARRIERS = {"train_dataloader()": "train", "val_dataloader()": "val", "test_dataloader()": "test"}


def unfloored(tensor: Tensor, reduce_op: object) -> Tensor:
    """``tensor`` in float64 where it is an integer tensor about to be mean-reduced (Lightning floors it, #21859)."""
    if not tensor.is_floating_point() and str(reduce_op).lower().rsplit(".", 1)[-1] in ("mean", "avg"):
        return tensor.double()
    return tensor


def forward_redirection(strategy: Any, wrapper: nn.Module, module: nn.Module, name: str, *args: Any) -> Any:
    """``module.<name>(*args)`` through FSDP1's root ``wrapper``, which gathers parameters only in its forward."""
    return strategy._forward_redirection(wrapper, module, name, *args)


def combined_mode(fit_loop: Any) -> str:
    """The mode of the train ``CombinedLoader`` Lightning built (it names it only on the loader's ``_mode``)."""
    return str(getattr(getattr(fit_loop, "_combined_loader", None), "_mode", "max_size_cycle"))


def fetched_batch(trainer: Any) -> Any:
    """The batch a ``training_step`` taking ``dataloader_iter`` fetched last (only on Lightning's fetcher)."""
    return getattr(trainer.fit_loop._data_fetcher, "_batch", None)


def train_batch_idx(trainer: Any) -> int:
    """The ``batch_idx`` of the train batch in progress, as the epoch loop counts it (no public view)."""
    return int(trainer.fit_loop.epoch_loop.batch_idx)


def train_progress(trainer: Any) -> tuple[int, bool]:
    """How many batches of the train epoch were processed, and whether the last was (``batch_progress``, private)."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    return int(progress.current.processed), bool(progress.is_last_batch)


def checkpoint_progress(checkpoint: dict[str, Any]) -> tuple[int, bool]:
    """:func:`train_progress` as a checkpoint of Lightning's holds it (``(0, False)`` where it holds none)."""
    progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress", {})
    return int(progress.get("current", {}).get("processed", 0)), bool(progress.get("is_last_batch", False))


def set_train_batches(trainer: Any, batches: int) -> None:
    """Tells the fit loop an epoch's number of train batches as ``setup_data`` does (it reads them once, at setup)."""
    from lightning.pytorch.trainer.connectors.data_connector import _parse_num_batches
    from lightning.pytorch.trainer.states import RunningStage

    limit = _parse_num_batches(RunningStage.TRAINING, batches, trainer.limit_train_batches)
    limits = trainer.fit_loop._combined_loader.limits  # in place: the epoch's iterator holds the same list
    limits[:] = [limit] * len(limits)
    trainer.fit_loop.max_batches = limit
    interval = trainer.val_check_interval
    if isinstance(interval, float) and getattr(trainer, "_val_check_time_interval", None) is None:
        trainer.val_check_batch = max(1, int(limit * interval))


def litdata_resumed(state: dict[str, Any], items: int) -> dict[str, Any]:
    """LitData's loader ``state`` that resumes after ``items`` of its order (LitData rounds down to whole batches)."""
    resumed = copy.deepcopy(state)
    resumed["dataset"]["sample_in_epoch"] = items
    return resumed


def litdata_drops_last(state: dict[str, Any]) -> bool:
    """Whether LitData's loader ``state`` deals whole rounds of batches only (its data set's ``drop_last``)."""
    return bool(state["dataset"].get("drop_last"))


def set_litdata_epoch(loader: Any, state: dict[str, Any]) -> None:
    """LitData's epoch counter as its loader ``state`` left it: its next pass deals the epoch after, whole."""
    loader.current_epoch = state["current_epoch"]


def litdata_loader(loader: object) -> bool:
    """Whether ``loader`` is LitData's ``StreamingDataLoader`` over one ``StreamingDataset`` (LitData not imported)."""
    loaders = [c.__name__ for c in type(loader).__mro__ if c.__module__.startswith("litdata.")]
    dataset = type(getattr(loader, "dataset", None))
    streaming = dataset.__module__.startswith("litdata.") and dataset.__name__ == "StreamingDataset"
    return "StreamingDataLoader" in loaders and streaming


def trainer_of(module: Any) -> Any:
    """The module's ``Trainer``, or ``None`` outside a fit (``LightningModule.trainer`` raises there)."""
    return getattr(module, "_trainer", None)


def join_enabled(ddp: nn.Module) -> bool:
    """Whether ``DistributedDataParallel.join()`` is active on ``ddp`` (no public query for it)."""
    config = getattr(ddp, "_join_config", None)
    return bool(config is not None and config.enable)


def flatten_mesh(mesh: Any, names: tuple[str, ...]) -> Any:
    """The one-dimensional submesh over several dimensions of a ``DeviceMesh`` (HSDP's replicate × shard)."""
    return mesh[names]._flatten()


def fsdp2_param_groups(module: nn.Module) -> list[Any]:
    """An FSDP2 module's parameter groups: their parameters, policies and mesh, which no public attribute exposes."""
    state: Any = module._get_fsdp_state()  # type: ignore[operator]
    if TORCH < (2, 12):  # torch 2.9-2.11: one group per module, None without parameters
        return [] if state._fsdp_param_group is None else [state._fsdp_param_group]
    return cast("list[Any]", state._fsdp_param_groups)  # torch 2.12 on: a list (one `fully_shard` of several modules)


def fsdp2_policies(group: Any) -> list[Any]:
    """The ``MixedPrecisionPolicy`` each parameter of an FSDP2 parameter group computes and reduces under."""
    if TORCH < (2, 15):  # torch 2.9-2.14: the group's one policy
        return [group.mp_policy]
    return [param.mp_policy for param in group.fsdp_params]  # torch 2.15 on: each its own (`param_dtype_override_fn`)


def fsdp2_shard_sizes(group: Any) -> tuple[int, int]:
    """How many ranks an FSDP2 parameter group shards and replicates over (its private ``mesh_info``)."""
    return getattr(group.mesh_info, "shard_mesh_size", 1), getattr(group.mesh_info, "replicate_mesh_size", 1)


def flat_parameters(module: nn.Module) -> list[Tensor]:
    """FSDP1's flat parameters in ``module``, where each unit's unsharded gradient accumulates."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return [unit._flat_param for unit in FullyShardedDataParallel.fsdp_modules(module) if unit._flat_param is not None]


@contextlib.contextmanager
def fsdp1_checkpoints(full_context: Callable[..., Any] | None = None) -> Iterator[None]:
    """FSDP1's checkpoints (Fabric's save and load, the Trainer's load) on the CPU and for any optimizer.

    Mends, for the block: Lightning's ``fsdp._get_full_state_dict_context``, which offloads to the CPU and segfaults on
    a CPU model (``full_context`` replaces it; ``None``: not on the CPU); torch's ``load_sharded_optimizer_state_dict``,
    which drops an optimizer's empty ``"state"`` (SGD without momentum) that FSDP1 refuses (put back); Lightning's
    ``_rekey_optimizer_state_if_needed``, which reads that state's first key (skipped where it has none).
    """
    from lightning.fabric.strategies import fsdp, model_parallel
    from torch.distributed.checkpoint import optimizer

    loading, rekeying = optimizer.load_sharded_optimizer_state_dict, model_parallel._rekey_optimizer_state_if_needed

    def load_with_state(model_state_dict: Any, optimizer_key: str, *args: Any, **kwargs: Any) -> Any:
        loaded = loading(model_state_dict, optimizer_key, *args, **kwargs)
        loaded[optimizer_key].setdefault("state", {})
        return loaded

    def rekey(state: dict[str, Any], module: nn.Module) -> dict[str, Any]:
        return state if not state["state"] else rekeying(state, module)

    mended: list[tuple[Any, str, Any]] = [
        (fsdp, "_get_full_state_dict_context", full_context or fsdp._get_full_state_dict_context),
        (optimizer, "load_sharded_optimizer_state_dict", load_with_state),
        (model_parallel, "_rekey_optimizer_state_if_needed", rekey),
    ]
    originals = [getattr(owner, name) for owner, name, _ in mended]
    for owner, name, replacement in mended:
        setattr(owner, name, replacement)
    try:
        yield
    finally:
        for (owner, name, _), original in zip(mended, originals, strict=True):
            setattr(owner, name, original)


def reduce_scatter(output: Tensor, source: Tensor, group: Any, op: Any, async_op: bool = False) -> Any:
    """A reduce-scatter of ``source`` into ``output`` by the name this torch prefers (2.13 deprecates the old one)."""
    if TORCH >= (2, 13):  # torch 2.13 on: `reduce_scatter_single`, as FSDP2's own reduce-scatter calls it
        return dist.reduce_scatter_single(output=output, input=source, op=op, group=group, async_op=async_op)
    return dist.reduce_scatter_tensor(output, source, op=op, group=group, async_op=async_op)  # torch 2.9-2.12


def metric_snapshot(metric: Any) -> tuple[dict[str, Any], int, Any]:
    """A ``Metric``'s state, update count and cached result, to put back after a replay (no public setter)."""
    state = {
        name: value.clone() if isinstance(value, Tensor) else [v.clone() if isinstance(v, Tensor) else v for v in value]
        for name, value in metric.metric_state.items()
    }
    return state, metric._update_count, metric._computed


def metric_restore(metric: Any, snapshot: tuple[dict[str, Any], int, Any]) -> None:
    """Puts back what :func:`metric_snapshot` took."""
    state, metric._update_count, metric._computed = snapshot
    for name, value in state.items():
        setattr(metric, name, value)


def set_sampler(loader: DataLoader[Any], sampler: Any, keep: bool = False) -> None:
    """Sets a built ``DataLoader``'s sampler, which its ``__setattr__`` refuses; ``keep``: in its batch sampler only."""
    batches: Any = loader.batch_sampler
    if batches is not None:
        batches.sampler = sampler
    if not keep:
        object.__setattr__(loader, "sampler", sampler)
