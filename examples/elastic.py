"""A run that survives losing a node: torchrun restarts it on the ranks left, and it resumes from its last checkpoint.

Launch it once per node under torchrun's elastic agent (``--nnodes=MIN:MAX``, ``--max-restarts``, a c10d
rendezvous). When a node dies, the survivors' collectives fail, their agents meet again without it and restart the
script on fewer ranks; when a node joins, the running agents restart it on more. Either way the script resumes from
``last.ckpt``: ``ddp_weighted`` trains the rest of the interrupted epoch's items, each once, dealt over the ranks
there are now, and every step stays the mean over all of its items::

    torchrun --nnodes=1:2 --nproc_per_node=1 --max-restarts=3 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:29400 --rdzv-id=job42 examples/elastic.py --out /shared/run

Each step's items are one token mask per item, so ranks hold different numbers of valid items. ``--record`` writes
what every step trained (one JSON line per microbatch) and the final parameters, which ``tests/test_examples.py``
checks against a float64 reference; ``--stop-at-step S`` makes the node it is given to die at step ``S`` of its
first run, its agent with it, as a lost machine does.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

import lightning_weighted  # noqa: F401  (registers "ddp_weighted")


def item(i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Item ``i``: 4 inputs, a target, and 1 or 0: whether its target token counts (about two in three do)."""
    x = torch.sin(torch.arange(4, dtype=torch.float64) * 0.7 + i)
    return x, torch.cos(torch.tensor(0.37 * i, dtype=torch.float64)), torch.tensor(float(i % 3 != 1)), i


class Items(Dataset[Any]):
    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> Any:
        return item(i)


def masked_mean(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The mean squared error over the batch's valid items (0 where none is)."""
    losses = 0.5 * (model(x).squeeze(-1) - y) ** 2
    return (losses * w).sum() / w.sum().clamp(min=1)


class Regression(LightningModule):
    def __init__(self, items: int = 96, batch_size: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model, self.items, self.batch_size = torch.nn.Linear(4, 1).double(), items, batch_size

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y, w, _ = batch
        return {"loss": masked_mean(self.model, x, y, w), "count": w.sum()}  # the mean over `count` valid items

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(Items(self.items), batch_size=self.batch_size, shuffle=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Record(Callback):
    """Writes what every microbatch trained, one JSON line each, to a file of this process's own.

    A run's first line says the step it starts from and its number of ranks; ``round`` (its rendezvous's port) tells
    the runs of one rendezvous from the next. ``stop_at``: this process dies at that step, its agent with it.
    """

    def __init__(self, out: Path, stop_at: int | None, pace: float) -> None:
        self.out, self.stop_at, self.pace = out, stop_at, pace
        self.path = out / f"steps.round{os.environ.get('MASTER_PORT', 0)}.rank{os.environ.get('RANK', 0)}.jsonl"

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._write({"start": trainer.global_step, "world": trainer.world_size})

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.stop_at:
            os.kill(os.getppid(), signal.SIGKILL)  # the node is lost: its agent and its worker die at once
            os._exit(1)
        replay = trainer.strategy.padding_step  # type: ignore[attr-defined]
        self._write({"step": trainer.global_step, "epoch": trainer.current_epoch, "ids": batch[3].tolist(),
                     "replay": replay})  # fmt: skip
        time.sleep(self.pace)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.is_global_zero:
            torch.save([p.detach() for p in pl_module.parameters()], self.out / "parameters.pt")

    def _write(self, line: dict[str, Any]) -> None:
        with self.path.open("a") as file:
            file.write(json.dumps(line) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the checkpoints' folder, shared by every node")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--every", type=int, default=3, help="optimizer steps between checkpoints")
    parser.add_argument("--record", action="store_true", help="write what each step trained, and the parameters")
    parser.add_argument("--stop-at-step", type=int, help="this node dies at this optimizer step of a fresh run")
    parser.add_argument("--pace", type=float, default=0.0, help="seconds each recorded batch takes at least")
    args = parser.parse_args()

    first_run = not (Path(args.out) / "last.ckpt").exists()  # a run restarted by its agent resumes from it
    callbacks: list[Callback] = [ModelCheckpoint(dirpath=args.out, every_n_train_steps=args.every, save_last=True)]
    if args.record:
        callbacks.append(Record(Path(args.out), args.stop_at_step if first_run else None, args.pace))
    trainer = Trainer(
        strategy="ddp_weighted", accelerator="cpu", devices=1, num_nodes=int(os.environ.get("WORLD_SIZE", 1)),
        precision="64-true", max_epochs=args.epochs, accumulate_grad_batches=2, callbacks=callbacks, logger=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Regression(), ckpt_path="last")  # the last checkpoint if there is one: a restarted run resumes
    if trainer.is_global_zero:
        print(f"finished: {trainer.global_step} steps on {trainer.world_size} rank(s)", flush=True)


if __name__ == "__main__":
    main()
