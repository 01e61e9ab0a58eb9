"""A GRPO-style loss as two named parts on 2 CPU processes: a policy token mean and a KL sequence mean, each exact.

The policy loss is the clipped surrogate ``−min(r·A, clip(r, 1 ± ε)·A)`` averaged over every valid completion token
of the optimizer step (verl's ``token-mean``); the KL term is the k3 estimate ``e^δ − δ − 1`` (``δ`` the reference
policy's log-probability minus the policy's), averaged within each sequence over its tokens, then over every
sequence that holds at least one token (verl's ``seq-mean-token-mean`` over non-empty sequences), times ``β``. Each
part has its own count, ``N_policy`` tokens and ``N_kl`` sequences over both ranks and every microbatch of the step,
and the step follows the gradient of ``(1/N_policy) Σ_tokens ℓ + (β/N_kl) Σ_sequences κ``.

Rank 0 holds few sequences with short completions, rank 1 more sequences with long ones; some sequences are fully
masked (empty: they count in neither part), and one microbatch of rank 0 holds nothing at all. Four runs from the
same initial policy on the same data, 2 microbatches per optimizer step:

- ``reference``: one process, float64, each step over the union of both ranks' microbatches of that step;
- ``ddp_weighted (Trainer)``: ``ItemCounter(parts={"policy": tokens, "kl": sequences})``, ``training_step``
  returning ``{"loss": policy + kl, "parts": {"policy": policy, "kl": kl}}``;
- ``ddp_weighted (Fabric)``: ``fabric.strategy.count_ahead({"policy": [...], "kl": [...]})`` per window, then
  ``fabric.backward(policy + kl, parts={"policy": policy, "kl": kl})`` per microbatch;
- ``ddp (Trainer)``: plain DDP on ``"loss"``, the control: it averages microbatch means over microbatches and ranks.

It prints each run's error against the reference, ``max|θ − θ_ref| / max|θ_ref − θ_0|`` (the largest parameter
error relative to the largest parameter change of the reference), and exits non-zero unless the weighted runs sit
on the reference (< 1e-12) and the plain one does not (> 1e-3).

Usage::

    python examples/grpo_parts.py
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from lightning.pytorch import LightningModule, Trainer
from torch import Tensor, nn
from torch.utils.data import DataLoader

import lightning_weighted  # noqa: F401  (registers "ddp_weighted" and its variants, Trainer and Fabric)
from lightning_weighted import ItemCounter, count_tokens

VOCAB, LENGTH = 12, 6  # the policy's vocabulary; completion positions per sequence
BETA, CLIP, LR, ACCUMULATE = 0.5, 0.2, 0.5, 2  # KL coefficient, PPO clip ε, SGD's learning rate, microbatches/step
SHARDS = {  # rank -> its microbatches, each the completion lengths of its sequences (0: an empty sequence)
    0: [[2, 0, 1], [1, 3], [0, 0], [2, 1, 0], [3], [1, 0, 2]],
    1: [[6, 5, 6, 4, 6], [5, 0, 6, 6], [6, 6, 5, 5, 6, 4], [4, 6, 6, 0], [6, 5, 6, 6, 5], [5, 6, 4]],
}
LAUNCHER = "fork" if "fork" in torch.multiprocessing.get_all_start_methods() else "spawn"
UNIT = "max|θ − θ_ref| / max|θ_ref − θ_0|"

# Keep the output to the table (in the launched ranks too): Lightning's start-up notes and a deprecation of its own.
for name in ("lightning.pytorch", "lightning.fabric"):
    logging.getLogger(name).setLevel(logging.WARNING)
warnings.filterwarnings("ignore", message=".*LeafSpec.*")


class Policy(nn.Module):
    """A tiny policy: each token's next-token distribution from its embedding, through a linear head."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed, self.head = nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB)

    def forward(self, context: Tensor, actions: Tensor) -> Tensor:
        """The log-probability of each sampled token ``actions[:, t]`` given ``context[:, t]``."""
        logprobs = self.head(self.embed(context)).log_softmax(-1)
        return logprobs.gather(-1, actions.unsqueeze(-1)).squeeze(-1)


def count_sequences(batch: dict[str, Tensor]) -> Tensor:
    """The non-empty sequences of a microbatch: those with at least one valid completion token."""
    return (batch["mask"].sum(-1) > 0).sum()


def shard(rank: int) -> list[dict[str, Tensor]]:
    """Rank ``rank``'s microbatches: sampled completions, their masks, advantages, behaviour and reference logprobs."""
    generator = torch.Generator().manual_seed(rank)
    behaviour, reference_policy = Policy(seed=0).double(), Policy(seed=1).double()  # sampled by; the KL's anchor
    batches = []
    for lengths in SHARDS[rank]:
        tokens = torch.randint(0, VOCAB, (len(lengths), LENGTH + 1), generator=generator)
        context, actions = tokens[:, :-1], tokens[:, 1:]  # a prompt token, then the completion
        with torch.no_grad():
            old, ref = behaviour(context, actions), reference_policy(context, actions)
        batches.append({
            "context": context,
            "actions": actions,
            "mask": torch.arange(LENGTH) < torch.tensor(lengths)[:, None],  # valid completion tokens
            "advantages": torch.randn(len(lengths), generator=generator, dtype=torch.float64),  # one per sequence
            "old_logprobs": old,
            "ref_logprobs": ref,
        })  # fmt: skip
    return batches


def part_sums(logprobs: Tensor, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """The microbatch's sum of the clipped policy loss over its valid tokens, and of ``β ×`` each non-empty
    sequence's token-mean KL over its sequences."""
    mask = batch["mask"].to(logprobs.dtype)
    ratio = torch.exp(logprobs - batch["old_logprobs"])
    advantages = batch["advantages"].unsqueeze(-1)
    policy = -torch.min(ratio * advantages, ratio.clamp(1 - CLIP, 1 + CLIP) * advantages)
    delta = batch["ref_logprobs"] - logprobs
    kl = torch.exp(delta) - delta - 1  # k3: unbiased, ≥ 0
    per_sequence = (kl * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # a sequence's token mean (0 where empty)
    return (policy * mask).sum(), BETA * per_sequence.sum()


def part_means(policy: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """Each part's mean over its own items in the microbatch, finite where it holds none (``clamp(min=1)``)."""
    policy_sum, kl_sum = part_sums(policy(batch["context"], batch["actions"]), batch)
    tokens, sequences = count_tokens(batch, "mask", mask=True), count_sequences(batch)
    return policy_sum / tokens.clamp(min=1), kl_sum / sequences.clamp(min=1)


class GRPO(LightningModule):
    """The policy, trained on each rank's own shard; ``"loss"`` is what plain DDP trains, ``"parts"`` the weighted."""

    def __init__(self) -> None:
        super().__init__()
        self.policy = Policy()

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Any:
        policy, kl = part_means(self.policy, batch)
        return {"loss": policy + kl, "parts": {"policy": policy, "kl": kl}}

    def train_dataloader(self) -> DataLoader[dict[str, Tensor]]:
        return DataLoader(shard(self.global_rank), batch_size=None)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def flat(module: nn.Module) -> Tensor:
    return torch.cat([p.detach().double().flatten() for p in module.parameters()])


def train_trainer(strategy: str) -> Tensor:
    """One epoch on 2 CPU processes through the Trainer; returns rank 0's parameters (the launcher brings them)."""
    counter = ItemCounter(parts={"policy": ItemCounter("tokens", key="mask", mask=True), "kl": count_sequences})
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=2, precision="64-true", accumulate_grad_batches=ACCUMULATE,
        max_epochs=1, callbacks=[counter] if "weighted" in strategy else [], use_distributed_sampler=False,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    module = GRPO().double()  # the launcher loads rank 0's parameters back into it: float64 keeps them exact
    trainer.fit(module)
    return flat(module)


def fabric_loop(fabric: Fabric) -> list[float]:
    """One rank of the Fabric loop: each window's counts handed over ahead, one part per loss."""
    policy = Policy().double()  # float64 itself: Fabric's "64-true" would hand back float32 outputs
    model, optimizer = fabric.setup(policy, torch.optim.SGD(policy.parameters(), lr=LR))
    loader = DataLoader(shard(fabric.global_rank), batch_size=None)  # each rank holds its own shard already
    batches = iter(fabric.setup_dataloaders(loader, use_distributed_sampler=False))
    for window in iter(lambda: list(itertools.islice(batches, ACCUMULATE)), []):
        tokens = [count_tokens(batch, "mask", mask=True) for batch in window]
        fabric.strategy.count_ahead({"policy": tokens, "kl": [count_sequences(b) for b in window]}, integer=True)
        for i, batch in enumerate(window):
            with fabric.no_backward_sync(model, enabled=i < len(window) - 1):
                policy, kl = part_means(model, batch)
                fabric.backward(policy + kl, parts={"policy": policy, "kl": kl})
        optimizer.step()
        optimizer.zero_grad()
    return flat(model).tolist()


def train_fabric() -> Tensor:
    fabric = Fabric(strategy=f"ddp_weighted_{LAUNCHER}", accelerator="cpu", devices=2)
    return torch.tensor(fabric.launch(fabric_loop), dtype=torch.float64)


def reference() -> Tensor:
    """Float64, one process: each step follows ``Σ_k (1/N_k) Σ_items loss_k`` over both ranks' microbatches."""
    policy = Policy().double()
    optimizer = torch.optim.SGD(policy.parameters(), lr=LR)
    shards = [shard(rank) for rank in range(2)]
    for start in range(0, max(map(len, shards)), ACCUMULATE):
        held = [batch for microbatches in shards for batch in microbatches[start : start + ACCUMULATE]]
        sums = [part_sums(policy(b["context"], b["actions"]), b) for b in held]
        counts = [(float(count_tokens(b, "mask", mask=True)), float(count_sequences(b))) for b in held]
        objective = torch.zeros((), dtype=torch.float64)
        for k in range(2):  # policy, kl
            total = sum(n[k] for n in counts)
            if total > 0:  # a part with no item in the step contributes nothing
                objective = objective + sum(s[k] for s in sums) / total
        optimizer.zero_grad()
        objective.backward()
        optimizer.step()
    return flat(policy)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="a folder for summary.json (default: print only)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the two ranks share the cores
    start, expected = flat(Policy().double()), reference()
    moved = float((expected - start).abs().max())
    runs = {
        "ddp_weighted (Trainer)": lambda: train_trainer(f"ddp_weighted_{LAUNCHER}"),
        "ddp_weighted (Fabric)": train_fabric,
        "ddp (Trainer)": lambda: train_trainer(f"ddp_{LAUNCHER}"),
    }
    errors = {name: float((run() - expected).abs().max()) / moved for name, run in runs.items()}
    steps = -(-max(map(len, SHARDS.values())) // ACCUMULATE)
    print(f"{steps} optimizer steps, {ACCUMULATE} microbatches per rank each; error: {UNIT}")
    print(f"{'run':<26}{'error':>10}")
    for name, error in errors.items():
        print(f"{name:<26}{error:>10.1e}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "summary.json").write_text(json.dumps({"unit": UNIT, "error": errors}, indent=2))
    weighted_ok = all(e < 1e-12 for n, e in errors.items() if n.startswith("ddp_weighted"))
    return 0 if weighted_ok and errors["ddp (Trainer)"] > 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
