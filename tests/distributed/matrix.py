"""The compatibility matrix: every row of ``docs/compatibility.md``, its data, and what each optimizer step must train.

A row (:class:`Row`) is one feature of Lightning 2.6 as it touches a weighted strategy: a Trainer argument, a hook,
a loader kind, a resume point, a Fabric loop pattern. Its outcome is

- ``exact``: on 2 ranks holding uneven data (by default rank 0 7 batches, rank 1 5, rank 1's batches twice as
  large, token-masked items, gradient accumulation) the weighted run trains the float64 reference of the global item
  mean (:func:`reference`) over the batches :func:`plan` says each optimizer step trains, and the plain strategy
  misses that reference (``test_compatibility.py`` runs both);
- ``refused``: every rank stops with a message matching the row's regex, before any optimizer step.

A row runs on the engines and count paths it names (the cells), one of them its home cell, which runs in the default
test suite; every other cell carries the ``matrix`` marker. Count paths: ``after`` (``training_step`` returns
``{"loss": mean, "count": n}``; Fabric ``fabric.backward(loss, count=n)``), ``ahead`` (``ItemCounter`` counts the
batches and ``training_step`` returns the bare mean; Fabric ``fabric.strategy.count_ahead``) and, for the rows that
say so, ``bare`` (a bare mean and no ``ItemCounter``: the strategy counts the batch size).

Adding a row is adding a :class:`Row` to :data:`ROWS` (and its line to ``docs/compatibility.md``): its ``options``
drive the rank scripts (``matrix_worker.py``, ``matrix_fabric_worker.py``) and :func:`plan` alike. A new option
needs both to read it.

Every item is named by an integer id, from which its values follow (:func:`values`): the reference needs only the
ids each optimizer step trains. Per-rank data (``layout="per_rank"``) gives rank ``r``'s batch ``k`` of epoch ``e``
the ids ``100000 r + 20000 l + 1000 e + 10 k + j`` (``l`` a loader of several); a shared data set (``"shared"``)
holds the ids ``0 .. items - 1``, sharded by the front end's sampler; a LitData data set (``"litdata"``, written by
``litdata.optimize``: ``litdata_items.py``) holds them too, sharded by LitData itself, whose shards :func:`rank_batches`
reads from LitData (a ``StreamingDataset`` per rank, iterated in this process without a Trainer).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import litdata_items
import torch
from torch import Tensor, nn

# ----------------------------------------------------------------------------------------------- the messages
# Every refusal the matrix expects, as a regex on each rank's error. One place, to align with the final wording.
RESUME_WORLD = r"cannot be dealt again over another number of ranks"
AMBIGUOUS = r"ambiguous"
HOOK_AFTER_TRANSFER = r"on_after_batch_transfer"
HOOK_BEFORE_TRANSFER = r"on_before_batch_transfer"
MANUAL = r"manual optimization"
ITERATOR_COUNTER = r"ItemCounter counts the batches Lightning hands training_step.*dataloader_iter"
COMBINED_UNEVEN = r"different numbers of batches"
NONE_LOSS = r"training_step returned None"
SEQUENTIAL = r'does not support the `CombinedLoader\(mode="sequential"\)` mode'  # Lightning's own message
# LitData's own refusal where its default `drop_last` (True on 2 ranks, False on 1) changes with the ranks, as the
# plain control's even shards leave it
LITDATA_WORLD = r"The provided `drop_last` state doesn't match the current one"
MESSAGES = {
    "RESUME_WORLD": RESUME_WORLD,
    "AMBIGUOUS": AMBIGUOUS,
    "HOOK_AFTER_TRANSFER": HOOK_AFTER_TRANSFER,
    "HOOK_BEFORE_TRANSFER": HOOK_BEFORE_TRANSFER,
    "MANUAL": MANUAL,
    "ITERATOR_COUNTER": ITERATOR_COUNTER,
    "COMBINED_UNEVEN": COMBINED_UNEVEN,
    "NONE_LOSS": NONE_LOSS,
    "SEQUENTIAL": SEQUENTIAL,
}

ENGINES = ("ddp", "fsdp2", "fsdp1")
PATHS = ("after", "ahead")
LR = 0.1
LBFGS = {"lr": 0.5, "max_iter": 3, "history_size": 4}
WORLD = 2
LENGTHS = (7, 5)  # batches per rank and epoch, by default


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of the matrix (see the module docstring).

    Attributes:
        id: its name in test ids and in ``docs/compatibility.md``.
        area: the table's section.
        feature: what the row does, as the table says it.
        outcome: ``"exact"`` or ``"refused"``.
        message: a refused row's regex (one of :data:`MESSAGES`).
        front: ``"trainer"`` or ``"fabric"``.
        options: what the rank scripts and :func:`plan` read (see :func:`option`).
        engines, paths: the cells.
        home: the cell of the default suite.
        extra: checks beyond parameters, replicas, steps and batches (``"padding"``, ``"logged_items"``,
            ``"metric_items"``, ``"rank_batches"``: each rank's batches, in order and each in its own order, are
            :func:`rank_batches`; ``"plain_order"``: the plain control trains another order too, Lightning's #21938).
        plain: for an exact row, where the plain control stops with an error of Lightning's instead of training:
            ``{engine: regex}``.
    """

    id: str
    area: str
    feature: str
    outcome: str = "exact"
    message: str | None = None
    front: str = "trainer"
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    engines: tuple[str, ...] = ENGINES
    paths: tuple[str, ...] = PATHS
    home: tuple[str, str] = ("ddp", "after")
    extra: tuple[str, ...] = ()
    plain: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        assert self.outcome in ("exact", "refused"), self.id
        assert (self.message is not None) == (self.outcome == "refused"), self.id
        assert self.home[0] in self.engines and self.home[1] in self.paths, self.id

    @property
    def resumes(self) -> bool:
        """Whether the row trains in two runs: a first that checkpoints, a second that resumes in fresh processes."""
        return "resume_from" in self.options

    def cells(self) -> list[tuple[str, str]]:
        return [(engine, path) for engine in self.engines for path in self.paths]


DEFAULTS: dict[str, Any] = {
    "layout": "per_rank",  # per_rank | shared | user_sharded | iterable | combined | litdata
    "lengths": LENGTHS,  # per_rank, iterable: each rank's batches per epoch
    "epoch_lengths": None,  # per epoch, each rank's batches (with a train_dataloader reloaded every epoch)
    "items": 37,  # shared, user_sharded, litdata: the data set's items
    "batch_size": 3,  # shared, user_sharded, litdata
    "shuffle": True,  # shared: the loader's own `shuffle` (Lightning's sampler shuffles a train loader either way);
    # litdata: StreamingDataset(shuffle=...), which deals the items anew each epoch
    "loader": "plain",  # plain | stateful | subclass | batch_sampler
    "fabric_order": False,  # set by the plan of a Fabric row: Fabric's sampler shuffles only where the loader does
    "drop_last": None,  # litdata: StreamingDataLoader(drop_last=...); None is LitData's default (True on 2 ranks)
    "num_workers": 0,
    "mode": "tokens",  # tokens (a 0/1 mask per item) | examples (every item counts)
    "epochs": 2,
    "accumulate": 2,
    "schedule": None,  # GradientAccumulationScheduler's {epoch: A}
    "max_steps": -1,
    "limit_train_batches": None,
    "overfit_batches": 0,
    "validation": False,
    "val_lengths": (3, 2),  # each rank's validation batches
    "val_check_interval": None,
    "check_val_every_n_epoch": 1,
    "clip": None,
    "clip_algorithm": "norm",
    "precision": None,  # None: 64-true under DDP, a float64 model under FSDP2, float32 under FSDP1
    "reload": False,
    "max_time": None,  # seconds on a clock that advances one second per train batch
    "early_stopping": False,
    "hook": None,  # see matrix_worker.MatrixModule
    "stop_at": None,  # (epoch, batch_idx) where on_train_batch_start returns -1
    "optimizer": "sgd",  # sgd | lbfgs
    "momentum": 0.9,  # SGD's: with 0 it keeps no state, which a checkpoint must save and load all the same
    "state_dict_type": "sharded",  # FSDP1's checkpoints (Trainer and Fabric): sharded | full
    "combined": None,  # {"mode": ..., "lengths": [[loader 0 per rank], [loader 1 per rank]]}
    "checkpoint": None,  # "epoch" (at each epoch end) | k (every k optimizer steps)
    "raise_at": None,  # (epoch, batch_idx) where training_step raises on every rank (OnExceptionCheckpoint saves)
    "resume_from": None,  # the checkpoint the second run resumes from: a step number, or "exception"
    "resume_world": WORLD,  # the second run's ranks
    "first_world": WORLD,  # the first run's ranks, where it resumes on another number
    # Fabric
    "marking": "no_sync",  # no_sync | window_end
    "fabric_clip": None,  # fabric.clip_gradients(max_norm=...)
    "cycle_steps": None,  # a CycleIterator over the loader, this many optimizer steps
    "skip": None,  # how the resumed loop finds its place: fast-forwards ("continue" | "next"), or its loader's "state"
    "save_after": None,  # the optimizer step after which fabric.save writes its checkpoint
    "rollback": None,  # (save after step, load after step): fabric.load rolls back within the run
    "models": 1,  # Fabric: models trained side by side on the same batches, each its own optimizer (seeds 0, 1, ...)
}


def option(options: Mapping[str, Any], name: str) -> Any:
    assert name in DEFAULTS, name
    return options.get(name, DEFAULTS[name])


# --------------------------------------------------------------------------------------------------- the rows
TRAINER = "Trainer arguments"
HOOKS = "Hooks"
LOADERS = "Loaders"
RESUME = "Resume"
FABRIC = "Fabric loops"


def _combined_rows() -> list[Row]:
    """A CombinedLoader of two loaders in each mode, lockstep on both ranks (each rank as many combined batches)."""
    lengths = {
        "max_size_cycle": [[2, 1], [4, 4]],  # loader 0 cycles on both ranks: 4 combined batches each
        "max_size": [[2, 1], [4, 4]],  # loader 0's part is None once it is out: 4 each
        "min_size": [[3, 3], [4, 5]],  # 3 each
        "sequential": [[2, 1], [3, 4]],  # loader 0's batches, then loader 1's: 5 each
    }
    rows = []
    for mode, per_loader in lengths.items():
        name = mode.replace("_", "-")
        options = {"layout": "combined", "mode": "examples", "combined": {"mode": mode, "lengths": per_loader}}
        if mode == "sequential":  # Lightning's fit loop refuses it, under any strategy
            rows.append(
                Row(
                    f"combined-{name}",
                    LOADERS,
                    "CombinedLoader `sequential` as the train loader: Lightning's own refusal, under every strategy",
                    outcome="refused",
                    message=SEQUENTIAL,
                    options=options,
                    paths=("after", "ahead", "bare"),
                )
            )
            continue
        rows.append(
            Row(
                f"combined-{name}",
                LOADERS,
                f"CombinedLoader `{mode}` of two loaders, the loss the mean over every row of the combined batch;"
                " the count returned (after) or `ItemCounter('examples')` (ahead)",
                options=options,
                home=("ddp", "ahead") if mode == "max_size_cycle" else ("ddp", "after"),
            )
        )
        rows.append(
            Row(
                f"combined-{name}-bare",
                LOADERS,
                f"CombinedLoader `{mode}`, a bare loss and no `ItemCounter` (Lightning's batch size: the first"
                " loader's rows)",
                outcome="refused",
                message=AMBIGUOUS,
                options=options,
                paths=("bare",),
                home=("ddp", "bare"),
            )
        )
    rows.append(
        Row(
            "combined-min-size-uneven",
            LOADERS,
            "CombinedLoader `min_size` whose combined batches differ in number across ranks (2 and 1)",
            outcome="refused",
            message=COMBINED_UNEVEN,
            options={
                "layout": "combined",
                "mode": "examples",
                "combined": {"mode": "min_size", "lengths": [[2, 1], [4, 4]]},
            },
        )
    )
    return rows


ROWS: list[Row] = [
    # ---------------------------------------------------------------------------------------- Trainer arguments
    Row("accumulate", TRAINER, "`accumulate_grad_batches=3`, the short last window of each epoch (1 batch)",
        options={"accumulate": 3}, home=("ddp", "ahead")),
    Row("accumulation-scheduler", TRAINER, "`GradientAccumulationScheduler({0: 2, 1: 3})`",
        options={"schedule": {0: 2, 1: 3}}, home=("fsdp1", "ahead")),
    Row("max-steps", TRAINER, "`max_steps=2`: training stops mid-epoch", options={"max_steps": 2}),
    Row("max-epochs", TRAINER, "`max_epochs=3`", options={"epochs": 3}, home=("fsdp2", "after")),
    Row("limit-train-batches", TRAINER, "`limit_train_batches=6`: rank 0 trains 6 of its 7 batches",
        options={"limit_train_batches": 6}),
    Row("val-check-interval", TRAINER, "`val_check_interval=3`: validation mid-epoch, mid-window (A = 2)",
        options={"validation": True, "val_check_interval": 3}, home=("ddp", "ahead")),
    Row("check-val-every-n-epoch", TRAINER, "`check_val_every_n_epoch=2`, validation on uneven shards",
        options={"validation": True, "check_val_every_n_epoch": 2}),
    Row("clip-norm", TRAINER, "`gradient_clip_val=0.05`, `gradient_clip_algorithm='norm'`",
        options={"clip": 0.05, "clip_algorithm": "norm"}, home=("fsdp1", "after"),
        plain={"fsdp1": r"`gradient_clip_algorithm='norm'` is currently not supported for `FSDPPrecision`"}),
    Row("clip-value", TRAINER, "`gradient_clip_val=0.02`, `gradient_clip_algorithm='value'`",
        options={"clip": 0.02, "clip_algorithm": "value"}),
    Row("precision-64-true", TRAINER, "`precision='64-true'` (Lightning refuses it under FSDP)",
        options={"precision": "64-true"}, engines=("ddp",)),
    Row("precision-32-true", TRAINER, "`precision='32-true'`, a float32 model (to 1e-5)",
        options={"precision": "32-true"}),
    Row("precision-bf16-mixed", TRAINER, "`precision='bf16-mixed'` (to 3e-2; not FSDP1, whose Lightning precision"
        " autocasts on CUDA only)", options={"precision": "bf16-mixed"}, engines=("ddp", "fsdp2"),
        home=("ddp", "ahead")),
    Row("reload-dataloaders", TRAINER, "`reload_dataloaders_every_n_epochs=1`, ranks holding 7, 5 then 4, 6 batches",
        options={"reload": True, "epoch_lengths": ((7, 5), (4, 6))}),
    Row("user-sharded", TRAINER, "`use_distributed_sampler=False`, each rank its own `Subset` of 37 items",
        options={"layout": "user_sharded"}),
    Row("overfit-batches", TRAINER, "`overfit_batches=2`, 3 epochs", options={"overfit_batches": 2, "epochs": 3}),
    Row("max-time", TRAINER, "`max_time` on a clock of one second per batch: stops after 5 batches, mid-window",
        options={"max_time": 5}),
    Row("early-stopping", TRAINER, "`EarlyStopping(patience=0)` on a train-epoch metric: stops after 2 of 4 epochs",
        options={"early_stopping": True, "epochs": 4}),
    # -------------------------------------------------------------------------------------------------- hooks
    Row("transfer-cast", HOOKS, "`transfer_batch_to_device` and `on_after_batch_transfer` that move and cast the"
        " batch (its count unchanged)", options={"hook": "cast"}, home=("ddp", "ahead")),
    Row("transfer-mask", HOOKS, "`on_after_batch_transfer` masks targets (every id divisible by 3), counted after",
        options={"hook": "mask_after"}, paths=("after",)),
    Row("transfer-mask-counted-ahead", HOOKS, "`on_after_batch_transfer` masks targets, counted ahead by"
        " `ItemCounter` at the loader", outcome="refused", message=HOOK_AFTER_TRANSFER,
        options={"hook": "mask_after"}, paths=("ahead",), home=("ddp", "ahead")),
    Row("transfer-drop", HOOKS, "`on_before_batch_transfer` drops the last row of every batch of more than one,"
        " counted after", options={"hook": "drop_before"}, paths=("after",)),
    Row("transfer-drop-counted-ahead", HOOKS, "`on_before_batch_transfer` drops rows, counted ahead",
        outcome="refused", message=HOOK_BEFORE_TRANSFER, options={"hook": "drop_before"}, paths=("ahead",),
        home=("ddp", "ahead")),
    Row("batch-start-minus-one", HOOKS, "`on_train_batch_start` returns -1 at batch 3 of epoch 0 (mid-window)",
        options={"stop_at": (0, 3)}, home=("ddp", "ahead")),
    Row("on-before-backward", HOOKS, "`on_before_backward` reads the loss", options={"hook": "before_backward"}),
    Row("on-after-backward", HOOKS, "`on_after_backward` zeroes the output bias's gradient (freezes it)",
        options={"hook": "freeze"}, home=("fsdp2", "ahead")),
    Row("backward-override", HOOKS, "`LightningModule.backward` overridden: `loss.backward()`",
        options={"hook": "backward"}),
    Row("on-before-optimizer-step", HOOKS, "`on_before_optimizer_step` halves every gradient",
        options={"hook": "halve"}),
    Row("configure-gradient-clipping", HOOKS, "`configure_gradient_clipping` clips by value 0.02 from step 1 on",
        options={"hook": "configure_clipping"}),
    Row("optimizer-step-warmup", HOOKS, "`optimizer_step` overridden: lr warmup over 3 steps, then"
        " `optimizer.step(closure=...)`", options={"hook": "warmup"}, home=("ddp", "ahead")),
    Row("optimizer-zero-grad", HOOKS, "`optimizer_zero_grad` overridden: `zero_grad(set_to_none=False)`",
        options={"hook": "zero_grad"}),
    Row("lr-scheduler-step", HOOKS, "`lr_scheduler_step` overridden, a step-interval `StepLR(gamma=0.5)`",
        options={"hook": "scheduler"}),
    Row("lbfgs", HOOKS, "`torch.optim.LBFGS`: its closure runs `training_step` several times per step (A = 1;"
        " DDP only: LBFGS flattens DTensors, which FSDP2 refuses, and under FSDP1 its dot products cover a shard)",
        options={"optimizer": "lbfgs", "accumulate": 1}, engines=("ddp",), home=("ddp", "ahead")),
    Row("dataloader-iter", HOOKS, "`training_step(self, dataloader_iter)` (A = 1), counted after",
        options={"hook": "dataloader_iter", "accumulate": 1}, paths=("after",)),
    Row("dataloader-iter-counted-ahead", HOOKS, "`training_step(self, dataloader_iter)` with `ItemCounter`",
        outcome="refused", message=ITERATOR_COUNTER, options={"hook": "dataloader_iter", "accumulate": 1},
        paths=("ahead",), home=("ddp", "ahead")),
    Row("training-step-none", HOOKS, "`training_step` returns `None` for a batch, Lightning's way to skip it (here"
        " batch 0, every rank)", outcome="refused", message=NONE_LOSS, options={"hook": "none"}),
    Row("manual-optimization", HOOKS, "manual optimization (`automatic_optimization = False`)",
        outcome="refused", message=MANUAL, options={"hook": "manual"}),
    Row("log-sync-dist", HOOKS, "`self.log(..., sync_dist=True)` on step and epoch in `training_step`, with replays;"
        " the epoch's logged item sum is exact", options={"hook": "log"}, extra=("logged_items",)),
    Row("log-sync-dist-32-true", HOOKS, "the same `self.log(..., sync_dist=True)` in a `32-true` run (a float32"
        " model)", options={"hook": "log", "precision": "32-true"}, extra=("logged_items",)),
    Row("torchmetrics", HOOKS, "a torchmetrics `SumMetric(dist_sync_on_step=True)` updated in `training_step`, with"
        " replays; its epoch value is exact", options={"hook": "metric"}, extra=("metric_items",),
        home=("ddp", "ahead")),
    Row("padding-step", HOOKS, "`strategy.padding_step` read in a callback's and the module's `on_train_batch_start`"
        " says whether that batch is a replay", options={"hook": "flags"}, extra=("padding",)),
    # ------------------------------------------------------------------------------------------------ loaders
    Row("map-style-sampler", LOADERS, "a map-style data set of 37 items, batch size 3, sharded by Lightning's"
        " sampler (19 and 18 items): each item once per epoch", options={"layout": "shared"}),
    Row("iterable", LOADERS, "an `IterableDataset` of 7 and 5 batches (no length)",
        options={"layout": "iterable"}, home=("ddp", "ahead")),
    Row("stateful-sampler", LOADERS, "torchdata's `StatefulDataLoader(shuffle=False)` over the 37 items, Lightning's"
        " sampler inserted (it shuffles): each item once per epoch",
        options={"layout": "shared", "loader": "stateful", "shuffle": False}),
    Row("stateful-per-rank", LOADERS, "`StatefulDataLoader` over each rank's own batches"
        " (`use_distributed_sampler=False`)", options={"loader": "stateful"}, home=("ddp", "ahead")),
    *_combined_rows(),
    Row("dataloader-subclass", LOADERS, "a `DataLoader` subclass with an argument of its own, Lightning's sampler",
        options={"layout": "shared", "loader": "subclass"}),
    Row("num-workers", LOADERS, "`num_workers=2`", options={"num_workers": 2}),
    Row("batch-sampler", LOADERS, "a custom `BatchSampler` subclass (batches of 2, 3 and 4 in turn), Lightning's"
        " sampler inserted into it", options={"layout": "shared", "loader": "batch_sampler"},
        home=("ddp", "ahead")),
    Row("litdata-uneven", LOADERS, "LitData's `StreamingDataLoader(batch_size=4, drop_last=False)` over a"
        " `StreamingDataset(shuffle=True)` of the 37 items (`use_distributed_sampler` left on): LitData's own shards"
        " of 16 and 21 items (4 and 6 batches), each item once per epoch",
        options={"layout": "litdata", "batch_size": 4, "drop_last": False}, extra=("rank_batches",),
        home=("ddp", "ahead")),
    # ------------------------------------------------------------------------------------------------- resume
    Row("resume-epoch-end", RESUME, "checkpoint at the end of epoch 0, `fit(ckpt_path=...)` in fresh processes",
        options={"checkpoint": "epoch", "resume_from": 4}, home=("fsdp1", "after")),
    Row("resume-stateless-optimizer", RESUME, "a mid-epoch checkpoint (step 2) of an optimizer that keeps no state"
        " (SGD without momentum)", options={"checkpoint": 2, "resume_from": 2, "momentum": 0.0},
        home=("fsdp1", "after"), plain={"fsdp1": r'`optim_state_dict` must have the keys "state"'}),
    Row("resume-full-state-dict", RESUME, "a mid-epoch checkpoint (step 2) of FSDP1 with `state_dict_type='full'`",
        options={"checkpoint": 2, "resume_from": 2, "state_dict_type": "full"}, engines=("fsdp1",),
        home=("fsdp1", "after")),
    Row("resume-mid-epoch-stateful", RESUME, "mid-epoch checkpoint (step 2 of 4) with a `StatefulDataLoader`,"
        " every rank still holding data", options={"loader": "stateful", "checkpoint": 2, "resume_from": 2},
        home=("ddp", "ahead")),
    Row("resume-mid-replay", RESUME, "mid-epoch checkpoint at step 3 while rank 1 replays (it holds no real batch"
        " left), `StatefulDataLoader`", options={"loader": "stateful", "checkpoint": 3, "resume_from": 3}),
    Row("resume-mid-replay-litdata", RESUME, "mid-epoch checkpoint at step 5 of 6 (A = 1) while rank 0 replays (its 4"
        " batches trained), the `StreamingDataLoader` of `litdata-uneven`: the rest of the epoch and the next one as"
        " uninterrupted (litData#770 replayed the resumed place in the next epoch)",
        options={"layout": "litdata", "batch_size": 4, "drop_last": False, "accumulate": 1, "checkpoint": 5,
                 "resume_from": 5}, extra=("rank_batches",)),
    Row("resume-mid-window", RESUME, "`OnExceptionCheckpoint` after an exception on every rank at batch 4, the"
        " middle of a window (A = 3), `StatefulDataLoader`: the window restarts with the batches after the failure"
        " (Lightning saves no accumulated gradient)",
        options={"loader": "stateful", "accumulate": 3, "raise_at": (0, 4), "resume_from": "exception"}),
    Row("resume-mid-epoch-stateless", RESUME, "mid-epoch checkpoint (step 2) with a plain `DataLoader`",
        options={"checkpoint": 2, "resume_from": 2}, home=("ddp", "ahead")),
    Row("resume-mid-epoch-later-stateful", RESUME, "mid-epoch checkpoint in epoch 1 (step 6 of 8), a"
        " `StatefulDataLoader` through Lightning's sampler, which deals each epoch anew",
        options={"layout": "shared", "loader": "stateful", "shuffle": False, "checkpoint": 6, "resume_from": 6}),
    Row("resume-mid-epoch-later-litdata", RESUME, "mid-epoch checkpoint in epoch 1 (step 4 of 6), the"
        " `StreamingDataLoader` of `litdata-uneven`",
        options={"layout": "litdata", "batch_size": 4, "drop_last": False, "checkpoint": 4, "resume_from": 4},
        extra=("rank_batches",)),
    Row("resume-mid-epoch-later-litdata-workers", RESUME, "`resume-mid-epoch-later-litdata` with"
        " `num_workers=2`", options={"layout": "litdata", "batch_size": 4, "drop_last": False, "num_workers": 2,
                                      "checkpoint": 4, "resume_from": 4}, extra=("rank_batches",)),
    Row("resume-epoch-last-batch-stateful", RESUME, "`every_n_train_steps=4` lands on epoch 0's last batch (rank 0's"
        " 7th, rank 1 replaying), a `StatefulDataLoader` through Lightning's sampler",
        options={"layout": "shared", "loader": "stateful", "shuffle": False, "checkpoint": 4, "resume_from": 4}),
    Row("resume-epoch-last-batch-litdata", RESUME, "`every_n_train_steps=3` lands on epoch 0's last batch, the"
        " `StreamingDataLoader` of `litdata-uneven`",
        options={"layout": "litdata", "batch_size": 4, "drop_last": False, "checkpoint": 3, "resume_from": 3},
        extra=("rank_batches",)),
    Row("resume-every-n-epochs-litdata", RESUME, "`ModelCheckpoint(every_n_epochs=1)` with the `StreamingDataLoader`"
        " of `litdata-uneven`", options={"layout": "litdata", "batch_size": 4, "drop_last": False,
                                         "checkpoint": "epoch", "resume_from": 3},
        extra=("rank_batches", "plain_order")),
    Row("resume-every-n-epochs-stateful", RESUME, "`ModelCheckpoint(every_n_epochs=1)` with a `StatefulDataLoader`"
        " through Lightning's sampler", options={"layout": "shared", "loader": "stateful", "shuffle": False,
                                                "checkpoint": "epoch", "resume_from": 4}),
    Row("resume-world-2-to-1", RESUME, "a mid-epoch checkpoint of 2 ranks (step 2) resumed on 1, a map-style data"
        " set through Lightning's sampler: the items no step took, in the epoch's order, dealt over the new ranks",
        options={"layout": "shared", "checkpoint": 2, "resume_from": 2, "resume_world": 1}),
    Row("resume-world-1-to-2", RESUME, "a mid-epoch checkpoint of 1 rank (step 3) resumed on 2, the same data set",
        options={"layout": "shared", "checkpoint": 3, "resume_from": 3, "first_world": 1}),
    Row("resume-world-2-to-1-stateful", RESUME, "`resume-world-2-to-1` with a `StatefulDataLoader` through"
        " Lightning's sampler", options={"layout": "shared", "loader": "stateful", "shuffle": False, "checkpoint": 2,
                                         "resume_from": 2, "resume_world": 1}),
    Row("resume-world-1-to-2-stateful", RESUME, "`resume-world-1-to-2` with a `StatefulDataLoader` through"
        " Lightning's sampler", options={"layout": "shared", "loader": "stateful", "shuffle": False, "checkpoint": 3,
                                         "resume_from": 3, "first_world": 1}),
    Row("resume-world-2-to-1-litdata", RESUME, "a mid-epoch checkpoint of 2 ranks at step 5 of 6 (A = 1, rank 0"
        " replaying) resumed on 1, the `StreamingDataLoader` of `litdata-uneven`: LitData's elastic resume from the"
        " 36 items the steps took", options={"layout": "litdata", "batch_size": 4, "drop_last": False,
                                            "accumulate": 1, "checkpoint": 5, "resume_from": 5, "resume_world": 1},
        plain=dict.fromkeys(ENGINES, LITDATA_WORLD)),
    Row("resume-world-2-to-1-litdata-workers", RESUME, "`resume-world-2-to-1-litdata` with `num_workers=2`",
        options={"layout": "litdata", "batch_size": 4, "drop_last": False, "accumulate": 1, "num_workers": 2,
                 "checkpoint": 5, "resume_from": 5, "resume_world": 1},
        plain=dict.fromkeys(ENGINES, LITDATA_WORLD)),
    Row("resume-world-1-to-2-litdata", RESUME, "a mid-epoch checkpoint of 1 rank at step 3 (A = 1) resumed on 2,"
        " LitData: it resumes from a whole batch of both ranks (8 items), so rank 0 skips the batch the steps took"
        " past it", options={"layout": "litdata", "batch_size": 4, "drop_last": False, "accumulate": 1,
                             "checkpoint": 3, "resume_from": 3, "first_world": 1},
        plain=dict.fromkeys(ENGINES, LITDATA_WORLD)),
    Row("resume-world-4-to-2", RESUME, "`resume-world-2-to-1` from a checkpoint of 4 ranks (step 1) resumed on 2",
        options={"layout": "shared", "checkpoint": 1, "resume_from": 1, "first_world": 4, "resume_world": 2},
        engines=("ddp",)),
    Row("resume-world-4-to-2-litdata", RESUME, "`resume-world-2-to-1-litdata` from a checkpoint of 4 ranks (step 2)"
        " resumed on 2", options={"layout": "litdata", "batch_size": 4, "drop_last": False, "accumulate": 1,
                                   "checkpoint": 2, "resume_from": 2, "first_world": 4, "resume_world": 2},
        engines=("ddp",)),
    Row("resume-world-size-mid-epoch", RESUME, "a mid-epoch checkpoint of 2 ranks resumed on 1, each rank's own data"
        " in a `StatefulDataLoader` (`use_distributed_sampler=False`)", outcome="refused", message=RESUME_WORLD,
        options={"loader": "stateful", "checkpoint": 2, "resume_from": 2, "resume_world": 1}),
    Row("resume-world-iterable", RESUME, "a mid-epoch checkpoint of 2 ranks resumed on 1, an `IterableDataset` of"
        " each rank's own batches", outcome="refused", message=RESUME_WORLD,
        options={"layout": "iterable", "checkpoint": 2, "resume_from": 2, "resume_world": 1}),
    Row("resume-world-size-epoch-end", RESUME, "an epoch-end checkpoint of 2 ranks resumed on 1, which holds both"
        " ranks' batches", options={"checkpoint": "epoch", "resume_from": 4, "resume_world": 1}),
    # -------------------------------------------------------------------------------------------------- fabric
    Row("fabric-no-backward-sync", FABRIC, "accumulation with `fabric.no_backward_sync`, A = 3",
        front="fabric", extra=("padding",), options={"accumulate": 3}),
    Row("fabric-window-end", FABRIC, "windows marked with `fabric.backward(..., window_end=...)`, no"
        " `no_backward_sync`", front="fabric", extra=("padding",), options={"marking": "window_end"},
        home=("ddp", "ahead")),
    Row("fabric-clip-gradients", FABRIC, "`fabric.clip_gradients(max_norm=0.05)` before each step",
        front="fabric", extra=("padding",), options={"fabric_clip": 0.05}, home=("fsdp2", "after")),
    Row("fabric-uneven-shards", FABRIC, "`fabric.setup_dataloaders` over 37 items, batch size 3: 7 and 6 batches,"
        " replays", front="fabric", extra=("padding",), options={"layout": "shared"}, home=("ddp", "ahead")),
    Row("fabric-resume-continue", FABRIC, "a resume in fresh processes that fast-forwards with `continue` past 6"
        " batches, rank 1 replaying", front="fabric", extra=("padding",), options={"save_after": 3, "skip": "continue",
                                                                 "resume_from": 3}),
    Row("fabric-resume-next", FABRIC, "a resume that fast-forwards with `next()` past 6 batches, rank 1 replaying",
        front="fabric", extra=("padding",), options={"save_after": 3, "skip": "next", "resume_from": 3},
        home=("ddp", "ahead")),
    Row("fabric-resume-state-litdata", FABRIC, "LitGPT's pretraining loop: the `StreamingDataLoader` of"
        " `litdata-uneven` saved and loaded with `fabric.save`/`fabric.load` mid epoch 1 (step 4), every rank back in"
        " its own place", front="fabric", extra=("padding",),
        options={"layout": "litdata", "batch_size": 4, "drop_last": False, "save_after": 4, "resume_from": 4,
                 "skip": "state"}),
    Row("fabric-resume-state-stateful", FABRIC, "a `StatefulDataLoader` through Fabric's sampler saved and loaded with"
        " `fabric.save`/`fabric.load` mid epoch 1 (step 6)", front="fabric", extra=("padding",),
        options={"layout": "shared", "loader": "stateful", "shuffle": False, "save_after": 6, "resume_from": 6,
                 "skip": "state"}),
    Row("fabric-two-models", FABRIC, "two models trained side by side (an actor-critic loop's shape), each its own"
        " optimizer and windows: `fabric.backward(loss, model=...)`, `count_ahead(..., model=...)`", front="fabric",
        extra=("padding",), options={"models": 2}, home=("ddp", "ahead")),
    Row("fabric-rollback", FABRIC, "`fabric.save` after step 1, `fabric.load` after step 3, training on",
        front="fabric", extra=("padding",), options={"rollback": (1, 3)}),
    Row("fabric-cycle-iterator", FABRIC, "a LitGPT-style `CycleIterator`: windows of 3 cross the epoch boundary",
        front="fabric", extra=("padding",), options={"cycle_steps": 5, "accumulate": 3}, home=("ddp", "ahead")),
    Row("fabric-save-load", FABRIC, "`fabric.save` at the end of epoch 0, `fabric.load` in fresh processes",
        front="fabric", extra=("padding",), options={"save_after": 4, "resume_from": 4}),
    Row("fabric-save-load-full", FABRIC, "`fabric-save-load` with FSDP1's `state_dict_type='full'` (LitGPT's) on the"
        " CPU, and an optimizer that keeps no state (SGD without momentum)", front="fabric", extra=("padding",),
        engines=("fsdp1",), home=("fsdp1", "after"),
        plain={"fsdp1": r"Segmentation fault|Connection (reset|closed) by peer"},
        options={"save_after": 4, "resume_from": 4, "state_dict_type": "full", "momentum": 0.0}),
    Row("fabric-save-load-stateless", FABRIC, "`fabric-save-load` with an optimizer that keeps no state (SGD without"
        " momentum), FSDP1's checkpoint sharded", front="fabric", extra=("padding",), home=("fsdp1", "after"),
        options={"save_after": 4, "resume_from": 4, "momentum": 0.0},
        plain={"fsdp1": r'`optim_state_dict` must have the keys "state"'}),
]  # fmt: skip

BY_ID = {row.id: row for row in ROWS}
assert len(BY_ID) == len(ROWS), "row ids are unique"


# --------------------------------------------------------------------------------------------------- the data
RANK_STRIDE, LOADER_STRIDE, EPOCH_STRIDE, BATCH_STRIDE = 100_000, 20_000, 1_000, 10


def values(ids: Tensor, mode: str = "tokens") -> tuple[Tensor, Tensor, Tensor]:
    """The items named by ``ids``: inputs ``x`` [n, 3], targets ``y`` [n], weights ``w`` [n] (a 0/1 mask), float64.

    Rank 1's own items have targets 2 higher, so that a mean of rank means misses the item mean.
    """
    i = ids.double()
    x = torch.stack([torch.sin(0.731 * i + 0.3), torch.cos(1.37 * i), torch.sin(0.173 * i + 1.1)], dim=-1)
    rank = ((ids // RANK_STRIDE) % 2).double()
    y = torch.cos(0.377 * i) + 2.0 * rank
    if mode == "examples":
        return x, y, torch.ones_like(y)
    # about 70% of the items count; the first of each per-rank batch always does
    w = ((((ids * 7919) % 10) < 7) | (ids % BATCH_STRIDE == 0)).double()
    return x, y, w


def batch_ids(rank: int, epoch: int, k: int, loader: int = 0) -> list[int]:
    """Rank ``rank``'s batch ``k`` of ``epoch`` (of loader ``loader``): rank 0 holds 1 to 3 items, rank 1 4 to 6."""
    size = 1 + (k + epoch + loader) % 3 + 3 * rank
    base = RANK_STRIDE * rank + LOADER_STRIDE * loader + EPOCH_STRIDE * epoch + BATCH_STRIDE * k
    return list(range(base, base + size))


def lengths_at(options: Mapping[str, Any], epoch: int) -> Sequence[int]:
    per_epoch = option(options, "epoch_lengths")
    return per_epoch[epoch] if per_epoch is not None else option(options, "lengths")


def rank_batches(options: Mapping[str, Any], rank: int, epoch: int, world_size: int = WORLD) -> list[list[int]]:
    """What rank ``rank`` of ``world_size`` trains in ``epoch``, batch by batch (a list of item ids each).

    ``per_rank`` and ``iterable``: its own batches (on one rank: both ranks' batch ``k`` as its batch ``k``).
    ``shared``: the data set sharded without padding (the permutation ``DistributedSampler`` draws with seed
    ``epoch``, rank ``r`` taking every ``world_size``-th index from ``r``), batched in order. Lightning inserts its
    sampler with ``shuffle=True`` into every train loader, whatever the loader's own ``shuffle``. ``user_sharded``: the
    user's own ``Subset`` of every second item, in order. ``litdata``: what LitData itself deals rank ``rank`` of
    ``world_size`` (``litdata_items.shards``: the row's loader iterated epoch after epoch in this process, LitData's
    distributed environment set to that rank), items in LitData's order.
    """
    layout = option(options, "layout")
    if layout == "litdata":
        epochs = max(int(option(options, "epochs")), epoch + 1)
        return litdata_items.shards(_litdata_options(options), epochs, world_size)[rank][epoch]
    if layout in ("per_rank", "iterable"):
        if world_size == 1:
            ranks = [rank_batches(options, r, epoch) for r in range(WORLD)]
            return [[i for b in ranks if k < len(b) for i in b[k]] for k in range(max(map(len, ranks)))]
        return [batch_ids(rank, epoch, k) for k in range(lengths_at(options, epoch)[rank])]
    items, size = option(options, "items"), option(options, "batch_size")
    if layout == "user_sharded":
        mine = list(range(rank, items, WORLD))
    else:
        mine = epoch_order(options, epoch)[rank::world_size]
    if option(options, "loader") == "batch_sampler":
        return list(_varied(mine))
    return [mine[i : i + size] for i in range(0, len(mine), size)]


def epoch_order(options: Mapping[str, Any], epoch: int) -> list[int]:
    """The order in which the sampler a front end inserts deals ``epoch``'s items: the Trainer's shuffles whatever the
    loader's own ``shuffle`` (seed 0 + the epoch), Fabric's only where the loader's does (``fabric_order``)."""
    items = option(options, "items")
    if option(options, "fabric_order") and not option(options, "shuffle"):
        return list(range(items))
    return torch.randperm(items, generator=torch.Generator().manual_seed(epoch)).tolist()


def _litdata_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """What a LitData row's loader is built from."""
    names = ("items", "batch_size", "shuffle", "drop_last", "mode", "num_workers")
    return {name: option(options, name) for name in names}


def _varied(indices: list[int]) -> Iterator[list[int]]:
    """``VariedBatchSampler``'s batches: 2, 3 and 4 indices in turn."""
    start, turn = 0, 0
    while start < len(indices):
        size = 2 + turn % 3
        yield indices[start : start + size]
        start, turn = start + size, turn + 1


def combined_batches(options: Mapping[str, Any], rank: int, epoch: int) -> list[list[list[int]]]:
    """Rank ``rank``'s combined batches: each a list of the item ids of its parts (one per loader that gave one)."""
    spec = option(options, "combined")
    lengths = [n[rank] for n in spec["lengths"]]
    own = [[batch_ids(rank, epoch, k, loader) for k in range(n)] for loader, n in enumerate(lengths)]
    mode = spec["mode"]
    if mode == "sequential":
        return [[b] for loader in own for b in loader]
    if mode == "min_size":
        return [[loader[k] for loader in own] for k in range(min(lengths))]
    steps = []
    for k in range(max(lengths)):
        if mode == "max_size_cycle":
            steps.append([loader[k % len(loader)] for loader in own])
        else:  # max_size: a loader out of batches gives none
            steps.append([loader[k] for loader in own if k < len(loader)])
    return steps


# ------------------------------------------------------------------------------------------------- the model
def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))


def item_losses(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return 0.5 * (model(x).squeeze(-1) - y) ** 2


def masked_mean(losses: Tensor, w: Tensor) -> Tensor:
    """``Σ w·ℓ / Σ w``, the mean over a microbatch's valid items (0 where none is valid)."""
    total = w.sum()
    return (losses * w).sum() / torch.where(total > 0, total, torch.ones_like(total))


def transformed(options: Mapping[str, Any], ids: list[int]) -> tuple[list[int], Tensor | None]:
    """The ids a hook leaves in a batch, and the weights it sets (``None``: the items' own).

    ``mask_after`` masks every id divisible by 3; ``drop_before`` drops the last row of a batch of several.
    """
    hook = option(options, "hook")
    if hook == "drop_before" and len(ids) > 1:
        return ids[:-1], None
    if hook == "mask_after":
        _, _, w = values(torch.tensor(ids), option(options, "mode"))
        return ids, torch.where(torch.tensor(ids) % 3 == 0, 0.0, w)
    return ids, None


# ---------------------------------------------------------------------------------------------------- the plan
@dataclasses.dataclass
class Step:
    """One optimizer step of the reference: every item its window trains, over all ranks and microbatches.

    ``weights`` (one per id) replaces the items' own where a hook changed them; ``restore`` (Fabric's rollback)
    resets the model to the parameters after that many steps first and trains nothing.
    """

    ids: list[int] = dataclasses.field(default_factory=list)
    weights: list[float] | None = None
    lr: float = LR
    clip: tuple[str, float] | None = None
    restore: int | None = None


def accumulate_at(options: Mapping[str, Any], epoch: int) -> int:
    schedule = option(options, "schedule")
    if schedule is None:
        return int(option(options, "accumulate"))
    return int(max(a for e, a in schedule.items() if int(e) <= epoch))


def epoch_batches(options: Mapping[str, Any], epoch: int, world_size: int = WORLD) -> list[list[list[int]]]:
    """Every rank's batches of ``epoch`` as Lightning hands them to ``training_step`` (after the Trainer's limits)."""
    if option(options, "layout") == "combined":
        combined = [combined_batches(options, r, epoch) for r in range(world_size)]
        return [[[i for part in parts for i in part] for parts in rank] for rank in combined]
    ranks = [rank_batches(options, r, epoch, world_size) for r in range(world_size)]
    limit = option(options, "limit_train_batches") or option(options, "overfit_batches") or None
    return [b[:limit] for b in ranks] if limit else ranks


def _step(options: Mapping[str, Any], held: list[list[int]], index: int) -> Step:
    ids: list[int] = []
    weights: list[float] = []
    changed = False
    for batch in held:
        kept, w = transformed(options, batch)
        ids += kept
        changed = changed or w is not None
        weights += (w if w is not None else values(torch.tensor(kept), option(options, "mode"))[2]).tolist()
    hook = option(options, "hook")
    lr = LR
    if hook == "warmup":
        lr = LR * min(1.0, (index + 1) / 3)
    elif hook == "scheduler":
        lr = LR * 0.5**index
    elif hook == "halve":
        lr = LR * 0.5  # SGD: halving the gradient is halving the step
    clip = None
    if option(options, "clip") is not None:
        clip = (option(options, "clip_algorithm"), float(option(options, "clip")))
    if option(options, "fabric_clip") is not None:
        clip = ("norm", float(option(options, "fabric_clip")))
    if hook == "configure_clipping" and index >= 1:
        clip = ("value", 0.02)
    return Step(ids, weights if changed else None, lr, clip)


def plan(row: Row, options: Mapping[str, Any] | None = None) -> list[Step]:
    """The optimizer steps the row's uninterrupted run trains, each with every item of its window, by the rules of
    Lightning (or of the row's Fabric loop) and the objective, never by the strategy's code."""
    options = row.options if options is None else options
    return fabric_plan(options) if row.front == "fabric" else trainer_plan(options)


def positions(options: Mapping[str, Any], epoch: int) -> list[list[list[int]]]:
    """Every rank's real batch at each position of ``epoch`` (a rank out of data holds none there).

    A run resumed mid-epoch on another number of ranks (``resume_world`` beside ``first_world``) trains the
    positions before its checkpoint on the first run's ranks; the items of the epoch no step took are dealt over the
    new ranks in the epoch's order, each rank taking every ``resume_world``-th (:func:`dealt`).
    """
    first, resumed = option(options, "first_world"), option(options, "resume_world")
    moved = resumed_place(options) if first != resumed else None
    world = first if moved is None or (epoch, 0) < moved else resumed  # an epoch's end resumes the next one whole
    ranks = epoch_batches(options, epoch, world)
    held = [[b[k] for b in ranks if k < len(b)] for k in range(max(map(len, ranks)))]
    if moved is None or (epoch, 0) >= moved or epoch != moved[0]:
        return held
    start = moved[1]
    taken = {i for batches in held[:start] for batch in batches for i in batch}
    if option(options, "layout") == "litdata":
        new = litdata_items.elastic(_litdata_options(options), epoch, taken, first, resumed)
    else:
        new = dealt(options, epoch, taken, resumed)
    left = sorted(i for rank in new for batch in rank for i in batch)
    assert not set(left) & taken and len(left) + len(taken) == len({*left, *taken}), "each item once"
    return held[:start] + [[b[k] for b in new if k < len(b)] for k in range(max(map(len, new)))]


def resumed_place(options: Mapping[str, Any]) -> tuple[int, int] | None:
    """The epoch and position at which the run resumes from step ``resume_from`` (``None``: it does not)."""
    resume_from = option(options, "resume_from")
    if not isinstance(resume_from, int):
        return None
    world, steps = option(options, "first_world"), 0
    for epoch in range(option(options, "epochs")):
        a = accumulate_at(options, epoch)
        longest = max(map(len, epoch_batches(options, epoch, world)))
        for start in range(0, longest, a):
            if steps == resume_from:
                return epoch, start
            steps += 1
    return None


def dealt(options: Mapping[str, Any], epoch: int, taken: set[int], world: int) -> list[list[list[int]]]:
    """The items of ``epoch`` not in ``taken``, in the epoch's order, dealt over ``world`` ranks in turn, batched."""
    size = option(options, "batch_size")
    left = [i for i in epoch_order(options, epoch) if i not in taken]
    return [[mine[i : i + size] for i in range(0, len(mine), size)] for mine in (left[r::world] for r in range(world))]


def trainer_plan(options: Mapping[str, Any]) -> list[Step]:
    steps: list[Step] = []
    epochs = 2 if option(options, "early_stopping") else option(options, "epochs")  # stops after epoch 1
    max_steps, max_time, stop_at = option(options, "max_steps"), option(options, "max_time"), option(options, "stop_at")
    clock = 0  # train batches so far (the max_time clock, one second each)
    resumed_at = option(options, "raise_at") if option(options, "resume_from") == "exception" else None
    for epoch in range(epochs):
        held_at = positions(options, epoch)
        a, longest = accumulate_at(options, epoch), len(held_at)
        for start in range(0, longest, a):
            window = range(start, min(start + a, longest))
            if stop_at is not None and stop_at[0] == epoch and window.stop > stop_at[1]:
                break  # the epoch ends before batch stop_at[1]: the half window before it is dropped
            if max_time is not None and clock + window.stop > max_time:
                return steps  # the clock runs out inside this window: Lightning stops after that batch
            if resumed_at is not None and resumed_at[0] == epoch and resumed_at[1] in window:
                # Lightning saves no accumulated gradient: the interrupted window trains what came after the failure
                window = range(resumed_at[1], window.stop)
            held = [batch for k in window for batch in held_at[k]]
            steps.append(_step(options, held, len(steps)))
            if max_steps > 0 and len(steps) == max_steps:
                return steps
        clock += longest
    return steps


def fabric_stream(options: Mapping[str, Any], rank: int) -> Iterator[tuple[int, int, list[int] | None]]:
    """What a rank's Fabric loop fetches: ``(epoch, index, ids)``, ``ids`` ``None`` for a replay; a cycle over
    epochs where ``cycle_steps`` says so."""
    epoch, options = 0, {**options, "fabric_order": True}
    while True:
        ranks = [rank_batches(options, r, epoch) for r in range(WORLD)]
        longest = max(map(len, ranks))
        for index in range(longest):
            yield epoch, index, ranks[rank][index] if index < len(ranks[rank]) else None
        epoch += 1
        if option(options, "cycle_steps") is None and epoch == option(options, "epochs"):
            return


def fabric_windows(options: Mapping[str, Any]) -> list[list[tuple[int, int]]]:
    """The Fabric loop's windows: the ``(epoch, index)`` of each microbatch (the same on every rank)."""
    a, cycle = int(option(options, "accumulate")), option(options, "cycle_steps")
    positions = [(e, i) for e, i, _ in fabric_stream(options, 0)] if cycle is None else []
    if cycle is not None:
        stream = fabric_stream(options, 0)
        positions = [next(stream)[:2] for _ in range(cycle * a)]
        return [positions[s : s + a] for s in range(0, len(positions), a)]
    windows: list[list[tuple[int, int]]] = []
    for position in positions:
        if not windows or len(windows[-1]) == a or windows[-1][-1][0] != position[0]:
            windows.append([])
        windows[-1].append(position)
    return windows


def fabric_plan(options: Mapping[str, Any]) -> list[Step]:
    batches = {}
    for rank in range(WORLD):
        for epoch, index, ids in fabric_stream_bounded(options, rank):
            batches[(rank, epoch, index)] = ids
    steps = [
        _step(options, [batches[(r, *p)] for r in range(WORLD) for p in window if batches[(r, *p)] is not None], n)
        for n, window in enumerate(fabric_windows(options))
    ]
    rollback = option(options, "rollback")
    if rollback is not None:
        saved, loaded = rollback
        steps = [*steps[:loaded], Step(restore=saved), *steps[loaded:]]  # back to the parameters after `saved`
    return steps


def fabric_stream_bounded(options: Mapping[str, Any], rank: int) -> Iterator[tuple[int, int, list[int] | None]]:
    """:func:`fabric_stream`, ending where the loop ends (after ``cycle_steps`` windows of a cycle)."""
    cycle = option(options, "cycle_steps")
    stream = fabric_stream(options, rank)
    if cycle is None:
        yield from stream
        return
    for _ in range(cycle * int(option(options, "accumulate"))):
        yield next(stream)


def replays(options: Mapping[str, Any], front: str, world_size: int = WORLD) -> list[list[tuple[int, int]]]:
    """Each rank's replayed batches, as ``(epoch, batch_idx)``: the positions past its own data."""
    if front == "fabric":
        return [[(e, i) for e, i, ids in fabric_stream_bounded(options, r) if ids is None] for r in range(world_size)]
    found: list[list[tuple[int, int]]] = [[] for _ in range(world_size)]
    for epoch in range(option(options, "epochs")):
        ranks = epoch_batches(options, epoch, world_size)
        longest = max(map(len, ranks))
        for r, own in enumerate(ranks):
            found[r] += [(epoch, i) for i in range(len(own), longest)]
    return found


# ---------------------------------------------------------------------------------------------- the reference
def reference(row: Row, steps: list[Step], options: Mapping[str, Any] | None = None) -> list[Tensor]:
    """Trains a float64 copy of the model on each step's ``Σ w·ℓ / Σ w`` over the items of the step (SGD with
    momentum at each step's lr, or LBFGS); a step without items changes nothing. Returns the final parameters (of
    each model in turn, where ``models`` trains several side by side)."""
    options = row.options if options is None else options
    return [p for seed in range(option(options, "models")) for p in _reference(steps, options, seed)]


def _reference(steps: list[Step], options: Mapping[str, Any], seed: int) -> list[Tensor]:
    model = copy.deepcopy(make_model(seed)).double()
    lbfgs = option(options, "optimizer") == "lbfgs"
    optimizer: torch.optim.Optimizer = (
        torch.optim.LBFGS(model.parameters(), **LBFGS)
        if lbfgs
        else torch.optim.SGD(model.parameters(), lr=LR, momentum=option(options, "momentum"))
    )
    saved = [copy.deepcopy((model.state_dict(), optimizer.state_dict()))]  # after each step
    for step in steps:
        if step.restore is not None:
            model.load_state_dict(saved[step.restore][0])
            optimizer.load_state_dict(saved[step.restore][1])
            saved.append(saved[step.restore])
            continue
        x, y, w = values(torch.tensor(step.ids, dtype=torch.long), option(options, "mode"))
        if step.weights is not None:
            w = torch.tensor(step.weights, dtype=torch.float64)
        if w.sum() == 0:
            saved.append(saved[-1])
            continue  # a window without items changes nothing

        def closure(x: Tensor = x, y: Tensor = y, w: Tensor = w, step: Step = step) -> Tensor:
            optimizer.zero_grad()
            loss = (item_losses(model, x, y) * w).sum() / w.sum()
            loss.backward()
            if option(options, "hook") == "freeze":
                model[2].bias.grad.zero_()
            if step.clip is not None and step.clip[0] == "value":
                torch.nn.utils.clip_grad_value_(model.parameters(), step.clip[1])
            elif step.clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), step.clip[1])
            return loss

        for group in optimizer.param_groups:
            group["lr"] = LBFGS["lr"] if lbfgs else step.lr
        if lbfgs:
            optimizer.step(closure)
        else:
            closure()
            optimizer.step()
        saved.append(copy.deepcopy((model.state_dict(), optimizer.state_dict())))
    return [p.detach().clone() for p in model.parameters()]


def max_relative_error(params: Sequence[Tensor], expected: Sequence[Tensor]) -> float:
    scale = max(float(e.abs().max()) for e in expected)
    return max(float((p.double() - e).abs().max()) for p, e in zip(params, expected, strict=True)) / scale


def tables() -> str:
    """The tables of ``docs/compatibility.md``: the rows, then the messages (``python matrix.py`` prints them)."""
    names = {regex: name for name, regex in MESSAGES.items()}
    header = ["row", "area", "feature", "outcome", "message", "engines", "count paths", "test (home cell)"]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for r in ROWS:
        message = f"`{names[r.message]}`" if r.message else ""
        cells = [f"`{r.id}`", r.area, r.feature, r.outcome, message, ", ".join(r.engines), ", ".join(r.paths)]
        lines.append("| " + " | ".join([*cells, f"`{r.id}-{r.home[0]}-{r.home[1]}`"]) + " |")
    lines += ["", "| name | regex |", "|---|---|"]
    for name, regex in MESSAGES.items():
        quote = "``" if "`" in regex else "`"  # a code span holding a backtick
        lines.append(f"| `{name}` | {quote}{regex}{quote} |")
    return "\n".join(lines)


def tolerance(row: Row, engine: str) -> float:
    """How close an exact cell must come to the float64 reference."""
    precision = option(row.options, "precision")
    if precision == "bf16-mixed":
        return 3e-2
    if precision == "32-true" or engine == "fsdp1":
        return 1e-5  # float32 (FSDP1 casts the float64 model to float32)
    return 1e-9


if __name__ == "__main__":
    print(tables())
