"""Launches beyond Lightning's own: two torchrun "nodes", two SLURM tasks, LightningCLI, and the GPU check script.

Every run is checked against the float64 single-process reference (`scenario.reference`), under a hard
timeout and a 30 s process-group timeout, on a free loopback port; leftover processes are killed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from launcher import ROOT, free_port, run
from scenario import Config, max_relative_error, reference

import lightning_weighted

HERE = Path(__file__).parent
CONFIG = Config(accumulate=3, batches=7, epochs=2, mode="tokens")  # uneven counts, a short last window
RUN_TIMEOUT = 180.0  # seconds for a whole 2-process run; a healthy one takes ~10 s
ENV = {"OMP_NUM_THREADS": "1"}


def run_together(commands: list[list[str]], envs: list[dict[str, str]]) -> None:
    """Runs the commands at once (two "nodes"); every process they start is killed once they are done."""
    done = run(commands, RUN_TIMEOUT, env=[{**ENV, **env} for env in envs])
    assert done.returncode == 0, done.stdout[-12000:]


def _worker_arguments(config: Config, out: Path, strategy: str, *, instance: bool = False) -> list[str]:
    arguments = [
        str(HERE / "node_worker.py"),
        "--config",
        json.dumps(dataclasses.asdict(config)),
        "--out",
        str(out),
        "--strategy",
        strategy,
        "--num-nodes",
        "2",
    ]
    return [*arguments, "--instance"] if instance else arguments


def _records(out: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    records = [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(2)]
    launches = [json.loads(Path(f"{out}.env.rank{r}").read_text()) for r in range(2)]
    return records, launches


Launch = tuple[list[list[str]], list[dict[str, str]], Path]  # the commands of one 2-node run, their envs, its out


def torchrun_launch(config: Config, strategy: str, tmp_path: Path) -> Launch:
    """Two `torchrun --nnodes=2 --nproc_per_node=1 --node_rank=K` launches on this machine, one per node."""
    out = tmp_path / f"launch-{os.urandom(6).hex()}"
    port = free_port()
    commands = [
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            "--nproc_per_node=1",
            f"--node_rank={node}",
            "--master_addr=127.0.0.1",
            f"--master_port={port}",
            *_worker_arguments(config, out, strategy),
        ]
        for node in range(2)
    ]
    return commands, [{}, {}], out


def slurm_launch(config: Config, tmp_path: Path) -> Launch:
    """Two processes with the variables `srun` gives two single-task nodes, started directly (no launcher)."""
    out = tmp_path / f"launch-{os.urandom(6).hex()}"
    port = str(free_port())
    job = {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "lw-launch-test",
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_NNODES": "2",
        "SLURM_NODELIST": "127.0.0.1",
        "MASTER_PORT": port,
    }
    envs = [{**job, "SLURM_PROCID": str(rank), "SLURM_NODEID": str(rank), "SLURM_LOCALID": "0"} for rank in range(2)]
    # SLURMEnvironment takes the address from the first host of SLURM_NODELIST
    command = [sys.executable, *_worker_arguments(config, out, "ddp_weighted", instance=True)]
    return [command, command], envs, out


@pytest.fixture(scope="module")
def two_node_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[list[dict[str, Any]], ...]]:
    """The three 2-node launches the tests below check, started side by side (each on its own port): every
    run's records and launch variables."""
    tmp_path = tmp_path_factory.mktemp("launch")
    launches = {
        "torchrun ddp_weighted": torchrun_launch(CONFIG, "ddp_weighted", tmp_path),
        "torchrun ddp": torchrun_launch(CONFIG, "ddp", tmp_path),
        "slurm ddp_weighted": slurm_launch(CONFIG, tmp_path),
    }
    run_together(
        [command for commands, _, _ in launches.values() for command in commands],
        [env for _, envs, _ in launches.values() for env in envs],
    )
    return {name: _records(out) for name, (_, _, out) in launches.items()}


def _assert_two_node_launch(launches: list[dict[str, Any]], environment: str, strategy: str) -> None:
    assert [launch["cluster_environment"] for launch in launches] == [environment] * 2
    assert [launch["strategy"] for launch in launches] == [strategy] * 2
    assert [(launch["global_rank"], launch["node_rank"], launch["local_rank"]) for launch in launches] == [
        (0, 0, 0),
        (1, 1, 0),
    ]
    assert all(launch["world_size"] == 2 and launch["num_nodes"] == 2 for launch in launches)
    assert all(launch["backend"] == "gloo" and launch["timeout_s"] == 30 for launch in launches)


def _assert_matches_reference(records: list[dict[str, Any]], expected: dict[str, Any]) -> None:
    assert max_relative_error(records[0]["params"], expected["params"]) < 1e-5
    assert all(torch.equal(a, b) for a, b in zip(records[0]["params"], records[1]["params"], strict=True))
    assert [step["norm"] for step in records[0]["steps"]] == pytest.approx(expected["norms"], rel=1e-5)


def test_two_torchrun_nodes_train_ddp_weighted_like_the_float64_reference(two_node_runs) -> None:
    records, launches = two_node_runs["torchrun ddp_weighted"]

    _assert_two_node_launch(launches, "TorchElasticEnvironment", "WeightedDDPStrategy")
    _assert_matches_reference(records, reference(CONFIG))


def test_two_torchrun_nodes_with_plain_ddp_miss_the_same_reference(two_node_runs) -> None:
    records, launches = two_node_runs["torchrun ddp"]

    _assert_two_node_launch(launches, "TorchElasticEnvironment", "DDPStrategy")
    # the check above can fail: plain DDP's mean of rank means re-weights the items
    assert max_relative_error(records[0]["params"], reference(CONFIG)["params"]) > 1e-2


def test_two_slurm_tasks_on_two_nodes_train_like_the_float64_reference(two_node_runs) -> None:
    records, launches = two_node_runs["slurm ddp_weighted"]

    _assert_two_node_launch(launches, "SLURMEnvironment", "WeightedDDPStrategy")
    _assert_matches_reference(records, reference(CONFIG))


# ---------------------------------------------------------------------------------------------- LightningCLI


def _load_script(monkeypatch: pytest.MonkeyPatch, path: Path) -> ModuleType:
    """Imports a script as a module registered for this test only (jsonargparse and dataclasses look it up)."""
    name = f"lightning_weighted_{path.stem}_script"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(sys, "path", list(sys.path))  # scripts may extend the path
    spec.loader.exec_module(module)
    return module


def _load_cli_example(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return _load_script(monkeypatch, ROOT / "examples" / "cli.py")


# LightningCLI 2.6 still calls jsonargparse APIs deprecated in jsonargparse 4.49 (to be removed in 5.0).
_JSONARGPARSE_DEPRECATIONS = pytest.mark.filterwarnings(
    "ignore::jsonargparse._deprecated.JsonargparseDeprecationWarning"
)
_CPU = ["--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.logger", "false"]
_CLASS = "lightning_weighted.WeightedDDPStrategy"


@_JSONARGPARSE_DEPRECATIONS
@pytest.mark.parametrize(
    ("arguments", "start_method", "find_unused", "timeout"),
    [
        ([], "popen", False, timedelta(minutes=30)),  # the example's default strategy
        (["--trainer.strategy", "ddp_weighted"], "popen", False, timedelta(minutes=30)),
        (["--trainer.strategy", "ddp_weighted_spawn"], "spawn", False, timedelta(minutes=30)),
        (["--trainer.strategy", "ddp_weighted_find_unused_parameters_true"], "popen", True, timedelta(minutes=30)),
        (
            [
                "--trainer.strategy",
                _CLASS,
                "--trainer.strategy.init_args.find_unused_parameters",
                "true",
                "--trainer.strategy.init_args.timeout",
                "0:00:45",
            ],
            "popen",
            True,
            timedelta(seconds=45),
        ),
        (
            ["--trainer.strategy", _CLASS, "--trainer.strategy.start_method", "fork"],
            "fork",
            False,
            timedelta(minutes=30),
        ),
        (["--trainer.strategy", json.dumps({"class_path": _CLASS})], "popen", False, timedelta(minutes=30)),
    ],
    ids=["default", "name", "spawn-name", "find-unused-name", "class-path-init-args", "class-path-short", "json"],
)
def test_lightning_cli_builds_the_weighted_strategy_from_a_name_or_a_class_path(
    monkeypatch: pytest.MonkeyPatch, arguments: list[str], start_method: str, find_unused: bool, timeout: timedelta
) -> None:
    monkeypatch.setattr(sys, "argv", ["cli.py"])  # LightningCLI warns when both sys.argv and `args` are given
    cli = _load_cli_example(monkeypatch).main(args=[*_CPU, *arguments], run=False)

    strategy = cli.trainer.strategy
    assert type(strategy) is lightning_weighted.WeightedDDPStrategy
    assert strategy._start_method == start_method
    assert strategy._ddp_kwargs.get("find_unused_parameters", False) is find_unused
    assert strategy._timeout == timeout


@_JSONARGPARSE_DEPRECATIONS
def test_lightning_cli_offers_the_strategys_own_arguments_and_ddps_under_its_class_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sys, "argv", ["cli.py"])
    cli = _load_cli_example(monkeypatch).main(
        args=[*_CPU, "--trainer.strategy", _CLASS, "--trainer.strategy.timeout", "0:01:00"], run=False
    )

    offered = cli.config["trainer"]["strategy"]["init_args"]
    own = {
        name: parameter.default
        for name, parameter in inspect.signature(lightning_weighted.WeightedDDPStrategy.__init__).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    }
    assert {name: offered[name] for name in own} == own  # every own argument, with its default
    # DDPStrategy's arguments, and DistributedDataParallel's behind its **kwargs, are seen through *args, **kwargs
    assert offered["timeout"] == timedelta(minutes=1) and offered["start_method"] == "popen"
    assert offered["process_group_backend"] is None and offered["find_unused_parameters"] is False


@_JSONARGPARSE_DEPRECATIONS
def test_lightning_cli_reads_a_bare_class_path_as_a_strategy_name_and_the_trainer_rejects_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Documented in docs/cluster.md and examples/cli.py: give one init arg, or use `class_path:` in a config file.
    monkeypatch.setattr(sys, "argv", ["cli.py"])
    with pytest.raises(ValueError, match=r"invalid strategy name: `strategy='lightning_weighted.weightedddpstrategy'`"):
        _load_cli_example(monkeypatch).main(args=[*_CPU, "--trainer.strategy", _CLASS], run=False)


def test_lightning_cli_fit_on_two_cpu_processes_matches_the_float64_reference(tmp_path: Path) -> None:
    config = {"accumulate": CONFIG.accumulate, "batches": CONFIG.batches, "epochs": CONFIG.epochs, "mode": CONFIG.mode}
    command = [
        sys.executable, str(ROOT / "examples" / "cli.py"), "fit",
        "--model", "scenario.WeightedModule", "--model.config", json.dumps(config),
        "--trainer.accelerator", "cpu", "--trainer.devices", "2",
        "--trainer.strategy", _CLASS, "--trainer.strategy.timeout", "0:00:30",
        "--trainer.max_epochs", str(CONFIG.epochs), "--trainer.accumulate_grad_batches", str(CONFIG.accumulate),
        "--trainer.use_distributed_sampler", "false", "--trainer.limit_val_batches", "0",
        "--trainer.num_sanity_val_steps", "0", "--trainer.logger", "false",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--trainer.default_root_dir", str(tmp_path),
    ]  # fmt: skip
    done = run(command, RUN_TIMEOUT, env=ENV)  # `scenario` is importable: the launcher's PYTHONPATH
    assert done.returncode == 0, done.stdout[-8000:]

    checkpoints = sorted((tmp_path / "checkpoints").glob("*.ckpt"))
    assert len(checkpoints) == 1, checkpoints
    state = torch.load(checkpoints[0], weights_only=False)["state_dict"]
    params = [tensor for key, tensor in state.items() if key.startswith("model.")]  # WeightedModule.model
    saved = (tmp_path / "config.yaml").read_text()
    assert f"class_path: {_CLASS}" in saved and "timeout: 0:00:30" in saved
    assert max_relative_error(params, reference(CONFIG)["params"]) < 1e-5


# ------------------------------------------------------------------------------------------------- GPU check


def test_gpu_check_prints_skip_and_exits_zero_without_cuda() -> None:
    # the check itself is tests/gpu (its CPU dry run runs with the suite); without a GPU the script says so
    done = run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], 120, env={"CUDA_VISIBLE_DEVICES": ""})

    assert done.returncode == 0, done.stdout
    assert done.stdout.splitlines()[-1].startswith("SKIP gpu_check: no CUDA device"), done.stdout
    assert "FAIL" not in done.stdout and "Traceback" not in done.stdout, done.stdout
