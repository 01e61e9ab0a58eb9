"""One sharded training run (FSDP2 or FSDP1) of `ShardedConfig`; every rank saves what it saw to `<out>.rank<r>`.

`Config.world_size` counts the data-parallel ranks, each holding its own data as in `scenario`; with tensor
parallelism every data-parallel rank is `tensor_parallel` processes that share its batches.
"""

from __future__ import annotations

import dataclasses
import json
from datetime import timedelta
from typing import Any

import torch
from cpu_fsdp import CPUFSDPStrategy
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import ModelParallelStrategy
from scenario import Config, WeightedModule
from torch import nn
from worker import Recorder, make_monitoring, rank_arguments

import lightning_weighted

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclasses.dataclass
class ShardedConfig(Config):
    strategy: str = "fsdp2_weighted"  # fsdp2_weighted | fsdp2 (ModelParallelStrategy) | fsdp_weighted | fsdp
    tensor_parallel: int = 1  # processes per data-parallel rank, splitting each layer
    hsdp: bool = False  # FSDP2 over a (replicate=2, shard) mesh of the data-parallel ranks
    mixed: str | None = None  # "param/reduce" dtypes of FSDP's own mixed precision, e.g. "bf16/fp32"
    full_checkpoint: bool = False  # one full checkpoint file instead of a folder of shards
    world_counts: bool = False  # count over every process: the wrong group under tensor parallelism
    sharding: str = "FULL_SHARD"  # FSDP1's sharding strategy
    sync_every_microbatch: bool = False  # FSDP1: reduce-scatter every microbatch instead of once per window
    checkpointing: bool = False  # FSDP1: activation checkpointing of each Linear
    audit: bool = False  # ObjectiveAudit(every_n_steps=1, on_mismatch="raise")
    float64: bool = False  # a float64 model under precision="32-true", which leaves its dtype alone (FSDP2)

    @property
    def processes(self) -> int:
        return self.world_size * self.tensor_parallel


class WorldCounting(lightning_weighted.WeightedModelParallelStrategy):
    """Counts over every process: right without tensor parallelism, `tensor_parallel` times too many with it."""

    def _make_engine(self) -> Any:
        engine = super()._make_engine()
        engine.group = None  # the world's processes, tensor-parallel peers among them
        return engine


class ShardedModule(WeightedModule):
    def __init__(self, config: ShardedConfig) -> None:
        super().__init__(config)
        self.config: ShardedConfig = config
        if config.float64:
            self.model.double()

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.config.float64:
            batch = tuple(t.double() for t in batch)
        return super().training_step(batch, batch_idx)

    @property
    def data_rank(self) -> int:
        return self.global_rank // self.config.tensor_parallel

    def configure_model(self) -> None:
        if not self.config.strategy.startswith("fsdp2"):
            return  # FSDP1: Lightning wraps the model, each Linear a unit of its own (the auto-wrap policy)
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if self.config.tensor_parallel > 1:
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
            parallelize_module(self.model, self.device_mesh["tensor_parallel"], plan)  # type: ignore[arg-type]
        mesh = self.device_mesh["data_parallel"]
        if self.config.hsdp:
            from torch.distributed.device_mesh import init_device_mesh

            shape = (2, self.config.world_size // 2)
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        policy = MixedPrecisionPolicy()
        if self.config.mixed is not None:
            param, reduce = self.config.mixed.split("/")
            policy = MixedPrecisionPolicy(param_dtype=DTYPES[param], reduce_dtype=DTYPES[reduce])
        for layer in (self.model[0], self.model[2], self.model):
            fully_shard(layer, mesh=mesh, mp_policy=policy)


def make_strategy(config: ShardedConfig) -> Any:
    timeout = timedelta(seconds=config.pg_timeout)
    weighted = config.strategy.endswith("_weighted")
    extra: dict[str, Any] = {"participation": config.participation} if weighted else {}
    if config.sync_every_microbatch:
        extra["sync_every_microbatch"] = True
    if config.strategy.startswith("fsdp2"):
        cls: Any = ModelParallelStrategy
        if weighted:
            cls = WorldCounting if config.world_counts else lightning_weighted.WeightedModelParallelStrategy
        return cls(
            data_parallel_size=config.world_size,
            tensor_parallel_size=config.tensor_parallel,
            save_distributed_checkpoint=not config.full_checkpoint,
            timeout=timeout,
            **extra,
        )
    mixed = None
    if config.mixed is not None:
        from torch.distributed.fsdp import MixedPrecision

        param, reduce = config.mixed.split("/")
        mixed = MixedPrecision(param_dtype=DTYPES[param], reduce_dtype=DTYPES[reduce])
    cls = lightning_weighted.WeightedFSDPStrategy if weighted else CPUFSDPStrategy
    return cls(
        timeout=timeout,
        auto_wrap_policy={nn.Linear},
        sharding_strategy=config.sharding,
        state_dict_type="full" if config.full_checkpoint else "sharded",
        mixed_precision=mixed,
        activation_checkpointing_policy={nn.Linear} if config.checkpointing else None,
        **extra,
    )


def main() -> None:
    args = rank_arguments()
    config = ShardedConfig(**json.loads(args.config))
    recorder = Recorder(config, args.out)
    callbacks: list[Callback] = [recorder]
    if config.checkpoint:
        callbacks.append(ModelCheckpoint(dirpath=f"{args.out}.ckpt", save_top_k=-1, save_on_train_epoch_end=True))
        callbacks.append(OnExceptionCheckpoint(dirpath=f"{args.out}.ckpt"))
    logger: Any = False
    if config.counter is not None:
        callbacks += make_monitoring(config)
        logger = CSVLogger(f"{args.out}.logs", name="", version="")
    if config.audit:
        recorder.audit = lightning_weighted.ObjectiveAudit(every_n_steps=1, on_mismatch="raise")
        callbacks.append(recorder.audit)
    trainer = Trainer(
        strategy=make_strategy(config),
        accelerator=config.device,
        devices=config.processes,
        max_epochs=config.epochs,
        accumulate_grad_batches=config.accumulate,
        precision=config.precision,  # type: ignore[arg-type]
        gradient_clip_val=config.clip,
        gradient_clip_algorithm=config.clip_algorithm,
        callbacks=callbacks,
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=config.checkpoint,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=config.items is not None,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(ShardedModule(config), ckpt_path=config.resume)


if __name__ == "__main__":
    main()
