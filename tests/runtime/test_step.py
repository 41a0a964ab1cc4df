"""Tier 1: the in-process step runner over stand-in engines: the graph's order, each MFC in its
timer with its stats under its scope (the names Lite logs), the LR step after each update, the
refusals; the fields each model function declares; Core's stats under the same names."""

from __future__ import annotations

import pytest
import torch

from areal.api.mfc import MFC, ModelFn, added_fields, model_fn
from areal.runtime.graphs import ACTOR, CRITIC, MODEL, REF, dpo_mfcs, ppo_mfcs
from areal.runtime.step import call_mfc, run_step, step_stats
from areal.utils.batch import PackedBatch
from areal.utils.stats import StatsTracker


class Stand:
    """A stand-in engine: each model function adds its fields (ones) and logs its call."""

    def __init__(self, name: str, log: list[str]):
        self.name, self.log = name, log

    def _add(self, fn: str, batch: PackedBatch, fields: tuple[str, ...], seqs=()):
        self.log.append(f"{self.name}.{fn}")
        ones = torch.ones(batch.n_tokens)
        out = batch.with_fields(tokens={k: ones for k in fields})
        if seqs:
            out = out.with_fields(seqs={k: torch.ones(batch.n_seqs) for k in seqs})
        return out, {f"{fn}_stat": 1.0}

    def compute_logp(self, batch, out="logp"):
        return self._add("compute_logp", batch, (out,))

    def compute_values(self, batch):
        return self._add("compute_values", batch, ("values",))

    def compute_advantages(self, batch):
        return self._add(
            "compute_advantages",
            batch,
            ("advantages", "returns", "token_rewards"),
            ("seq_rewards",),
        )

    def ppo_update(self, batch, logp_out=None):
        return self._add("ppo_update", batch, (logp_out,) if logp_out else ())

    def compute_seq_logp(self, batch, out="seq_logp"):
        return self._add("compute_seq_logp", batch, (), (out,))

    def train_dpo(self, batch):
        return self._add("train_dpo", batch, ())

    def step_lr_scheduler(self):
        self.log.append(f"{self.name}.step_lr_scheduler")


def rollout_batch() -> PackedBatch:
    return PackedBatch.from_sequences(
        {"input_ids": [[1, 2, 3], [4, 5]], "loss_mask": [[0, 1, 1], [0, 1]]},
        {"rewards": [1.0, 0.0], "no_eos": [False, False]},
    ).with_fields(tokens={"logprobs": torch.zeros(5)})


def test_run_step_runs_the_ppo_graph_in_lites_order_under_lites_names():
    log: list[str] = []
    engines = {m: Stand(m.role, log) for m in (ACTOR, CRITIC, REF)}
    tracker = StatsTracker()
    out = run_step(ppo_mfcs(True, True, True), engines, rollout_batch(), tracker)
    assert log == [
        "actor.compute_logp",
        "ref.compute_logp",
        "critic.compute_values",
        "actor.compute_advantages",
        "actor.ppo_update",
        "actor.step_lr_scheduler",  # each update is followed by its engine's LR step
        "critic.ppo_update",
        "critic.step_lr_scheduler",
    ]
    assert {"prox_logp", "ref_logp", "values", "advantages", "trainer_logp"} <= out.keys()[0]
    stats = tracker.export()
    timers = {k for k in stats if k.startswith("timing/")}
    assert timers == {f"timing/{t}" for t in ("prox_logp", "ref_logp", "values", "advantages")} | {
        "timing/train"  # the actor's and the critic's update together, as Lite timed them
    }
    assert stats["loss/compute_advantages_stat"] == 1.0 and stats["loss/ppo_update_stat"] == 1.0
    assert stats["loss/critic/ppo_update_stat"] == 1.0
    assert not [k for k in stats if "compute_logp" in k or "compute_values" in k]  # unscoped


def test_the_dpo_graph_scores_with_the_reference_only_online_under_lites_names():
    log: list[str] = []
    engines = {MODEL: Stand("model", log), REF: Stand("ref", log)}
    pairs = PackedBatch.from_sequences(  # chosen, rejected: one pair
        {"input_ids": [[1, 2, 3], [1, 2, 4]], "loss_mask": [[0, 1, 1], [0, 1, 1]]}
    )
    tracker = StatsTracker()
    out = run_step(dpo_mfcs(use_ref=True, online_ref=True), engines, pairs, tracker)
    assert log == ["ref.compute_seq_logp", "model.train_dpo", "model.step_lr_scheduler"]
    assert "ref_logp" in out.seqs
    stats = tracker.export()
    assert {k for k in stats if k.startswith("timing/")} == {"timing/ref_logp", "timing/train"}
    assert stats["loss/train_dpo_stat"] == 1.0 and "loss/compute_seq_logp_stat" not in stats
    log.clear()  # precompute: the batch brings ref_logp and no reference runs
    precomputed = pairs.with_fields(seqs={"ref_logp": torch.zeros(2)})
    run_step(dpo_mfcs(True, False), {MODEL: engines[MODEL]}, precomputed, StatsTracker())
    assert log == ["model.train_dpo", "model.step_lr_scheduler"]
    with pytest.raises(ValueError, match=r"MFC 'dpo_train' reads \['ref_logp'\]"):
        run_step(dpo_mfcs(True, False), {MODEL: engines[MODEL]}, pairs, StatsTracker())
    assert [m.inputs for m in dpo_mfcs(False, False)] == [("input_ids", "loss_mask")]  # simpo
    with pytest.raises(ValueError, match="online_ref=True needs use_ref=True"):
        dpo_mfcs(use_ref=False, online_ref=True)


def test_run_step_refuses_a_step_it_cannot_run_naming_each_problem():
    graph = ppo_mfcs(use_critic=True, use_ref=False, prox_logp=False)
    batch = PackedBatch.from_sequences({"input_ids": [[1, 2]], "loss_mask": [[0, 1]]})
    with pytest.raises(ValueError) as e:
        run_step(graph, {ACTOR: Stand("actor", [])}, batch, StatsTracker())
    text = str(e.value)
    assert "critic@0.compute_values" in text  # no critic given
    assert "MFC 'actor_adv' reads ['rewards', 'no_eos', 'logprobs']" in text


class Scripted(Stand):
    """A script's engine: two model functions the library's vocabulary does not name."""

    @model_fn("probe")
    def probe_fields(self, batch):
        return self._add("probe_fields", batch, ("probe",))

    @model_fn(trains=True)
    def probe_train(self, batch):
        return self._add("probe_train", batch, ())


def test_run_step_runs_a_scripts_model_functions_named_by_strings():
    log: list[str] = []
    graph = [
        MFC("probe", ACTOR, "probe_fields", ("input_ids",), ("probe",), scope="probe"),
        MFC("probe_train", ACTOR, "probe_train", ("input_ids", "probe"), scope="loss"),
    ]
    tracker = StatsTracker()
    out = run_step(graph, {ACTOR: Scripted("actor", log)}, rollout_batch(), tracker)
    # only the one declared trains=True is followed by its engine's LR step
    assert log == ["actor.probe_fields", "actor.probe_train", "actor.step_lr_scheduler"]
    stats = tracker.export()
    assert "probe" in out.tokens and stats["probe/probe_fields_stat"] == 1.0
    assert stats["loss/probe_train_stat"] == 1.0 and "timing/probe_train" in stats
    # a library function's name is its member: one spelling in every graph
    assert MFC("v", CRITIC, "compute_values", ("input_ids",)).fn is ModelFn.COMPUTE_VALUES


def test_run_step_refuses_a_method_name_no_engine_declares_in_one_line():
    for name in ("probe_fieldz", "step_lr_scheduler"):  # a typo; a method but no model function
        graph = [MFC("probe", ACTOR, name, ("input_ids",))]
        with pytest.raises(ValueError) as e:
            run_step(graph, {ACTOR: Scripted("actor", [])}, rollout_batch(), StatsTracker())
        assert str(e.value).splitlines()[1:] == [
            f"  - MFC 'probe' runs actor@0.{name}, but the engines given (['actor@0']) have no "
            "such model function (a method marked @model_fn)"
        ]
    with pytest.raises(ValueError, match="MFC 'probe': fn '_add' is no engine method's name"):
        MFC("probe", ACTOR, "_add", ("input_ids",))


def test_a_library_functions_trains_declaration_must_agree_with_training_fns():
    with pytest.raises(TypeError, match="train_lm declared trains=False, but TRAINING_FNS"):

        @model_fn()
        def train_lm(batch):
            return batch, {}

    with pytest.raises(TypeError, match="methods of one name add the same fields and train"):

        @model_fn("probe", trains=True)
        def probe_fields(batch):
            return batch, {}


def test_call_mfc_refuses_a_call_that_adds_other_fields_than_the_mfc_declares():
    mfc = MFC("values", CRITIC, ModelFn.COMPUTE_VALUES, ("input_ids",), ("value",))
    with pytest.raises(ValueError, match=r"added keys \['values'\] but the graph declares"):
        call_mfc(Stand("critic", []), mfc, rollout_batch())


def test_engine_methods_declare_the_fields_their_model_functions_add():
    import areal.engine.dpo  # noqa: F401  (DPOReference.compute_seq_logp, DPOEngine.train_dpo)
    import areal.engine.lora  # noqa: F401  (FrozenBase.compute_logp)
    import areal.engine.ppo  # noqa: F401  (the actor's and the critic's)

    assert added_fields(ModelFn.COMPUTE_LOGP, {}) == ("logp",)
    assert added_fields(ModelFn.COMPUTE_LOGP, {"out": "ref_logp"}) == ("ref_logp",)
    assert added_fields(ModelFn.PPO_UPDATE, {}) == ()  # the critic's, or the actor's alone
    assert added_fields(ModelFn.PPO_UPDATE, {"logp_out": "trainer_logp"}) == ("trainer_logp",)
    assert added_fields(ModelFn.COMPUTE_VALUES, {}) == ("values",)
    assert added_fields(ModelFn.GENERATE, {}) is None  # generate's outputs are the MFC's
    assert added_fields(ModelFn.COMPUTE_SEQ_LOGP, {}) == ("seq_logp",)
    assert added_fields(ModelFn.COMPUTE_SEQ_LOGP, {"out": "ref_logp"}) == ("ref_logp",)
    assert added_fields(ModelFn.TRAIN_DPO, {}) == ()

    @model_fn("scores_for_a_test")
    def fn_declared_in_a_test(batch):
        return batch, {}

    with pytest.raises(TypeError, match="methods of one name add the same fields"):

        @model_fn("another_field")
        def fn_declared_in_a_test(batch):  # noqa: F811
            return batch, {}


def test_step_stats_name_the_masters_stats_as_a_step_in_process_does():
    # 0.5 s of wall time etc. are the master's; the losses take the MFCs' scopes
    timing = {"n_tokens": 10.0, "wall_time": 0.5, "compute_time": 0.25}
    out = {
        "actor_adv": {"adv_mean": 0.5, **timing},
        "actor_train": {"pg_loss": 1.5, **timing},
        "critic_train": {"loss": 2.0, **timing},
        "ref_logp": {**timing, "realloc/ref/bytes": 64.0},
    }
    stats = step_stats(ppo_mfcs(True, True, False), out)
    assert stats["loss/pg_loss"] == 1.5 and stats["loss/critic/loss"] == 2.0
    assert stats["loss/adv_mean"] == 0.5
    assert stats["mfc/actor_train/wall_time"] == 0.5 and stats["realloc/ref/bytes"] == 64.0
    assert "loss/wall_time" not in stats and "ref_logp/n_tokens" not in stats


def test_only_inputs_hands_each_mfc_the_keys_it_reads_as_a_worker_does():
    seen: dict[str, set[str]] = {}

    class Keys(Stand):
        def compute_values(self, batch):
            seen["values"] = set().union(*batch.keys())
            return super().compute_values(batch)

    graph = ppo_mfcs(use_critic=True, use_ref=False, prox_logp=False)
    log: list[str] = []
    batch = rollout_batch().with_fields(seqs={"prompt_lens": torch.tensor([1, 1])})
    engines = {ACTOR: Stand("actor", log), CRITIC: Keys("critic", log)}
    out = run_step(graph, engines, batch, StatsTracker(), only_inputs=True)
    assert seen["values"] == {"input_ids"}  # not the batch's prompt_lens, rewards, ...
    assert {"values", "advantages", "trainer_logp", "prompt_lens"} <= set().union(*out.keys())
    run_step(graph, engines, batch, StatsTracker())
    assert "prompt_lens" in seen["values"]  # in process (Lite): the whole batch so far
