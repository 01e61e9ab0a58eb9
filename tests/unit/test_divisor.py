"""DDP's own reducer divides by the window's N (one gloo rank): a whole N, any other, the world size after close."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_weighted._counts import CountPayload
from lightning_weighted.reduce.divisor import ReducerDivision


@pytest.fixture
def ddp():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    yield nn.parallel.DistributedDataParallel(nn.Linear(3, 2, dtype=torch.float64))
    dist.destroy_process_group()


def _item_sum_gradient(ddp: nn.Module, items: float, division: ReducerDivision | None) -> list[torch.Tensor]:
    """The gradient DDP leaves for a loss summed over ``items`` items of a fixed batch, the window's N handed over."""
    if division is not None:
        division.begin_window(CountPayload(items, None, 0, True), torch.device("cpu"))
    x = torch.linspace(-1, 1, 12, dtype=torch.float64).reshape(4, 3)
    (ddp(x).square().sum() * items).backward()
    grads = [p.grad.clone() for p in ddp.parameters()]
    ddp.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("items", [7.0, 2.5])
def test_the_reducer_divides_by_a_whole_n_and_the_strategy_by_any_other(ddp, items):
    unscaled = _item_sum_gradient(ddp, 1.0, None)  # world size 1: the reducer divides by 1
    division = ReducerDivision(ddp)
    grads = _item_sum_gradient(ddp, items, division)
    summed = division.counts()
    assert summed[0] == items
    for p, g in zip(ddp.parameters(), grads, strict=True):
        p.grad = g
    division.normalize(ddp.parameters(), items)  # 2.5 is no divisor the reducer can take: it divided by 1
    for p, expected in zip(ddp.parameters(), unscaled, strict=True):  # without the divisor: 7 times as large
        torch.testing.assert_close(p.grad, expected, rtol=1e-14, atol=0)


def test_after_close_the_reducer_divides_by_the_world_size_again(ddp):
    division = ReducerDivision(ddp)
    _item_sum_gradient(ddp, 4.0, division)
    division.counts()
    division.close()
    alone = copy.deepcopy(ddp.module)  # the same loss without DDP: nothing divides it
    x = torch.linspace(-1, 1, 12, dtype=torch.float64).reshape(4, 3)
    (alone(x).square().sum() * 4.0).backward()
    # a divisor left in place would still be 4
    torch.testing.assert_close(_item_sum_gradient(ddp, 4.0, None)[0], alone.weight.grad)
