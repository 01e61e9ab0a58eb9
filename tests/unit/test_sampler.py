"""The unpadded sampler: every index exactly once per epoch, as `DistributedSampler` would order them."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler

from lightning_weighted import UnpaddedDistributedSampler


@settings(max_examples=300, deadline=None)
@given(
    size=st.integers(0, 300),
    world_size=st.integers(1, 4),
    shuffle=st.booleans(),
    seed=st.integers(0, 10),
    epoch=st.integers(0, 5),
)
def test_every_index_appears_exactly_once_per_epoch_over_all_ranks(size, world_size, shuffle, seed, epoch):
    shards = []
    for rank in range(world_size):
        sampler = UnpaddedDistributedSampler(range(size), world_size, rank, shuffle=shuffle, seed=seed)
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
        assert len(shards[-1]) == len(sampler)
    assert sorted(i for shard in shards for i in shard) == list(range(size))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


@pytest.mark.parametrize("shuffle", [False, True])
def test_it_shards_the_same_order_as_distributed_sampler_when_no_padding_is_needed(shuffle):
    for rank in range(4):
        ours = UnpaddedDistributedSampler(range(40), 4, rank, shuffle=shuffle, seed=3)
        theirs = DistributedSampler(range(40), 4, rank, shuffle=shuffle, seed=3)
        ours.set_epoch(2)
        theirs.set_epoch(2)
        assert list(ours) == list(theirs)


def test_set_epoch_reshuffles():
    sampler = UnpaddedDistributedSampler(range(50), 2, 0)
    first = list(sampler)
    sampler.set_epoch(1)
    assert list(sampler) != first
    assert sorted(first) == sorted(list(UnpaddedDistributedSampler(range(50), 2, 0)))


def test_a_dataset_without_length_is_refused():
    class Stream:
        def __iter__(self):
            return iter(())

    with pytest.raises(TypeError, match="needs a dataset with a length"):
        UnpaddedDistributedSampler(Stream(), 2, 0)  # type: ignore[arg-type]
