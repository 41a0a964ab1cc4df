"""Tier 1: the reallocation plan (areal/core/realloc.py) against hand-worked numbers.

A toy model of float32 parameters (4 bytes each), one decoder layer unless said otherwise:
q_proj.weight [4, 2] (column-parallel: tp cuts rows), o_proj.weight [2, 4] (row-parallel: tp
cuts columns), norm.weight [2] and embed_tokens.weight [6, 2] (replicated over tp). FSDP cuts
dim 0 of the tp-local tensor over dp. 30 elements, 120 bytes in all.
"""

from __future__ import annotations

import pytest

from areal.api.mfc import ModelName
from areal.core.dfg import Allocation
from areal.core.realloc import (
    ModelShapes,
    chunk,
    format_bytes,
    pieces_for,
    plan_realloc,
    shard_box,
    stage_layers,
)

M = ModelName("actor")


def toy(n_layers: int = 1) -> ModelShapes:
    shapes = {"model.embed_tokens.weight": (6, 2)}
    for i in range(n_layers):
        shapes[f"model.layers.{i}.self_attn.q_proj.weight"] = (4, 2)
        shapes[f"model.layers.{i}.self_attn.o_proj.weight"] = (2, 4)
    shapes["model.norm.weight"] = (2,)
    return ModelShapes(shapes, n_layers, tied=True, itemsize=4)


def layout(workers, dp=1, tp=1, pp=1) -> Allocation:
    return Allocation(M, tuple(workers), dp, tp, pp)


def test_chunks_follow_torch_chunk_sizes():
    # 5 in 2: ceil(5/2) = 3 -> [0, 3) and [3, 5); 1 in 4: [0, 1) then empty chunks
    assert [chunk(5, 2, i) for i in range(2)] == [(0, 3), (3, 5)]
    assert [chunk(1, 4, i) for i in range(4)] == [(0, 1), (1, 1), (1, 1), (1, 1)]


def test_stages_split_layers_evenly_first_stages_longer():
    assert stage_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_layers(4, 4) == [range(i, i + 1) for i in range(4)]
    with pytest.raises(ValueError, match="pp=3 stages for a model of 2 decoder layers"):
        stage_layers(2, 3)


def test_shard_boxes_compose_tp_then_fsdp_dp():
    model, mesh = toy(), layout([0, 1, 2, 3], dp=2, tp=2)  # worker 1 = dp 0, tp 1
    q = "model.layers.0.self_attn.q_proj.weight"
    o = "model.layers.0.self_attn.o_proj.weight"
    # q rows: tp 1 holds [2, 4), dp 0 the first half of those: [2, 3)
    assert shard_box(q, (4, 2), mesh, 1, model) == ((2, 3), (0, 2))
    # o: tp 1 holds columns [2, 4), dp 0 row [0, 1)
    assert shard_box(o, (2, 4), mesh, 1, model) == ((0, 1), (2, 4))
    assert shard_box("model.norm.weight", (2,), mesh, 3, model) == ((1, 2),)


def test_tp2_to_tp1_fetches_the_other_half_of_each_cut_parameter():
    # worker 0 keeps its halves and the replicated norm and embedding; from worker 1 it fetches
    # q rows [2, 4) (2 x 2 = 4 elements) and o columns [2, 4) (4): 8 x 4 B = 32 B
    plan = plan_realloc(layout([0, 1], tp=2), layout([0]), toy())
    assert plan.received == {0: 32} and plan.sent == {0: 0, 1: 32}
    assert plan.kept == {0: 120 - 32} and plan.model_bytes == 120 and plan.moved == 32


def test_tp1_to_tp2_sends_the_new_rank_its_whole_shard():
    # worker 1 needs q rows [2, 4) (4), o columns [2, 4) (4), norm (2), embedding (12): 88 B
    plan = plan_realloc(layout([0]), layout([0, 1], tp=2), toy())
    assert plan.received == {0: 0, 1: 88} and plan.sent == {0: 88}


def test_dp2_to_dp1_fetches_the_second_half_of_dim_0():
    # from worker 1: q rows [2, 4) (4), o row 1 (4), norm [1] (1), embedding rows [3, 6) (6)
    plan = plan_realloc(layout([0, 1], dp=2), layout([0]), toy())
    assert plan.received == {0: 15 * 4}


def test_replicated_boxes_are_read_from_holders_by_destination_position():
    # tp2 on workers 0, 1 -> dp2 on workers 2, 3: worker 2 (position 0) reads a box both hold
    # from worker 0, worker 3 from worker 1; each destination needs half of every tensor
    plan = plan_realloc(layout([0, 1], tp=2), layout([2, 3], dp=2), toy())
    assert plan.received == {2: 60, 3: 60} and plan.moved == 120
    norm = [p for p in pieces_for(3, plan.source, plan.target, toy()) if "norm" in p.name]
    assert [(p.box, p.source, p.local) for p in norm] == [(((1, 2),), 1, False)]


def test_pp2_to_dp2_moves_the_other_stage_half():
    # 2 layers; stage 0 = worker 0: embedding (tied: also on stage 1) and layer 0; stage 1 =
    # worker 1: layer 1, norm, embedding. dp2 on the same workers: each needs dim-0 halves.
    # worker 0 lacks layer 1's halves (q rows [0, 2): 4, o row 0: 4) and norm [0] (1): 9 el;
    # worker 1 lacks layer 0's second halves: 8 el (the embedding it holds: tied)
    plan = plan_realloc(layout([0, 1], pp=2), layout([0, 1], dp=2), toy(n_layers=2))
    assert plan.received == {0: 9 * 4, 1: 8 * 4}


def test_same_layout_moves_nothing():
    same = layout([0, 1], dp=2)
    assert plan_realloc(same, same, toy()).moved == 0


@pytest.mark.parametrize(
    "n, text", [(512, "512 B"), (1536, "1.5 KiB"), (3 << 20, "3 MiB"), (5 << 30, "5 GiB")]
)
def test_bytes_print_in_binary_units(n, text):
    assert format_bytes(n) == text


def test_shards_follow_group_ranks_not_the_order_workers_are_listed_in():
    # torch ranks a process group's members by global rank: a dp group listed [1, 0] still
    # gives worker 0 the first chunk (embedding rows [0, 3))
    swapped = layout([1, 0], dp=2)
    assert shard_box("model.embed_tokens.weight", (6, 2), swapped, 0, toy()) == ((0, 3), (0, 2))
    assert plan_realloc(layout([0, 1], dp=2), swapped, toy()).moved == 0
