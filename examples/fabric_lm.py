"""The tiny causal language model of ``tiny_lm.py`` as a Fabric loop: ``"ddp"`` drifts, ``"ddp_weighted"`` does not.

    python examples/fabric_lm.py --out runs/fabric_lm

trains one GRU language model, from the same initial weights on the same microbatches, three ways:

- ``reference``: one process, float64, where each optimizer step sees the union of both shards' microbatches of
  that step and minimises the mean over all their valid target tokens;
- ``ddp`` and ``ddp_weighted``: two CPU processes (gloo, Fabric's fork launcher) running the same loop, with
  ``fabric.no_backward_sync`` for every microbatch of a window but the last. Rank 0 holds short sequences, rank 1
  long ones, so the ranks' valid-token counts differ several-fold. Plain ``"ddp"`` backpropagates
  ``loss / accumulate``, as a Fabric loop does; ``"ddp_weighted"`` backpropagates ``fabric.backward(loss,
  count=n)`` with ``n`` the microbatch's valid target tokens.

It prints each run's distance from the reference, ``‖θ − θ_ref‖ / ‖θ_ref‖`` after the last step and the largest
over all steps, and writes ``summary.json`` (and each 2-process run's parameter snapshots) to ``--out``.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy
from tiny_lm import IGNORE, VOCAB, make_shard
from torch import Tensor, nn

import lightning_weighted
from lightning_weighted import count_tokens

RUNS = ("reference", "ddp", "ddp_weighted")


class GRULanguageModel(nn.Module):
    """``tiny_lm.py``'s model: token embedding, one GRU layer, a linear head over the vocabulary."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        torch.manual_seed(args.seed)
        self.embed = nn.Embedding(len(VOCAB), args.embed)
        self.gru = nn.GRU(args.embed, args.hidden, batch_first=True)
        self.head = nn.Linear(args.hidden, len(VOCAB))

    def forward(self, inputs: Tensor, targets: Tensor, reduction: str = "mean") -> Tensor:
        hidden, _ = self.gru(self.embed(inputs))
        logits = self.head(hidden)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction=reduction)


def flat(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().double().flatten() for p in model.parameters()])


def reference(args: argparse.Namespace) -> dict[str, Any]:
    """One float64 process: each optimizer step on the union of both shards' microbatches of that step."""
    model = GRULanguageModel(args).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    shards = [make_shard(args, rank) for rank in range(2)]
    a, snapshots, losses = args.accumulate, [flat(model)], []
    for step in range(args.steps):
        held = [mb for shard in shards for mb in shard[step * a : (step + 1) * a]]
        tokens = sum(count_tokens(mb, 1) for mb in held)
        loss = sum(model(inputs, targets, "sum") for inputs, targets in held) / tokens
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        snapshots.append(flat(model))
    return {"params": torch.stack(snapshots), "loss": losses}


def train(fabric: Fabric, args: argparse.Namespace, run: str) -> None:
    """One rank of a 2-process run; rank 0 saves the snapshots to ``<out>/<run>.pt``."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    torch.set_num_threads(1)
    model = GRULanguageModel(args)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9))
    loader = fabric.setup_dataloaders(
        torch.utils.data.DataLoader(make_shard(args, fabric.global_rank), batch_size=None),
        use_distributed_sampler=False,  # each rank holds its own shard already
    )
    a, snapshots, losses = args.accumulate, [flat(model)], []
    window = torch.zeros(2, dtype=torch.float64)  # Σ n · loss and Σ n over this rank's microbatches of the window
    for index, (inputs, targets) in enumerate(loader):
        last = (index + 1) % a == 0
        with fabric.no_backward_sync(model, enabled=not last):
            loss = model(inputs, targets)  # the mean over this microbatch's valid target tokens
            tokens = count_tokens((inputs, targets), 1)
            if run == "ddp_weighted":
                fabric.backward(loss, count=tokens)
            else:
                fabric.backward(loss / a)
        window += torch.stack([loss.detach().double() * tokens, tokens.double()])
        if not last:
            continue
        optimizer.step()
        optimizer.zero_grad()
        totals = fabric.all_reduce(window, reduce_op="sum")  # the global token mean of the loss, for either run
        losses.append(float(totals[0] / totals[1]))
        window.zero_()
        snapshots.append(flat(model))
    if fabric.global_rank == 0:  # a file: Fabric's spawn launcher returns results through a pipe of limited size
        torch.save({"params": torch.stack(snapshots), "loss": losses}, Path(args.out) / f"{run}.pt")


def run_two_ranks(args: argparse.Namespace, run: str) -> dict[str, Any]:
    # Fabric(strategy="ddp_weighted_fork") is the same strategy; the instance sets a short process-group timeout.
    # Forked ranks start at once, as this process has imported everything (spawn where fork is unavailable).
    start_method = "fork" if "fork" in torch.multiprocessing.get_all_start_methods() else "spawn"
    kind = lightning_weighted.WeightedFabricDDPStrategy if run == "ddp_weighted" else DDPStrategy
    strategy = kind(start_method=start_method, timeout=timedelta(seconds=args.timeout))
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch(train, args, run)
    record: dict[str, Any] = torch.load(Path(args.out) / f"{run}.pt")
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/fabric_lm", help="folder for summary.json")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps")
    parser.add_argument("--accumulate", type=int, default=2, help="microbatches per optimizer step and rank")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per microbatch")
    parser.add_argument("--embed", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.5, help="SGD learning rate (momentum 0.9)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=120, help="process-group timeout of the 2-rank runs (s)")
    args = parser.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1` prints every thread's stack
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the two ranks share the cores
    torch.set_num_threads(1)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    records, seconds = {}, {}
    for run in RUNS:
        start = time.perf_counter()
        records[run] = reference(args) if run == "reference" else run_two_ranks(args, run)
        seconds[run] = round(time.perf_counter() - start, 1)
    expected = records["reference"]["params"]
    scale = expected.norm(dim=1)
    distance = {run: ((records[run]["params"] - expected).norm(dim=1) / scale).tolist() for run in RUNS[1:]}
    summary = {
        "steps": args.steps,
        "final_distance": {run: distance[run][-1] for run in RUNS[1:]},
        "max_distance": {run: max(distance[run]) for run in RUNS[1:]},
        "final_loss": {run: records[run]["loss"][-1] for run in RUNS},
        "seconds": seconds,
    }
    (Path(args.out) / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"{args.steps} optimizer steps; distance: ‖θ − θ_ref‖ / ‖θ_ref‖ (all parameters) from the float64 reference;")
    print("loss: cross-entropy in nats, the mean over every valid target token of the last step")
    print(f"{'run':<14}{'final distance':>16}{'max distance':>14}{'final loss':>12}")
    for run in RUNS:
        final = summary["final_distance"].get(run, 0.0)
        largest = summary["max_distance"].get(run, 0.0)
        print(f"{run:<14}{final:>16.2e}{largest:>14.2e}{summary['final_loss'][run]:>12.6f}")


if __name__ == "__main__":
    main()
