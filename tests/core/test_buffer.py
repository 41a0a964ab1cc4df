"""Tier 1: the master's sample buffer (metadata only) and the token-balanced split."""

from __future__ import annotations

import pytest

from areal.core.buffer import BufferFull, SampleBuffer, SampleMeta
from areal.utils.batch import split_by_tokens

# key -> MFCs reading it: a reads input_ids; b reads x (written by a); nobody reads y (b's)
CONSUMERS = {"input_ids": {"a"}, "x": {"b"}}
STEP = {"a", "b"}


def buffer(capacity: int = 10) -> SampleBuffer:
    return SampleBuffer(capacity, CONSUMERS, STEP)


def metas(ids, worker: int = 0):
    return [SampleMeta(i, 3, {"input_ids": worker}) for i in ids]


def test_steps_take_the_oldest_waiting_samples_first():
    buf = buffer()
    buf.put(metas([7, 8]))
    buf.put(metas([1, 2]))  # ids need not be ordered: age is the order of put
    assert buf.take_oldest(3) == [7, 8, 1]
    assert buf.take_oldest(1) == [2]


def test_a_step_cannot_take_more_than_is_waiting():
    buf = buffer()
    buf.put(metas([0, 1]))
    buf.take_oldest(2)
    with pytest.raises(ValueError, match="buffer has 0 waiting"):
        buf.take_oldest(1)


def test_a_key_is_released_after_its_last_reader_and_not_before():
    buf = buffer()
    buf.put(metas([0]))
    buf.take_oldest(1)
    assert buf.mark_used("a", [0]) == [(0, "input_ids", 0)]  # a was input_ids' only reader
    buf.add_keys([0], ("x",), worker=1)
    assert buf.meta(0).keys == {"x": 1}  # x waits for b


def test_a_sample_leaves_once_every_mfc_used_it_releasing_all_its_keys():
    buf = buffer()
    buf.put(metas([0, 1]))
    buf.take_oldest(2)
    buf.mark_used("a", [0, 1])
    buf.add_keys([0, 1], ("x", "y"), worker=1)  # y has no reader: kept until the sample leaves
    released = buf.mark_used("b", [0])
    assert sorted(released) == [(1, "x", 0), (1, "y", 0)]
    assert len(buf) == 1  # sample 1 still waits for b


def test_a_full_buffer_refuses_new_samples_whole():
    buf = buffer(capacity=3)
    buf.put(metas([0, 1]))
    with pytest.raises(BufferFull, match="holds 2 of 3 samples and cannot take 2 more"):
        buf.put(metas([2, 3]))
    assert len(buf) == 2  # nothing of the refused put went in
    buf.take_oldest(2)
    buf.mark_used("a", [0, 1])
    buf.mark_used("b", [0, 1])  # the step is over: room again
    buf.put(metas([2, 3]))
    assert len(buf) == 2


def test_a_sample_id_cannot_enter_twice():
    buf = buffer()
    buf.put(metas([0]))
    with pytest.raises(ValueError, match="sample 0 is already"):
        buf.put(metas([0]))


def test_split_by_tokens_balances_tokens_with_equal_counts():
    # lengths 5,1,4,2 on 2 ranks, 2 each: longest first to the least loaded rank:
    # 5 -> r0, 4 -> r1, 2 -> r1 (4 < 5), 1 -> r0: r0 = {0, 1} (6 tokens), r1 = {2, 3} (6 tokens)
    assert split_by_tokens([5, 1, 4, 2], 2, 1) == [[0, 1], [2, 3]]


def test_split_by_tokens_keeps_groups_whole():
    # groups (0,1)=4 tokens, (2,3)=10, (4,5)=2 on 2 ranks with quotas of 2 and 1 groups:
    # 10 -> r0; 4 -> r1 (now at its quota); 2 -> r0
    assert split_by_tokens([2, 2, 5, 5, 1, 1], 2, 2) == [[2, 3, 4, 5], [0, 1]]
