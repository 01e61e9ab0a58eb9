"""The GPU check: the worked trace and the float64 oracle over NCCL and over gloo on CUDA tensors, no device
synchronisation inside a microbatch on any path, engine or integration, and paired step times on a ~100M-parameter
transformer.

Each test runs on CUDA where a GPU is visible (`scripts/gpu_check.sh` runs `-k cuda`, at most 8 minutes on one
GPU) and as a CPU dry run everywhere (gloo, the same launches, records and verdicts, small sizes), so CI keeps
the check working. One GPU holds every rank: NCCL for one rank, gloo on CUDA tensors for two.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

import pytest
import torch
from fabric_worker import FabricConfig
from harness import fit
from launcher import ranks
from scenario import Config, max_relative_error, reference
from sharded import fit_sharded
from sharded_worker import ShardedConfig
from trace_worker import Config as Trace
from transformer_worker import Config as Transformer

HERE = Path(__file__).parent
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
DEVICES = [pytest.param("cuda", marks=CUDA), "cpu"]
ORACLE = Config(accumulate=3, batches=7, epochs=2, mode="tokens")  # uneven counts, a short last window


def _run(script: str, config: object, world_size: int, tmp_path: Path, timeout: float = 240) -> list[dict]:
    out = tmp_path / f"{Path(script).stem}-{id(config)}"
    arguments = ["--config", json.dumps(dataclasses.asdict(config)), "--out", str(out)]  # type: ignore[call-overload]
    done = ranks(HERE / script, arguments, world_size, timeout)
    assert done.returncode == 0, done.stdout[-8000:]
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(world_size)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize(("strategy", "counter", "w"), [("ddp_weighted", False, 9.75), ("ddp_weighted", True, 9.75),
                                                        ("ddp", False, 9.8)])  # fmt: skip
def test_the_worked_trace_lands_where_its_objective_says(tmp_path, device, world_size, strategy, counter, w):
    records = _run("trace_worker.py", Trace(device, world_size, strategy, counter), world_size, tmp_path)
    backend = "nccl" if device == "cuda" and world_size == 1 else "gloo"
    for record in records:
        assert (record["backend"], record["device"].split(":")[0], record["steps"]) == (backend, device, 1)
        assert record["counts_ahead"] is (counter if strategy == "ddp_weighted" else None)
        assert record["fsdp_modules"] == 0
        assert record["w"] == pytest.approx(w, abs=1e-6)  # 9.75: the mean over all 8 items; 9.8: the mean of means


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("strategy", "w"), [("fsdp2_weighted", 9.75), ("fsdp2", 9.8)])
def test_the_worked_trace_under_fsdp2_on_one_rank(tmp_path, device, strategy, w):
    (record,) = _run("trace_worker.py", Trace(device, 1, strategy), 1, tmp_path)
    backend = "nccl" if device == "cuda" else "gloo"
    assert (record["backend"], record["device"].split(":")[0], record["steps"]) == (backend, device, 1)
    assert record["fsdp_modules"] == 1  # `w` really is sharded
    assert record["w"] == pytest.approx(w, abs=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("counter", [None, "quiet"])
def test_the_fsdp2_oracle_matches_the_float64_reference_on_one_rank(tmp_path, device, counter):
    config = ShardedConfig(
        **{**dataclasses.asdict(ORACLE), "strategy": "fsdp2_weighted", "world_size": 1, "device": device},
    )
    config = dataclasses.replace(config, counter=counter, bare_loss=bool(counter))
    (record,) = fit_sharded(config, tmp_path, timeout=240)
    assert record["counts_ahead"] is (counter is not None)
    assert max_relative_error(record["params"], reference(config)["params"]) < 1e-5


@pytest.mark.parametrize(
    ("device", "world_size", "counter"),
    [*(pytest.param("cuda", n, c, marks=CUDA) for n in (1, 2) for c in (None, "quiet")), ("cpu", 2, "quiet")],
)
def test_the_oracle_matches_the_float64_reference(tmp_path, device, world_size, counter):
    config = dataclasses.replace(ORACLE, device=device, world_size=world_size, counter=counter, bare_loss=bool(counter))
    result = fit(config, tmp_path, timeout=240)
    assert result[0]["counts_ahead"] is (counter is not None)
    assert max_relative_error(result[0]["params"], reference(config)["params"]) < 1e-5  # fp32 matmuls: no TF32


def _fabric(config: object, tmp_path: Path) -> list[dict]:
    return fit(config, tmp_path, timeout=240, script="fabric_worker.py")  # type: ignore[arg-type, no-any-return]


def _sharded(config: object, tmp_path: Path) -> list[dict]:
    return fit_sharded(config, tmp_path, timeout=240)  # type: ignore[arg-type, no-any-return]


def _trainer(config: object, tmp_path: Path) -> list[dict]:
    return fit(config, tmp_path, timeout=240)  # type: ignore[arg-type, no-any-return]


AHEAD = {"counter": "quiet", "bare_loss": True}
COMBINATIONS = [  # every integration, engine and count path, on one rank (NCCL on CUDA)
    ("trainer-ddp-returned", _trainer, ORACLE),
    ("trainer-ddp-counter", _trainer, dataclasses.replace(ORACLE, **AHEAD)),
    ("trainer-fsdp2-returned", _sharded, ShardedConfig(**{**dataclasses.asdict(ORACLE), "strategy": "fsdp2_weighted"})),
    (
        "trainer-fsdp2-counter",
        _sharded,
        ShardedConfig(**{**dataclasses.asdict(ORACLE), **AHEAD, "strategy": "fsdp2_weighted"}),
    ),
    ("trainer-fsdp1-returned", _sharded, ShardedConfig(**{**dataclasses.asdict(ORACLE), "strategy": "fsdp_weighted"})),
    (
        "trainer-fsdp1-counter",
        _sharded,
        ShardedConfig(**{**dataclasses.asdict(ORACLE), **AHEAD, "strategy": "fsdp_weighted"}),
    ),
    ("fabric-ddp-returned", _fabric, FabricConfig(**dataclasses.asdict(ORACLE))),
    ("fabric-ddp-ahead", _fabric, FabricConfig(**dataclasses.asdict(ORACLE), ahead=True)),
    ("fabric-fsdp2-returned", _fabric, FabricConfig(**{**dataclasses.asdict(ORACLE), "strategy": "fsdp2_weighted"})),
    (
        "fabric-fsdp2-ahead",
        _fabric,
        FabricConfig(**{**dataclasses.asdict(ORACLE), "strategy": "fsdp2_weighted"}, ahead=True),
    ),
]
DRY_RUN = {
    "trainer-ddp-returned",
    "fabric-fsdp2-ahead",
}  # on the CPU, the rest runs in tests/distributed/test_host_reads.py


@pytest.mark.parametrize(
    ("device", "train", "config"),
    [
        *(pytest.param("cuda", train, config, id=f"cuda-{name}", marks=CUDA) for name, train, config in COMBINATIONS),
        *(
            pytest.param("cpu", train, config, id=f"cpu-{name}")
            for name, train, config in COMBINATIONS
            if name in DRY_RUN
        ),
    ],
)
def test_no_microbatch_synchronizes_the_device_on_any_path(tmp_path, device, train, config):
    # CUDA: torch.cuda.set_sync_debug_mode("error") from each batch's start to the end of its backward (after DDP's
    # bucket rebuild), so any host read of a device value raises; on the CPU the same run, without the sync mode
    config = dataclasses.replace(config, world_size=1, device=device, sync_debug=device == "cuda")
    result = train(config, tmp_path)
    assert max_relative_error(result[0]["params"], reference(config)["params"]) < 1e-5


@CUDA
def test_the_sync_check_catches_a_count_read_back_from_the_device(tmp_path):
    # the counterpart: training_step reads its own CUDA count on the host, once per microbatch
    config = dataclasses.replace(ORACLE, world_size=1, device="cuda", sync_debug=True, read_in_step=True)
    done = fit(config, tmp_path, timeout=240, expect_failure=True)
    assert "called a synchronizing CUDA operation" in done.stdout, done.stdout[-4000:]


@pytest.mark.parametrize(
    ("device", "size", "accumulate"),
    [pytest.param("cuda", "100M", 1, marks=CUDA), pytest.param("cuda", "100M", 4, marks=CUDA), ("cpu", "tiny", 1)],
)
def test_paired_step_times_on_a_transformer_in_bf16_mixed(tmp_path, device, size, accumulate):
    steps, rounds = (20, 3) if device == "cuda" else (3, 1)
    config = Transformer(device, size, accumulate, steps=steps, rounds=rounds)
    (times,) = _run("transformer_worker.py", config, 1, tmp_path, timeout=360)
    ratio = [w / d for w, d in zip(times["ddp_weighted"], times["ddp"], strict=True)]
    control = [c / d for c, d in zip(times["ddp_control"], times["ddp"], strict=True)]
    print(
        f"RESULT {size} transformer, bf16-mixed, A={accumulate}, {device}:"
        f" ddp {statistics.median(times['ddp']) * 1e3:.1f} ms per window;"
        f" ddp_weighted / ddp {statistics.median(ratio):.3f} (rounds {', '.join(f'{r:.3f}' for r in ratio)});"
        f" A-vs-A control {statistics.median(control):.3f} (rounds {', '.join(f'{c:.3f}' for c in control)})"
    )
    assert all(t > 0 for name in times for t in times[name])  # a benchmark, not a timed test: the figures are printed
