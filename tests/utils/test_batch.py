import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal.utils.batch import (
    PackedBatch,
    allocate_bins,
    balance_across_ranks,
    split_microbatches,
)


def _batch(lengths, with_seq=True):
    ids = [[100 * i + j for j in range(n)] for i, n in enumerate(lengths)]
    logp = [[float(-x) for x in row] for row in ids]
    seq = {"rewards": torch.arange(len(lengths), dtype=torch.float32)} if with_seq else None
    return PackedBatch.from_sequences({"input_ids": ids, "logprobs": logp}, seq)


def test_packing_hand_worked():
    b = _batch([2, 3])
    assert b.cu_seqlens.tolist() == [0, 2, 5]
    assert b["input_ids"].tolist() == [0, 1, 100, 101, 102]
    assert b.position_ids().tolist() == [0, 1, 0, 1, 2]
    assert b.seq_index().tolist() == [0, 0, 1, 1, 1]
    assert b["logprobs"].dtype == torch.float32 and b["input_ids"].dtype == torch.long


def test_pad_unpad_round_trip():
    b = _batch([2, 3, 1])
    padded, mask = b.to_padded(pad_value=-1)
    assert padded["input_ids"].tolist() == [[0, 1, -1], [100, 101, 102], [200, -1, -1]]
    assert mask.sum(1).tolist() == [2, 3, 1]
    back = PackedBatch.from_padded(padded, mask, b.seqs)
    assert torch.equal(back["input_ids"], b["input_ids"]) and torch.equal(
        back.cu_seqlens, b.cu_seqlens
    )


def test_select_picks_sequences_in_the_given_order():
    b = _batch([2, 3, 1])
    s = b.select([2, 0])
    assert s["input_ids"].tolist() == [200, 0, 1] and s["rewards"].tolist() == [2.0, 0.0]
    assert s.cu_seqlens.tolist() == [0, 1, 3]


def test_mismatched_field_lengths_are_rejected():
    with pytest.raises(ValueError, match="token field 'logprobs' has 2 rows, expected 3"):
        PackedBatch(torch.tensor([0, 3]), {"input_ids": torch.zeros(3), "logprobs": torch.zeros(2)})


def test_allocate_bins_hand_worked():
    # lengths 5,4,3,2,2 budget 8: sum 16 -> ceil(16/8) = 2 bins to start.
    # 5 -> bin0 (0); 4 -> bin1 (0); 3 -> least loaded with room: bin1 (4) -> 7;
    # 2 -> bin0 (5) -> 7; 2 -> neither bin has room for 2 (7+2 > 8) -> new bin2.
    assert allocate_bins([5, 4, 3, 2, 2], 1, 8) == [[0, 3], [1, 2], [4]]
    # no budget, at least 3 bins: 5 | 4 | 3 then 2 -> bin of 3 (5), 2 -> bin of 4 (6)
    assert allocate_bins([5, 4, 3, 2, 2], 3, None) == [[0], [1, 4], [2, 3]]
    # fewer items than n_min_bins: one bin per item, never an empty bin
    assert allocate_bins([3, 1], 4, None) == [[0], [1]]


def test_sequence_longer_than_budget_names_length_and_budget():
    with pytest.raises(
        ValueError,
        match="item 1 has 9 tokens, more than the micro-batch budget max_tokens_per_mb=8",
    ):
        allocate_bins([3, 9], 1, 8)


def test_groups_stay_together():
    b = _batch([1, 1, 5, 5])
    mbs = split_microbatches(b, n_mbs=2, max_tokens_per_mb=10, granularity=2)
    assert sorted(mbs.indices) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="granularity=3"):
        split_microbatches(b, granularity=3)


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 50), min_size=1, max_size=40),
    n_mbs=st.integers(1, 8),
    slack=st.integers(0, 60),
)
def test_split_properties(lengths, n_mbs, slack):
    budget = max(lengths) + slack
    b = _batch(lengths, with_seq=False)
    mbs = split_microbatches(b, n_mbs=n_mbs, max_tokens_per_mb=budget)
    flat = sorted(i for idx in mbs.indices for i in idx)
    assert flat == list(range(len(lengths)))  # every sequence exactly once
    assert all(mb.n_tokens <= budget for mb in mbs.mbs)  # budget respected
    assert len(mbs.mbs) >= min(n_mbs, len(lengths))  # at least n_mbs bins (when possible)
    for mb, idx in zip(mbs.mbs, mbs.indices):  # contents are the selected sequences
        assert torch.equal(mb["input_ids"], b.select(idx)["input_ids"])
    restored = mbs.restore_order(
        [[int(mb["input_ids"][s]) for s in mb.cu_seqlens[:-1]] for mb in mbs.mbs]
    )
    assert restored == [100 * i for i in range(len(lengths))]


@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.integers(1, 50), min_size=4, max_size=40), n_ranks=st.integers(1, 4))
def test_rank_balance_properties(lengths, n_ranks):
    b = _batch(lengths, with_seq=False)
    parts = balance_across_ranks(b, n_ranks)
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1  # same number of sequences per rank (+-1)
    loads = [sum(lengths[i] for i in p) for p in parts]
    # greedy longest-first: the spread never exceeds the longest sequence
    assert max(loads) - min(loads) <= max(lengths)


def test_rank_balance_hand_worked():
    # lengths 8,1,1,6 on 2 ranks with 2 sequences each: 8 -> r0, 6 -> r1, 1 -> r1 (6<8), 1 -> r0
    assert balance_across_ranks(_batch([8, 1, 1, 6]), 2) == [[0, 2], [1, 3]]
