"""A multimodal loss as two named parts on 2 CPU processes: text tokens and image patches, each its own global mean.

A tiny model reads text tokens and image patches. Its loss has two parts, each a mean over its own items over both
ranks and every microbatch of the optimizer step: next-token cross-entropy over the text labels that are not -100,
and a squared error over the image patches the patch mask marks. The step follows the gradient of
``(1/N_text) Σ_tokens CE + (1/N_image) Σ_patches SE``. The ranks hold different mixes: rank 0 long texts and few
patches, with no patch at all in one microbatch (its image part counts 0 there while its text part trains); rank 1
short texts and many patches, with no text target in one microbatch. Three runs from the same initial weights on the
same data, 2 microbatches per optimizer step:

- ``reference``: one process, float64, each step over the union of both ranks' microbatches of that step;
- ``ddp_weighted``: ``ItemCounter(parts={"text": ItemCounter("tokens", key="labels"), "image":
  ItemCounter("tokens", key="patch_mask", mask=True)})``, ``training_step`` returning ``{"loss": text + image,
  "parts": {"text": text, "image": image}}``; ``ItemMonitor`` logs ``train/loss/<part>``, and the evaluation at the
  epoch's end ``val/loss/<part>`` and ``val/loss``;
- ``ddp``: plain DDP on ``"loss"``, the control.

It prints each run's error against the reference, ``max|θ − θ_ref| / max|θ_ref − θ_0|``, then the per-part means the
weighted run logged beside the reference's, and exits non-zero unless the weighted run sits on the reference
(< 1e-12) and the plain one does not (> 1e-3).

Usage::

    python examples/multimodal_parts.py
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from torch import Tensor, nn
from torch.utils.data import DataLoader

import lightning_weighted  # noqa: F401  (registers "ddp_weighted" and its variants)
from lightning_weighted import ItemCounter, ItemMonitor

VOCAB, PATCH, WIDTH = 16, 4, 8  # text vocabulary, features per patch, the model's width
LR, ACCUMULATE = 0.5, 2  # SGD's learning rate, microbatches per optimizer step
SHARDS = {  # rank -> its microbatches: (examples, text length, text targets per example, patches, valid patches)
    0: [(2, 10, 9, 2, 1), (3, 12, 11, 2, 0), (2, 9, 7, 3, 2), (2, 12, 12, 1, 1)],
    1: [(4, 4, 3, 6, 6), (5, 3, 0, 8, 7), (4, 5, 2, 6, 5), (6, 4, 4, 8, 8)],
}
LAUNCHER = "fork" if "fork" in torch.multiprocessing.get_all_start_methods() else "spawn"
UNIT = "max|θ − θ_ref| / max|θ_ref − θ_0|"
LOGGED = ("train/loss/text", "train/loss/image", "val/loss/text", "val/loss/image", "val/loss")

# Keep the output to the tables (in the launched ranks too): Lightning's start-up notes and a deprecation of its own.
for name in ("lightning.pytorch", "lightning.fabric"):
    logging.getLogger(name).setLevel(logging.WARNING)
warnings.filterwarnings("ignore", message=".*LeafSpec.*")


class TextAndImage(nn.Module):
    """Text tokens conditioned on the image's mean patch; each patch's target predicted from the patch itself."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.patch = nn.Embedding(VOCAB, WIDTH), nn.Linear(PATCH, WIDTH)
        self.trunk, self.text_head = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, VOCAB)
        self.image_head = nn.Linear(WIDTH, PATCH)

    def forward(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """Each part's sum over its own items in the microbatch: text tokens' cross-entropy, patches' squared error."""
        mask = batch["patch_mask"].to(batch["patches"].dtype)
        patches = self.patch(batch["patches"])
        image = (patches * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1)  # 0 without a patch
        text = torch.tanh(self.trunk(self.embed(batch["input_ids"]) + image[:, None]))
        logits = self.text_head(text)
        text_sum = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100, reduction="sum")
        error = (self.image_head(torch.tanh(self.trunk(patches))) - batch["patch_targets"]).pow(2).mean(-1)
        return text_sum, (error * mask).sum()


def shard(rank: int) -> list[dict[str, Tensor]]:
    """Rank ``rank``'s microbatches: text (the first targets of each example kept, the rest -100) and patches."""
    generator = torch.Generator().manual_seed(rank)
    batches = []
    for examples, length, targets, patches, valid in SHARDS[rank]:
        input_ids = torch.randint(0, VOCAB, (examples, length), generator=generator)
        labels = torch.randint(0, VOCAB, (examples, length), generator=generator)
        batches.append({
            "input_ids": input_ids,
            "labels": labels.masked_fill(torch.arange(length) >= targets, -100),
            "patches": torch.randn(examples, patches, PATCH, generator=generator, dtype=torch.float64),
            "patch_targets": torch.randn(examples, patches, PATCH, generator=generator, dtype=torch.float64),
            "patch_mask": (torch.arange(patches) < valid).long().expand(examples, patches),
        })  # fmt: skip
    return batches


def counts(batch: dict[str, Tensor]) -> tuple[float, float]:
    """The text targets and the valid patches of a microbatch: each part's own items."""
    return float((batch["labels"] != -100).sum()), float(batch["patch_mask"].sum())


class Multimodal(LightningModule):
    """The model, trained on each rank's shard and evaluated on it; ``"loss"`` is what plain DDP trains."""

    def __init__(self) -> None:
        super().__init__()
        self.model = TextAndImage()

    def means(self, batch: dict[str, Tensor]) -> dict[str, Any]:
        text_sum, image_sum = self.model(batch)
        text_n, image_n = (batch["labels"] != -100).sum(), batch["patch_mask"].sum()
        # each a mean over its own items, finite where the microbatch holds none (0 · loss then runs its backward)
        text, image = text_sum / text_n.clamp(min=1), image_sum / image_n.clamp(min=1)
        return {"loss": text + image, "parts": {"text": text, "image": image}}

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Any:
        return self.means(batch)

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> Any:
        return self.means(batch)  # ddp_weighted logs val/loss/<part>: each part's item mean over every rank

    def train_dataloader(self) -> DataLoader[dict[str, Tensor]]:
        return DataLoader(shard(self.global_rank), batch_size=None)

    def val_dataloader(self) -> DataLoader[dict[str, Tensor]]:
        return DataLoader(shard(self.global_rank), batch_size=None)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def flat(module: nn.Module) -> Tensor:
    return torch.cat([p.detach().double().flatten() for p in module.parameters()])


def train(strategy: str) -> tuple[Tensor, dict[str, float]]:
    """One epoch on 2 CPU processes, then the evaluation; rank 0's parameters and logged metrics."""
    weighted = "weighted" in strategy
    parts = {"text": ItemCounter("tokens", key="labels"), "image": ItemCounter("tokens", key="patch_mask", mask=True)}
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=2, precision="64-true", accumulate_grad_batches=ACCUMULATE,
        max_epochs=1, callbacks=[ItemCounter(parts=parts), ItemMonitor()] if weighted else [], logger=False,
        use_distributed_sampler=False, num_sanity_val_steps=0, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    module = Multimodal().double()  # the launcher loads rank 0's parameters back into it: float64 keeps them exact
    trainer.fit(module)
    return flat(module), {k: float(v) for k, v in trainer.callback_metrics.items() if k in LOGGED}


def part_means(model: nn.Module, held: list[dict[str, Tensor]]) -> tuple[Tensor, dict[str, float]]:
    """``Σ_k (1/N_k) Σ_items loss_k`` over ``held``, and each part's mean (a part without items: left out)."""
    sums, n = [model(batch) for batch in held], [counts(batch) for batch in held]
    objective, means = torch.zeros((), dtype=torch.float64), {}
    for k, part in enumerate(("text", "image")):
        total = sum(c[k] for c in n)
        if total > 0:  # a part with no item in the step contributes nothing
            mean = sum(s[k] for s in sums) / total
            objective, means[part] = objective + mean, float(mean.detach())
    return objective, means


def reference() -> tuple[Tensor, dict[str, float]]:
    """Float64, one process: each step over both ranks' microbatches; then the evaluation over every microbatch."""
    model = TextAndImage().double()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    shards = [shard(rank) for rank in range(2)]
    logged = {}
    for start in range(0, max(map(len, shards)), ACCUMULATE):
        objective, means = part_means(model, [b for s in shards for b in s[start : start + ACCUMULATE]])
        logged = {f"train/loss/{part}": mean for part, mean in means.items()}  # the last step's
        optimizer.zero_grad()
        objective.backward()
        optimizer.step()
    with torch.no_grad():
        objective, means = part_means(model, [b for s in shards for b in s])
    logged |= {f"val/loss/{part}": mean for part, mean in means.items()} | {"val/loss": float(objective)}
    return flat(model), logged


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="a folder for summary.json (default: print only)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the two ranks share the cores
    start, (expected, expected_logged) = flat(TextAndImage().double()), reference()
    moved = float((expected - start).abs().max())
    errors, logged = {}, {}
    for name in ("ddp_weighted", "ddp"):
        params, logged[name] = train(f"{name}_{LAUNCHER}")
        errors[name] = float((params - expected).abs().max()) / moved
    steps = -(-max(map(len, SHARDS.values())) // ACCUMULATE)
    print(f"{steps} optimizer steps, {ACCUMULATE} microbatches per rank each; error: {UNIT}")
    print(f"{'run':<16}{'error':>10}")
    for name, error in errors.items():
        print(f"{name:<16}{error:>10.1e}")
    print("\nlogged by ddp_weighted (the last step's train parts; the evaluation after it), beside the reference")
    print(f"{'metric':<18}{'ddp_weighted':>14}{'reference':>14}")
    for key in LOGGED:
        print(f"{key:<18}{logged['ddp_weighted'].get(key, float('nan')):>14.10f}{expected_logged[key]:>14.10f}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        summary = {"unit": UNIT, "error": errors, "logged": logged["ddp_weighted"], "reference": expected_logged}
        (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    logs_ok = all(abs(logged["ddp_weighted"].get(k, 0.0) - v) <= 1e-12 * abs(v) for k, v in expected_logged.items())
    return 0 if errors["ddp_weighted"] < 1e-12 and errors["ddp"] > 1e-3 and logs_ok else 1


if __name__ == "__main__":
    sys.exit(main())
