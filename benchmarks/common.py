"""What every benchmark shares: models, data, the float64 reference, statistics, collective counting, launching.

Data (identical for every variant): each microbatch is a padded block of ``rows`` items, ``x, y`` of shape
``[rows, width]`` and a boolean mask ``w`` of valid items. Rank 0 holds sparse masks (10-40 % valid), rank 1 dense
ones (70-100 %), their targets offset in opposite directions, so a mean of per-rank means (plain DDP, and
Lightning's ``loss / A``) trains a measurably different model from the global item mean.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
Batch = tuple[Tensor, Tensor, Tensor]  # x [rows, width], y [rows, width], w [rows] (bool mask)
SIZES = {"tiny": (32, 2), "0.2M": (256, 3), "2M": (1024, 2), "20M": (2048, 5)}  # (width, Linear layers)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LR = 0.2


@dataclass(frozen=True)
class Point:
    """One benchmarked configuration."""

    size: str
    accumulate: int
    dtype: str
    rounds: int
    warmup: int
    rows: int = 32
    seed: int = 0

    @property
    def steps(self) -> int:
        return self.warmup + self.rounds

    @property
    def label(self) -> str:
        return f"{self.size} A={self.accumulate} {self.dtype}"


def make_model(size: str, seed: int) -> nn.Sequential:
    width, layers = SIZES[size]
    torch.manual_seed(seed)
    modules: list[nn.Module] = []
    for k in range(layers):
        modules += [nn.Linear(width, width)] + ([nn.ReLU()] if k < layers - 1 else [])
    return nn.Sequential(*modules)


def parameter_count(size: str) -> int:
    width, layers = SIZES[size]
    return layers * (width * width + width)


def make_batch(size: str, rows: int, seed: int, rank: int, step: int, micro: int) -> Batch:
    """Microbatch ``micro`` of optimizer step ``step`` on ``rank``: deterministic, so any process can rebuild it."""
    width, _ = SIZES[size]
    generator = torch.Generator().manual_seed(((seed * 7919 + rank) * 100_003 + step) * 64 + micro)
    x = torch.randn(rows, width, generator=generator)
    y = 0.5 * torch.randn(rows, width, generator=generator) + (1.0 if rank == 1 else -1.0)
    low, high = (0.1, 0.4) if rank == 0 else (0.7, 1.0)
    w = torch.rand(rows, generator=generator) < low + (high - low) * float(torch.rand((), generator=generator))
    w[0] = True  # every microbatch holds at least one item
    return x, y, w


def item_losses(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """Per-item loss ``½ · mean_j (f(x)_j − y_j)²``, computed in float32 (or float64) whatever the model dtype."""
    out = model(x.to(next(model.parameters()).dtype))
    out = out.to(torch.float64) if y.dtype == torch.float64 else out.float()
    return 0.5 * ((out - y) ** 2).mean(-1)


def local_sum(model: nn.Module, batch: Batch) -> Tensor:
    x, y, w = batch
    return (item_losses(model, x, y) * w).sum()


def local_mean(model: nn.Module, batch: Batch) -> Tensor:
    """The mean over the valid items of one microbatch."""
    return local_sum(model, batch) / batch[2].sum().clamp_min(1)


def _reference_loss(model: nn.Module, point: Point, step: int, world_size: int) -> Tensor:
    """The global item mean of step ``step``'s window over every rank's microbatches, in float64."""
    batches = [
        make_batch(point.size, point.rows, point.seed, rank, step, micro)
        for rank in range(world_size)
        for micro in range(point.accumulate)
    ]
    x, y, w = (torch.cat([b[k] for b in batches]).double() for k in range(3))
    return (item_losses(model, x, y) * w).sum() / w.sum()


def reference_params(point: Point, steps: int, world_size: int) -> list[Tensor]:
    """Float64 single-process SGD on the global item mean of every optimizer step."""
    model = make_model(point.size, point.seed).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(steps):
        optimizer.zero_grad()
        _reference_loss(model, point, step, world_size).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def reference_gradient(point: Point, world_size: int) -> list[Tensor]:
    """The float64 gradient of step 0's global item mean at the initial parameters, as rounded to the point's dtype
    (where every variant starts)."""
    model = make_model(point.size, point.seed).to(DTYPES[point.dtype]).double()
    _reference_loss(model, point, 0, world_size).backward()
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def deviation(params: Sequence[Tensor], initial: Sequence[Tensor], expected: Sequence[Tensor], point: Point) -> float:
    """``‖(θ − θ_0) − (θ_ref − θ_0,ref)‖ / ‖θ_ref − θ_0,ref‖``: the error of the total update relative to the
    reference's (with bf16 parameters it leaves out the rounding of the initial ones, which no variant can help)."""
    error = moved = 0.0
    for p, p0, e, e0 in zip(params, initial, expected, make_model(point.size, point.seed).parameters(), strict=True):
        reference_update = e.double() - e0.double()
        error += float(((p.double() - p0.double()) - reference_update).pow(2).sum())
        moved += float(reference_update.pow(2).sum())
    return math.sqrt(error / moved)


def gradient_deviation(grads: Sequence[Tensor], expected: Sequence[Tensor]) -> float:
    """``‖g − g_ref‖ / ‖g_ref‖`` over all parameters."""
    error = sum(float((g.double() - e).pow(2).sum()) for g, e in zip(grads, expected, strict=True))
    return math.sqrt(error / sum(float(e.pow(2).sum()) for e in expected))


def summary(values: Sequence[float]) -> dict[str, float]:
    """Median, p10, p90 and the median's 95 % confidence interval (order statistics, rounds taken as independent)."""
    ordered = sorted(values)
    n = len(ordered)

    def quantile(q: float) -> float:
        position = q * (n - 1)
        low = math.floor(position)
        return ordered[low] + (ordered[min(low + 1, n - 1)] - ordered[low]) * (position - low)

    r = max(1, math.floor(n / 2 - 0.98 * math.sqrt(n)))
    return {
        "median": statistics.median(ordered),
        "p10": quantile(0.1),
        "p90": quantile(0.9),
        "ci_low": ordered[r - 1],
        "ci_high": ordered[n - r],
        "n": n,
    }


def pool(repeats: Sequence[Sequence[dict[str, Any]]], pairs: dict[str, tuple[str, str]]) -> list[dict[str, Any]]:
    """One entry per point: each ratio of ``pairs`` (label -> variant ÷ baseline, paired per round) pooled over the
    repeats, the median step time of every variant, and the first repeat's other fields (the same in every repeat)."""
    pooled = []
    for entries in zip(*repeats, strict=True):
        times = [entry["times"] for entry in entries]
        ratios = {
            label: summary([t / b for run in times for t, b in zip(run[name], run[base], strict=True)])
            for label, (name, base) in pairs.items()
            if name in times[0] and base in times[0]
        }
        ms = {name: summary([t * 1e3 for run in times for t in run[name]])["median"] for name in times[0]}
        pooled.append({key: value for key, value in entries[0].items() if key != "times"} | {"ratio": ratios, "ms": ms})
    return pooled


class BatchStream:
    """Yields fresh copies of pre-built microbatches, as a data loader hands out new tensors."""

    def __init__(self, batches: Sequence[Batch], cycle: bool = False) -> None:
        self.batches, self.cycle = batches, cycle

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Batch]:
        for x, y, w in itertools.cycle(self.batches) if self.cycle else self.batches:
            yield x.clone(), y.clone(), w.clone()


# Collectives that pass through Python (DDP's own bucket all-reduces run in C++ and are taken from its logging
# data instead, `bucket_counts`), each counted by the tensor this rank sends: its position and keyword.
_SENT = {"all_reduce": (0, "tensor"), "broadcast": (0, "tensor"), "all_gather": (1, "tensor"), "barrier": (-1, "")}
_SENT |= {"all_gather_into_tensor": (1, "input_tensor"), "reduce_scatter_tensor": (1, "input")}
_SENT |= {"all_gather_single": (1, "input"), "reduce_scatter_single": (1, "input")}


class CollectiveCounter:
    """Counts calls and payload bytes of ``torch.distributed`` collectives while ``active``, by kind and dtype."""

    def __init__(self) -> None:
        self.active = False
        self.calls: list[tuple[str, str, int]] = []  # (name, dtype, bytes)
        self._originals = {name: getattr(dist, name) for name in _SENT if hasattr(dist, name)}
        for name, original in self._originals.items():
            setattr(dist, name, self._wrap(name, original))

    def _wrap(self, name: str, original: Any) -> Any:
        position, keyword = _SENT[name]

        def counting(*args: Any, **kwargs: Any) -> Any:
            if self.active:
                sent = kwargs.get(keyword, args[position] if 0 <= position < len(args) else None)
                if isinstance(sent, Tensor):
                    self.calls.append(
                        (name, str(sent.dtype).removeprefix("torch."), sent.numel() * sent.element_size())
                    )
                else:
                    self.calls.append((name, "", 0))
            return original(*args, **kwargs)

        return counting

    @contextlib.contextmanager
    def counting(self) -> Iterator[list[tuple[str, str, int]]]:
        self.calls = []
        self.active = True
        try:
            yield self.calls
        finally:
            self.active = False


def kinds(calls: Sequence[tuple[str, str, int]], steps: int = 1) -> dict[str, list[float]]:
    """``{kind[dtype]: [calls, bytes]}`` per optimizer step; the reduce-scatter and all-gather names merged."""
    totals: dict[str, list[float]] = {}
    for name, dtype, size in calls:
        key = f"{name.replace('_single', '_tensor').replace('all_gather_tensor', 'all_gather')}[{dtype}]"
        entry = totals.setdefault(key, [0, 0])
        entry[0] += 1 / steps
        entry[1] += size / steps
    return totals


def timed_rounds(
    point: Point, names: Sequence[str], step: Callable[[str], None], counter: CollectiveCounter
) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Runs ``point.steps`` rounds of one ``step(name)`` per name, in an order shuffled per round (the same on every
    rank), each after a barrier. Returns the slowest rank's time of each timed round per name, and the collectives of
    each name's last warm-up step (DDP has rebuilt its buckets by then)."""
    times: dict[str, list[float]] = {name: [] for name in names}
    calls: dict[str, Any] = {}
    for unit in range(point.steps):
        order = list(names)
        random.Random(point.seed * 1_000_003 + unit).shuffle(order)
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            if unit == point.warmup - 1:
                with counter.counting() as recorded:
                    step(name)
                calls[name] = kinds(recorded)
            else:
                step(name)
            if unit >= point.warmup:
                times[name].append(time.perf_counter() - start)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, times)
    return {name: [max(g[name][k] for g in gathered) for k in range(point.rounds)] for name in names}, calls


def bucket_counts(ddp: nn.parallel.DistributedDataParallel) -> tuple[int, int]:
    """(buckets, bytes) DDP reduces per sync, from its logging data (the reducer's C++ all-reduces)."""
    data = ddp._get_ddp_logging_data()
    sizes = str(data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or "")
    buckets = [int(s) for s in sizes.split(",") if s.strip()]
    return len(buckets), sum(buckets)


def launch(args: Sequence[str], world_size: int, timeout: float) -> str:
    """Runs ``run.py rank ARGS`` on ``world_size`` local ranks with ``torch.distributed.run`` under a hard timeout.

    Returns the ranks' output. torchrun ends every rank when one fails; on the timeout the whole session is killed.
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(world_size),
        "--master-addr", "127.0.0.1", "--master-port", str(port), "--monitor-interval", "0.1",
        str(HERE / "run.py"), "rank", *args,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT / "examples"), os.environ.get("PYTHONPATH"))))
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise RuntimeError(f"{args[:1]} did not finish within {timeout:.0f}s\n{output[-8000:]}") from None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # nothing of the run outlives it
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(args)[:300]} failed ({process.returncode})\n{output[-8000:]}")
    return output


def finish() -> None:
    """Ends a rank's run: waits for every rank, keeps the process group, and lets gloo settle before the exit.

    A gloo thread that completes a collective takes the GIL once more to release the work; an interpreter that is
    finalizing by then aborts ("terminate called without an active exception"; after a ``destroy_process_group()``,
    about one launch in 80 did). A short sleep after the last barrier hands it over.
    """
    dist.barrier()
    time.sleep(0.05)


@contextlib.contextmanager
def one_rank() -> Iterator[None]:
    """A 1-rank gloo group (DDP still buckets, copies and all-reduces) on one intra-op thread, for the block."""
    torch.set_num_threads(1)
    store = Path(tempfile.mkdtemp(prefix="one-rank-")) / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
