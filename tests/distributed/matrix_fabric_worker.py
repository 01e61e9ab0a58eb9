"""One Fabric loop of one cell of the compatibility matrix (`matrix.py`); every rank saves a record to `<out>.rank<r>`.

The loop is the one a Fabric user writes, LitGPT's among them: it fetches batches from the loader set up by
`fabric.setup_dataloaders` (over the epochs, or a `CycleIterator` whose windows cross them), reads
`fabric.strategy.padding_step` as each batch arrives, and ends each window of `accumulate` microbatches with a
backward outside `fabric.no_backward_sync` (or one marked `window_end=True`), then clips and steps. Counted after,
each microbatch passes `fabric.backward(loss, count=n)`; counted ahead, the window's batches are fetched first and
their counts handed to `fabric.strategy.count_ahead`. The plain strategy divides each mean by the window's size.

A resumed loop (`resume`) loads the checkpoint `fabric.save` wrote and fast-forwards to the next microbatch, with
`continue` or with `next()`, or (`skip="state"`, LitGPT's pretraining loop) saves and loads the loader with it, which
puts it back in its place; a rollback loads an earlier checkpoint within the run and trains on. The record has the
cell's Trainer record's shape (`matrix_worker.py`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import litdata_items
import matrix
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy
from matrix_worker import as_batch, stateful
from torch import nn
from torch.utils.data import DataLoader, Dataset
from worker import rank_arguments, whole

import lightning_weighted
from lightning_weighted import shard_blocks

PG_TIMEOUT = timedelta(seconds=20)


class Clock:
    def __init__(self) -> None:
        self.epoch = 0


class Batches(Dataset[Any]):
    """One rank's own batches of the epoch the clock names."""

    def __init__(self, options: dict[str, Any], rank: int, clock: Clock) -> None:
        self.options, self.rank, self.clock = options, rank, clock
        self.length = len(matrix.rank_batches(options, rank, 0))

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, k: int) -> Any:
        return as_batch(matrix.rank_batches(self.options, self.rank, self.clock.epoch)[k], self.options["mode"])


class Items(Dataset[Any]):
    def __init__(self, options: dict[str, Any]) -> None:
        self.x, self.y, self.w = matrix.values(torch.arange(options["items"]), options["mode"])

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> Any:
        return self.x[i], self.y[i], self.w[i], torch.tensor(i)


class CycleIterator:
    """LitGPT's `CycleIterator` (`litgpt/utils.py`): iterates the loader over and over, counting its epochs."""

    def __init__(self, iterable: Any, clock: Clock) -> None:
        self.iterable, self.clock = iterable, clock
        self.epoch = clock.epoch
        self._iterator: Iterator[Any] | None = None

    def __next__(self) -> Any:
        if self._iterator is None:
            self._iterator = iter(self.iterable)
        try:
            return next(self._iterator)
        except StopIteration:
            self.epoch += 1
            self.clock.epoch = self.epoch
            self._iterator = iter(self.iterable)
            return next(self._iterator)

    def __iter__(self) -> CycleIterator:
        return self


class CPUFSDP1(FSDPStrategy):
    """Fabric's FSDP1 on the CPU (Fabric refuses its own class there; a subclass wraps with the CPU as device)."""

    def setup_module(self, module: nn.Module) -> Any:
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(
            module=module,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),
            **self._fsdp_kwargs,
        )


def make_strategy(cell: dict[str, Any]) -> Any:
    engine, weighted = cell["engine"], cell["weighted"]
    if engine == "ddp":
        return (lightning_weighted.WeightedFabricDDPStrategy if weighted else DDPStrategy)(timeout=PG_TIMEOUT)
    if engine == "fsdp2":
        if weighted:
            return lightning_weighted.WeightedFabricModelParallelStrategy(timeout=PG_TIMEOUT)
        return ModelParallelStrategy(
            shard_blocks, data_parallel_size=cell["world_size"], tensor_parallel_size=1, timeout=PG_TIMEOUT
        )
    kind = cell["options"]["state_dict_type"]
    if not weighted:
        return CPUFSDP1(timeout=PG_TIMEOUT, auto_wrap_policy={nn.Linear}, use_orig_params=True, state_dict_type=kind)
    fsdp1 = getattr(lightning_weighted, "WeightedFabricFSDPStrategy", None)
    if fsdp1 is None:
        return "fsdp_weighted"  # Fabric's registry says whether the name exists
    return fsdp1(timeout=PG_TIMEOUT, auto_wrap_policy={nn.Linear}, use_orig_params=True, state_dict_type=kind)


def whole_params(model: Any) -> list[torch.Tensor]:
    """The model's whole parameters: FSDP1's summoned, FSDP2's gathered."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    root = next((m for m in model.modules() if isinstance(m, FullyShardedDataParallel)), None)
    if root is None:
        return [whole(p) for p in model.parameters()]
    with FullyShardedDataParallel.summon_full_params(root, writeback=False):
        return [whole(p) for p in root.parameters()]


def main() -> None:
    args = rank_arguments()
    cell = json.loads(args.config)
    cell["options"] = {**matrix.DEFAULTS, **cell["options"]}
    rank = int(os.environ["LOCAL_RANK"])
    record: dict[str, Any] = {"rank": rank, "error": None, "params": None, "steps": [], "global_step": None}
    record["flags"] = {"fetch": []}
    try:
        Loop(cell, args.out, record).run()
    except BaseException as error:
        record["error"] = f"{type(error).__name__}: {error}"
        print(f"MATRIX rank {rank} raised {record['error']}", flush=True)
        raise
    finally:
        torch.save(record, f"{args.out}.rank{rank}")


class Loop:
    def __init__(self, cell: dict[str, Any], out: str, record: dict[str, Any]) -> None:
        self.cell, self.options, self.out, self.record = cell, cell["options"], out, record
        self.weighted, self.ahead = cell["weighted"], cell["weighted"] and cell["path"] == "ahead"
        self.a = int(self.options["accumulate"])
        self.fabric = Fabric(
            strategy=make_strategy(cell), accelerator="cpu", devices=cell["world_size"], precision="32-true"
        )
        self.fabric.launch()
        # `models=2`: an actor-critic loop's shape, two models each with its own optimizer and backward
        self.models, self.optimizers = [], []
        for seed in range(self.options["models"]):
            model = self.fabric.setup_module(matrix.make_model(seed).double())
            optimizer = torch.optim.SGD(model.parameters(), lr=matrix.LR, momentum=self.options["momentum"])
            self.models.append(model)
            self.optimizers.append(self.fabric.setup_optimizers(optimizer))
        self.model, self.optimizer = self.models[0], self.optimizers[0]
        self.clock = Clock()
        layout, make = self.options["layout"], stateful if self.options["loader"] == "stateful" else DataLoader
        shared = layout == "shared"
        loader: Any = (
            make(Items(self.options), batch_size=self.options["batch_size"], shuffle=self.options["shuffle"])
            if shared
            else litdata_items.loader(self.options)
            if layout == "litdata"
            else make(Batches(self.options, self.fabric.global_rank, self.clock), batch_size=None)
        )
        self.loader = self.fabric.setup_dataloaders(loader, use_distributed_sampler=shared)
        self.steps = 0  # optimizer steps done
        self.micro = 0  # microbatches fetched
        self.pending: list[tuple[int, int, list[int], bool]] = []

    # ------------------------------------------------------------------------------------------- the stream
    def stream(self, start: tuple[int, int]) -> Iterator[tuple[int, int, Any, bool]]:
        """``(epoch, index, batch, replay)`` from epoch ``start[0]`` on; the replay flag read as the batch arrives."""
        strategy, cycle = self.fabric.strategy, self.options["cycle_steps"]
        self.clock.epoch = start[0]
        if cycle is not None:
            iterator = CycleIterator(self.loader, self.clock)
            epoch, index = iterator.epoch, 0
            while True:
                batch = next(iterator)
                if iterator.epoch != epoch:
                    epoch, index = iterator.epoch, 0
                yield epoch, index, batch, bool(getattr(strategy, "padding_step", False))
                index += 1
        for epoch in range(start[0], self.options["epochs"]):
            self.clock.epoch = epoch
            # a loader put back in its place starts the epoch where the checkpoint left it
            first = start[1] if epoch == start[0] and self.options["skip"] == "state" else 0
            for index, batch in enumerate(self.loader, start=first):
                yield epoch, index, batch, bool(getattr(strategy, "padding_step", False))

    def ends_window(self, epoch: int, index: int) -> bool:
        if self.options["cycle_steps"] is not None:
            return (self.micro + 1) % self.a == 0
        return (index + 1) % self.a == 0 or index + 1 == len(self.loader)

    def done(self) -> bool:
        cycle = self.options["cycle_steps"]
        return cycle is not None and self.steps == cycle

    # --------------------------------------------------------------------------------------------- the loop
    def run(self) -> None:
        start, skip = (0, 0), 0
        if self.cell.get("resume"):
            state = {**self.saved(), "next": None, "steps": 0, "micro": 0}
            self.fabric.load(self.cell["resume"], state)
            (epoch, index), self.steps, self.micro = state["next"], state["steps"], state["micro"]
            self.record["loaded"] = whole_params(self.model)
            if self.options["skip"] == "state":
                start = (epoch, index)  # the loader's own state puts it back in its place: nothing to skip
            else:
                start, skip = (epoch, 0), index  # a fresh pass over the epoch, fast-forwarded past `index` batches
        source = self.stream(start)
        if skip and self.options["skip"] == "next":
            for _ in range(skip):
                next(source)
            skip = 0
        held: list[tuple[int, int, Any, bool]] = []
        for position, item in enumerate(source):
            if position < skip:
                continue  # fast-forward: fetched, not trained
            epoch, index, _, replay = item
            self.record["flags"]["fetch"].append((epoch, index, replay))
            last = self.ends_window(epoch, index)
            self.micro += 1
            if not self.ahead:
                self.backward(item, last)
            else:
                held.append(item)
                if last:
                    counts = [b[2][2].sum() for b in held]  # each batch's valid items, before any forward
                    for model in self.models:
                        model_keyword = {"model": model} if len(self.models) > 1 else {}
                        self.fabric.strategy.count_ahead(counts, integer=True, **model_keyword)
                    for k, one in enumerate(held):
                        self.backward(one, k == len(held) - 1)
                    held = []
            if last:
                self.step(epoch, index)
                if self.done():
                    break
        self.record["global_step"] = self.steps
        self.record["params"] = [p for model in self.models for p in whole_params(model)]

    def backward(self, item: tuple[int, int, Any, bool], last: bool) -> None:
        epoch, index, (x, y, w, ids), replay = item
        self.pending.append((epoch, index, ids.tolist(), replay))
        dtype = torch.float64
        x, y, w = x.to(dtype), y.to(dtype), w.to(dtype)
        window_end = self.options["marking"] == "window_end"
        for model in self.models:
            with self.fabric.no_backward_sync(model, enabled=not last and not window_end):
                mean = matrix.masked_mean(matrix.item_losses(model, x, y), w)
                keywords: dict[str, Any] = {"model": model} if len(self.models) > 1 else {}
                if not self.weighted:
                    self.fabric.backward(mean / self.a, **keywords)
                    continue
                keywords.update({} if self.ahead else {"count": w.sum()})
                if window_end:
                    keywords["window_end"] = last
                self.fabric.backward(mean, **keywords)

    def saved(self) -> dict[str, Any]:
        """What `fabric.save` keeps: the model, the optimizer and, to resume in its place, the loader (LitGPT's)."""
        state = {"model": self.model, "optimizer": self.optimizer}
        return {**state, "loader": self.loader} if self.options["skip"] == "state" else state

    def step(self, epoch: int, index: int) -> None:
        clip = self.options["fabric_clip"]
        for model, optimizer in zip(self.models, self.optimizers, strict=True):
            if clip is not None:
                self.fabric.clip_gradients(model, optimizer, max_norm=clip)
            optimizer.step()
            optimizer.zero_grad()
        self.record["steps"].append({"step": self.steps, "batches": self.pending})
        self.pending = []
        self.steps += 1
        state = self.saved()
        if self.options["save_after"] == self.steps and not self.cell.get("resume"):
            following = (epoch, index + 1) if index + 1 < len(self.loader) else (epoch + 1, 0)
            self.fabric.save(f"{self.out}.save", {**state, "next": following, "steps": self.steps, "micro": self.micro})
        rollback = self.options["rollback"]
        if rollback is not None and self.steps == rollback[0]:
            self.fabric.save(f"{self.out}.rollback", state)
        if rollback is not None and self.steps == rollback[1]:
            self.fabric.load(f"{self.out}.rollback", state)


if __name__ == "__main__":
    main()
