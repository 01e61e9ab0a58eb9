"""One distributed training run of `scenario.Config`; every rank saves what it saw to `<out>.rank<r>`.

Run as a script (the popen launcher re-executes it on every rank); the tests start it as a subprocess.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import inspect
import json
import signal
import types
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from launcher import settle_at_exit
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import GradientAccumulationScheduler, ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy
from reads import ReadSpy
from scenario import Config, WeightedModule, part_masks
from torch import Tensor

import lightning_weighted
from lightning_weighted import ItemMonitor

# A newer name of an older collective is recorded under the older one, so that a record reads the same on every torch
# (FSDP2 reduce-scatters and all-gathers through the `*_single` names from torch 2.13, the `*_tensor` ones before).
ALIASES = {"all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}


def collectives() -> dict[str, Any]:
    """Every public collective of ``torch.distributed`` on this torch: each function that takes ``async_op``.

    Found by signature rather than listed by name, so that a collective a new torch adds is counted as well. The
    object collectives (``broadcast_object_list``, ...) and point-to-point calls take no ``async_op``; the former run
    a tensor collective inside torch, through its own module's names, which stay unwrapped (nothing counted twice).
    """
    return {
        name: value
        for name, value in vars(dist).items()
        if not name.startswith("_")
        and type(value) is types.FunctionType  # not isinstance: a deprecated alias warns when its class is read
        and "async_op" in inspect.signature(value).parameters
    }


@contextmanager
def full(trainer: Trainer, grads: bool = False) -> Iterator[None]:
    """Makes FSDP1's parameters (and gradients) whole for the block; FSDP2's are made whole by `whole`."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = trainer.strategy.model
    if isinstance(model, FullyShardedDataParallel):
        with FullyShardedDataParallel.summon_full_params(model, writeback=False, with_grads=grads):
            yield
    else:
        yield


def whole(tensor: Tensor) -> Tensor:
    """A copy of the whole tensor: an FSDP2 shard (a DTensor) gathered, any other tensor as it is."""
    full_tensor = getattr(tensor, "full_tensor", None)
    return (full_tensor() if full_tensor is not None else tensor).detach().clone()


def local(value: Any) -> Any:
    """A copy of this rank's part of a value: a DTensor's local shard, any other tensor as it is."""
    to_local = getattr(value, "to_local", None)
    return (to_local() if to_local is not None else value).clone() if isinstance(value, Tensor) else value


def grad_norm(grads: list[Tensor]) -> float:
    """The float64 norm over every gradient (0 where no parameter has one)."""
    return float(torch.linalg.vector_norm(torch.stack([g.double().norm() for g in grads]))) if grads else 0.0


class Recorder(Callback):
    """Snapshots gradients, parameters and optimizer state at each optimizer step; counts collectives.

    Whole parameters and gradients under every engine (FSDP1's summoned, FSDP2's gathered), this rank's optimizer
    state (its shards under FSDP).
    """

    def __init__(self, config: Config, out: str) -> None:
        self.config, self.out = config, out
        self.steps: list[dict[str, Any]] = []
        self.collectives: list[tuple[str, str, int]] = []
        self.padding: list[bool] = []
        self.validation: list[float] = []
        self.windows: list[tuple[int, float, float]] = []  # (global_step, N, local items) per optimizer step
        self.batches: list[tuple[int, int]] = []
        self.spy = ReadSpy()  # with `host_reads`: every host read of a tensor during the fit
        self.audit: Any = None  # an ObjectiveAudit whose reports the record keeps
        self._originals: dict[str, Any] = {}

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_step, self._stepped, self._pending = trainer.global_step, False, None
        for optimizer in trainer.optimizers:  # whether the optimizer stepped in a window (not where it had no item)
            optimizer.register_step_post_hook(lambda *args: setattr(self, "_stepped", True))
        if self.config.host_reads:
            self.spy.install()
            self.spy.active = True
        if self.config.join:
            trainer.strategy.model.join().__enter__()  # as a user wrapping the loop in `ddp.join()` would
        if self.config.count_collectives:
            self.count_collectives()

    def count_collectives(self) -> None:
        """Records every collective called through ``torch.distributed`` from now on (see :func:`collectives`)."""
        for name, original in collectives().items():
            self._originals[name] = original
            setattr(dist, name, self._counting(ALIASES.get(name, name), original))

    def _counting(self, name: str, original: Any) -> Any:
        first = next(iter(inspect.signature(original).parameters))  # a tensor (the output where there are two)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            value = args[0] if args else kwargs.get(first)
            tensor = value if isinstance(value, torch.Tensor) else None
            dtype = str(tensor.dtype) if tensor is not None else ""
            self.collectives.append((name, dtype, tensor.numel() if tensor is not None else 0))
            return original(*args, **kwargs)

        return wrapper

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.validation.append(float(trainer.callback_metrics["val/loss"]))
        with full(trainer):
            self.validation_params = [whole(p) for p in pl_module.model.parameters()]

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        with full(trainer, grads=True):
            grads = [whole(p.grad) for p in pl_module.model.parameters() if p.grad is not None]
        self._pending = {"norm": grad_norm(grads), "collectives": len(self.collectives)}

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self.spy.active = False
        self.batches.append((trainer.global_step, float(batch[2].sum())))  # the items of this batch, by step
        self.spy.mark, self.spy.active = (trainer.global_step, len(self.batches) - 1), self.config.host_reads
        if self.config.sync_debug and trainer.global_step >= 2:  # past DDP's bucket rebuild, which reads once
            torch.cuda.set_sync_debug_mode("error")  # any device synchronisation from here raises

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.config.sync_debug:
            torch.cuda.set_sync_debug_mode("default")

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        self.padding.append(bool(getattr(trainer.strategy, "padding_step", False)))
        window = getattr(trainer.strategy, "last_window", None)
        if window is not None and (not self.windows or self.windows[-1][0] != window.step):
            self.windows.append((window.step, window.items, window.local_items))
        if trainer.global_step == self._last_step:
            return  # no window ended at this batch
        # a window without items steps no optimizer and calls no hook before it: its norm is None
        step = self._pending or {"norm": None, "collectives": len(self.collectives)}
        step["stepped"], self._last_step, self._stepped, self._pending = self._stepped, trainer.global_step, False, None
        optimizer = trainer.optimizers[0]
        with full(trainer):
            step["params"] = [whole(p) for p in pl_module.model.parameters()]
        step["state"] = {k: {n: local(t) for n, t in v.items()} for k, v in optimizer.state_dict()["state"].items()}
        step["lr"] = optimizer.param_groups[0]["lr"]
        self.steps.append(step)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.spy.active = False
        self.spy.uninstall()
        for name, original in self._originals.items():
            setattr(dist, name, original)
        with full(trainer):
            params = [whole(p) for p in pl_module.model.parameters()]
        ddp_logging = getattr(trainer.strategy.model, "_get_ddp_logging_data", None)  # DDP's alone
        record = {
            "rank": trainer.global_rank,
            "params": params,
            "steps": self.steps,
            "collectives": self.collectives,
            "global_step": trainer.global_step,
            "skipped_steps": getattr(trainer.strategy, "skipped_steps", None),
            "padding": self.padding,
            "validation": self.validation,
            "validation_params": getattr(self, "validation_params", None),
            "windows": self.windows,
            "batches": self.batches,
            "comm_hook": ddp_logging().get("comm_hook") if ddp_logging is not None else None,
            "audits": [dataclasses.asdict(r) for r in self.audit.reports] if self.audit is not None else [],
            "counts_ahead": getattr(trainer.strategy, "counts_ahead", None),
            "reads": self.spy.reads,
            "items_total": next((c.items_total for c in trainer.callbacks if isinstance(c, ItemMonitor)), None),
        }
        torch.save(record, f"{self.out}.rank{trainer.global_rank}")


def weighted_name(config: Config) -> bool:
    return config.strategy.startswith("ddp_weighted")


def make_strategy(config: Config) -> Any:
    kwargs: dict[str, Any] = {"timeout": timedelta(seconds=config.pg_timeout)}
    if config.static_graph:
        kwargs["static_graph"] = True
    if config.find_unused:
        kwargs["find_unused_parameters"] = True
    if config.bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = config.bucket_cap_mb
    if weighted_name(config) and config.participation != "pad":
        kwargs["participation"] = config.participation
    weighted = weighted_name(config)
    start_method = config.strategy.removeprefix("ddp_weighted" if weighted else "ddp").lstrip("_") or "popen"
    cls = lightning_weighted.WeightedDDPStrategy if weighted else DDPStrategy
    return cls(start_method=start_method, **device_kwargs(config.device, config.world_size), **kwargs)


def device_kwargs(device: str, world_size: int) -> dict[str, Any]:
    """One GPU holds every rank: NCCL for one rank, gloo on CUDA tensors for several (NCCL refuses two per GPU)."""
    if device != "cuda":
        return {}
    backend = "nccl" if world_size == 1 else "gloo"
    return {"parallel_devices": [torch.device("cuda", 0)] * world_size, "process_group_backend": backend}


def make_counter(config: Config) -> Callback:
    if config.parts:  # each part counted ahead on the batch: (x, y, w)
        parts = {n: (lambda batch, n=n: part_masks(batch[0], batch[2])[n].sum()) for n in ("tokens", "positive")}
        return lightning_weighted.ItemCounter(parts={n: lightning_weighted.ItemCounter(f) for n, f in parts.items()})
    if config.counter == "bad":
        calls = []

        def count_fn(batch: Any) -> Any:
            calls.append(1)  # rank 1's third microbatch claims a negative count
            return -1 if dist.get_rank() == 1 and len(calls) == 3 else batch[2].sum()

        return lightning_weighted.ItemCounter(count_fn)
    if config.counter == "examples":
        return lightning_weighted.ItemCounter("examples")
    return lightning_weighted.ItemCounter("tokens", key=2, mask=True)


def make_monitoring(config: Config) -> list[Callback]:
    """An `ItemMonitor` where the run logs (`monitor`, or any `counter` but "quiet"), with or without an ItemCounter.

    "quiet" logs nothing: the monitor's `train/imbalance` takes a collective of its own on the steps it logs.
    """
    callbacks = [make_counter(config)] if config.counter is not None else []
    if config.monitor or config.counter not in (None, "quiet"):
        callbacks.append(lightning_weighted.ItemMonitor())
    return callbacks


def rank_arguments(parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """What every rank script does first: dump all stacks on SIGUSR1 (the harness's signal on a hang), settle its
    exit (``launcher.settle_at_exit``), use one intra-op thread, and parse its options, ``--config`` (a JSON config)
    and ``--out`` among them."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    settle_at_exit()
    torch.set_num_threads(1)
    parser = parser or argparse.ArgumentParser()
    parser.add_argument("--config", required=True, help="the config dataclass as JSON")
    parser.add_argument("--out", required=True, help="prefix of the per-rank output files")
    return parser.parse_args()


def main() -> None:
    args = rank_arguments()
    config = Config(**json.loads(args.config))
    if config.python_reducer:
        torch._dynamo.config.optimize_ddp = "python_reducer"
    recorder = Recorder(config, args.out)
    callbacks: list[Callback] = [recorder]
    if config.schedule is not None:
        callbacks.append(GradientAccumulationScheduler({int(k): v for k, v in config.schedule.items()}))
    if config.checkpoint:
        callbacks.append(ModelCheckpoint(dirpath=f"{args.out}.ckpt", save_top_k=-1, save_on_train_epoch_end=True))
        callbacks.append(OnExceptionCheckpoint(dirpath=f"{args.out}.ckpt"))
    logger: Any = False
    if config.counter is not None or config.monitor:
        callbacks += make_monitoring(config)
        logger = CSVLogger(f"{args.out}.logs", name="", version="")
    trainer = Trainer(
        strategy=make_strategy(config),
        accelerator=config.device,
        devices=1 if config.device == "cuda" else config.world_size,  # on CUDA the list is `parallel_devices`
        max_epochs=config.epochs,
        accumulate_grad_batches=1 if config.schedule is not None else config.accumulate,
        precision=config.precision,  # type: ignore[arg-type]
        gradient_clip_val=config.clip,
        gradient_clip_algorithm=config.clip_algorithm,
        callbacks=callbacks,
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=config.checkpoint,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=config.items is not None or config.val_items is not None,
        num_sanity_val_steps=0,
        limit_val_batches=None if config.val_items is not None else 0,
    )
    trainer.fit(WeightedModule(config), ckpt_path=config.resume)


if __name__ == "__main__":
    main()
