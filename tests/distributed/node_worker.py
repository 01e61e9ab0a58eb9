"""One process of a run whose processes are started outside Lightning (torchrun, SLURM), one device per node.

``Trainer(num_nodes=..., devices=1, strategy=...)`` trains `scenario.Config`; every rank saves the `worker.Recorder`
record to ``<out>.rank<r>`` and what Lightning detected about the launch to ``<out>.env.rank<r>`` (JSON).
"""

from __future__ import annotations

import argparse
import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from scenario import Config, WeightedModule
from worker import Recorder, make_strategy, rank_arguments

TIMEOUT = timedelta(seconds=30)  # process-group timeout: a dead peer fails the run, not the test's budget


class LaunchReport(Callback):
    """Writes the cluster environment, ranks and process group Lightning ended up with."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        strategy: Any = trainer.strategy
        report = {
            "cluster_environment": type(strategy.cluster_environment).__name__,
            "strategy": type(strategy).__name__,
            "world_size": dist.get_world_size(),
            "global_rank": trainer.global_rank,
            "node_rank": trainer.node_rank,
            "local_rank": trainer.local_rank,
            "num_nodes": trainer.num_nodes,
            "backend": dist.get_backend(),
            "timeout_s": strategy._timeout.total_seconds(),
        }
        Path(f"{self.out}.env.rank{trainer.global_rank}").write_text(json.dumps(report))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", required=True, help="a registered name, e.g. ddp_weighted or ddp")
    parser.add_argument("--instance", action="store_true", help="pass a strategy object instead of the name")
    parser.add_argument("--num-nodes", type=int, default=2)
    args = rank_arguments(parser)
    config = Config(**{**json.loads(args.config), "strategy": args.strategy})

    import lightning_weighted  # noqa: F401  (what a user's script does before naming the strategy)

    trainer = Trainer(
        strategy=make_strategy(config) if args.instance else args.strategy,
        accelerator="cpu",
        num_nodes=args.num_nodes,
        devices=1,
        max_epochs=config.epochs,
        accumulate_grad_batches=config.accumulate,
        callbacks=[Recorder(config, args.out), LaunchReport(args.out)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        # as in worker.py: the scenario's own per-rank batches, validation only when the config has a set
        use_distributed_sampler=config.items is not None or config.val_items is not None,
        num_sanity_val_steps=0,
        limit_val_batches=None if config.val_items is not None else 0,
    )
    if not args.instance:
        # A registered name takes no arguments: shorten the process-group timeout of the strategy it built.
        assert isinstance(trainer.strategy._timeout, timedelta), "DDPStrategy no longer keeps `_timeout`"  # type: ignore[attr-defined]
        trainer.strategy._timeout = TIMEOUT  # type: ignore[attr-defined]
    trainer.fit(WeightedModule(config))


if __name__ == "__main__":
    main()
