"""The benchmark code on tiny sizes: ``benchmarks/run.py`` as a subprocess under a hard timeout.

Asserts what the benchmark must never get wrong (the correctness columns, the collectives each variant adds, the
tables it prints), not timings: no variant may look fast because it is wrong. The tests that measure cost (one-rank
timing, callgrind) are marked ``cost``.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
from typing import Any

import pytest
from launcher import ROOT, run

RUN = [sys.executable, str(ROOT / "benchmarks" / "run.py")]
PLAIN = {  # each weighted variant and anchor, and the plain counterpart it is checked beside, per level
    "raw": {"ddp_weighted": "ddp", "ddp_weighted_after": "ddp", "post_hoc": "ddp", "pre_count": "ddp"},
    "sharded": {"fsdp2_weighted": "fsdp2", "fsdp2_weighted_ahead": "fsdp2", "fsdp_weighted": "fsdp"},
}
PLAIN["trainer"] = dict(PLAIN["raw"])
PLAIN["raw"] |= {"ddp_weighted_parts1": "ddp", "ddp_weighted_parts4": "ddp"}  # counts ahead, 1 and 4 loss parts
PLAIN["sharded"]["fsdp_weighted_ahead"] = "fsdp"
PAYLOAD = {"all_reduce[float64]": [1, 8 * 6]}  # the window's payload: 6 float64 values summed (`payload.SUMMED`), once


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench")
    done = run([*RUN, "--quick", "--out", str(out), "--timeout", "150", "--pg-timeout", "30"], timeout=400)
    assert done.returncode == 0, done.stdout[-6000:]
    data: dict[str, Any] = json.loads((out / "results.json").read_text())
    data["report"] = (out / "RESULTS.md").read_text()
    return data


@pytest.mark.examples
def test_every_level_ran_every_variant_with_its_control(results: dict[str, Any]) -> None:
    for level, pairs in PLAIN.items():
        assert [entry["point"]["accumulate"] for entry in results[level]] == [1, 2], level
        for entry in results[level]:
            assert {*pairs, *pairs.values()} <= set(entry["ms"]), (level, entry["ms"])
            assert set(pairs) <= set(entry["ratio"]), (level, entry["ratio"])
    for level in ("raw", "trainer"):
        assert all({"ddp_control", "after_to_ahead"} <= set(entry["ratio"]) for entry in results[level])
    assert all("fsdp2_control" in entry["ratio"] for entry in results["sharded"])
    assert 0 < results["probe"]["payload_allreduce_s"] < 1


@pytest.mark.examples
def test_weighted_variants_match_the_float64_reference_and_their_plain_counterparts_do_not(
    results: dict[str, Any],
) -> None:
    for level, pairs in PLAIN.items():
        for entry in results[level]:
            deviation, gradient = entry["deviation"], entry["gradient_deviation"]
            for weighted, plain in pairs.items():
                # fp32 over a few SGD steps: rounding only (measured 1.2e-6 and 1.1e-7 at most)
                assert deviation[weighted] < 1e-4 and gradient[weighted] < 1e-5, (level, weighted, entry["point"])
                # rank means averaged over uneven counts: off by most of the update (measured 0.89-1.1)
                assert deviation[plain] > 0.3 and gradient[plain] > 0.3, (level, plain, entry["point"])


@pytest.mark.examples
def test_the_weighting_adds_one_payload_all_reduce_per_step_and_ddp_reduces_its_own_buckets(
    results: dict[str, Any],
) -> None:
    for level in PLAIN:
        for entry in results[level]:
            calls = entry["collectives"]
            for weighted in ("ddp_weighted", "ddp_weighted_after", *PLAIN["sharded"]):
                if weighted in calls:
                    plain = calls[PLAIN["sharded"].get(weighted, "ddp")]
                    extra = {kind: value for kind, value in calls[weighted].items() if plain.get(kind) != value}
                    assert extra == PAYLOAD and set(plain) <= set(calls[weighted]), (level, weighted, calls)
            if level != "sharded":  # no comm hook: DDP's C++ reducer reduces the same buckets as plain DDP's
                plain, ahead, after = (entry["buckets"][n] for n in ("ddp", "ddp_weighted", "ddp_weighted_after"))
                assert plain[0] > 0 and ahead == after == plain, (level, entry["buckets"])


@pytest.mark.examples
def test_loss_parts_add_no_collective_their_counts_ride_in_the_one_payload_all_reduce(results: dict[str, Any]) -> None:
    for entry in results["raw"]:
        calls, plain = entry["collectives"], entry["collectives"]["ddp"]
        for name, parts in (("ddp_weighted_parts1", 1), ("ddp_weighted_parts4", 4)):
            extra = {kind: value for kind, value in calls[name].items() if plain.get(kind) != value}
            # one all-reduce per step whatever K: 3 shared float64 values and 3 per part in one vector (4 parts: 120 B)
            assert extra == {"all_reduce[float64]": [1, 8 * (3 + 3 * parts)]}, (name, entry["point"], calls)
            assert set(plain) <= set(calls[name]), (name, calls)
            assert entry["buckets"][name] == entry["buckets"]["ddp"], entry["buckets"]  # DDP's own buckets alike


@pytest.mark.examples
def test_the_report_holds_each_level_with_its_tables(results: dict[str, Any]) -> None:
    report = results["report"]
    for title in ("## Raw DDP step", "## Lightning Trainer step", "## Sharded strategies (Trainer)"):
        assert report.count(title) == 1, title
    assert report.count("Final-parameter deviation / first-step gradient deviation") == 3
    assert "| tiny A=2 | ddp_weighted (counts after) | all_reduce[float64] ×1 (48 B) |" in report
    assert "| tiny A=2 | counts ahead, 4 parts | all_reduce[float64] ×1 (120 B) |" in report


@pytest.mark.cost
def test_the_one_rank_overhead_table_has_a_cell_per_variant_and_point() -> None:
    done = run([*RUN, "overhead", "--sizes", "tiny", "--steps", "30"], timeout=180)
    assert done.returncode == 0, done.stdout[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| tiny A=")]
    assert [row.split(" (")[0] for row in rows] == ["| tiny A=1", "| tiny A=4"], done.stdout
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert len(cells) == 2 + 5 and all(cells), row  # the point, plain DDP, then 5 variants
        assert float(cells[1]) > 0  # plain DDP's step, µs


@pytest.mark.cost
@pytest.mark.skipif(not (shutil.which("valgrind") and shutil.which("cc")), reason="needs valgrind and cc")
@pytest.mark.timeout(1450)  # a whole Lightning fit under callgrind, per variant: minutes on a slow machine
def test_callgrind_counts_what_the_weighting_executes_beyond_plain_ddp_in_raw_steps_and_fits() -> None:
    common = [*RUN, "instructions", "--sizes", "tiny", "--accumulate", "1", "--steps", "3"]
    raw = [*common, "--variants", "ddp_control,ddp_weighted", "--level", "raw"]  # one process
    fits = [*common, "--variants", "ddp_weighted", "--level", "trainer"]  # one process per variant
    done = run([raw, fits], timeout=1400)
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


def test_the_parts_rows_control_trains_plain_ddps_update_and_the_weighted_parts_that_of_counts_ahead() -> None:
    # `ddp_parts1/4` (plain DDP on K parts) are the control of the instruction rows of `ddp_weighted_parts1/4`: each
    # must do plain DDP's training and each weighted parts variant that of counts ahead, so that the rows differ by
    # the parts' bookkeeping alone; on one rank the two objectives differ (uneven microbatches), so the check can fail
    code = f"""
import sys, torch
sys.path.insert(0, {str(ROOT / "benchmarks")!r})
from common import Point, one_rank
from steps import build
names = ["ddp", "ddp_parts1", "ddp_parts4", "ddp_weighted", "ddp_weighted_parts1", "ddp_weighted_parts4"]
with one_rank():
    variants = build(Point("tiny", 2, "fp32", 3, 0), names, 0, 1)
    for variant in variants.values():
        for _ in range(3):
            variant.step()
    flat = {{n: torch.cat([p.flatten() for p in v.parameters()]) for n, v in variants.items()}}
    for name in names:
        base = "ddp_weighted" if "weighted" in name else "ddp"
        print(name, float((flat[name] - flat[base]).abs().max()), float((flat[name] - flat["ddp"]).abs().max()))
"""
    done = run([sys.executable, "-c", code], timeout=240)
    assert done.returncode == 0, done.stdout[-3000:]
    lines = [line.split() for line in done.stdout.splitlines() if line.startswith("ddp")]
    rows = {name: [float(value) for value in values] for name, *values in lines}
    assert len(rows) == 6 and {"ddp_parts4", "ddp_weighted_parts4"} <= set(rows), done.stdout
    assert all(to_base < 1e-6 for to_base, _ in rows.values()), rows  # each trains its base's update
    assert rows["ddp_weighted"][1] > 1e-4, rows  # and the two bases differ
