"""α-β cost model of what ddp_weighted adds to the gradient reduction, projected to NCCL at P = 8 … 4096 GPUs.

With fp32/fp64 gradients the window's counts ride at the end of the first bucket (RIDE_WIDTH more values, no
extra call); with fp16/bf16 gradients they are one separate all-reduce of the float64 count vector.

All-reduce of ``b`` bytes over ``P`` ranks (Thakur, Rabenseifner & Gropp 2005; NCCL's ring and tree; the
``2(P−1)/P`` factor is nccl-tests' bus-bandwidth factor, doc/PERFORMANCE.md):

    ring:  t = o + 2(P−1)·α      + 2(P−1)/P · b · β
    tree:  t = o + 2·log2(P)·α   + 2(P−1)/P · b · β      (NCCL's double binary tree, latency-bound regime)

NCCL's tuner picks the faster; for the count vector (a few float64) that is the tree from P ≈ 8 on. ``o`` is the fixed
cost of one NCCL call (launch and proxy), ``α`` the per-hop latency, ``β`` the inverse bus bandwidth.
Run ``python benchmarks/cost_model.py`` for the table with the default inputs (see ``Inputs``).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, fields

try:  # the count vector that ddp_weighted all-reduces (WIDTH float64) or lets ride (RIDE_WIDTH fp32 values)
    from lightning_weighted._counts import RIDE_WIDTH as _RIDE_WIDTH
    from lightning_weighted._counts import WIDTH as _WIDTH
except ImportError:  # pragma: no cover - the model stands alone
    _WIDTH, _RIDE_WIDTH = 6, 12
COUNT_BYTES = 8 * _WIDTH
RIDE_BYTES = 4 * _RIDE_WIDTH


@dataclass(frozen=True)
class Inputs:
    """Latency and bandwidth inputs (seconds, bytes/second); defaults for H100/H200-class nodes of 8 GPUs.

    - ``overhead``: 10 µs per NCCL collective: the small-message floor of nccl-tests' all_reduce_perf within
      one NVLink node is ~10-20 µs; we take the low end (it makes the count look more expensive, not less).
    - ``alpha_intra``: 2 µs per hop over NVLink (LL128 protocol ~2 µs/hop, LL ~1 µs: Hu et al., "Demystifying
      NCCL", arXiv:2507.04786, 2025).
    - ``alpha_inter``: 5 µs per hop across nodes (InfiniBand NDR switch hop 2-5 µs plus NIC/proxy; ibid.).
    - ``bw_intra``: 360 GB/s all-reduce bus bandwidth within a node (nccl-tests on NVLink4 H100 SXM reach
      ~360-480 GB/s busbw).
    - ``bw_inter``: 45 GB/s per GPU across nodes (one 400 Gb/s NDR NIC per GPU = 50 GB/s line rate, ~90 %).
    - ``hbm``: 3.35 TB/s device memory bandwidth (H100 SXM), for the post-hoc pass over the gradients.
    - ``gpus_per_node``: 8.
    """

    overhead: float = 10e-6
    alpha_intra: float = 2e-6
    alpha_inter: float = 5e-6
    bw_intra: float = 360e9
    bw_inter: float = 45e9
    hbm: float = 3.35e12
    gpus_per_node: int = 8


def allreduce_time(size_bytes: float, ranks: int, inputs: Inputs) -> tuple[float, str]:
    """The modelled time of one all-reduce and the algorithm NCCL would pick."""
    if ranks <= 1:
        return 0.0, "-"
    inter = ranks > inputs.gpus_per_node
    alpha = inputs.alpha_inter if inter else inputs.alpha_intra
    beta = 1.0 / (inputs.bw_inter if inter else inputs.bw_intra)
    volume = 2 * (ranks - 1) / ranks * size_bytes * beta
    ring = inputs.overhead + 2 * (ranks - 1) * alpha + volume
    tree = inputs.overhead + 2 * math.log2(ranks) * alpha + volume
    return (tree, "tree") if tree < ring else (ring, "ring")


def projection(gradient_bytes: dict[str, float], ranks: list[int], inputs: Inputs) -> list[dict[str, float | str]]:
    """Rows of (P, model): what ddp_weighted's counts add and their share of a step that is at least as long as
    the gradient all-reduce (an upper bound on the share: it assumes nothing else in the step, and that the
    separate count is fully exposed, although it is launched before the backward and overlaps it); plus what
    the anchors pay in the same model (a blocking count, and post-hoc's extra read+write of the gradients).
    Models named ``fp32`` let the counts ride in their first bucket; the others pay the separate call."""
    rows: list[dict[str, float | str]] = []
    for p in ranks:
        separate, algorithm = allreduce_time(COUNT_BYTES, p, inputs)
        for model, size in gradient_bytes.items():
            gradient, _ = allreduce_time(size, p, inputs)
            if "fp32" in model:
                count, how = allreduce_time(size + RIDE_BYTES, p, inputs)[0] - gradient, f"rides (+{RIDE_BYTES} B)"
            else:
                count, how = separate, algorithm
            rows.append(
                {
                    "P": p,
                    "model": model,
                    "count_algorithm": how,
                    "count_us": count * 1e6,
                    "grad_allreduce_ms": gradient * 1e3,
                    "share_upper_bound": count / (count + gradient),
                    "post_hoc_extra_us": (separate + 2 * size / inputs.hbm) * 1e6,
                    "pre_count_extra_us": separate * 1e6,
                }
            )
    return rows


def markdown(rows: list[dict[str, float | str]]) -> str:
    lines = [
        "| P | gradients | ddp_weighted's count | its cost (µs) | gradient all-reduce (ms) | count share ≤ |"
        " post-hoc exposed (µs) | pre-count exposed (µs) |",
        "|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['P']} | {row['model']} | {row['count_algorithm']} | {row['count_us']:.3g} |"
            f" {row['grad_allreduce_ms']:.3f} | {100 * float(row['share_upper_bound']):.3g} % |"
            f" {row['post_hoc_extra_us']:.0f} | {row['pre_count_extra_us']:.0f} |"
        )
    return "\n".join(lines)


DEFAULT_MODELS = {
    "2M fp32 (8.4 MB)": 8.4e6,
    "20M fp32 (84 MB)": 84e6,
    "20M bf16 (42 MB)": 42e6,
    "1B bf16 (2 GB)": 2e9,
}
DEFAULT_RANKS = [8, 64, 512, 4096]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for field in fields(Inputs):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default), default=field.default)
    args = parser.parse_args()
    inputs = Inputs(**{f.name: getattr(args, f.name) for f in fields(Inputs)})
    print(markdown(projection(DEFAULT_MODELS, DEFAULT_RANKS, inputs)))


if __name__ == "__main__":
    main()
