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


def test_the_sampler_lightning_inserts_is_replaced_and_one_of_the_users_own_stays():
    import torch
    from torch.utils.data import DataLoader

    from lightning_weighted.data import Replicas, without_padding

    data = torch.arange(7)
    # what Lightning builds from the strategy's `distributed_sampler_kwargs`, whose rank count is marked
    inserted = DataLoader(data, sampler=DistributedSampler(data, num_replicas=Replicas(2), rank=1, shuffle=False))
    replaced = without_padding(inserted)
    assert replaced is inserted and type(inserted.sampler) is UnpaddedDistributedSampler
    assert list(inserted.sampler) == [1, 3, 5]  # no item repeated to even the ranks out
    own = DataLoader(data, sampler=DistributedSampler(data, num_replicas=2, rank=1, shuffle=False))
    assert without_padding(own) is own and type(own.sampler) is DistributedSampler  # the user's choice stays
    assert list(own.sampler) == [1, 3, 5, 0]
