"""A Hugging Face causal LM with an auxiliary loss on uneven shards: the weighted strategy sits on the reference.

    python examples/hf_lm.py --out runs/hf_lm                    # DDP, padded microbatches
    python examples/hf_lm.py --out runs/hf_lm --engine fsdp2      # FSDP2: the tied wte/lm_head sharded with the root
    python examples/hf_lm.py --out runs/hf_lm --packed            # padding-free: DataCollatorWithFlattening

trains one tiny, randomly initialised GPT-2 (``transformers``; ``wte`` and ``lm_head`` tied) from the same weights
on the same documents three ways, and prints how far each run's parameters end from the reference's (the largest
difference of any parameter, relative to the largest reference parameter, ``max|θ − θ_ref| / max|θ_ref|``):

- ``reference``: one process, float64, each optimizer step over the union of both shards' microbatches of that
  step: the mean over all their target tokens of the token loss, plus an auxiliary z-loss averaged over the step's
  microbatches and ranks, as plain DDP averages a loss (Megatron-Core's convention for its MoE auxiliary losses);
- ``weighted``: ``"ddp_weighted"`` (or ``"fsdp2_weighted"``) on two CPU processes; ``ItemCounter`` counts each
  microbatch's target tokens ahead (``labels[..., 1:] != -100``, the loss's own denominator), ``training_step``
  returns Hugging Face's own ``out.loss`` (a token mean) and the z-loss under ``"aux"``;
- ``plain``: ``"ddp"`` (or ``"fsdp2"``) with the z-loss added into the loss, as a Hugging Face MoE model adds its
  ``router_aux_loss_coef * aux_loss`` into ``out.loss``.

Rank 0 holds short documents, rank 1 long ones. With ``--packed`` every microbatch is one row of its documents
flattened (``position_ids`` restarting at 0 for each, ``-100`` at each boundary); a block-diagonal attention mask
built from the positions keeps documents apart, so the packed runs train what the padded ones train.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch import Tensor

import lightning_weighted
from lightning_weighted import shard_blocks

VOCAB, IGNORE = 64, -100
UNIT = "max|θ − θ_ref| / max|θ_ref| over all parameters"
LAUNCHER = "fork" if "fork" in torch.multiprocessing.get_all_start_methods() else "spawn"


def gpt2() -> torch.nn.Module:
    """A two-block GPT-2, its embedding and output layer tied (Hugging Face's default)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # no dropout: every run computes the same function
    )  # fmt: skip
    config.attn_implementation = "eager"  # float64 and a custom mask alike; SDPA gives the same
    return GPT2LMHeadModel(config)


def documents(rank: int, step: int, microbatch: int) -> list[list[int]]:
    """Rank 0's microbatches hold two short documents, rank 1's three long ones: token counts differ several-fold."""
    rng = random.Random(1000 * step + 10 * microbatch + rank)
    lengths = [rng.randint(3, 6) for _ in range(2)] if rank == 0 else [rng.randint(10, 20) for _ in range(3)]
    return [[rng.randrange(1, VOCAB) for _ in range(n)] for n in lengths]


def padded(docs: list[list[int]]) -> dict[str, Tensor]:
    longest = max(map(len, docs))
    ids = torch.zeros(len(docs), longest, dtype=torch.long)
    labels = torch.full((len(docs), longest), IGNORE)
    for row, doc in enumerate(docs):
        ids[row, : len(doc)], labels[row, : len(doc)] = torch.tensor(doc), torch.tensor(doc)
    return {"input_ids": ids, "labels": labels, "attention_mask": (labels != IGNORE).long()}


def packed(docs: list[list[int]]) -> dict[str, Tensor]:
    from transformers import DataCollatorWithFlattening

    return dict(DataCollatorWithFlattening()([{"input_ids": doc} for doc in docs]))


def block_diagonal(position_ids: Tensor, dtype: torch.dtype) -> Tensor:
    """The additive 4-D attention mask of packed documents: causal within each, nothing across (0 or -inf)."""
    document = torch.cumsum(position_ids == 0, dim=-1)  # [batch, T]: which document each token is in
    same = document[..., :, None] == document[..., None, :]
    causal = torch.ones_like(same).tril()
    return torch.zeros(same.shape, dtype=dtype).masked_fill(~(same & causal), float("-inf"))[:, None]


def microbatches(args: argparse.Namespace, rank: int) -> list[dict[str, Tensor]]:
    make = packed if args.packed else padded
    return [make(documents(rank, s, m)) for s in range(args.steps) for m in range(args.accumulate)]


class HuggingFaceLM(LightningModule):
    def __init__(self, args: argparse.Namespace, run: str) -> None:
        super().__init__()
        self.args, self.run = args, run
        self.model = gpt2()

    def configure_model(self) -> None:
        if self.args.engine == "fsdp2" and self.run != "reference":
            shard_blocks(self.model, self.device_mesh)  # the blocks, then the root, which holds the tied weight

    def forward(self, batch: dict[str, Tensor]) -> Any:
        inputs = {key: value for key, value in batch.items() if key != "labels"}
        if "position_ids" in batch:  # packed: keep documents apart
            inputs["attention_mask"] = block_diagonal(batch["position_ids"], self.dtype)
        return self.model(**inputs, labels=batch["labels"])

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Any:
        out = self(batch)  # out.loss: the mean over this microbatch's target tokens, as Hugging Face computes it
        z_loss = self.args.z * out.logits.logsumexp(-1).pow(2).mean()  # a router-style z-loss of the microbatch
        if self.run == "plain":
            return out.loss + z_loss  # one loss, as a Hugging Face MoE model returns it
        return {"loss": out.loss, "aux": {"z": z_loss}}

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(microbatches(self.args, self.global_rank), batch_size=None)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.args.lr)


def reference(args: argparse.Namespace) -> list[Tensor]:
    """The objective as written, in float64 on one process: token mean over every rank, auxiliary mean over P·M."""
    module = HuggingFaceLM(args, "reference").double()
    optimizer = module.configure_optimizers()
    shards = [microbatches(args, rank) for rank in range(2)]
    for step in range(args.steps):
        window = [shard[step * args.accumulate + m] for shard in shards for m in range(args.accumulate)]
        optimizer.zero_grad()
        losses, tokens, aux = [], [], []
        for batch in window:
            out = module(batch)
            n = int((batch["labels"][..., 1:] != IGNORE).sum())  # the tokens out.loss averages over
            losses.append(out.loss * n)
            tokens.append(n)
            aux.append(args.z * out.logits.logsumexp(-1).pow(2).mean())
        (sum(losses) / sum(tokens) + sum(aux) / len(window)).backward()
        optimizer.step()
    return [p.detach() for p in module.model.parameters()]


class SaveParameters(Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        whole = [getattr(p, "full_tensor", lambda p=p: p)().detach().clone() for p in pl_module.model.parameters()]
        if trainer.global_rank == 0:
            torch.save(whole, self.path)


def train(args: argparse.Namespace, run: str) -> None:
    weighted = run == "weighted"
    timeout = timedelta(seconds=args.timeout)
    if args.engine == "fsdp2":
        cls = lightning_weighted.WeightedModelParallelStrategy if weighted else ModelParallelStrategy
        strategy: Any = cls(data_parallel_size=2, tensor_parallel_size=1, timeout=timeout)
    else:
        cls = lightning_weighted.WeightedDDPStrategy if weighted else DDPStrategy
        strategy = cls(start_method=LAUNCHER, timeout=timeout)
    callbacks: list[Callback] = [SaveParameters(Path(args.out) / f"{run}.pt")]
    if weighted:
        callbacks.append(lightning_weighted.ItemCounter("tokens", key="labels", shift=True))
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=args.steps,
        accumulate_grad_batches=args.accumulate,
        callbacks=callbacks,
        logger=False,
        use_distributed_sampler=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(HuggingFaceLM(args, run))
    if torch.distributed.is_initialized():  # a rank in a process of its own: it leaves without the interpreter's
        sys.stdout.flush()  # teardown, where gloo's threads, still holding work, abort the process (SIGABRT)
        sys.stderr.flush()
        os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/hf_lm", help="folder for the parameters and summary.json")
    parser.add_argument("--engine", choices=("ddp", "fsdp2"), default="ddp")
    parser.add_argument("--packed", action="store_true", help="padding-free microbatches: one row of documents")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps")
    parser.add_argument("--accumulate", type=int, default=2, help="microbatches per optimizer step")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate")
    parser.add_argument("--z", type=float, default=1e-3, help="the z-loss coefficient")
    parser.add_argument("--timeout", type=float, default=120, help="process-group timeout (s)")
    parser.add_argument("--run", help=argparse.SUPPRESS)  # one 2-rank run, started by this script
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    if args.run:
        train(args, args.run)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    expected = reference(args)
    summary: dict[str, Any] = {"engine": args.engine, "packed": args.packed, "steps": args.steps, "unit": UNIT}
    for run in ("weighted", "plain"):  # each strategy's launcher re-runs this command for rank 1
        subprocess.run([sys.executable, __file__, *sys.argv[1:], "--run", run], check=True)
        params = torch.load(out / f"{run}.pt")
        scale = max(float(e.abs().max()) for e in expected)
        summary[run] = max(float((p.double() - e).abs().max()) for p, e in zip(params, expected, strict=True)) / scale
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"{args.steps} Adam steps, {'packed' if args.packed else 'padded'} microbatches; distance from the float64")
    print(f"reference after the last step, {UNIT}:")
    print(f"{'weighted':<10}{summary['weighted']:>10.2e}  ({args.engine}_weighted, z-loss under 'aux')")
    print(f"{'plain':<10}{summary['plain']:>10.2e}  ({args.engine}, z-loss inside the loss)")
    print(f"wrote {out / 'summary.json'}")


if __name__ == "__main__":
    main()
