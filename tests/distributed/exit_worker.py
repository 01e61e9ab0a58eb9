"""A bare DDP loop with the weighted hook that exits right after its last window: one of two gloo processes.

Rank and world come from ``RANK`` and ``WORLD_SIZE``, the rendezvous from ``MASTER_ADDR`` and ``MASTER_PORT``;
``--rides`` lets the counts ride in the gradient bucket (otherwise they take their own all-reduce).
"""

from __future__ import annotations

import argparse
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_weighted import LossScale, WeightedReduceState, Window, weighted_allreduce_hook
from lightning_weighted._counts import count_of


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rides", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank = dist.get_rank()
    torch.manual_seed(0)
    ddp = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)))
    state = WeightedReduceState(rides=args.rides)
    ddp.register_comm_hook(state, weighted_allreduce_hook)
    for _ in range(3):
        x = torch.randn(2 + 4 * rank, 8)
        window = Window(LossScale.ITEM_SUM if args.rides else LossScale.MEAN_SIZED)
        loss = ddp(x).pow(2).mean()
        loss = loss * window.add(count_of({"count": len(x)}, x), loss)
        state.begin_window(window.payload(rank), window.reference, torch.device("cpu"))
        loss.backward()
        assert window.finish(state.counts()).items == 2 + 6
    # no destroy_process_group(): the interpreter's exit follows the last collective's callbacks at once


if __name__ == "__main__":
    main()
