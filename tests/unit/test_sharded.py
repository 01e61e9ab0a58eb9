"""The sharded strategies' surface and `reduce/sharded.py` on one in-process rank (no extra processes)."""

from __future__ import annotations

import importlib
import math
import pickle

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn

import lightning_weighted
from lightning_weighted import ShardedReduceState, WeightedFSDPStrategy, WeightedModelParallelStrategy
from lightning_weighted.reduce.sharded import data_parallel_group, divide_gradients, reduce_with_sum

NAMES = {"fsdp2_weighted": WeightedModelParallelStrategy, "fsdp_weighted": WeightedFSDPStrategy}


def test_import_registers_the_sharded_names_and_reimport_changes_nothing():
    before = {name: StrategyRegistry[name] for name in NAMES}
    importlib.reload(lightning_weighted)
    for name, cls in NAMES.items():
        assert StrategyRegistry[name]["strategy"].__name__ == cls.__name__
        assert StrategyRegistry[name]["init_params"] == before[name]["init_params"] == {}


@pytest.mark.parametrize("name", sorted(NAMES))
def test_trainer_builds_each_sharded_strategy_from_its_name_on_cpu(name):
    trainer = Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
    assert type(trainer.strategy).__name__ == NAMES[name].__name__  # Lightning's own "fsdp" refuses the CPU


@pytest.mark.parametrize(
    ("sharding", "extra"), [("NO_SHARD", {}), ("HYBRID_SHARD", {"device_mesh": (1, 2)})], ids=["no-shard", "hybrid"]
)
def test_fsdp1_sharding_strategies_that_take_no_weighted_reduction_are_refused(sharding, extra):
    with pytest.raises(ValueError, match=rf"`sharding_strategy='{sharding}'` does not shard.*'FULL_SHARD'"):
        WeightedFSDPStrategy(sharding_strategy=sharding, **extra)


def test_the_reduce_state_pickles_without_its_group_and_wants_a_payload_before_counts():
    state = pickle.loads(pickle.dumps(ShardedReduceState()))
    assert state.process_group is None and state.empty is False
    with pytest.raises(RuntimeError, match=r"call `ShardedReduceState\.begin_window` before the backward"):
        state.counts()


@pytest.fixture
def one_rank():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _sharded(policy: object = None, root: bool = True) -> nn.Sequential:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    mesh = init_device_mesh("cpu", (1,))
    kwargs = {"mesh": mesh, "mp_policy": policy or MixedPrecisionPolicy()}
    fully_shard(model[0], **kwargs)
    if root:
        fully_shard(model, **kwargs)
    return model


def test_a_model_without_fsdp2_modules_or_with_unsharded_parameters_is_refused(one_rank):
    with pytest.raises(ValueError, match=r"Sequential holds no FSDP2 module: apply .*fully_shard"):
        reduce_with_sum(nn.Sequential(nn.Linear(2, 2)), ShardedReduceState())
    with pytest.raises(ValueError, match=r"2 trainable parameters are not sharded by FSDP2 \(first: '2.weight'\)"):
        reduce_with_sum(_sharded(root=False), ShardedReduceState())


def test_a_float16_policy_is_refused_with_the_fix(one_rank):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"module '\(the root\)' computes or reduces .* float16.*bfloat16 or float32"):
        reduce_with_sum(_sharded(policy), ShardedReduceState())


def test_on_one_rank_gradients_are_item_sums_and_an_empty_microbatch_contributes_exact_zeros(one_rank):
    # one rank: FSDP2 copies instead of reduce-scattering, and its all-reduce hook zeroes the empty microbatch
    model, state = _sharded(), ShardedReduceState()
    reduce_with_sum(model, state)
    reference = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    for param, whole in zip(reference.parameters(), model.parameters(), strict=True):
        param.data.copy_(whole.full_tensor())
    x = torch.randn(5, 3)
    model(x).sum().backward()  # an item sum over 5 items: no division by the world size or anything else
    reference(x).sum().backward()
    for param, whole in zip(reference.parameters(), model.parameters(), strict=True):
        assert torch.equal(whole.grad.full_tensor(), param.grad)
    state.empty = True
    (model(x).sum() * math.nan).backward()  # a fully masked mean: 0/0
    state.empty = False
    for param, whole in zip(reference.parameters(), model.parameters(), strict=True):
        assert torch.equal(whole.grad.full_tensor(), param.grad)  # unchanged: it accumulated exact zeros
    divide_gradients(model.parameters(), 4.0)
    for param, whole in zip(reference.parameters(), model.parameters(), strict=True):
        assert torch.equal(whole.grad.full_tensor(), param.grad / 4.0)


def test_the_data_parallel_group_of_a_mesh_spans_its_data_dimensions(one_rank):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    assert dist.get_world_size(data_parallel_group(mesh)) == 1
    hsdp = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    assert dist.get_world_size(data_parallel_group(hsdp, ("replicate", "shard"))) == 1
