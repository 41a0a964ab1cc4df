"""Pipeline parallelism of FSDPEngine (areal/engine/pipeline.py).

Tier 1: how layers are divided among stages, layouts that cannot work (one-line errors naming
the field and the fix), and that a stage reads only its own tensors of a checkpoint.

Tier 2 (2 gloo processes, dp=1 x pp=2, run once by a module fixture): an SFT step, a GRPO actor
step over shared-prefix groups and a critic step equal the single-process engine's (loss, grad
norm, every stat, the updated full weights; 1e-5), and so do logprobs and values; each stage
holds the layers it should, the two copies of the tied embedding stay equal, and HF export, HF
load and a DCP round trip work stage by stage. The 4-process layouts (tp or dp beside pp) run
in tests/core/test_ray_pp.py through Core's Ray workers.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_fsdp import LINEAR_ADAM, free_port, random_batch, set_dist_env, world_mesh
from test_ppo import GROUP, actor_config, rollout_batch

from areal.api.config.actor import PPOCriticConfig
from areal.api.config.base import MicroBatchSpec
from areal.api.config.engine import TrainEngineConfig
from areal.api.io import SaveLoadMeta, WeightUpdateMeta
from areal.engine.pipeline import check_pipeline, read_stage_weights, stage_layers
from areal.engine.ppo import PPOActor, PPOCritic
from areal.engine.sft import SFTEngine
from areal.runtime.dist import build_mesh, check_layout
from tests.ranks import run_ranks

SFT_MB = MicroBatchSpec(max_tokens_per_mb=30)


# ------------------------------------------------------------------------------------ tier 1


def test_stages_get_consecutive_layers_the_first_ones_one_more():
    assert [list(stage_layers(4, 2, p)) for p in range(2)] == [[0, 1], [2, 3]]
    assert [list(stage_layers(5, 2, p)) for p in range(2)] == [[0, 1, 2], [3, 4]]
    assert [list(stage_layers(4, 3, p)) for p in range(3)] == [[0, 1], [2], [3]]
    assert [list(stage_layers(3, 3, p)) for p in range(3)] == [[0], [1], [2]]


def test_more_stages_than_layers_is_refused_naming_pp_and_the_fix():
    from transformers import Qwen2Config

    with pytest.raises(ValueError, match=r"^pp=5 exceeds num_hidden_layers=4 .*; use pp <= 4$"):
        check_pipeline(Qwen2Config(num_hidden_layers=4), 5, "m")
    check_pipeline(Qwen2Config(num_hidden_layers=4), 4, "m")


def test_a_mesh_that_is_not_dp_x_tp_x_pp_ranks_is_refused_in_one_line():
    with pytest.raises(
        ValueError, match=r"^mesh: dp=1 x tp=1 x pp=2 = 2 ranks, but it has 3; .* set dp, tp, pp$"
    ):
        check_layout(3, dp=1, tp=1, pp=2)
    with pytest.raises(ValueError, match=r"but it has 8; give it dp\*tp\*pp ranks or set dp=4$"):
        check_layout(8, dp=2, tp=1, pp=2)
    with pytest.raises(ValueError, match=r"^mesh: pp=0; each of dp, tp, pp must be >= 1$"):
        check_layout(2, dp=2, pp=0)
    check_layout(8, dp=2, tp=2, pp=2)


def test_a_stage_reads_only_its_own_tensors_of_the_checkpoint(tiny_model_dir, monkeypatch):
    import safetensors
    from safetensors.torch import load_file
    from transformers import AutoConfig

    read: list[str] = []
    real_open = safetensors.safe_open

    class Spy:
        def __init__(self, *args, **kw):
            self.f = real_open(*args, **kw)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    config = AutoConfig.from_pretrained(tiny_model_dir)
    last = [k for k in load_file(f"{tiny_model_dir}/model.safetensors") if ".layers.3." in k]
    names = [*last, "model.norm.weight", "lm_head.weight"]
    got = read_stage_weights(tiny_model_dir, names, config)
    stored = load_file(f"{tiny_model_dir}/model.safetensors")
    assert sorted(got) == sorted(names)
    # the tied head is the stored embedding; no other layer's tensor was read
    assert sorted(read) == sorted([*last, "model.norm.weight", "model.embed_tokens.weight"])
    assert torch.equal(got["lm_head.weight"], stored["model.embed_tokens.weight"])
    assert all(torch.equal(got[k], stored[k]) for k in last)


# ------------------------------------------------------------------------------------ tier 2


def prefix_batch(n_groups: int = 4):
    """test_ppo's rollout groups with the fields that turn on the shared-prefix layout."""
    batch = rollout_batch(n_groups=n_groups)
    n = batch.n_seqs
    return batch.with_fields(
        seqs={"group_index": torch.arange(n) // GROUP, "prompt_lens": torch.full((n,), 4)}
    )


def _sft(path: str, mesh) -> dict:
    engine = SFTEngine(TrainEngineConfig(path=path, mb_spec=SFT_MB, optimizer=LINEAR_ADAM), mesh)
    engine.initialize(None)
    batch = random_batch()
    logp = engine.compute_logp(batch)[0]["logp"]
    _, stats = engine.train_lm(batch)
    out = {"stats": stats, "state": engine.full_state_dict(), "logp": logp}
    out["keys"] = sorted(engine.model.state_dict())
    engine.destroy()
    return out


def _grpo(path: str, mesh) -> dict:
    actor = PPOActor(actor_config(path, budget=24, lr=1e-2, eps=1.0), mesh, group_size=GROUP)
    actor.initialize(None)
    batch = prefix_batch()
    logp = actor.compute_logp(batch)[0]["logp"]
    batch, _ = actor.compute_advantages(batch.with_fields(tokens={"logprobs": logp}))
    batch, stats = actor.ppo_update(batch, logp_out="trainer_logp")
    out = {"stats": stats, "state": actor.full_state_dict(), "trainer_logp": batch["trainer_logp"]}
    actor.destroy()
    return out


def _critic(path: str, mesh) -> dict:
    mb = MicroBatchSpec(max_tokens_per_mb=24, granularity=GROUP)
    critic = PPOCritic(
        PPOCriticConfig(path=path, mb_spec=mb, optimizer=LINEAR_ADAM), mesh, group_size=GROUP
    )
    critic.initialize(None)
    batch, _ = critic.compute_values(prefix_batch())
    returns = batch["values"] + torch.linspace(-1, 1, batch.n_tokens)
    _, stats = critic.ppo_update(batch.with_fields(tokens={"returns": returns}))
    out = {"values": batch["values"], "stats": stats, "state": critic.full_state_dict()}
    critic.destroy()
    return out


def _io(path: str, mesh, tmp: str) -> dict:
    """HF export, HF load and a DCP round trip on the pipelined mesh."""

    def build() -> SFTEngine:
        engine = SFTEngine(
            TrainEngineConfig(path=path, mb_spec=SFT_MB, optimizer=LINEAR_ADAM), mesh
        )
        engine.initialize(None)
        return engine

    a = build()
    a.train_lm(random_batch(seed=1))
    a.set_version(3)
    a.save(SaveLoadMeta(path=f"{tmp}/hf", weight_format="hf"))
    a.save(SaveLoadMeta(path=f"{tmp}/dcp", weight_format="dcp", with_optim=True))
    out = {"saved": a.full_state_dict(), "next_a": a.train_lm(random_batch(seed=7))[1]}
    out["state_a"] = a.full_state_dict()
    b = build()
    b.load(SaveLoadMeta(path=f"{tmp}/dcp", weight_format="dcp", with_optim=True))
    out["version_b"] = b.get_version()
    out["next_b"], out["state_b"] = b.train_lm(random_batch(seed=7))[1], b.full_state_dict()
    b.load(SaveLoadMeta(path=f"{tmp}/hf", weight_format="hf"))
    out["hf_loaded"] = b.full_state_dict()
    try:
        b.update_weights(WeightUpdateMeta("distributed"))
    except ValueError as e:
        out["broadcast_refused"] = str(e)
    for engine in (a, b):
        engine.destroy()
    return out


def _pp_run(rank: int, path: str, port: int, out: str, tmp: str) -> None:
    set_dist_env(rank, 2, port)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    mesh = build_mesh("cpu", [0, 1], dp=1, pp=2)
    result = {"sft": _sft(path, mesh), "grpo": _grpo(path, mesh), "critic": _critic(path, mesh)}
    result.update(_io(path, mesh, tmp))
    torch.save(result, f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("pp")
    mesh = world_mesh()
    single = {
        "sft": _sft(tiny_model_dir, mesh),
        "grpo": _grpo(tiny_model_dir, mesh),
        "critic": _critic(tiny_model_dir, mesh),
    }
    out = str(tmp / "pp2.pt")
    run_ranks(_pp_run, 2, (tiny_model_dir, free_port(), out, str(tmp)), timeout=300)
    stages = [torch.load(f"{out}.{r}") for r in range(2)]
    return {"single": single, "stages": stages, "hf_dir": tmp / "hf"}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sft", "grpo", "critic"])
def test_a_step_on_two_stages_equals_the_single_process_step(runs, kind):
    single, first, last = runs["single"][kind], *(s[kind] for s in runs["stages"])
    assert first["stats"] == last["stats"]  # every stage returns the last stage's stats
    assert first["stats"].keys() == single["stats"].keys()
    for key, value in single["stats"].items():
        assert first["stats"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert first["stats"]["grad_norm"] > 0
    assert max_diff(first["state"], single["state"]) < 1e-5
    assert last["state"] == {}  # the full weights are gathered on the mesh's first rank


@pytest.mark.slow
def test_logprobs_and_values_on_two_stages_equal_the_single_process_ones(runs):
    single = runs["single"]
    for stage in runs["stages"]:  # the last stage's outputs reach the first
        assert (stage["sft"]["logp"] - single["sft"]["logp"]).abs().max().item() < 1e-5
        trainer, plain = stage["grpo"]["trainer_logp"], single["grpo"]["trainer_logp"]
        assert (trainer - plain).abs().max().item() < 1e-5 and plain.abs().sum() > 0
        assert (stage["critic"]["values"] - single["critic"]["values"]).abs().max().item() < 1e-5


@pytest.mark.slow
def test_each_stage_holds_its_layers_and_the_tied_embedding_copies_stay_equal(runs):
    first, last = (s["sft"]["keys"] for s in runs["stages"])

    def layers(keys):
        return sorted({int(k.split(".")[2]) for k in keys if ".layers." in k})

    assert layers(first) == [0, 1] and layers(last) == [2, 3]
    assert [k for k in first if ".layers." not in k] == ["model.embed_tokens.weight"]
    assert [k for k in last if ".layers." not in k] == ["lm_head.weight", "model.norm.weight"]
    state = runs["stages"][0]["sft"]["state"]  # trained: both copies took the same step
    assert torch.equal(state["model.embed_tokens.weight"], state["lm_head.weight"])


@pytest.mark.slow
def test_hf_export_hf_load_and_dcp_round_trip_on_two_stages(runs):
    from transformers import AutoConfig

    from areal.engine.checkpoint import read_hf_weights

    run = runs["stages"][0]
    exported = read_hf_weights(str(runs["hf_dir"]), AutoConfig.from_pretrained(runs["hf_dir"]))
    assert max_diff(exported, run["saved"]) == 0.0
    assert max_diff(run["hf_loaded"], run["saved"]) == 0.0
    assert run["version_b"] == 3
    assert run["next_b"]["loss"] == run["next_a"]["loss"]
    assert max_diff(run["state_b"], run["state_a"]) == 0.0
    assert "use weight_update_mode=disk" in run["broadcast_refused"]


@pytest.mark.slow
def test_an_export_of_a_pipelined_model_loads_in_plain_transformers(runs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(Path(runs["hf_dir"]))
    state = runs["stages"][0]["saved"]
    assert torch.equal(
        model.model.layers[3].mlp.up_proj.weight, state["model.layers.3.mlp.up_proj.weight"]
    )
