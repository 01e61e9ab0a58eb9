"""α-β cost model of what ddp_weighted adds to the gradient reduction, projected to NCCL at P = 8 … 4096 GPUs.

Every path moves a window's counts in one asynchronous float64 all-reduce of ``lightning_weighted.counts.WIDTH``
values (the window's payload: 80 bytes) per optimizer step, launched right before the syncing backward and waited
for after it (``lightning_weighted.loop.Exchange``); counts ahead (an ItemCounter) add one 1-value all-reduce at
each epoch's first window, left out here. Counts after (returned by ``training_step``, known only after the
forward) also pass once over every gradient after the backward, multiplying it by ``P·c/N`` (a read and a write).
The ablation beside it, ``benchmarks/carrier.py`` (what counts ahead shipped before the payload all-reduce): each
window's handover rides in DDP's gradient all-reduce as the gradient of one extra parameter (``carrier.width(dtype,
P)`` values, 7 to 80, padded to whole 64-byte lines; no call of its own) where ``carrier.fits(dtype, P)``;
elsewhere (bf16 beyond 256 ranks, fp32 beyond 2048 unless P is a power of two) one all-reduce of 4 float64.

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

import torch
from carrier import Carrier, Handover, fits

from lightning_weighted.counts import WIDTH

PAYLOAD_BYTES = 8 * WIDTH  # the window's float64 payload, one all-reduce per optimizer step on every path
HANDOVER_BYTES = 8 * len(Handover)  # the carrier ablation's own all-reduce, where the carrier does not fit
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


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
    - ``hbm``: 3.35 TB/s device memory bandwidth (H100 SXM), for the pass over the gradients (post-hoc, counts after).
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
    """Rows of (P, model): what ddp_weighted's counts add (the payload all-reduce, every path; counts after also
    their pass over the gradients after the backward) and the payload's share of a step that is at least as long
    as the gradient all-reduce (an upper bound: it assumes nothing else in the step, and the payload all-reduce
    fully exposed although it is launched before the syncing backward and overlaps it); beside it what the carrier
    ablation would add instead, and what the anchors pay in the same model (a blocking count, and post-hoc's
    extra read+write of the gradients). A model's name says its gradients' dtype (``fp32`` or ``bf16``)."""
    rows: list[dict[str, float | str]] = []
    for p in ranks:
        payload, algorithm = allreduce_time(PAYLOAD_BYTES, p, inputs)
        separate, separate_algorithm = allreduce_time(HANDOVER_BYTES, p, inputs)
        blocking, _ = allreduce_time(8, p, inputs)
        for model, size in gradient_bytes.items():
            dtype = next(d for name, d in _DTYPES.items() if name in model)
            gradient, _ = allreduce_time(size, p, inputs)
            gradient_pass = 2 * size / inputs.hbm  # counts after: every gradient read and written once
            if fits(dtype, p):
                rider = Carrier(torch.nn.Identity(), dtype, torch.device("cpu"), p).rider  # padded as it shipped
                carried = rider.numel() * dtype.itemsize
                carrier, how = allreduce_time(size + carried, p, inputs)[0] - gradient, f"carried (+{carried} B)"
            else:
                carrier, how = separate, f"own all-reduce ({separate_algorithm})"
            rows.append(
                {
                    "P": p,
                    "model": model,
                    "count_algorithm": algorithm,
                    "count_us": payload * 1e6,
                    "after_pass_us": gradient_pass * 1e6,
                    "grad_allreduce_ms": gradient * 1e3,
                    "share_upper_bound": payload / (payload + gradient),
                    "carrier_how": how,
                    "carrier_us": carrier * 1e6,
                    "post_hoc_extra_us": (blocking + gradient_pass) * 1e6,
                    "pre_count_extra_us": blocking * 1e6,
                }
            )
    return rows


def markdown(rows: list[dict[str, float | str]]) -> str:
    lines = [
        f"| P | gradients | the payload all-reduce ({PAYLOAD_BYTES} B) | its cost, if exposed (µs) |"
        " counts after, beyond it: the pass over the gradients (µs) | gradient all-reduce (ms) | its share ≤ |"
        " carrier ablation: the handover | its cost (µs) | post-hoc exposed (µs) | pre-count exposed (µs) |",
        "|---:|---|---|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['P']} | {row['model']} | {row['count_algorithm']} | {row['count_us']:.3g} |"
            f" {row['after_pass_us']:.3g} | {row['grad_allreduce_ms']:.3f} |"
            f" {100 * float(row['share_upper_bound']):.3g} % | {row['carrier_how']} | {row['carrier_us']:.3g} |"
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
    print("A projection of the α-β model with the inputs below, not a measurement (see --help):\n")
    print(markdown(projection(DEFAULT_MODELS, DEFAULT_RANKS, inputs)))


if __name__ == "__main__":
    main()
