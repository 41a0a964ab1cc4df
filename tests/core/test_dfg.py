"""Tier 1: the dataflow graph's validation (one test per invalid case) and the entry points'
graphs."""

from __future__ import annotations

import pytest

from areal.api.mfc import MFC, ModelFn, ModelName, ParamRealloc, UpdateServers, model_fn
from areal.cli import main as cli_main
from areal.core.dfg import Allocation, GraphError, build_graph, format_graph
from areal.core.graphs import CoreGraphConfig, graph_from_config
from areal.runtime.graphs import ROLLOUT_KEYS

A, B = ModelName("actor"), ModelName("critic")
KEYS = ("input_ids", "loss_mask")


def logp(name: str, out: str, reads: tuple[str, ...] = ("input_ids",), model: ModelName = A) -> MFC:
    return MFC(name, model, ModelFn.COMPUTE_LOGP, reads, (out,), {"out": out})


def build(mfcs, allocations=None, n_workers=2, keys=KEYS):
    if allocations is None:
        allocations = [Allocation(m, (0, 1), 2) for m in sorted({m.model for m in mfcs})]
    return build_graph("g", mfcs, keys, allocations, n_workers)


def problems_of(mfcs, **kw) -> list[str]:
    with pytest.raises(GraphError) as e:
        build(mfcs, **kw)
    return e.value.problems


def test_input_key_without_producer_names_the_mfc_and_the_key():
    (p,) = problems_of([logp("a", "x", ("input_ids", "values"))])
    assert "MFC 'a' reads key 'values'" in p and "no MFC writes" in p


def test_two_mfcs_writing_one_key_name_both_and_the_key():
    (p,) = problems_of([logp("a", "x"), logp("b", "x", model=B)])
    assert "key 'x' is written by MFC 'a' and by MFC 'b'" in p


def test_mfc_overwriting_a_dataset_key_is_refused():
    (p,) = problems_of([logp("a", "loss_mask")])
    assert "MFC 'a' writes key 'loss_mask', which comes from the dataset" in p


def test_cycle_names_each_mfc_and_key_on_it():
    (p,) = problems_of(
        [logp("a", "x", ("input_ids", "y")), logp("b", "y", ("input_ids", "x"), model=B)]
    )
    assert "cycle" in p
    assert "MFC 'a' reads key 'y' from MFC 'b'" in p and "MFC 'b' reads key 'x' from MFC 'a'" in p


def test_self_loop_is_a_cycle():
    (p,) = problems_of([logp("a", "x", ("input_ids", "x"))])
    assert "MFC 'a' reads key 'x' from MFC 'a'" in p


def test_declared_outputs_must_be_what_the_function_adds():
    bad = MFC("v", A, ModelFn.COMPUTE_VALUES, ("input_ids",), ("value",))
    (p,) = problems_of([bad])
    assert "MFC 'v' calls compute_values()" in p and "['values']" in p and "['value']" in p


def test_an_mfc_naming_a_method_no_engine_declares_is_refused_in_one_line():
    typo = MFC("entropy", A, "compute_entropyy", ("input_ids",), ("entropy",))
    (p,) = problems_of([typo])
    assert "\n" not in p
    assert p.startswith("MFC 'entropy' runs actor@0.compute_entropyy: no engine method declares")


def test_a_scripts_model_function_named_by_a_string_joins_the_graph():
    class Probe:  # a script's engine method, declared beside it
        @model_fn("probe_score")
        def probe_for_dfg(self, batch):
            return batch, {}

    scripted = MFC("probe", A, Probe.probe_for_dfg.__name__, ("input_ids",), ("probe_score",))
    graph = build([scripted, logp("a", "x", ("input_ids", "probe_score"))])
    assert graph.edges == (("probe", "a", "probe_score"),)
    assert "actor@0.probe_for_dfg()" in format_graph(graph)


def test_compute_logp_adds_the_key_named_by_out():
    bad = MFC("r", A, ModelFn.COMPUTE_LOGP, ("input_ids",), ("logp",), {"out": "ref_logp"})
    (p,) = problems_of([bad])
    assert "compute_logp(out='ref_logp')" in p and "['ref_logp']" in p


def test_an_mfc_must_read_input_ids():
    (p,) = problems_of([logp("a", "x", ("loss_mask",))])
    assert "MFC 'a' does not read key 'input_ids'" in p


def test_mfc_names_are_unique():
    (p,) = problems_of([logp("a", "x"), logp("a", "y")])
    assert "MFC name 'a' is used twice" in p


def test_model_without_allocation_names_the_mfc_and_model():
    (p,) = problems_of(
        [logp("a", "x"), logp("b", "y", model=B)], allocations=[Allocation(A, (0, 1), 2)]
    )
    assert "MFC 'b' runs on model 'critic@0', which has no allocation" in p


def test_mesh_must_match_the_number_of_workers():
    (p,) = problems_of([logp("a", "x")], allocations=[Allocation(A, (0, 1), dp=1)])
    assert "model 'actor@0' (MFCs ['a']): mesh dp=1 x tp=1 x pp=1 needs 1 workers, allocated 2" in p


def test_worker_index_must_exist():
    (p,) = problems_of([logp("a", "x")], allocations=[Allocation(A, (1, 2), dp=2)])
    assert "model 'actor@0'" in p and "workers [2] do not exist; there are 2 workers" in p


def test_worker_listed_twice_is_refused():
    (p,) = problems_of([logp("a", "x")], allocations=[Allocation(A, (0, 0), dp=2)])
    assert "a worker appears twice in [0, 0]" in p


def test_tensor_parallel_mesh_is_accepted_when_its_workers_fill_dp_x_tp():
    graph = build([logp("a", "x")], allocations=[Allocation(A, (0, 1), dp=1, tp=2)])
    assert graph.allocations[A].tp == 2
    (p,) = problems_of([logp("a", "x")], allocations=[Allocation(A, (0, 1), dp=2, tp=2)])
    assert "mesh dp=2 x tp=2 x pp=1 needs 4 workers, allocated 2" in p
    (p,) = problems_of([logp("a", "x")], allocations=[Allocation(A, (0, 1), tp=2, pp=2)])
    assert "mesh dp=1 x tp=2 x pp=2 needs 4 workers, allocated 2 ([0, 1]); list dp * tp * pp" in p
    graph = build([logp("a", "x")], allocations=[Allocation(A, (1, 0), pp=2)])
    assert graph.allocations[A].coordinate(0) == (1, 0, 0)  # stage 1: workers are pp-major


def test_allocated_model_without_mfc_is_refused():
    allocs = [Allocation(A, (0, 1), 2), Allocation(B, (0, 1), 2)]
    (p,) = problems_of([logp("a", "x")], allocations=allocs)
    assert "model 'critic@0' is allocated workers but no MFC runs on it" in p


def test_every_problem_is_reported_at_once():
    probs = problems_of(
        [logp("a", "x", ("input_ids", "nope")), logp("b", "x")],
        allocations=[Allocation(A, (0, 5), 2)],
    )
    assert len(probs) == 3  # duplicate writer, missing producer, worker 5


def test_order_is_topological_and_stable_and_edges_are_derived():
    # given out of order: c reads what b writes, b what a writes
    mfcs = [logp("c", "z", ("input_ids", "y")), logp("a", "x"), logp("b", "y", ("input_ids", "x"))]
    g = build(mfcs)
    assert [m.name for m in g.mfcs] == ["a", "b", "c"]
    assert set(g.edges) == {("a", "b", "x"), ("b", "c", "y")}


def test_sync_ppo_graph_has_generate_then_inference_then_advantages_then_trains():
    g = graph_from_config(
        CoreGraphConfig(graph="sync_ppo", use_critic=True, use_ref=True, prox_logp=True)
    )
    assert [m.name for m in g.mfcs] == [
        "actor_gen",
        "actor_logp",
        "ref_logp",
        "critic_values",
        "actor_adv",
        "actor_train",
        "critic_train",
    ]
    edges = {(s, d) for s, d, _ in g.edges}
    for mid in ("actor_logp", "ref_logp", "critic_values"):
        assert ("actor_gen", mid) in edges and (mid, "actor_adv") in edges
    assert {("actor_adv", "actor_train"), ("actor_adv", "critic_train")} <= edges
    assert ("critic_values", "critic_train") in edges  # the critic regresses from its own values


def test_async_ppo_graph_is_fed_by_the_rollout_stream_without_generate():
    g = graph_from_config(CoreGraphConfig(graph="async_ppo"))
    assert ModelFn.GENERATE not in {m.fn for m in g.mfcs}
    assert g.dataset_keys == ROLLOUT_KEYS
    assert [m.name for m in g.mfcs] == ["actor_adv", "actor_train"]


def test_sft_graph_is_one_train_lm_node():
    g = graph_from_config(CoreGraphConfig(graph="sft", n_workers=2))
    (m,) = g.mfcs
    assert m.fn is ModelFn.TRAIN_LM and g.allocations[m.model].workers == (0, 1)


def test_default_allocation_puts_every_model_on_every_worker():
    g = graph_from_config(CoreGraphConfig(n_workers=3, use_critic=True))
    assert {str(m): (a.workers, a.dp) for m, a in g.allocations.items()} == {
        "actor@0": ((0, 1, 2), 3),
        "critic@0": ((0, 1, 2), 3),
        "rollout@0": ((3,), 1),
    }
    assert g.n_workers == 4  # the generation worker comes after the model workers


def test_printed_graph_lists_models_meshes_nodes_with_timers_and_scopes_and_edges():
    text = format_graph(graph_from_config(CoreGraphConfig(use_ref=True, n_workers=2)))
    assert "ref@0        mesh dp=2 x tp=1  workers [0, 1]  MFCs: ref_logp" in text
    assert "ref_logp         ref@0.compute_logp(out='ref_logp')           timing/ref_logp\n" in text
    assert "actor@0.ppo_update(logp_out='trainer_logp')  timing/train  loss/*\n" in text
    assert "actor_gen        rollout@0.generate()\n" in text  # not run in process: no timer
    assert "ref_logp -> actor_adv  [ref_logp]" in text
    assert "before: actor@0's weights pushed to the generation servers" in text
    assert "rollout@0    mesh dp=1 x tp=1  workers [2]  MFCs: actor_gen" in text


def test_areal_core_graph_prints_a_yaml_config(tmp_path, capsys):
    cfg = tmp_path / "core.yaml"
    cfg.write_text(
        "graph: sync_ppo\nn_workers: 4\nuse_critic: true\nallocations:\n"
        "  - {model: actor, workers: [0, 1], dp: 2}\n  - {model: critic, workers: [2, 3], dp: 2}\n"
    )
    assert cli_main(["core", "graph", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "critic@0     mesh dp=2 x tp=1  workers [2, 3]" in out
    assert "critic_values -> critic_train  [values]" in out


def test_areal_core_graph_reports_an_invalid_graph_with_exit_code_2(tmp_path, capsys):
    cfg = tmp_path / "core.yaml"
    cfg.write_text(
        "use_ref: true\nn_workers: 2\nallocations:\n  - {model: actor, workers: [0, 1], dp: 2}\n"
    )
    assert cli_main(["core", "graph", "--config", str(cfg)]) == 2
    assert (
        "MFC 'ref_logp' runs on model 'ref@0', which has no allocation" in capsys.readouterr().err
    )


def test_a_reallocation_hook_needs_another_allocated_source_model():
    own = MFC(
        "a", A, ModelFn.COMPUTE_LOGP, ("input_ids",), ("x",), {"out": "x"}, hooks=(ParamRealloc(A),)
    )
    (p,) = problems_of([own], allocations=[Allocation(A, (0, 1), 2)])
    assert "MFC 'a' takes weights from model 'actor@0', which is its own model" in p
    other = MFC(
        "a", A, ModelFn.COMPUTE_LOGP, ("input_ids",), ("x",), {"out": "x"}, hooks=(ParamRealloc(B),)
    )
    (p,) = problems_of([other], allocations=[Allocation(A, (0, 1), 2)])
    assert "from model 'critic@0', which has no allocation" in p


def test_a_reallocation_ema_must_be_below_one():
    m = MFC(
        "a",
        A,
        ModelFn.COMPUTE_LOGP,
        ("input_ids",),
        ("x",),
        {"out": "x"},
        hooks=(ParamRealloc(B, ema=1.0),),
    )
    (p,) = problems_of([m, logp("b", "y", model=B)])
    assert "MFC 'a': reallocation ema=1.0 must be in [0, 1)" in p


def test_a_server_update_hook_belongs_to_a_generate_mfc_that_reads_nothing():
    gen = MFC(
        "gen",
        ModelName("rollout"),
        ModelFn.GENERATE,
        ("prompt",),
        ("input_ids",),
        hooks=(UpdateServers(A),),
    )
    lp = MFC(
        "a",
        A,
        ModelFn.COMPUTE_LOGP,
        ("input_ids",),
        ("x",),
        {"out": "x"},
        hooks=(UpdateServers(B),),
    )
    got = problems_of(
        [gen, lp, logp("b", "y", model=B)],
        keys=("prompt",),
        allocations=[
            Allocation(A, (0,), 1),
            Allocation(B, (1,), 1),
            Allocation(ModelName("rollout"), (2,), 1),
        ],
        n_workers=3,
    )
    assert any(
        "MFC 'gen' (generate) reads ['prompt']; a generate MFC draws its prompts" in p for p in got
    )
    assert any(
        "MFC 'a' (compute_logp) has an UpdateServers hook, which only a generate MFC can have" in p
        for p in got
    )
    realloc = MFC(
        "b",
        B,
        ModelFn.COMPUTE_LOGP,
        ("input_ids",),
        ("y",),
        {"out": "y"},
        hooks=(ParamRealloc(ModelName("rollout")),),
    )
    got = problems_of(
        [gen, realloc],
        keys=("prompt",),
        n_workers=3,
        allocations=[Allocation(B, (1,), 1), Allocation(ModelName("rollout"), (2,), 1)],
    )
    assert any(
        "MFC 'b': parameter reallocation to or from a generate MFC's model" in p for p in got
    )


def test_printed_graph_shows_reallocation_hooks():
    ref = MFC(
        "ref_logp",
        B,
        ModelFn.COMPUTE_LOGP,
        ("input_ids",),
        ("r",),
        {"out": "r"},
        hooks=(ParamRealloc(A, ema=0.9),),
    )
    assert "before: weights from actor@0 (ema 0.9)" in format_graph(build([logp("a", "x"), ref]))


def test_format_graph_counts_model_workers_apart_from_the_generation_worker():
    from areal.core.dfg import format_graph
    from areal.core.graphs import CoreGraphConfig, graph_from_config

    sync = format_graph(
        graph_from_config(CoreGraphConfig(graph="sync_ppo", n_workers=4))
    ).splitlines()
    assert sync[0].endswith("4 model workers + 1 generation worker [4]")
    assert (
        sync[1] == "dataset keys: none (the generation worker draws prompts from the train dataset)"
    )
    sft = format_graph(graph_from_config(CoreGraphConfig(graph="sft", n_workers=4))).splitlines()
    assert (
        sft[0].endswith("1 models, 4 model workers")
        and sft[1] == "dataset keys: input_ids, loss_mask"
    )
