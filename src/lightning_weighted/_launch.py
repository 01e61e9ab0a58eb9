"""How both front ends start and group their processes: the launcher names, and the data-parallel mesh."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch.distributed as dist

from lightning_weighted._compat import flatten_mesh, parallel_sizes, set_parallel_sizes

__all__ = ["LAUNCHERS", "data_parallel_group", "every_rank_data_parallel", "mesh_sizes"]

LAUNCHERS: tuple[tuple[str, dict[str, Any]], ...] = (  # a registered name, its keyword arguments
    ("ddp_weighted", {"start_method": "popen"}),
    ("ddp_weighted_spawn", {"start_method": "spawn"}),
    ("ddp_weighted_fork", {"start_method": "fork"}),
    ("ddp_weighted_find_unused_parameters_true", {"start_method": "popen", "find_unused_parameters": True}),
)


def data_parallel_group(mesh: Any, dims: str | Sequence[str] = "data_parallel") -> dist.ProcessGroup:
    """The process group of a device mesh's data-parallel dimensions: where a window's counts are summed.

    ``dims``: one dimension, or several flattened into one group (HSDP's ``("replicate", "shard")``).
    """
    names = (dims,) if isinstance(dims, str) else tuple(dims)
    submesh = mesh[names[0]] if len(names) == 1 else flatten_mesh(mesh, names)
    group: dist.ProcessGroup = submesh.get_group()
    return group


def every_rank_data_parallel(strategy: Any) -> None:
    """Sets a ``ModelParallelStrategy``'s ``"auto"`` mesh sizes by :func:`mesh_sizes`, before it builds its mesh."""
    world = strategy.num_nodes * strategy.num_processes
    set_parallel_sizes(strategy, *mesh_sizes(world, *parallel_sizes(strategy)))


def mesh_sizes(world: int, data: int | Literal["auto"], tensor: int | Literal["auto"]) -> tuple[int, int]:
    """``(data_parallel_size, tensor_parallel_size)``: every rank data-parallel unless told otherwise.

    Lightning's own ``"auto"`` is one data-parallel rank per node; here it is what the other size leaves.

    Example::

        >>> mesh_sizes(8, "auto", "auto"), mesh_sizes(8, "auto", 2), mesh_sizes(8, 2, "auto")
        ((8, 1), (4, 2), (2, 4))
    """
    if data == "auto":
        data = world // (1 if tensor == "auto" else tensor)
    return data, max(world // data, 1) if tensor == "auto" else tensor
