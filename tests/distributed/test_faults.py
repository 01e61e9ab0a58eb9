"""Faults on one rank end every rank with an error within the process-group timeout, and nothing hangs.

Every rank is a process of its own, as under the default popen launcher, with a 10 s process-group timeout; T is the
bound of the fault catalogue: timeout + 10 s from the moment the fault strikes until every rank has exited.
"""

from __future__ import annotations

import re
import time

import pytest
from harness import run_worker
from scenario import Config

PG_TIMEOUT = 10.0
T = PG_TIMEOUT + 10.0
TIMES: dict[str, float] = {}


def _inject(tmp_path, kind: str, batch_idx: int = 2, *extra: float, accumulate: int = 3):
    config = Config(
        strategy="ddp_weighted",
        accumulate=accumulate,
        batches=6,
        pg_timeout=PG_TIMEOUT,
        fault=[kind, 1, batch_idx, *extra],
    )
    started = time.time()
    _, done = run_worker("worker.py", config, tmp_path, timeout=120, check_leftovers=True)
    struck = re.search(r"FAULT \S+ (\d+\.\d+)", done.stdout)
    assert struck, done.stdout[-3000:]
    elapsed = done.ended - float(struck.group(1))  # type: ignore[attr-defined]
    TIMES[f"{kind}@{batch_idx}"] = elapsed
    assert done.returncode != 0, done.stdout[-3000:]
    assert not done.left_alive  # type: ignore[attr-defined]
    assert 0 <= elapsed <= T, f"{elapsed:.1f}s after the fault (started {struck.group(1)} vs {started:.3f})"
    return done


pytestmark = pytest.mark.slow


@pytest.mark.parametrize("batch_idx", [0, 1, 2])  # first, middle and last microbatch of the first window
def test_an_exception_on_one_rank_ends_every_rank(tmp_path, batch_idx):
    done = _inject(tmp_path, "raise", batch_idx)
    assert "injected raise on rank 1" in done.stdout


@pytest.mark.parametrize("kind", ["exit", "kill"])
def test_a_rank_dying_before_the_count_reduction_ends_every_rank(tmp_path, kind):
    _inject(tmp_path, kind, 2)


@pytest.mark.parametrize("kind", ["exit_after_count", "kill_after_count"])
def test_a_rank_dying_between_the_count_reduction_and_the_backward_ends_every_rank(tmp_path, kind):
    _inject(tmp_path, kind, 2)


def test_an_exception_in_the_optimizer_step_ends_every_rank(tmp_path):
    done = _inject(tmp_path, "raise_in_step", 2)
    assert "injected raise_in_step on rank 1" in done.stdout


def test_a_rank_stalling_past_the_process_group_timeout_makes_its_peer_time_out(tmp_path):
    done = _inject(tmp_path, "stall", 2, PG_TIMEOUT + 3, accumulate=1)
    assert re.search(r"[Tt]imed out|timeout|Connection closed", done.stdout), done.stdout[-3000:]


def test_sigterm_on_one_rank_ends_every_rank_within_the_timeout(tmp_path):
    # Lightning's SIGTERM notifier broadcasts from inside the signal handler of the signalled rank alone; the
    # unmatched collective is ended by the process-group timeout on every rank (as it is with plain "ddp")
    done = _inject(tmp_path, "sigterm", 1, accumulate=1)
    assert "Received SIGTERM: 15" in done.stdout, done.stdout[-3000:]


@pytest.mark.parametrize(
    ("kind", "error"),
    [
        ("none", "RuntimeError: on rank 1, training_step returned None instead of a loss"),
        ("nograd", "RuntimeError: on rank 1, training_step returned a loss that is not attached to the graph"),
    ],
)
def test_a_bad_return_on_one_rank_is_the_same_clear_error_on_every_rank(tmp_path, kind, error):
    done = _inject(tmp_path, kind, 1)
    assert done.stdout.count(error) == 2, done.stdout[-3000:]


def test_time_to_failure_report(capsys):
    if not TIMES:
        pytest.skip("run with the fault tests above")
    with capsys.disabled():
        ordered = sorted(TIMES.values())
        print(
            f"\ntime to failure over {len(ordered)} faults: median {ordered[len(ordered) // 2]:.1f}s,"
            f" max {ordered[-1]:.1f}s (bound {T:.0f}s): " + ", ".join(f"{k} {v:.1f}s" for k, v in TIMES.items())
        )
    assert max(ordered) <= T
