"""The static-shape decode step (areal/serving/decode_graph.py): buckets and options, the same
tokens as the eager step (plain, compiled, for every dense family), weight updates reaching it in
place, the host/device overlap's answers, and on CUDA (tier 3) graph replay, in-place updates
under graphs and release/resume with graphs."""

from __future__ import annotations

import pytest
import torch

from areal.serving.decode_graph import DecodeOptions, StaticDecode, decode_options, default_buckets
from areal.serving.model import KVCache, ModelSpec, Qwen2Forward, read_hf_dir
from areal.serving.sampling import SamplingParams
from tests.serving.conftest import hf_greedy

CPU = torch.device("cpu")
PLAIN = DecodeOptions(compile=False, graphs=False, buckets=(1, 2, 4, 8))  # static, not compiled
PROMPTS = [[(13 * i + 7 * j) % 256 for j in range(2 + 5 * i)] for i in range(8)]
GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)


def test_buckets_are_powers_of_two_then_the_batch_limit():
    assert default_buckets(1) == (1,)
    assert default_buckets(8) == (1, 2, 4, 8)
    assert default_buckets(6) == (1, 2, 4, 6)  # the limit itself is the last bucket
    static = StaticDecode.__new__(StaticDecode)
    static.options = DecodeOptions(False, False, (1, 2, 4, 6))
    assert [static.bucket(b) for b in (1, 2, 3, 4, 5, 6)] == [1, 2, 4, 4, 6, 6]
    with pytest.raises(ValueError, match="exceed the largest bucket"):
        static.bucket(7)


def test_options_auto_is_eager_on_cpu_and_explicit_ones_are_checked(tiny_family_dirs):
    from areal.serving.model import read_hf_config

    dense = ModelSpec(read_hf_config(tiny_family_dirs["qwen2"]))
    moe = ModelSpec(read_hf_config(tiny_family_dirs["qwen3_moe"]))
    assert decode_options("auto", "auto", [], CPU, 8, dense) is None
    assert decode_options("on", "off", [3], CPU, 8, dense) == DecodeOptions(True, False, (3, 8))
    with pytest.raises(ValueError, match="server.cuda_graphs=on needs a CUDA device"):
        decode_options("auto", "on", [], CPU, 8, dense)
    with pytest.raises(ValueError, match=r"server.decode_buckets: \[9\] outside 1..max_batch"):
        decode_options("on", "off", [9], CPU, 8, dense)
    assert decode_options("auto", "auto", [], torch.device("cuda"), 8, moe) is None  # eager
    with pytest.raises(ValueError, match=r"server.compile=on: this model's sparse \(MoE\) layers"):
        decode_options("on", "auto", [], CPU, 8, moe)


def test_config_check_names_cuda_graphs_off_cuda_and_bad_buckets():
    from areal.api.config.server import GenerationServerConfig

    cfg = GenerationServerConfig(cuda_graphs="on", decode_buckets=[0, 4], max_batch_size=4)
    problems = "\n".join(cfg.check())
    assert "cuda_graphs: on needs a CUDA device, got device='cpu'" in problems
    assert "decode_buckets: [0] outside 1..max_batch_size (4)" in problems


def test_static_step_equals_the_packed_step_and_padding_leaves_the_cache_as_it_was(
    tiny_model_dir,
):
    model = Qwen2Forward.from_pretrained(tiny_model_dir, pack_weights=False)
    caches = [KVCache(model.spec, 8, 64, model.device, model.dtype) for _ in range(2)]
    for t, u in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
        u.copy_(t.normal_())  # free slots hold values (a prefix cache could have left them)
    prompts = [torch.tensor(p) for p in PROMPTS[:3]]  # 3 rows: bucket 4, one padding row
    empty = torch.zeros(0, dtype=torch.long)
    out = []
    for cache, static in zip(caches, (None, StaticDecode(model, PLAIN))):
        model.static = None
        model.step(empty, empty, prompts, cache)
        model.static = static
        logits = model.step(torch.tensor([3, 4, 5]), torch.tensor([2, 7, 12]), [], cache)
        out.append(logits.clone())
    torch.testing.assert_close(out[1], out[0], atol=1e-5, rtol=0)
    for eager, static in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
        torch.testing.assert_close(static[3:], eager[3:], atol=0, rtol=0)  # free slots untouched
        torch.testing.assert_close(static[:3, :, :13], eager[:3, :, :13], atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_static_step_greedy_equals_hf_generate_for_64_tokens_on_8_prompts(tiny_family_dirs, family):
    from transformers import AutoModelForCausalLM

    from areal.serving.generator import Generator

    model = Qwen2Forward.from_pretrained(tiny_family_dirs[family], pack_weights=False)
    gen = Generator(model, max_batch_size=8, static_decode=PLAIN).start()
    calls = _count_static(gen)
    try:
        results = gen.generate(PROMPTS, SamplingParams(max_new_tokens=64, temperature=0.0))
    finally:
        gen.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(tiny_family_dirs[family], dtype=torch.float32)
    for prompt, r in zip(PROMPTS, results):
        assert r.output_ids == hf_greedy(hf.eval(), prompt, 64), prompt
    assert calls[0] >= 60  # the decode steps ran the static step


def _count_static(gen) -> list[int]:
    """A counter of the static forward's calls on ``gen``'s model."""
    calls, forward = [0], gen.model.static.forward

    def counted(*args):
        calls[0] += 1
        return forward(*args)

    gen.model.static.forward = counted
    return calls


@pytest.fixture(scope="module")
def compiled_generator(tiny_model_dir):
    """A generator whose decode steps run the inductor-compiled static step (one bucket, so one
    compile: ~30 s on 2 cores)."""
    from areal.serving.generator import Generator

    gen = Generator.from_pretrained(
        tiny_model_dir, compile="on", decode_buckets=[8], max_batch_size=8
    ).start()
    yield gen
    gen.shutdown()


@pytest.mark.slow
def test_compiled_decode_equals_the_eager_step_token_for_token(tiny_model_dir, compiled_generator):
    from areal.serving.generator import Generator

    assert compiled_generator.model.static.options.compile
    calls = _count_static(compiled_generator)
    compiled = compiled_generator.generate(PROMPTS, GREEDY)
    eager = Generator.from_pretrained(tiny_model_dir, max_batch_size=8).start()
    try:
        plain = eager.generate(PROMPTS, GREEDY)
    finally:
        eager.shutdown()
    assert [r.output_ids for r in compiled] == [r.output_ids for r in plain]
    lp = [torch.tensor(r.output_logprobs) for r in (compiled, plain) for r in r]
    torch.testing.assert_close(torch.cat(lp[:8]), torch.cat(lp[8:]), atol=1e-4, rtol=0)
    assert calls[0] >= 20


@pytest.mark.slow
def test_a_weight_update_between_steps_reaches_the_compiled_decode(
    compiled_generator, tiny_model_dir, other_model_dir
):
    gen = compiled_generator
    other = Qwen2Forward.from_pretrained(other_model_dir)  # eager reference of the new weights
    before = gen._call(lambda: _decode_logits(gen.model))
    gen.update_weights(read_hf_dir(other_model_dir)[1])
    try:
        after = gen._call(lambda: _decode_logits(gen.model))
    finally:
        gen.update_weights(read_hf_dir(tiny_model_dir)[1])  # the fixture's weights again
    torch.testing.assert_close(after, _decode_logits(other), atol=1e-4, rtol=0)
    assert (after - before).abs().max() > 1e-2  # the old weights' logits are gone
    torch.testing.assert_close(gen._call(lambda: _decode_logits(gen.model)), before)


@pytest.mark.parametrize("pack", [True, False])
def test_a_weight_update_writes_every_fused_weight_into_its_own_storage(
    tiny_model_dir, other_model_dir, pack
):
    # captured CUDA graphs read the fused q/k/v and gate/up weights (and packed ones) by address
    model = Qwen2Forward.from_pretrained(tiny_model_dir, pack_weights=pack)
    fresh = Qwen2Forward.from_pretrained(other_model_dir, pack_weights=pack)
    held = [(t, None if t.is_mkldnn else t.data_ptr()) for t in _fused(model)]  # opaque: none
    model.assign_weights(read_hf_dir(other_model_dir)[1])
    for (t, ptr), now, new in zip(held, _fused(model), _fused(fresh), strict=True):
        assert now is t and (t.is_mkldnn or t.data_ptr() == ptr)
        dense = (lambda x: x.to_dense()) if t.is_mkldnn else (lambda x: x)
        torch.testing.assert_close(dense(t), dense(new), atol=0, rtol=0)


def _fused(model: Qwen2Forward) -> list[torch.Tensor]:
    """Every tensor the forward reads through ``model.layers`` and the head."""
    layers = [t for layer in model.layers for t in layer.values() if isinstance(t, torch.Tensor)]
    return [*layers, model.lm_head, model.embed, model.final_norm]


def _decode_logits(model: Qwen2Forward) -> torch.Tensor:
    """Logits of one decode step of 3 rows after their prompts' prefill, on a fresh cache."""
    cache = KVCache(model.spec, 8, 256, model.device, model.dtype)
    empty = torch.zeros(0, dtype=torch.long)
    model.step(empty, empty, [torch.tensor(p) for p in PROMPTS[1:4]], cache)
    positions = torch.tensor([len(p) for p in PROMPTS[1:4]])
    return model.step(torch.tensor([9, 8, 7]), positions, [], cache).clone()


def test_overlapped_answers_leave_outputs_and_pause_as_they_were(tiny_model_dir):
    # overlap (on for CUDA) answers a step's finished requests during the next step: the outputs,
    # seeded draws included, are those of the plain order, and a pause still answers everything
    from areal.serving.generator import Generator

    params = [
        SamplingParams(max_new_tokens=3 + 4 * i, temperature=1.0, seed=i, ignore_eos=True)
        for i in range(8)
    ]
    outputs = []
    for overlap in (False, True):
        gen = Generator.from_pretrained(tiny_model_dir, max_batch_size=4)
        gen.overlap = overlap
        gen.start()
        try:
            outputs.append([r.output_ids for r in gen.generate(PROMPTS, params)])
            futures = gen.submit_batch(PROMPTS[:2], [SamplingParams(max_new_tokens=500)] * 2)
            gen.pause()
            assert all(f.result(timeout=60).finish_reason == "abort" for f in futures)
            gen.resume()
        finally:
            gen.shutdown()
    assert outputs[1] == outputs[0]
    assert [len(o) for o in outputs[0]] == [3 + 4 * i for i in range(8)]


def _cuda_generator(model_dir: str, **kwargs):
    from areal.serving.generator import Generator

    return Generator.from_pretrained(
        model_dir, device="cuda", compile="off", cuda_graphs="on", max_batch_size=8, **kwargs
    )


@pytest.mark.gpu
def test_cuda_graph_replay_equals_the_eager_step(tiny_model_dir):
    from areal.serving.generator import Generator

    graphs = _cuda_generator(tiny_model_dir).start()
    eager = Generator.from_pretrained(
        tiny_model_dir, device="cuda", compile="off", cuda_graphs="off", max_batch_size=8
    ).start()
    try:
        replayed = graphs.generate(PROMPTS, GREEDY)
        plain = eager.generate(PROMPTS, GREEDY)
        assert graphs.model.static.captures >= 2  # buckets 8, 4, ... as requests finish
    finally:
        graphs.shutdown()
        eager.shutdown()
    assert [r.output_ids for r in replayed] == [r.output_ids for r in plain]


@pytest.mark.gpu
def test_a_weight_update_in_place_reaches_the_captured_graphs(tiny_model_dir, other_model_dir):
    gen = _cuda_generator(tiny_model_dir).start()
    reference = _cuda_generator(other_model_dir).start()
    try:
        gen.generate(PROMPTS, GREEDY)  # captures the graphs under the first weights
        captured = gen.model.static.captures
        gen.update_weights(read_hf_dir(other_model_dir)[1])
        updated = gen.generate(PROMPTS, GREEDY)
        assert gen.model.static.captures == captured  # replayed the same graphs
        expected = reference.generate(PROMPTS, GREEDY)
    finally:
        gen.shutdown()
        reference.shutdown()
    assert [r.output_ids for r in updated] == [r.output_ids for r in expected]


@pytest.mark.gpu
def test_release_and_resume_memory_with_graphs_recaptures_and_generates_the_same(tiny_model_dir):
    gen = _cuda_generator(tiny_model_dir).start()
    try:
        first = gen.generate(PROMPTS, GREEDY)
        gen.pause()
        torch.cuda.synchronize()
        held = torch.cuda.memory_reserved()
        assert gen.release_memory() > 0
        assert torch.cuda.memory_reserved() < held  # the cache and the graphs' pool went back
        gen.resume_memory()
        gen.resume()
        again = gen.generate(PROMPTS, GREEDY)
    finally:
        gen.shutdown()
    assert [r.output_ids for r in again] == [r.output_ids for r in first]
