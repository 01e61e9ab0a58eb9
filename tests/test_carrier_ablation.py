"""The carrier ablation (``benchmarks/carrier.py``) against DDP's arithmetic: each rank's gradient times the rounded
1/P, then a SUM in the gradients' dtype in any order; the decoded count must be the exact SUM of every rank's count
(no processes)."""

from __future__ import annotations

import doctest
import importlib.util
import random
from types import ModuleType

import pytest
import torch
from launcher import ROOT


def _benchmark(name: str) -> ModuleType:
    """A module of ``benchmarks/`` (not a package), loaded from its file."""
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


carrier = _benchmark("carrier")
Carrier, decode, digit_bits, encode, fits, width = (
    carrier.Carrier,
    carrier.decode,
    carrier.digit_bits,
    carrier.encode,
    carrier.fits,
    carrier.width,
)

MAX_COUNT = 2.0**53 - 1  # a rank's window count stays below 2**53


def _ddp_average(rows: list[list[float]], dtype: torch.dtype, seed: int) -> list[float]:
    """What DDP's reducer leaves in the gradient: every rank's values times 1/P (computed as DDP's `mul_out` with a
    scalar does), then summed in `dtype`, one rank after another in a shuffled order, each partial sum rounded."""
    ranks = len(rows)
    scaled = [torch.tensor(row, dtype=dtype) * (1.0 / ranks) for row in rows]
    random.Random(seed).shuffle(scaled)
    total = torch.zeros_like(scaled[0])
    for part in scaled:
        total = (total + part).to(dtype)
    return total.double().tolist()


@pytest.mark.parametrize(
    ("dtype", "ranks"),
    [
        (torch.float32, 2),
        (torch.float32, 3),
        (torch.float32, 7),
        (torch.float32, 96),
        (torch.float32, 1000),
        (torch.bfloat16, 2),
        (torch.bfloat16, 3),
        (torch.bfloat16, 100),
        (torch.bfloat16, 256),
        (torch.float16, 6),
        (torch.float16, 2048),
        (torch.float64, 5),
    ],
)
def test_the_summed_count_decodes_exactly_from_ddps_average(dtype, ranks):
    bits = digit_bits(dtype, ranks)
    assert bits > 0 and fits(dtype, ranks)
    rng = random.Random(ranks)
    for seed in range(3):
        # every digit at its largest on every rank (the worst rounding), then random whole counts and weight sums
        counts = [MAX_COUNT] * ranks if seed == 0 else [float(rng.randrange(2**40)) for _ in range(ranks)]
        if seed == 2:
            counts = [rng.randrange(2**20) + rng.randrange(2**24) / 2**24 for _ in range(ranks)]
        rows = [encode([n, float(r % 2), 1.0, 0.5], ranks, bits) for r, n in enumerate(counts)]
        items, invalid, more, loss = decode(_ddp_average(rows, dtype, seed), ranks, bits)
        assert items == sum(round(n * 2**24) for n in counts) / 2**24  # exact to 2**-24 per rank
        assert (invalid, more) == (ranks // 2, ranks)
        # the loss share travels as a plain value of `dtype`: a few significant digits in 16 bits
        assert loss == pytest.approx(0.5 * ranks, rel=1e-4 if dtype.itemsize >= 4 else 0.1)


@pytest.mark.parametrize(("dtype", "ranks"), [(torch.bfloat16, 257), (torch.float16, 4096), (torch.float32, 4095)])
def test_beyond_its_limits_the_carrier_declines(dtype, ranks):
    assert digit_bits(dtype, ranks) == 0 and not fits(dtype, ranks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_rider_fills_whole_cache_lines_and_its_padding_carries_nothing(dtype):
    # DDP puts the rider first in its bucket: a size of whole 64-byte lines keeps the gradients after it aligned
    for ranks in (2, 3, 96):
        rider = Carrier(torch.nn.Linear(2, 1), dtype, torch.device("cpu"), ranks).rider
        assert rider.numel() * dtype.itemsize % 64 == 0 and width(dtype, ranks) <= rider.numel()
    carrier = Carrier(torch.nn.Linear(2, 1), dtype, torch.device("cpu"), ranks=1)  # no average: the SUM is ours
    carrier.load([5.5, 0.0, 1.0, 0.0], fill=lambda slot: slot.add_(0.25))
    carrier.term().backward()
    assert carrier.rider.grad is not None and carrier.rider.grad[width(dtype, 1) :].eq(0).all()
    assert carrier.read() == [5.5, 0, 1, 0.25]
    assert carrier.read() is None  # read once: the next window's backward brings the next handover


def test_the_carrier_module_s_examples_hold():
    found = doctest.testmod(carrier)
    assert found.attempted > 0 and found.failed == 0
