"""The compatibility matrix of `docs/compatibility.md`: every row (`matrix.ROWS`) × engine × count path is a test.

An exact cell trains the row on 2 gloo ranks holding uneven data and must match the float64 reference of the global
item mean over the batches `matrix.plan` says each optimizer step trains: the parameters, the replicas, the number of
steps, and the ids of the items each step trained. A resumed row trains twice (the first run checkpoints, the second
resumes in fresh processes) and must match the uninterrupted run too. A refused cell must stop every rank with the
row's message before any optimizer step. The plain strategy (`"ddp"`, Lightning's FSDP2 and FSDP1, plain Fabric)
trains each exact row with as many batches on every rank, which it needs, and must miss the same reference.

Each row's home cell runs in the default suite; every other cell and every plain control carry the `matrix` marker
(`python -m pytest -q -m matrix tests/distributed/test_compatibility.py`). The LitData rows skip where LitData is not
installed (`pip install --no-deps litdata==0.2.76`, as `.ci/run` does); their data set is written once (`prepared`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import litdata_items
import matrix
import pytest
import torch
from harness import HERE, ROOT
from launcher import Done, ranks
from matrix import ROWS, Row, option

TIMEOUT = 120  # seconds for one launch, hard; each rank's process group times out after 20 s
PLAIN_MISS = 1e-3  # the plain strategy misses the reference by more than this (relative), not by a rounding error


def cell_params() -> list[Any]:
    params = []
    for row in ROWS:
        for engine, path in row.cells():
            marks = () if (engine, path) == row.home else (pytest.mark.matrix,)
            params.append(pytest.param(row, engine, path, id=f"{row.id}-{engine}-{path}", marks=marks))
    return params


def plain_params() -> list[Any]:
    return [
        pytest.param(row, engine, id=f"{row.id}-{engine}", marks=pytest.mark.matrix)
        for row in ROWS
        if row.outcome == "exact"
        for engine in row.engines
    ]


# ------------------------------------------------------------------------------------------------- launching
@dataclasses.dataclass
class Run:
    """A cell's training: the records of its last launch (the resumed one, where it resumes) and what came before."""

    records: list[dict[str, Any] | None]
    done: Done
    first_step: int = 0  # the optimizer step the last launch starts at
    uninterrupted: list[dict[str, Any] | None] | None = None  # a resumed row's run without interruption
    earlier: list[Done] = dataclasses.field(default_factory=list)

    @property
    def output(self) -> str:
        return "".join(d.stdout[-3000:] for d in [*self.earlier, self.done])


def launch(
    row: Row, engine: str, path: str, weighted: bool, options: dict[str, Any], tmp_path: Path, **cell: Any
) -> tuple[list[dict[str, Any] | None], Done, Path]:
    world_size = cell.pop("world_size", matrix.WORLD)
    tmp_path.mkdir(parents=True, exist_ok=True)
    kind = "weighted" if weighted else "plain"
    out = tmp_path / f"{row.id}-{engine}-{path}-{kind}-{os.urandom(3).hex()}"
    config = {"row": row.id, "engine": engine, "path": path, "weighted": weighted, "world_size": world_size,
              "options": options, **cell}  # fmt: skip
    script = "matrix_worker.py" if row.front == "trainer" else "matrix_fabric_worker.py"
    done = ranks(HERE / script, ["--config", json.dumps(config), "--out", str(out)], world_size, TIMEOUT)
    records = [
        torch.load(f"{out}.rank{r}", weights_only=False) if Path(f"{out}.rank{r}").exists() else None
        for r in range(world_size)
    ]
    return records, done, out


def prepared(row: Row) -> None:
    """Readies what the row's ranks read: a LitData row's optimized data set, written once (a cache keyed by its
    content, ``litdata_items.ensure``); the test skips where LitData is not installed."""
    if option(row.options, "layout") == "litdata":
        pytest.importorskip("litdata", reason="LitData is not installed (`pip install --no-deps litdata==0.2.76`)")
        litdata_items.ensure(option(row.options, "items"))


def even(row: Row) -> dict[str, Any]:
    """The row's options with as many batches on every rank, which the plain strategies need to train at all
    (training and validation alike: a rank out of batches leaves its peers waiting in a collective)."""
    options = dict(row.options)
    layout = option(options, "layout")
    if layout == "litdata":
        options["drop_last"] = None  # LitData's default on 2 ranks: it drops items until the ranks' shards are even
    if layout in ("per_rank", "iterable"):
        options["lengths"] = [max(option(options, "lengths"))] * matrix.WORLD
        if option(options, "epoch_lengths") is not None:
            options["epoch_lengths"] = [[max(n)] * matrix.WORLD for n in option(options, "epoch_lengths")]
    if layout == "user_sharded":
        options["items"] = 36  # the user's own shards of 18 items, 6 batches of 3 on each rank
    options["val_lengths"] = [max(option(options, "val_lengths"))] * matrix.WORLD
    return options


def checkpoint_of(row: Row, out: Path) -> str:
    resume_from = option(row.options, "resume_from")
    if row.front == "fabric":
        return f"{out}.save"
    name = "on_exception.ckpt" if resume_from == "exception" else f"*-step={resume_from}.ckpt"
    if option(row.options, "checkpoint") == "epoch":  # each such row resumes at epoch 0's end, whose step the plain
        name = "epoch=0-step=*.ckpt"  # control's even shards can move
    found = sorted(Path(f"{out}.ckpt").glob(name))
    assert len(found) == 1, f"no single checkpoint {name} in {out}.ckpt: {found}"
    return str(found[0])


def train(row: Row, engine: str, path: str, weighted: bool, tmp_path: Path) -> Run:
    options = dict(row.options) if weighted else even(row)
    if not row.resumes:
        records, done, _ = launch(row, engine, path, weighted, options, tmp_path)
        return Run(records, done)
    resume_from, world = option(options, "resume_from"), option(options, "first_world")
    first, first_done, out = launch(row, engine, path, weighted, options, tmp_path / "first", world_size=world)
    injected = all(r is not None and "injected failure" in str(r["error"]) for r in first)
    if (first_done.returncode == 0) != (resume_from != "exception") or (resume_from == "exception" and not injected):
        return Run(first, first_done)  # the run that checkpoints failed (or did not fail where it must)
    resumed_options = {**options, "raise_at": None, "checkpoint": None}
    records, done, _ = launch(
        row, engine, path, weighted, resumed_options, tmp_path / "resumed",
        resume=checkpoint_of(row, out), world_size=option(options, "resume_world"),
    )  # fmt: skip
    # after a failure the interrupted window restarts without the gradient accumulated before it (`matrix.plan`);
    # resumed on another number of ranks, the rest of the epoch is dealt anew: no uninterrupted run trains it
    same = world == option(options, "resume_world")
    uninterrupted = first if resume_from != "exception" and same else None
    start = int(resume_from) if resume_from != "exception" else len(first[0]["steps"]) if first[0] else 0
    return Run(records, done, start, uninterrupted, [first_done])


# ---------------------------------------------------------------------------------------------------- checks
def trained(records: list[dict[str, Any] | None]) -> dict[int, list[int]]:
    """The ids of the items each optimizer step trained, over every rank (replays left out), sorted."""
    steps: dict[int, list[int]] = defaultdict(list)
    for record in records:
        assert record is not None
        for step in record["steps"]:
            for _, _, ids, replay in step["batches"]:
                steps[step["step"]] += [] if replay else list(ids)
    return {step: sorted(ids) for step, ids in steps.items()}


def epoch_items(options: dict[str, Any], epoch: int) -> float:
    """The valid items every rank holds in ``epoch``."""
    total = 0.0
    for batches in matrix.epoch_batches(options, epoch):
        for ids in batches:
            total += float(matrix.values(torch.tensor(ids), option(options, "mode"))[2].sum())
    return total


def departures(row: Row, engine: str, run: Run, weighted: bool = True) -> dict[str, str]:
    """The checks of an exact row that ``run`` fails, each with what it found: none where it is exact."""
    records = run.records
    if run.done.returncode != 0 or any(r is None or r["error"] is not None for r in records):
        errors = [r["error"] if r is not None else "no record" for r in records]
        return {"ran": f"exit {run.done.returncode}, {errors}\n{run.output[-6000:]}"}
    options = row.options if weighted else even(row)
    steps = matrix.plan(row, options)
    expected = matrix.reference(row, steps, options)
    tol = matrix.tolerance(row, engine)
    found: dict[str, str] = {}
    first: Any = records[0]
    error = matrix.max_relative_error(first["params"], expected)
    if not error < tol:
        found["parameters"] = f"relative error {error:.3g} (tolerance {tol:g})"
    if not all(all(torch.equal(a, b) for a, b in zip(first["params"], r["params"], strict=True)) for r in records):
        found["replicas"] = "the ranks' parameters differ"
    if run.uninterrupted is not None:
        whole = run.uninterrupted[0]
        gap = matrix.max_relative_error(first["params"], [p.double() for p in whole["params"]]) if whole else 1.0
        if not gap < tol:
            found["uninterrupted"] = f"relative distance {gap:.3g} from the uninterrupted run"
    optimizer_steps = [s for s in steps if s.restore is None]
    if first["global_step"] != len(optimizer_steps):
        found["steps"] = f"{first['global_step']} optimizer steps, the plan {len(optimizer_steps)}"
    planned = {n: sorted(s.ids) for n, s in enumerate(optimizer_steps) if n >= run.first_step}
    got = trained(records)
    if weighted and got != planned:
        wrong = sorted(n for n in set(got) | set(planned) if got.get(n) != planned.get(n))
        found["batches"] = f"steps {wrong} trained other items than planned (first: {_diff(got, planned, wrong)})"
    if "padding" in row.extra and weighted:
        found.update(_padding(row, records))
    if "rank_batches" in row.extra:
        found.update(_rank_batches(options, records))
        if run.uninterrupted is not None and all(r is not None for r in run.uninterrupted):
            found.update(_rank_batches(options, run.uninterrupted, "uninterrupted, "))
    last_epoch = option(options, "epochs") - 1
    for name, key in (("logged_items", "train/items"), ("metric_items", "train/items_metric")):
        if name in row.extra:
            value, items = first["metrics"].get(key), epoch_items(options, last_epoch)
            if value is None or abs(value - items) > 1e-6 * items:
                found[name] = f"{key} = {value}, the epoch's items {items}"
    return found


def _diff(got: dict[int, list[int]], planned: dict[int, list[int]], wrong: list[int]) -> str:
    n = wrong[0]
    return f"step {n}: trained {got.get(n)}, planned {planned.get(n)}"


def _padding(row: Row, records: list[Any]) -> dict[str, str]:
    """Where the replay flags the batch-start hooks (Fabric: the loop, as each batch arrives) read are wrong."""
    expected = matrix.replays(row.options, row.front)
    found = {}
    for rank, record in enumerate(records):
        for source, flags in record["flags"].items():
            flagged = sorted((e, i) for e, i, flag in flags if flag)
            seen = {(e, i) for e, i, _ in flags}
            if flagged != sorted(p for p in expected[rank] if p in seen):
                found[f"padding ({source}, rank {rank})"] = f"flagged {flagged}, replays {expected[rank]}"
    return found


def _rank_batches(options: dict[str, Any], records: list[Any], run: str = "") -> dict[str, str]:
    """Where a rank trained other batches than its own of `matrix.rank_batches` (by position, each item in its place),
    or replayed before its own were done: the first such batch of each rank."""
    found = {}
    for rank, record in enumerate(records):
        for epoch, index, ids, replay in (batch for step in record["steps"] for batch in step["batches"]):
            own = matrix.epoch_batches(options, epoch)[rank]
            if replay != (index >= len(own)) or (not replay and list(ids) != own[index]):
                expected = "a replay" if index >= len(own) else own[index]
                found[f"rank_batches ({run}rank {rank})"] = (
                    f"epoch {epoch} batch {index}: trained {list(ids)} (replay {replay}), its own {expected}"
                )
                break
    return found


def refusal(row: Row, run: Run) -> list[str]:
    """How a refused row's run falls short of the refusal: every rank stopped, with the message, before a step."""
    problems = []
    if run.done.returncode == 0:
        problems.append("every rank exited 0")
    for rank, record in enumerate(run.records):
        if record is None:
            problems.append(f"rank {rank} saved no record")
            continue
        if record["error"] is None or not re.search(row.message or "", record["error"], re.S):
            problems.append(f"rank {rank}: {record['error']!r} does not match {row.message!r}")
        if record["steps"]:
            problems.append(f"rank {rank} stepped the optimizer {len(record['steps'])} time(s) first")
    return problems


# ----------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize(("row", "engine", "path"), cell_params())
def test_each_cell_trains_the_float64_reference_of_the_global_item_mean_or_is_refused_on_every_rank(
    tmp_path, row, engine, path
):
    prepared(row)
    run = train(row, engine, path, True, tmp_path)
    if row.outcome == "refused":
        assert refusal(row, run) == [], run.output[-6000:]
    else:
        assert departures(row, engine, run) == {}


@pytest.mark.parametrize(("row", "engine"), plain_params())
def test_the_plain_strategy_misses_the_reference_of_each_exact_row(tmp_path, row, engine):
    prepared(row)
    run = train(row, engine, "plain", False, tmp_path)
    stopped = row.plain.get(engine)
    if stopped is not None:  # Lightning's own refusal, not a training
        assert run.done.returncode != 0 and re.search(stopped, run.output), run.output[-4000:]
        return
    found = departures(row, engine, run, weighted=False)
    assert "ran" not in found, found
    if "plain_order" not in row.extra:  # else Lightning's own resume trains another order (#21938), as the row says
        assert not [check for check in found if check.startswith("rank_batches")], found
    assert "parameters" in found, "the plain strategy trained the weighted reference"
    steps = matrix.plan(row, even(row))
    error = matrix.max_relative_error(run.records[0]["params"], matrix.reference(row, steps, even(row)))
    assert error > max(PLAIN_MISS, 3 * matrix.tolerance(row, engine))


def test_the_compatibility_page_lists_exactly_the_rows_of_the_matrix_with_their_outcomes():
    # the page's two tables, rows then messages, as `python tests/distributed/matrix.py` prints them, and no line more
    page = (ROOT / "docs" / "compatibility.md").read_text()
    for table in matrix.tables().split("\n\n"):
        missing = [line for line in table.splitlines() if line not in page.splitlines()]
        assert missing == [], "docs/compatibility.md: paste the tables `python tests/distributed/matrix.py` prints"
        assert table in page  # in the matrix's order
    listed = [line.split("|")[1].strip() for line in page.splitlines() if re.match(r"\| `[\w-]+` \| ", line)]
    assert listed == [f"`{row.id}`" for row in ROWS] + [f"`{name}`" for name in matrix.MESSAGES]


def test_the_plan_of_a_sharded_data_set_trains_each_item_exactly_once_per_epoch():
    # the reference's own bookkeeping: 37 items over 2 ranks in batches of 3 (19 items in 7 batches, 18 in 6)
    row = matrix.BY_ID["map-style-sampler"]
    steps = matrix.plan(row)
    assert len(steps) == 8  # 2 epochs of 4 windows (A = 2) over the longer rank's 7 batches
    per_epoch = [sorted(i for s in steps[4 * e : 4 * e + 4] for i in s.ids) for e in range(2)]
    assert per_epoch == [list(range(37))] * 2
    assert [len(b) for b in matrix.rank_batches(row.options, 0, 0)] == [3, 3, 3, 3, 3, 3, 1]  # 19 items


def test_the_plan_of_a_resumed_fabric_loop_with_replays_matches_its_uninterrupted_windows():
    # A = 2 over 7 and 5 batches: the save after step 3 falls where rank 1 replays batch 5, its own data spent
    row = matrix.BY_ID["fabric-resume-next"]
    assert matrix.fabric_windows(row.options)[:4] == [[(0, 0), (0, 1)], [(0, 2), (0, 3)], [(0, 4), (0, 5)], [(0, 6)]]
    assert matrix.replays(row.options, "fabric")[1][:2] == [(0, 5), (0, 6)]
    steps = matrix.plan(row)
    assert len(steps) == 8  # 2 epochs of 4 windows
    assert steps[2].ids == [*matrix.batch_ids(0, 0, 4), *matrix.batch_ids(0, 0, 5), *matrix.batch_ids(1, 0, 4)]
    assert steps[3].ids == matrix.batch_ids(0, 0, 6)  # rank 1's replay adds nothing


def test_the_plan_of_a_litdata_data_set_takes_litdatas_own_uneven_shards_each_item_once_per_epoch():
    # LitData's shards, read from LitData in this process: 37 items, batch size 4, drop_last=False on 2 ranks give 16
    # items (4 batches) and 21 (6, the last of 1 item), dealt anew each epoch (shuffle=True)
    row = matrix.BY_ID["litdata-uneven"]
    prepared(row)
    epochs = [matrix.epoch_batches(row.options, epoch) for epoch in range(2)]
    assert [[len(b) for b in rank] for rank in epochs[0]] == [[4, 4, 4, 4], [4, 4, 4, 4, 4, 1]]
    assert [sorted(i for rank in ranks for b in rank for i in b) for ranks in epochs] == [list(range(37))] * 2
    assert epochs[0] != epochs[1]
    assert len(matrix.plan(row)) == 6  # 2 epochs of 3 windows (A = 2) over rank 1's 6 batches
    # the plain control's: LitData's default drop_last, even shards of 16 items (4 batches of 4) each
    assert [[len(b) for b in rank] for rank in matrix.epoch_batches(even(row), 0)] == [[4] * 4] * 2
