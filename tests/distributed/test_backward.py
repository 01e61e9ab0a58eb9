"""An empty microbatch and a replay backpropagate through their own graph: collectives in the model's backward
(SyncBatchNorm's shape, ``all_gather(..., sync_grads=True)``) stay matched and sparse gradients stay sparse, on every
engine, Trainer and Fabric, against the float64 reference; plain ``"ddp"`` trains the same model on even lengths and
misses it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from backward_worker import BackwardConfig, Coupled, reference
from harness import run_worker
from scenario import is_finite, max_relative_error


def train(config: BackwardConfig, tmp_path: Path, expect_failure: bool = False) -> Any:
    out, done = run_worker("backward_worker.py", config, tmp_path, timeout=120)
    assert (done.returncode != 0) == expect_failure, done.stdout[-8000:]
    if expect_failure:
        return done
    return [torch.load(f"{out}.rank{r}", weights_only=False)["params"] for r in range(config.world_size)]


@pytest.mark.parametrize(
    ("strategy", "sparse", "float64", "counter"),
    [
        ("ddp_weighted", True, True, False),
        ("ddp_weighted", True, True, True),  # counted ahead by an ItemCounter
        ("fsdp2_weighted", False, True, False),  # FSDP1 and FSDP2 refuse sparse gradients
        ("fsdp_weighted", False, False, False),  # FSDP1 keeps float32 parameters
        ("fabric_ddp_weighted", True, True, False),
        ("fabric_fsdp2_weighted", False, True, False),
    ],
)
def test_an_empty_microbatch_and_a_replay_run_their_backward_collectives_and_add_nothing(
    tmp_path, strategy, sparse, float64, counter
):
    # rank 0 holds 3 microbatches, rank 1 holds 4 (rank 0 replays its last one, counted 0, in the second window);
    # rank 0's microbatch 1 has every token masked (counted 0 on the host). Both run their backward through the
    # centring all-reduce and the gathered term, which the other rank's backward waits in, and their own loss adds
    # nothing; what the other rank's loss sends through their rows stays, as in the reference.
    config = BackwardConfig(strategy=strategy, sparse=sparse, float64=float64, counter=counter)
    ranks = train(config, tmp_path)
    expected = reference(config)
    for params in ranks:
        assert is_finite(params)
        assert max_relative_error(params, expected) < (1e-12 if float64 else 1e-5)
    if sparse:  # its sparse rows trained (compared with the reference above too)
        assert not torch.equal(ranks[0][2], Coupled(sparse=True).embed.weight.to(ranks[0][2].dtype))


def test_plain_ddp_trains_the_model_on_even_lengths_and_misses_the_item_mean(tmp_path):
    # the control: the same collectives and sparse gradients, 4 microbatches on each rank, no replay
    config = BackwardConfig(strategy="ddp", lengths=(4, 4), sparse=True)
    (params, _) = train(config, tmp_path)
    assert is_finite(params)
    assert max_relative_error(params, reference(config)) > 1e-3


@pytest.mark.parametrize("strategy", ["ddp_weighted", "fsdp2_weighted"])
def test_a_nan_mean_that_a_backward_collective_carries_to_the_peers_is_one_error_on_every_rank(tmp_path, strategy):
    # rank 0's fully masked mean is 0/0: the centring all-reduce of its backward brings NaN to rank 1's gradients
    config = BackwardConfig(strategy=strategy, safe_mean=False, pg_timeout=20)
    done = train(config, tmp_path, expect_failure=True)
    message = "RuntimeError: On 1 rank(s), a microbatch whose count is 0 has a non-finite loss"
    assert done.stdout.count(message) == 2, done.stdout[-4000:]
    assert "divide by `n.clamp(min=1)` (`max(n, 1)`)" in done.stdout
