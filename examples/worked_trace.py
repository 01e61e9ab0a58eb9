"""The worked trace, trained for real on 2 CPU processes: ``ddp_weighted`` gives w = 9.75, plain ``ddp`` 9.8.

One parameter ``w = 10``, per-item loss ``½(w − y)²``. Rank 0 holds targets ``[9, 9]`` (2 items, mean
gradient 1), rank 1 holds ``[7] * 6`` (6 items, mean gradient 3). The mean over all 8 items has gradient
``(2·1 + 6·3) / 8 = 2.5``; plain DDP averages the two rank means, ``(1 + 3) / 2 = 2``. One SGD step with
lr 0.1 lands on ``10 − 0.25 = 9.75`` (weighted) or ``10 − 0.2 = 9.8`` (plain).

Usage::

    python examples/worked_trace.py                          # both strategies, side by side
    python examples/worked_trace.py --strategy ddp_weighted  # one 2-process run, prints a JSON line
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader

import lightning_weighted  # noqa: F401  (registers "ddp_weighted")

TARGETS = {0: [9.0, 9.0], 1: [7.0] * 6}


class OneParameter(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(10.0))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> dict[str, Any]:
        loss = (0.5 * (self.w - batch) ** 2).mean()
        return {"loss": loss, "count": len(batch)}

    def train_dataloader(self) -> DataLoader[torch.Tensor]:
        # one microbatch holding this rank's targets
        return DataLoader([torch.tensor(TARGETS[self.global_rank])], batch_size=None)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def train(strategy: str) -> None:
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
    model = OneParameter()
    trainer.fit(model)
    if trainer.global_rank == 0:
        print(json.dumps({"strategy": strategy, "w": model.w.item()}))


def side_by_side() -> int:
    expected = {"ddp_weighted": 9.75, "ddp": 9.8}
    print(f"{'strategy':<14}{'w after one step':>18}{'expected':>10}")
    ok = True
    for strategy, want in expected.items():
        run = subprocess.run(
            [sys.executable, __file__, "--strategy", strategy], capture_output=True, text=True, timeout=300
        )
        lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
        if run.returncode != 0 or not lines:
            print(run.stdout, run.stderr, file=sys.stderr)
            return 1
        w = json.loads(lines[-1])["w"]
        ok &= abs(w - want) < 1e-6
        print(f"{strategy:<14}{w:>18.6f}{want:>10}")
    print("global item mean (the objective as written): w = 9.75")
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", help="run one 2-process training with this strategy")
    args = parser.parse_args()
    if args.strategy:
        train(args.strategy)
    else:
        sys.exit(side_by_side())
