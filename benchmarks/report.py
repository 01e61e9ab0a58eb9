"""Writes ``RESULTS.md`` and ``results.png`` from the aggregated results of ``run.py``."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from cost_model import DEFAULT_MODELS, DEFAULT_RANKS, HANDOVER_BYTES, PAYLOAD_BYTES, Inputs, markdown, projection

# the variants of the speed and correctness tables, where a level ran them (the carrier ablation: the raw level)
SHOWN = ["ddp_control", "ddp_weighted", "ddp_weighted_after", "ddp_weighted_carrier", "post_hoc", "pre_count"]
INTERVALS = ("ddp_control", "ddp_weighted")  # the ratios whose median's confidence interval the tables show
WEIGHTED = ["ddp_weighted", "ddp_weighted_after", "ddp_weighted_carrier", "post_hoc", "pre_count"]
TITLES = {
    "ddp": "plain DDP",
    "ddp_control": "A-vs-A control",
    "ddp_weighted": "ddp_weighted (counts ahead)",
    "ddp_weighted_after": "ddp_weighted (counts after)",
    "ddp_weighted_carrier": "counts ahead, payload in a carrier (ablation)",
    "post_hoc": "post-hoc",
    "pre_count": "pre-count",
    "py_allreduce_hook": "torch's Python allreduce_hook",
    "scale_only": "losses scaled on the host",
    "carrier_wrapper": "+ the carrier's module call",
    "carrier_in_graph": "+ its parameter in the backward and bucket",
    "carrier_fixed": "+ the carrier, a fixed handover",
}

ANALYSIS_FILE = "ANALYSIS.md"  # hand-written findings, linked from the report when present


def sharded_section(data: dict[str, Any]) -> str:
    from sharded_step import section  # imports torch: only when a report is written

    return section(data)


def median_cell(stats: dict[str, float]) -> str:
    """``median (ci_low–ci_high)``: the median and its 95 % confidence interval."""
    return f"{stats['median']:.3f} ({stats['ci_low']:.3f}–{stats['ci_high']:.3f})"


def ratio_cell(stats: dict[str, float], interval: bool = False) -> str:
    """``median [p10, p90]``; with ``interval``, the median's 95 % confidence interval in parentheses after it."""
    median = median_cell(stats) if interval and "ci_low" in stats else f"{stats['median']:.3f}"
    return f"{median} [{stats['p10']:.3f}, {stats['p90']:.3f}]"


TARGETS = {"0.2M": 1.03, "2M": 1.01, "20M": 1.01}  # the ratio ddp_weighted (counts ahead) ÷ plain DDP aims at


def verdict(stats: dict[str, float], target: float) -> str:
    """Whether the median's 95 % confidence interval lies below ``target``, above it, or across it."""
    if stats["ci_high"] <= target:
        return "met"
    if stats["ci_low"] > target:
        return "missed"
    return "not resolved"


def targets_table(levels: dict[str, list[dict[str, Any]]]) -> str:
    lines = [
        "| level | point | target | ddp_weighted (counts ahead) ÷ DDP (95 % CI) | A-vs-A control (95 % CI) | verdict |"
        " below post-hoc and pre-count |",
        "|---|---|---:|---:|---:|---|---|",
    ]
    tally: dict[str, int] = {}
    for level, points in levels.items():
        for entry in points:
            point, ratio = entry["point"], entry["ratio"]
            target = TARGETS.get(point["size"])
            if target is None or "ci_low" not in ratio["ddp_weighted"]:
                continue
            weighted, control = ratio["ddp_weighted"], ratio["ddp_control"]
            found = verdict(weighted, target)
            tally[found] = tally.get(found, 0) + 1
            below = all(weighted["median"] < ratio[n]["median"] for n in ("post_hoc", "pre_count"))
            lines.append(
                f"| {level} | {point['size']} A={point['accumulate']} {point['dtype']} | ≤ {target:.2f} | "
                f"{median_cell(weighted)} | {median_cell(control)} | {found} | {'yes' if below else 'no'} |"
            )
    counted = ", ".join(f"{name} {tally[name]}" for name in ("met", "not resolved", "missed") if name in tally)
    return "\n".join([*lines, "", f"Verdicts: {counted or 'none'}."])


def present(names: list[str], entries: list[dict[str, Any]], key: str = "ratio") -> list[str]:
    """The ``names`` that some entry holds under ``key`` (a level's variants), in their order."""
    return [name for name in names if any(name in (entry.get(key) or {}) for entry in entries)]


def deviation_cell(value: float | None) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.1e}"


def speed_table(points: list[dict[str, Any]], params: dict[str, int]) -> str:
    shown = present(SHOWN, points)
    lines = [
        "| point | params | plain DDP step (ms) | "
        + " | ".join(f"{TITLES[n]} ÷ DDP" for n in shown)
        + " | counts after ÷ counts ahead | ddp_weighted per repeat |",
        "|---|---:|---:|" + "---:|" * len(shown) + "---:|---|",
    ]
    for entry in points:
        point = entry["point"]
        label = f"{point['size']} A={point['accumulate']} {point['dtype']} ({point['rounds']} rounds)"
        repeats = ", ".join(f"{r:.3f}" for r in entry["ratio_per_repeat"]["ddp_weighted"])
        lines.append(
            f"| {label} | {params[point['size']] / 1e6:.2f}M | {entry['ms']['ddp']:.2f} | "
            + " | ".join(ratio_cell(entry["ratio"][n], n in INTERVALS) if n in entry["ratio"] else "–" for n in shown)
            + f" | {ratio_cell(entry['after_to_ahead'], True) if 'after_to_ahead' in entry else '–'} | {repeats} |"
        )
    return "\n".join(lines)


def correctness_table(points: list[dict[str, Any]]) -> str:
    names = ["ddp", *present(WEIGHTED, points, "deviation")]
    lines = ["| point | " + " | ".join(TITLES[n] for n in names) + " |", "|---|" + "---:|" * len(names)]
    for entry in points:
        point, dev, grad = entry["point"], entry.get("deviation") or {}, entry.get("gradient_deviation") or {}
        label = f"{point['size']} A={point['accumulate']} {point['dtype']}"
        if "imbalance" in entry:
            label += f" imbalance {entry['imbalance']:.0%}"
        lines.append(
            f"| {label} | "
            + " | ".join(f"{deviation_cell(dev.get(n))} / {deviation_cell(grad.get(n))}" for n in names)
            + " |"
        )
    return "\n".join(lines)


def collectives_table(points: list[dict[str, Any]], level: str) -> str:
    names = ["ddp", *present(WEIGHTED, points, "collectives")]
    lines = [
        "| point | variant | gradient all-reduces / step | gradient bytes / step | source |"
        " other collectives / step | their bytes | kinds seen by the Python wrapper |",
        "|---|---|---:|---:|---|---:|---:|---|",
    ]
    seen = set()
    for entry in points:
        point = entry["point"]
        key = (point["size"], point["accumulate"], point["dtype"])
        if key in seen:
            continue
        seen.add(key)
        for name in names:
            calls = entry["collectives"].get(name)
            if calls is None:
                continue
            buckets, bucket_bytes = entry["buckets"][name]
            if calls["gradient_calls"]:  # a Python comm hook: counted by the wrapper
                grads, grad_bytes, source = calls["gradient_calls"], calls["gradient_bytes"], "Python hook (counted)"
            else:
                grads, grad_bytes, source = buckets, bucket_bytes, "C++ reducer (DDP logging data)"
            lines.append(
                f"| {point['size']} A={point['accumulate']} {point['dtype']} | {TITLES[name]} | {grads:g} |"
                f" {grad_bytes / 1e6:.3f} MB | {source} | {calls['other_calls']:g} | {calls['other_bytes']:g} B |"
                f" {', '.join(calls['kinds'])} |"
            )
    note = (
        "Counted over the last warm-up step. Every variant here reduces its buckets in DDP's C++ reducer (no comm "
        "hook), which a Python wrapper of `torch.distributed` never sees: their bucket counts and bytes come from "
        "DDP's logging data (`rebuilt_bucket_sizes`); a Python comm hook's buckets would be counted by the wrapper. "
        "ddp_weighted, with counts ahead and with counts after alike, adds one asynchronous float64 all-reduce of "
        f"the window's payload ({PAYLOAD_BYTES} bytes) per step, started before the syncing backward (counted "
        "under 'other'); post-hoc and pre-count one blocking 8-byte count all-reduce. The carrier ablation adds no "
        "collective: one bucket holds the carrier's gradient (7 values in fp32, 14 in bf16, on 2 ranks, padded to "
        "64 bytes). Bytes are the payload of each call, not the 2(P−1)/P traffic of a ring."
    )
    if level == "trainer":
        note += (
            " In the Trainer every variant also pays Lightning's per-microbatch SIGTERM-flag broadcast "
            "(`broadcast[int64]`, A per step), counted under 'other'."
        )
    return "\n".join(lines) + "\n\n" + note


def sweep_table(sweep: list[dict[str, Any]]) -> str:
    names = ["ddp", "ddp_control", *present(WEIGHTED, sweep, "ms")]
    lines = [
        "| rank 0 holds | "
        + " | ".join(f"{TITLES[n]} epoch (ms)" for n in names)
        + " | ddp_weighted ÷ its balanced epoch | ddp_weighted ÷ DDP (paired) |",
        "|---|" + "---:|" * (len(names) + 2),
    ]
    for entry in sweep:
        lines.append(
            f"| {1 - entry['imbalance']:.0%} of rank 1's batches | "
            + " | ".join(f"{entry['ms'][n]:.1f}" for n in names)
            + f" | {entry['vs_largest_shard']['ddp_weighted']:.3f} | {ratio_cell(entry['ratio']['ddp_weighted'])} |"
        )
    return "\n".join(lines)


def ablation_table(ablation: list[dict[str, Any]]) -> str:
    if not ablation:
        return "(not run)"
    names = [n for n in ablation[0]["ratio"] if n != "ddp"]
    lines = [
        "| point | plain DDP step (ms) | " + " | ".join(TITLES[n] for n in names) + " |",
        "|---|---:|" + "---:|" * len(names),
    ]
    for entry in ablation:
        point = entry["point"]
        lines.append(
            f"| {point['size']} A={point['accumulate']} {point['dtype']} ({point['rounds']} rounds) |"
            f" {entry['ms']['ddp']:.2f} | " + " | ".join(ratio_cell(entry["ratio"][n]) for n in names) + " |"
        )
    lines.append("")
    lines.append(
        "Median step time (ms): "
        + "; ".join(
            f"{e['point']['size']}: " + ", ".join(f"{TITLES[n]} {e['ms'][n]:.2f}" for n in e["ms"]) for e in ablation
        )
    )
    return "\n".join(lines)


def memory_table(memory: list[dict[str, Any]]) -> str:
    if not memory:
        return "(not run)"
    base = next((m for m in memory if m["variant"] == "ddp"), memory[0])
    lines = ["| variant | peak RSS growth (MB) | minus plain DDP (MB) | in gradient sizes |", "|---|---:|---:|---:|"]
    for m in memory:
        extra = m["peak_delta_bytes"] - base["peak_delta_bytes"]
        lines.append(
            f"| {TITLES[m['variant']]} | {m['peak_delta_bytes'] / 1e6:.1f} | {extra / 1e6:+.1f} |"
            f" {extra / m['parameter_bytes']:+.2f} |"
        )
    return (
        "\n".join(lines) + f"\n\nMethod: {memory[0]['method']}, maximum over the ranks; one gradient is "
        f"{memory[0]['parameter_bytes'] / 1e6:.1f} MB."
    )


def cpu_model_table(data: dict[str, Any]) -> str:
    probe = data.get("probe") or {}
    count = probe.get("count_allreduce_s")
    if count is None:
        return "(no probe)"
    lines = [
        "| point | plain DDP step (ms) | one small all-reduce, if fully exposed | ddp_weighted (ahead) ÷ DDP − 1 |"
        " after ÷ DDP − 1 | A-vs-A control − 1 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for entry in data["raw"]:
        point = entry["point"]
        step = entry["ms"]["ddp"] / 1e3
        lines.append(
            f"| {point['size']} A={point['accumulate']} {point['dtype']} | {step * 1e3:.2f} |"
            f" {100 * count / step:.1f} % | {100 * (entry['ratio']['ddp_weighted']['median'] - 1):+.1f} % |"
            f" {100 * (entry['ratio']['ddp_weighted_after']['median'] - 1):+.1f} % |"
            f" {100 * (entry['ratio']['ddp_control']['median'] - 1):+.1f} % |"
        )
    return "\n".join(lines) + (
        f"\n\nMeasured on this machine's gloo loopback: the payload's {PAYLOAD_BYTES}-byte float64 all-reduce takes "
        f"{count * 1e6:.0f} µs (median of 200), an 8 MiB fp32 all-reduce "
        f"{probe['allreduce_8MiB_s'] * 1e3:.1f} ms "
        f"(≈ {8 * 1.048576 / probe['allreduce_8MiB_s'] / 1e3:.2f} GB/s)."
    )


def write_chart(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 2, figsize=(15, 10))
    colors = {
        "ddp_control": "grey",
        "ddp_weighted": "tab:blue",
        "ddp_weighted_after": "tab:purple",
        "ddp_weighted_carrier": "tab:cyan",
        "post_hoc": "tab:orange",
        "pre_count": "tab:green",
    }
    for ax, level, title in ((axes[0][0], "raw", "Raw DDP step"), (axes[0][1], "trainer", "Lightning Trainer step")):
        points = data[level]
        shown = present(SHOWN, points)
        for k, name in enumerate(shown):
            xs = [i + (k - (len(shown) - 1) / 2) * 0.12 for i in range(len(points))]
            med = [p["ratio"][name]["median"] for p in points]
            low = [p["ratio"][name]["median"] - p["ratio"][name]["p10"] for p in points]
            high = [p["ratio"][name]["p90"] - p["ratio"][name]["median"] for p in points]
            ax.errorbar(xs, med, yerr=[low, high], fmt="o", color=colors[name], label=TITLES[name], capsize=3)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(1.01, color="tab:blue", linewidth=0.6, linestyle="--")
        ax.set_xticks(range(len(points)))
        ax.set_xticklabels(
            [f"{p['point']['size']}\nA={p['point']['accumulate']}\n{p['point']['dtype']}" for p in points], fontsize=8
        )
        ax.set_ylabel("step time ÷ plain DDP (median, p10-p90)")
        ax.set_title(title)
        ax.legend(fontsize=8)
    ax = axes[1][0]
    sweep = data["sweep"]
    if sweep:
        for name in ["ddp", *present(WEIGHTED, sweep, "ms")]:
            ax.plot(
                [1 - s["imbalance"] for s in sweep],
                [s["ms"][name] for s in sweep],
                "o-",
                label=TITLES[name],
                color=colors.get(name, "black"),
            )
        ax.set_xlabel("rank 0's share of rank 1's microbatches")
        ax.set_ylabel("epoch wall time (ms, median)")
        ax.set_ylim(bottom=0)
        ax.set_title("Imbalance sweep: epoch time vs the largest shard's (100 %)")
        ax.legend(fontsize=8)
    ax = axes[1][1]
    rows = projection(DEFAULT_MODELS, DEFAULT_RANKS, Inputs())
    for model in DEFAULT_MODELS:
        mine = [r for r in rows if r["model"] == model]
        ax.plot([r["P"] for r in mine], [100 * float(r["share_upper_bound"]) for r in mine], "o-", label=model)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("GPUs (NCCL, α-β model)")
    ax.set_ylabel("counts' cost ÷ (that + gradient all-reduce), %")
    ax.set_title("Projected upper bound of the payload all-reduce's share")
    ax.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_report(data: dict[str, Any], out: Path) -> None:
    meta = data["meta"]
    params = meta["parameters"]
    analysis = Path(__file__).parent / ANALYSIS_FILE
    sections = [
        "# Benchmarks: ddp_weighted beside plain DDP and the anchors' mechanisms",
        "",
        f"- Date: {meta['date']}; torch {meta['torch']}, lightning {meta['lightning']}, Python {meta['python']}",
        f"- CPU: {meta['cpu']} ({meta['cores']} cores; {meta['cpu_flags']}); 2 gloo ranks on loopback, "
        "`torch.set_num_threads(1)` per rank; the machine is shared with other work, hence the A-vs-A control",
        f"- Command: `{meta['command']}` ({meta['seconds'] / 60:.1f} min wall; "
        + ", ".join(f"{k} {v:.0f} s" for k, v in data["seconds"].items())
        + ")",
        f"- Method: all variants in one process group on identical data, one optimizer step each per round, in "
        f"an order shuffled per round, a barrier before each; {meta['warmup']} warm-up rounds (20M: "
        f"{max(2, meta['warmup'] // 2)}), then {meta['rounds']} timed rounds (20M: {meta['rounds_20m']}); "
        f"{meta['repeats']} repeats in fresh process groups; a step's time is the slowest rank's; ratios are "
        "paired (same round) and pooled over repeats: median [p10, p90], and for the control and counts ahead "
        "the median's 95 % confidence interval in parentheses (order statistics over the pooled rounds; it does "
        "not hold the spread between repeats, which the last column shows). Ratios are what count.",
        "",
        'Variants (see `anchors.py`, `raw_step.py`, `trainer_step.py`): **plain DDP** (`strategy="ddp"`: local '
        "mean ÷ A, mean all-reduce; the floor, and the wrong objective); **A-vs-A control** (a second, independent "
        "plain DDP: its ratio is the noise floor); **ddp_weighted (counts ahead)** (what the strategy does with an "
        "`ItemCounter`, the package's own window loop over DDP in the raw level: each batch counted on the host as "
        "the loader yields it, every loss scaled by P·n/N before its backward, DDP's own C++ reducer with no comm "
        "hook, the window's payload — its flags and loss, the next window's N — summed by one asynchronous "
        f"{PAYLOAD_BYTES}-byte float64 all-reduce started before the syncing backward and read once after it); "
        "**ddp_weighted (counts after)** (counts returned by `training_step`, checked on the device: each loss "
        "scaled to its item sum, DDP's own reducer averaging, the same payload all-reduce, then every reduced "
        "gradient multiplied by P·c/N once after the backward); **counts ahead, payload in a carrier** (raw level "
        "only, `ddp_weighted_carrier`: the ablation of counts ahead as it shipped before the payload all-reduce, "
        "the window's handover riding in DDP's gradient all-reduce as one extra parameter's gradient, "
        "`carrier.py`); **post-hoc** (fairseq / Megatron / "
        "torchtune: loss sums, DDP mean, then a blocking count all-reduce and ×P/N over every gradient); "
        "**pre-count** (HF Trainer / torchtitan: load the window, blocking count all-reduce before the first "
        "forward, each loss sum ×P/N).",
        "",
        "Data: microbatches of 32 padded items; rank 0 has 10-40 % valid items, rank 1 70-100 %, targets offset "
        "in opposite directions; SGD lr 0.2, no momentum, no clipping; models are MLPs "
        + ", ".join(f"{k} = {v:,} parameters" for k, v in params.items() if k != "tiny")
        + ".",
        "",
        "## Raw DDP step",
        "",
        speed_table(data["raw"], params),
        "",
        "## Speed targets",
        "",
        "ddp_weighted (counts ahead) ÷ plain DDP against its target at each point: **met** where the median's 95 % "
        "confidence interval lies at or below the target, **missed** where it lies above, **not resolved** where "
        "it spans the target (these rounds cannot tell). The control's interval beside it is what the same "
        "rounds make of two identical plain DDPs.",
        "",
        targets_table({"raw": data["raw"], "Trainer": data["trainer"]}),
        "",
        "## Lightning Trainer step",
        "",
        'Each variant is a whole `Trainer.fit` (`strategy="ddp"` or `"ddp_weighted"`; post-hoc and pre-count '
        'as LightningModules under `strategy="ddp"`, pre-count fed by a window-prefetching loader) in its own '
        "thread; a baton callback parks each fit at every window start and the main thread releases one window "
        "at a time, so the interleaving and pairing are the same as in the raw benchmark. ddp_weighted (counts "
        "ahead) is the plain DDP module (a bare mean loss) with `ItemCounter('tokens', key=2, mask=True, "
        "log=False)`; ddp_weighted (counts after) returns `{'loss': mean, 'count': n}`. bf16 is `bf16-true`.",
        "",
        speed_table(data["trainer"], params) if data["trainer"] else "(not run)",
        "",
        "## Correctness: final parameters against a float64 single-process reference",
        "",
        "Each cell: **final-parameter deviation / first-step gradient deviation**. The first is "
        "`‖(θ_T − θ_0) − (θ_ref − θ_0,ref)‖ / ‖θ_ref − θ_0,ref‖` after all steps (warm-up included) of the first "
        "repeat, where the reference trains one float64 model on the concatenated items of every step's window "
        "with the global item mean (with fp32 parameters θ_0 = θ_0,ref, so this is the plain final-parameter "
        "deviation). The second is `‖g − g_ref‖ / ‖g_ref‖` for the synchronized gradient the optimizer applied "
        "at step 0, against the float64 gradient of the global item mean at the same (dtype-rounded) "
        "parameters. In bf16 (`bf16-true`: bf16 parameters, plain SGD) most per-step updates are below half a "
        "bf16 ulp of the weights and are rounded away, so every variant's final parameters drift from the "
        "float64 trajectory by O(1) — the final-parameter column cannot judge bf16 rows, the gradient column "
        "can: the weighted variants sit at bf16's rounding (~1e-2) while plain DDP is off by its objective.",
        "",
        "Raw DDP:",
        "",
        correctness_table(data["raw"] + data["sweep"]),
        "",
        "Lightning Trainer:",
        "",
        correctness_table(data["trainer"]) if data["trainer"] else "(not run)",
        "",
        "## Collectives and bytes per optimizer step (raw DDP)",
        "",
        collectives_table(data["raw"], "raw"),
        "",
        "## Collectives per optimizer step (Lightning Trainer)",
        "",
        collectives_table(data["trainer"], "trainer") if data["trainer"] else "(not run)",
        "",
        "## Peak memory",
        "",
        "One variant per process group (20M parameters fp32, A = 4, 4 steps): growth of peak resident memory "
        "from after model, DDP and data set-up to the end of the steps. Counts ahead hold the next window's "
        "batches (host memory, A microbatches) from the last microbatch of the window before it.",
        "",
        memory_table(data["memory"]),
        "",
        "## Where ddp_weighted's cost comes from (raw DDP ablation)",
        "",
        "Each column adds one piece of counts ahead to plain DDP, all interleaved in the same rounds: every loss "
        "scaled by a number known on the host (the batches counted as they arrive, nothing else); plus the carrier "
        "of the ablation (its parameter in a bucket, its term in the syncing forward, a fixed handover through its "
        "hook, one host read of its gradient); counts ahead through the window loop with the payload in the "
        "carrier (`ddp_weighted_carrier`: the window bookkeeping, the lookahead, the handover decoded, no collective "
        "of its own); ddp_weighted with counts ahead as shipped (the same loop, the payload in its own float64 "
        "all-reduce started before the syncing backward and waited after it: beside the carrier, the price of one "
        "more collective on this machine); and, for reference, torch's own Python `allreduce_hook` (the price of "
        "any Python comm hook) and ddp_weighted with counts after.",
        "",
        ablation_table(data.get("ablation", [])),
        "",
        "## Imbalance sweep (raw DDP)",
        "",
        "Rank 0 holds 100 %, 75 % or 50 % of rank 1's microbatches per epoch and fills its remaining turns with "
        "zero-count microbatches (0 rows) so that collectives stay matched. Plain DDP then averages a zero "
        "gradient into every such step (wrong); ddp_weighted weights it exactly. An epoch is "
        f"{data['sweep'][0]['epoch_steps'] if data['sweep'] else '?'} optimizer steps; its time is compared "
        "with the same variant's balanced epoch, in which both ranks hold the largest shard.",
        "",
        sweep_table(data["sweep"]) if data["sweep"] else "(not run)",
        "",
        "## α-β cost model: the counts at scale (NCCL)",
        "",
        "An all-reduce of `b` bytes over `P` ranks costs `t = o + 2(P−1)·α + 2(P−1)/P·b·β` (ring) or "
        "`t = o + 2·log2(P)·α + 2(P−1)/P·b·β` (tree); NCCL's tuner picks the faster (`cost_model.py`, after "
        "Thakur et al. 2005 and nccl-tests' `doc/PERFORMANCE.md`, whose bus bandwidth is algbw·2(P−1)/P). "
        "Inputs (defaults of `cost_model.Inputs`, with their sources in its docstring): o = 10 µs per call; "
        "α = 2 µs per NVLink hop (P = 8), 5 µs per InfiniBand hop (P > 8); 1/β = 360 GB/s within a node, "
        "45 GB/s per GPU across nodes (400 Gb/s NDR); HBM 3.35 TB/s for a pass over the gradients. "
        "Every path of ddp_weighted moves a window's counts in one float64 all-reduce of its payload "
        f"({PAYLOAD_BYTES} bytes) per optimizer step (counts ahead: one more of 8 bytes at each epoch's first "
        "window); counts after also read and write every gradient once after the backward, multiplying it by "
        "P·c/N. The carrier ablation (`carrier.py`) would carry the handover in the gradient all-reduce instead, "
        "as one parameter's gradient (7 to 80 values, by dtype and P, padded to whole 64-byte lines; no call) "
        "where it stays exact (`carrier.fits`: bf16 to 256 ranks, fp32 to 2048 or any power of two), else in its "
        f"own all-reduce of {HANDOVER_BYTES} bytes.",
        "",
        "This is a projection of the model, not a measurement. The share column is an upper bound: it charges the "
        "payload all-reduce in full against a step that holds nothing but the gradient all-reduce. The payload "
        "all-reduce is launched before the syncing backward and waited for after it, so it is exposed only when the "
        "backward is shorter than its time. Post-hoc and pre-count pay a count call fully exposed (blocking) at "
        "every P and dtype, post-hoc also a read and write of every gradient.",
        "",
        markdown(projection(DEFAULT_MODELS, DEFAULT_RANKS, Inputs())),
        "",
        "Measured on this CPU (gloo, P = 2), next to the projection:",
        "",
        cpu_model_table(data),
        "",
        "![results](results.png)",
        "",
        sharded_section(data),
    ]
    if analysis.exists():
        sections += [f"What these figures mean: [{ANALYSIS_FILE}]({ANALYSIS_FILE}).", ""]
    (out / "RESULTS.md").write_text("\n".join(sections))
    write_chart(data, out / "results.png")


if __name__ == "__main__":
    import json
    import sys

    # python benchmarks/report.py [DIR]: rewrite RESULTS.md and results.png from DIR/results.json
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
    write_report(json.loads((folder / "results.json").read_text()), folder)
