"""Benchmarks ddp_weighted side by side with plain DDP, the anchors' mechanisms and the sharded strategies.

    python benchmarks/run.py                        # the 2-rank tables, RESULTS.md (≈ 35 min on 2 cores)
    python benchmarks/run.py --quick --out /tmp/b   # the same on a tiny grid (≈ 1 min)
    python benchmarks/run.py overhead               # host time per step on one rank, µs beyond plain DDP
    python benchmarks/run.py instructions           # instructions per step under callgrind, beyond plain DDP

The default command runs, on 2 gloo ranks of this machine, each level in fresh processes under a hard timeout,
every variant of a level in the same rounds (one optimizer step each per round, shuffled order, paired ratios):

- ``raw``: raw ``DistributedDataParallel`` steps (``steps.py``): plain DDP, an A-vs-A control, ddp_weighted with
  counts ahead and counts after (the package's window loop over DDP's own reducer), counts ahead with 1 and with 4
  named loss parts, post-hoc and pre-count; also the payload all-reduce's time on this loopback;
- ``trainer``: the same as whole Lightning ``Trainer`` fits (``fits.py``);
- ``sharded``: fsdp2_weighted and fsdp_weighted, counts ahead and after, beside plain FSDP2 and FSDP1.

Each level also checks every variant against a float64 single-process reference and counts its collectives. Then
it writes ``results.json`` and ``RESULTS.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from common import HERE, Point, launch, parameter_count, pool

RAW = ["ddp", "ddp_control", "ddp_weighted", "ddp_weighted_after", "post_hoc", "pre_count"]
PARTS = ["ddp_weighted_parts1", "ddp_weighted_parts4"]  # counts ahead with 1 and 4 named loss parts (raw level)
SHARDED = ["fsdp2", "fsdp2_control", "fsdp2_weighted", "fsdp2_weighted_ahead", "fsdp", "fsdp_weighted"]
SHARDED += ["fsdp_weighted_ahead"]
PAIRS = {name: (name, "ddp") for name in [*RAW, "ddp_callback"]}  # label -> (variant, the one it is divided by)
PAIRS |= {"after_to_ahead": ("ddp_weighted_after", "ddp_weighted")}
PAIRS |= {name: (name, "ddp") for name in PARTS} | {"parts4_to_parts1": ("ddp_weighted_parts4", "ddp_weighted_parts1")}
PAIRS |= {name: (name, name.split("_")[0]) for name in SHARDED}
LEVELS = {"raw": ("raw", [*RAW, *PARTS]), "trainer": ("fits", [*RAW, "ddp_callback"]), "sharded": ("fits", SHARDED)}


def grid(args: argparse.Namespace) -> dict[str, list[Point]]:
    """Each level's points."""
    if args.quick:
        return {level: [Point("tiny", a, "fp32", args.rounds, args.warmup) for a in (1, 2)] for level in LEVELS}
    rounds = {"0.2M": 2 * args.rounds, "2M": args.rounds, "20M": args.rounds_20m}
    warm = {"0.2M": args.warmup, "2M": args.warmup, "20M": max(2, args.warmup // 2)}
    points = [
        Point(s, a, d, rounds[s], warm[s])
        for s in args.sizes.split(",")
        for a in (1, 4)
        for d in args.dtypes.split(",")
    ]
    sharded = [Point(s, a, "fp32", args.rounds, max(args.warmup, 2)) for s in ("0.2M", "2M") for a in (1, 4)]
    return {"raw": points, "trainer": points, "sharded": sharded}


def measure(args: argparse.Namespace) -> None:
    """The default command: every level, ``--repeats`` times, then results.json and RESULTS.md."""
    from report import write_report

    if args.quick:
        args.rounds, args.warmup, args.repeats = min(args.rounds, 4), min(args.warmup, 2), min(args.repeats, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    started, points = time.monotonic(), grid(args)
    runs: dict[str, list[Any]] = {level: [] for level in args.levels.split(",")}
    seconds: dict[str, float] = {}
    probe = None
    with tempfile.TemporaryDirectory(prefix="bench-") as scratch:
        for repeat in range(args.repeats):
            for level in runs:
                kind, names = LEVELS[level]
                out = Path(scratch) / f"{level}-{repeat}.json"
                spec = {"kind": kind, "names": names, "points": [p.__dict__ for p in points[level]]}
                spec |= {
                    "correctness": repeat == 0,
                    "probe": level == "raw" and repeat == 0,
                    "timeout": args.pg_timeout,
                }
                start = time.monotonic()
                output = launch(["--spec", json.dumps(spec), "--out", str(out)], 2, args.timeout)
                seconds[level] = seconds.get(level, 0.0) + time.monotonic() - start
                print(output[-4000:] if args.verbose else f"[run.py] {level} repeat {repeat} done", flush=True)
                data = json.loads(out.read_text())
                runs[level].append(data["points"])
                probe = probe or data.get("probe")
    results: dict[str, Any] = {level: pool(found, PAIRS) for level, found in runs.items()}
    results |= {"probe": probe, "seconds": seconds, "meta": meta(args, time.monotonic() - started)}
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    write_report(results, args.out)
    print(f"[run.py] wrote {args.out} in {time.monotonic() - started:.0f}s", flush=True)


def meta(args: argparse.Namespace, seconds: float) -> dict[str, Any]:
    import lightning
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")), "unknown")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "python": platform.python_version(),
        "cpu": f"{cpu} ({os.cpu_count()} cores)",
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "seconds": seconds,
        "repeats": args.repeats,
        "parameters": {s: parameter_count(s) for s in ("0.2M", "2M", "20M")},
    }


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def rank(args: argparse.Namespace) -> None:
    """One rank of a level (started by ``launch``): every point's variants, written by rank 0 to ``--out``."""
    import logging

    import torch
    import torch.distributed as dist
    from common import CollectiveCounter, finish

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    spec = json.loads(args.spec)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=spec["timeout"]))
    counter, results = CollectiveCounter(), {"points": [], "probe": None}
    if spec["probe"]:
        from steps import gloo_probe

        results["probe"] = gloo_probe()
    for entry in spec["points"]:
        point = Point(**entry)
        if spec["kind"] == "raw":
            from steps import run_point

            result = run_point(point, spec["names"], counter, spec["correctness"])
        else:
            from fits import run_point as run_fits

            result = run_fits(point, spec["names"], counter, spec["correctness"], spec["timeout"])
        results["points"].append(result)
        if dist.get_rank() == 0:
            medians = {k: statistics.median(v) * 1e3 for k, v in result["times"].items()}
            print(
                f"{spec['kind']} {point.label}: " + " ".join(f"{k}={v:.2f}ms" for k, v in medians.items()), flush=True
            )
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results))
    finish()


def overhead(args: argparse.Namespace) -> None:
    """Host time each raw variant adds per step on a 1-rank gloo group (DDP still buckets, copies and all-reduces):
    the median of the paired per-step differences to plain DDP, with their quartiles. The 2-rank ratios carry the
    other rank's jitter, which hides differences below a few percent at 0.2M-2M parameters."""
    from common import one_rank
    from steps import one_rank_differences

    names = args.variants.split(",")
    print("Host time added per optimizer step: median of the paired differences to plain DDP [q25, q75], µs")
    print("| point | plain DDP step (µs) | " + " | ".join(names) + " |\n|---|---:|" + "---:|" * len(names))
    with one_rank():
        for size in args.sizes.split(","):
            for accumulate in map(int, args.accumulate.split(",")):
                found = one_rank_differences(Point(size, accumulate, "fp32", args.steps, args.steps // 10), names)
                cells = []
                for name in names:
                    q1, median, q3 = statistics.quantiles([d * 1e6 for d in found[name]], n=4)
                    cells.append(f"{median:.0f} [{q1:.0f}, {q3:.0f}]")
                plain = statistics.median(found["ddp"]) * 1e6
                print(f"| {size} A={accumulate} ({args.steps} steps) | {plain:.0f} | " + " | ".join(cells) + " |")


# callgrind's client requests, callable from Python through ctypes
_REQUESTS = b"#include <valgrind/callgrind.h>\nvoid dump(const char *label) { CALLGRIND_DUMP_STATS_AT(label); }\n"
_WARM = 5


def instructions(args: argparse.Namespace) -> None:
    """Instructions each variant executes per optimizer step, counted by callgrind on a 1-rank gloo group, every
    thread's, after a warm-up, on one intra-op thread: host work without noise. ``raw``: every variant of a point
    in one process, each step counted between two dumps; ``trainer``: one ``Trainer.fit`` per process (Lightning's
    state is per fit), windows counted from the start of one to the start of another. An instruction is not a
    unit of time (the weighting's Python runs at a lower rate than the model's matrix products)."""
    if not (shutil.which("valgrind") and shutil.which("cc")):
        sys.exit("instructions need valgrind and a C compiler (cc) on the PATH")
    names = ["ddp", *args.variants.split(",")]
    print(f"Instructions per optimizer step ({args.level}), {args.steps} steps counted by callgrind, 1 rank, thousands")
    print("(in brackets: beyond plain DDP)\n\n| point | " + " | ".join(names) + " |\n|---|" + "---:|" * len(names))
    with tempfile.TemporaryDirectory(prefix="callgrind-") as temporary:
        folder = Path(temporary)
        command = ["cc", "-O2", "-shared", "-fPIC", "-x", "c", "-", "-o", str(folder / "requests.so")]
        subprocess.run(command, input=_REQUESTS, check=True)
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "LW_CALLGRIND_REQUESTS": str(folder / "requests.so")}
        env |= {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "LOCAL_RANK": "0"}  # Lightning: no launch
        # the examples' modules, then the caller's path: `PYTHONPATH=<checkout>/src` measures another checkout
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(HERE.parent / "examples"), os.environ.get("PYTHONPATH"))))
        for size in args.sizes.split(","):
            for accumulate in args.accumulate.split(","):
                runs = [",".join(names)] if args.level == "raw" else names  # one process per fit
                started = []
                for k, group in enumerate(runs):
                    out = folder / f"{size}-{accumulate}-{k}.out"
                    counted = [sys.executable, __file__, "count", args.level, size, accumulate, str(args.steps), group]
                    call = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *counted]
                    started.append(subprocess.Popen(call, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env))
                found: dict[str, float] = {}
                for process in started:
                    output = process.communicate(timeout=3600)[0].decode(errors="replace")
                    if process.returncode != 0:
                        sys.exit(f"callgrind run failed ({process.returncode}):\n{output[-3000:]}")
                for dump in folder.glob(f"{size}-{accumulate}-*.out.*"):
                    text = dump.read_text()
                    label = re.search(r"^desc: Trigger: Client Request: (.+)$", text, re.MULTILINE)
                    total = re.search(r"^(?:summary|totals): (\d+)", text, re.MULTILINE)
                    if label and total and label.group(1) != "before":
                        found[label.group(1)] = int(total.group(1)) / args.steps
                    dump.unlink()
                plain = found["ddp"]
                cells = [f"{plain / 1e3:.1f}"] + [
                    f"{found[n] / 1e3:.1f} ({(found[n] - plain) / 1e3:+.1f})" for n in names[1:]
                ]
                print(f"| {size} A={accumulate} | " + " | ".join(cells) + " |", flush=True)


def count(args: argparse.Namespace) -> None:
    """Under callgrind: each variant's ``steps`` steps after a warm-up, counted from zero, dumped under its name."""
    from common import one_rank

    dump = ctypes.CDLL(os.environ["LW_CALLGRIND_REQUESTS"]).dump  # looked up once, outside the counting
    point = Point(args.size, args.accumulate, "fp32", args.steps, _WARM)
    with one_rank():
        if args.level == "raw":
            from steps import build

            models = build(point, args.names.split(","), 0, 1, windows=50)
            for _ in range(_WARM):
                for model in models.values():
                    model.step()
            gc.disable()  # a collection would land in whichever variant crosses its threshold
            for name, model in models.items():
                gc.collect()
                dump(b"before")  # a dump zeroes every thread's count: what ran before is left out
                for _ in range(args.steps):
                    model.step()
                dump(name.encode())
            return
        from fits import Fit
        from lightning.pytorch import Callback

        class Counting(Callback):
            """Dumps at the start of window ``_WARM`` (zeroing every count) and of window ``_WARM + steps``."""

            def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
                if batch_idx == _WARM * point.accumulate:
                    gc.collect()
                    gc.disable()
                    dump(b"before")
                elif batch_idx == (_WARM + args.steps) * point.accumulate:
                    dump(args.names.encode())
                    gc.enable()

        fit = Fit(args.names, point, point.steps + 1, 60, extra=[Counting()], park=False)
        fit.run()
        if fit.baton.error is not None:
            raise fit.baton.error


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", metavar="{all,overhead,instructions}")
    run_all = commands.add_parser("all", help="the 2-rank tables and RESULTS.md (the default)")
    run_all.add_argument("--quick", action="store_true", help="tiny grid, few rounds (the smoke test)")
    run_all.add_argument("--repeats", type=int, default=2, help="independent process groups per level")
    run_all.add_argument("--rounds", type=int, default=150, help="timed rounds per point (0.2M: twice)")
    run_all.add_argument("--rounds-20m", type=int, default=12, help="timed rounds for the 20M points")
    run_all.add_argument("--warmup", type=int, default=5, help="untimed rounds first (20M: half)")
    run_all.add_argument("--levels", default="raw,trainer,sharded")
    run_all.add_argument("--sizes", default="0.2M,2M,20M", help="the raw and Trainer grids' model sizes")
    run_all.add_argument("--dtypes", default="fp32,bf16", help="the raw and Trainer grids' gradient dtypes")
    run_all.add_argument("--out", type=Path, default=HERE, help="where results.json and RESULTS.md go")
    run_all.add_argument("--timeout", type=float, default=1800, help="hard timeout of one launch (s)")
    run_all.add_argument("--pg-timeout", type=float, default=180, help="gloo process-group timeout (s)")
    run_all.add_argument("--verbose", action="store_true")
    one = commands.add_parser("overhead", help="host time per step on one rank, µs beyond plain DDP")
    one.add_argument("--sizes", default="0.2M,2M")
    one.add_argument("--accumulate", default="1,4")
    one.add_argument("--steps", type=int, default=1500, help="optimizer steps per variant and point")
    one.add_argument("--variants", default="ddp_control,ddp_weighted,ddp_weighted_after,post_hoc,pre_count")
    grind = commands.add_parser("instructions", help="instructions per step under callgrind, beyond plain DDP")
    grind.add_argument("--level", choices=("raw", "trainer"), default="raw")
    grind.add_argument("--sizes", default="0.2M")
    grind.add_argument("--accumulate", default="1,4")
    grind.add_argument("--steps", type=int, default=10, help="optimizer steps counted per variant and point")
    grind.add_argument("--variants", help="besides plain DDP; default: the level's")
    worker = commands.add_parser("rank")  # one rank of a level, started by `launch`
    worker.add_argument("--spec", required=True)
    worker.add_argument("--out", required=True)
    counted = commands.add_parser("count")  # under callgrind
    for name, kind in (("level", str), ("size", str), ("accumulate", int), ("steps", int), ("names", str)):
        counted.add_argument(name, type=kind)
    argv = sys.argv[1:]
    if not argv or (argv[0] not in commands.choices and argv[0] not in ("-h", "--help")):
        argv = ["all", *argv]
    args = parser.parse_args(argv)
    if args.command == "instructions" and not args.variants:
        args.variants = "ddp_control,ddp_weighted,ddp_weighted_after"
        args.variants += ",post_hoc,pre_count," + ",".join(PARTS) if args.level == "raw" else ",ddp_callback"
    {"all": measure, "overhead": overhead, "instructions": instructions, "rank": rank, "count": count}[args.command](
        args
    )


if __name__ == "__main__":
    main()
