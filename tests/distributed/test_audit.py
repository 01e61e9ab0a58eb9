"""`ObjectiveAudit` on 2 gloo ranks: it flags plain DDP's mean of means and passes `ddp_weighted`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from audit_worker import Config
from harness import fit


def audited(config: Config, tmp_path: Path, expect_failure: bool = False) -> Any:
    if expect_failure:
        return fit(config, tmp_path, timeout=120, expect_failure=True, script="audit_worker.py").stdout
    records, output = fit(config, tmp_path, timeout=120, output=True, script="audit_worker.py")
    assert records[0]["reports"] == records[1]["reports"]  # every rank reaches the same verdict
    return records[0], output


@pytest.mark.parametrize("bare", [False, True], ids=["count", "batch-size"])
def test_the_audit_flags_plain_ddp_on_the_worked_trace_as_two_where_two_and_a_half_is_intended(tmp_path, bare):
    record, output = audited(Config(strategy="ddp", bare=bare), tmp_path)
    (report,) = record["reports"]
    # DDP: (1 + 3) / 2 = 2; global item mean: (2 · 1 + 6 · 3) / 8 = 2.5; |2 − 2.5| / 2.5 = 0.2
    assert (report["norm"], report["expected_norm"]) == (pytest.approx(2.0), pytest.approx(2.5))
    assert report["objective_error"] == pytest.approx(0.2)
    # max_r P · n_r / N = 2 · 6 / 8
    assert (report["imbalance"], report["counts"], report["replica_error"]) == (1.5, (2.0, 6.0), 0.0)
    assert report["passed"] is False
    assert record["w"] == pytest.approx(9.8)  # the audit observes; the run trains as it would without it
    assert "relative error of 0.2 (rtol=0.001)" in output and "strategy='ddp_weighted'" in output


def test_the_audit_passes_ddp_weighted_on_the_worked_trace(tmp_path):
    record, output = audited(Config(strategy="ddp_weighted"), tmp_path)
    (report,) = record["reports"]
    assert report["objective_error"] < 1e-6 and report["passed"] is True
    assert (report["norm"], report["expected_norm"]) == (pytest.approx(2.5), pytest.approx(2.5))
    assert record["w"] == pytest.approx(9.75)
    assert "relative error" not in output  # no warning


@pytest.mark.parametrize(("strategy", "first_error"), [("ddp", 0.11607), ("ddp_weighted", 0.0)])
def test_the_audit_replays_whole_accumulation_windows_on_every_nth_step(tmp_path, strategy, first_error):
    record, _ = audited(Config(strategy=strategy, accumulate=2, steps=3, every=2), tmp_path)
    assert [r["step"] for r in record["reports"]] == [0, 2]
    first = record["reports"][0]
    # rank 0: [9, 9], [8] -> 2 · 1 + 1 · 2 = 4; rank 1: [7] * 6, [7, 7] -> 8 · 3 = 24; g* = 28 / 11
    # DDP with A = 2: ((1 + 2) / 2 + (3 + 3) / 2) / 2 = 2.25; |2.25 − 28/11| / (28/11) = 0.11607
    assert first["expected_norm"] == pytest.approx(28 / 11)
    assert first["counts"] == (3.0, 8.0)
    assert first["objective_error"] == pytest.approx(first_error, abs=1e-6, rel=1e-4)
    assert all(r["passed"] is (strategy == "ddp_weighted") for r in record["reports"])


def test_a_batch_replayed_by_a_rank_out_of_data_counts_zero_in_the_audit_as_in_training(tmp_path):
    record, _ = audited(Config(strategy="ddp_weighted", steps=2, short=True), tmp_path)
    first, second = record["reports"]
    assert first["counts"] == (2.0, 6.0) and second["counts"] == (0.0, 6.0)
    # step 2 holds rank 1's [7] * 6 only: g* = w − 7 at w = 9.75
    assert second["expected_norm"] == pytest.approx(2.75)
    assert all(r["objective_error"] < 1e-6 and r["passed"] for r in record["reports"])


def test_counts_supplied_by_an_item_counter_are_the_ones_the_audit_weighs(tmp_path):
    # the counter counts each microbatch as its first target: n = 9 and 7, g* = (9 · 1 + 7 · 3) / 16
    record, _ = audited(Config(strategy="ddp_weighted", bare=True, counter=True), tmp_path)
    (report,) = record["reports"]
    assert report["counts"] == (9.0, 7.0)
    assert report["expected_norm"] == pytest.approx(30 / 16) and report["norm"] == pytest.approx(30 / 16)
    assert report["objective_error"] < 1e-6 and report["passed"] is True


def test_the_audit_reports_replicas_whose_gradients_disagree(tmp_path):
    # a callback adds 1 to rank 1's gradient: rank 1 holds 3.5 where rank 0 holds the correct 2.5
    record, output = audited(Config(strategy="ddp_weighted", corrupt=True), tmp_path)
    (report,) = record["reports"]
    assert report["replica_error"] > 0.1 and report["passed"] is False
    assert report["objective_error"] == pytest.approx(0.4)  # |3.5 − 2.5| / 2.5 on rank 1
    assert "the replicas disagree" in output


def test_raise_mode_stops_every_rank_with_the_error_and_the_fix(tmp_path):
    output = audited(Config(strategy="ddp", on_mismatch="raise"), tmp_path, expect_failure=True)
    assert "ObjectiveMismatchError: ObjectiveAudit at step 0:" in output
    assert "relative error of 0.2" in output and "strategy='ddp_weighted'" in output
