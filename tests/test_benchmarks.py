"""Smoke test of the benchmark harness: a tiny grid, few rounds, as a subprocess under a hard timeout.

Asserts what the benchmark must never get wrong (the correctness columns, the collectives each variant adds), not
timings: no variant may look fast because it is wrong.
"""

from __future__ import annotations

import json
import shutil
import sys
from typing import Any

import pytest
from launcher import ROOT, run

WEIGHTED = ("ddp_weighted", "ddp_weighted_after", "post_hoc", "pre_count")
CARRIER = "ddp_weighted_carrier"  # the carrier ablation: counts ahead, the payload in DDP's bucket (raw levels only)
PAYLOAD_BYTES = 8 * 10  # the window's payload: 10 float64 values (`lightning_weighted.counts.WIDTH`)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench")
    command = [
        sys.executable,
        str(ROOT / "benchmarks" / "run.py"),
        "--quick",
        "--out",
        str(out),
        "--levels",
        "raw,sweep,ablation,trainer,sharded",
        "--timeout",
        "90",
        "--pg-timeout",
        "30",
    ]
    done = run(command, timeout=200, env={"PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0, done.stdout[-6000:]
    assert (out / "RESULTS.md").exists() and (out / "results.png").stat().st_size > 0
    data: dict[str, Any] = json.loads((out / "results.json").read_text())
    return data


def entries(data: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(level, entry) for level in ("raw", "sweep", "trainer") for entry in data[level]]


def weighted_at(level: str) -> tuple[str, ...]:
    return (*WEIGHTED, CARRIER) if level in ("raw", "sweep") else WEIGHTED


def test_every_level_ran_with_the_control(results: dict[str, Any]) -> None:
    assert results["raw"] and results["sweep"] and results["trainer"] and results["ablation"]
    for level, entry in entries(results):
        assert {"ddp", "ddp_control", *weighted_at(level)} <= set(entry["ratio"])
        assert entry["ratio"]["ddp"]["median"] == 1.0
    for entry in results["ablation"]:
        assert {"ddp", "ddp_control", "scale_only", "carrier_fixed", CARRIER, "ddp_weighted"} <= set(entry["ratio"])


def test_weighted_variants_match_the_float64_reference(results: dict[str, Any]) -> None:
    for level, entry in entries(results):
        for name in weighted_at(level):
            # fp32 over a few SGD steps: rounding only (measured ~1e-6)
            assert entry["deviation"][name] < 1e-4, (level, entry["point"], name, entry["deviation"])
            assert entry["gradient_deviation"][name] < 1e-5, (level, entry["point"], name)


def test_plain_ddp_is_measurably_wrong(results: dict[str, Any]) -> None:
    for level, entry in entries(results):
        # rank means averaged over uneven counts: the update is off by a large fraction (measured ~0.6-0.9)
        assert entry["deviation"]["ddp"] > 0.3, (level, entry["point"], entry["deviation"])
        assert entry["gradient_deviation"]["ddp"] > 0.3, (level, entry["point"])


def test_ddp_weighted_adds_one_payload_all_reduce_per_step_and_no_comm_hook(results: dict[str, Any]) -> None:
    for level in ("raw", "trainer"):
        for entry in results[level]:
            plain = entry["collectives"]["ddp"]
            for name in ("ddp_weighted", "ddp_weighted_after"):  # counts ahead, and counts after
                ours = entry["collectives"][name]
                # no comm hook: DDP's C++ reducer reduces the same buckets as plain DDP's, no Python in between
                assert ours["gradient_calls"] == 0, (level, name, ours)
                assert entry["buckets"][name] == entry["buckets"]["ddp"], (level, name, entry["buckets"])
                # beyond plain DDP (Lightning's SIGTERM flag): exactly the window's payload, one float64 all-reduce
                assert ours["other_calls"] == plain["other_calls"] + 1, (level, name, ours, plain)
                assert ours["other_bytes"] == plain["other_bytes"] + PAYLOAD_BYTES, (level, name, ours, plain)
                assert set(ours["kinds"]) == {*plain["kinds"], "all_reduce[float64]"}, (level, name, ours)
    for entry in results["raw"]:
        carrier, plain = entry["collectives"][CARRIER], entry["collectives"]["ddp"]
        # the carrier ablation adds no collective: the payload rides in DDP's bucket, as one parameter's gradient
        assert carrier["gradient_calls"] == 0 and carrier["other_calls"] == plain["other_calls"] == 0, carrier
        (buckets, size), (plain_buckets, plain_size) = entry["buckets"][CARRIER], entry["buckets"]["ddp"]
        assert (buckets, size) == (plain_buckets, plain_size + 64)  # its 7 fp32 values, padded to 64 bytes


SHARDED = {  # each weighted strategy (counts after, counts ahead) and its plain counterpart
    "fsdp2_weighted": "fsdp2",
    "fsdp2_weighted_ahead": "fsdp2",
    "fsdp_weighted": "fsdp",
    "fsdp_weighted_ahead": "fsdp",
}


def test_sharded_strategies_match_the_float64_reference_and_their_plain_counterparts_do_not(
    results: dict[str, Any],
) -> None:
    assert results["sharded"]
    for entry in results["sharded"]:
        for weighted, plain in SHARDED.items():
            assert entry["deviation"][weighted] < 1e-4, (entry["point"], entry["deviation"])  # measured ~1e-6
            assert entry["gradient_deviation"][weighted] < 1e-5, (entry["point"], entry["gradient_deviation"])
            assert entry["deviation"][plain] > 0.3 and entry["gradient_deviation"][plain] > 0.3  # measured ~0.9
            assert {"median", "p10", "p90"} <= set(entry["ratio"][weighted])  # paired with the plain one


def test_sharded_strategies_add_one_small_count_all_reduce_per_step_to_their_plain_counterparts(
    results: dict[str, Any],
) -> None:
    for entry in results["sharded"]:
        for weighted, plain in SHARDED.items():
            ours, theirs = entry["collectives"][weighted], entry["collectives"][plain]
            extra = {kind: value for kind, value in ours.items() if theirs.get(kind) != value}
            # counts after and counts ahead alike: the window's 10-value float64 payload, once per step
            assert extra == {"all_reduce[float64]": [1, PAYLOAD_BYTES]}, (entry["point"], weighted, ours, theirs)
            assert set(theirs) <= set(ours)


def test_the_one_rank_overhead_table_has_a_cell_per_variant_and_point() -> None:
    command = [sys.executable, str(ROOT / "benchmarks" / "overhead.py"), "--sizes", "tiny", "--steps", "30"]
    done = run(command, timeout=120, env={"PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0, done.stdout[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| tiny A=")]
    assert [row.split(" (")[0] for row in rows] == ["| tiny A=1", "| tiny A=4"], done.stdout
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert len(cells) == 2 + 8 and all(cell.replace(" ", "") for cell in cells), row  # plain, then 8 variants
        assert float(cells[1]) > 0  # plain DDP's step, µs


@pytest.mark.skipif(not (shutil.which("valgrind") and shutil.which("cc")), reason="needs valgrind and cc")
@pytest.mark.timeout(900)  # a whole Lightning fit under callgrind, per variant: minutes on a slow machine
def test_callgrind_counts_what_the_weighting_executes_beyond_plain_ddp_in_raw_steps_and_fits() -> None:
    script = [sys.executable, str(ROOT / "benchmarks" / "instructions.py"), "--sizes", "tiny", "--accumulate", "1"]
    script += ["--steps", "3"]
    raw = [*script, "--variants", "ddp_control,ddp_weighted", "--level", "raw"]  # one process
    fits = [*script, "--variants", "ddp_weighted", "--level", "trainer"]  # one process per variant
    done = run([raw, fits], timeout=840, env={"PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0, done.stdout[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| tiny A=1 |")]
    assert len(rows) == 2, done.stdout[-3000:]  # one per level
    beyond = {}
    for row in rows:
        plain, *cells = (cell.strip() for cell in row.strip("|").split("|")[1:])
        assert float(plain) > 0
        beyond[len(cells)] = [float(cell.split("(")[1].rstrip(")")) for cell in cells], float(plain)
    (control, weighted), plain = beyond[2]
    # a second plain DDP executes what the first does, to within the allocator's state; the weighting far more
    assert abs(control) < 0.02 * plain and weighted > 10 * abs(control), rows
    (fit,), plain = beyond[1]
    assert fit > 0.01 * plain, rows  # through the Trainer too


def test_the_median_interval_covers_the_median_narrows_with_rounds_and_decides_the_verdict(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import random

    from common import summary
    from report import verdict

    draw = random.Random(0)
    few = summary([1.0 + draw.gauss(0, 0.3) for _ in range(100)])
    many = summary([1.0 + draw.gauss(0, 0.3) for _ in range(10_000)])
    for stats in (few, many):
        assert stats["ci_low"] < stats["median"] < stats["ci_high"]
        assert stats["ci_low"] < 1.0 < stats["ci_high"]  # the true median, 1.0
    assert many["ci_high"] - many["ci_low"] < (few["ci_high"] - few["ci_low"]) / 5
    assert verdict(many, 1.03) == "met"
    assert verdict(many, 0.97) == "missed"
    assert verdict(few, 1.0) == "not resolved"
