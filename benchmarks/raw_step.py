"""Raw ``DistributedDataParallel`` step benchmark: one rank's worker (started by ``run.py`` on every rank).

Every variant owns a DDP copy of the same model in one gloo process group. Each round runs one optimizer step
(or one epoch, in the imbalance sweep) of every variant on identical data, in an order shuffled per round
(the same on every rank), each after a barrier; a step's time is the slowest rank's.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import resource
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from anchors import PostHocStep, PreCountStep
from carrier import Carrier, CarrierLoop, fits
from common import (
    DTYPES,
    Batch,
    BatchStream,
    CollectiveCounter,
    Point,
    RawStep,
    bucket_counts,
    deviation,
    finish,
    gradient_deviation,
    make_batch,
    make_model,
    per_step,
    reference_gradient,
    reference_params,
)
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from lightning_weighted.ahead import Lookahead, Planner
from lightning_weighted.counts import TRAINER, WIDTH, read_count
from lightning_weighted.data import Participation
from lightning_weighted.engines.ddp import DDPEngine
from lightning_weighted.loop import WindowLoop

CPU = torch.device("cpu")


class PlainDDPStep(RawStep):
    """What ``strategy="ddp"`` does: each microbatch's local mean divided by A, DDP averages over ranks."""

    name = "ddp"

    def step(self, window: Iterator[Batch]) -> None:
        for micro, batch in enumerate(window):
            with self.sync_context(micro):
                (self.ddp(batch) / self.accumulate).backward()
        self.finish()


class ControlStep(PlainDDPStep):
    """A second, independent plain DDP: its ratio to ``ddp`` is the noise floor (A-vs-A control)."""

    name = "ddp_control"


class WeightedStep(RawStep):
    """A raw DDP module driven by the package's own window loop (:class:`~lightning_weighted.loop.WindowLoop` over
    a :class:`~lightning_weighted.engines.ddp.DDPEngine`), as ``WeightedDDPStrategy`` drives it: the raw level
    measures what the strategy runs, without Lightning around it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.engine = DDPEngine(self.ddp, self.ddp.module)
        self.loop = self.make_loop()
        self.batch_idx = self.optimizer_steps = 0

    def make_loop(self) -> WindowLoop:
        return WindowLoop(self.engine, CPU, TRAINER, self.name)

    def end(self) -> None:
        """The optimizer step after the window's last backward; none where the window holds no item."""
        result = self.loop.finish(self.optimizer_steps)
        self.optimizer_steps += 1
        if result.items == 0:  # the loop dropped every gradient
            self.optimizer.zero_grad(set_to_none=True)
            return
        self.finish()


class AfterStep(WeightedStep):
    """What ``strategy="ddp_weighted"`` does with counts returned by ``training_step`` (known only after it): each
    count (``batch[2].sum()``, a tensor, as ``training_step`` returns it) is checked where it lives, each loss
    scaled to its item sum, the window's payload summed by one asynchronous float64 all-reduce started before the
    syncing backward, DDP's own C++ reducer averaging, and the reduced gradients multiplied by ``P c / N`` once
    after it."""

    name = "ddp_weighted_after"

    def step(self, window: Iterator[Batch]) -> None:
        loop = self.loop
        for micro, batch in enumerate(window):
            loop.begin_batch(self.batch_idx)
            self.batch_idx += 1
            with self.sync_context(micro):
                loss = self.ddp(batch)
                loop.add(loss, read_count(batch[2].sum()), False)
                scaled = loop.scaled(loss)
                if micro == self.accumulate - 1:
                    loop.end()
                scaled.backward()
        self.end()


class AheadStep(WeightedStep):
    """What ``strategy="ddp_weighted"`` does with an ``ItemCounter`` (counts ahead), on a raw DDP module.

    The same pieces as the strategy (``Lookahead``, ``Planner``, ``WindowLoop``): each batch counted on the host as
    the stream yields it, the next window fetched and counted at this window's syncing microbatch, every loss
    scaled by ``P n / N`` before its backward, DDP's own C++ reducer averaging; the window's payload (the next
    window's ``N``, this window's flags and loss) is summed by one asynchronous float64 all-reduce started before
    the syncing backward and read once after it.
    """

    name = "ddp_weighted"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lookahead = Lookahead(_count, True, Participation())  # integer counts: tokens
        size = self.accumulate  # no epochs here: every window is A microbatches
        self.loop.planner = self.planner = Planner(self.lookahead, lambda _: size, self.engine, CPU)

    def feed(self, data: Sequence[Sequence[Batch]]) -> None:
        self.stream = self.lookahead.iterate(iter(BatchStream([b for window in data for b in window])))

    def step(self, window: Iterator[Batch]) -> None:
        loop = self.loop
        for micro in range(self.accumulate):
            batch = next(self.stream)
            loop.begin_batch(self.batch_idx)
            self.batch_idx += 1
            sync = micro == self.accumulate - 1
            self.arm(sync)
            with self.sync_context(micro):
                loss = self.ddp(batch)
                loop.add(loss, self.planner.count, False)
                scaled = loop.scaled(loss)
                if sync:
                    loop.end()
                scaled.backward()
        self.end()

    def arm(self, sync: bool) -> None:
        """Before each microbatch's forward: whether it is the window's syncing one."""


class AheadCarrierStep(AheadStep):
    """The ablation of ddp_weighted's counts ahead that the package shipped before its payload all-reduce: the
    window's handover (the next window's count, this window's flags and loss share) rides in the gradient of one
    extra parameter (``carrier.Carrier``) through DDP's bucket all-reduce, no collective of its own, and is read
    once after the syncing backward (``carrier.CarrierLoop``)."""

    name = "ddp_weighted_carrier"

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        # DDP's forward returns the loss, as Lightning's `training_step` through DDP does: the carrier adds to it
        dtype = next(model.parameters()).dtype
        if not fits(dtype, self.world_size):
            raise ValueError(f"the carrier cannot carry a count in {dtype} over {self.world_size} ranks")
        self.carrier = Carrier(super().wrap(model), dtype, CPU, self.world_size)
        return self.carrier

    def make_loop(self) -> WindowLoop:
        return CarrierLoop(self.carrier, self.engine, CPU, TRAINER, self.name)

    def arm(self, sync: bool) -> None:
        self.carrier.arm(sync)


def _count(batch: Batch) -> torch.Tensor:
    """``ItemCounter("tokens", key=2, mask=True)`` without the callback: the valid items of a benchmark batch."""
    return batch[2].sum()


# ---------------------------------------------------------------------------------------------------------------
# Ablations of ddp_weighted's cost (the `ablation` level of run.py, and overhead.py): each adds one piece of a
# mechanism to plain DDP; the carrier_* steps take ddp_weighted_carrier (carrier.py) apart.


class PythonHookStep(PlainDDPStep):
    """Plain DDP through torch's own Python ``allreduce_hook``: the cost of any Python comm hook."""

    name = "py_allreduce_hook"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ddp.register_comm_hook(None, default_hooks.allreduce_hook)


class ScaleOnlyStep(RawStep):
    """Plain DDP whose losses are scaled by numbers known on the host (the counts of the step's window, counted
    as the batches arrive, with ``N`` taken as twice the local count): the cost of scaling alone."""

    name = "scale_only"

    def step(self, window: Iterator[Batch]) -> None:
        batches = list(window)
        counts = [float(b[2].sum()) for b in batches]
        total = self.world_size * sum(counts) or 1.0
        for micro, batch in enumerate(batches):
            with self.sync_context(micro):
                (self.ddp(batch) * (self.world_size * counts[micro] / total)).backward()
        self.finish()


class CarrierOnlyStep(ScaleOnlyStep):
    """ScaleOnlyStep plus the carrier of the ablation (``carrier.Carrier``): its parameter in the first bucket, its
    term in the syncing forward, a fixed handover through its hook and one host read of it after the backward (no
    window bookkeeping)."""

    name = "carrier_fixed"
    in_graph = True  # the carrier's parameter joins DDP's bucket and the syncing backward
    hands_over = True  # a handover is written before the syncing backward and read after it

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        self.carrier = Carrier(super().wrap(model), next(model.parameters()).dtype, CPU, self.world_size)
        self.carrier.rider.requires_grad_(self.in_graph)  # DDP leaves out a parameter that needs no gradient
        return self.carrier

    def step(self, window: Iterator[Batch]) -> None:
        batches = list(window)
        counts = [float(b[2].sum()) for b in batches]
        total = self.world_size * sum(counts) or 1.0
        for micro, batch in enumerate(batches):
            sync = micro == self.accumulate - 1
            self.carrier.arm(sync and self.in_graph)
            with self.sync_context(micro):
                if sync and self.hands_over:
                    self.carrier.load([0.0, 0.0, 1.0, 0.0])
                (self.ddp(batch) * (self.world_size * counts[micro] / total)).backward()
        if self.hands_over:
            self.carrier.read()
        else:
            self.carrier.rider.grad = None  # what reached it passed through the hook unchanged
        self.finish()


class CarrierInGraphStep(CarrierOnlyStep):
    """The carrier's parameter in DDP's bucket and its term in the syncing forward, no handover: its gradient (zero)
    passes through the hook."""

    name = "carrier_in_graph"
    hands_over = False


class CarrierWrapperStep(CarrierOnlyStep):
    """The carrier's module call around the model on every microbatch alone: its parameter needs no gradient, so DDP
    leaves it out, and no term is added."""

    name = "carrier_wrapper"
    in_graph = hands_over = False


VARIANTS: dict[str, type[RawStep]] = {
    cls.name: cls
    for cls in (
        PlainDDPStep,
        ControlStep,
        AheadStep,
        AheadCarrierStep,
        AfterStep,
        PostHocStep,
        PreCountStep,
        PythonHookStep,
        ScaleOnlyStep,
        CarrierWrapperStep,
        CarrierInGraphStep,
        CarrierOnlyStep,
    )
}


class Runner:
    def __init__(self, rank: int, world_size: int, counter: CollectiveCounter) -> None:
        self.rank, self.world_size, self.counter = rank, world_size, counter
        self.references: dict[Any, list[torch.Tensor]] = {}

    def reference(self, point: Point, pattern: list[list[list[bool]]]) -> list[torch.Tensor]:
        key = (point.size, point.rows, point.seed, json.dumps(pattern))
        if key not in self.references:
            self.references[key] = reference_params(point.size, point.rows, point.seed, pattern, self.world_size)
        return self.references[key]

    def run(
        self,
        point: Point,
        variants: Sequence[str],
        epoch_steps: int = 1,
        imbalance: float = 0.0,
        correctness: bool = True,
    ) -> dict[str, Any]:
        """Times ``point.rounds`` rounds after ``point.warmup``; a timed unit is ``epoch_steps`` optimizer steps."""
        dtype = DTYPES[point.dtype]
        steps = list(variants)
        models = {
            name: VARIANTS[name](
                make_model(point.size, point.seed).to(dtype), self.rank, self.world_size, point.accumulate
            )
            for name in steps
        }
        initial = {name: model.parameters() for name, model in models.items()}
        for model in models.values():
            model.capture = True
        units = point.warmup + point.rounds
        total_steps = units * epoch_steps
        pattern = self.pattern(point, total_steps, epoch_steps, imbalance)
        data = [
            [
                make_batch(point.size, point.rows, point.seed, self.rank, s, m, pattern[s][self.rank][m])
                for m in range(point.accumulate)
            ]
            for s in range(total_steps)
        ]
        for batches in data:  # the model's dtype, as a loader with `bf16-true` would hand them out
            for k, (x, y, w) in enumerate(batches):
                batches[k] = (x.to(dtype), y, w)
        for model in models.values():
            model.feed(data)
        times: dict[str, list[float]] = {name: [] for name in steps}
        calls: dict[str, list[tuple[str, str, int]]] = {}
        for unit in range(units):
            order = list(steps)
            random.Random(point.seed * 1_000_003 + unit).shuffle(order)
            for name in order:
                model = models[name]
                count = unit == point.warmup - 1  # the last warm-up unit: DDP's buckets are rebuilt by then
                dist.barrier()
                start = time.perf_counter()
                with self.counter.counting() if count else _nothing() as recorded:
                    for s in range(unit * epoch_steps, (unit + 1) * epoch_steps):
                        model.step(iter(BatchStream(data[s])))
                elapsed = time.perf_counter() - start
                if count:
                    calls[name] = list(recorded) if recorded is not None else []
                if unit >= point.warmup:
                    times[name].append(elapsed)
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, times)
        slowest = {name: [max(g[name][k] for g in gathered) for k in range(point.rounds)] for name in steps}
        result: dict[str, Any] = {
            "point": point.__dict__,
            "imbalance": imbalance,
            "epoch_steps": epoch_steps,
            "times": slowest,
            "collectives": {name: _per_step(calls.get(name, []), epoch_steps, dtype) for name in steps},
            "buckets": {name: bucket_counts(models[name].ddp) for name in steps},
        }
        if correctness and self.rank == 0:
            expected = self.reference(point, pattern)
            expected_initial = list(make_model(point.size, point.seed).parameters())
            result["deviation"] = {
                name: deviation(models[name].parameters(), initial[name], expected, expected_initial) for name in steps
            }
            gradient = reference_gradient(point.size, point.rows, point.seed, pattern[0], self.world_size, dtype)
            result["gradient_deviation"] = {
                name: gradient_deviation(models[name].captured or [], gradient) for name in steps
            }
        dist.barrier()
        del models, data
        gc.collect()
        return result

    def pattern(self, point: Point, total_steps: int, epoch_steps: int, imbalance: float) -> list[list[list[bool]]]:
        """``[step][rank][micro]`` → zero-count microbatch? In the imbalance sweep rank 0 holds ``imbalance``
        fewer real microbatches per epoch and pads its turns with zero-count microbatches."""
        per_epoch = epoch_steps * point.accumulate
        real = round(per_epoch * (1 - imbalance))
        return [
            [
                [rank == 0 and (s % epoch_steps) * point.accumulate + m >= real for m in range(point.accumulate)]
                for rank in range(self.world_size)
            ]
            for s in range(total_steps)
        ]


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: Any) -> None:
        return None


def _per_step(calls: list[tuple[str, str, int]], steps: int, dtype: torch.dtype) -> dict[str, Any]:
    return per_step(calls, steps, dtype)


CORE = [
    "ddp",
    "ddp_control",
    "ddp_weighted",
    "ddp_weighted_carrier",
    "ddp_weighted_after",
    "post_hoc",
    "pre_count",
]


def gloo_probe(rank: int) -> dict[str, float]:
    """Median time of the count vector's float64 all-reduce and of an 8 MiB fp32 one."""
    small = torch.zeros(WIDTH, dtype=torch.float64)
    large = torch.zeros(2 * 1024 * 1024, dtype=torch.float32)
    results = {}
    for name, tensor, repeats in (("count_allreduce_s", small, 200), ("allreduce_8MiB_s", large, 15)):
        for _ in range(3):
            dist.all_reduce(tensor)
        samples = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            samples.append(time.perf_counter() - start)
        results[name] = sorted(samples)[len(samples) // 2]
    return results


def memory_run(point: Point, variant: str, rank: int, world_size: int) -> dict[str, Any]:
    """Peak resident memory growth over ``point.rounds`` steps of one variant, alone in its process."""
    dtype = DTYPES[point.dtype]
    data = [
        [make_batch(point.size, point.rows, point.seed, rank, s, m) for m in range(point.accumulate)]
        for s in range(point.rounds)
    ]
    data = [[(x.to(dtype), y, w) for x, y, w in batches] for batches in data]
    model = VARIANTS[variant](make_model(point.size, point.seed).to(dtype), rank, world_size, point.accumulate)
    model.feed(data)
    gc.collect()
    dist.barrier()
    hwm_reset = _reset_peak_rss()
    before = _rss_kib("VmRSS") if hwm_reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for s in range(point.rounds):
        model.step(iter(BatchStream(data[s])))
    peak = _rss_kib("VmHWM") if hwm_reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.model.parameters())
    dist.barrier()
    return {
        "variant": variant,
        "peak_delta_bytes": (peak - before) * 1024,
        "parameter_bytes": parameter_bytes,
        "method": "VmHWM after clear_refs" if hwm_reset else "ru_maxrss",
    }


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--spec", required=True, help="JSON: points, sweep, memory, probe, timeout")
    parser.add_argument("--out", required=True, help="rank 0 writes its JSON results here")
    args = parser.parse_args()
    spec = json.loads(Path(args.spec).read_text()) if args.spec.endswith(".json") else json.loads(args.spec)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=spec.get("timeout", 120)))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    counter = CollectiveCounter()
    counter.install()
    runner = Runner(rank, world_size, counter)
    results: dict[str, Any] = {"points": [], "sweep": [], "ablation": [], "memory": None, "probe": None}
    if spec.get("probe"):
        results["probe"] = gloo_probe(rank)
    variants = spec.get("variants", CORE)
    for entry in spec.get("points", []):
        results["points"].append(runner.run(Point(**entry), variants, correctness=spec.get("correctness", True)))
        _log(rank, results["points"][-1])
    for entry in spec.get("ablation", []):
        results["ablation"].append(
            runner.run(Point(**entry), spec["ablation_variants"], correctness=spec.get("correctness", True))
        )
        _log(rank, results["ablation"][-1])
    for entry in spec.get("sweep", []):
        entry = dict(entry)
        imbalance, epoch_steps = entry.pop("imbalance"), entry.pop("epoch_steps")
        results["sweep"].append(
            runner.run(Point(**entry), variants, epoch_steps, imbalance, correctness=spec.get("correctness", True))
        )
        _log(rank, results["sweep"][-1])
    if spec.get("memory"):
        results["memory"] = memory_run(Point(**spec["memory"]["point"]), spec["memory"]["variant"], rank, world_size)
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, results["memory"])
        results["memory"]["peak_delta_bytes"] = max(g["peak_delta_bytes"] for g in gathered)
    counter.uninstall()
    if rank == 0:
        Path(args.out).write_text(json.dumps(results))
    finish()


def _log(rank: int, result: dict[str, Any]) -> None:
    if rank != 0:
        return
    times = result["times"]
    medians = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}
    point = result["point"]
    print(
        f"{point['size']} A={point['accumulate']} {point['dtype']} imbalance={result['imbalance']}: "
        + " ".join(f"{k}={v:.2f}ms" for k, v in medians.items())
        + "".join(
            f"\n  {k}: " + " ".join(f"{n}={v:.1e}" for n, v in result[k].items())
            for k in ("deviation", "gradient_deviation")
            if k in result
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
