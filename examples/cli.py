"""Train with ``ddp_weighted`` from the command line through Lightning's ``LightningCLI``.

The model is a small next-token classifier over padded sequences of uneven length: the loss of a batch is
the mean over its unpadded tokens (``F.cross_entropy(..., ignore_index=-100)``), and ``training_step``
returns that mean together with the number of tokens behind it, so every optimizer step minimises the
mean over all unpadded tokens of all ranks. Any other ``LightningModule`` can be passed with ``--model``.

Needs ``jsonargparse[signatures]`` (``pip install -e '.[examples]'`` in a clone). Usage::

    # the registered strategy name, 2 CPU processes
    python examples/cli.py fit --trainer.accelerator cpu --trainer.devices 2 --trainer.strategy ddp_weighted

    # the class, with arguments (its own and those of Lightning's DDPStrategy); `timeout` is H:MM:SS
    python examples/cli.py fit --trainer.accelerator cpu --trainer.devices 2 \\
        --trainer.strategy lightning_weighted.WeightedDDPStrategy \\
        --trainer.strategy.find_unused_parameters true --trainer.strategy.timeout 0:05:00

    # print the full configuration, then run from it
    python examples/cli.py fit --trainer.strategy ddp_weighted --print_config > config.yaml
    python examples/cli.py fit --config config.yaml

A class path given without any argument (``--trainer.strategy lightning_weighted.WeightedDDPStrategy``
alone) is read as a strategy *name* and rejected by the ``Trainer``; add one argument, or write
``class_path:`` in a config file, or use the name ``ddp_weighted``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from jsonargparse.typing import lazy_instance
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_weighted  # noqa: F401  (registers "ddp_weighted" before the Trainer is built)

PAD = -100  # the target of a padding position: ignored by `cross_entropy` and not counted


class NextTokenClassifier(LightningModule):
    """Predicts ``(3 * token + 1) % vocab_size`` at every position of padded random sequences.

    Args:
        vocab_size: number of token ids.
        hidden: width of the embedding.
        sequences: number of training sequences.
        max_length: sequences are 1 to ``max_length`` tokens long, padded to ``max_length``.
        batch_size: sequences per microbatch.
        lr: SGD learning rate.
        seed: seed of the synthetic data set.
    """

    def __init__(
        self,
        vocab_size: int = 16,
        hidden: int = 32,
        sequences: int = 256,
        max_length: int = 24,
        batch_size: int = 8,
        lr: float = 0.5,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.vocab_size, self.sequences, self.max_length = vocab_size, sequences, max_length
        self.batch_size, self.lr, self.seed = batch_size, lr, seed
        self.embedding = nn.Embedding(vocab_size, hidden)
        self.head = nn.Linear(hidden, vocab_size)

    def forward(self, tokens: Tensor) -> Tensor:
        logits: Tensor = self.head(torch.tanh(self.embedding(tokens)))
        return logits

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> dict[str, Any]:
        tokens, targets = batch
        logits = self(tokens)
        # the mean over this microbatch's unpadded tokens, and how many there are
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=PAD)
        count = (targets != PAD).sum()
        self.log("train_loss", loss, prog_bar=True, batch_size=tokens.shape[0])
        return {"loss": loss, "count": count}

    def train_dataloader(self) -> DataLoader[tuple[Tensor, ...]]:
        generator = torch.Generator().manual_seed(self.seed)
        tokens = torch.randint(0, self.vocab_size, (self.sequences, self.max_length), generator=generator)
        targets = (3 * tokens + 1) % self.vocab_size
        lengths = torch.randint(1, self.max_length + 1, (self.sequences, 1), generator=generator)
        padding = torch.arange(self.max_length) >= lengths
        tokens = tokens.masked_fill(padding, 0)
        targets = targets.masked_fill(padding, PAD)
        # the distributed sampler shards the sequences across ranks: token counts differ per rank and batch
        return DataLoader(TensorDataset(tokens, targets), batch_size=self.batch_size, shuffle=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class WeightedCLI(LightningCLI):
    """``LightningCLI`` whose model defaults to :class:`NextTokenClassifier` and whose strategy to ``ddp_weighted``."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Sets the defaults; every one can be overridden on the command line or in a config file."""
        parser.set_defaults({"model": lazy_instance(NextTokenClassifier), "trainer.strategy": "ddp_weighted"})


def main(args: ArgsType = None, run: bool = True) -> WeightedCLI:
    """Builds the CLI (and runs its subcommand when ``run``); ``args`` replaces ``sys.argv[1:]``."""
    return WeightedCLI(
        model_class=None,  # any LightningModule, chosen with `--model`
        seed_everything_default=0,
        args=args,
        run=run,
        save_config_kwargs={"overwrite": True},
    )


if __name__ == "__main__":
    main()
