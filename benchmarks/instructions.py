"""Instructions each DDP variant executes per optimizer step, counted by callgrind: host work without noise.

Step times on a shared machine move by more than the host work a variant adds (see ``overhead.py``); the
instructions a step executes do not: callgrind counts them the same in every run, whatever else the machine does.
This script runs itself under ``valgrind --tool=callgrind`` on a 1-rank gloo group and counts the instructions of
``--steps`` optimizer steps of each variant, every thread's (gloo's included), after a warm-up, on one intra-op
thread (OpenMP's spinning workers would add a count that depends on scheduling). It prints them per step, and what
each variant executes beyond plain DDP. Two levels:

- ``raw``: the variants of ``raw_step.py``, all in one process per point, each DDP step counted between two dumps.
- ``trainer``: whole ``Trainer.fit`` runs of ``trainer_step.py``'s variants, one process per variant (Lightning's
  state is per fit), windows counted from the start of one to the start of another; ``ddp_callback`` is plain
  ``"ddp"`` with one more, empty, ``Callback``: what Lightning's dispatch of any callback costs, ``ItemCounter``'s
  included.

An instruction is not a unit of time: the weighting's Python runs at a lower rate than the model's matrix
products, and between passes over the gradients that leave the caches cold (``ANALYSIS.md``).

    python benchmarks/instructions.py                         # raw, 0.2M, A = 1 and 4 (≈ 20 min)
    python benchmarks/instructions.py --level trainer         # the same points through the Trainer (≈ 15 min)
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
from typing import Any

from common import Point
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


TRAINER_DEFAULT = ["ddp_control", "ddp_callback", "ddp_weighted", "ddp_weighted_after"]


def count_fit(size: str, accumulate: int, steps: int, name: str, library: Path) -> None:
    """Under callgrind: ``steps`` windows of one variant's ``Trainer.fit``, counted from zero, dumped under its name."""
    from lightning.pytorch import Callback  # imported here: the raw level, under callgrind too, needs no Lightning
    from trainer_step import setup_fit

    dump, warm = ctypes.CDLL(str(library)).dump, 5

    class Counting(Callback):
        """Dumps at the start of window ``warm`` (zeroing every thread's count) and of window ``warm + steps``."""

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == warm * accumulate:
                gc.collect()
                gc.disable()  # a collection would land in whichever window crosses its threshold
                dump(b"before")
            elif batch_idx == (warm + steps) * accumulate:
                dump(name.encode())
                gc.enable()

    point = Point(size, accumulate, "fp32", rounds=steps, warmup=warm)
    with one_rank():
        trainer, module, loader = setup_fit(name, point, 0, warm + steps + 1, [Counting()])
        trainer.fit(module, train_dataloaders=loader)


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


def measure(level: str, size: str, accumulate: int, steps: int, variants: list[str], folder: Path) -> dict[str, float]:
    """Runs this script's counting under callgrind for one point; returns instructions per step by variant."""
    # one process per point for raw steps, per variant for fits, all at once
    runs = [",".join(variants)] if level == "raw" else variants
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "LW_CALLGRIND_REQUESTS": str(folder / "requests.so")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", LOCAL_RANK="0")  # Lightning: one thread, no launch
    started = []
    for k, names in enumerate(runs):
        out = folder / f"{level}-{size}-{accumulate}-{k}.out"
        command = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, __file__]
        command += ["--count", level, size, str(accumulate), str(steps), names]
        started.append((out, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)))
    found: dict[str, float] = {}
    try:
        for out, process in started:
            output = process.communicate(timeout=3600)[0].decode(errors="replace")
            if process.returncode != 0:
                raise RuntimeError(f"callgrind run failed ({process.returncode}):\n{output[-3000:]}")
            found.update(per_step(sorted(folder.glob(f"{out.name}.*")), steps))
    finally:
        for _, process in started:
            process.kill()  # none outlives a failed one
    missing = set(variants) - set(found)
    if missing:
        raise RuntimeError(f"no count for {sorted(missing)} in {folder}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--level", choices=("raw", "trainer"), default="raw")
    parser.add_argument("--sizes", default="0.2M")
    parser.add_argument("--accumulate", default="1,4")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps counted per variant and point")
    parser.add_argument("--variants", help="besides plain DDP (ddp); by default every variant of the level")
    parser.add_argument("--count", nargs=5, help=argparse.SUPPRESS)  # LEVEL SIZE A STEPS VARIANTS, under callgrind
    args = parser.parse_args()
    if args.count:
        level, size, accumulate, steps, names = args.count
        library = Path(os.environ["LW_CALLGRIND_REQUESTS"])
        if level == "raw":
            count(size, int(accumulate), int(steps), names.split(","), library)
        else:
            count_fit(size, int(accumulate), int(steps), names, library)
        return
    if not (shutil.which("valgrind") and shutil.which("cc")):
        sys.exit("instructions.py needs valgrind and a C compiler (cc) on the PATH")
    default = DEFAULT if args.level == "raw" else TRAINER_DEFAULT
    variants = ["ddp", *(args.variants.split(",") if args.variants else default)]
    what = "raw DDP steps" if args.level == "raw" else "Trainer.fit"
    print(f"Instructions per optimizer step ({what}), {args.steps} steps counted by callgrind, 1 rank, thousands")
    print("(in brackets: beyond plain DDP)\n")
    print("| point | " + " | ".join(variants) + " |")
    print("|---|" + "---:|" * len(variants))
    with tempfile.TemporaryDirectory(prefix="callgrind-") as temporary:
        folder = Path(temporary)
        compiled = ["cc", "-O2", "-shared", "-fPIC", "-x", "c", "-", "-o", str(folder / "requests.so")]
        subprocess.run(compiled, input=_REQUESTS, check=True)
        for size in args.sizes.split(","):
            for accumulate in map(int, args.accumulate.split(",")):
                found = measure(args.level, size, accumulate, args.steps, variants, folder)
                plain = found["ddp"]
                cells = [f"{plain / 1e3:.1f}"]
                cells += [f"{found[name] / 1e3:.1f} ({(found[name] - plain) / 1e3:+.1f})" for name in variants[1:]]
                print(f"| {size} A={accumulate} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
