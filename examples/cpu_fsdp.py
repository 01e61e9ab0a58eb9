"""Lightning's ``FSDPStrategy`` on the CPU: the plain FSDP1 that ``"fsdp_weighted"`` is set beside.

Lightning refuses its own ``FSDPStrategy`` on the CPU (only that class and its registered names), and wraps the
module with the device index, which is ``None`` there. FSDP1 runs on the CPU when wrapped with
``device_id=torch.device("cpu")``, and saves full state dicts when they are not "offloaded" to the CPU they are on
already (FSDP1 frees the unsharded parameters it offloads, and a CPU "offload" is the same memory). Nothing else
differs from Lightning's FSDP1. ``examples/tiny_lm.py --sharded fsdp``, the tests and the benchmarks use it as the
plain control; it is no part of ``lightning_weighted``, whose ``"fsdp_weighted"`` runs on the CPU by itself.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from lightning.fabric.strategies import FSDPStrategy as FabricFSDPStrategy
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import FSDPStrategy
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's ``FSDPStrategy``, also on the CPU (gloo); on CUDA it is Lightning's own."""

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if not self._full_on_cpu():
            return super().lightning_module_state_dict()
        assert self.model is not None
        with _full_state_dict_in_place(self.model):
            state: dict[str, Any] = self.model.state_dict()
        return state

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        if not self._full_on_cpu():
            return super().optimizer_state(optimizer)
        from torch.distributed.fsdp import FullyShardedDataParallel, OptimStateKeyType

        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        assert self.model is not None
        with _full_state_dict_in_place(self.model):
            state = FullyShardedDataParallel.optim_state_dict(self.model, optimizer)
            if self.global_rank == 0:  # the standard layout, as Lightning saves it
                state = FullyShardedDataParallel.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_ID, self.model)
        return state

    def _full_on_cpu(self) -> bool:
        return self._state_dict_type == "full" and self.root_device.type == "cpu"

    @override
    def _setup_model(self, model: Module) -> Module:
        from lightning.fabric.strategies.fsdp import _move_torchmetrics_to_device, _setup_activation_checkpointing
        from torch.distributed.fsdp import FullyShardedDataParallel

        if self.root_device.type != "cpu" or any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
            return super()._setup_model(model)
        wrapped = FullyShardedDataParallel(
            module=model,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),  # Lightning passes the device index, which is None on the CPU
            **self.kwargs,
        )
        _move_torchmetrics_to_device(wrapped, self.root_device)
        _setup_activation_checkpointing(wrapped, self._activation_checkpointing_kwargs)
        return wrapped


class CPUFabricFSDPStrategy(FabricFSDPStrategy):
    """Fabric's ``FSDPStrategy``, also on the CPU (gloo): the plain control of Fabric's ``"fsdp_weighted"``."""

    @override
    def setup_module(self, module: Module) -> Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        if self.root_device.type != "cpu" or any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
            return super().setup_module(module)
        return FullyShardedDataParallel(
            module=module,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),  # Fabric passes the device index, which is None on the CPU
            **self._fsdp_kwargs,
        )


def _full_state_dict_in_place(module: Module) -> contextlib.AbstractContextManager[Any]:
    """FSDP1's full state-dict context of Lightning's checkpoints (rank 0 only), without the offload to the CPU."""
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return FSDP.state_dict_type(
        module=module,
        state_dict_type=StateDictType.FULL_STATE_DICT,
        state_dict_config=FullStateDictConfig(offload_to_cpu=False, rank0_only=True),
        optim_state_dict_config=FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True),
    )
