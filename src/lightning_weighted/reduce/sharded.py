r"""Sharded reductions (FSDP2, FSDP1): gradients SUM-reduced as item sums, divided by the window's :math:`N` on shards.

Every microbatch's loss is an item sum (:class:`~lightning_weighted.window.LossScale` ``ITEM_SUM``), so the
gradient a rank computes is :math:`\sum_m n_m \bar g_m` (see :mod:`lightning_weighted.window`). FSDP2 in
Lightning reduce-scatters it on every microbatch, before :math:`N` is known (FSDP1 once per window), so the pieces
here

- make every reduction a plain SUM (:func:`reduce_with_sum` for FSDP2's ``FSDPModule``\ s,
  :func:`weighted_reduce_scatter_hook` for FSDP1's communication hook), with no division by the world size;
- replace the local gradient of a microbatch that holds no item by exact zeros, in FSDP2's reduce-scatter
  (:attr:`ShardedReduceState.empty`, :class:`ZeroingReduceScatter`) or before it accumulates in FSDP1's flat
  parameters (:func:`zero_gradients`): its mean is NaN when every item is masked (0/0), and the backward still has
  to run, because its all-gathers and reduce-scatters are collectives every rank takes part in;
- sum the window's count payload over the data-parallel group (:meth:`ShardedReduceState.begin_window`, one
  asynchronous 48-byte all-reduce per optimizer step, :func:`data_parallel_group` for a device mesh);
- divide the local gradient shards by :math:`N` once the window is over (:func:`divide_gradients`): one pass over
  :math:`1/P` of the gradients, before clipping and the optimizer.

Counts are summed over the data-parallel ranks only (replicate × shard with HSDP), never over tensor-parallel
peers, which hold the same batch. The worked trace on 2 ranks: the SUM gives :math:`2 \cdot 1 + 6 \cdot 3 = 20`
on every shard, and :math:`20 / 8 = 2.5`.

The names in ``__all__`` are a stable API, for the Trainer strategies and any other loop that drives sharded
models (Fabric's, or a hand-written one).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.futures import Future
from torch.utils.hooks import RemovableHandle

from lightning_weighted._counts import CountPayload
from lightning_weighted.reduce.counts import sum_counts

__all__ = [
    "ShardedReduceState",
    "ZeroingReduceScatter",
    "data_parallel_group",
    "divide_gradients",
    "empty_microbatch",
    "flat_parameters",
    "fsdp2_modules",
    "mesh_sizes",
    "reduce_with_sum",
    "weighted_reduce_scatter_hook",
    "zero_gradients",
]

_FSDP2_METHODS = ("set_custom_reduce_scatter", "set_force_sum_reduction_for_comms", "set_gradient_divide_factor")
FP16_FIX = (
    "float16 cannot hold the item-sum gradients that are computed and reduced before the division by N. Compute"
    " and reduce in bfloat16 or float32: `precision='bf16-mixed'` or 'bf16-true', FSDP2's"
    " `MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`, FSDP1's"
    " `MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`"
)


class ShardedReduceState:
    """What the sharded reductions of one model need to know about the microbatch and the window in progress.

    Args:
        process_group: the data-parallel group the window's counts are summed over; ``None`` is the world.

    Attributes:
        empty: while ``True``, the local gradient on its way into a reduction is replaced by exact zeros. Set it
            before the backward of a microbatch that holds no item (count 0) and clear it after.
    """

    __slots__ = ("_pending", "empty", "process_group")

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.process_group = process_group
        self.empty = False
        self._pending: Future[Tensor] | None = None  # the window's count SUM in flight

    def __getstate__(self) -> dict[str, Any]:
        # Like `PowerSGDState`: a process group and a pending collective do not pickle.
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

    def zero_if_empty(self, tensor: Tensor) -> None:
        """Sets ``tensor`` (a local gradient about to be reduced) to exact zeros while :attr:`empty` is set."""
        if self.empty:
            tensor.zero_()

    def begin_window(self, payload: CountPayload, device: torch.device) -> None:
        """Starts the SUM of this rank's count payload over the data-parallel group, without waiting.

        Call it before the backward that ends the window, so that the 48-byte all-reduce overlaps it.

        Args:
            payload: this rank's count payload (:meth:`lightning_weighted.window.Window.payload`), whose ``rank`` is
                the rank's index in :attr:`process_group`.
            device: where the gradients live (the payload travels there).
        """
        self._pending = sum_counts(payload, device, self.process_group)

    def counts(self) -> list[float]:
        """The window's summed payload on the host, indexed by ``Slot`` (one device read per window)."""
        if self._pending is None:
            raise RuntimeError(
                "no count payload was handed over for this window: call `ShardedReduceState.begin_window` before the"
                " backward that ends each accumulation window"
            )
        summed: list[float] = self._pending.wait().tolist()
        self._pending = None
        return summed


class ZeroingReduceScatter:
    """FSDP2's reduce-scatter (``FSDPModule.set_custom_reduce_scatter``) with an empty microbatch's input zeroed.

    Args:
        state: the state whose :attr:`~ShardedReduceState.empty` flag says whether this rank's microbatch holds
            no item.
    """

    def __init__(self, state: ShardedReduceState) -> None:
        self.state = state

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A fresh buffer, as FSDP2's default reduce-scatter allocates one."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: Tensor,
        input_tensor: Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> dist.Work | None:
        """Reduce-scatters ``input_tensor`` (this rank's unsharded gradients) into ``output_tensor``."""
        self.state.zero_if_empty(input_tensor)
        return _reduce_scatter(output_tensor, input_tensor, group, op, async_op)


def data_parallel_group(mesh: Any, dims: str | Sequence[str] = "data_parallel") -> dist.ProcessGroup:
    """The process group of a device mesh's data-parallel dimensions: where a window's counts are summed.

    Args:
        mesh: a ``DeviceMesh`` (Lightning's ``ModelParallelStrategy.device_mesh`` has the dimensions
            ``("data_parallel", "tensor_parallel")``).
        dims: the data-parallel dimension, or several (HSDP's ``("replicate", "shard")``), which are flattened into
            one group holding every rank that sees different data.

    Example::

        >>> # with Lightning's mesh of 2 data-parallel × 2 tensor-parallel ranks, rank 0's group is ranks {0, 2}
        >>> # data_parallel_group(strategy.device_mesh)
    """
    names = (dims,) if isinstance(dims, str) else tuple(dims)
    submesh = mesh[names[0]] if len(names) == 1 else mesh[names]._flatten()
    group: dist.ProcessGroup = submesh.get_group()
    return group


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


def empty_microbatch(state: ShardedReduceState, loss: Tensor | None, source: str, strategy: str) -> Tensor:
    """``0 · loss``, whose backward (NaN for a fully masked mean) reaches the reduction as exact zeros.

    Sets ``state.empty``; the caller clears it once the backward has run. The backward must run: its all-gathers
    and reduce-scatters are collectives every rank takes part in, so a loss without a graph (``source`` says whose,
    as in ``"On rank 1, training_step returned"``) raises here, and the peers fail as this rank's connections close.
    """
    if loss is None or loss.grad_fn is None:
        what = "None" if loss is None else "a loss that is not attached to the graph"
        raise RuntimeError(
            f"{source} {what}. Under {strategy} every rank runs each microbatch's backward through the sharded"
            " model, whose collectives the other ranks wait in: give the loss of the model's forward (with a count"
            " of 0 for a microbatch that holds no item)."
        )
    state.empty = True
    return loss.sum() * 0.0


def fsdp2_modules(module: nn.Module) -> list[nn.Module]:
    """Every FSDP2 ``FSDPModule`` (a module ``fully_shard`` was applied to) in ``module``, outermost first."""
    from torch.distributed.fsdp import FSDPModule

    return [child for child in module.modules() if isinstance(child, FSDPModule)]


def reduce_with_sum(module: nn.Module, state: ShardedReduceState) -> list[nn.Module]:
    r"""Makes every FSDP2 module in ``module`` SUM its gradients, and zero an empty microbatch's on the way in.

    Each ``FSDPModule`` gets a divide factor of 1 with SUM-only reductions (no division by the world size; no
    ``PREMUL_SUM``, which gloo lacks) and a :class:`ZeroingReduceScatter`. Where a module's reduce-scatter spans one
    rank (FSDP2 on a single rank), FSDP copies instead of calling it, and its all-reduce hook does the zeroing.

    Args:
        module: the model after ``fully_shard`` (a ``LightningModule`` after ``configure_model``).
        state: the state whose :attr:`~ShardedReduceState.empty` flag the reductions read.

    Returns:
        The configured ``FSDPModule``\ s.

    Raises:
        ValueError: a trainable parameter is not sharded by FSDP2 (its gradient would not be reduced at all), a
            module computes or reduces in fp16 (item sums overflow it), or a module replicates without sharding
            (HSDP with a shard dimension of size 1), whose reduction this zeroing cannot reach.
        RuntimeError: this torch has no FSDP2 SUM-reduction controls.
    """
    modules = fsdp2_modules(module)
    if not modules:
        raise ValueError(
            f"{type(module).__name__} holds no FSDP2 module: apply `torch.distributed.fsdp.fully_shard` in"
            " `configure_model` (to each block, then to the whole model) so that its gradients are reduced."
        )
    missing = [name for name in _FSDP2_METHODS if not hasattr(modules[0], name)]
    if missing:
        raise RuntimeError(
            f"FSDPModule lacks {', '.join(missing)} in torch {torch.__version__}: upgrade torch to 2.9 or newer for"
            " count-weighted FSDP2."
        )
    _check_sharded(module)
    names = {child: name for name, child in module.named_modules()}
    for fsdp in modules:
        groups = fsdp._get_fsdp_state()._fsdp_param_groups  # type: ignore[operator]
        for group in groups:
            _check_dtypes(names[fsdp] or "(the root)", fsdp, group)
        fsdp.set_gradient_divide_factor(1.0)  # type: ignore[operator]
        fsdp.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
        if groups:
            fsdp.set_custom_reduce_scatter(ZeroingReduceScatter(state))  # type: ignore[operator]
        if any(_shards_over_one_rank(group) for group in groups):
            fsdp.set_all_reduce_hook(state.zero_if_empty)  # type: ignore[operator]
    return modules


def divide_gradients(parameters: Iterable[Tensor], items: float) -> None:
    """Divides every local gradient (a shard, for a sharded parameter) by ``items``, in one pass.

    Args:
        parameters: the model's parameters; those without a gradient are left alone. A DTensor's local shard is
            divided in place, and so is a plain tensor's gradient (FSDP1's views of its flat gradient shard are
            disjoint, so no element is divided twice).
        items: the window's global item count ``N`` (> 0).

    Example::

        >>> weight = torch.nn.Parameter(torch.ones(2))
        >>> weight.grad = torch.tensor([20.0, 4.0])
        >>> divide_gradients([weight], 8.0)
        >>> weight.grad
        tensor([2.5000, 0.5000])
    """
    local: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for param in parameters:
        grad = param.grad
        if grad is None:
            continue
        shard = grad.to_local() if hasattr(grad, "to_local") else grad
        if shard.numel():
            local.setdefault((shard.device, shard.dtype), []).append(shard)
    with torch.no_grad():
        for grads in local.values():
            torch._foreach_div_(grads, items)


def weighted_reduce_scatter_hook(state: ShardedReduceState, grad: Tensor, output: Tensor | None = None) -> None:
    """FSDP1's communication hook: SUM-reduce-scatters the unsharded gradient, with no division.

    Registered on the root ``FullyShardedDataParallel`` (``register_comm_hook(state, hook)``) before its first
    forward; it replaces FSDP's division by the world size, so the sharded gradient is an item sum until
    :func:`divide_gradients`. Under ``no_sync`` it runs once per window, on the gradient accumulated over the
    window's microbatches, so an empty microbatch is zeroed before it accumulates (:func:`zero_gradients` on
    :func:`flat_parameters`), not here. Sharded strategies only (``FULL_SHARD``, ``SHARD_GRAD_OP``): FSDP1 refuses
    hooks for the hybrid ones, and ``NO_SHARD`` would SUM an accumulated gradient twice.

    Args:
        state: its :attr:`~ShardedReduceState.process_group` is FSDP's.
        grad: this rank's flat unsharded gradient of one FSDP unit (padded to a multiple of the world size).
        output: the pre-sized flat shard the SUM lands in.
    """
    if output is None:
        raise ValueError(
            "weighted_reduce_scatter_hook reduce-scatters a sharded gradient, but FSDP called it without an output"
            " shard (NO_SHARD). Use a sharded strategy ('FULL_SHARD' or 'SHARD_GRAD_OP'), or 'ddp_weighted'."
        )
    _reduce_scatter(output, grad, state.process_group)


def flat_parameters(module: nn.Module) -> list[Tensor]:
    """FSDP1's flat parameters in ``module``: the leaves every unsharded gradient of its FSDP units accumulates into."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    units = FullyShardedDataParallel.fsdp_modules(module)
    return [unit._flat_param for unit in units if unit._flat_param is not None]


def zero_gradients(tensors: Iterable[Tensor]) -> list[RemovableHandle]:
    """Replaces the gradient computed for each tensor by exact zeros (before it accumulates), until the handles go.

    For a microbatch that holds no item under FSDP1: its backward runs (its all-gathers are collectives) and its
    gradient (NaN for a fully masked mean) reaches the flat parameters as zeros, also under ``no_sync``, where it
    would otherwise land in the unsharded gradient accumulated over the window.

    Example::

        >>> weight = torch.nn.Parameter(torch.ones(2))
        >>> handles = zero_gradients([weight])
        >>> (weight * torch.tensor(float("nan"))).sum().backward()
        >>> for handle in handles:
        ...     handle.remove()
        >>> weight.grad
        tensor([0., 0.])
    """
    return [tensor.register_hook(torch.zeros_like) for tensor in tensors]  # type: ignore[no-untyped-call]


def _reduce_scatter(
    output: Tensor, source: Tensor, group: dist.ProcessGroup | None, op: Any = None, async_op: bool = False
) -> dist.Work | None:
    """A SUM (or ``op``) reduce-scatter of ``source`` into ``output``, by the name this torch prefers."""
    op = dist.ReduceOp.SUM if op is None else op
    single = getattr(dist, "reduce_scatter_single", None)  # torch 2.13 deprecates `reduce_scatter_tensor`
    if single is not None:
        work: dist.Work | None = single(output=output, input=source, op=op, group=group, async_op=async_op)
    else:
        work = dist.reduce_scatter_tensor(output, source, op=op, group=group, async_op=async_op)
    return work


def _check_sharded(module: nn.Module) -> None:
    from torch.distributed.tensor import DTensor

    plain = [
        name for name, param in module.named_parameters() if param.requires_grad and not isinstance(param, DTensor)
    ]
    if plain:
        raise ValueError(
            f"{len(plain)} trainable parameters are not sharded by FSDP2 (first: {plain[0]!r}), so their gradients"
            " would not be reduced. Apply `fully_shard` to the module that holds them as well (usually the whole"
            " model, after its blocks) in `configure_model`, or freeze them."
        )


def _check_dtypes(name: str, fsdp: nn.Module, group: Any) -> None:
    policy = group.mp_policy
    dtypes = {param.dtype for param in fsdp.parameters() if param.requires_grad}
    if torch.float16 in (policy.reduce_dtype, policy.param_dtype, *dtypes):
        raise ValueError(f"FSDP2 module {name!r} computes or reduces its gradients in float16: {policy}. {FP16_FIX}.")


def _shards_over_one_rank(group: Any) -> bool:
    """Whether FSDP2 copies instead of reduce-scattering this group's gradients (it shards over one rank)."""
    mesh_info = group.mesh_info
    shard_size = getattr(mesh_info, "shard_mesh_size", 1)
    if shard_size > 1:
        return False
    if getattr(mesh_info, "replicate_mesh_size", 1) > 1:
        raise ValueError(
            "An FSDP2 module replicates its parameters over a mesh without sharding them (a shard dimension of"
            " size 1): its gradients are all-reduced where an empty microbatch's cannot be zeroed. Shard over at"
            " least 2 ranks, or use strategy='ddp_weighted' for pure data parallelism."
        )
    return True
