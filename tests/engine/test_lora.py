"""LoRA on the FSDP engine (tier 2): only adapters train, exports are the merged model (what the
server then serves), the adapter dir loads with peft, the base is the KL reference, and DCP
checkpoints hold adapters + optimizer only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_fsdp import (
    free_port,
    n_loss_tokens,
    nll_loss,
    random_batch,
    set_dist_env,
    world_mesh,
)
from test_ppo import GROUP, rollout_batch

from areal.api.config.actor import PPOActorConfig, PPOCriticConfig
from areal.api.config.base import MicroBatchSpec, OptimizerConfig
from areal.api.config.engine import LoRAConfig, TrainEngineConfig
from areal.api.io import SaveLoadMeta, WeightUpdateMeta
from areal.engine import lora
from areal.engine.fsdp import FSDPEngine
from areal.engine.ppo import PPOActor, PPOCritic
from areal.utils import weight_sync
from tests.ranks import run_ranks

pytestmark = pytest.mark.slow
LORA = LoRAConfig(rank=4, alpha=8.0)
OPT = OptimizerConfig(lr=1e-2)


def lora_engine(path, lora_cfg=LORA, **kw) -> FSDPEngine:
    engine = FSDPEngine(
        TrainEngineConfig(path=path, lora=lora_cfg, optimizer=OPT, **kw), world_mesh()
    )
    engine.initialize(None)
    return engine


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_only_adapters_train_and_get_optimizer_state(tiny_model_dir):
    engine = lora_engine(tiny_model_dir, LoRAConfig(rank=4, target_modules=["q_proj", "v_proj"]))
    before = engine._gathered_state()
    trainable = {n for n, p in engine.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert all(("q_proj" in n or "v_proj" in n) for n in trainable)
    engine.train_batch(random_batch(), nll_loss, n_loss_tokens)
    after = engine._gathered_state()
    with_state = [
        p for p in engine.optimizer.param_groups[0]["params"] if engine.optimizer.state.get(p)
    ]
    assert len(with_state) == len(trainable)  # AdamW moments exist for adapters only
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".lora_B." in k or ".lora_A." in k for k in changed), sorted(changed)[:5]
    assert any(".lora_B." in k for k in changed)  # B starts at 0: the merged model moves
    engine.destroy()


def test_activation_checkpointing_gives_the_same_lora_step(tiny_model_dir):
    states = []
    for ckpt in ("none", "full"):
        engine = lora_engine(tiny_model_dir, activation_checkpointing=ckpt)
        engine.train_batch(random_batch(), nll_loss, n_loss_tokens)
        states.append(engine.full_state_dict())
        engine.destroy()
    assert max((states[0][k] - states[1][k]).abs().max().item() for k in states[0]) <= 1e-6


def test_value_head_stays_trainable_under_lora(tiny_model_dir):
    cfg = PPOCriticConfig(
        path=tiny_model_dir, lora=LORA, optimizer=OPT, mb_spec=MicroBatchSpec(granularity=GROUP)
    )
    critic = PPOCritic(cfg, world_mesh(), group_size=GROUP)
    critic.initialize(None)
    batch = rollout_batch()
    before = critic.full_state_dict()
    assert set(before) >= {"score.weight", "score.bias"} and not any("lora" in k for k in before)
    batch, _ = critic.compute_values(batch)
    batch = batch.with_fields(tokens={"returns": torch.ones(batch.n_tokens)})
    critic.ppo_update(batch)
    after = critic.full_state_dict()
    assert not torch.equal(before["score.weight"], after["score.weight"])  # modules_to_save trains
    assert torch.equal(before["model.embed_tokens.weight"], after["model.embed_tokens.weight"])
    critic.destroy()


def export_and_compare(engine: FSDPEngine, base_dir, out: Path):
    """Save ``engine`` as an HF export in ``out`` (and destroy it); check that the merged model,
    the base + peft's adapter dir and the trainer's own logprobs agree; returns the merged model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    batch = random_batch(seed=3)
    ours = engine.compute_logp(batch)[0]["logp"]
    engine.save(SaveLoadMeta(str(out), weight_format="hf"))
    engine.destroy()
    merged = AutoModelForCausalLM.from_pretrained(out)
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_dir), str(out / lora.ADAPTER_DIR)
    )
    ids = batch["input_ids"][: int(batch.cu_seqlens[1])][None]
    with torch.no_grad():
        a, b = merged(input_ids=ids).logits, peft_model(input_ids=ids).logits
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    # the trainer's own (unmerged) logprobs of that sequence equal the merged model's
    logp = torch.log_softmax(a[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
    torch.testing.assert_close(ours[1 : ids.shape[1]], logp, atol=1e-5, rtol=0)
    return merged


def test_merged_export_and_adapter_dir_give_the_same_logits(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    engine = lora_engine(tiny_model_dir)
    engine.train_batch(random_batch(), nll_loss, n_loss_tokens)
    merged = export_and_compare(engine, tiny_model_dir, tmp_path / "export")
    base_keys = set(AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict())
    assert set(merged.state_dict()) == base_keys  # plain HF names, no peft prefixes
    adapter_config = tmp_path / "export" / lora.ADAPTER_DIR / "adapter_config.json"
    assert json.loads(adapter_config.read_text())["r"] == 4


def test_embeddings_trained_in_full_stay_tied_and_export_merged(tiny_model_dir, tmp_path):
    engine = lora_engine(
        tiny_model_dir, LoRAConfig(rank=4, alpha=8.0, modules_to_save=["embed_tokens"])
    )
    trainable = {n for n, p in engine.model.named_parameters() if p.requires_grad}
    whole = sorted(n for n in trainable if "lora_" not in n)
    assert whole == ["base_model.model.model.embed_tokens.modules_to_save.default.weight"], whole
    model = lora.base_model(engine.model)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tied head follows the copy
    before = engine.full_state_dict()
    engine.train_batch(random_batch(), nll_loss, n_loss_tokens)
    after = engine.full_state_dict()
    assert not torch.equal(before["model.embed_tokens.weight"], after["model.embed_tokens.weight"])
    merged = export_and_compare(engine, tiny_model_dir, tmp_path / "export")
    torch.testing.assert_close(merged.model.embed_tokens.weight, after["model.embed_tokens.weight"])
    assert merged.lm_head.weight is merged.model.embed_tokens.weight


def test_lora_grpo_step_then_server_logprobs_equal_the_trainers(tiny_model_dir, tmp_path):
    from areal.serving.generator import Generator
    from areal.serving.sampling import SamplingParams

    cfg = PPOActorConfig(
        path=tiny_model_dir,
        algorithm="grpo",
        lora=LORA,
        optimizer=OPT,
        mb_spec=MicroBatchSpec(granularity=GROUP),
        kl_ctl=0.1,
    )
    actor = PPOActor(cfg, world_mesh(), group_size=GROUP)
    actor.initialize(None)
    batch = rollout_batch()
    logp0 = actor.compute_logp(batch)[0]["logp"]
    reference = lora.FrozenBase(actor)
    batch, _ = reference.compute_logp(batch.with_fields(tokens={"logprobs": logp0}), out="ref_logp")
    batch, _ = actor.compute_advantages(batch)
    actor.ppo_update(batch)
    moved = actor.compute_logp(batch)[0]["logp"]
    assert (moved - logp0).abs().max() > 1e-4  # the adapters changed the policy
    # the frozen base is the reference: adapters off gives the starting logprobs again
    torch.testing.assert_close(
        reference.compute_logp(batch, out="ref_logp")[0]["ref_logp"], logp0, atol=1e-6, rtol=0
    )
    actor.update_weights(WeightUpdateMeta(type="disk", path=str(tmp_path / "w1"), version=1))
    gen = Generator.from_pretrained(tiny_model_dir).start()
    try:
        gen.update_weights_from_disk(tmp_path / "w1")
        results = gen.generate(
            [[5, 6, 7, 8], [9, 10, 11]], SamplingParams(max_new_tokens=10, seed=1, ignore_eos=True)
        )
    finally:
        gen.shutdown()
    seqs = {"input_ids": [r.input_ids + r.output_ids for r in results]}
    from areal.utils.batch import PackedBatch

    logp = actor.compute_logp(PackedBatch.from_sequences(seqs))[0]
    actor.destroy()
    for i, r in enumerate(results):
        start = int(logp.cu_seqlens[i]) + len(r.input_ids)
        trainer = logp["logp"][start : start + len(r.output_ids)]
        torch.testing.assert_close(trainer, torch.tensor(r.output_logprobs), atol=1e-5, rtol=0)


def test_dcp_holds_adapters_and_optimizer_only_and_resumes_exactly(tiny_model_dir, tmp_path):
    full = FSDPEngine(TrainEngineConfig(path=tiny_model_dir, optimizer=OPT), world_mesh())
    full.initialize(None)
    full.save(SaveLoadMeta(str(tmp_path / "full"), weight_format="dcp", with_optim=True))
    full.destroy()
    engine = lora_engine(tiny_model_dir)
    engine.train_batch(random_batch(), nll_loss, n_loss_tokens)
    engine.save(SaveLoadMeta(str(tmp_path / "lora"), weight_format="dcp", with_optim=True))
    assert dir_bytes(tmp_path / "lora") * 5 < dir_bytes(tmp_path / "full")
    engine.train_batch(random_batch(seed=1), nll_loss, n_loss_tokens)
    want = engine.full_state_dict()
    engine.destroy()
    resumed = lora_engine(
        tiny_model_dir, init_seed=9
    )  # other adapter init: the load must replace it
    resumed.load(SaveLoadMeta(str(tmp_path / "lora"), weight_format="dcp", with_optim=True))
    resumed.train_batch(random_batch(seed=1), nll_loss, n_loss_tokens)
    got = resumed.full_state_dict()
    resumed.destroy()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def _broadcast(rank: int, path: str, ports: tuple[int, int], out: str) -> None:
    meta = WeightUpdateMeta(
        type="distributed", master_port=ports[1], bucket_bytes=200_000, version=1
    )
    if rank == 1:  # the server side: joins only the weight-update group
        torch.set_num_threads(1)
        group = weight_sync.init_weight_update_group("127.0.0.1", ports[1], 1, 2, timeout=120)
        ann = json.loads(Path(out + ".json").read_text())
        specs = weight_sync.specs_from_announcement(ann["names"], ann["dtypes"], ann["shapes"])
        torch.save(
            weight_sync.receive_weights(specs, group, meta.bucket_bytes, timeout=120),
            out + ".received",
        )
        return
    set_dist_env(0, 1, ports[0])
    engine = lora_engine(path)
    engine.train_batch(random_batch(), nll_loss, n_loss_tokens)
    Path(out + ".json").write_text(json.dumps(engine.weight_announcement()))
    engine.init_weight_update_group(meta, world_size=2)
    engine.update_weights(meta)
    torch.save(engine.full_state_dict(), out + ".sent")
    engine.destroy()


def test_broadcast_sends_the_merged_model_under_hf_names(tiny_model_dir, tmp_path):
    out = str(tmp_path / "w")
    run_ranks(_broadcast, 2, (tiny_model_dir, (free_port(), free_port()), out))
    sent, received = torch.load(out + ".sent"), torch.load(out + ".received")
    assert set(received) == set(sent) - {"lm_head.weight"} and not any(
        "lora" in k for k in received
    )
    for name, tensor in received.items():
        assert torch.equal(tensor, sent[name]), name


def test_bad_lora_config_names_the_field(tiny_model_dir):
    with pytest.raises(ValueError, match="lora.target_modules"):
        lora_engine(tiny_model_dir, LoRAConfig(rank=4, target_modules=["no_such_proj"]))
    problems = list(LoRAConfig(rank=4, target_modules=[]).check())
    assert problems and problems[0].startswith("target_modules")
    with pytest.raises(ValueError, match=r"lora.modules_to_save=\['no_such_module'\]"):
        lora_engine(tiny_model_dir, LoRAConfig(rank=4, modules_to_save=["no_such_module"]))
    (problem,) = LoRAConfig(rank=4, target_modules=["q_proj"], modules_to_save=["q_proj"]).check()
    assert problem.startswith("modules_to_save: ['q_proj'] also in target_modules")
