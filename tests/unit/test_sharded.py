"""The sharded strategies' surface and the FSDP2 engine on one in-process rank (no extra processes)."""

from __future__ import annotations

import importlib
import math
import re

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn

import lightning_weighted
from lightning_weighted import WeightedFabricFSDPStrategy, WeightedFSDPStrategy, WeightedModelParallelStrategy
from lightning_weighted.engines.fsdp2 import FSDP2Engine, shard_blocks
from lightning_weighted.loop import multiply_gradients
from lightning_weighted.strategy import data_parallel_group

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


@pytest.mark.parametrize("front", ["trainer", "fabric"])
@pytest.mark.parametrize(
    ("sharding", "extra", "fix"),
    [
        ("NO_SHARD", {}, r"replicates the model.*Use `strategy='ddp_weighted'` for replicated training"),
        ("HYBRID_SHARD", {"device_mesh": (1, 2)}, r"is hybrid, and FSDP1 takes no communication hook.*'FULL_SHARD'"),
    ],
    ids=["no-shard", "hybrid"],
)
def test_fsdp1_sharding_strategies_that_take_no_weighted_reduction_are_refused_with_their_own_fix(
    front, sharding, extra, fix
):
    strategy = WeightedFSDPStrategy if front == "trainer" else WeightedFabricFSDPStrategy
    with pytest.raises(ValueError, match=rf"`sharding_strategy='{sharding}'` {fix}") as refused:
        strategy(sharding_strategy=sharding, **extra)
    assert "NO_SHARD" not in str(refused.value) or sharding == "NO_SHARD"


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
        FSDP2Engine(nn.Sequential(nn.Linear(2, 2)), None)
    with pytest.raises(ValueError, match=r"2 trainable parameters are not sharded by FSDP2 \(first: '2.weight'\)"):
        FSDP2Engine(_sharded(root=False), None)


def test_a_float16_policy_is_refused_with_the_fix(one_rank):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"module '\(the root\)' computes or reduces .* float16.*bfloat16 or float32"):
        FSDP2Engine(_sharded(policy), None)


def test_a_torch_older_than_fsdp2s_floor_is_refused_naming_both_versions(one_rank, monkeypatch):
    from lightning_weighted import _compat

    model = _sharded()  # `fully_shard` itself is there from torch 2.6; what the engine calls next is not
    monkeypatch.setattr(_compat, "TORCH", (2, 8))
    installed = re.escape(torch.__version__)
    with pytest.raises(RuntimeError, match=rf"'fsdp2_weighted' needs torch>=2\.9, and torch {installed} is installed"):
        FSDP2Engine(model, None)


def test_on_one_rank_gradients_are_item_sums_and_an_empty_microbatch_contributes_exact_zeros(one_rank):
    # one rank: FSDP2 copies instead of reduce-scattering, and its all-reduce hook zeroes the empty microbatch
    model = _sharded()
    engine = FSDP2Engine(model, None)
    reference = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    for param, whole in zip(reference.parameters(), model.parameters(), strict=True):
        param.data.copy_(whole.full_tensor())
    x = torch.randn(5, 3)
    model(x).sum().backward()  # an item sum over 5 items: no division by the world size or anything else
    reference(x).sum().backward()
    for param, whole in zip(reference.parameters(), model.parameters(), strict=True):
        assert torch.equal(whole.grad.full_tensor(), param.grad)
    engine.empty(model(x).sum() * math.nan).backward()  # a fully masked mean: 0/0
    engine.after_backward()
    for param, whole in zip(reference.parameters(), model.parameters(), strict=True):
        assert torch.equal(whole.grad.full_tensor(), param.grad)  # unchanged: it accumulated exact zeros
    multiply_gradients(model.parameters(), torch.tensor(0.25, dtype=torch.float64))  # D·c/N, on the shards
    for param, whole in zip(reference.parameters(), model.parameters(), strict=True):
        assert torch.equal(whole.grad.full_tensor(), param.grad / 4.0)


def test_the_data_parallel_group_of_a_mesh_spans_its_data_dimensions(one_rank):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    assert dist.get_world_size(data_parallel_group(mesh)) == 1
    hsdp = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    assert dist.get_world_size(data_parallel_group(hsdp, ("replicate", "shard"))) == 1


class _Tied(nn.Module):
    """A language model's shape: the output layer shares its weight with the embedding (Hugging Face's GPT-2)."""

    def __init__(self) -> None:
        super().__init__()
        blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.body = nn.ModuleDict({"embed": nn.Embedding(5, 4), "blocks": blocks})
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.body["embed"].weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.body["embed"](tokens)
        for block in self.body["blocks"]:
            hidden = torch.tanh(block(hidden))
        return self.head(hidden)


def test_shard_blocks_shards_every_block_and_leaves_a_tied_weight_to_the_root(one_rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    model = shard_blocks(_Tied(), mesh)
    sharded = {name for name, module in model.named_modules() if isinstance(module, FSDPModule)}
    # the blocks on their own; not the embedding nor the head, whose weight is one; the root holds that weight
    assert sharded == {"", "body.blocks.0", "body.blocks.1"}
    model(torch.tensor([1, 2, 3])).sum().backward()  # runs: torch refuses a tied weight split over two units
    assert model.head.weight is model.body["embed"].weight
