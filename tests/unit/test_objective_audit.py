"""`ObjectiveAudit`: its pure helpers, its arguments, and single-process runs (no extra processes)."""

from __future__ import annotations

import csv
import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor, nn

from lightning_weighted.monitor import imbalance
from lightning_weighted.trainer.audit import (
    ObjectiveAudit,
    ObjectiveMismatchError,
    is_audit_rerun,
    relative_error,
    spread,
)


def test_the_audit_lives_in_the_trainers_room_and_keeps_its_public_import_paths():
    import lightning_weighted
    import lightning_weighted.audit as public

    assert ObjectiveAudit.__module__ == "lightning_weighted.trainer.audit"
    assert public.ObjectiveAudit is lightning_weighted.ObjectiveAudit is ObjectiveAudit
    assert public.is_audit_rerun is lightning_weighted.is_audit_rerun is is_audit_rerun
    assert public.ObjectiveMismatchError is ObjectiveMismatchError


def test_relative_error_of_plain_ddp_on_the_worked_trace_is_one_fifth():
    # |2.0 - 2.5| / 2.5
    assert relative_error(torch.tensor([2.0]), torch.tensor([2.5])) == pytest.approx(0.2)


def test_relative_error_is_normalised_by_the_largest_expected_entry():
    # max |[1, 0.5] - [1, 0]| / max |[1, 0]|
    assert relative_error(torch.tensor([1.0, 0.5]), torch.tensor([1.0, 0.0])) == pytest.approx(0.5)


def test_relative_error_is_zero_for_two_zero_gradients_and_infinite_against_a_zero_target():
    assert relative_error(torch.zeros(3), torch.zeros(3)) == 0.0
    assert relative_error(torch.ones(3), torch.zeros(3)) == math.inf
    assert relative_error(torch.zeros(0), torch.zeros(0)) == 0.0


def test_imbalance_is_the_largest_rank_share_times_the_world_size():
    assert imbalance(6, 8, 2) == pytest.approx(1.5)  # 2 · 6 / 8
    assert imbalance(5, 15, 3) == pytest.approx(1.0)
    assert imbalance(0, 0, 2) == 1.0  # a window without items


def test_spread_is_zero_for_equal_replicas_and_relative_otherwise():
    assert spread(torch.tensor([[1.0, -2.0, 0.0], [1.0, -2.0, 0.0]])) == 0.0
    assert spread(torch.tensor([[1.0, 4.0], [1.0, 5.0], [1.0, 4.5]])) == pytest.approx(0.2)  # (5 - 4) / 5


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"every_n_steps": 0}, r"`every_n_steps=0` is not a positive int.*None to turn the audit off"),
        ({"every_n_steps": True}, r"`every_n_steps=True` is not a positive int"),
        ({"every_n_steps": 2.0}, r"`every_n_steps=2.0` is not a positive int"),
        ({"on_mismatch": "error"}, r"`on_mismatch='error'` must be 'warn' or 'raise'"),
        ({"rtol": -1.0}, r"`rtol=-1.0` must be a finite number >= 0"),
        ({"rtol": math.nan}, r"`rtol=nan` must be a finite number >= 0"),
    ],
)
def test_invalid_arguments_are_rejected_with_the_value_and_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ObjectiveAudit(**kwargs)


class Trace(LightningModule):
    """The worked trace on one process: microbatches [9, 9] then [7] * 6 in one accumulation window."""

    def __init__(self, microbatches: list[list[float]], dropout: float = 0.0, norm: bool = False) -> None:
        super().__init__()
        self.microbatches = microbatches
        self.w = nn.Parameter(torch.tensor([10.0]))
        self.dropout = nn.Dropout(dropout)
        self.norm = nn.BatchNorm1d(1) if norm else None
        self.grads: list[float] = []

    def training_step(self, batch: Tensor, batch_idx: int) -> Any:
        w = self.dropout(self.w.expand(len(batch)))  # per-item dropout of the prediction
        if self.norm is not None:
            w = w + 0.0 * self.norm(batch.unsqueeze(-1)).squeeze(-1)  # only updates the running statistics
        mean = (0.5 * (w - batch) ** 2).mean()
        self.log("mean", mean)
        return {"loss": mean, "count": len(batch)}

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.grads.append(float(self.w.grad))

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader([torch.tensor(b) for b in self.microbatches], batch_size=None)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(module: LightningModule, audit: ObjectiveAudit | None, accumulate: int, logger: Any = False) -> Trainer:
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        accumulate_grad_batches=accumulate,
        callbacks=[audit] if audit is not None else [],
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    return trainer


def test_lightning_accumulation_on_one_device_is_flagged_as_the_mean_of_microbatch_means():
    audit = ObjectiveAudit(every_n_steps=1)
    module = Trace([[9.0, 9.0], [7.0] * 6])
    with pytest.warns(UserWarning, match=r"relative error of 0\.2 .*strategy='ddp_weighted'"):
        fit(module, audit, accumulate=2)
    # Lightning: (1 + 3) / 2 = 2; the item mean: (2 · 1 + 6 · 3) / 8 = 2.5
    assert module.grads == [pytest.approx(2.0)]
    (report,) = audit.reports
    assert (report.step, report.norm, report.expected_norm) == (0, pytest.approx(2.0), pytest.approx(2.5))
    assert report.objective_error == pytest.approx(0.2)
    assert (report.replica_error, report.imbalance, report.counts, report.passed) == (0.0, 1.0, (8.0,), False)


def test_audited_steps_reach_the_logger_once_each(tmp_path):
    audit = ObjectiveAudit(every_n_steps=2, on_mismatch="raise")
    fit(Trace([[9.0, 9.0], [7.0] * 6, [8.0], [1.0, 2.0, 3.0], [5.0]]), audit, 1, CSVLogger(tmp_path, "run", ""))
    with open(tmp_path / "run" / "metrics.csv", newline="") as file:
        audited = [row for row in csv.DictReader(file) if row["audit/objective_error"]]
    assert [int(row["step"]) for row in audited] == [0, 2, 4]  # not repeated on the steps in between
    assert max(float(row["audit/objective_error"]) for row in audited) < 1e-6
    assert [float(row["audit/imbalance"]) for row in audited] == [1.0, 1.0, 1.0]


def test_raise_mode_stops_training_before_the_optimizer_step():
    module = Trace([[9.0, 9.0], [7.0] * 6])
    with pytest.raises(ObjectiveMismatchError, match=r"step 0: .*\(norm 2\) .*\(norm 2\.5\) .*error of 0\.2"):
        fit(module, ObjectiveAudit(every_n_steps=1, on_mismatch="raise"), accumulate=2)
    assert float(module.w.detach()) == 10.0


def test_the_audit_is_off_by_default():
    audit = ObjectiveAudit()
    fit(Trace([[9.0, 9.0], [7.0] * 6]), audit, accumulate=2)  # would warn (an error here) if it audited
    assert audit.reports == []


def test_the_replay_reuses_the_random_state_of_each_microbatch():
    # with a fresh dropout mask in the replay the gradients would differ and the audit would raise
    torch.manual_seed(0)
    module = Trace([[9.0] * 8, [7.0] * 8, [8.0] * 8], dropout=0.5)
    audit = ObjectiveAudit(every_n_steps=1, on_mismatch="raise", rtol=1e-6)
    fit(module, audit, accumulate=1)
    assert len(audit.reports) == 3 and all(r.passed for r in audit.reports)


def test_buffers_changed_by_the_replay_are_restored():
    stats = []
    for audit in (None, ObjectiveAudit(every_n_steps=1, on_mismatch="raise")):
        module = Trace([[9.0, 1.0], [7.0, 3.0, 2.0]], norm=True)
        fit(module, audit, accumulate=1)
        assert module.norm is not None
        stats.append((module.norm.running_mean.clone(), int(module.norm.num_batches_tracked)))
    assert torch.equal(stats[0][0], stats[1][0]) and stats[0][1] == stats[1][1] == 2


class Manual(Trace):
    def __init__(self) -> None:
        super().__init__([[1.0]])
        self.automatic_optimization = False


def test_manual_optimization_is_rejected_with_the_fix():
    with pytest.raises(ValueError, match=r"needs automatic optimization.*Manual.*Remove the callback"):
        fit(Manual(), ObjectiveAudit(every_n_steps=1), accumulate=1)


class CountsItems(Trace):
    def training_step(self, batch: Tensor, batch_idx: int) -> Any:
        self.log("items", float(len(batch)), on_step=False, on_epoch=True, reduce_fx="sum")
        return super().training_step(batch, batch_idx)


def test_what_training_step_logs_is_not_logged_again_by_the_replay():
    audit = ObjectiveAudit(every_n_steps=2, on_mismatch="raise")
    trainer = fit(CountsItems([[9.0, 9.0], [7.0] * 6, [1.0]]), audit, accumulate=1)
    assert len(audit.reports) == 2  # steps 0 and 2 replayed 2 + 1 items
    assert float(trainer.callback_metrics["items"]) == 9.0  # 2 + 6 + 1, logged once each


class RecordsReplays(Trace):
    def training_step(self, batch: Tensor, batch_idx: int) -> Any:
        self.calls.append(is_audit_rerun())
        return super().training_step(batch, batch_idx)


def test_is_audit_rerun_tells_the_audit_replay_apart_from_training():
    module = RecordsReplays([[9.0, 9.0], [7.0] * 6, [8.0]])
    module.calls = []
    fit(module, ObjectiveAudit(every_n_steps=2, on_mismatch="raise"), accumulate=1)
    assert module.calls == [False, True, False, False, True]  # steps 0 and 2 are replayed once each
    assert is_audit_rerun() is False


class NegativeCount(Trace):
    def training_step(self, batch: Tensor, batch_idx: int) -> Any:
        return {**super().training_step(batch, batch_idx), "count": -1}


def test_an_invalid_count_stops_the_audit_with_the_expected_form_of_count():
    with pytest.raises(ValueError, match=r"invalid count on 1 rank\(s\) .* step 0.*a finite int, float or 0-dim"):
        fit(NegativeCount([[9.0, 9.0]]), ObjectiveAudit(every_n_steps=1), accumulate=1)


def test_a_strategy_that_shards_parameters_out_of_its_reach_is_rejected_with_the_fix():
    class ShardingStrategy:  # stands for DeepSpeed: no rank holds every parameter, and the audit cannot gather them
        pass

    trainer = SimpleNamespace(strategy=ShardingStrategy())
    with pytest.raises(ValueError, match=r"or to gather them as FSDP does, which ShardingStrategy does not.*'ddp'"):
        ObjectiveAudit(every_n_steps=1).setup(trainer, Trace([[1.0]]), "fit")  # type: ignore[arg-type]
