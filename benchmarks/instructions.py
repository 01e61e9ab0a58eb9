"""Instructions each raw DDP variant executes per optimizer step, counted by callgrind: host work without noise.

Step times on a shared machine move by more than the host work a variant adds (see ``overhead.py``); the
instructions a step executes do not: callgrind counts them the same in every run, whatever else the machine does.
This script runs itself under ``valgrind --tool=callgrind`` once per point, on a 1-rank gloo group, and counts the
instructions of ``--steps`` optimizer steps of each variant of ``raw_step.py``, every thread's (gloo's included),
after a warm-up. It prints them per step, and what each variant executes beyond plain DDP. An instruction is not a
unit of time: the weighting's Python runs at a lower rate than the model's matrix products, and between passes over
the gradients that leave the caches cold (``ANALYSIS.md``).

    python benchmarks/instructions.py                         # 0.2M, A = 1 and 4 (≈ 20 min)
    python benchmarks/instructions.py --sizes tiny --accumulate 1 --steps 3 --variants ddp_control,ddp_weighted

Needs valgrind and a C compiler: the counts are dumped by callgrind's client requests, from a tiny library
compiled on the fly.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from overhead import DEFAULT, build, one_rank

# callgrind's client requests, callable from Python through ctypes
_REQUESTS = b"""
#include <valgrind/callgrind.h>
void dump(const char *label) { CALLGRIND_DUMP_STATS_AT(label); }
"""


def count(size: str, accumulate: int, steps: int, variants: list[str], library: Path) -> None:
    """Under callgrind: each variant's ``steps`` steps counted from zero and dumped under its name."""
    requests = ctypes.CDLL(str(library))
    dump = requests.dump  # looked up once, outside the counting
    warm = 5
    with one_rank():
        models, windows = build(size, accumulate, warm + steps, variants)
        for step in range(warm):
            for model in models.values():
                model.step(windows(step))
        gc.disable()  # a collection would land in whichever variant crosses its threshold
        for name, model in models.items():
            label = name.encode()
            gc.collect()
            dump(b"before")  # a dump zeroes every thread's count: what ran before is left out
            for step in range(warm, warm + steps):
                model.step(windows(step))
            dump(label)


def per_step(outputs: list[Path], steps: int) -> dict[str, float]:
    """Instructions per step under each dump's label: a variant's name (``before`` marks where a count starts)."""
    found = {}
    for output in outputs:
        text = output.read_text()
        label = re.search(r"^desc: Trigger: Client Request: (.+)$", text, re.MULTILINE)
        total = re.search(r"^(?:summary|totals): (\d+)", text, re.MULTILINE)
        if label and total:
            found[label.group(1)] = int(total.group(1)) / steps
    return found


def measure(size: str, accumulate: int, steps: int, variants: list[str], folder: Path) -> dict[str, float]:
    """Runs this script's counting under callgrind for one point; returns instructions per step by variant."""
    out = folder / f"{size}-{accumulate}.out"
    command = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]
    command += [sys.executable, __file__, "--count", size, str(accumulate), str(steps), ",".join(variants)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "LW_CALLGRIND_REQUESTS": str(folder / "requests.so")}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"callgrind run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    found = per_step(sorted(folder.glob(f"{out.name}.*")), steps)
    missing = set(variants) - set(found)
    if missing:
        raise RuntimeError(f"no count for {sorted(missing)} in {folder}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="0.2M")
    parser.add_argument("--accumulate", default="1,4")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps counted per variant and point")
    parser.add_argument("--variants", default=",".join(DEFAULT), help="besides plain DDP (ddp)")
    parser.add_argument("--count", nargs=4, metavar=("SIZE", "A", "STEPS", "VARIANTS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.count:
        size, accumulate, steps, variants = args.count
        count(size, int(accumulate), int(steps), variants.split(","), Path(os.environ["LW_CALLGRIND_REQUESTS"]))
        return
    if not (shutil.which("valgrind") and shutil.which("cc")):
        sys.exit("instructions.py needs valgrind and a C compiler (cc) on the PATH")
    variants = ["ddp", *args.variants.split(",")]
    print(f"Instructions per optimizer step, {args.steps} steps counted by callgrind, 1 rank, thousands")
    print("(in brackets: beyond plain DDP)\n")
    print("| point | " + " | ".join(variants) + " |")
    print("|---|" + "---:|" * len(variants))
    with tempfile.TemporaryDirectory(prefix="callgrind-") as temporary:
        folder = Path(temporary)
        compiled = ["cc", "-O2", "-shared", "-fPIC", "-x", "c", "-", "-o", str(folder / "requests.so")]
        subprocess.run(compiled, input=_REQUESTS, check=True)
        for size in args.sizes.split(","):
            for accumulate in map(int, args.accumulate.split(",")):
                found = measure(size, accumulate, args.steps, variants, folder)
                plain = found["ddp"]
                cells = [f"{plain / 1e3:.1f}"]
                cells += [f"{found[name] / 1e3:.1f} ({(found[name] - plain) / 1e3:+.1f})" for name in variants[1:]]
                print(f"| {size} A={accumulate} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
