"""One Fabric training loop over `scenario`'s data; every rank saves what it saw to `<out>.rank<r>`.

Started by `launcher.ranks` (the environment says which rank it is, so Fabric launches no process itself). The
loop is the one a Fabric user writes: `fabric.no_backward_sync` for the microbatches before each window's last,
`fabric.clip_gradients` and `optimizer.step()` after it; plain `"ddp"` divides each microbatch's mean by the
window size instead of passing its count.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import time
import types
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
from cpu_fsdp import CPUFabricFSDPStrategy
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy
from reads import ReadSpy, to_device
from scenario import (
    Batch,
    Config,
    aux_terms,
    count_of,
    inject,
    item_losses,
    make_model,
    make_optimizer,
    masked_mean,
    part_masks,
    part_means,
    train_loader,
)
from worker import Recorder, grad_norm, local, rank_arguments, whole

import lightning_weighted
from lightning_weighted import ItemMetrics
from lightning_weighted.engines.fsdp2 import shard_blocks


@dataclasses.dataclass
class FabricConfig(Config):
    marking: str = "no_sync"  # how windows are marked: "no_sync" (no_backward_sync) or "window_end" (the keyword)
    item_sum: bool = False  # pass the loss as a sum over items, with reduction="sum"
    misuse: str | None = None  # a use the strategy refuses: see `train_epoch`
    counts: str = "given"  # "given": each microbatch's count; "none": none (a loop written for "ddp"); "one": count=1
    evaluate: bool = False  # after training, one pass over the loader without backward (an evaluation loop)
    ahead: bool = False  # fetch each window's batches first and hand their counts over with `count_ahead`
    metrics: bool = False  # an ItemMetrics takes each window's result: its values per window and epoch are recorded


def weighted(config: Config) -> bool:
    return config.strategy.endswith("_weighted") or "_weighted_" in config.strategy


def make_strategy(config: FabricConfig) -> Any:
    kwargs: dict[str, Any] = {"timeout": timedelta(seconds=config.pg_timeout)}
    if config.strategy.startswith("fsdp2"):  # FSDP2: fully_shard each Linear, then the whole model
        if weighted(config):
            return lightning_weighted.WeightedFabricModelParallelStrategy(participation=config.participation, **kwargs)
        return ModelParallelStrategy(
            shard_blocks, data_parallel_size=config.world_size, tensor_parallel_size=1, **kwargs
        )
    if config.strategy.startswith("fsdp"):  # FSDP1: the whole model one unit
        if weighted(config):
            return lightning_weighted.WeightedFabricFSDPStrategy(participation=config.participation, **kwargs)
        return CPUFabricFSDPStrategy(**kwargs)
    if weighted(config):
        if config.participation != "pad":
            kwargs["participation"] = config.participation
        return lightning_weighted.WeightedFabricDDPStrategy(**kwargs)
    return DDPStrategy(**kwargs)


def main() -> None:
    args = rank_arguments()
    config = FabricConfig(**json.loads(args.config))
    fabric = Fabric(
        strategy=make_strategy(config),
        accelerator=config.device,
        devices=1 if config.device == "cuda" else config.world_size,  # on CUDA: one rank, NCCL
        precision=config.precision,  # type: ignore[arg-type]
    )
    fabric.launch()
    rank, strategy = fabric.global_rank, fabric.strategy
    record: dict[str, Any] = {"rank": rank, "steps": [], "padding": [], "windows": [], "error": None, "params": None}
    model: Any = None
    recorder = Recorder(config, "")
    record["collectives"] = recorder.collectives  # (name, dtype, numel) of every collective once training starts
    record["spy"] = spy = ReadSpy()
    if config.host_reads:
        spy.install()
    try:
        model = fabric.setup_module(make_model(config.seed, config.tied))  # FSDP2 shards it: the optimizer after
        optimizer = fabric.setup_optimizers(make_optimizer(config, model.parameters()))
        if config.misuse == "second_model":
            fabric.setup_module(make_model(config.seed + 1))
        metrics = ItemMetrics(strategy.data_parallel_group, fabric.device) if config.metrics else None
        record["metrics"], record["epoch_metrics"] = [], []
        clock = types.SimpleNamespace(current_epoch=0)  # the epoch the loader serves
        given = train_loader(config, rank, clock)
        loader = fabric.setup_dataloaders(given, use_distributed_sampler=config.items is not None)
        # the attributes of the user's `DataLoader`, which Fabric copies onto what it returns
        record["loader"] = {
            "dataset": getattr(loader, "dataset", None) is given.dataset,
            "sampler": type(getattr(loader, "sampler", None)).__name__,
            "batch_size": getattr(loader, "batch_size", None),
            "num_workers": getattr(loader, "num_workers", None),
        }
        # the mean over the ranks of an integer: 7 items on rank 0 and none on rank 1 (3.5, not Lightning's floor)
        record["mean_of_ints"] = float(fabric.all_reduce(torch.tensor(7 if rank == 0 else 0), reduce_op="mean"))
        if config.count_collectives:
            recorder.count_collectives()
        for epoch in range(config.epochs):
            clock.current_epoch = epoch
            train_epoch(fabric, config, model, optimizer, loader, record, metrics)
            if metrics is not None:
                record["epoch_metrics"].append(metrics.end_epoch())
        if config.evaluate:
            with torch.no_grad():
                record["evaluation"] = [(float(model(x).sum()), strategy.padding_step) for x, _, _ in loader]
        with summoned(model):
            record["params"] = [whole(p) for p in model.parameters()]
        record["items_total"] = None if metrics is None else metrics.items_total
    except Exception as error:
        record["error"] = f"{type(error).__name__}: {error}"
        raise
    finally:
        record["skipped_steps"] = getattr(strategy, "skipped_steps", None)
        record["local_params"] = None if model is None else [local(p.detach()) for p in model.parameters()]
        spy.uninstall()
        record["reads"] = record.pop("spy").reads
        torch.save(record, f"{args.out}.rank{rank}")


def summoned(model: Any, grads: bool = False) -> Any:
    """FSDP1's parameters (and gradients) made whole for the block; any other model's as they are."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    root = getattr(model, "_forward_module", model)
    if isinstance(root, FullyShardedDataParallel):
        return FullyShardedDataParallel.summon_full_params(root, writeback=False, with_grads=grads)
    return contextlib.nullcontext()


def fetched(strategy: Any, loader: Any) -> Iterator[tuple[int, Batch, bool]]:
    """The loader's batches with their index, each with whether the strategy marked it a replay when it came."""
    for index, batch in enumerate(loader):
        yield index, batch, bool(getattr(strategy, "padding_step", False))


def counted_ahead(config: Config, strategy: Any, loader: Any) -> Iterator[tuple[int, Batch, bool]]:
    """The loader's batches, each window's fetched first and its counts handed over (as torchtitan counts)."""
    held: list[tuple[int, Batch, bool]] = []
    for item in itertools.chain(fetched(strategy, loader), [None]):
        if item is not None:
            held.append(item)
        if held and (item is None or len(held) == config.accumulate):
            if config.parts:  # each part's counts, by name
                masks = [part_masks(b[0], b[2]) for _, b, _ in held]
                strategy.count_ahead({name: [m[name].sum() for m in masks] for name in masks[0]})
            else:
                strategy.count_ahead([count_of(config, b[2]) for _, b, _ in held], integer=config.mode != "weights")
            yield from held
            held = []


def train_epoch(
    fabric: Fabric,
    config: FabricConfig,
    model: Any,
    optimizer: Any,
    loader: Any,
    record: Any,
    metrics: ItemMetrics | None = None,
) -> None:
    a, strategy = config.accumulate, fabric.strategy
    started: float | None = None  # when the window in progress began
    aux: dict[str, torch.Tensor] = {}  # its auxiliary terms summed over this rank's microbatches
    microbatches = 0
    length = None if config.iterable else len(loader)
    batches = counted_ahead(config, strategy, loader) if config.ahead else fetched(strategy, loader)
    spy: ReadSpy = record["spy"]
    for index, (x, y, w), replay in batches:
        if config.host_reads:  # the batch reaches the device: every host read of a value computed from it counts
            x, y, w = to_device((x, y, w))
            spy.mark, spy.active = (len(record["steps"]), index), True  # the optimizer step of the window
        if config.device == "cuda":
            x, y, w = (t.to(fabric.device, non_blocking=True) for t in (x, y, w))
            if config.sync_debug and index >= 2 * a:  # past DDP's bucket rebuild, which reads once
                torch.cuda.set_sync_debug_mode("error")  # any device synchronisation from here raises
        if config.precision == "64-true":  # Fabric converts the model's inputs, not the batch: weights in float64
            y, w = y.double(), w.double()
        last = (index + 1) % a == 0 or index + 1 == length
        started, microbatches = started or time.perf_counter(), microbatches + 1
        record["padding"].append(replay)
        if config.fault is not None and config.fault[2] == index:
            inject(config.fault, fabric.global_rank, "training_step")
        sync_off = config.marking == "no_sync" and not last
        misuse = config.misuse if index == 0 else None
        with fabric.no_backward_sync(model, enabled=sync_off):
            losses = item_losses(model, x, y)
            total = (losses * w).sum()
            mean = masked_mean(config, losses, w)
            count = count_of(config, w)
            if config.bad_count is not None and list(config.bad_count[:2]) == [fabric.global_rank, index]:
                count = config.bad_count[2]
            if not weighted(config):
                fabric.backward(mean / a)
            else:
                keywords: dict[str, Any] = {"count": count}
                if config.counts != "given":
                    keywords = {"count": 1} if config.counts == "one" else {}
                if count == "nograd":  # a loss cut from the graph, with a valid count
                    mean, total, keywords = mean.detach(), total.detach(), {"count": 3}
                if config.marking == "window_end" or misuse == "window_end_in_no_sync":
                    keywords["window_end"] = last or misuse == "window_end_in_no_sync"
                reduction = "avg" if misuse == "reduction" else "sum" if config.item_sum else "mean"
                if config.ahead:
                    keywords.pop("count", None)  # handed over ahead
                if config.parts:
                    keywords["parts"] = part_means(model, x, y, w)
                if config.aux == "parts":
                    keywords["aux"] = aux_terms(model.module, x)  # the module Fabric set up, its layers called
                    for name, term in keywords["aux"].items():  # a replay of an exhausted rank adds nothing
                        aux[name] = aux.get(name, 0.0) + (0.0 if replay else term.detach().double())
                fabric.backward(total if config.item_sum else mean, reduction=reduction, **keywords)
        spy.active = False
        if config.sync_debug:
            torch.cuda.set_sync_debug_mode("default")
        if misuse == "step_in_open_window":
            optimizer.step()
        if misuse == "clip_in_open_window":
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
        if not last:
            continue
        window = getattr(strategy, "last_window", None)
        if window is not None:
            record["windows"].append((window.step, window.items, window.local_items))
        with summoned(model, grads=True):
            grads = [whole(p.grad) for p in model.parameters() if p.grad is not None]
        step: dict[str, Any] = {"norm": grad_norm(grads), "collectives": len(record["collectives"])}
        if config.clip is not None:
            if config.clip_algorithm == "value":
                fabric.clip_gradients(model, optimizer, clip_val=config.clip)
            else:
                fabric.clip_gradients(model, optimizer, max_norm=config.clip)
        optimizer.step()
        optimizer.zero_grad()
        if metrics is not None:  # as a Fabric loop logs: `fabric.log_dict(metrics.compute())`
            elapsed = time.perf_counter() - started
            metrics.update(strategy.last_window, elapsed=elapsed, aux=aux, microbatches=microbatches)
            record["metrics"].append({k: float(v) for k, v in metrics.compute().items()})
        started, aux, microbatches = None, {}, 0
        with summoned(model):
            step["params"] = [whole(p) for p in model.parameters()]
        step["local_params"] = [local(p.detach()) for p in model.parameters()]
        step["state"] = {  # this rank's shard of it, under FSDP2
            k: {n: local(t) for n, t in v.items()} for k, v in optimizer.optimizer.state_dict()["state"].items()
        }
        record["steps"].append(step)


if __name__ == "__main__":
    main()
