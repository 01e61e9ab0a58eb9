"""A bare training loop that exits right after its last collective: one of two gloo processes.

Rank and world come from ``RANK`` and ``WORLD_SIZE``, the rendezvous from ``MASTER_ADDR`` and ``MASTER_PORT``.
``--path`` picks the loop: ``window`` (DDP with the weighted window's payload summed asynchronously, started before
each backward, as the strategies run it), or ``backward`` (no DDP: one all-reduce inside each backward, the bare
shape of DDP's own bucket all-reduces and FSDP's reduce-scatters).
"""

from __future__ import annotations

import argparse
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from launcher import settle_at_exit
from torch.nn.parallel import DistributedDataParallel

from lightning_weighted.count import read_count
from lightning_weighted.payload import SUMMED, window_result
from lightning_weighted.window import Window, payload


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--path", choices=["window", "backward"], required=True)
    args = parser.parse_args()
    settle_at_exit()
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    if args.path == "backward":
        x = torch.ones(4, requires_grad=True)
        for _ in range(3):
            _AllReduce.apply(x).sum().backward()
        return  # the interpreter's exit follows the last all-reduce at once
    rank = dist.get_rank()
    torch.manual_seed(0)
    ddp = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)))
    for _ in range(3):
        x = torch.randn(2 + 4 * rank, 8)
        window = Window()
        loss = ddp(x).pow(2).mean()
        loss = loss * window.add(read_count(len(x)), loss)
        summed = payload([window], more=True, device=torch.device("cpu"))
        work = dist.all_reduce(summed[:SUMMED], async_op=True)
        loss.backward()
        work.wait()
        values = summed.tolist()
        assert window_result(values, step=0).items == 2 + 6
    # no destroy_process_group(): the interpreter's exit follows the last collective's callbacks at once


if __name__ == "__main__":
    main()
