r"""FSDP2 (``fully_shard``): every ``FSDPModule`` SUM-reduces, and an empty microbatch's own NaN never reaches it.

Each ``FSDPModule`` gets a divide factor of 1 with SUM-only reductions (:math:`D = 1`; gloo lacks ``PREMUL_SUM``) and
a reduce-scatter that cuts that NaN. Counts are summed over the data-parallel ranks only, not tensor-parallel peers.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_weighted._compat import (
    FSDP2_TORCH,
    fsdp2_param_groups,
    fsdp2_policies,
    fsdp2_shard_sizes,
    reduce_scatter,
    require_torch,
)

__all__ = ["FP16_FIX", "FSDP2Engine", "shard_blocks"]

FP16_FIX = (
    "float16 cannot hold the item-sum gradients that are computed and reduced before the division by N. Compute"
    " and reduce in bfloat16 or float32: `precision='bf16-mixed'` or 'bf16-true', FSDP2's"
    " `MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`, FSDP1's"
    " `MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`"
)


class FSDP2Engine:
    """The engine of ``module`` sharded with FSDP2 (torch 2.9 or later) over ``group``, configured and checked here."""

    divisor = 1
    mean_sized = False
    needs_graph = True  # every backward runs the collectives of the sharded model

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None) -> None:
        require_torch(FSDP2_TORCH, "strategy='fsdp2_weighted'")
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        self.module, self.group = module, group
        self.zeroing = False  # while True, a local gradient on its way into a reduction keeps its finite values
        modules = [child for child in module.modules() if isinstance(child, FSDPModule)]
        if not modules:
            raise ValueError(
                f"{type(module).__name__} holds no FSDP2 module: apply `torch.distributed.fsdp.fully_shard` in"
                " `configure_model` (to each block, then to the whole model) so that its gradients are reduced."
            )
        plain = [name for name, p in module.named_parameters() if p.requires_grad and not isinstance(p, DTensor)]
        if plain:
            raise ValueError(
                f"{len(plain)} trainable parameters are not sharded by FSDP2 (first: {plain[0]!r}), so their gradients"
                " would not be reduced. Apply `fully_shard` to the module that holds them as well (usually the whole"
                " model, after its blocks) in `configure_model`, or freeze them."
            )
        for fsdp in modules:
            groups, dtypes = fsdp2_param_groups(fsdp), {p.dtype for p in fsdp.parameters() if p.requires_grad}
            for policy in (policy for param_group in groups for policy in fsdp2_policies(param_group)):
                if torch.float16 in (policy.reduce_dtype, policy.param_dtype, *dtypes):
                    name = next(name for name, child in module.named_modules() if child is fsdp) or "(the root)"
                    raise ValueError(
                        f"FSDP2 module {name!r} computes or reduces its gradients in float16: {policy}. {FP16_FIX}."
                    )
            fsdp.set_gradient_divide_factor(1.0)
            fsdp.set_force_sum_reduction_for_comms(True)
            if groups:
                fsdp.set_custom_reduce_scatter(self)  # type: ignore[arg-type]
            if any(_shards_over_one_rank(param_group) for param_group in groups):
                fsdp.set_all_reduce_hook(self._zero)  # one rank: FSDP copies instead of reduce-scattering

    def empty(self, loss: Tensor | None) -> Tensor:
        """``0 · loss``, whose backward's own NaN (a fully masked mean) reaches the reductions as zeros."""
        assert loss is not None  # the loop refuses a step without a graph first (`needs_graph`)
        self.zeroing = True
        return loss.sum() * 0.0

    def after_backward(self) -> None:
        """Lets the reductions pass gradients through again."""
        self.zeroing = False

    def parameters(self) -> Iterable[Tensor]:
        """The sharded module's parameters (DTensors, whose local shards hold this rank's gradients)."""
        return self.module.parameters()

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A fresh buffer, as FSDP2's default reduce-scatter allocates one."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group: Any, op: Any, async_op: bool = False) -> Any:
        """Each ``FSDPModule``'s reduce-scatter (``set_custom_reduce_scatter``), an empty microbatch's input zeroed."""
        self._zero(input_tensor)
        return reduce_scatter(output_tensor, input_tensor, group, op, async_op)

    def _zero(self, tensor: Tensor) -> None:
        if self.zeroing:  # its own NaN (0/0) cut, what collectives brought from the other ranks' losses kept
            torch.nan_to_num(tensor, nan=0.0, posinf=0.0, neginf=0.0, out=tensor)


def shard_blocks(module: nn.Module, mesh: Any) -> nn.Module:
    """``fully_shard`` each submodule that owns its trainable parameters alone, outermost first, then the root.

    Fabric's default ``parallelize_fn`` (over ``mesh["data_parallel"]``); under the Trainer, ``configure_model`` calls
    ``shard_blocks(self.model, self.device_mesh)``. A parameter shared by submodules (tied embeddings) stays with
    the root, as torch requires; a container (``ModuleList``) runs no forward, so its entries are sharded instead.
    """
    from torch.distributed.fsdp import fully_shard

    owners: dict[int, list[str]] = {}
    for name, submodule in module.named_modules(remove_duplicate=False):
        for param in submodule.parameters(recurse=False):
            owners.setdefault(id(param), []).append(name)

    def visit(prefix: str, parent: nn.Module) -> None:
        for name, child in parent.named_children():
            path = f"{prefix}{name}"
            if not any(param.requires_grad for param in child.parameters()):
                continue
            alone = all(o == path or o.startswith(f"{path}.") for p in child.parameters() for o in owners[id(p)])
            if alone and not isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                fully_shard(child, mesh=mesh["data_parallel"])
            else:
                visit(f"{path}.", child)

    visit("", module)
    fully_shard(module, mesh=mesh["data_parallel"])
    return module


def _shards_over_one_rank(group: Any) -> bool:
    shards, replicas = fsdp2_shard_sizes(group)
    if shards > 1:
        return False
    if replicas > 1:
        raise ValueError(
            "An FSDP2 module replicates its parameters over a mesh without sharding them (a shard dimension of"
            " size 1): its gradients are all-reduced where an empty microbatch's cannot be zeroed. Shard over at"
            " least 2 ranks, or use strategy='ddp_weighted' for pure data parallelism."
        )
    return True
