"""Runs a worker script on several ranks under a hard timeout, with tracebacks of every process on a hang."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from scenario import Config

HERE = Path(__file__).parent
ROOT = HERE.parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run(
    command: list[str], timeout: float, env: dict[str, str] | None = None, check_leftovers: bool = False
) -> subprocess.CompletedProcess[str]:
    """Runs `command` in its own session; on timeout dumps every process's traceback, kills them all, fails.

    The returned process carries `ended`: the time at which every rank had closed its output (had exited), and
    `left_alive`: with `check_leftovers`, whether any process of the session was still alive 1 s after that.
    """
    full_env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONUNBUFFERED": "1"}
    full_env.update(env or {})
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    left_alive = False
    try:
        output, _ = process.communicate(timeout=timeout)
        ended = time.time()
        if check_leftovers:
            time.sleep(1.0)
            left_alive = bool(_alive_in_group(process.pid))
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGUSR1)  # faulthandler in every rank prints its stacks
        time.sleep(2)
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"hang: {command} did not finish in {timeout}s\n{output[-8000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # no rank outlives its test
    done = subprocess.CompletedProcess(command, process.returncode, output, None)
    done.ended, done.left_alive = ended, left_alive  # type: ignore[attr-defined]
    return done


def _alive_in_group(pgid: int) -> list[int]:
    """Processes of group `pgid` that are still running (zombies, already dead, are not counted)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                alive.append(int(stat.parent.name))
    return alive


def run_worker(
    script: str, config: Any, tmp_path: Path, timeout: float
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """Runs a worker script of this folder on `config` (a dataclass); returns its output prefix and the process."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / f"{Path(script).stem}-{config.strategy}-{os.urandom(4).hex()}"
    config_json = json.dumps(dataclasses.asdict(config))
    command = [sys.executable, str(HERE / script), "--config", config_json, "--out", str(out)]
    return out, run(command, timeout)


def fit(
    config: Config, tmp_path: Path, timeout: float = 180, expect_failure: bool | None = False, output: bool = False
) -> Any:
    """Trains `config` on its ranks; returns each rank's record, or the finished process when it must fail.

    With `expect_failure=None` either may happen: the records when every rank saved one, else the process.
    With `output=True` a successful run returns `(records, output)`.
    """
    out, done = run_worker("worker.py", config, tmp_path, timeout)
    if expect_failure is None:
        if done.returncode == 0 and all(Path(f"{out}.rank{r}").exists() for r in range(config.world_size)):
            return [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(config.world_size)]
        return done
    if expect_failure:
        assert done.returncode != 0, done.stdout[-4000:]
        return done
    assert done.returncode == 0, done.stdout[-8000:]
    records = [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(config.world_size)]
    return (records, done.stdout) if output else records
