"""Benchmarks ddp_weighted side by side with plain DDP and the anchors' mechanisms.

Runs, on 2 gloo ranks of this machine, each level in fresh processes under a hard timeout:

- ``raw``: raw ``DistributedDataParallel`` optimizer steps (``raw_step.py``): plain DDP, an A-vs-A control
  (a second plain DDP), ddp_weighted with counts ahead and with counts after (the package's window loop over
  DDP's own reducer, one float64 payload all-reduce per step), counts ahead with the window's payload carried in
  DDP's bucket instead (the carrier ablation, ``carrier.py``), post-hoc and pre-count normalisation
  (``anchors.py``), over parameters × accumulation × gradient dtype, repeated ``--repeats`` times, the ranks
  started by ``torch.distributed.run`` under a hard timeout;
- ``ablation``: the pieces of counts ahead's cost, each added to plain DDP alone;
- ``sweep``: one rank holding 0/25/50 % fewer microbatches per epoch, padded with zero-count microbatches;
- ``trainer``: the same variants as whole Lightning ``Trainer`` fits (``trainer_step.py``);
- ``memory``: one process group per variant, peak resident memory growth over a few steps;
- ``sharded``: fsdp2_weighted and fsdp_weighted beside plain FSDP2 and FSDP1 (``sharded_step.py``).

Then writes ``RESULTS.md``, ``results.png`` and ``results.json`` into ``--out``.

    python benchmarks/run.py                       # the full run (≈ 35 min on 2 cores)
    python benchmarks/run.py --quick --out /tmp/b  # the smoke test's tiny grid (≈ 30 s)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import sharded_step
from common import HERE, Point, launch, paired_ratios, parameter_count, summary

ABLATION_VARIANTS = [
    "ddp",
    "ddp_control",
    "scale_only",
    "carrier_fixed",
    "ddp_weighted_carrier",
    "ddp_weighted",
    "py_allreduce_hook",
    "ddp_weighted_after",
]


def plan(args: argparse.Namespace) -> dict[str, Any]:
    """The grid: lists of `Point`s per level."""
    if args.quick:
        sizes, accumulate, dtypes = ["tiny"], [1, 2], ["fp32"]
        rounds = {"tiny": args.rounds}
        trainer_sizes = sizes
        sweep = dict(size="tiny", accumulate=2, dtype="fp32", epoch_steps=2, rounds=args.rounds, warmup=1)
        memory = Point("tiny", 2, "fp32", 3, 0)
        ablation = [Point("tiny", 1, "fp32", args.rounds, args.warmup)]
    else:
        sizes, accumulate, dtypes = args.sizes.split(","), [1, 4], args.dtypes.split(",")
        rounds = {"0.2M": 2 * args.rounds, "2M": args.rounds, "20M": args.rounds_20m}
        trainer_sizes = sizes
        sweep = dict(size="2M", accumulate=4, dtype="fp32", epoch_steps=2, rounds=args.sweep_rounds, warmup=1)
        memory = Point("20M", 4, "fp32", 4, 0)
        ablation = [Point(s, a, "fp32", args.ablation_rounds, args.warmup) for s in ("0.2M", "2M") for a in (1, 4)]

    def points(chosen: list[str]) -> list[Point]:
        return [
            Point(size, a, dtype, rounds[size], args.warmup if size != "20M" else max(2, args.warmup // 2))
            for size in chosen
            for a in accumulate
            for dtype in dtypes
        ]

    sweeps = [{**sweep, "imbalance": s} for s in (0.0, 0.25, 0.5)]
    grid = {"raw": points(sizes), "trainer": points(trainer_sizes), "sweep": sweeps, "memory": memory}
    return {**grid, "ablation": ablation, "sharded": sharded_step.points(args)}


def run_levels(args: argparse.Namespace, grid: dict[str, Any]) -> dict[str, Any]:
    results: dict[str, Any] = {"raw": [], "trainer": [], "memory": [], "probe": None, "seconds": {}, "sharded": []}
    scratch = Path(tempfile.mkdtemp(prefix="bench-"))
    levels = set(args.levels.split(","))

    def timed(level: str, script: str, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
        out = scratch / f"{level}-{time.monotonic_ns()}.json"
        start = time.monotonic()
        output = launch(HERE / script, ["--spec", json.dumps(spec), "--out", str(out)], 2, timeout)
        results["seconds"][level] = results["seconds"].get(level, 0.0) + time.monotonic() - start
        if args.verbose:
            print(output[-4000:], flush=True)
        data: dict[str, Any] = json.loads(out.read_text())
        out.unlink()
        return data

    for repeat in range(args.repeats):
        if levels & {"raw", "sweep", "ablation"}:
            spec = {
                "probe": repeat == 0,
                "points": [dataclasses.asdict(p) for p in grid["raw"]] if "raw" in levels else [],
                "sweep": grid["sweep"] if "sweep" in levels else [],
                "ablation": [dataclasses.asdict(p) for p in grid["ablation"]] if "ablation" in levels else [],
                "ablation_variants": ABLATION_VARIANTS,
                "correctness": repeat == 0,  # the data are the same in every repeat
                "timeout": args.pg_timeout,
            }
            data = timed("raw", "raw_step.py", spec, args.timeout)
            results["probe"] = results["probe"] or data["probe"]
            results["raw"].append({"points": data["points"], "sweep": data["sweep"], "ablation": data["ablation"]})
            _progress(f"raw repeat {repeat}", results, args.out)
        if "trainer" in levels:
            spec = {
                "points": [dataclasses.asdict(p) for p in grid["trainer"]],
                "correctness": repeat == 0,
                "timeout": args.pg_timeout,
            }
            results["trainer"].append(timed("trainer", "trainer_step.py", spec, args.timeout)["points"])
            _progress(f"trainer repeat {repeat}", results, args.out)
        if "sharded" in levels:
            spec = sharded_step.spec(grid["sharded"], repeat, args)
            results["sharded"].append(timed("sharded", "sharded_step.py", spec, args.timeout)["points"])
            _progress(f"sharded repeat {repeat}", results, args.out)
    if {"sharded", "memory"} <= levels:
        results["sharded_memory"] = [
            timed("sharded", "sharded_step.py", spec, args.timeout)["memory"]
            for spec in sharded_step.memory_specs(grid["sharded"], args)
        ]
    if "memory" in levels:
        for variant in ("ddp", "ddp_weighted", "ddp_weighted_carrier", "ddp_weighted_after", "post_hoc", "pre_count"):
            spec = {
                "memory": {"point": dataclasses.asdict(grid["memory"]), "variant": variant},
                "timeout": args.pg_timeout,
            }
            results["memory"].append(timed("memory", "raw_step.py", spec, args.timeout)["memory"])
        _progress("memory", results, args.out)
    return results


def _progress(what: str, results: dict[str, Any], out: Path) -> None:
    """Reports a finished part of the run, and keeps what has been measured so far where a later failure leaves it."""
    (out / "partial.json").write_text(json.dumps(results))
    print(
        f"[run.py] {what} done; seconds so far: " + ", ".join(f"{k} {v:.0f}" for k, v in results["seconds"].items()),
        flush=True,
    )


# ---------------------------------------------------------------------------------------------------------------
# Aggregation


def aggregate_times(repeats: list[dict[str, list[float]]]) -> dict[str, Any]:
    """Paired ratios to plain DDP per repeat and pooled; the median step time of each variant."""
    per_repeat = [paired_ratios(times) for times in repeats]
    names = list(repeats[0])
    pooled = {name: summary([r for ratios in per_repeat for r in ratios[name]]) for name in names}
    paths = {}
    if "ddp_weighted" in names and "ddp_weighted_after" in names:  # counts after ÷ counts ahead, paired per round
        paths["after_to_ahead"] = summary(
            [r for times in repeats for r in paired_ratios(times, "ddp_weighted")["ddp_weighted_after"]]
        )
    return {
        "ratio": pooled,
        **paths,
        "ratio_per_repeat": {name: [summary(ratios[name])["median"] for ratios in per_repeat] for name in names},
        "ms": {name: summary([t * 1e3 for times in repeats for t in times[name]])["median"] for name in names},
    }


def pool(repeats: Sequence[Sequence[dict[str, Any]]], keep: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """One entry per grid point: the times pooled over the repeats, the first repeat's correctness columns and
    its ``keep`` fields (deterministic, so the same in every repeat)."""
    pooled = []
    for entries in zip(*repeats, strict=True):
        first = entries[0]
        pooled.append(
            {
                "point": first["point"],
                **{key: first[key] for key in keep},
                **aggregate_times([entry["times"] for entry in entries]),
                "deviation": first.get("deviation"),
                "gradient_deviation": first.get("gradient_deviation"),
            }
        )
    return pooled


def aggregate(results: dict[str, Any]) -> dict[str, Any]:
    raw_points = pool([r["points"] for r in results["raw"]], keep=("collectives", "buckets"))
    sweep = pool([r["sweep"] for r in results["raw"]], keep=("imbalance", "epoch_steps"))
    base = {name: s["ms"][name] for s in sweep if s["imbalance"] == 0 for name in s["ms"]}
    for s in sweep:
        s["vs_largest_shard"] = {name: s["ms"][name] / base[name] for name in s["ms"]} if base else {}
    ablation = pool([r["ablation"] for r in results["raw"]])
    trainer = pool(results["trainer"], keep=("collectives", "buckets"))
    return {
        "raw": raw_points,
        "sweep": sweep,
        "ablation": ablation,
        "trainer": trainer,
        "memory": results["memory"],
        "sharded": sharded_step.pool(results["sharded"]) if results["sharded"] else [],
        "sharded_memory": results.get("sharded_memory", []),
        "probe": results["probe"],
        "seconds": results["seconds"],
    }


# ---------------------------------------------------------------------------------------------------------------
# Report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny grid, few rounds (the smoke test)")
    parser.add_argument("--repeats", type=int, default=2, help="independent process groups per level")
    parser.add_argument("--rounds", type=int, default=150, help="timed rounds per grid point (2M; 0.2M: twice)")
    parser.add_argument("--rounds-20m", type=int, default=12, help="timed rounds for the 20M points")
    parser.add_argument("--sweep-rounds", type=int, default=8, help="timed epochs per imbalance")
    parser.add_argument("--warmup", type=int, default=5, help="untimed rounds first (20M: half)")
    parser.add_argument("--ablation-rounds", type=int, default=150, help="timed rounds of the cost ablation")
    parser.add_argument("--levels", default="raw,sweep,ablation,trainer,memory,sharded")
    parser.add_argument("--sizes", default="0.2M,2M,20M", help="the raw and Trainer grids' model sizes")
    parser.add_argument("--dtypes", default="fp32,bf16", help="the raw and Trainer grids' gradient dtypes")
    parser.add_argument("--out", type=Path, default=HERE, help="where RESULTS.md, results.png, results.json go")
    parser.add_argument("--timeout", type=float, default=900, help="hard timeout of one launch (s)")
    parser.add_argument("--pg-timeout", type=float, default=180, help="gloo process-group timeout (s)")
    parser.add_argument("--no-report", action="store_true", help="write results.json only")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.warmup, args.repeats = min(args.rounds, 4), min(args.warmup, 2), min(args.repeats, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    grid = plan(args)
    results = run_levels(args, grid)
    summary_data = aggregate(results)
    summary_data["meta"] = meta(args, time.monotonic() - started)
    (args.out / "results.json").write_text(json.dumps(summary_data, indent=1))
    (args.out / "partial.json").unlink(missing_ok=True)
    if not args.no_report:
        from report import write_report

        write_report(summary_data, args.out)
    print(f"[run.py] wrote {args.out} in {time.monotonic() - started:.0f}s", flush=True)


def meta(args: argparse.Namespace, seconds: float) -> dict[str, Any]:
    import lightning
    import torch

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    flags = ""
    try:
        text = Path("/proc/cpuinfo").read_text()
        flags = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in text)
    except OSError:
        pass
    import os

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "python": platform.python_version(),
        "cpu": cpu,
        "cpu_flags": flags,
        "cores": os.cpu_count(),
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "seconds": seconds,
        "repeats": args.repeats,
        "rounds": args.rounds,
        "rounds_20m": args.rounds_20m,
        "warmup": args.warmup,
        "sweep_rounds": args.sweep_rounds,
        "quick": args.quick,
        "parameters": {s: parameter_count(s) for s in ("tiny", "0.2M", "2M", "20M")},
    }


if __name__ == "__main__":
    main()
