"""Generator vs Hugging Face: greedy equality, logprobs, seeds, joining, stops, pause, reloads."""

from __future__ import annotations

import time

import pytest
import torch

from areal.serving.sampling import SamplingParams
from tests.serving.conftest import hf_greedy, hf_logprobs, needs_cc

PROMPTS = [[5, 17, 99, 200, 3], [42] * 3, list(range(60, 90)), [7]]
GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0)


@pytest.mark.parametrize("attention", [pytest.param("compiled", marks=needs_cc), "torch"])
def test_packed_step_logits_equal_hf_forward(tiny_model_dir, hf_model, attention):
    # One step holding 2 decode rows and 3 new prompts (the adjacent two of equal length share
    # an SDPA call), with either decode-attention path.
    from areal.serving.model import KVCache, Qwen2Forward

    model = Qwen2Forward.from_pretrained(tiny_model_dir, cpu_attention=attention)
    assert model.attention_impl == attention
    cache = KVCache(model.spec, 8, 128, model.device, model.dtype)
    first, later = [[5, 17, 99, 200, 3], [42] * 3], [list(range(60, 90)), [7, 8, 9], [1, 2, 3]]
    empty = torch.zeros(0, dtype=torch.long)
    prefill = model.step(empty, empty, [torch.tensor(p) for p in first], cache)
    nxt = torch.tensor([11, 12])
    logits = model.step(
        nxt, torch.tensor([len(p) for p in first]), [torch.tensor(p) for p in later], cache
    )
    seqs = [first[0] + [11], first[1] + [12], *later]
    with torch.no_grad():
        ref = torch.stack([hf_model(torch.tensor([q])).logits[0, -1] for q in first + seqs])
    torch.testing.assert_close(torch.cat([prefill, logits]), ref, atol=1e-4, rtol=0)


def test_decode_attention_runs_read_their_own_length_and_match_one_run(tiny_model_dir):
    from areal.serving.attention import MaskedAttention
    from areal.serving.model import KVCache, Qwen2Forward

    model = Qwen2Forward.from_pretrained(tiny_model_dir, cpu_attention="torch")
    s, attention = model.spec, model.attention
    cache = KVCache(model.spec, 8, 64, model.device, model.dtype)
    for t in cache.k + cache.v:
        t.normal_()
    lengths = torch.tensor([10, 4, 6, 8, 3])
    q = torch.randn(5, s.n_heads, s.head_dim)
    attention.run = 2  # runs of 2 slots
    runs = attention.layout(lengths, cache.capacity)
    assert [(a, b, bias.shape[-1]) for a, b, bias in runs] == [(0, 2, 10), (2, 4, 8), (4, 5, 3)]
    assert runs[0][2][s.n_kv_heads, 0].isinf().tolist() == [False] * 4 + [True] * 6  # row 1: 0..3
    in_runs = attention(q, cache.k[1], cache.v[1], runs)
    attention.run = 64
    one_run = attention(q, cache.k[1], cache.v[1], attention.layout(lengths, cache.capacity))
    torch.testing.assert_close(in_runs, one_run, atol=1e-5, rtol=0)  # fp32 summation order
    masked = MaskedAttention()  # the static decode's: the whole capacity under a length mask
    full = masked(q, cache.k[1], cache.v[1], masked.layout(lengths, cache.capacity))
    torch.testing.assert_close(full, one_run, atol=1e-5, rtol=0)


@pytest.mark.parametrize("attention", [pytest.param("compiled", marks=needs_cc), "torch"])
def test_retire_refills_holes_and_logprobs_stay_exact(tiny_model_dir, hf_model, attention):
    # torch: 4 attention runs of 2 slots, so retirements refill holes run by run (middle rows
    # move); compiled: no runs, the last row fills each hole. Either way cache rows move between
    # slots, and each request's logprobs still equal HF's forward on its tokens.
    from areal.serving.generator import Generator

    gen = Generator.from_pretrained(tiny_model_dir, cpu_attention=attention, max_batch_size=8)
    if attention == "torch":
        gen.model.attention_run = 2
    moves = []
    move_slot = gen.cache.move_slot

    def record(src, dst, n):
        moves.append(src != len(gen._running) - 1)  # True: a middle row refilled a hole
        move_slot(src, dst, n)

    gen.cache.move_slot = record
    prompts = [[(7 * i + j) % 250 for j in range(3 + 5 * i % 17)] for i in range(14)]
    limits = [2 + (11 * i) % 19 for i in range(14)]
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in limits]
    try:
        results = gen.start().generate(prompts, params)
    finally:
        gen.shutdown()
    assert moves and not all(moves)
    assert any(moves) == (attention == "torch")
    for prompt, n, r in zip(prompts, limits, results):
        assert len(r.output_ids) == n
        ref = hf_logprobs(hf_model, prompt, r.output_ids)  # sees every cached key: a bad move shows
        torch.testing.assert_close(torch.tensor(r.output_logprobs), ref, atol=1e-4, rtol=0)


def test_fused_dense_ops_are_onednn_on_cpu_fp32_and_match_unfused_torch():
    import torch.nn.functional as F

    from areal.serving.model import DenseOps

    fused = DenseOps(torch.device("cpu"), torch.float32)
    plain = DenseOps(torch.device("cpu"), torch.bfloat16)
    assert fused.fused  # oneDNN is in every torch CPU build this project installs
    assert not plain.fused
    x, w, b = torch.randn(37, 64), torch.randn(96, 64), torch.randn(96)
    res = torch.randn(37, 96)
    close = dict(atol=1e-4, rtol=1e-5)
    packed = fused.pack(w)
    assert packed.is_mkldnn and plain.pack(w) is w  # packed once into oneDNN's layout
    for weight in (w, packed):
        torch.testing.assert_close(fused.linear(x, weight, b), F.linear(x, w, b), **close)
        torch.testing.assert_close(fused.linear(x, weight), x @ w.T, **close)
        torch.testing.assert_close(fused.linear_add(x, weight, res), res + x @ w.T, **close)
    torch.testing.assert_close(plain.linear_add(x, w, res), res + x @ w.T, **close)


def test_greedy_output_equals_hf_generate(generator, hf_model):
    results = generator.generate(PROMPTS, GREEDY)
    for prompt, r in zip(PROMPTS, results):
        assert r.output_ids == hf_greedy(hf_model, prompt, 24)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_equal_log_softmax_of_hf_forward(generator, hf_model, temperature):
    # Contract: log_softmax(logits / T)[token], T = 1 for greedy (temperature 0).
    params = SamplingParams(max_new_tokens=16, temperature=temperature, seed=11)
    r = generator.generate([PROMPTS[0]], params)[0]
    ref = hf_logprobs(hf_model, PROMPTS[0], r.output_ids, temperature if temperature > 0 else 1.0)
    torch.testing.assert_close(torch.tensor(r.output_logprobs), ref, atol=1e-4, rtol=0)
    assert r.output_versions == [generator.version] * len(r.output_ids)


def test_seeded_sampling_is_reproducible_regardless_of_batch(generator):
    params = SamplingParams(max_new_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    alone = generator.generate([PROMPTS[0]], params)[0].output_ids
    crowd = generator.generate(
        PROMPTS + [PROMPTS[0]], [SamplingParams(max_new_tokens=20)] * len(PROMPTS) + [params]
    )[-1].output_ids
    other_seed = generator.generate([PROMPTS[0]], SamplingParams(max_new_tokens=20, seed=99))[0]
    assert alone == crowd
    assert other_seed.output_ids != alone


def test_a_group_sharing_one_prefill_samples_as_if_each_ran_alone(generator, hf_model):
    # 4 samples of one prompt admitted together (one prefill, cache copied) beside another prompt
    seeds = [3, 4, 5, 6]
    group = [SamplingParams(max_new_tokens=12, temperature=1.0, seed=s) for s in seeds]
    shared = generator.generate([PROMPTS[2]] * 4 + [PROMPTS[0]], group + [GREEDY])
    for seed, r in zip(seeds, shared[:4]):
        alone = generator.generate(
            [PROMPTS[2]], SamplingParams(max_new_tokens=12, temperature=1.0, seed=seed)
        )[0]
        assert r.output_ids == alone.output_ids
        ref = hf_logprobs(hf_model, PROMPTS[2], r.output_ids, 1.0)
        torch.testing.assert_close(torch.tensor(r.output_logprobs), ref, atol=1e-4, rtol=0)
    assert len({tuple(r.output_ids) for r in shared[:4]}) > 1  # independent samples, not copies
    assert shared[4].output_ids == hf_greedy(hf_model, PROMPTS[0], 24)


def test_request_joining_mid_run_gets_same_greedy_result_as_alone(generator):
    alone = generator.generate([PROMPTS[2]], GREEDY)[0].output_ids
    long_run = generator.submit(
        PROMPTS[1], SamplingParams(max_new_tokens=300, temperature=0.0, ignore_eos=True)
    )
    time.sleep(0.2)  # the long request is decoding when the next one joins
    joined = generator.generate([PROMPTS[2]], GREEDY)[0].output_ids
    assert not long_run.done() or len(long_run.result().output_ids) == 300
    long_run.result(timeout=60)
    assert joined == alone


def test_stop_token_ids_stop_at_first_occurrence_after_min_tokens(generator):
    free = generator.generate([PROMPTS[0]], GREEDY)[0].output_ids
    stop_tok = free[5]
    first = free.index(stop_tok)
    r = generator.generate(
        [PROMPTS[0]], SamplingParams(max_new_tokens=24, temperature=0.0, stop_token_ids=(stop_tok,))
    )[0]
    assert r.finish_reason == "stop" and r.matched == stop_tok
    assert r.output_ids == free[: first + 1]
    # min_new_tokens suppresses the stop token until that many tokens exist
    r = generator.generate(
        [PROMPTS[0]],
        SamplingParams(
            max_new_tokens=24, temperature=0.0, stop_token_ids=(stop_tok,), min_new_tokens=first + 2
        ),
    )[0]
    assert len(r.output_ids) >= first + 2
    assert stop_tok not in r.output_ids[: first + 2]


def test_stop_string_ends_generation(generator, tiny_tokenizer):
    free = generator.generate([PROMPTS[3]], GREEDY)[0].output_ids
    text = tiny_tokenizer.decode(free[3:5])
    r = generator.generate(
        [PROMPTS[3]], SamplingParams(max_new_tokens=24, temperature=0.0, stop=(text,))
    )[0]
    assert r.finish_reason == "stop" and r.matched == text
    assert text in tiny_tokenizer.decode(r.output_ids)
    assert len(r.output_ids) <= 5


def test_max_new_tokens_and_zero_tokens(generator):
    r = generator.generate([PROMPTS[0]], SamplingParams(max_new_tokens=3, ignore_eos=True))[0]
    assert r.finish_reason == "length" and len(r.output_ids) == 3
    r = generator.generate([PROMPTS[0]], SamplingParams(max_new_tokens=0))[0]
    assert r.finish_reason == "length" and r.output_ids == []


def test_pause_aborts_in_flight_with_partials_and_resume_accepts_work(generator):
    fut = generator.submit(PROMPTS[0], SamplingParams(max_new_tokens=1500, ignore_eos=True))
    time.sleep(0.3)
    assert generator.pause() >= 1
    r = fut.result(timeout=10)
    assert r.finish_reason == "abort"
    assert 0 < len(r.output_ids) < 1500 and len(r.output_logprobs) == len(r.output_ids)
    held = generator.submit(PROMPTS[0], SamplingParams(max_new_tokens=2))
    time.sleep(0.1)
    assert not held.done()  # held while paused
    generator.resume()
    assert held.result(timeout=10).finish_reason in ("length", "stop")


def test_weight_update_makes_outputs_match_new_weights(generator, hf_model, other_model_dir):
    from transformers import AutoModelForCausalLM

    other = AutoModelForCausalLM.from_pretrained(other_model_dir, dtype=torch.float32).eval()
    v0 = generator.version
    assert generator.update_weights_from_disk(other_model_dir) == v0 + 1
    r = generator.generate([PROMPTS[0]], GREEDY)[0]
    assert r.output_ids == hf_greedy(other, PROMPTS[0], 24)
    assert r.output_versions == [v0 + 1] * len(r.output_ids)
    state = {k: v for k, v in hf_model.state_dict().items()}
    assert generator.update_weights(state, version=v0) == v0  # set, not bump
    assert generator.generate([PROMPTS[0]], GREEDY)[0].output_ids == hf_greedy(
        hf_model, PROMPTS[0], 24
    )


def test_invalid_requests_are_rejected_with_the_field_name(generator):
    with pytest.raises(ValueError, match="input_ids"):
        generator.submit([], GREEDY)
    with pytest.raises(ValueError, match="input_ids"):
        generator.submit([1] * generator.context_length, GREEDY)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generator.submit([1], SamplingParams(max_new_tokens=-1))
    hostile = {
        "temperature": SamplingParams(temperature=float("nan")),
        "top_k": SamplingParams(top_k=10**20),
        "seed": SamplingParams(seed=-1),
        "stop_token_ids": SamplingParams(stop_token_ids=(generator.model.spec.vocab_size,)),
    }
    for field, params in hostile.items():
        with pytest.raises(ValueError, match=f"sampling_params.{field}"):
            generator.submit([1], params)
    assert generator.generate([PROMPTS[0]], GREEDY)[0].finish_reason in ("stop", "length")


def test_failed_steps_fail_their_requests_until_too_many_in_a_row_stop_the_generator(
    tiny_model_dir,
):
    from areal.serving.generator import MAX_FAILED_STEPS, Generator, GeneratorStopped, StepFailed

    gen = Generator.from_pretrained(tiny_model_dir, max_batch_size=1)  # one request per step

    def broken_step(*args):
        raise FloatingPointError("bad kernel")

    gen.model.step = broken_step
    prompts = [PROMPTS[0]] * (MAX_FAILED_STEPS + 1)
    try:
        futures = gen.start().submit_batch(prompts, [GREEDY] * len(prompts))
        for f in futures[: MAX_FAILED_STEPS - 1]:  # each failed step fails only its own request
            with pytest.raises(StepFailed, match="generation step failed: FloatingPointError"):
                f.result(timeout=30)
        for f in futures[MAX_FAILED_STEPS - 1 :]:  # then the generator counts as broken
            with pytest.raises(GeneratorStopped, match="generator crashed: FloatingPointError"):
                f.result(timeout=30)
        assert isinstance(gen.error, FloatingPointError) and gen.n_failed_steps == MAX_FAILED_STEPS
        with pytest.raises(GeneratorStopped, match="not running"):
            gen.submit(PROMPTS[0], GREEDY)
    finally:
        gen.shutdown()
