"""Sharded Lightning ``Trainer`` steps: fsdp2_weighted beside plain FSDP2, fsdp_weighted beside plain FSDP1.

A rank worker started by ``run.py`` (level ``sharded``) on every rank, in the manner of ``trainer_step.py``: each
variant is a whole ``Trainer.fit`` in its own thread of this process, in one gloo process group; a baton parks
every fit at each window start and the main thread releases one at a time, in an order shuffled per round (the
same on every rank), so each weighted strategy and its plain counterpart run side by side in the same rounds.

Variants: ``fsdp2`` (Lightning's ``ModelParallelStrategy``, every rank data-parallel, each ``Linear`` and the
model ``fully_shard``-ed; the module returns its local mean), ``fsdp2_control`` (a second one: the noise floor),
``fsdp2_weighted`` (``"fsdp2_weighted"``, ``{"loss": mean, "count": n}``: counts after), ``fsdp2_weighted_ahead``
(``"fsdp2_weighted"`` with the plain module and ``ItemCounter``: counts ahead), ``fsdp`` (FSDP1 through
``CPUFSDPStrategy``, Lightning's ``FSDPStrategy`` enabled on CPU, each ``Linear`` a unit), ``fsdp_weighted``
and ``fsdp_weighted_ahead``. With ``--spec '{"memory": ...}'`` it trains one variant alone and reports the growth of its
peak resident memory. Also holds what ``run.py`` and ``report.py`` need for this level: its grid, the pooling of
its repeats and its report section.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import logging
import threading
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from common import (
    CollectiveCounter,
    Point,
    deviation,
    finish,
    gradient_deviation,
    make_model,
    reference_gradient,
    reference_params,
    summary,
)
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import ModelParallelStrategy
from report import ratio_cell
from torch import Tensor, nn
from trainer_step import WAIT_S, BatonFit, PlainModule, WeightedModule, fit_loader, fit_trainer, interleave

import lightning_weighted
from lightning_weighted.trainer.fsdp1 import CPUFSDPStrategy

VARIANTS = (
    "fsdp2",
    "fsdp2_control",
    "fsdp2_weighted",
    "fsdp2_weighted_ahead",
    "fsdp",
    "fsdp_weighted",
    "fsdp_weighted_ahead",
)
PAIRS = {  # variant -> baseline
    "fsdp2_weighted": "fsdp2",
    "fsdp2_weighted_ahead": "fsdp2",
    "fsdp2_control": "fsdp2",
    "fsdp_weighted": "fsdp",
    "fsdp_weighted_ahead": "fsdp",
}
TITLES = {
    "fsdp2": "plain FSDP2",
    "fsdp2_control": "plain FSDP2 (control)",
    "fsdp2_weighted": "fsdp2_weighted (counts after)",
    "fsdp2_weighted_ahead": "fsdp2_weighted (counts ahead)",
    "fsdp": "plain FSDP1",
    "fsdp_weighted": "fsdp_weighted (counts after)",
    "fsdp_weighted_ahead": "fsdp_weighted (counts ahead)",
}


def _shard(module: LightningModule) -> None:
    """Each ``Linear``, then the model, ``fully_shard``-ed over the data-parallel ranks (its ``configure_model``)."""
    from torch.distributed.fsdp import fully_shard

    mesh = module.device_mesh["data_parallel"]
    for layer in [m for m in module.model if isinstance(m, nn.Linear)] + [module.model]:
        fully_shard(layer, mesh=mesh)


class ShardedPlain(PlainModule):
    def configure_model(self) -> None:
        _shard(self)


class ShardedWeighted(WeightedModule):
    def configure_model(self) -> None:
        _shard(self)


def _module(name: str, point: Point) -> LightningModule:
    fsdp2 = name.startswith("fsdp2")
    if name.endswith("_weighted"):  # returns its count; with counts ahead the module is the plain one
        return (ShardedWeighted if fsdp2 else WeightedModule)(make_model(point.size, point.seed))
    return (ShardedPlain if fsdp2 else PlainModule)(make_model(point.size, point.seed))


def _strategy(name: str, timeout: float) -> Any:
    limit = timedelta(seconds=timeout)
    world = dist.get_world_size()
    weighted = "_weighted" in name
    if name.startswith("fsdp2"):
        cls = lightning_weighted.WeightedModelParallelStrategy if weighted else ModelParallelStrategy
        return cls(data_parallel_size=world, tensor_parallel_size=1, timeout=limit)
    cls = lightning_weighted.WeightedFSDPStrategy if weighted else CPUFSDPStrategy
    return cls(auto_wrap_policy={nn.Linear}, timeout=limit)


def whole(tensors: Sequence[Tensor | None]) -> list[Tensor]:
    """Whole tensors from shards (a collective: every rank calls it at the same point)."""
    return [
        t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()  # type: ignore[union-attr]
        for t in tensors
        if t is not None
    ]


class Baton(Callback):
    """Parks the fit at every window start until released; keeps the first step's whole gradient."""

    def __init__(self, accumulate: int) -> None:
        self.accumulate = accumulate
        self.arrived, self.go = threading.Event(), threading.Event()
        self.error: BaseException | None = None
        self.initial: list[Tensor] = []
        self.captured: list[Tensor] | None = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.initial = _whole_params(trainer, pl_module)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self.captured is None:  # the first step's synchronized, normalized gradient
            with _summoned(trainer, gradients=True):
                self.captured = whole([p.grad for p in pl_module.model.parameters()])

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx % self.accumulate == 0:
            self.arrived.set()
            if not self.go.wait(WAIT_S):
                raise TimeoutError("the benchmark's main thread never released this fit")
            self.go.clear()


def _summoned(trainer: Trainer, gradients: bool = False) -> Any:
    from contextlib import nullcontext

    from torch.distributed.fsdp import FullyShardedDataParallel

    model = trainer.strategy.model
    if isinstance(model, FullyShardedDataParallel):
        return FullyShardedDataParallel.summon_full_params(model, writeback=False, with_grads=gradients)
    return nullcontext()


def _whole_params(trainer: Trainer, pl_module: LightningModule) -> list[Tensor]:
    with _summoned(trainer):
        return whole(list(pl_module.model.parameters()))


class Fit(BatonFit):
    def __init__(self, name: str, point: Point, rank: int, timeout: float) -> None:
        super().__init__(name=name, daemon=True)
        self.baton = Baton(point.accumulate)
        self.module = _module(name, point)
        steps = point.steps + 1  # the last window runs untimed, while the fits finish one by one
        self.loader = fit_loader(point, rank, steps)
        callbacks: list[Callback] = [self.baton, _Final(self)]
        if name.endswith("_ahead"):
            callbacks.append(lightning_weighted.ItemCounter("tokens", key=2, mask=True, log=False))
        self.trainer = fit_trainer(_strategy(name, timeout), point, steps, callbacks)
        self.final: list[Tensor] = []


class _Final(Callback):
    """Keeps the whole parameters at the end of the fit (every rank, in the fit's last collective)."""

    def __init__(self, fit: Fit) -> None:
        self.fit = fit

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.fit.final = _whole_params(trainer, pl_module)


class ShardedCounter(CollectiveCounter):
    """`CollectiveCounter` plus the entry points FSDP calls with keyword tensors (`reduce_scatter_single`) and the
    list form of `all_gather` (FSDP1's), each counted by the tensor this rank sends."""

    def install(self) -> None:
        super().install()
        sent = {"reduce_scatter_single": "input", "all_gather_single": "input", "all_gather": 1}
        for name, where in sent.items():
            original = self._originals.get(name, getattr(dist, name, None))
            if original is not None:
                self._originals[name] = original
                setattr(dist, name, self._sending(name, original, where))

    def _sending(self, name: str, original: Any, where: str | int) -> Any:
        def counting(*args: Any, **kwargs: Any) -> Any:
            if self.active:
                tensor = kwargs.get(where) if isinstance(where, str) else None
                if tensor is None:
                    tensor = args[1] if len(args) > 1 else kwargs.get("tensor")
                dtype = str(tensor.dtype).removeprefix("torch.")
                self.calls.append((name, dtype, tensor.numel() * tensor.element_size()))
            return original(*args, **kwargs)

        return counting


def kinds(calls: Sequence[tuple[str, str, int]]) -> dict[str, list[float]]:
    """``{kind[dtype]: [calls, bytes]}`` of one optimizer step; the reduce-scatter names merged."""
    totals: dict[str, list[float]] = {}
    for name, dtype, size in calls:
        key = f"{name.replace('_single', '_tensor').replace('all_gather_tensor', 'all_gather')}[{dtype}]"
        entry = totals.setdefault(key, [0, 0])
        entry[0] += 1
        entry[1] += size
    return totals


def run_point(point: Point, rank: int, counter: ShardedCounter, timeout: float, correctness: bool) -> dict[str, Any]:
    fits = {name: Fit(name, point, rank, timeout) for name in VARIANTS}
    slowest, recorded = interleave(fits, point, counter)
    calls = {name: kinds(found) for name, found in recorded.items()}
    result: dict[str, Any] = {"point": point.__dict__, "times": slowest, "collectives": calls}
    if correctness and rank == 0:
        world = dist.get_world_size()
        pattern = [[[False] * point.accumulate for _ in range(world)] for _ in range(point.steps + 1)]
        expected = reference_params(point.size, point.rows, point.seed, pattern, world)
        initial = list(make_model(point.size, point.seed).parameters())
        gradient = reference_gradient(point.size, point.rows, point.seed, pattern[0], world, torch.float32)
        result["deviation"] = {n: deviation(f.final, f.baton.initial, expected, initial) for n, f in fits.items()}
        result["gradient_deviation"] = {
            n: gradient_deviation(f.baton.captured or [], gradient) for n, f in fits.items()
        }
    dist.barrier()
    del fits
    gc.collect()
    return result


def memory_run(point: Point, variant: str, rank: int, timeout: float) -> dict[str, Any]:
    """Peak resident memory growth over the timed steps of one variant, alone in its process group."""
    from raw_step import _reset_peak_rss, _rss_kib

    # Large blocks straight from mmap: a freed tensor leaves the resident set, so its peak is the live memory's
    # (with the allocator's reuse, the peak of one run varied by up to 70 MB at 20M parameters).
    ctypes.CDLL(None).mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    fit = Fit(variant, point, rank, timeout)
    fit.start()
    for _ in range(point.warmup + 1):  # set-up and the warm-up windows
        if not fit.baton.arrived.wait(WAIT_S) or fit.baton.error is not None:
            raise RuntimeError(f"{variant} failed") from fit.baton.error
        if _ < point.warmup:
            fit.release()
    gc.collect()
    dist.barrier()
    before, reset = _rss_kib("VmRSS"), _reset_peak_rss()
    for _ in range(point.rounds):
        fit.release()
    peak = _rss_kib("VmHWM")
    fit.baton.go.set()
    fit.join(WAIT_S)
    parameter_bytes = sum(p.numel() * p.element_size() for p in make_model(point.size, point.seed).parameters())
    return {
        "variant": variant,
        "peak_delta_bytes": (peak - before) * 1024 if reset else None,
        "parameter_bytes": parameter_bytes,
        "method": "VmHWM after clear_refs, blocks of 64 KiB or more mmap-ed",
        "point": point.label,
        "steps": point.rounds,
    }


# ------------------------------------------------------------------------------------- run.py and report.py


def points(args: argparse.Namespace) -> dict[str, Any]:
    """The level's grid: timed points and the memory point."""
    if args.quick:
        return {
            "points": [Point("tiny", a, "fp32", args.rounds, max(args.warmup, 2)) for a in (1, 2)],
            "memory": Point("tiny", 2, "fp32", 3, 2),
        }
    timed = [Point(s, a, "fp32", args.rounds, max(args.warmup, 2)) for s in ("0.2M", "2M") for a in (1, 4)]
    return {"points": timed, "memory": Point("20M", 4, "fp32", 3, 2)}


def spec(grid: dict[str, Any], repeat: int, args: argparse.Namespace) -> dict[str, Any]:
    """One repeat's launch: every point, the correctness columns on the first (the data are the same in all)."""
    return {"points": [p.__dict__ for p in grid["points"]], "correctness": repeat == 0, "timeout": args.pg_timeout}


def memory_specs(grid: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    """One launch per variant (not the control), each alone in its process group."""
    point = grid["memory"].__dict__
    names = [name for name in VARIANTS if name != "fsdp2_control"]
    return [{"memory": {"point": point, "variant": name}, "timeout": args.pg_timeout} for name in names]


def pool(repeats: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One entry per point: paired ratios to each variant's plain counterpart pooled over the repeats."""
    pooled = []
    for entries in zip(*repeats, strict=True):
        first = entries[0]
        ratios = {
            name: summary([t / b for e in entries for t, b in zip(e["times"][name], e["times"][base], strict=True)])
            for name, base in PAIRS.items()
        }
        ms = {name: summary([t * 1e3 for e in entries for t in e["times"][name]])["median"] for name in VARIANTS}
        pooled.append({key: value for key, value in first.items() if key != "times"} | {"ratio": ratios, "ms": ms})
    return pooled


def section(data: dict[str, Any]) -> str:
    """RESULTS.md's section on the sharded strategies."""
    entries, memory = data.get("sharded") or [], data.get("sharded_memory") or []
    if not entries:
        return ""
    meta = data.get("sharded_meta") or data["meta"]
    lines = [
        "## Sharded strategies (Lightning Trainer step, FSDP2 and FSDP1)",
        "",
        f"Measured {meta['date']} with `{meta['command']}` ({meta['seconds'] / 60:.1f} min wall), 2 gloo ranks.",
        "",
        "Each weighted strategy beside its plain counterpart, whole `Trainer.fit`s interleaved in the same rounds"
        " as in the Trainer benchmark (`sharded_step.py`): **plain FSDP2** is Lightning's `ModelParallelStrategy`"
        " (each `Linear` and the model `fully_shard`-ed over every rank; it reduce-scatters every microbatch),"
        " **plain FSDP1** is Lightning's `FSDPStrategy` enabled on CPU (each `Linear` a unit; it reduce-scatters"
        " once per window). Each weighted strategy runs twice: with counts after (the module returns"
        " `{'loss': mean, 'count': n}`) and with counts ahead (the plain module and `ItemCounter`). Ratios are paired"
        " with the plain counterpart of the same round: median (its 95 % confidence interval) [p10, p90].",
        "",
        "| point | plain FSDP2 step (ms) | control ÷ FSDP2 | fsdp2_weighted (counts after) ÷ FSDP2 |"
        " fsdp2_weighted (counts ahead) ÷ FSDP2 | plain FSDP1 step (ms) | fsdp_weighted (counts after) ÷ FSDP1 |"
        " fsdp_weighted (counts ahead) ÷ FSDP1 | deviation / gradient deviation, in the column order |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    shown = ("fsdp2", "fsdp2_weighted", "fsdp2_weighted_ahead", "fsdp", "fsdp_weighted", "fsdp_weighted_ahead")
    for e in entries:
        p, dev, grad, ratio = e["point"], e.get("deviation") or {}, e.get("gradient_deviation") or {}, e["ratio"]
        devs = ", ".join(f"{dev[n]:.1e} / {grad[n]:.1e}" for n in shown if n in dev)
        cells = {n: ratio_cell(ratio[n], interval=True) if n in ratio else "–" for n in PAIRS}
        lines.append(
            f"| {p['size']} A={p['accumulate']} {p['dtype']} ({p['rounds']} rounds) | {e['ms']['fsdp2']:.2f} |"
            f" {cells['fsdp2_control']} | {cells['fsdp2_weighted']} | {cells['fsdp2_weighted_ahead']} |"
            f" {e['ms']['fsdp']:.2f} | {cells['fsdp_weighted']} | {cells['fsdp_weighted_ahead']} | {devs or '–'} |"
        )
    lines += ["", "Collectives per optimizer step (calls, bytes each rank sends), counted over one warm-up step:", ""]
    lines += ["| point | variant | collectives |", "|---|---|---|"]
    for e in entries:
        p = e["point"]
        for name in (name for name in VARIANTS if name in e["collectives"]):
            counted = e["collectives"][name]
            listed = ", ".join(f"{k} ×{int(v[0])} ({int(v[1]):,} B)" for k, v in sorted(counted.items()))
            lines.append(f"| {p['size']} A={p['accumulate']} | {TITLES[name]} | {listed} |")
    if memory:
        lines += [
            "",
            f"Peak resident memory growth over {memory[0]['steps']} optimizer steps at {memory[0]['point']}, one"
            f" variant per process group ({memory[0]['method']}), the larger rank's:",
            "",
        ]
        lines += ["| variant | peak RSS growth (MB) | one gradient (MB) |", "|---|---:|---:|"]
        for m in memory:
            grow = "–" if m["peak_delta_bytes"] is None else f"{m['peak_delta_bytes'] / 1e6:.1f}"
            lines.append(f"| {TITLES[m['variant']]} | {grow} | {m['parameter_bytes'] / 1e6:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--spec", required=True, help="JSON: points or memory, timeout, correctness")
    parser.add_argument("--out", required=True, help="rank 0 writes its JSON results here")
    args = parser.parse_args()
    spec = json.loads(args.spec)
    torch.set_num_threads(1)
    timeout = spec.get("timeout", 120)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
    rank = dist.get_rank()
    output: dict[str, Any] = {}
    if spec.get("memory"):
        result = memory_run(Point(**spec["memory"]["point"]), spec["memory"]["variant"], rank, timeout)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)
        peaks = [g["peak_delta_bytes"] for g in gathered]
        output["memory"] = {**result, "peak_delta_bytes": None if None in peaks else max(peaks)}
    else:
        counter = ShardedCounter()
        counter.install()
        output["points"] = []
        for entry in spec["points"]:
            result = run_point(Point(**entry), rank, counter, timeout, spec.get("correctness", True))
            output["points"].append(result)
            if rank == 0:
                medians = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in result["times"].items()}
                print(
                    f"sharded {Point(**entry).label}: " + " ".join(f"{k}={v:.2f}ms" for k, v in medians.items()),
                    flush=True,
                )
        counter.uninstall()
    if rank == 0:
        Path(args.out).write_text(json.dumps(output))
    finish()


if __name__ == "__main__":
    main()
