"""No device value is read on the host per microbatch, on any path, engine or integration (2 gloo ranks).

The loader hands out `reads.HostTensor`s and the batch reaches the device as `reads.DeviceTensor`s: a count returned
by `training_step` (or given to `fabric.backward`) is computed from the device batch, one `ItemCounter` (or
`count_ahead`) takes from the host batch. Every host read of a tensor made by `lightning_weighted` is noted with its
optimizer step: reading a device value (a synchronisation on a GPU) fails the test, and each step makes one read of
its own, the window's payload (its step decision and logged values together). Every cell of the oracle
(`cells.py`) runs, on uneven batch counts (a rank replays), and trains the oracle's float64 reference there too.
"""

from __future__ import annotations

from collections import Counter

from cells import EVERY_CELL, SCENARIO, WEIGHTED, counted_where_the_path_says, departures, train
from harness import strategy_reads
from scenario import Config, reference


@EVERY_CELL
def test_no_microbatch_reads_a_device_value_and_each_step_reads_its_payload_once(tmp_path, front, engine, path):
    # rank 1 holds 3 microbatches to rank 0's 5 and replays to keep in step (plain DDP hangs or crashes there)
    lengths = (5, 3)
    fields = {"accumulate": 2, "lengths": lengths, "host_reads": True}
    expected = reference(Config(**{**SCENARIO, **fields}))
    weighted = train(front, WEIGHTED[engine], path, tmp_path, **fields)
    assert departures(weighted, expected) == []
    assert counted_where_the_path_says(front, path, weighted)
    for rank, (record, held) in enumerate(zip(weighted, lengths, strict=True)):
        assert [w[1] for w in record["windows"]] == expected["items"]
        assert [w[2] for w in record["windows"]] == [local[rank] for local in expected["local_items"]]
        assert record["padding"] == ([False] * held + [True] * (max(lengths) - held)) * 2  # replays, and only they
        assert strategy_reads(record, "device", ours=True) == Counter()  # no synchronisation inside a window
        assert strategy_reads(record, "other", ours=True) == Counter(range(len(expected["items"])))


def test_the_check_fails_where_a_per_microbatch_read_is_put_back():
    # the control: the same spy and count, in one process; a count read on the host (`host=True`, what the riding
    # path did with every returned count) is a device read by lightning_weighted, which the test above refuses
    import torch
    from reads import DeviceTensor, ReadSpy

    from lightning_weighted.count import read_count
    from lightning_weighted.window import Window, payload

    spy = ReadSpy()
    spy.install()
    spy.active, spy.mark = True, (0, 0)
    try:
        count = torch.tensor(3).as_subclass(DeviceTensor)
        window = Window()
        window.add(read_count(count), loss=torch.tensor(1.5).as_subclass(DeviceTensor))
        payload([window], True, torch.device("cpu"))
        assert strategy_reads({"reads": spy.reads}, "device", ours=True) == Counter()
        window.add(read_count(count, host=True))
        assert strategy_reads({"reads": spy.reads}, "device", ours=True) == Counter({0: 1})
    finally:
        spy.uninstall()
