"""No device value is read on the host per microbatch, on any path, engine or integration (2 gloo ranks).

The loader hands out `reads.HostTensor`s and the batch reaches the device as `reads.DeviceTensor`s: a count returned
by `training_step` (or given to `fabric.backward`) is computed from the device batch, one `ItemCounter` (or
`count_ahead`) takes from the host batch. Every host read of a tensor made by `lightning_weighted` is noted with its
optimizer step: reading a device value (a synchronisation on a GPU) fails the test, and each step makes one read of
its own, the window's payload (its step decision and logged values together).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from fabric_worker import FabricConfig
from harness import fit, strategy_reads
from scenario import Config, max_relative_error, reference
from sharded import ShardedConfig, fit_sharded

BASE = {"accumulate": 2, "lengths": (5, 3), "host_reads": True, "mode": "tokens"}  # uneven ranks: replays too
AHEAD = {"counter": "quiet", "bare_loss": True}  # ItemCounter counts the host batch, ahead


def _fabric(config: Any, tmp_path: Path) -> Any:
    return fit(config, tmp_path, script="fabric_worker.py")


COMBINATIONS = [
    # integration and engine, how the run is trained, the config, where its counts come from
    ("Trainer DDP", fit, Config(strategy="ddp_weighted", **BASE), {}),
    ("Trainer DDP", fit, Config(strategy="ddp_weighted", **BASE), AHEAD),
    ("Trainer FSDP2", fit_sharded, ShardedConfig(strategy="fsdp2_weighted", **BASE), {}),
    ("Trainer FSDP2", fit_sharded, ShardedConfig(strategy="fsdp2_weighted", **BASE), AHEAD),
    ("Trainer FSDP1", fit_sharded, ShardedConfig(strategy="fsdp_weighted", **BASE), {}),
    ("Trainer FSDP1", fit_sharded, ShardedConfig(strategy="fsdp_weighted", **BASE), AHEAD),
    ("Fabric DDP", _fabric, FabricConfig(strategy="ddp_weighted", **BASE), {}),
    ("Fabric DDP", _fabric, FabricConfig(strategy="ddp_weighted", **BASE), {"ahead": True}),
    ("Fabric FSDP2", _fabric, FabricConfig(strategy="fsdp2_weighted", **BASE), {}),
    ("Fabric FSDP2", _fabric, FabricConfig(strategy="fsdp2_weighted", **BASE), {"ahead": True}),
]


@pytest.mark.parametrize(
    ("train", "config", "ahead"),
    [pytest.param(t, c, a, id=f"{name}-{'ahead' if a else 'returned'}") for name, t, c, a in COMBINATIONS],
)
def test_no_microbatch_reads_a_device_value_and_each_step_reads_its_payload_once(tmp_path, train, config, ahead):
    config = dataclasses.replace(config, **ahead)
    result = train(config, tmp_path)
    assert max_relative_error(result[0]["params"], reference(config)["params"]) < 1e-5
    for rank in result:
        assert strategy_reads(rank, "device", ours=True) == Counter()  # no synchronisation inside a window
        steps = len(rank["steps"])
        assert strategy_reads(rank, "other", ours=True) == Counter({step: 1 for step in range(steps)})


def test_the_check_fails_where_a_per_microbatch_read_is_put_back():
    # the control: the same spy and count, in one process; a count read on the host (`host=True`, what the riding
    # path did with every returned count) is a device read by lightning_weighted, which the test above refuses
    import torch
    from reads import DeviceTensor, ReadSpy

    from lightning_weighted.counts import read_count
    from lightning_weighted.window import Window

    spy = ReadSpy()
    spy.install()
    spy.active, spy.mark = True, (0, 0)
    try:
        count = torch.tensor(3).as_subclass(DeviceTensor)
        window = Window()
        window.add(read_count(count), loss=torch.tensor(1.5).as_subclass(DeviceTensor))
        window.payload(0, True, torch.device("cpu"))
        assert strategy_reads({"reads": spy.reads}, "device", ours=True) == Counter()
        window.add(read_count(count, host=True))
        assert strategy_reads({"reads": spy.reads}, "device", ours=True) == Counter({0: 1})
    finally:
        spy.uninstall()
