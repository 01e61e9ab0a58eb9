"""The worked trace, trained for real on 2 CPU processes: ``ddp_weighted`` gives w = 9.75, plain ``ddp`` 9.8.

One parameter ``w = 10``, per-item loss ``½(w − y)²``. Rank 0 holds targets ``[9, 9]`` (2 items, mean
gradient 1), rank 1 holds ``[7] * 6`` (6 items, mean gradient 3). The mean over all 8 items has gradient
``(2·1 + 6·3) / 8 = 2.5``; plain DDP averages the two rank means, ``(1 + 3) / 2 = 2``. One SGD step with
lr 0.1 lands on ``10 − 0.25 = 9.75`` (weighted) or ``10 − 0.2 = 9.8`` (plain).

Both trainings run from this one script, so they use the fork launcher (``"ddp_weighted_fork"``; spawn where fork
is unavailable); a script that trains once uses ``"ddp_weighted"``.

Usage::

    python examples/worked_trace.py
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader

import lightning_weighted  # noqa: F401  (registers "ddp_weighted" and its variants)

TARGETS = {0: [9.0, 9.0], 1: [7.0] * 6}  # rank -> its targets, one microbatch each
LAUNCHER = "fork" if "fork" in torch.multiprocessing.get_all_start_methods() else "spawn"

# Keep the output to the table (in the launched ranks too): Lightning's start-up notes and a deprecation of its own.
for name in ("lightning.pytorch", "lightning.fabric"):
    logging.getLogger(name).setLevel(logging.WARNING)
warnings.filterwarnings("ignore", message=".*LeafSpec.*")


class WorkedTrace(LightningModule):
    """One parameter ``w = 10``, per-item loss ``½(w − y)²``; each rank trains on its own microbatches of targets.

    Args:
        microbatches: rank -> that rank's microbatches, each a list of targets (default: ``TARGETS``, one each).
        lr: SGD's learning rate.
    """

    def __init__(self, microbatches: dict[int, list[list[float]]] | None = None, lr: float = 0.1) -> None:
        super().__init__()
        self.microbatches = microbatches or {rank: [targets] for rank, targets in TARGETS.items()}
        self.lr = lr
        self.w = torch.nn.Parameter(torch.tensor([10.0]))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> Any:
        loss = (0.5 * (self.w - batch) ** 2).mean()  # the mean over this microbatch's items
        return {"loss": loss, "count": len(batch)}

    def train_dataloader(self) -> DataLoader[torch.Tensor]:
        return DataLoader([torch.tensor(t) for t in self.microbatches[self.global_rank]], batch_size=None)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def train(strategy: str) -> float:
    """One optimizer step on 2 CPU processes; returns ``w`` (rank 0's, brought back by the launcher)."""
    trainer = Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    model = WorkedTrace()
    trainer.fit(model)
    return float(model.w.detach())


def main() -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # no options: `--help` only
    print(f"{'strategy':<20}{'w after one step':>18}{'expected':>10}")
    ok = True
    for strategy, expected in ((f"ddp_weighted_{LAUNCHER}", 9.75), (f"ddp_{LAUNCHER}", 9.8)):
        w = train(strategy)
        ok &= abs(w - expected) < 1e-6
        print(f"{strategy:<20}{w:>18.6f}{expected:>10}")
    print("global item mean (the objective as written): w = 9.75")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
