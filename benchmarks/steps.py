"""Raw ``DistributedDataParallel`` optimizer steps: plain DDP, the package's window loop, and the anchors' mechanisms.

Every variant runs a window the way Lightning does: ``no_sync`` for all microbatches but the last, one backward per
microbatch, the loss computed inside DDP's forward (as Lightning runs ``training_step``), then ``optimizer.step()``
and ``zero_grad(set_to_none=True)``. The anchors are re-implemented here with the fastest primitive their sources
allow (not in ``src/``), and give the same update as ``ddp_weighted`` (:mod:`lightning_weighted.window`):

- post-hoc (fairseq ``multiply_grads``, Megatron ``finalize_model_grads``, torchtune ``scale_grads``): loss sums,
  DDP's mean, then one blocking count all-reduce and every gradient multiplied by ``P / N``;
- pre-count (HF Trainer ``get_batch_samples``, torchtitan ``global_valid_tokens``, Composer): the whole window
  loaded first, one blocking count all-reduce before the first forward, each loss sum scaled by ``P / N``.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import itertools
import random
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from common import (
    DTYPES,
    LR,
    Batch,
    BatchStream,
    CollectiveCounter,
    Point,
    bucket_counts,
    deviation,
    gradient_deviation,
    local_mean,
    local_sum,
    make_batch,
    make_model,
    reference_gradient,
    reference_params,
    timed_rounds,
)
from torch import Tensor, nn

from lightning_weighted.count import TRAINER, Counts, host_items, read_count, read_counts
from lightning_weighted.engines.ddp import DDPEngine
from lightning_weighted.loop import Output, WindowLoop
from lightning_weighted.payload import SUMMED

CPU = torch.device("cpu")


class Loss(nn.Module):
    """The model's loss over a batch (its item sum with ``summed``, else its item mean) as DDP's forward."""

    def __init__(self, model: nn.Module, summed: bool) -> None:
        super().__init__()
        self.model, self.summed = model, summed

    def forward(self, batch: Batch) -> Tensor:
        return local_sum(self.model, batch) if self.summed else local_mean(self.model, batch)


def count_all_ranks(count: Tensor) -> Tensor:
    """A window's item count summed over the ranks, blocking, in float64: the anchors' one collective."""
    total = count.to(torch.float64)
    dist.all_reduce(total)
    return total.clamp_min(1.0)


class PlainDDPStep:
    """What ``strategy="ddp"`` does: each microbatch's local mean divided by A, DDP averages over ranks."""

    summed = False  # the loss DDP's forward returns: the item sum rather than the item mean

    def __init__(self, model: nn.Module, world_size: int, accumulate: int, data: BatchStream) -> None:
        self.model, self.world_size, self.accumulate = model, world_size, accumulate
        self.ddp = nn.parallel.DistributedDataParallel(Loss(model, self.summed))
        self.optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        self.stream = iter(data)  # every window's microbatches, in order
        self.captured: list[Tensor] | None = None  # the first step's synchronized gradient

    def sync(self, micro: int) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext() if micro == self.accumulate - 1 else self.ddp.no_sync()

    def window(self) -> list[Batch]:
        return list(itertools.islice(self.stream, self.accumulate))

    def step(self) -> None:
        for micro, batch in enumerate(self.window()):
            with self.sync(micro):
                (self.ddp(batch) / self.accumulate).backward()
        self.finish()

    def finish(self) -> None:
        if self.captured is None:
            params = self.model.parameters()
            self.captured = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def parameters(self) -> list[Tensor]:
        return [p.detach() for p in self.model.parameters()]


class AfterStep(PlainDDPStep):
    """``"ddp_weighted"`` with counts returned by ``training_step`` (tensors), through the package's own window loop
    over DDP's own reducer: each loss scaled to its item sum, the window's 48-byte payload in one asynchronous
    float64 all-reduce started before the syncing backward, the reduced gradients multiplied by ``P c / N``."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.engine = DDPEngine(self.ddp, self.ddp.module)
        self.loop = WindowLoop(self.engine, CPU, TRAINER)
        self.steps = 0

    def step(self) -> None:
        window = self.window()
        for micro, batch in enumerate(window):
            with self.sync(micro):
                loss = self.ddp(batch)
                self.loop.add(Output(loss, read_count(batch[2].sum())))  # a count on the device, checked there
                self.backward(self.loop.backward_loss(loss), micro == len(window) - 1, [])
        self.loop.finish(self.steps)
        self.steps += 1
        self.finish()

    def backward(self, loss: Tensor, last: bool, next_items: list[float]) -> None:
        """One microbatch's backward, the window's exchange started right before the last one (as the strategy)."""
        if last:
            self.loop.end(True, next_items)
        loss.backward()
        self.engine.after_backward()


class AheadStep(AfterStep):
    """``"ddp_weighted"`` with an ``ItemCounter`` (counts ahead), through the package's window loop as the strategy
    drives it: each batch counted on the host as the stream yields it, every loss scaled by ``P n / N`` before its
    backward; the payload (this window's flags and loss, the next window's ``N``, counted from the batches fetched
    ahead) in the same one all-reduce, so that no window but the first sums its counts apart.

    With ``parts`` (the subclasses), the loss is named parts, each counted and averaged over its own items: here
    each part is the item mean ÷ K over the same valid items, so the objective stays the global item mean that the
    float64 reference checks, and every part's count travels in the window's one payload all-reduce."""

    parts: tuple[str, ...] = ()

    def __init__(self, model: nn.Module, world_size: int, accumulate: int, data: BatchStream) -> None:
        super().__init__(model, world_size, accumulate, data)
        self.loop = WindowLoop(self.engine, CPU, TRAINER, self.parts)
        self.fetched: list[tuple[Batch, Counts]] = []  # fetched and counted ahead, not trained yet
        self.totals: list[float] | None = None  # the next window's N of each part, brought by the last exchange
        self.integers = [True] * len(self.parts or ("",))  # each part counts whole items

    def fetch(self, size: int) -> list[tuple[Batch, Counts]]:
        """The next ``size`` batches of the stream (fewer at its end), each counted on the host once, as fetched."""
        while len(self.fetched) < size:
            batch = next(self.stream, None)
            if batch is None:
                break
            # counted once on the host; the parts' counts checked together as the strategy checks what the count
            # functions gave (the parts here count the same items: a user's K count functions cost what they cost)
            items = batch[2].sum().item()
            self.fetched.append((batch, read_counts([items] * len(self.parts or ("",)), self.integers)))
        return self.fetched[:size]

    def step(self) -> None:
        window = self.fetch(self.accumulate)
        del self.fetched[: len(window)]
        self.loop.plan([counts for _, counts in window], self.totals)
        following: list[tuple[Batch, Counts]] = []
        next_items: list[float] = []
        for micro, (batch, _) in enumerate(window):
            with self.sync(micro):
                loss = self.ddp(batch)
                self.loop.add(self.output(loss))
                last = micro == len(window) - 1
                if last:  # the next window, counted ahead: its items ride this window's exchange
                    following = self.fetch(self.accumulate)
                    next_items = host_items([counts for _, counts in following], len(self.integers))
                self.backward(self.loop.backward_loss(loss), last, next_items)
        self.loop.finish(self.steps, True, next_items)
        self.totals = self.loop.next_totals if following else None  # the stream's end: the next plan sums anew
        self.steps += 1
        self.finish()

    def output(self, loss: Tensor) -> Output:
        if not self.parts:
            return Output(loss)  # the planned count stands
        share = loss / len(self.parts)
        return Output(loss, parts={name: share for name in self.parts})


class OnePartStep(AheadStep):
    """Counts ahead with one named loss part (``ItemCounter(parts={"a": ...})``)."""

    parts = ("a",)


class FourPartsStep(AheadStep):
    """Counts ahead with four named loss parts, each counted by its own function: ``K = 4`` counts per batch."""

    parts = ("a", "b", "c", "d")


class PlainPartsStep(PlainDDPStep):
    """Plain DDP trained on K named parts: what ``strategy="ddp"`` does with a ``training_step`` that returns them
    (each the item mean ÷ K, as ``AheadStep``'s) and their sum as its loss. The control of the parts rows: beside
    ``ddp_weighted_parts4 − ddp_weighted_parts1``, ``ddp_parts4 − ddp_parts1`` is what K parts cost the user's own
    step (their dict, their stack and sum, and one more gradient per part in the backward) without any weighting."""

    parts: tuple[str, ...] = ("a",)

    def step(self) -> None:
        for micro, batch in enumerate(self.window()):
            with self.sync(micro):
                share = self.ddp(batch) / len(self.parts)
                parts = {name: share for name in self.parts}
                (torch.stack(list(parts.values())).sum() / self.accumulate).backward()
        self.finish()


class PlainFourPartsStep(PlainPartsStep):
    """Plain DDP trained on four named parts (:class:`PlainPartsStep`)."""

    parts = ("a", "b", "c", "d")


class PostHocStep(PlainDDPStep):
    """Post-hoc normalisation (fairseq / Megatron / torchtune)."""

    summed = True

    def step(self) -> None:
        items = torch.zeros((), dtype=torch.int64)
        for micro, batch in enumerate(self.window()):
            with self.sync(micro):
                items += batch[2].sum()
                self.ddp(batch).backward()  # the sum; DDP averages it over the P ranks
        scale = self.world_size / count_all_ranks(items)  # after the backward: blocking, then one pass
        torch._foreach_mul_([p.grad for p in self.model.parameters() if p.grad is not None], scale)
        self.finish()


class PreCountStep(PlainDDPStep):
    """Pre-count normalisation (HF Trainer / torchtitan / Composer)."""

    summed = True

    def step(self) -> None:
        batches = self.window()  # the whole window loaded first, then a blocking count before the first forward
        scale = self.world_size / count_all_ranks(
            sum((b[2].sum() for b in batches), torch.zeros((), dtype=torch.int64))
        )
        for micro, batch in enumerate(batches):
            with self.sync(micro):
                (self.ddp(batch) * scale).backward()
        self.finish()


VARIANTS: dict[str, type[PlainDDPStep]] = {
    "ddp": PlainDDPStep,
    "ddp_control": PlainDDPStep,  # a second, independent plain DDP: its ratio to "ddp" is the noise floor
    "ddp_weighted": AheadStep,
    "ddp_weighted_after": AfterStep,
    "post_hoc": PostHocStep,
    "pre_count": PreCountStep,
    "ddp_weighted_parts1": OnePartStep,
    "ddp_weighted_parts4": FourPartsStep,
    "ddp_parts1": PlainPartsStep,  # the parts rows' control: plain DDP trained on the same 1 and 4 parts
    "ddp_parts4": PlainFourPartsStep,
}


def build(point: Point, names: Sequence[str], rank: int, world: int, windows: int = 0) -> dict[str, PlainDDPStep]:
    """One copy of each variant, fed this rank's ``point.steps`` windows in the point's dtype (``windows`` distinct
    ones cycled, when given: the one-rank tables run thousands of steps)."""
    dtype = DTYPES[point.dtype]
    steps = range(min(point.steps, windows or point.steps))
    data = [make_batch(point.size, point.rows, point.seed, rank, s, m) for s in steps for m in range(point.accumulate)]
    data = [(x.to(dtype), y, w) for x, y, w in data]  # the model's dtype, as a loader under `bf16-true` hands them
    model = make_model(point.size, point.seed).to(dtype)
    stream = BatchStream(data, cycle=bool(windows))
    return {name: VARIANTS[name](copy.deepcopy(model), world, point.accumulate, stream) for name in names}


def _stepping(models: dict[str, PlainDDPStep]) -> Any:
    return lambda name: models[name].step()


def run_point(point: Point, names: Sequence[str], counter: CollectiveCounter, correctness: bool) -> dict[str, Any]:
    """Every variant's ``point.steps`` steps, one each per round in an order shuffled per round (the same on every
    rank), each after a barrier; a step's time is the slowest rank's. Collectives are counted over the last warm-up
    step (DDP has rebuilt its buckets by then)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    models = build(point, names, rank, world)
    initial = {name: [p.clone() for p in model.parameters()] for name, model in models.items()}
    slowest, calls = timed_rounds(point, names, _stepping(models), counter)
    result: dict[str, Any] = {"point": point.__dict__, "times": slowest, "collectives": calls}
    result["buckets"] = {name: bucket_counts(model.ddp) for name, model in models.items()}
    if correctness and rank == 0:
        expected, gradient = reference_params(point, point.steps, world), reference_gradient(point, world)
        result["deviation"] = {n: deviation(m.parameters(), initial[n], expected, point) for n, m in models.items()}
        result["gradient_deviation"] = {n: gradient_deviation(m.captured or [], gradient) for n, m in models.items()}
    dist.barrier()
    del models
    gc.collect()
    return result


def gloo_probe() -> dict[str, float]:
    """Median time of the window's payload all-reduce (``SUMMED`` float64 values) and of an 8 MiB fp32 one."""
    results = {}
    for name, tensor, repeats in (
        ("payload_allreduce_s", torch.zeros(SUMMED, dtype=torch.float64), 200),
        ("allreduce_8MiB_s", torch.zeros(2 * 1024 * 1024), 15),
    ):
        samples = []
        for k in range(repeats + 3):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            if k >= 3:
                samples.append(time.perf_counter() - start)
        results[name] = sorted(samples)[len(samples) // 2]
    return results


def one_rank_differences(point: Point, names: Sequence[str]) -> dict[str, list[float]]:
    """On a 1-rank group: each step's time of each variant minus plain DDP's in the same step (shuffled order), and
    plain DDP's own (``"ddp"``), in seconds, after a tenth of the steps as warm-up."""
    models = build(point, ["ddp", *names], 0, 1, windows=50)
    times: dict[str, list[float]] = {name: [] for name in models}
    for step in range(point.steps):
        order = list(models)
        random.Random(step).shuffle(order)
        for name in order:
            start = time.perf_counter()
            models[name].step()
            times[name].append(time.perf_counter() - start)
    plain = times["ddp"][point.warmup :]
    return {"ddp": plain} | {n: [t - b for t, b in zip(times[n][point.warmup :], plain, strict=True)] for n in names}
