"""``ObjectiveAudit``, a Trainer callback: checks that an optimizer step's gradient is the global item mean's."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_weighted._compat import forward_redirection
from lightning_weighted.count import TRAINER, Count
from lightning_weighted.loop import read_output
from lightning_weighted.monitor import imbalance
from lightning_weighted.strategy import WeightedStrategy
from lightning_weighted.trainer._seam import patched
from lightning_weighted.trainer._strategy import WeightedTrainerStrategy

__all__ = ["AuditReport", "ObjectiveAudit", "ObjectiveMismatchError", "is_audit_rerun", "relative_error", "spread"]

_FIX = (
    "Train with a weighted strategy (`strategy='ddp_weighted'`, 'fsdp2_weighted' or 'fsdp_weighted' under FSDP,"
    f" after `import lightning_weighted`). {TRAINER.fix}"
)
_rerunning = False  # True while an audit re-runs `training_step`


class ObjectiveMismatchError(RuntimeError):
    """Raised by :class:`ObjectiveAudit` with ``on_mismatch="raise"`` when an audited step fails a check."""


@dataclass(frozen=True)
class AuditReport:
    """What one audited optimizer step measured; identical on every rank.

    Attributes:
        step: ``trainer.global_step`` before the audited optimizer step (0 for the first step).
        objective_error: ``max|g - g*| / max|g*|``, ``g`` the synchronized gradient (the largest over ranks).
        replica_error: the largest relative spread across ranks of the parameter and gradient checksums.
        imbalance: ``max_r P · n_r / N``: 1 when every rank holds the same number of items.
        norm: ``‖g‖``, the L2 norm of the synchronized gradient (rank 0's).
        expected_norm: ``‖g*‖``, the L2 norm of ``g*``, the gradient of the global item mean.
        counts: ``n_r``, the window's item count on each rank.
        passed: both errors are within ``rtol``.
    """

    step: int
    objective_error: float
    replica_error: float
    imbalance: float
    norm: float
    expected_norm: float
    counts: tuple[float, ...]
    passed: bool


def relative_error(actual: Tensor, expected: Tensor) -> float:
    """``max|actual - expected| / max|expected|``: 0 when both are zero, ``inf`` when only ``expected`` is."""
    if not expected.numel():
        return 0.0
    scale, difference = float(expected.abs().max()), float((actual - expected).abs().max())
    return difference / scale if scale != 0 else (0.0 if difference == 0 else math.inf)


def spread(rows: Tensor) -> float:
    """The largest relative spread ``(max - min) / max|·|`` over the columns of ``rows`` ([ranks, values])."""
    low, high = rows.min(dim=0).values, rows.max(dim=0).values
    scale = torch.maximum(low.abs(), high.abs())
    ratios = torch.where(high == low, torch.zeros_like(scale), (high - low) / scale)
    return float(ratios.max()) if ratios.numel() else 0.0


class ObjectiveAudit(Callback):
    """Checks, every ``every_n_steps`` optimizer steps, the synchronized gradient against the global item mean.

    Each audited step goes to the loggers as ``audit/objective_error``, ``audit/replica_error`` and
    ``audit/imbalance``, to rank 0's INFO log, and to :attr:`reports`. Side effects of ``training_step`` other than
    ``self.log`` happen twice unless guarded by :func:`is_audit_rerun`; the costs: ``docs/example_and_audit.md``.

    Args:
        every_n_steps: audit the steps whose ``global_step`` is a multiple of it; ``None`` (default): no audit.
        on_mismatch: ``"warn"`` (rank 0) or ``"raise"`` (every rank, :class:`ObjectiveMismatchError`) beyond ``rtol``.
        rtol: the largest objective or replica error accepted; ``1e-3`` leaves room for fp32 and fp16 rounding.
    """

    def __init__(
        self, every_n_steps: int | None = None, on_mismatch: Literal["warn", "raise"] = "warn", rtol: float = 1e-3
    ) -> None:
        positive = isinstance(every_n_steps, int) and not isinstance(every_n_steps, bool) and every_n_steps >= 1
        if every_n_steps is not None and not positive:
            raise ValueError(
                f"`every_n_steps={every_n_steps!r}` is not a positive int: pass how many optimizer steps apart the"
                " audited steps are (1 audits every step), or None to turn the audit off."
            )
        if on_mismatch not in ("warn", "raise"):
            raise ValueError(f"`on_mismatch={on_mismatch!r}` must be 'warn' or 'raise'.")
        if not (isinstance(rtol, (int, float)) and math.isfinite(rtol) and rtol >= 0):
            raise ValueError(f"`rtol={rtol!r}` must be a finite number >= 0, such as 1e-3.")
        self.every_n_steps, self.on_mismatch, self.rtol = every_n_steps, on_mismatch, float(rtol)
        self.reports: list[AuditReport] = []
        self._window: list[Microbatch] = []

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.every_n_steps is None:
            return
        if not pl_module.automatic_optimization:
            raise ValueError(
                f"ObjectiveAudit(every_n_steps={self.every_n_steps}) needs automatic optimization, but"
                f" {type(pl_module).__name__} sets `automatic_optimization=False`. Remove the callback."
            )
        strategy = trainer.strategy
        if not isinstance(strategy, (DDPStrategy, SingleDeviceStrategy, ModelParallelStrategy, FSDPStrategy)):
            raise ValueError(
                f"ObjectiveAudit needs every rank to hold all parameters, or to gather them as FSDP does, which"
                f" {type(strategy).__name__} does not. Audit with a DDP or FSDP strategy ('ddp', 'ddp_weighted',"
                " 'fsdp2_weighted', 'fsdp_weighted') or a single device."
            )
        if isinstance(strategy, ModelParallelStrategy) and strategy.device_mesh["tensor_parallel"].size() > 1:
            raise ValueError(
                "ObjectiveAudit compares whole gradients of data-parallel ranks, and does not take tensor-parallel"
                f" meshes apart (tensor_parallel_size={strategy.device_mesh['tensor_parallel'].size()}). Audit a run"
                " with tensor_parallel_size=1, or remove the callback."
            )

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        # Every microbatch of a window runs at the same `global_step`; the window is cleared when it steps.
        if self.every_n_steps is None or trainer.global_step % self.every_n_steps != 0:
            return
        cuda = [torch.cuda.get_rng_state(pl_module.device)] if pl_module.device.type == "cuda" else []
        padding = isinstance(trainer.strategy, WeightedStrategy) and trainer.strategy.padding_step
        self._window.append(Microbatch(batch, batch_idx, [torch.get_rng_state(), *cuda], padding))

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer) -> None:
        window, self._window = self._window, []
        if not window:
            return
        report = self._audit(trainer, pl_module, window)
        self.reports.append(report)
        # Straight to the loggers: a value `self.log`-ged here would be repeated on every later step's row.
        metrics = {f"audit/{name}": getattr(report, name) for name in ("objective_error", "replica_error", "imbalance")}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        rank_zero_info(
            f"ObjectiveAudit step {report.step}: objective error {report.objective_error:.3g} (gradient norm"
            f" {report.norm:.6g}, global item mean's {report.expected_norm:.6g}), replica error"
            f" {report.replica_error:.3g}, imbalance max_r P·n_r/N {report.imbalance:.3g} over counts"
            f" {[round(c, 6) for c in report.counts]}"
        )
        if report.passed:
            return
        if self.on_mismatch == "raise":
            raise ObjectiveMismatchError(_mismatch_message(report, self.rtol))
        rank_zero_warn(_mismatch_message(report, self.rtol))

    def _audit(self, trainer: Trainer, pl_module: LightningModule, window: list[Microbatch]) -> AuditReport:
        strategy, device = trainer.strategy, pl_module.device
        targets = Targets(pl_module, strategy.model if isinstance(strategy, FSDPStrategy) else None)
        params = [param for param in targets.values() if param is not None]
        sums, items, invalid = local_sums(trainer, pl_module, targets, params, window)
        # One SUM of the counts gives every rank N_k (and the ranks with an invalid count), one more Σ_k S_k / N_k.
        totals = torch.tensor([*items, invalid], dtype=torch.float64, device=device)
        distributed = dist.is_available() and dist.is_initialized()
        if distributed:
            dist.all_reduce(totals)
        if totals[-1] > 0:
            raise ValueError(
                f"training_step returned an invalid count on {int(totals[-1])} rank(s) in the window audited at"
                f" step {trainer.global_step}. {_FIX}: a finite int, float or 0-dim tensor >= 0."
            )
        parts = zip(sums, totals[:-1].tolist(), strict=True)
        expected = sum((part / total for part, total in parts if total > 0), torch.zeros_like(sums[0]))
        if distributed:
            dist.all_reduce(expected)
        actual = flat(targets.values(gradients=True), params)
        error = relative_error(actual, expected)
        param_sum = sum(float(param.double().sum()) for param in params)
        param_squares = sum(float(param.double().square().sum()) for param in params)
        checksums = [param_sum, param_squares, actual.sum(), actual.square().sum()]
        row = [sum(items), *checksums, error, actual.norm(), expected.norm()]
        local = torch.tensor(row, dtype=torch.float64, device=device)
        rows = local.unsqueeze(0)
        if distributed:
            gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, local)
            rows = torch.stack(gathered)
        counts = tuple(float(count) for count in rows[:, 0].tolist())
        objective_error, replica_error = float(rows[:, 5].max()), spread(rows[:, 1:5])  # the first NaN if a rank's is
        norm, expected_norm = (float(value) for value in rows[0, 6:8])
        passed = objective_error <= self.rtol and replica_error <= self.rtol  # False for NaN
        skew, step = imbalance(max(counts), sum(counts), len(counts)), trainer.global_step
        return AuditReport(step, objective_error, replica_error, skew, norm, expected_norm, counts, passed)


def _mismatch_message(report: AuditReport, rtol: float) -> str:
    parts = [f"ObjectiveAudit at step {report.step}:"]
    replicas_agree = report.replica_error <= rtol
    if not replicas_agree:
        parts.append(
            f"the replicas disagree: parameter or gradient checksums differ across ranks by a relative"
            f" {report.replica_error:.4g} (rtol={rtol:g}). Something changed parameters or gradients on some"
            " ranks only (a callback, an unsynchronized buffer, a rank-dependent `training_step`): make every"
            " rank apply the same update."
        )
    if not report.objective_error <= rtol:
        parts.append(
            f"the synchronized gradient (norm {report.norm:.6g}) differs from the gradient of the global item mean"
            f" (norm {report.expected_norm:.6g}) by a relative error of {report.objective_error:.4g} (rtol={rtol:g});"
            f" the ranks' item counts are {list(report.counts)} (imbalance max_r P·n_r/N = {report.imbalance:.4g})."
            + (f" {_FIX}." if replicas_agree else " Make the replicas agree first.")
        )
    return " ".join(parts)


def is_audit_rerun() -> bool:
    """Whether an :class:`ObjectiveAudit` re-runs ``training_step``: guard side effects besides ``self.log`` with it."""
    return _rerunning


@dataclass
class Microbatch:
    """One cached microbatch of an audited window."""

    batch: Any
    batch_idx: int
    rng: list[Tensor]  # the CPU state, then the device's when it is CUDA
    padding: bool = False  # an exhausted rank's replay of a batch under a weighted strategy: count 0


def local_sums(
    trainer: Trainer, pl_module: LightningModule, targets: Targets, params: list[Tensor], window: list[Microbatch]
) -> tuple[list[Tensor], list[float], float]:
    """Re-runs the window; returns each part's ``Σ_m n_m · ḡ_m`` over ``params``, its ``Σ_m n_m``, 1.0 if invalid."""
    strategy = trainer.strategy
    sharded = isinstance(strategy, (ModelParallelStrategy, FSDPStrategy))  # every rank joins each backward's gathers
    weighted = strategy if isinstance(strategy, WeightedTrainerStrategy) else None
    names = weighted.item_counter.names if weighted and weighted.item_counter else ()
    size = sum(param.numel() for param in params)
    sums = [torch.zeros(size, dtype=torch.float64, device=pl_module.device) for _ in names or ("",)]
    items, invalid = [0.0] * len(sums), 0.0
    takes_index = is_param_in_hook_signature(pl_module.training_step, "batch_idx", min_args=2)
    buffers = [(buffer, buffer.detach().clone()) for buffer in pl_module.buffers()]
    cuda = [pl_module.device] if pl_module.device.type == "cuda" else []
    root = targets.root if targets.root is not pl_module else None  # FSDP1 gathers parameters only in its forward
    with _rerun_step(pl_module), torch.enable_grad():
        for microbatch in window:
            with torch.random.fork_rng(devices=cuda), targets.used() as used:
                torch.set_rng_state(microbatch.rng[0])
                if cuda:
                    torch.cuda.set_rng_state(microbatch.rng[1], cuda[0])
                with strategy.precision_plugin.train_step_context():
                    args = (microbatch.batch, microbatch.batch_idx) if takes_index else (microbatch.batch,)
                    if root is not None:
                        step = read_output(forward_redirection(strategy, root, pl_module, "training_step", *args))
                    else:
                        step = read_output(pl_module.training_step(*args))
            losses = [step.parts.get(name) if step.parts else None for name in names] if names else [step.loss]
            if any(loss is None or not loss.requires_grad for loss in losses):
                continue  # Lightning skips a `None` step; a loss without a graph fails its own backward
            if weighted is not None:  # the strategy's count rule, read on the host, as training never does
                counted = weighted.counts_of(step, microbatch.batch)
            else:  # a plain one's: a returned count, else the batch size
                counted = [step.count if step.count is not None else Count(float(extract_batch_size(microbatch.batch)))]
            bad = step.problem is not None or any(c.problem is not None and float(c.problem) != 0 for c in counted)
            invalid = 1.0 if bad else invalid
            for k, (loss, count) in enumerate(zip(losses, counted, strict=True)):
                weight = float(count.value)
                skipped = bad or weight == 0 or microbatch.padding  # exactly zero, also for a NaN mean
                if skipped and not sharded:
                    continue
                assert loss is not None
                grads = torch.autograd.grad(loss.sum(), used, allow_unused=True, retain_graph=k < len(losses) - 1)
                if not skipped:
                    sums[k].add_(flat(grads, params), alpha=1.0 if step.item_sum else weight)
                    items[k] += weight
    with torch.no_grad():
        for buffer, saved in buffers:
            buffer.copy_(saved)
    return sums, items, invalid


def flat(tensors: Sequence[Tensor | None], like: Sequence[Tensor]) -> Tensor:
    """Concatenates ``tensors`` as float64 on ``like``'s device; a missing tensor reads as zeros shaped as ``like``."""
    pairs = zip(tensors, like, strict=True)
    return torch.cat([(t.detach() if t is not None else torch.zeros_like(r)).reshape(-1).double() for t, r in pairs])


@contextlib.contextmanager
def _rerun_step(pl_module: LightningModule) -> Iterator[None]:
    """Marks the re-run for :func:`is_audit_rerun`; its ``self.log`` and ``self.log_dict`` calls do nothing."""
    global _rerunning
    with patched(pl_module, log=lambda *args, **kwargs: None, log_dict=lambda *args, **kwargs: None):
        _rerunning = True
        try:
            yield
        finally:
            _rerunning = False


class Targets:
    """The trainable parameters of ``module``, each read whole (inside FSDP1's ``root``), and as a forward uses it."""

    def __init__(self, module: nn.Module, root: nn.Module | None = None) -> None:
        self.root = root
        self.owners: list[tuple[nn.Module, str]] = []
        for path, param in module.named_parameters():  # each parameter once, as its first owner holds it
            if param.requires_grad:
                prefix, _, name = path.rpartition(".")
                self.owners.append((module.get_submodule(prefix), name))

    @contextlib.contextmanager
    def used(self) -> Iterator[list[Tensor]]:
        """The tensor each parameter's module computed with in the block's forward: under FSDP, the whole parameter."""
        tensors: list[Tensor] = [getattr(owner, name) for owner, name in self.owners]

        def record(index: int, owner: nn.Module, args: Any) -> None:
            tensors[index] = getattr(owner, self.owners[index][1])

        hooks = [owner.register_forward_pre_hook(partial(record, i)) for i, (owner, _) in enumerate(self.owners)]
        try:
            yield tensors
        finally:
            for hook in hooks:
                hook.remove()

    def values(self, gradients: bool = False) -> list[Tensor | None]:
        """Every parameter (or gradient, ``None`` where none) whole, the same on every rank: a collective under FSDP."""
        summoned: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if self.root is not None:
            from torch.distributed.fsdp import FullyShardedDataParallel

            summoned = FullyShardedDataParallel.summon_full_params(self.root, writeback=False, with_grads=gradients)
        with summoned:
            params = [getattr(owner, name) for owner, name in self.owners]
            values = [param.grad for param in params] if gradients else params
            return [None if value is None else _whole(value.detach()) for value in values]


def _whole(tensor: Tensor) -> Tensor:
    full_tensor = getattr(tensor, "full_tensor", None)  # a DTensor: all-gathered over its mesh
    return full_tensor() if full_tensor is not None else tensor.clone()
