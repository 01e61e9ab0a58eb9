"""Host time each raw DDP variant adds per optimizer step, on one rank, without the noise of a second one.

The 2-rank benchmark (``run.py``) times what users see; its paired ratios carry the other rank's jitter, which
hides differences below a few percent at 0.2M-2M parameters. Here one process runs every variant of
``raw_step.py`` on a 1-rank gloo group (DDP still buckets, copies and all-reduces), thousands of steps in an order
shuffled per step, and prints the median of the paired per-step differences to plain DDP with their quartiles: the
cost of what a variant does on the host, in microseconds.

    python benchmarks/overhead.py                          # 0.2M and 2M, A = 1 and 4 (≈ 11 min)
    python benchmarks/overhead.py --sizes tiny --steps 40  # the smoke test

``instructions.py`` counts the instructions of the same variants, which no other load moves.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from common import Batch, BatchStream, RawStep, make_batch, make_model
from raw_step import VARIANTS

DEFAULT = [
    "ddp_control",
    "scale_only",
    "carrier_wrapper",
    "carrier_in_graph",
    "carrier_fixed",
    "ddp_weighted_carrier",
    "ddp_weighted",
    "ddp_weighted_after",
]


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


def build(
    size: str, accumulate: int, steps: int, names: list[str]
) -> tuple[dict[str, RawStep], Callable[[int], Iterator[Batch]]]:
    """One 1-rank copy of each variant, fed ``steps`` windows of the same data, and the window of a given step."""
    distinct = 50  # distinct windows of data, cycled
    data = [[make_batch(size, 32, 0, 0, s, m) for m in range(accumulate)] for s in range(distinct)]
    models = {name: VARIANTS[name](make_model(size, 0), 0, 1, accumulate) for name in names}
    for model in models.values():
        model.feed([data[s % distinct] for s in range(steps)])
    return models, lambda step: iter(BatchStream(data[step % distinct]))


def differences(size: str, accumulate: int, steps: int, variants: list[str]) -> dict[str, list[float]]:
    """Per-step time of each variant minus plain DDP's in the same step, and plain DDP's own (``"ddp"``), in
    seconds, after a warm-up."""
    names = ["ddp", *variants]
    models, windows = build(size, accumulate, steps, names)
    times: dict[str, list[float]] = {name: [] for name in names}
    for step in range(steps):
        order = list(names)
        random.Random(step).shuffle(order)
        for name in order:
            start = time.perf_counter()
            models[name].step(windows(step))
            times[name].append(time.perf_counter() - start)
    warm = steps // 10
    plain = times["ddp"][warm:]
    added = {name: [t - b for t, b in zip(times[name][warm:], plain, strict=True)] for name in variants}
    return {"ddp": plain, **added}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="0.2M,2M")
    parser.add_argument("--accumulate", default="1,4")
    parser.add_argument("--steps", type=int, default=1500, help="optimizer steps per variant and point")
    parser.add_argument("--variants", default=",".join(DEFAULT))
    args = parser.parse_args()
    variants = args.variants.split(",")
    print("Host time added per optimizer step: median of the paired differences to plain DDP [q25, q75], µs")
    print("| point | plain DDP step (µs) | " + " | ".join(variants) + " |")
    print("|---|---:|" + "---:|" * len(variants))
    with one_rank():
        for size in args.sizes.split(","):
            for accumulate in map(int, args.accumulate.split(",")):
                found = differences(size, accumulate, args.steps, variants)
                cells = []
                for name in variants:
                    q1, median, q3 = statistics.quantiles([d * 1e6 for d in found[name]], n=4)
                    cells.append(f"{median:.0f} [{q1:.0f}, {q3:.0f}]")
                plain = statistics.median(found["ddp"]) * 1e6
                row = f"| {size} A={accumulate} ({args.steps} steps) | {plain:.0f} | " + " | ".join(cells) + " |"
                print(row, flush=True)


if __name__ == "__main__":
    main()
