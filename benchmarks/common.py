"""Shared by every benchmark worker: models, data, the float64 reference, statistics and collective counting.

Data model (identical for every variant): each microbatch is a padded block of ``rows`` items, ``x, y`` of
shape ``[rows, width]`` and a boolean mask ``w`` of valid items. Rank 0 holds sparse masks (10-40 % valid),
rank 1 dense ones (70-100 %), and their targets are offset in opposite directions, so a mean of per-rank
means (plain DDP, and Lightning's ``loss / A`` across microbatches) trains a measurably different model from
the global item mean. A zero-count microbatch (an exhausted rank's turn in the imbalance sweep) has 0 rows.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

Batch = tuple[Tensor, Tensor, Tensor]  # x [rows, width], y [rows, width], w [rows] (bool mask)

# name -> (width, Linear layers): ~0.2M, ~2M, ~20M parameters (weights + biases)
SIZES: dict[str, tuple[int, int]] = {
    "tiny": (32, 2),  # smoke test only
    "0.2M": (256, 3),
    "2M": (1024, 2),
    "20M": (2048, 5),
}
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
        modules.append(nn.Linear(width, width))
        if k < layers - 1:
            modules.append(nn.ReLU())
    return nn.Sequential(*modules)


def parameter_count(size: str) -> int:
    width, layers = SIZES[size]
    return layers * (width * width + width)


def make_batch(size: str, rows: int, seed: int, rank: int, step: int, micro: int, empty: bool = False) -> Batch:
    """Microbatch ``micro`` of optimizer step ``step`` on ``rank``: deterministic, so any process can rebuild it."""
    width, _ = SIZES[size]
    if empty:
        return torch.zeros(0, width), torch.zeros(0, width), torch.zeros(0, dtype=torch.bool)
    generator = torch.Generator().manual_seed(((seed * 7919 + rank) * 100_003 + step) * 64 + micro)
    x = torch.randn(rows, width, generator=generator)
    sign = 1.0 if rank == 1 else -1.0
    y = 0.5 * torch.randn(rows, width, generator=generator) + sign
    low, high = (0.1, 0.4) if rank == 0 else (0.7, 1.0)
    density = low + (high - low) * float(torch.rand((), generator=generator))
    w = torch.rand(rows, generator=generator) < density
    w[0] = True  # every real microbatch holds at least one item
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
    """The mean over the valid items of one microbatch; 0 (not 0/0) for a zero-count microbatch."""
    x, y, w = batch
    return (item_losses(model, x, y) * w).sum() / w.sum().clamp_min(1)


def reference_params(
    size: str, rows: int, seed: int, windows: Sequence[Sequence[Sequence[bool]]], world_size: int
) -> list[Tensor]:
    """Float64 single-process SGD on the global item mean of every optimizer step.

    ``windows[s][r][m]`` says whether microbatch ``m`` of step ``s`` on rank ``r`` is empty (zero count).
    """
    model = make_model(size, seed).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step, ranks in enumerate(windows):
        batches = [
            make_batch(size, rows, seed, rank, step, micro, empty)
            for rank in range(world_size)
            for micro, empty in enumerate(ranks[rank])
        ]
        x = torch.cat([b[0] for b in batches]).double()
        y = torch.cat([b[1] for b in batches]).double()
        w = torch.cat([b[2] for b in batches]).double()
        if w.sum() == 0:
            continue
        optimizer.zero_grad()
        ((item_losses(model, x, y) * w).sum() / w.sum()).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def deviation(
    params: Sequence[Tensor], initial: Sequence[Tensor], expected: Sequence[Tensor], expected_initial: Sequence[Tensor]
) -> float:
    """``‖(θ − θ_0) − (θ_ref − θ_0,ref)‖ / ‖θ_ref − θ_0,ref‖``: the error of the total update relative to the
    reference's. With fp32 parameters ``θ_0 = θ_0,ref`` and this is the final-parameter deviation; with bf16
    parameters it leaves out the rounding of the initial parameters to bf16, which no variant can help."""
    error = moved = 0.0
    for p, p0, e, e0 in zip(params, initial, expected, expected_initial, strict=True):
        reference_update = e.double() - e0.double()
        error += float(((p.double() - p0.double()) - reference_update).pow(2).sum())
        moved += float(reference_update.pow(2).sum())
    return math.sqrt(error / moved)


def reference_gradient(
    size: str, rows: int, seed: int, empty: Sequence[Sequence[bool]], world_size: int, dtype: torch.dtype
) -> list[Tensor]:
    """The float64 gradient of the global item mean of step 0's window at the initial parameters (as rounded to
    ``dtype``, which is where every variant starts)."""
    model = make_model(size, seed).to(dtype).double()
    batches = [
        make_batch(size, rows, seed, rank, 0, micro, flag)
        for rank in range(world_size)
        for micro, flag in enumerate(empty[rank])
    ]
    x = torch.cat([b[0] for b in batches]).double()
    y = torch.cat([b[1] for b in batches]).double()
    w = torch.cat([b[2] for b in batches]).double()
    ((item_losses(model, x, y) * w).sum() / w.sum()).backward()
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def gradient_deviation(grads: Sequence[Tensor], expected: Sequence[Tensor]) -> float:
    """``‖g − g_ref‖ / ‖g_ref‖`` over all parameters."""
    error = sum(float((g.double() - e).pow(2).sum()) for g, e in zip(grads, expected, strict=True))
    return math.sqrt(error / sum(float(e.pow(2).sum()) for e in expected))


def summary(values: Sequence[float]) -> dict[str, float]:
    ordered = sorted(values)
    if not ordered:
        return {"median": math.nan, "p10": math.nan, "p90": math.nan, "n": 0}

    def quantile(q: float) -> float:
        position = q * (len(ordered) - 1)
        low = math.floor(position)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (position - low)

    # the median's 95 % confidence interval from order statistics (distribution-free; rounds taken as independent)
    n = len(ordered)
    r = max(1, math.floor(n / 2 - 0.98 * math.sqrt(n)))
    return {
        "median": statistics.median(ordered),
        "p10": quantile(0.1),
        "p90": quantile(0.9),
        "ci_low": ordered[r - 1],
        "ci_high": ordered[n - r],
        "n": n,
    }


def paired_ratios(times: dict[str, list[float]], baseline: str = "ddp") -> dict[str, list[float]]:
    """Per-round ratio ``t_variant / t_baseline``: both were measured in the same round, back to back."""
    base = times[baseline]
    return {name: [t / b for t, b in zip(series, base, strict=True)] for name, series in times.items()}


class BatchStream:
    """Yields fresh copies of pre-built microbatches, as a data loader hands out new tensors."""

    def __init__(self, batches: Sequence[Batch]) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[Batch]:
        for x, y, w in self.batches:
            yield x.clone(), y.clone(), w.clone()


# ---------------------------------------------------------------------------------------------------------------
# Collective counting: wraps the Python entry points of torch.distributed. DDP's own bucket all-reduces run in
# C++ (the reducer calls the process group directly) and never pass through here: with no Python comm hook they
# are taken from DDP's logging data instead (`bucket_counts`).

_COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "barrier",
    "reduce_scatter_tensor",
    "reduce",
    "gather",
    "scatter",
    "broadcast_object_list",
    "all_to_all_single",
)


class CollectiveCounter:
    """Counts calls and payload bytes of ``torch.distributed`` collectives while ``active``."""

    def __init__(self) -> None:
        self.active = False
        self.calls: list[tuple[str, str, int]] = []  # (name, dtype, payload bytes)
        self._originals: dict[str, Any] = {}

    def install(self) -> None:
        for name in _COLLECTIVES:
            original = getattr(dist, name, None)
            if original is None or name in self._originals:
                continue
            self._originals[name] = original
            setattr(dist, name, self._wrap(name, original))

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()

    def _wrap(self, name: str, original: Any) -> Any:
        def counting(*args: Any, **kwargs: Any) -> Any:
            if self.active:
                tensor = args[0] if args and isinstance(args[0], Tensor) else kwargs.get("tensor")
                if isinstance(tensor, Tensor):
                    self.calls.append(
                        (name, str(tensor.dtype).removeprefix("torch."), tensor.numel() * tensor.element_size())
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


def per_step(calls: Sequence[tuple[str, str, int]], steps: int, dtype: torch.dtype) -> dict[str, Any]:
    """Calls and bytes per optimizer step, split into gradient all-reduces (in the model's dtype, i.e. a
    Python comm hook's buckets) and everything else (counts, Lightning's flags)."""
    name = str(dtype).removeprefix("torch.")
    gradient = [c for c in calls if c[0] == "all_reduce" and c[1] == name]
    other = [c for c in calls if not (c[0] == "all_reduce" and c[1] == name)]
    return {
        "gradient_calls": len(gradient) / steps,
        "gradient_bytes": sum(c[2] for c in gradient) / steps,
        "other_calls": len(other) / steps,
        "other_bytes": sum(c[2] for c in other) / steps,
        "kinds": sorted({f"{c[0]}[{c[1]}]" for c in calls}),
    }


def bucket_counts(ddp: nn.parallel.DistributedDataParallel) -> tuple[int, int]:
    """(buckets, bytes) DDP reduces per sync, from its logging data (the reducer's C++ all-reduces)."""
    data = ddp._get_ddp_logging_data()
    sizes = str(data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or "")
    buckets = [int(s) for s in sizes.split(",") if s.strip()]
    return len(buckets), sum(buckets)


# ---------------------------------------------------------------------------------------------------------------
# Process launching


def launch(script: Path, args: Sequence[str], world_size: int, timeout: float) -> str:
    """Runs ``script`` on ``world_size`` local ranks with ``torch.distributed.run`` under a hard timeout.

    Returns the ranks' output. torchrun ends every rank when one fails; on the timeout the whole session is killed.
    """
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(world_size),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--monitor-interval", "0.1",
        str(script), *args,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise RuntimeError(f"{script.name} did not finish within {timeout:.0f}s\n{output[-8000:]}") from None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # nothing of the run outlives it
    if process.returncode != 0:
        raise RuntimeError(f"{script.name} {' '.join(args)[:300]} failed ({process.returncode})\n{output[-8000:]}")
    return output


def finish() -> None:
    """Ends a rank's run: waits for every rank, and keeps the process group for the exit.

    No ``destroy_process_group()``: while a group exists, lightning_weighted's exit hands the GIL to gloo's threads,
    which release the last collectives' tensors before the interpreter finalizes (after a destroy, about one launch
    in 80 aborted: "terminate called without an active exception").
    """
    dist.barrier()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ---------------------------------------------------------------------------------------------------------------
# Raw DDP training steps: one optimizer step over a window of `accumulate` microbatches.


class Loss(nn.Module):
    """The model's loss over a batch as a module's forward: DDP runs it inside its own forward, as Lightning runs
    ``training_step`` (every variant then pays the same module call).

    Args:
        model: the model.
        summed: return the sum over the batch's valid items (:func:`local_sum`) rather than their mean.
    """

    def __init__(self, model: nn.Module, summed: bool = False) -> None:
        super().__init__()
        self.model, self.summed = model, summed

    def forward(self, batch: Batch) -> Tensor:
        return local_sum(self.model, batch) if self.summed else local_mean(self.model, batch)


class RawStep:
    """One variant's DDP model and optimizer; ``step`` runs one optimizer step over a window of microbatches.

    Every variant runs the window the way Lightning does: ``no_sync`` for all microbatches but the last, one
    backward per microbatch, then ``optimizer.step()`` and ``zero_grad(set_to_none=True)``.
    """

    name = "?"
    summed = False  # the loss DDP's forward returns: the sum over the valid items rather than their mean

    def __init__(self, model: nn.Module, rank: int, world_size: int, accumulate: int) -> None:
        self.rank, self.world_size, self.accumulate = rank, world_size, accumulate
        self.model = model
        self.ddp = nn.parallel.DistributedDataParallel(self.wrap(model))
        self.optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        self.capture = False
        self.captured: list[Tensor] | None = None

    def wrap(self, model: nn.Module) -> nn.Module:
        """The module DDP wraps: the model's loss as its forward (:class:`Loss`), unless a variant adds to it."""
        return Loss(model, self.summed)

    def feed(self, data: Sequence[Sequence[Batch]]) -> None:
        """Sees every step's window before the first (a variant that reads its loader ahead keeps an iterator)."""

    def sync_context(self, micro: int) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext() if micro == self.accumulate - 1 else self.ddp.no_sync()

    def step(self, window: Iterator[Batch]) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        if self.capture:  # the synchronized gradient that the optimizer is about to apply (step 0 only)
            self.captured = [
                p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in self.model.parameters()
            ]
            self.capture = False
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def parameters(self) -> list[Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]
