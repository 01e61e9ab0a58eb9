"""Writes ``RESULTS.md`` from the pooled results of ``run.py`` (``python benchmarks/report.py DIR`` rewrites it from
``DIR/results.json``)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

TITLES = {
    "ddp": "plain DDP",
    "ddp_control": "A-vs-A control",
    "ddp_callback": "plain DDP + an empty Callback",
    "ddp_weighted": "ddp_weighted (counts ahead)",
    "ddp_weighted_after": "ddp_weighted (counts after)",
    "after_to_ahead": "counts after ÷ counts ahead",
    "ddp_weighted_parts1": "counts ahead, 1 part",
    "ddp_weighted_parts4": "counts ahead, 4 parts",
    "parts4_to_parts1": "4 parts ÷ 1 part",
    "post_hoc": "post-hoc",
    "pre_count": "pre-count",
    "fsdp2": "plain FSDP2",
    "fsdp2_control": "plain FSDP2 (control)",
    "fsdp2_weighted": "fsdp2_weighted (counts after)",
    "fsdp2_weighted_ahead": "fsdp2_weighted (counts ahead)",
    "fsdp": "plain FSDP1",
    "fsdp_weighted": "fsdp_weighted (counts after)",
    "fsdp_weighted_ahead": "fsdp_weighted (counts ahead)",
}
INTERVALS = ("ddp_control", "ddp_weighted", "after_to_ahead", "parts4_to_parts1", "fsdp2_control")  # with 95 % CIs
TARGETS = {"0.2M": 1.03, "2M": 1.01, "20M": 1.01}  # the ratio ddp_weighted (counts ahead) ÷ plain DDP aims at
BASES = ("ddp", "fsdp2", "fsdp")  # what the others are divided by


def verdict(stats: dict[str, float], target: float) -> str:
    """Whether the median's 95 % confidence interval lies at or below ``target`` (met), above it, or across it."""
    if stats["ci_high"] <= target:
        return "met"
    return "missed" if stats["ci_low"] > target else "not resolved"


def ratio_cell(stats: dict[str, float], interval: bool) -> str:
    """``median (ci_low–ci_high) [p10, p90]``, the interval only where asked for."""
    ci = f" ({stats['ci_low']:.3f}–{stats['ci_high']:.3f})" if interval else ""
    return f"{stats['median']:.3f}{ci} [{stats['p10']:.3f}, {stats['p90']:.3f}]"


def speed_table(points: list[dict[str, Any]]) -> str:
    labels = [label for label in TITLES if label not in BASES and any(label in p["ratio"] for p in points)]
    bases = [base for base in BASES if base in points[0]["ms"]]
    lines = [
        "| point | " + " | ".join(f"{TITLES[b]} step (ms)" for b in bases) + " | "
        + " | ".join(TITLES[n] + ("" if "_to_" in n else " ÷ plain") for n in labels) + " |",
        "|---|" + "---:|" * (len(bases) + len(labels)),
    ]  # fmt: skip
    for entry in points:
        p, ratio = entry["point"], entry["ratio"]
        cells = [f"{entry['ms'][b]:.2f}" for b in bases]
        cells += [ratio_cell(ratio[n], n in INTERVALS) if n in ratio else "–" for n in labels]
        target = TARGETS.get(p["size"])
        if target and "ddp_weighted" in ratio:
            cells[len(bases) + labels.index("ddp_weighted")] += (
                f" ({verdict(ratio['ddp_weighted'], target)} ≤ {target})"
            )
        lines.append(
            f"| {p['size']} A={p['accumulate']} {p['dtype']} ({p['rounds']} rounds) | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def correctness_table(points: list[dict[str, Any]]) -> str:
    names = [n for n in TITLES if n in (points[0].get("deviation") or {})]
    lines = ["| point | " + " | ".join(TITLES[n] for n in names) + " |", "|---|" + "---:|" * len(names)]
    for entry in points:
        dev, grad = entry["deviation"], entry["gradient_deviation"]
        cells = [f"{_e(dev[n])} / {_e(grad[n])}" for n in names]
        lines.append(
            f"| {entry['point']['size']} A={entry['point']['accumulate']} {entry['point']['dtype']} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def _e(value: float) -> str:
    return "–" if math.isnan(value) else f"{value:.1e}"


def collectives_table(points: list[dict[str, Any]]) -> str:
    """What each variant's collectives add to its plain counterpart's in one optimizer step (calls, bytes each);
    DDP's own bucket all-reduces (C++, unseen by the wrapper) from its logging data."""
    lines = ["| point | variant | beyond the plain counterpart | DDP buckets (count, bytes) |", "|---|---|---|---|"]
    for entry in points:
        calls, buckets = entry["collectives"], entry.get("buckets") or {}
        for name in (n for n in TITLES if n in calls and n not in BASES):
            plain = calls[next((b for b in BASES[1:] if name.startswith(b)), "ddp")]
            extra = {k: v for k, v in calls[name].items() if plain.get(k) != v}
            listed = ", ".join(f"{k} ×{v[0]:g} ({v[1]:,.0f} B)" for k, v in sorted(extra.items())) or "nothing"
            bucket = buckets.get(name, [0, 0])
            same = "" if not bucket[0] or tuple(bucket) == tuple(buckets.get("ddp", ())) else " (differs from plain)"
            shown = f"{bucket[0]}, {bucket[1]:,}{same}" if bucket[0] else "–"
            lines.append(
                f"| {entry['point']['size']} A={entry['point']['accumulate']} | {TITLES[name]} | {listed} | {shown} |"
            )
    return "\n".join(lines)


def write_report(data: dict[str, Any], out: Path) -> None:
    meta, probe = data["meta"], data.get("probe")
    levels = {"raw": "Raw DDP step", "trainer": "Lightning Trainer step", "sharded": "Sharded strategies (Trainer)"}
    sections = [
        "# Benchmarks: ddp_weighted beside plain DDP, the anchors' mechanisms and the sharded strategies",
        "",
        f"- {meta['date']}; torch {meta['torch']}, lightning {meta['lightning']}, Python {meta['python']}; "
        f"{meta['cpu']}; 2 gloo ranks on loopback, one intra-op thread each",
        f"- `{meta['command']}` ({meta['seconds'] / 60:.1f} min; "
        + ", ".join(f"{k} {v:.0f} s" for k, v in data["seconds"].items()) + ")",
        "- Every variant of a level in one process group on identical data, one optimizer step each per round in an"
        f" order shuffled per round, a barrier before each, a step's time the slowest rank's; {meta['repeats']}"
        " repeats in fresh process groups. Ratios are paired (same round) and pooled: median [p10, p90], with the"
        " median's 95 % confidence interval in parentheses for the control and counts ahead; a verdict says whether"
        " that interval lies below the target.",
        "- Data: microbatches of 32 padded items, rank 0 with 10-40 % valid, rank 1 70-100 %, targets offset in"
        " opposite directions; SGD lr 0.2; MLPs of "
        + ", ".join(f"{k} = {v:,}" for k, v in meta["parameters"].items()) + " parameters. Variants: `steps.py`,"
        " `fits.py`.",
        "",
    ]  # fmt: skip
    if probe:
        sections += [
            f"The window's payload all-reduce (48 bytes of float64 for one loss, 24 more per loss part) takes"
            f" {probe['payload_allreduce_s'] * 1e6:.0f} µs on this loopback (median of 200), an 8 MiB fp32 one"
            f" {probe['allreduce_8MiB_s'] * 1e3:.1f} ms.",
            "",
        ]
    for level, title in levels.items():
        if data.get(level):
            sections += [f"## {title}", "", speed_table(data[level]), ""]
            sections += ["Final-parameter deviation / first-step gradient deviation from the float64 reference:", ""]
            sections += [correctness_table(data[level]), "", "Collectives per optimizer step:", ""]
            sections += [collectives_table(data[level]), ""]
    sections += ["What these figures mean: [ANALYSIS.md](ANALYSIS.md).", ""]
    (out / "RESULTS.md").write_text("\n".join(sections))


if __name__ == "__main__":
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
    write_report(json.loads((folder / "results.json").read_text()), folder)
