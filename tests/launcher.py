"""The test suite's one process launcher: whole commands, or the ranks of a training script forked ready-imported.

- :func:`run` runs any command in its own session: the examples, ``torchrun``, SLURM-style launches, the CLI.
- :func:`ranks` starts every rank of a training script as a fork of one process that has already imported torch,
  Lightning and ``lightning_weighted`` (the zygote, started once per test session), with the variables Lightning's
  own launcher gives each rank (``LOCAL_RANK``, ``NODE_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``):
  the Trainer sees processes created outside it and launches none, as under ``torchrun``. Every rank is its own
  process, as with the default ``"ddp"`` launcher, and a run costs its training, not its imports (~3.5 s each).

Both run under a hard timeout: on expiry every process of the run dumps its stacks (``SIGUSR1``, registered with
``faulthandler`` by the rank scripts) and is killed, and the test fails. Run as ``python launcher.py --zygote``,
this file is the zygote.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
PYTHONPATH = os.pathsep.join(str(p) for p in (TESTS, TESTS / "distributed", ROOT / "examples"))
PREIMPORTS = (
    "torch",
    "torchmetrics",
    "lightning.pytorch",
    "lightning.pytorch.loggers",
    "lightning_weighted",
    "scenario",
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Done(subprocess.CompletedProcess[str]):
    """A finished run: ``returncode``, ``stdout`` (every process's output), ``ended`` (when the last one exited)
    and ``left_alive`` (with ``check_leftovers``: whether a process of the run was alive 1 s after that)."""

    def __init__(self, args: Any, returncode: int, stdout: str, ended: float, left_alive: bool = False) -> None:
        super().__init__(args, returncode, stdout, None)
        self.ended, self.left_alive = ended, left_alive


def run(
    command: list[str] | list[list[str]],
    timeout: float,
    env: dict[str, str] | list[dict[str, str]] | None = None,
    check_leftovers: bool = False,
    grace: float = 10.0,
) -> Done:
    """Runs a command (or several at once, each with its own ``env``) on a free loopback port, each in its own
    session; returns when all have exited, or fails the test on a hang.

    Several commands are one run: when one fails the others get ``grace`` seconds to report their own errors (or,
    elastic, to go on without it), then the run ends. Every process of the run, in whatever session (``torchrun``
    starts its workers in their own), carries ``LW_RUN=<token>`` in its environment, which finds them all for the
    stack dump and the final kill.
    """
    commands = command if command and isinstance(command[0], list) else [command]
    envs = env if isinstance(env, list) else [env or {}] * len(commands)
    token = os.urandom(6).hex()
    shared = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, (PYTHONPATH, os.environ.get("PYTHONPATH")))),
        "LW_RUN": token,
    }
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(tempfile.TemporaryFile("w+", errors="replace")) for _ in commands]
        processes = [
            subprocess.Popen(
                list(one), cwd=ROOT, env={**_outside_any_launch(), **shared, **extra}, stdout=log,
                stderr=subprocess.STDOUT, text=True, start_new_session=True,
            )
            for one, extra, log in zip(commands, envs, logs, strict=True)
        ]  # fmt: skip
        deadline, failed_at, hung = time.monotonic() + timeout, None, False
        while any(process.poll() is None for process in processes):
            now = time.monotonic()
            if failed_at is None and any(process.poll() not in (None, 0) for process in processes):
                failed_at = now  # one side failed: give the others a moment to report their own errors
            if now > deadline or (failed_at is not None and now > failed_at + grace):
                hung = now > deadline
                _signal(_processes_of(token), signal.SIGUSR1)  # faulthandler in every rank prints its stacks
                time.sleep(2)
                break
            time.sleep(0.05)
        ended = time.time()
        left_alive = check_leftovers and bool(_wait_alive(lambda: _processes_of(token)))
        _signal(_processes_of(token), signal.SIGKILL)  # nothing outlives its test
        for process in processes:
            process.wait()
        output = ""
        for one, process, log in zip(commands, processes, logs, strict=True):
            log.seek(0)
            header = f"--- {' '.join(one[:6])} (exit {process.returncode})\n" if len(commands) > 1 else ""
            output += header + log.read()
    if hung:
        _fail(f"hang: {commands} did not finish in {timeout}s\n{output[-8000:]}")
    code = next((p.returncode for p in processes if p.returncode != 0), 0)
    return Done(commands if len(commands) > 1 else commands[0], code, output, ended, left_alive)


def _outside_any_launch() -> dict[str, str]:
    """This process's environment without the variables of a launch around it (torchrun, SLURM, Lightning)."""
    return {
        key: value
        for key, value in os.environ.items()
        if key not in _LAUNCH_VARIABLES and not key.startswith(("SLURM_", "TORCHELASTIC_", "PL_"))
    }


_LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def ranks(
    script: Path,
    args: list[str],
    world_size: int,
    timeout: float,
    env: dict[str, str] | None = None,
    check_leftovers: bool = False,
) -> Done:
    """Runs ``script`` on ``world_size`` ranks forked from the zygote; returns when every rank has exited."""
    global _zygote
    if _zygote is None or _zygote.process.poll() is not None:
        _zygote = _Zygote()
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / f"lw-ranks-{os.getpid()}-{os.urandom(4).hex()}"
    _zygote.send(
        {
            "script": str(script),
            "args": args,
            "world_size": world_size,
            "log": str(logs),
            "env": {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), **(env or {})},
        }
    )
    group = int(_zygote.receive(60)["pid"])
    reply = _zygote.receive(timeout)
    if reply is None:  # the hard timeout: every rank dumps its stacks, then the run is killed
        output = _hang(group, lambda: _collect(logs, world_size))
        _zygote.receive(30)  # the zygote reaps the run and reports it
        _fail(f"hang: {script.name} {args} did not finish in {timeout}s\n{output[-8000:]}")
    ended = time.time()
    left_alive = check_leftovers and bool(_wait_alive(lambda: _in_group(group)))
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGKILL)
    return Done([str(script), *args], int(reply["status"]), _collect(logs, world_size), ended, left_alive)


class _Zygote:
    """This file run as ``--zygote``, spoken to in JSON lines over its standard input and output."""

    def __init__(self) -> None:
        env = {
            **_outside_any_launch(),
            "PYTHONPATH": os.pathsep.join(filter(None, (PYTHONPATH, os.environ.get("PYTHONPATH")))),
        }
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--zygote"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        self._buffer = b""
        atexit.register(self.process.kill)
        if self.receive(120) != {"ready": True}:
            _fail("the zygote did not start")

    def send(self, message: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write((json.dumps(message) + "\n").encode())
        self.process.stdin.flush()

    def receive(self, timeout: float) -> Any:
        """The next JSON line from the zygote, or ``None`` after ``timeout`` seconds."""
        assert self.process.stdout is not None
        fd, deadline = self.process.stdout.fileno(), time.monotonic() + timeout
        while b"\n" not in self._buffer:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                _fail("the zygote exited")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)


_zygote: _Zygote | None = None


def _collect(logs: Path, world_size: int) -> str:
    parts = []
    for rank in range(world_size):
        path = Path(f"{logs}.rank{rank}")
        if path.exists():
            parts.append(path.read_text(errors="replace"))
            path.unlink()
    return "".join(parts)


def _hang(group: int, output: Any) -> str:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGUSR1)  # faulthandler in every rank prints its stacks
        time.sleep(2)
        os.killpg(group, signal.SIGKILL)
    return str(output())


def _wait_alive(alive: Any) -> list[int]:
    """What ``alive()`` still lists 1 s after a run ended (it must be empty by then)."""
    time.sleep(1.0)
    return list(alive())


def _in_group(group: int) -> list[int]:
    """Running processes of process group ``group`` (zombies, already dead, are not counted)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == group and fields[0] != "Z":
                pids.append(int(stat.parent.name))
    return pids


def _processes_of(token: str) -> list[int]:
    """Running processes whose environment holds ``LW_RUN=<token>``."""
    needle = f"LW_RUN={token}".encode()
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            if needle in (entry / "environ").read_bytes().split(b"\0") and int(entry.name) != os.getpid():
                pids.append(int(entry.name))
    return pids


def _signal(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _fail(message: str) -> None:
    import pytest

    pytest.fail(message)


# ------------------------------------------------------------------------------------------ the exit settle
# A gloo thread that completes a collective takes the GIL once more after waking the waiter, to release the work,
# which holds the Python context of the code that launched it (a backward's bucket all-reduces included). A process
# whose interpreter is finalizing by then aborts ("terminate called without an active exception", exit code -6,
# after training finished; plain "ddp" too). Ranks forked from the zygote end with `os._exit` and never finalize;
# a rank script started by `run` (Lightning's popen launcher, torchrun) registers this settle first.
EXIT_SETTLE_S = 0.05


def settle_at_exit() -> None:
    """Makes this process's exit hand the GIL over first (for :data:`EXIT_SETTLE_S`) while a process group exists."""
    atexit.unregister(_settle)
    atexit.register(_settle)


def _settle() -> None:
    dist = sys.modules.get("torch.distributed")  # a process that never imported it has no group to settle
    if dist is not None and dist.is_available() and dist.is_initialized():
        time.sleep(EXIT_SETTLE_S)


# --------------------------------------------------------------------------------------------------- the zygote


def _zygote_main() -> None:
    import importlib

    for name in PREIMPORTS:
        importlib.import_module(name)
    requests = os.fdopen(os.dup(0), "r")
    replies = os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(devnull, fd)

    def reply(message: dict[str, Any]) -> None:
        os.write(replies, (json.dumps(message) + "\n").encode())

    reply({"ready": True})
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            requests.close()
            os.close(replies)
            os._exit(_supervise(request))
        reply({"pid": pid})
        _, status = os.waitpid(pid, 0)
        reply({"status": os.waitstatus_to_exitcode(status)})


def _supervise(request: dict[str, Any]) -> int:
    """Forks every rank in a new session (its process group is the run's), waits for all; the worst exit status."""
    os.setsid()
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # the stack-dump signal is for the ranks
    pids = []
    for rank in range(int(request["world_size"])):
        pid = os.fork()
        if pid == 0:
            _rank(request, rank)  # never returns
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    return next((code for code in codes if code != 0), 0) % 256


def _rank(request: dict[str, Any], rank: int) -> None:
    import runpy

    log = os.open(f"{request['log']}.rank{rank}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for fd in (1, 2):
        os.dup2(log, fd)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    os.environ.update(request["env"])
    os.environ.update(
        {"LOCAL_RANK": str(rank), "NODE_RANK": "0", "WORLD_SIZE": str(request["world_size"]), "PYTHONUNBUFFERED": "1"}
    )
    sys.argv = [request["script"], *request["args"]]
    code = 0
    try:
        runpy.run_path(request["script"], run_name="__main__")
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__" and sys.argv[1:] == ["--zygote"]:
    _zygote_main()
