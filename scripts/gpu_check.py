"""GPU check of ``ddp_weighted`` and ``fsdp2_weighted``: the worked trace and the float64 oracle on CUDA.

Checks, each run as its own Lightning training in a subprocess with a hard timeout, one line per check:

- ``ranks=1``: NCCL, world size 1, on ``cuda:0``. The trace's two microbatches ``[9, 9]`` and ``[7] * 6`` form one
  accumulation window (``accumulate_grad_batches=2``). ``fsdp2_weighted`` (FSDP2, Lightning's
  ``ModelParallelStrategy``) runs here too, against plain ``ModelParallelStrategy``: its module applies
  ``fully_shard`` in ``configure_model`` over the one-rank data-parallel mesh.
- ``ranks=2``: gloo with CUDA tensors, two processes both on ``cuda:0`` (the strategy's
  ``parallel_devices=[cuda:0, cuda:0]``; NCCL refuses two ranks on one GPU). Rank 0 holds ``[9, 9]``, rank 1
  ``[7] * 6``.

Worked trace: ``w = 10``, per-item loss ``½(w − y)²``, SGD lr 0.1, one step. ``ddp_weighted`` lands on
``w = 9.75`` (the mean over all 8 items), plain ``ddp`` on ``9.8`` (the mean of the two means); both are checked, so
the check can tell them apart. Oracle: ``tests/distributed/scenario.py``'s uneven token-masked data trained for
2 epochs with 3 microbatches per step must match its float64 single-process reference to a relative error below 1e-5.

Prints ``PASS``/``FAIL`` lines with timings and exits 1 on any failure; without a CUDA device it prints ``SKIP``
and exits 0. ``--device cpu`` runs the same checks on CPU with gloo (a dry run of this script).

Usage::

    scripts/gpu_check.sh                     # or: python scripts/gpu_check.py
    python scripts/gpu_check.py --device cpu --only trace-ddp_weighted-2
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests" / "distributed")]  # this checkout's package and test scenario

import torch  # noqa: E402

EXPECTED_W = {"ddp_weighted": 9.75, "ddp": 9.8, "fsdp2_weighted": 9.75, "fsdp2": 9.8}
TARGETS = [[9.0, 9.0], [7.0] * 6]
PHASE_TIMEOUT = 120.0  # seconds for one training run; a healthy one takes 10-30 s (imports, CUDA init)
PG_TIMEOUT = timedelta(seconds=60)  # process-group timeout: a dead rank fails the check instead of hanging it
# Variables of an enclosing launch (srun, torchrun) that would make Lightning adopt that launch's world.
_LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclasses.dataclass(frozen=True)
class Check:
    """One training run: ``kind`` is ``trace`` or ``oracle``; ``ranks`` 1 (NCCL) or 2 (gloo, one GPU)."""

    kind: str
    strategy: str
    ranks: int

    @property
    def name(self) -> str:
        """The check's id, as passed to ``--check``."""
        return f"{self.kind}-{self.strategy}-{self.ranks}"


CHECKS = (
    Check("trace", "ddp_weighted", 1),
    Check("trace", "ddp", 1),
    Check("oracle", "ddp_weighted", 1),
    Check("trace", "fsdp2_weighted", 1),
    Check("trace", "fsdp2", 1),
    Check("oracle", "fsdp2_weighted", 1),
    Check("trace", "ddp_weighted", 2),
    Check("trace", "ddp", 2),
    Check("oracle", "ddp_weighted", 2),
)


def oracle_config(ranks: int, strategy: str = "ddp_weighted") -> Any:
    """The oracle's scenario: uneven token counts per rank and microbatch, a short last window, 2 epochs."""
    from sharded_worker import ShardedConfig

    return ShardedConfig(strategy=strategy, world_size=ranks, accumulate=3, batches=7, epochs=2, mode="tokens")


# ----------------------------------------------------------------------------------------- one training run


def train(check: Check, device_type: str, out: str) -> None:
    """Trains ``check`` on this rank (Lightning's popen launcher re-runs this command for rank 1)."""
    from lightning.pytorch import Callback, LightningModule, Trainer
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
    from scenario import WeightedModule
    from sharded_worker import ShardedModule

    import lightning_weighted

    sharded = check.strategy.startswith("fsdp2")

    class OneParameter(LightningModule):
        """``w = 10`` and one microbatch of trace targets per rank (both on rank 0 when it is alone)."""

        def __init__(self) -> None:
            super().__init__()
            self.half_square = HalfSquare(10.0)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> dict[str, Any]:
            return {"loss": self.half_square(batch).mean(), "count": len(batch)}

        def configure_model(self) -> None:
            if sharded:  # FSDP2 shards `w` over the one-rank data-parallel mesh and unshards it for each forward
                from torch.distributed.fsdp import fully_shard

                fully_shard(self.half_square, mesh=self.device_mesh["data_parallel"])

        def train_dataloader(self) -> Any:
            mine = TARGETS if check.ranks == 1 else [TARGETS[self.global_rank]]
            # a list of microbatches is a map-style data set; `batch_size=None` serves each one as it is
            return torch.utils.data.DataLoader([torch.tensor(t) for t in mine], batch_size=None)  # type: ignore[arg-type]

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Report(Callback):
        """Writes what this rank ran on and its final parameters to ``<out>.rank<r>``."""

        def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
            model: Any = trainer.strategy.model  # the DistributedDataParallel wrapper, or the module under FSDP2
            if sharded:
                from torch.distributed.fsdp import FSDPModule

                hook = f"{sum(isinstance(m, FSDPModule) for m in model.modules())} FSDP2 modules"
            else:
                hook = str(model._get_ddp_logging_data().get("comm_hook"))
            self.launch = {
                "backend": torch.distributed.get_backend(),
                "world_size": torch.distributed.get_world_size(),
                "device": str(whole(next(pl_module.parameters())).device),
                "comm_hook": hook,
            }

        def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
            params = [whole(p.detach()).double().cpu().tolist() for p in pl_module.parameters()]
            record = {**self.launch, "rank": trainer.global_rank, "steps": trainer.global_step, "params": params}
            Path(f"{out}.rank{trainer.global_rank}").write_text(json.dumps(record))

    cuda = device_type == "cuda"
    torch.set_float32_matmul_precision("highest")  # TF32 matmuls would miss the oracle's 1e-5
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    backend = "nccl" if cuda and check.ranks == 1 else "gloo"
    strategy: Any
    if sharded:  # one rank: the device comes from `devices=1`
        cls: Any = lightning_weighted.WeightedModelParallelStrategy if "weighted" in check.strategy else None
        cls = cls or ModelParallelStrategy
        strategy = cls(data_parallel_size=1, tensor_parallel_size=1, process_group_backend=backend, timeout=PG_TIMEOUT)
    else:
        cls = lightning_weighted.WeightedDDPStrategy if check.strategy == "ddp_weighted" else DDPStrategy
        strategy = cls(parallel_devices=[device] * check.ranks, process_group_backend=backend, timeout=PG_TIMEOUT)
    module: LightningModule
    if check.kind == "trace":
        module, limits = OneParameter(), {"max_steps": 1, "accumulate_grad_batches": len(TARGETS) // check.ranks}
    else:
        config = oracle_config(check.ranks, check.strategy)
        model = ShardedModule(config) if sharded else WeightedModule(config)
        module, limits = model, {"max_epochs": config.epochs, "accumulate_grad_batches": 3}
    trainer = Trainer(
        accelerator=device_type,
        devices=1,  # the device list comes from `parallel_devices`; `devices=2` would ask for two GPUs
        strategy=strategy,
        callbacks=[Report()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,  # each rank's batches are its own already
        num_sanity_val_steps=0,
        limit_val_batches=0,  # the checks train only
        **limits,  # type: ignore[arg-type]
    )
    trainer.fit(module)


class HalfSquare(torch.nn.Module):
    """``½ (w − y)²`` per item: the trace's one parameter ``w``, in a module whose forward FSDP2 can shard."""

    def __init__(self, w: float) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([w]))

    def forward(self, targets: torch.Tensor) -> torch.Tensor:
        """The per-item loss of ``targets``."""
        return 0.5 * (self.w - targets) ** 2


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter as a whole tensor: FSDP2's DTensor shards gathered."""
    full_tensor = getattr(tensor, "full_tensor", None)
    return full_tensor() if full_tensor is not None else tensor


# ------------------------------------------------------------------------------------------------ the checks


def judge(check: Check, device_type: str, records: list[dict[str, Any]]) -> tuple[bool, str]:
    """Compares the ranks' records with the expectation; returns ``(passed, detail)``."""
    from scenario import max_relative_error, reference

    backend = "nccl" if device_type == "cuda" and check.ranks == 1 else "gloo"
    launch = {(r["backend"], r["world_size"], r["device"].split(":")[0]) for r in records}
    if launch != {(backend, check.ranks, device_type)}:
        expected = (backend, check.ranks, device_type)
        return False, f"ran as (backend, world size, device) {sorted(launch)}, expected {expected}"
    hooks = {r["comm_hook"] for r in records}
    if check.strategy == "ddp_weighted" and not all("weighted_allreduce_hook" in hook for hook in hooks):
        return False, f"comm hook {sorted(hooks)}, expected weighted_allreduce_hook"
    sharded = all(hook.endswith("FSDP2 modules") and not hook.startswith("0 ") for hook in hooks)
    if check.strategy.startswith("fsdp2") and not sharded:
        return False, f"{sorted(hooks)}, expected a module sharded by FSDP2"
    if any(r["params"] != records[0]["params"] for r in records):
        return False, "replicas disagree"
    params = [torch.tensor(p, dtype=torch.float64) for p in records[0]["params"]]
    if check.kind == "trace":
        w, want = float(params[0]), EXPECTED_W[check.strategy]
        return abs(w - want) < 1e-5, f"w = {w:.6f} (expected {want}; {records[0]['steps']} step)"
    error = max_relative_error(params, reference(oracle_config(check.ranks, check.strategy))["params"])
    return error < 1e-5, f"max relative error {error:.2e} vs float64 reference (limit 1e-5)"


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_check(check: Check, device_type: str, workdir: Path) -> tuple[bool, str, float, str]:
    """Runs one check in its own session under ``PHASE_TIMEOUT``; returns ``(passed, detail, seconds, output)``."""
    out = workdir / check.name
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in _LAUNCH_VARIABLES and not key.startswith(("SLURM_", "TORCHELASTIC_", "PL_"))
    }
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONUNBUFFERED": "1"})
    command = [sys.executable, str(Path(__file__).resolve()), "--check", check.name, "--device", device_type,
               "--out", str(out)]  # fmt: skip
    start = time.monotonic()
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=PHASE_TIMEOUT)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return False, f"hung: killed after {PHASE_TIMEOUT:.0f}s", time.monotonic() - start, output
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # Lightning's rank 1 shares the session: no leftovers
    seconds = time.monotonic() - start
    if process.returncode != 0:
        return False, f"training exited with {process.returncode}", seconds, output
    try:
        records = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(check.ranks)]
        passed, detail = judge(check, device_type, records)
    except Exception as error:  # a missing or malformed record is a failure of this check, not of the script
        return False, f"could not read the result: {error!r}", seconds, output
    return passed, detail, seconds, output


def describe(device_type: str) -> str:
    """The versions and device the checks run with."""
    line = f"torch {torch.__version__}, CUDA {torch.version.cuda}"
    if device_type == "cuda":
        nccl = "missing"
        if torch.distributed.is_nccl_available():
            version = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
            nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        line += f", NCCL {nccl}, {torch.cuda.get_device_name(0)} ({torch.cuda.device_count()} visible)"
    return line + f", device {device_type}"


def main(argv: list[str] | None = None) -> int:
    """Runs every check (or, with ``--check``, trains one); returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="cpu: a dry run with gloo")
    parser.add_argument("--only", action="append", choices=[c.name for c in CHECKS], help="run only these checks")
    parser.add_argument("--check", choices=[c.name for c in CHECKS], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.check:
        train(next(c for c in CHECKS if c.name == args.check), args.device, args.out)
        return 0

    if args.device == "auto" and not torch.cuda.is_available():
        print(f"SKIP gpu_check: no CUDA device (torch {torch.__version__}, CUDA build {torch.version.cuda})")
        return 0
    device_type = "cuda" if args.device == "auto" else args.device
    if device_type == "cuda" and not torch.cuda.is_available():
        print("FAIL gpu_check: --device cuda was asked for, but torch.cuda.is_available() is False")
        return 1
    if device_type == "cuda" and not torch.distributed.is_nccl_available():
        print("FAIL gpu_check: this torch build has no NCCL; the ranks=1 checks need it")
        return 1
    print(f"gpu_check: {describe(device_type)}", flush=True)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` in gpu_check.sh: the `finally`s still run
    checks = [check for check in CHECKS if not args.only or check.name in args.only]
    failures, start = 0, time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as workdir:
        for check in checks:
            passed, detail, seconds, output = run_check(check, device_type, Path(workdir))
            failures += not passed
            backend = "nccl" if device_type == "cuda" and check.ranks == 1 else "gloo"
            label = f"{check.kind:<6} {check.strategy:<14} ranks={check.ranks} {backend:<5}"
            print(f"{'PASS' if passed else 'FAIL'} {label} {seconds:6.1f}s  {detail}", flush=True)
            if not passed:
                print("    " + "\n    ".join(output[-6000:].splitlines()), flush=True)
    total = time.monotonic() - start
    print(f"gpu_check: {len(checks) - failures}/{len(checks)} passed in {total:.1f}s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
