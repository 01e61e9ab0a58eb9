"""The unpadded sampler: every index exactly once per epoch, as `DistributedSampler` would order them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from lightning_weighted import UnpaddedDistributedSampler
from lightning_weighted.loaders.sampler import InsertedReplicas, dealt_sampler, marked, taken, without_padding


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
    data = torch.arange(7)
    # what Lightning builds from the strategy's `distributed_sampler_kwargs`, whose rank count is marked
    inserted = DataLoader(
        data, sampler=DistributedSampler(data, num_replicas=InsertedReplicas(2), rank=1, shuffle=False)
    )
    replaced = without_padding(inserted)
    assert replaced is inserted and type(inserted.sampler) is UnpaddedDistributedSampler
    assert list(inserted.sampler) == [1, 3, 5]  # no item repeated to even the ranks out
    own = DataLoader(data, sampler=DistributedSampler(data, num_replicas=2, rank=1, shuffle=False))
    assert without_padding(own) is own and type(own.sampler) is DistributedSampler  # the user's choice stays
    assert list(own.sampler) == [1, 3, 5, 0]


def test_marked_kwargs_carry_the_rank_count_as_inserted_replicas_and_leave_the_given_ones_alone():
    given = {"num_replicas": 4, "rank": 1}
    kwargs = marked(given)
    assert kwargs == given and type(kwargs["num_replicas"]) is InsertedReplicas and kwargs["num_replicas"] == 4
    assert type(given["num_replicas"]) is int  # a copy is marked
    sampler = DistributedSampler(range(8), **kwargs)
    assert isinstance(sampler.num_replicas, InsertedReplicas)  # what tells Lightning's sampler from the user's


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")  # torchdata 0.11's, on torch 2.13
@pytest.mark.parametrize("shuffle", [False, True])
def test_a_stateful_loader_lightning_rebuilt_around_its_sampler_shards_every_item_exactly_once(shuffle):
    from lightning.pytorch.utilities.data import _update_dataloader
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = list(range(7))
    shards = []
    for rank in range(2):
        # as Lightning inserts it: the loader built again around a DistributedSampler of the strategy's rank count
        inserted = DistributedSampler(data, num_replicas=InsertedReplicas(2), rank=rank, shuffle=shuffle, seed=5)
        loader = _update_dataloader(StatefulDataLoader(data, batch_size=2), inserted)
        assert loader.batch_sampler.sampler is inserted and loader.sampler is not inserted  # torchdata keeps it there
        assert len([i for batch in loader for i in batch.tolist()]) == 4  # padded: one item twice over the ranks
        own = loader.sampler
        assert without_padding(loader) is loader
        sampler = loader.batch_sampler.sampler
        assert type(sampler) is UnpaddedDistributedSampler and loader.sampler is own
        assert (sampler.num_replicas, sampler.rank, sampler.shuffle, sampler.seed) == (2, rank, shuffle, 5)
        shards.append([i for batch in loader for i in batch.tolist()])
    assert sorted(shards[0] + shards[1]) == data  # every item exactly once over the 2 ranks
    assert [len(shard) for shard in shards] == [4, 3]


def test_lightnings_wrapper_of_a_users_sampler_is_unpadded_keeping_what_the_users_sampler_draws():
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

    data = list(range(10, 20))
    drawn = [5, 3, 1, 7, 9]  # a sampler of the user's: the dataset indices it draws, in its order
    shards = []
    for rank in range(2):
        # what Lightning inserts around a sampler of the user's, from the strategy's marked kwargs
        wrapper = DistributedSamplerWrapper(drawn, num_replicas=InsertedReplicas(2), rank=rank, shuffle=False)
        loader = DataLoader(data, sampler=wrapper, batch_size=None)
        assert [int(x) for x in loader] == [[15, 11, 19], [13, 17, 15]][rank]  # padded: 15 twice over the ranks
        assert without_padding(loader) is loader
        shards.append([int(x) for x in loader])
    assert shards == [[15, 11, 19], [13, 17]]  # each draw of the user's sampler once, in its order


@settings(max_examples=200, deadline=None)
@given(
    size=st.integers(1, 120),
    world=st.integers(1, 4),
    again=st.integers(1, 4),
    batch=st.integers(1, 5),
    steps=st.integers(0, 30),
    shuffle=st.booleans(),
)
def test_the_items_ranks_took_in_step_are_a_prefix_of_the_order_and_the_rest_dealt_again_repeats_none(
    size, world, again, batch, steps, shuffle
):
    # every rank takes `steps` batches (fewer where its shard ends): what they took, together, is the epoch's order
    # up to the number of items taken, so dealing from there over another number of ranks trains each item once
    shards = [UnpaddedDistributedSampler(range(size), world, rank, shuffle=shuffle, seed=2) for rank in range(world)]
    order = shards[0].order()
    loader = DataLoader(range(size), batch_size=batch)
    took = [taken(loader, list(shard), steps) for shard in shards]
    seen = {i for shard, n in zip(shards, took, strict=True) for i in list(shard)[:n]}
    assert seen == set(order[: sum(took)])
    rest = []
    for rank in range(again):
        dealt = UnpaddedDistributedSampler(range(size), again, rank, shuffle=shuffle, seed=2)
        dealt.deal_from(0, sum(took))
        rest.append(list(dealt))
        assert len(dealt) == len(rest[-1])
    assert sorted([*seen, *(i for share in rest for i in share)]) == list(range(size))
    assert max(map(len, rest)) - min(map(len, rest)) <= 1


def test_an_epoch_dealt_from_a_point_is_that_epoch_alone_the_next_one_is_whole():
    sampler = UnpaddedDistributedSampler(range(10), 2, 1, shuffle=False)
    sampler.deal_from(3, 6)  # epoch 3's first 6 items trained: rank 1 of 2 takes items 7 and 9
    assert (list(sampler), len(sampler)) == ([7, 9], 2)
    sampler.set_epoch(4)
    assert (list(sampler), len(sampler)) == ([1, 3, 5, 7, 9], 5)


def test_taken_counts_the_items_of_a_loaders_first_batches_of_any_size():
    class Varied(BatchSampler):  # 1, 2, 3 indices in turn
        def __iter__(self):
            indices, size = list(self.sampler), 1
            while indices:
                yield indices[:size]
                indices, size = indices[size:], size % 3 + 1

    indices = list(range(10, 20))
    assert taken(DataLoader(range(20), batch_size=4), indices, 2) == 8
    assert taken(DataLoader(range(20), batch_size=4), indices, 5) == 10  # its last batch short, the rest none
    assert taken(DataLoader(range(20), batch_sampler=Varied(range(20), 1, False)), indices, 3) == 6
    assert taken(DataLoader(range(20), batch_size=None), indices, 4) == 4  # one item a batch


def test_the_sampler_dealt_again_is_lightnings_inserted_one_not_a_sampler_of_the_users_own():
    inserted = DataLoader(range(8), sampler=DistributedSampler(range(8), InsertedReplicas(2), 0))
    own = DataLoader(range(8), sampler=DistributedSampler(range(8), 2, 0))
    assert isinstance(dealt_sampler(without_padding(inserted)), UnpaddedDistributedSampler)
    assert dealt_sampler(without_padding(own)) is None and dealt_sampler(DataLoader(range(8))) is None
