"""A tiny causal language model on uneven shards: plain "ddp" drifts from the reference, "ddp_weighted" does not.

    python examples/tiny_lm.py --out runs/tiny_lm
    python examples/tiny_lm.py --out runs/tiny_lm_fsdp2 --sharded fsdp2  # or --sharded fsdp (FSDP1)

trains the same GRU language model, from the same initial weights on the same microbatches, three ways:

- ``reference``: one process, float64, where each optimizer step sees the union of both shards' microbatches of
  that step and minimises the mean over all their valid target tokens;
- ``ddp`` and ``ddp_weighted`` (``fsdp2`` and ``fsdp2_weighted``, ``fsdp`` and ``fsdp_weighted`` with
  ``--sharded``): two CPU processes (gloo); rank 0 holds short sequences, rank 1 long ones, so the valid-token
  counts of the ranks differ several-fold.

Every run logs to ``<out>/<run>/metrics.csv`` (Lightning's CSVLogger) and saves its parameters after every
optimizer step; the script then writes ``curves.csv``, ``summary.json`` and ``tiny_lm.png``. The three runs
share this one invocation: the DDP ones use the fork launcher (spawn where fork is unavailable), the sharded ones
(whose strategies launch by re-running the script, as ``"ddp"`` does) run as ``tiny_lm.py ... --run <name>``.
"""

from __future__ import annotations

import argparse
import csv
import faulthandler
import json
import os
import random
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from cpu_fsdp import CPUFSDPStrategy
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch import Tensor, nn

import lightning_weighted
from lightning_weighted.audit import ObjectiveAudit, is_audit_rerun

IGNORE = -100
LAUNCHER = "fork" if "fork" in torch.multiprocessing.get_all_start_methods() else "spawn"  # of the DDP runs
PLAIN = {"ddp": DDPStrategy, "fsdp2": ModelParallelStrategy, "fsdp": CPUFSDPStrategy}
WEIGHTED = {
    "ddp": lightning_weighted.WeightedDDPStrategy,
    "fsdp2": lightning_weighted.WeightedModelParallelStrategy,
    "fsdp": lightning_weighted.WeightedFSDPStrategy,
}


def runs(args: argparse.Namespace) -> tuple[str, str, str]:
    """The reference, the plain strategy and its weighted counterpart."""
    engine = args.sharded or "ddp"
    return "reference", engine, f"{engine}_weighted"


# A small grammar: S -> NP VP "." ; NP -> DET [ADJ] NOUN ; VP -> VERB NP [PREP NP]
DET, ADJ = ["the", "a"], ["big", "small", "red", "old"]
NOUN, VERB = ["cat", "dog", "bird", "fox", "mouse"], ["sees", "chases", "likes", "finds"]
PREP = ["near", "under", "behind"]
VOCAB = ["<pad>", "<bos>", "<eos>", ".", *DET, *ADJ, *NOUN, *VERB, *PREP]
INDEX = {word: i for i, word in enumerate(VOCAB)}
PAD, BOS, EOS = 0, 1, 2

Microbatch = tuple[Tensor, Tensor]  # inputs [B, T] padded with PAD, targets [B, T] padded with IGNORE


def noun_phrase(rng: random.Random) -> list[str]:
    adjective = [rng.choice(ADJ)] if rng.random() < 0.5 else []
    return [rng.choice(DET), *adjective, rng.choice(NOUN)]


def sentence(rng: random.Random) -> list[str]:
    tail = [rng.choice(PREP), *noun_phrase(rng)] if rng.random() < 0.4 else []
    return [*noun_phrase(rng), rng.choice(VERB), *noun_phrase(rng), *tail, "."]


def collate(sequences: list[list[int]]) -> Microbatch:
    length = max(len(s) for s in sequences) - 1
    inputs = torch.full((len(sequences), length), PAD)
    targets = torch.full((len(sequences), length), IGNORE)
    for row, tokens in enumerate(sequences):
        inputs[row, : len(tokens) - 1] = torch.tensor(tokens[:-1])
        targets[row, : len(tokens) - 1] = torch.tensor(tokens[1:])
    return inputs, targets


def make_shard(args: argparse.Namespace, rank: int) -> list[Microbatch]:
    """Rank 0: one sentence per sequence; rank 1: several, so rank 1 holds several times more target tokens."""
    rng = random.Random(1000 * args.seed + rank)
    sentences = (1, 1) if rank == 0 else (3, 6)
    shard = []
    for _ in range(args.steps * args.accumulate):
        sequences = []
        for _ in range(args.batch_size):
            words = [word for _ in range(rng.randint(*sentences)) for word in sentence(rng)]
            sequences.append([BOS, *(INDEX[w] for w in words), EOS])
        shard.append(collate(sequences))
    return shard


class TinyLM(LightningModule):
    def __init__(self, args: argparse.Namespace, run: str) -> None:
        super().__init__()
        self.args, self.run = args, run
        torch.manual_seed(args.seed)
        self.embed = nn.Embedding(len(VOCAB), args.embed)
        self.gru = nn.GRU(args.embed, args.hidden, batch_first=True)
        self.head = nn.Linear(args.hidden, len(VOCAB))
        self._window = [0.0, 0.0]  # Σ n · loss and Σ n over this rank's microbatches of the current window
        self.global_losses: list[float] = []  # float64, one per optimizer step

    def token_losses(self, inputs: Tensor, targets: Tensor, reduction: str) -> Tensor:
        hidden, _ = self.gru(self.embed(inputs))
        logits = self.head(hidden)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction=reduction)

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        if self.run == "reference":
            # the union of every rank's microbatches of this optimizer step: Σ token losses / Σ tokens
            count = sum((targets != IGNORE).sum() for _, targets in batch)
            loss = sum(self.token_losses(inputs, targets, "sum") for inputs, targets in batch) / count
        else:
            inputs, targets = batch
            loss = self.token_losses(inputs, targets, "mean")  # the mean over valid target tokens
            count = (targets != IGNORE).sum()
        if not is_audit_rerun():  # ObjectiveAudit re-runs training_step on audited microbatches
            self._window[0] += float(loss.detach()) * int(count)
            self._window[1] += int(count)
        return {"loss": loss, "count": count}

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        # The correctly weighted global loss of this step, whichever strategy computed the gradient.
        totals = torch.tensor(self._window, dtype=torch.float64)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(totals)
        self._window = [0.0, 0.0]
        self.global_losses.append(float(totals[0] / totals[1]))
        self.log("global_loss", self.global_losses[-1], on_step=True)
        self.log("tokens", float(totals[1]), on_step=True)

    def configure_model(self) -> None:
        if self.run.startswith("fsdp2"):  # FSDP2: each block sharded over the data-parallel ranks
            from torch.distributed.fsdp import fully_shard

            for block in (self.embed, self.gru, self.head):
                fully_shard(block, mesh=self.device_mesh["data_parallel"])

    def train_dataloader(self) -> Any:
        if self.run == "reference":
            shards = [make_shard(self.args, rank) for rank in range(2)]
            a = self.args.accumulate
            data: list[Any] = [
                [mb for shard in shards for mb in shard[step * a : (step + 1) * a]] for step in range(self.args.steps)
            ]
        else:
            data = make_shard(self.args, self.global_rank)
        return torch.utils.data.DataLoader(data, batch_size=None)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.args.lr, momentum=0.9)


class ParameterSnapshots(Callback):
    """Keeps the flattened parameters before training and after every optimizer step; rank 0 saves them.

    The file also holds the float64 global loss of every step (the CSV log rounds it to float32).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.steps = -1
        self.snapshots: list[Tensor] = []

    def _take(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.steps += 1
        with whole_parameters(trainer):  # a collective under FSDP: every rank takes part
            flat = torch.cat([_whole(p.detach()).flatten() for p in pl_module.parameters()])
        if trainer.global_rank == 0:
            self.snapshots.append(flat.clone())

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._take(trainer, pl_module)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.global_step > self.steps:  # an optimizer step just ran
            self._take(trainer, pl_module)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.global_rank == 0:
            assert isinstance(pl_module, TinyLM)
            torch.save({"params": torch.stack(self.snapshots), "loss": pl_module.global_losses}, self.path)


def whole_parameters(trainer: Trainer) -> Any:
    """FSDP1 keeps flat shards outside its forward: gather them for the block; the others need nothing."""
    from contextlib import nullcontext

    from torch.distributed.fsdp import FullyShardedDataParallel

    model = trainer.strategy.model
    if isinstance(model, FullyShardedDataParallel):
        return FullyShardedDataParallel.summon_full_params(model, writeback=False)
    return nullcontext()


def _whole(tensor: Tensor) -> Tensor:
    full_tensor = getattr(tensor, "full_tensor", None)  # FSDP2's DTensor shards
    return full_tensor() if full_tensor is not None else tensor


def make_strategy(args: argparse.Namespace, run: str) -> Any:
    engine = run.removesuffix("_weighted")
    kind = WEIGHTED[engine] if run.endswith("_weighted") else PLAIN[engine]
    timeout = timedelta(seconds=args.timeout)
    if engine == "ddp":
        return kind(start_method=LAUNCHER, timeout=timeout)
    if engine == "fsdp2":
        return kind(data_parallel_size=2, tensor_parallel_size=1, timeout=timeout)
    return kind(timeout=timeout, auto_wrap_policy={nn.Embedding, nn.GRU, nn.Linear})


def train(args: argparse.Namespace, run: str) -> None:
    out = Path(args.out)
    (out / run).mkdir(parents=True, exist_ok=True)
    callbacks: list[Callback] = [ParameterSnapshots(out / run / "record.pt")]
    if run == "reference":
        strategy: Any = "auto"
    else:
        strategy = make_strategy(args, run)
        if args.audit_every:
            callbacks.append(ObjectiveAudit(every_n_steps=args.audit_every))
    trainer = Trainer(
        accelerator="cpu",
        devices=1 if run == "reference" else 2,
        strategy=strategy,
        precision="64-true" if run == "reference" else "32-true",
        max_steps=args.steps,
        max_epochs=1,
        accumulate_grad_batches=1 if run == "reference" else args.accumulate,
        logger=CSVLogger(out, name=run, version=""),
        log_every_n_steps=1,
        callbacks=callbacks,
        use_distributed_sampler=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyLM(args, run))
    if dist.is_initialized():  # a rank in a process of its own: it leaves without the interpreter's teardown,
        sys.stdout.flush()  # where gloo's threads, still holding work, abort the process (SIGABRT)
        sys.stderr.flush()
        os._exit(0)


def rows(path: Path, column: str) -> list[dict[str, str]]:
    """The rows of a CSV log where ``column`` holds a value."""
    with open(path, newline="") as file:
        return [row for row in csv.DictReader(file) if row.get(column)]


def report(args: argparse.Namespace, seconds: dict[str, float]) -> dict[str, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(args.out)
    names = runs(args)
    records = {run: torch.load(out / run / "record.pt") for run in names}
    params = {run: record["params"].double() for run, record in records.items()}
    scale = params["reference"].norm(dim=1)
    distance = {run: ((params[run] - params["reference"]).norm(dim=1) / scale).tolist() for run in names[1:]}
    steps = list(range(len(scale)))  # 0: the initial parameters, t: after t optimizer steps
    loss = {run: records[run]["loss"] for run in names}  # loss[t]: at the parameters before step t + 1
    curves = {"step": steps, **{f"distance_{run}": distance[run] for run in names[1:]}}
    curves.update({f"loss_{run}": [*loss[run], ""] for run in names})
    with open(out / "curves.csv", "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(curves)
        writer.writerows(zip(*curves.values(), strict=True))
    audits = {run: rows(out / run / "metrics.csv", "audit/objective_error") for run in names[1:]}

    figure, axes = plt.subplots(2, 2, figsize=(12, 8.5), layout="constrained")  # room for every title
    (a, b), (c, d) = axes
    colors = dict(zip(names, ("black", "tab:red", "tab:blue"), strict=True))
    for run in names[1:]:
        a.semilogy(steps[1:], distance[run][1:], color=colors[run], label=f'"{run}"')
    a.set(title="(a) parameter distance from the reference", xlabel="optimizer step", ylabel="‖θ − θ_ref‖ / ‖θ_ref‖")
    for run in names:
        style = {"linestyle": "--", "linewidth": 2.5} if run == "reference" else {"linewidth": 1.2}
        b.plot(steps[:-1], loss[run], color=colors[run], label=run if run == "reference" else f'"{run}"', **style)
    b.set(title="(b) training loss: mean over all valid target tokens", xlabel="optimizer step", ylabel="cross-entropy")
    for run in names[1:]:
        gap = [max(abs(x - r), 1e-17) for x, r in zip(loss[run], loss["reference"], strict=True)]
        c.semilogy(steps[:-1], gap, color=colors[run], label=f'"{run}"')
    c.set(title="(c) |loss − reference loss|", xlabel="optimizer step")
    for run, audited in audits.items():
        errors = [max(float(row["audit/objective_error"]), 1e-17) for row in audited]
        d.semilogy([int(row["step"]) for row in audited], errors, "o-", color=colors[run], label=f'"{run}"')
    d.set(title="(d) ObjectiveAudit: max|g − g*| / max|g*|", xlabel="optimizer step")
    for axis in axes.flat:
        axis.legend()
        axis.grid(alpha=0.3)
    figure.suptitle(
        f"tiny GRU language model, {args.steps} optimizer steps, 2 CPU ranks of {names[1]!r} and {names[2]!r}\n"
        f"(rank 0 short sequences, rank 1 long ones), accumulate_grad_batches={args.accumulate}; reference: 1"
        " process, float64,\neach step on the union of both ranks' microbatches"
    )
    figure.savefig(out / "tiny_lm.png", dpi=100)
    plt.close(figure)

    summary = {
        "steps": args.steps,
        "final_distance": {run: distance[run][-1] for run in names[1:]},
        "max_distance": {run: max(distance[run]) for run in names[1:]},
        "final_loss": {run: loss[run][-1] for run in names},
        "audit_objective_error": {run: [float(r["audit/objective_error"]) for r in audits[run]] for run in names[1:]},
        "mean_tokens_per_rank_step": {
            f"rank{rank}": sum(int((t != IGNORE).sum()) for _, t in make_shard(args, rank)) / args.steps
            for rank in range(2)
        },
        "seconds": seconds,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/tiny_lm", help="folder for the logs, parameters and the figure")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps")
    parser.add_argument("--accumulate", type=int, default=2, help="accumulate_grad_batches of the 2-rank runs")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per microbatch")
    parser.add_argument("--embed", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.5, help="SGD learning rate (momentum 0.9)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--audit-every", type=int, default=25, help="ObjectiveAudit period in the 2-rank runs; 0: off")
    parser.add_argument("--timeout", type=float, default=120, help="process-group timeout of the 2-rank runs (s)")
    parser.add_argument("--sharded", choices=("fsdp2", "fsdp"), help="train the 2-rank runs with FSDP2 or FSDP1")
    parser.add_argument("--run", help=argparse.SUPPRESS)  # one sharded run, started by this script
    args = parser.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1` prints every thread's stack
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("tiny_lm.py draws its figure with matplotlib: `pip install matplotlib`") from None
    # A model this small gains nothing from intra-op threads, and the two ranks share the cores (spawned ranks
    # read the variable when torch starts).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    if args.run:
        train(args, args.run)
        return
    seconds = {}
    for run in runs(args):
        start = time.perf_counter()
        if run == "reference" or not args.sharded:
            train(args, run)
        else:  # its strategy's launcher re-runs this command for rank 1
            subprocess.run([sys.executable, __file__, *sys.argv[1:], "--run", run], check=True)
        seconds[run] = round(time.perf_counter() - start, 1)
    summary = report(args, seconds)
    names = runs(args)
    print(f"{args.steps} optimizer steps; distance: ‖θ − θ_ref‖ / ‖θ_ref‖ (all parameters) from the float64 reference;")
    print("loss: cross-entropy in nats, the mean over every valid target token of the step; audit: the largest")
    print("ObjectiveAudit error max|g − g*| / max|g*| of the run (g*: the gradient of the global token mean)")
    print(f"{'run':<16}{'final distance':>16}{'max distance':>14}{'final loss':>12}{'audit':>10}{'seconds':>9}")
    for run in names:
        measured = run != "reference"
        final = f"{summary['final_distance'][run]:.2e}" if measured else "-"
        largest = f"{summary['max_distance'][run]:.2e}" if measured else "-"
        audits = summary["audit_objective_error"].get(run)
        audit = f"{max(audits):.2e}" if audits else "-"
        loss, took = summary["final_loss"][run], seconds[run]
        print(f"{run:<16}{final:>16}{largest:>14}{loss:>12.6f}{audit:>10}{took:>9.1f}")
    print(f"wrote {Path(args.out) / 'curves.csv'}, summary.json, tiny_lm.png and <run>/metrics.csv")


if __name__ == "__main__":
    main()
