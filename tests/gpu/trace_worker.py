"""The worked trace (`examples/worked_trace.py`) trained for one step on CUDA or CPU; every rank saves `w`.

World size 1: both microbatches `[9, 9]` and `[7] * 6` form one accumulation window on rank 0 (NCCL on CUDA).
World size 2: one microbatch per rank (gloo, both ranks on `cuda:0` on CUDA: NCCL refuses two ranks on one GPU).
`fsdp2_weighted` and plain FSDP2 (`ModelParallelStrategy`) run the trace with `w` in a submodule that
`configure_model` shards over the data-parallel mesh.
"""

from __future__ import annotations

import dataclasses
import json
from datetime import timedelta
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, Strategy
from torch.distributed.fsdp import FSDPModule, fully_shard
from worked_trace import TARGETS, WorkedTrace
from worker import device_kwargs, rank_arguments, whole

import lightning_weighted


@dataclasses.dataclass
class Config:
    device: str = "cpu"  # cpu | cuda
    world_size: int = 2
    strategy: str = "ddp_weighted"  # ddp_weighted | ddp | fsdp2_weighted | fsdp2
    counter: bool = False  # an ItemCounter counts examples ahead (training_step's count must agree)


def strategy_for(name: str, device: str, world_size: int) -> Strategy:
    timeout = timedelta(seconds=60)
    if name.startswith("fsdp2"):
        cls: type[Strategy] = lightning_weighted.WeightedModelParallelStrategy if name.endswith("weighted") else None
        cls = cls or ModelParallelStrategy
        return cls(data_parallel_size=world_size, tensor_parallel_size=1, timeout=timeout)  # type: ignore[call-arg]
    cls = lightning_weighted.WeightedDDPStrategy if name == "ddp_weighted" else DDPStrategy
    return cls(**device_kwargs(device, world_size), timeout=timeout)  # type: ignore[call-arg]


class HalfSquare(torch.nn.Module):
    """The trace's parameter `w` and its per-item loss `½ (w − y)²`, as a module FSDP2 can shard."""

    def __init__(self, w: float) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([w]))

    def forward(self, targets: torch.Tensor) -> torch.Tensor:
        return 0.5 * (self.w - targets) ** 2


class ShardedTrace(WorkedTrace):
    """The worked trace with `w` in a submodule, sharded over the data-parallel mesh in `configure_model`."""

    def __init__(self, microbatches: dict[int, list[list[float]]]) -> None:
        super().__init__(microbatches)
        del self.w
        self.half_square = HalfSquare(10.0)

    def configure_model(self) -> None:
        fully_shard(self.half_square, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> dict[str, object]:
        return {"loss": self.half_square(batch).mean(), "count": len(batch)}


class Report(Callback):
    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        record = {
            "backend": torch.distributed.get_backend(),
            "device": str(whole(next(pl_module.parameters())).device),
            "counts_ahead": getattr(trainer.strategy, "counts_ahead", None),
            "fsdp_modules": sum(isinstance(module, FSDPModule) for module in pl_module.modules()),
            "w": float(whole(next(pl_module.parameters()).detach()).cpu()),
            "steps": trainer.global_step,
        }
        Path(f"{self.out}.rank{trainer.global_rank}").write_text(json.dumps(record))


def main() -> None:
    args = rank_arguments()
    config = Config(**json.loads(args.config))
    torch.set_float32_matmul_precision("highest")
    alone = config.world_size == 1
    microbatches = {0: list(TARGETS.values())} if alone else {rank: [t] for rank, t in TARGETS.items()}
    callbacks: list[Callback] = [Report(args.out)]
    if config.counter:
        callbacks.append(lightning_weighted.ItemCounter("examples"))
    trainer = Trainer(
        strategy=strategy_for(config.strategy, config.device, config.world_size),
        accelerator=config.device,
        devices=1 if config.device == "cuda" else config.world_size,  # on CUDA the list is `parallel_devices`
        max_steps=1,
        accumulate_grad_batches=2 if alone else 1,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    sharded = config.strategy.startswith("fsdp2")
    trainer.fit(ShardedTrace(microbatches) if sharded else WorkedTrace(microbatches))


if __name__ == "__main__":
    main()
