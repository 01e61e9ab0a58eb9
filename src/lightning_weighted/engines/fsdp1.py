"""FSDP1 (``FullyShardedDataParallel``): a communication hook SUM-reduce-scatters, an empty microbatch adds zeros.

The hook replaces FSDP1's division by the world size (:math:`D = 1`) and runs once per window under ``no_sync``, an
empty microbatch's NaN cut before it accumulates. Sharded only: ``NO_SHARD`` would SUM an accumulated gradient twice.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from lightning_weighted._compat import flat_parameters, fsdp1_options, move_metrics, reduce_scatter, setup_checkpointing
from lightning_weighted.engines import FiniteGradients

__all__ = ["FSDP1Engine", "check_sharding", "full_state_dict_in_place", "wrapped_on_cpu"]


def check_sharding(name: str) -> None:
    """Refuses an FSDP1 ``sharding_strategy`` whose gradients fsdp_weighted cannot reduce, with the fix for each."""
    if name == "NO_SHARD":
        raise ValueError(
            "`sharding_strategy='NO_SHARD'` replicates the model, where fsdp_weighted reduce-scatters sharded"
            " gradients. Use `strategy='ddp_weighted'` for replicated training, or 'FULL_SHARD' or 'SHARD_GRAD_OP'."
        )
    if name not in ("FULL_SHARD", "SHARD_GRAD_OP"):
        raise ValueError(
            f"`sharding_strategy={name!r}` is hybrid, and FSDP1 takes no communication hook for its hybrid"
            " strategies, which fsdp_weighted's reduction needs. Use 'FULL_SHARD' or 'SHARD_GRAD_OP'."
        )


class FSDP1Engine(FiniteGradients):
    """The engine of a ``FullyShardedDataParallel`` root; the constructor registers its communication hook once.

    Args:
        root: the FSDP1 root (before its first forward), or a module holding FSDP1 units already set up (a
            ``validate()`` after a fit), whose first unit's hook is the one registered then.
    """

    divisor = 1
    mean_sized = False
    needs_graph = True  # every backward runs the collectives of the sharded model

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        first = next(m for m in root.modules() if isinstance(m, FSDP))
        self.group: dist.ProcessGroup | None = first.process_group
        if first is root and first not in _HOOKED:  # FSDP1 takes one hook per root
            first.register_comm_hook(self, _sum_reduce_scatter)
            _HOOKED.add(first)

    def empty(self, loss: Tensor | None) -> Tensor:
        """``0 · loss`` through its own graph; the flat parameters keep the finite values of their gradients."""
        assert loss is not None  # the loop refuses a step without a graph first (`needs_graph`)
        self.keep_finite(flat_parameters(self.root))
        return loss.sum() * 0.0

    def parameters(self) -> Iterable[Tensor]:
        """The root's parameters (FSDP1 keeps each one's gradient as a view of its flat gradient shard)."""
        return self.root.parameters()

    def __getstate__(self) -> dict[str, object]:
        return {}  # like `PowerSGDState`: a process group does not pickle


_HOOKED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _sum_reduce_scatter(engine: FSDP1Engine, grad: Tensor, output: Tensor | None = None) -> None:
    if output is None:
        if dist.get_world_size(engine.group) == 1:
            return  # one rank: FSDP1 runs NO_SHARD, and the gradient is the sum already
        raise ValueError(
            "fsdp_weighted reduce-scatters a sharded gradient, but FSDP called its hook without an output shard"
            " (NO_SHARD). Use a sharded strategy ('FULL_SHARD' or 'SHARD_GRAD_OP'), or 'ddp_weighted'."
        )
    reduce_scatter(output, grad, engine.group, dist.ReduceOp.SUM)


def wrapped_on_cpu(strategy: Any, module: nn.Module) -> nn.Module | None:
    """``module`` wrapped by an ``FSDPStrategy`` on the CPU, which Lightning cannot (it passes the index ``None``)."""
    if strategy.root_device.type != "cpu" or any(isinstance(m, FSDP) for m in module.modules()):
        return None
    kwargs, checkpointing_kwargs = fsdp1_options(strategy)[1:]
    wrapped = FSDP(
        module=module,
        cpu_offload=strategy.cpu_offload,
        mixed_precision=strategy.mixed_precision_config,
        sharding_strategy=strategy.sharding_strategy,
        device_id=torch.device("cpu"),
        **kwargs,
    )
    move_metrics(wrapped, strategy.root_device)  # what Lightning's `_setup_model` does after wrapping, too
    setup_checkpointing(wrapped, checkpointing_kwargs)
    return wrapped


def full_state_dict_in_place(module: nn.Module, rank0_only: bool = True) -> contextlib.AbstractContextManager[Any]:
    """FSDP1's full state-dict context of Lightning's checkpoints, without its offload to the CPU.

    On a CPU model the offload frees the gathered parameters that the state dict then clones (torch's FSDP
    state-dict hook segfaults); on the CPU they are where they would go anyway.
    """
    return FSDP.state_dict_type(
        module=module,
        state_dict_type=StateDictType.FULL_STATE_DICT,
        state_dict_config=FullStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only),
        optim_state_dict_config=FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only),
    )
