"""End-to-end Lightning ``Trainer`` step benchmark: one rank's worker (started by ``run.py`` on every rank).

Each variant is a whole ``Trainer.fit`` (``strategy="ddp"`` or ``"ddp_weighted"``) running in its own thread of
this process, all in one gloo process group that the worker creates (Lightning sees ``LOCAL_RANK`` and joins
it instead of launching). A baton callback parks every fit at the start of each accumulation window; the main
thread releases one fit at a time, in an order shuffled per round (the same on every rank) after a barrier, so
the variants' optimizer steps interleave exactly as in the raw benchmark and their collectives never mix.
A step's time runs from the release to the fit parking again at the next window (one full window: Lightning's
per-batch SIGTERM broadcast, data fetch, forward, backward, all-reduce, optimizer step, hooks).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from anchors import PostHocModule, PreCountModule, WindowPrefetch
from common import (
    DTYPES,
    LR,
    Batch,
    BatchStream,
    CollectiveCounter,
    Point,
    bucket_counts,
    deviation,
    finish,
    gradient_deviation,
    local_mean,
    make_batch,
    make_model,
    per_step,
    reference_gradient,
    reference_params,
)
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor

import lightning_weighted  # registers "ddp_weighted"

PRECISION = {"fp32": "32-true", "bf16": "bf16-true"}
WAIT_S = 300.0


class PlainModule(LightningModule):
    """Returns the local mean: what ``strategy="ddp"`` users write (wrong objective with uneven counts)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch: Batch, batch_idx: int) -> Any:
        return local_mean(self.model, batch)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=LR)


class WeightedModule(PlainModule):
    """Returns ``{"loss": local_mean, "count": n}``: counts known only after ``training_step`` (counts after)."""

    def training_step(self, batch: Batch, batch_idx: int) -> Any:
        return {"loss": local_mean(self.model, batch), "count": batch[2].sum()}


def _item_counter() -> list[Callback]:
    """The mask's valid items, counted from each batch as the loader yields it; no logging."""
    return [lightning_weighted.ItemCounter("tokens", key=2, mask=True, log=False)]


# name -> (module class, strategy name, window prefetch, the callbacks it adds)
VARIANTS: dict[str, tuple[type[LightningModule], str, bool, Callable[[], list[Callback]]]] = {
    "ddp": (PlainModule, "ddp", False, list),
    "ddp_control": (PlainModule, "ddp", False, list),
    # plain DDP with one more callback that overrides nothing: Lightning calls every callback's batch hooks
    "ddp_callback": (PlainModule, "ddp", False, lambda: [Callback()]),
    # the module plain DDP users write, with an ItemCounter: counts taken ahead, every loss scaled before its backward
    "ddp_weighted": (PlainModule, "ddp_weighted", False, _item_counter),
    # counts returned by training_step: the reduced gradients multiplied by P/N once after the syncing backward
    "ddp_weighted_after": (WeightedModule, "ddp_weighted", False, list),
    "post_hoc": (PostHocModule, "ddp", False, list),
    "pre_count": (PreCountModule, "ddp", True, list),
}


class Baton(Callback):
    """Parks the fit at the start of every accumulation window until the main thread releases it."""

    def __init__(self, accumulate: int, counter: CollectiveCounter) -> None:
        self.accumulate, self.counter = accumulate, counter
        self.arrived, self.go = threading.Event(), threading.Event()
        self.buckets: tuple[int, int] = (0, 0)
        self.error: BaseException | None = None
        self.initial: list[Tensor] = []
        self.captured: list[Tensor] | None = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.initial = [p.detach().clone() for p in pl_module.parameters()]
        # Lightning runs the closure (forward, backward, its hooks, clipping) inside `optimizer.step()`; after
        # the step the gradients are still the ones it applied (SGD leaves them alone until the next zero_grad).
        self._handle = trainer.optimizers[0].register_step_post_hook(self._capture)

    def _capture(self, optimizer: Any, *args: Any) -> None:
        if self.captured is None:  # the first step's synchronized gradient
            self.captured = [
                p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                for group in optimizer.param_groups
                for p in group["params"]
            ]

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx % self.accumulate == 0:
            self.arrived.set()
            if not self.go.wait(WAIT_S):
                raise TimeoutError("the benchmark's main thread never released this fit")
            self.go.clear()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        model = trainer.strategy.model
        if self.counter.active and isinstance(model, torch.nn.parallel.DistributedDataParallel):
            self.buckets = bucket_counts(model)


class BatonFit(threading.Thread):
    """A whole ``Trainer.fit`` in a thread, parked by its baton at every window start (``trainer``, ``module``,
    ``loader`` and ``baton`` are set by the subclass)."""

    trainer: Trainer
    module: LightningModule
    loader: Any
    baton: Any

    def run(self) -> None:
        torch.set_num_threads(1)
        try:
            self.trainer.fit(self.module, train_dataloaders=self.loader)
        except BaseException as error:  # reported by the main thread
            self.baton.error = error
            self.baton.arrived.set()

    def release(self) -> None:
        """Lets the fit run one accumulation window; returns when it parks at the next one."""
        self.baton.arrived.clear()
        self.baton.go.set()
        if not self.baton.arrived.wait(WAIT_S):
            raise TimeoutError(f"{self.name} did not finish its window within {WAIT_S}s")
        if self.baton.error is not None:
            raise RuntimeError(f"{self.name} failed") from self.baton.error


def interleave(
    fits: Mapping[str, BatonFit], point: Point, counter: Any
) -> tuple[dict[str, list[float]], dict[str, list[tuple[str, str, int]]]]:
    """Runs ``point.steps`` windows of every fit, one window of each per round, and ends the fits.

    The fits start one at a time (each setup runs its own collectives); every round releases them in an order
    shuffled per round (the same on every rank), each after a barrier. Returns the slowest rank's time of each
    timed round (after ``point.warmup``) per fit, and the collectives ``counter`` recorded in each fit's last
    warm-up window (not the first: its gradient is captured).
    """
    for name, fit in fits.items():
        fit.start()
        if not fit.baton.arrived.wait(WAIT_S) or fit.baton.error is not None:
            raise RuntimeError(f"{name} did not reach its first step") from fit.baton.error
    times: dict[str, list[float]] = {name: [] for name in fits}
    calls: dict[str, list[tuple[str, str, int]]] = {}
    for unit in range(point.steps):
        order = list(fits)
        random.Random(point.seed * 1_000_003 + unit).shuffle(order)
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            if unit == point.warmup - 1:
                with counter.counting() as recorded:
                    fits[name].release()
                calls[name] = list(recorded)
            else:
                fits[name].release()
            if unit >= point.warmup:
                times[name].append(time.perf_counter() - start)
    for name, fit in fits.items():  # the last window and the end of fit, one fit at a time
        fit.baton.go.set()
        fit.join(WAIT_S)
        if fit.is_alive() or fit.baton.error is not None:
            raise RuntimeError(f"{name} did not finish") from fit.baton.error
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, times)
    slowest = {name: [max(g[name][k] for g in gathered) for k in range(point.rounds)] for name in fits}
    return slowest, calls


class Fit(BatonFit):
    def __init__(self, name: str, point: Point, rank: int, counter: CollectiveCounter) -> None:
        super().__init__(name=name, daemon=True)
        self.baton = Baton(point.accumulate, counter)
        steps = point.steps + 1  # the last window runs untimed, while the fits finish one by one
        self.trainer, self.module, self.loader = setup_fit(name, point, rank, steps, [self.baton])

    def parameters(self) -> list[Tensor]:
        return [p.detach().clone() for p in self.module.model.parameters()]


def setup_fit(
    name: str, point: Point, rank: int, steps: int, callbacks: list[Callback]
) -> tuple[Trainer, LightningModule, Any]:
    """One variant's ``Trainer`` (``callbacks`` first), module, and loader of ``steps`` windows of this rank's data."""
    module_cls, strategy, prefetch, added = VARIANTS[name]
    callbacks = [*callbacks, *added()]
    module = module_cls(make_model(point.size, point.seed))
    return fit_trainer(strategy, point, steps, callbacks), module, fit_loader(point, rank, steps, prefetch)


def fit_trainer(strategy: Any, point: Point, steps: int, callbacks: list[Callback]) -> Trainer:
    """A ``Trainer`` of ``steps`` optimizer steps at ``point`` on every rank of the group, nothing but training."""
    return Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=dist.get_world_size(),
        num_nodes=1,
        max_steps=steps,
        accumulate_grad_batches=point.accumulate,
        precision=PRECISION[point.dtype],
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )


def fit_loader(point: Point, rank: int, steps: int, prefetch: bool = False) -> Any:
    """This rank's ``steps`` windows of data as a sized loader; ``prefetch`` reads each window ahead (pre-count)."""
    batches = [
        make_batch(point.size, point.rows, point.seed, rank, s, m)
        for s in range(steps)
        for m in range(point.accumulate)
    ]
    loader: Any = BatchStream(batches)
    if prefetch:
        loader = WindowPrefetch(loader, point.accumulate, len(batches))
    return _Sized(loader, len(batches))


class _Sized:
    """An iterable with a length, so Lightning knows the epoch's size."""

    def __init__(self, iterable: Any, length: int) -> None:
        self.iterable, self.length = iterable, length

    def __iter__(self) -> Any:
        return iter(self.iterable)

    def __len__(self) -> int:
        return self.length


def run_point(
    point: Point,
    variants: Sequence[str],
    rank: int,
    counter: CollectiveCounter,
    references: dict[Any, list[Tensor]],
    correctness: bool,
) -> dict[str, Any]:
    fits = {name: Fit(name, point, rank, counter) for name in variants}
    slowest, calls = interleave(fits, point, counter)
    result: dict[str, Any] = {
        "point": point.__dict__,
        "times": slowest,
        "collectives": {name: per_step(c, 1, DTYPES[point.dtype]) for name, c in calls.items()},
        "buckets": {name: fits[name].baton.buckets for name in variants},
    }
    if correctness and rank == 0:
        key = (point.size, point.rows, point.seed, point.accumulate, point.steps + 1)
        if key not in references:
            pattern = [[[False] * point.accumulate for _ in range(2)] for _ in range(point.steps + 1)]
            references[key] = reference_params(point.size, point.rows, point.seed, pattern, dist.get_world_size())
        expected_initial = list(make_model(point.size, point.seed).parameters())
        result["deviation"] = {
            name: deviation(fits[name].parameters(), fits[name].baton.initial, references[key], expected_initial)
            for name in variants
        }
        empty = [[False] * point.accumulate for _ in range(dist.get_world_size())]
        gradient = reference_gradient(
            point.size, point.rows, point.seed, empty, dist.get_world_size(), DTYPES[point.dtype]
        )
        result["gradient_deviation"] = {
            name: gradient_deviation(fits[name].baton.captured or [], gradient) for name in variants
        }
    dist.barrier()
    del fits
    gc.collect()
    return result


def main() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--spec", required=True, help="JSON: points, variants, timeout")
    parser.add_argument("--out", required=True, help="rank 0 writes its JSON results here")
    args = parser.parse_args()
    spec = json.loads(args.spec)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=spec.get("timeout", 120)))
    rank = dist.get_rank()
    counter = CollectiveCounter()
    counter.install()
    references: dict[Any, list[Tensor]] = {}
    results = []
    for entry in spec["points"]:
        result = run_point(
            Point(**entry),
            spec.get("variants", list(VARIANTS)),
            rank,
            counter,
            references,
            spec.get("correctness", True),
        )
        results.append(result)
        if rank == 0:
            medians = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in result["times"].items()}
            print(
                f"trainer {Point(**entry).label}: "
                + " ".join(f"{k}={v:.2f}ms" for k, v in medians.items())
                + "".join(
                    f"\n  {k}: " + " ".join(f"{n}={v:.1e}" for n, v in result[k].items())
                    for k in ("deviation", "gradient_deviation")
                    if k in result
                ),
                flush=True,
            )
    counter.uninstall()
    if rank == 0:
        Path(args.out).write_text(json.dumps({"points": results}))
    finish()


if __name__ == "__main__":
    main()
