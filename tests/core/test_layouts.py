"""Tier 1: per-MFC layouts in the Core config (``layouts``): the graph they give (a replica of the
model on the layout, a reallocation hook before the MFC), the one-line errors, and what
``areal core graph`` prints (bytes from a model's config.json)."""

from __future__ import annotations

from pathlib import Path

import pytest

from areal.api.config import load_config
from areal.api.config.loader import ConfigError
from areal.api.mfc import ModelName, ParamRealloc
from areal.cli import main as cli_main
from areal.core.config import CoreGRPOConfig
from areal.core.dfg import Allocation
from areal.core.graphs import (
    CoreGraphConfig,
    allocations_for,
    graph_from_config,
    graph_mfcs,
    replica_sources,
    with_layouts,
)

ACTOR0, ACTOR1 = ModelName("actor"), ModelName("actor", 1)
# the seeds' allocation example: the actor trains on pp2 x dp2, infers on dp4; the ref on tp2
SEED_EXAMPLE = [
    "graph=sync_ppo", "n_workers=6", "use_ref=true", "prox_logp=true",
    "allocations=[{model: actor, workers: [0, 1, 2, 3], dp: 2, pp: 2}, "
    "{model: ref, workers: [4, 5], tp: 2}]",
    "layouts=[{mfc: actor_logp, dp: 4}]",
]  # fmt: skip


def small_model(tmp_path) -> str:
    """config.json of a 2-layer Qwen2: hidden 8, 2 heads of 4 (1 key/value head), MLP 16."""
    from transformers import Qwen2Config

    Qwen2Config(
        vocab_size=16,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    ).save_pretrained(tmp_path)
    return str(tmp_path)


def problems(argv: list[str], cls=CoreGraphConfig) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_config(cls, argv)
    return e.value.problems


def test_no_layouts_keep_the_graph_as_it_was():
    cfg = CoreGraphConfig(use_ref=True, use_critic=True, prox_logp=True, n_workers=2)
    mfcs, _ = graph_mfcs(cfg)
    allocations = allocations_for(cfg, mfcs)
    assert with_layouts(cfg, mfcs, allocations) == (mfcs, allocations, [])
    graph = graph_from_config(cfg)
    assert not any(isinstance(h, ParamRealloc) for m in graph.mfcs for h in m.hooks)
    assert replica_sources(graph) == {}


def test_a_layout_equal_to_the_model_allocation_moves_nothing():
    cfg = load_config(
        CoreGraphConfig, ["n_workers=2", "prox_logp=true", "layouts=[{mfc: actor_logp, dp: 2}]"]
    )
    assert graph_from_config(cfg) == graph_from_config(CoreGraphConfig(n_workers=2, prox_logp=True))


def test_seed_example_runs_actor_logp_on_a_dp4_replica_after_a_reallocation():
    graph = graph_from_config(load_config(CoreGraphConfig, SEED_EXAMPLE))
    logp = next(m for m in graph.mfcs if m.name == "actor_logp")
    assert logp.model == ACTOR1 and logp.hooks == (ParamRealloc(ACTOR0),)
    assert graph.allocations[ACTOR1] == Allocation(ACTOR1, (0, 1, 2, 3), dp=4)
    assert graph.allocations[ACTOR0] == Allocation(ACTOR0, (0, 1, 2, 3), dp=2, pp=2)
    assert graph.allocations[ModelName("ref")].tp == 2
    assert {m.name: m.model for m in graph.mfcs}["actor_train"] == ACTOR0
    assert replica_sources(graph) == {ACTOR1: ACTOR0}


@pytest.mark.parametrize(
    "layout, message",
    [
        ("{mfc: actor_lgp}", "layouts[0].mfc: 'actor_lgp' is no MFC of graph sync_ppo"),
        ("{mfc: actor_train}", "layouts[0].mfc: 'actor_train' trains model actor@0, so its "
         "layout is the model's own; set it under allocations (model: actor)"),
        ("{mfc: actor_gen}", "layouts[0].mfc: 'actor_gen' generates on the generation servers"),
        ("{mfc: actor_adv, dp: 2}", "layouts[0].mfc: 'actor_adv' uses no weights"),
        ("{mfc: ref_logp, tp: 2}", "layouts[0].mfc: 'ref_logp' runs on ref@0, which no MFC "
         "trains (nothing to reallocate); give ref this layout under allocations"),
        ("{mfc: actor_logp, dp: 3}", "layouts[0]: dp=3 x tp=1 x pp=1 needs 3 workers, and "
         "actor@0's own are [0, 1]; list 3 workers or change the sizes"),
        ("{mfc: actor_logp, workers: [1, 2], dp: 2}", "layouts[0].workers: [2] are not model "
         "workers (0..1)"),
        ("{mfc: actor_logp, workers: [1, 0, 1], dp: 2}", "layouts[0].workers: [1, 0, 1] are 3 "
         "workers, but dp=2 x tp=1 x pp=1 needs 2; list 2 workers or change the sizes"),
    ],
)  # fmt: skip
def test_a_bad_layout_is_one_line_naming_the_field_the_value_and_the_fix(layout, message):
    argv = ["n_workers=2", "use_ref=true", "prox_logp=true", f"layouts=[{layout}]"]
    got = problems(argv)
    assert len(got) == 1 and got[0].startswith(message), got


def test_two_layouts_for_one_mfc_are_refused():
    got = problems(
        [
            "n_workers=2",
            "prox_logp=true",
            "layouts=[{mfc: actor_logp, dp: 2}, {mfc: actor_logp, tp: 2}]",
        ]
    )
    assert got == ["layouts[1].mfc: 'actor_logp' has a layout already (layouts[0]); keep one"]


def test_more_stages_than_decoder_layers_are_refused_naming_the_model(tmp_path):
    path = small_model(tmp_path)
    got = problems([*SEED_EXAMPLE[:3], "allocations=[{model: actor, workers: [0, 1, 2], pp: 3}]",
                    f"model_path={path}"])  # fmt: skip
    assert got == [
        f"allocations[0].pp: 3 stages for a model of 2 decoder layers (model_path={path}); "
        "use pp <= 2"
    ]


def test_run_config_checks_layouts_under_core_against_the_actor(tiny_model_dir):
    yaml = str(Path(__file__).resolve().parents[2] / "examples" / "arithmetic_grpo.yaml")
    run = ["--config", yaml, f"actor.path={tiny_model_dir}"]

    def core_problems(*argv: str) -> list[str]:
        try:
            load_config(CoreGRPOConfig, [*run, *argv])
        except ConfigError as e:  # every one set here: each marked "(set on the command line)"
            mark = " (set on the command line)"
            core = [p for p in e.problems if p.startswith("core.")]
            assert all(p.endswith(mark) for p in core), core
            return [p.removesuffix(mark) for p in core]
        return []

    assert core_problems("core.layouts=[{mfc: actor_logp, dp: 2}]") == [
        "core.layouts: in_process hosts every model on its one worker; set backend=ray for layouts"
    ]
    ray = ["core.backend=ray", "core.n_workers=2"]
    assert core_problems(*ray, "core.layouts=[{mfc: actor_logp}]") == [
        "core.layouts[0].mfc: 'actor_logp' is no MFC of graph sync_ppo; name one that areal core "
        "graph lists"
    ]  # one PPO minibatch, no KL: no proximal-logp node
    prox = [*ray, "actor.ppo_n_minibatches=2", "actor.use_decoupled_loss=true"]
    assert core_problems(*prox, "core.layouts=[{mfc: actor_logp, dp: 2}]") == []
    # the tiny model has 4 decoder layers
    assert core_problems(*ray, "core.allocations=[{model: actor, workers: [0, 1], pp: 2}]") == []
    assert core_problems(*prox, "core.layouts=[{mfc: actor_logp, workers: [0, 1], pp: 8}]") == [
        "core.layouts[0].workers: [0, 1] are 2 workers, but dp=1 x tp=1 x pp=8 needs 8; list 8 "
        "workers or change the sizes",
        f"core.layouts[0].pp: 8 stages for a model of 4 decoder layers (actor.path="
        f"{tiny_model_dir}); use pp <= 4",
    ]


def test_areal_core_graph_prints_each_reallocation_and_its_bytes(tmp_path, capsys):
    # tp2 -> tp1 on worker 0: it fetches the other half of every tensor-parallel parameter. Per
    # layer: q 8x8 + bias 8, k and v 4x8 + bias 4 each, o 8x8, gate and up 16x8, down 8x16:
    # 592 elements, half from worker 1; 2 layers: 592 floats = 2368 B = 2.31 KiB
    path = small_model(tmp_path / "m")
    argv = ["n_workers=2", "prox_logp=true", f"model_path={path}",
            "allocations=[{model: actor, workers: [0, 1], tp: 2}]",
            "layouts=[{mfc: actor_logp, workers: [0]}]"]  # fmt: skip
    assert cli_main(["core", "graph", *argv]) == 0
    out = capsys.readouterr().out
    assert "  actor_logp: actor@0 (dp=1 x tp=2 on workers [0, 1])" in out
    assert "-> actor@1 (dp=1 x tp=1 on workers [0])" in out
    assert "moves 2.31 KiB between workers" in out
    assert "            0    2.31 KiB" in out and "[1]" in out


def test_the_critic_values_take_a_layout_of_their_own_too():
    allocations = "[{model: actor, workers: [0, 1], dp: 2}, {model: critic, workers: [1]}]"
    layouts = "[{mfc: critic_values, workers: [0, 1], tp: 2}]"
    argv = ["n_workers=2", "use_critic=true", f"allocations={allocations}", f"layouts={layouts}"]
    cfg = load_config(CoreGraphConfig, argv)
    graph = graph_from_config(cfg)
    critic, replica = ModelName("critic"), ModelName("critic", 1)
    assert graph.allocations[replica] == Allocation(replica, (0, 1), tp=2)
    assert replica_sources(graph) == {replica: critic}
    assert {m.name: m.model for m in graph.mfcs}["critic_train"] == critic
