"""The synchronized update equals the float64 single-process gradient of the global item mean."""

from __future__ import annotations

import pytest
import torch
from harness import fit
from scenario import Config, max_relative_error, reference


@pytest.mark.parametrize(
    ("accumulate", "precision", "rtol"), [(1, "32-true", 1e-5), (3, "32-true", 1e-5), (3, "64-true", 1e-10)]
)
def test_ddp_weighted_matches_the_float64_reference_and_ddp_does_not(tmp_path, accumulate, precision, rtol):
    # counts returned by training_step: DDP averages, the strategy multiplies the gradients by P·c/N after
    config = Config(
        strategy="ddp_weighted", accumulate=accumulate, batches=7, epochs=2, mode="tokens", precision=precision
    )
    expected = reference(config)
    weighted = fit(config, tmp_path)
    plain = fit(Config(**{**vars(config), "strategy": "ddp"}), tmp_path)

    assert max_relative_error(weighted[0]["params"], expected["params"]) < rtol
    assert all(
        torch.equal(a, b) for a, b in zip(weighted[0]["params"], weighted[1]["params"], strict=False)
    )  # replicas agree
    assert [s["norm"] for s in weighted[0]["steps"]] == pytest.approx(expected["norms"], rel=max(rtol, 1e-6))
    # the same check fails for plain DDP: its mean of means re-weights the items
    assert max_relative_error(plain[0]["params"], expected["params"]) > 1e-2


def test_the_objective_does_not_depend_on_the_number_of_ranks(tmp_path):
    # the same items per optimizer step, held by 3 ranks or merged into 1: both train the float64 reference
    three = Config(strategy="ddp_weighted", world_size=3, accumulate=2, batches=4, epochs=2, mode="weights")
    one = Config(**{**vars(three), "world_size": 1, "merged_from": 3})
    expected = reference(three)
    assert max_relative_error(reference(one)["params"], expected["params"]) < 1e-12  # the same objective
    spread = [fit(config, tmp_path)[0]["params"] for config in (three, one)]
    assert max_relative_error(spread[0], expected["params"]) < 1e-5
    assert max_relative_error(spread[1], expected["params"]) < 1e-5
    assert max_relative_error(spread[0], [p.double() for p in spread[1]]) < 1e-5
