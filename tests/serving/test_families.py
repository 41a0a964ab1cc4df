"""The embedded generator's architecture table (areal/serving/families): Qwen2, Qwen3, Llama 3 and
Qwen3-MoE each match transformers (RoPE frequencies, logits, greedy generate, the trainer's
logprobs), and a family or option it does not serve is one line at start naming what it serves."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from areal.serving.families import FAMILIES, UnsupportedModel, architecture_of
from areal.serving.sampling import SamplingParams
from tests.serving.conftest import hf_greedy, needs_cc

pytestmark = pytest.mark.slow

SERVED = ("qwen2", "qwen3", "llama", "qwen3_moe")
# 8 prompts of different lengths (2..40 tokens), run together: prefill and decode rows share steps
PROMPTS = [[(13 * i + 7 * j) % 256 for j in range(2 + 5 * i)] for i in range(8)]
ATTENTION = [pytest.param("compiled", marks=needs_cc), "torch"]


def _hf(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_models(tiny_family_dirs):
    return {family: _hf(d) for family, d in tiny_family_dirs.items()}


def test_the_table_serves_qwen2_qwen3_llama_and_qwen3_moe():
    assert tuple(FAMILIES) == SERVED


def test_each_family_reads_its_departures_from_config_json(tiny_family_dirs):
    from areal.serving.model import read_hf_config

    arch = {f: architecture_of(read_hf_config(d)) for f, d in tiny_family_dirs.items()}
    assert arch["qwen2"].qkv_bias and not arch["qwen2"].qk_norm
    assert arch["qwen3"].qk_norm and not arch["qwen3"].qkv_bias and arch["qwen3"].head_dim == 64
    assert not arch["llama"].qkv_bias and not arch["llama"].o_bias
    assert arch["llama"].rope.rope_type == "llama3" and arch["llama"].rope.factor == 8.0
    assert arch["llama"].rope.original_max_positions == 512 and arch["llama"].rope.theta == 5e5
    moe = arch["qwen3_moe"]
    assert moe.qk_norm and moe.head_dim == 64 and arch["qwen3"].experts is None
    assert moe.experts is not None and moe.experts.sparse_layers == {0, 1, 2, 3}
    assert (moe.experts.n_experts, moe.experts.top_k, moe.experts.norm_topk_prob) == (8, 2, True)
    # Qwen3 without head_dim: transformers' default 128, not hidden / heads
    base = {"hidden_size": 256, "num_attention_heads": 4}
    assert architecture_of({**base, "model_type": "qwen3"}).head_dim == 128
    # a transformers 4.x Llama 3.1 config.json (rope_theta beside rope_scaling) reads the same
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}
    scaling |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 512}
    v4 = {**base, "model_type": "llama", "rope_theta": 5e5, "rope_scaling": scaling}
    assert architecture_of(v4).rope == arch["llama"].rope
    # Qwen3-MoE: transformers' rule for sparse layers; 4.x spells num_local_experts num_experts
    layers = {"num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    layers |= {"num_experts_per_tok": 2}
    sparse = architecture_of({**base, **layers, "model_type": "qwen3_moe", "num_experts": 4})
    assert sparse.experts is not None and sparse.experts.sparse_layers == {1, 5}
    assert sparse.experts.n_experts == 4 and sparse.head_dim == 64  # hidden / heads


@pytest.mark.parametrize("family", SERVED)
def test_rope_frequencies_equal_transformers_bit_for_bit(tiny_family_dirs, hf_models, family):
    from areal.serving.model import ModelSpec, read_hf_config

    spec = ModelSpec(read_hf_config(tiny_family_dirs[family]))
    ours = spec.arch.rope.inv_freq(spec.head_dim)
    assert torch.equal(ours, hf_models[family].model.rotary_emb.inv_freq)
    if family == "llama":  # the llama3 scaling really moves the low frequencies
        unscaled = 1.0 / (5e5 ** (torch.arange(0, spec.head_dim, 2).float() / spec.head_dim))
        assert torch.equal(ours[:4], unscaled[:4]) and (ours[-4:] < unscaled[-4:] / 7.9).all()


def _perturbed_model(out, config, seed: int) -> str:
    """An HF model of ``config`` whose norms and biases are random too (init makes them 1 and 0,
    which would hide a weight read from the wrong place), saved to ``out``."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.data.normal_(1.0 if "norm" in name else 0.0, 0.3)
    model.save_pretrained(out)
    return str(out)


def _odd_config(family: str):
    """Family options the tiny models leave out: Qwen3 with head_dim 48 (!= hidden / heads)
    and attention biases, Llama 3 with attention biases and a tied head; Qwen3-MoE as Qwen3,
    with a dense layer among the sparse ones and the top-k probabilities not renormalised."""
    from areal.utils.tiny_model import SIZES, family_config

    common = dict(max_position_embeddings=256, eos_token_id=258, pad_token_id=256)
    config = family_config(family, SIZES["tiny"], 259, **common)
    config.attention_bias = True
    if family in ("qwen3", "qwen3_moe"):
        config.head_dim = 48
    else:
        config.tie_word_embeddings = True
    if family == "qwen3_moe":  # layer 1 dense (intermediate_size), 0, 2 and 3 sparse
        config.mlp_only_layers, config.norm_topk_prob = [1], False
    return config


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_moe"])
def test_packed_step_and_score_equal_hf_with_biases_norms_and_head_dim(tmp_path, family, attention):
    from areal.serving.model import KVCache, Qwen2Forward, read_hf_dir

    config = _odd_config(family)
    dirs = [_perturbed_model(tmp_path / f"seed{s}", config, s) for s in (0, 1)]
    model = Qwen2Forward.from_pretrained(dirs[0], cpu_attention=attention)
    for d in dirs:  # then the second weight set, loaded in place (a weight update)
        if d != dirs[0]:
            model.assign_weights(read_hf_dir(d)[1])
        hf = _hf(d)
        cache = KVCache(model.spec, 4, 64, model.device, model.dtype)
        first, later = [[5, 17, 99, 200, 3], [42] * 3], [[7, 8, 9, 1, 2, 3, 4]]
        empty = torch.zeros(0, dtype=torch.long)
        prefill = model.step(empty, empty, [torch.tensor(p) for p in first], cache)
        positions = torch.tensor([len(p) for p in first])
        step = model.step(torch.tensor([11, 12]), positions, [torch.tensor(later[0])], cache)
        seqs = first + [first[0] + [11], first[1] + [12], *later]
        with torch.no_grad():
            ref = torch.stack([hf(torch.tensor([q])).logits[0, -1] for q in seqs])
            full = hf(torch.tensor([later[0]])).logits[0]
        torch.testing.assert_close(torch.cat([prefill, step]), ref, atol=1e-4, rtol=0)
        torch.testing.assert_close(model.score(torch.tensor(later[0])), full, atol=1e-4, rtol=0)


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("family", SERVED)
def test_greedy_tokens_equal_hf_generate_for_64_tokens_on_8_prompts(
    tiny_family_dirs, hf_models, family, attention
):
    from areal.serving.generator import Generator

    gen = Generator.from_pretrained(tiny_family_dirs[family], cpu_attention=attention).start()
    try:
        results = gen.generate(PROMPTS, SamplingParams(max_new_tokens=64, temperature=0.0))
    finally:
        gen.shutdown()
    lengths = []
    for prompt, r in zip(PROMPTS, results):
        assert r.output_ids == hf_greedy(hf_models[family], prompt, 64), prompt
        lengths.append(len(r.output_ids))
    assert sum(lengths) >= 4 * 64, lengths  # most rows run the full 64 tokens (no early eos)


@pytest.mark.parametrize("family", SERVED)
def test_sampled_logprobs_equal_the_trainers_compute_logp(tiny_family_dirs, family):
    from areal.api.config import TrainEngineConfig
    from areal.engine.fsdp import FSDPEngine
    from areal.runtime.dist import init_distributed
    from areal.serving.generator import Generator
    from areal.utils.batch import PackedBatch

    model_dir, temperature = tiny_family_dirs[family], 0.7
    params = SamplingParams(max_new_tokens=16, temperature=temperature, seed=5, ignore_eos=True)
    gen = Generator.from_pretrained(model_dir).start()
    try:
        results = gen.generate(PROMPTS[:4], params)
    finally:
        gen.shutdown()
    engine = FSDPEngine(
        TrainEngineConfig(path=model_dir), init_distributed("gloo").mesh, temperature=temperature
    )
    engine.initialize(None)
    try:
        seqs = [r.input_ids + r.output_ids for r in results]
        batch = PackedBatch.from_sequences({"input_ids": seqs})
        logp = engine.compute_logp(batch)[0]["logp"]  # [T]
    finally:
        engine.destroy()
    for i, r in enumerate(results):
        start = int(batch.cu_seqlens[i]) + len(r.input_ids)
        trainer = logp[start : start + len(r.output_ids)]
        torch.testing.assert_close(trainer, torch.tensor(r.output_logprobs), atol=1e-4, rtol=0)


REFUSED = [
    ({"model_type": "gpt2"}, "model_type 'gpt2'"),
    ({"model_type": "mixtral"}, "model_type 'mixtral'"),
    ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window=true"),
    ({"model_type": "qwen3", "layer_types": ["sliding_attention"]}, "layer_types"),
    ({"model_type": "llama", "rope_parameters": {"rope_type": "yarn"}}, "rope_type 'yarn'"),
    ({"model_type": "llama", "mlp_bias": True}, "mlp_bias=true"),
    ({"model_type": "qwen3", "partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ({"model_type": "llama", "hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"model_type": "qwen3_moe", "decoder_sparse_step": 0}, "decoder_sparse_step 0"),
    (
        {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 5},
        "num_experts_per_tok 5",
    ),
    ({"model_type": "qwen3_moe", "use_sliding_window": True}, "use_sliding_window=true"),
]


@pytest.mark.parametrize("config, named", REFUSED)
def test_what_is_not_served_is_one_line_naming_it_and_the_advice(config, named):
    config = {"hidden_size": 256, "num_attention_heads": 4, "num_hidden_layers": 2, **config}
    with pytest.raises(UnsupportedModel) as e:
        architecture_of(config)
    line = str(e.value)
    assert "\n" not in line and named in line and "rollout.backend=vllm|sglang" in line, line
    if "model_type" in named:  # an unknown family: the families served are named
        assert "qwen2, qwen3, llama, qwen3_moe" in line, line


def _unserved_dir(tiny_model_dir, out) -> str:
    """A copy of the tiny model declaring model_type gpt2, its weights unreadable: a refusal
    must come before the weights are read."""
    shutil.copytree(tiny_model_dir, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    for f in out.glob("*.safetensors"):
        f.write_bytes(b"not safetensors")
    return str(out)


def test_an_unserved_family_is_refused_before_its_weights_are_read(tiny_model_dir, tmp_path):
    from areal.serving.model import Qwen2Forward

    with pytest.raises(UnsupportedModel, match="gpt2"):
        Qwen2Forward.from_pretrained(_unserved_dir(tiny_model_dir, tmp_path / "unserved"))


def test_areal_serve_of_an_unserved_family_is_one_line_and_exit_2(tiny_model_dir, tmp_path):
    model_dir = _unserved_dir(tiny_model_dir, tmp_path / "unserved")
    proc = subprocess.run(
        [sys.executable, "-m", "areal.cli", "serve", "--model", model_dir, "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and "model_type 'gpt2'" in lines[0], lines
    assert (
        "qwen2, qwen3, llama, qwen3_moe" in lines[0] and "rollout.backend=vllm|sglang" in lines[0]
    )
    assert "listening" not in proc.stdout


def test_rms_norm_in_bf16_equals_transformers_rmsnorm():
    """The server's norms (layer norms, Qwen3's per-head q/k norms) compute the variance in fp32
    as transformers does, so a bf16 server's logprobs do not drift from the trainer's there."""
    from types import SimpleNamespace

    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from areal.serving.model import Qwen2Forward

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 3, 64, generator=gen) * 30).to(torch.bfloat16)
    hf = Qwen3RMSNorm(64, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        hf.weight.copy_(torch.rand(64, generator=gen) + 0.5)
        ours = Qwen2Forward._rms_norm(SimpleNamespace(spec=SimpleNamespace(eps=1e-6)), x, hf.weight)
        assert torch.equal(ours, hf(x))


def test_a_weight_update_reaches_the_experts_in_either_spelling(tiny_family_dirs, tmp_path):
    """transformers 5 holds a layer's experts fused (``mlp.experts.gate_up_proj [E, 2I, H]``: the
    trainer's state dict, weight updates and checkpoints); save_pretrained writes them per
    expert. Either spelling updates the served experts in place."""
    from safetensors.torch import save_file

    from areal.serving.model import Qwen2Forward, read_hf_dir
    from areal.utils.tiny_model import build_tiny_model

    model = Qwen2Forward.from_pretrained(tiny_family_dirs["qwen3_moe"])
    other_dir = build_tiny_model(tmp_path / "seed1", seed=1, family="qwen3_moe")
    other = _hf(str(other_dir))
    state = other.state_dict()
    fused = {k: v for k, v in state.items() if ".mlp.experts." in k}
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused  # transformers 5's spelling
    tokens = torch.tensor(PROMPTS[6])
    before = model.score(tokens)
    model.require_loadable(fused)
    model.assign_weights(fused)  # the experts alone
    assert (model.score(tokens) - before).abs().max() > 0.1
    on_disk = read_hf_dir(other_dir)[1]  # per expert, as save_pretrained writes them
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in on_disk
    model.require_loadable(on_disk, complete=True)
    model.assign_weights(on_disk)
    with torch.no_grad():
        ref = other(tokens[None]).logits[0]
    torch.testing.assert_close(model.score(tokens), ref, atol=1e-4, rtol=0)
    assert model.check_weights(state, complete=True) == []  # the fused state dict is whole too
    # a trainer's fused checkpoint loads as the server's model
    fused_dir = tmp_path / "fused"
    shutil.copytree(other_dir, fused_dir)
    save_file(
        {k: v.contiguous() for k, v in state.items() if k != "lm_head.weight"},
        str(fused_dir / "model.safetensors"),
    )
    reloaded = Qwen2Forward.from_pretrained(fused_dir)
    torch.testing.assert_close(reloaded.score(tokens), ref, atol=1e-4, rtol=0)
