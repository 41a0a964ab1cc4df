"""The stateful, DP-sharded dataloader: exact mid-epoch resume, disjoint shards, reshuffles."""

from __future__ import annotations

import pytest

from areal.api.config.data import ArithmeticConfig, DatasetConfig
from areal.dataset import ShardedBatchSampler, create_dataloader, load_dataset

CFG = DatasetConfig(batch_size=4, arithmetic=ArithmeticConfig(n_train=30))


def _ids(batches):
    return [[item["id"] for item in batch] for batch in batches]


@pytest.mark.parametrize("stop_after", [0, 3, 7])  # start, mid-epoch, exactly at epoch end
def test_resumed_loader_yields_the_identical_remaining_sequence(stop_after):
    ds = load_dataset(CFG)
    loader = create_dataloader(ds, CFG, seed=7, dp_rank=1, dp_world=2)
    it = iter(loader)
    for _ in range(stop_after):
        next(it)
    state = loader.state_dict()
    rest = _ids(it) + _ids(loader) + _ids(loader)  # rest of this epoch, then two more
    resumed = create_dataloader(ds, CFG, seed=7, dp_rank=1, dp_world=2)
    resumed.load_state_dict(state)
    assert _ids(resumed) + _ids(resumed) + _ids(resumed) == rest


def test_ranks_get_disjoint_halves_of_each_global_batch():
    ds = load_dataset(CFG)
    shards = [_ids(create_dataloader(ds, CFG, seed=1, dp_rank=r, dp_world=2)) for r in (0, 1)]
    assert len(shards[0]) == len(shards[1]) == 30 // 4
    for a, b in zip(*shards):
        assert len(a) == len(b) == 2 and not set(a) & set(b)
    seen = [i for shard in shards for batch in shard for i in batch]
    assert len(seen) == len(set(seen)) == 28  # drop_last drops 30 % 4 = 2 items


def test_each_epoch_is_a_new_permutation_fixed_by_the_seed():
    s = ShardedBatchSampler(12, 4, seed=0, shuffle=True, drop_last=True, dp_rank=0, dp_world=1)
    e0, e1 = s.epoch_batches(0), s.epoch_batches(1)
    assert e0 != e1 and sorted(sum(e0, [])) == sorted(sum(e1, [])) == list(range(12))
    assert e0 == ShardedBatchSampler(12, 4, 0, True, True, 0, 1).epoch_batches(0)


def test_without_drop_last_the_last_batch_is_padded_for_every_rank():
    s = ShardedBatchSampler(10, 4, seed=0, shuffle=False, drop_last=False, dp_rank=1, dp_world=2)
    # global batches [0..3], [4..7], [8, 9, 0, 1] (wrapped); rank 1 takes the second half
    assert s.epoch_batches(0) == [[2, 3], [6, 7], [0, 1]]


def test_unpadded_the_last_batch_gives_each_item_once_and_a_rank_may_get_none():
    # global batches [0..3], [4..7], [8, 9]: rank 0 takes 8 and 9, rank 1 nothing of the last
    shards = [ShardedBatchSampler(10, 4, 0, False, False, r, 2, pad=False) for r in (0, 1)]
    assert [s.epoch_batches(0) for s in shards] == [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], []]]
    # a held-out set of 8 under a batch of 200 (the eval batch's default): 8 items, not 200
    assert ShardedBatchSampler(8, 200, 0, False, False, 0, 1, pad=False).epoch_batches(0) == [
        list(range(8))
    ]


def test_batch_size_must_divide_over_ranks():
    with pytest.raises(ValueError, match="not divisible by the 3 data-parallel ranks"):
        ShardedBatchSampler(10, 4, 0, True, True, 0, 3)
