"""What every weighted strategy shares, Trainer and Fabric alike: the mixin, the launchers, the data-parallel mesh."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, cast

import torch.distributed as dist

from lightning_weighted._compat import StrategyRegistry, flatten_mesh, parallel_sizes, register, set_parallel_sizes
from lightning_weighted.loaders.sampler import marked
from lightning_weighted.loop import WindowLoop
from lightning_weighted.payload import WindowResult

__all__ = ["LAUNCHERS", "WeightedStrategy", "data_parallel_group", "every_rank_data_parallel", "mesh_sizes", "weighted"]


class WeightedStrategy:
    """The mixin of every weighted strategy, Trainer and Fabric alike: what it tells of its loop of windows."""

    _loop: WindowLoop | None
    _registered: tuple[str, Sequence[tuple[str, dict[str, Any]]]]  # the description; each name, its keyword arguments

    @classmethod
    def register_strategies(cls, strategy_registry: StrategyRegistry) -> None:
        """Registers the strategy under each of its names, as Lightning registers ``"ddp"``'s variants."""
        description, names = cls._registered
        register(strategy_registry, cls, description, *names)

    @property
    def padding_step(self) -> bool:
        """The batch in progress replays a batch of a rank whose data ran out (it counts for nothing)."""
        raise NotImplementedError

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """The strategy's, ``num_replicas`` marked so that its padding sampler is told from the user's."""
        return marked(super().distributed_sampler_kwargs)  # type: ignore[misc]  # the Lightning strategy's, next

    @property
    def data_parallel_group(self) -> dist.ProcessGroup | None:
        """The ranks a window's counts are summed over, the ones that see different data (``None``: every rank)."""
        return self._loop.engine.group if self._loop is not None else None

    @property
    def skipped_steps(self) -> int:
        """Windows whose global ``N`` was 0: optimizer steps that changed nothing."""
        return self._loop.skipped_steps if self._loop is not None else 0

    @property
    def last_window(self) -> WindowResult | None:
        """The result of the last window."""
        return self._loop.last_window if self._loop is not None else None


def weighted(strategy: object, role: str) -> WeightedStrategy:
    """``strategy`` where it is a weighted one; else a clear error, opening with what ``role`` says the caller does."""
    if not isinstance(strategy, WeightedStrategy):
        raise ValueError(
            f"{role} a weighted strategy (`strategy='ddp_weighted'`), but the Trainer uses {type(strategy).__name__}."
            " Pass `strategy='ddp_weighted'` or drop the callback."
        )
    return strategy


LAUNCHERS: tuple[tuple[str, dict[str, Any]], ...] = (  # a registered name, its keyword arguments
    ("ddp_weighted", {"start_method": "popen"}),
    ("ddp_weighted_spawn", {"start_method": "spawn"}),
    ("ddp_weighted_fork", {"start_method": "fork"}),
    ("ddp_weighted_find_unused_parameters_true", {"start_method": "popen", "find_unused_parameters": True}),
)


def data_parallel_group(mesh: Any, dims: str | Sequence[str] = "data_parallel") -> dist.ProcessGroup:
    """The process group of a device mesh's data-parallel ``dims``: one, or several flattened (HSDP's two)."""
    names = (dims,) if isinstance(dims, str) else tuple(dims)
    submesh = mesh[names[0]] if len(names) == 1 else flatten_mesh(mesh, names)
    return cast("dist.ProcessGroup", submesh.get_group())


def every_rank_data_parallel(strategy: Any) -> None:
    """Sets a ``ModelParallelStrategy``'s ``"auto"`` mesh sizes by :func:`mesh_sizes`, before it builds its mesh."""
    set_parallel_sizes(strategy, *mesh_sizes(strategy.num_nodes * strategy.num_processes, *parallel_sizes(strategy)))


def mesh_sizes(world: int, data: int | Literal["auto"], tensor: int | Literal["auto"]) -> tuple[int, int]:
    """``(data_parallel_size, tensor_parallel_size)``, where an ``"auto"`` size is what the other leaves of ``world``.

    Example::

        >>> mesh_sizes(8, "auto", "auto"), mesh_sizes(8, "auto", 2), mesh_sizes(8, 2, "auto")
        ((8, 1), (4, 2), (2, 4))
    """
    if data == "auto":
        data = world // (1 if tensor == "auto" else tensor)
    return data, max(world // data, 1) if tensor == "auto" else tensor
