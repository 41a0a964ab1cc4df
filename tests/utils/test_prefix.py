"""Tier 1: the shared-prefix layout of a micro-batch, against hand-written rows and masks."""

from __future__ import annotations

import torch

from areal.utils.batch import PackedBatch
from areal.utils.prefix import share_prefixes


def _batch(seqs, group_index, prompt_lens) -> PackedBatch:
    return PackedBatch.from_sequences(
        {"input_ids": seqs}, {"group_index": group_index, "prompt_lens": prompt_lens}
    )


def test_a_group_runs_its_prompt_once_and_completions_restart_after_it():
    # group 0: prompt [1, 2, 3] with completions [4, 5] and [6]; group 1: one sequence [7, 8].
    mb = _batch([[1, 2, 3, 4, 5], [1, 2, 3, 6], [7, 8]], [0, 0, 1], [3, 3, 1])
    row = share_prefixes(mb)
    assert row.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert row.position_ids.tolist() == [0, 1, 2, 3, 4, 3, 0, 1]
    assert row.index.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 5, 6, 7]
    assert torch.equal(row.input_ids[row.index], mb["input_ids"])  # every token maps to itself
    assert row.bounds == [(0, 6), (6, 8)] and row.masks[1] is None  # a lone sequence: causal
    expected = torch.tensor(
        [  # rows attend to columns: prompt causal, each completion prompt + itself
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0, 0],
            [1, 1, 1, 1, 1, 0],
            [1, 1, 1, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(row.masks[0], expected)


def test_nothing_is_shared_without_group_fields_or_equal_prompts():
    plain = PackedBatch.from_sequences({"input_ids": [[1, 2, 3], [1, 2, 4]]})
    assert share_prefixes(plain) is None  # SFT-style data
    differ = _batch([[1, 2, 3], [1, 9, 4]], [0, 0], [2, 2])  # same group id, different prompts
    assert share_prefixes(differ) is None
    apart = _batch([[1, 2, 3], [5, 5], [1, 2, 4]], [0, 1, 0], [2, 1, 2])  # not consecutive
    assert share_prefixes(apart) is None
