"""The batched device sampler (areal.serving.sampler) and incremental stop strings
(areal.serving.stop_text): counter-based noise, truncation, suppression, logprobs, one host copy
per step (tiers 1 and 2)."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

from areal.serving.requests import Seq
from areal.serving.sampler import FINITE, LENGTH, STOP, UNSEEDED, BatchSampler, counter_uniform
from areal.serving.sampling import SamplingParams
from areal.serving.stop_text import REPLACEMENT, StopText

V = 40


def _seq(params: SamplingParams, stop_ids=(), prompt_len: int = 3) -> Seq:
    return Seq(list(range(prompt_len)), params, concurrent.futures.Future(), frozenset(stop_ids))


def _sampler(context_length: int = 1000) -> BatchSampler:
    return BatchSampler(torch.device("cpu"), V, context_length, seed=0)


def _steps(sampler: BatchSampler, seqs: list[Seq], logits: list[torch.Tensor]) -> list[list[int]]:
    """Tokens each of ``seqs`` draws over ``len(logits)`` steps (logits[t]: [len(seqs), V])."""
    out: list[list[int]] = [[] for _ in seqs]
    for step_logits in logits:
        tokens = sampler.sample(step_logits, seqs)[0]
        for row, (s, tok) in enumerate(zip(seqs, tokens)):
            s.out.append(int(tok))
            out[row].append(int(tok))
    return out


def test_counter_uniform_is_a_pure_function_of_key_and_counter_and_uniform():
    n = torch.arange(20000)
    lo, hi = torch.full_like(n, 1234), torch.zeros_like(n)
    u = counter_uniform(lo, hi, n)
    assert torch.equal(u, counter_uniform(lo, hi, n))  # same key, same counters: same noise
    assert ((u >= 0) & (u < 1)).all()
    # 10 bins of 2000 expected each; a binomial's sd is ~42, so 200 is ~5 sd
    counts = torch.histc(u, bins=10, min=0, max=1)
    assert (counts - 2000).abs().max() < 200, counts
    other = counter_uniform(lo + 1, hi, n)  # a neighbouring key: unrelated noise
    assert abs(torch.corrcoef(torch.stack([u, other]))[0, 1]) < 0.03
    assert (u != other).float().mean() > 0.99
    assert not torch.equal(u, counter_uniform(lo, hi + 1, n))  # the key's high half counts


def test_draws_follow_the_distribution():
    # one seeded row, 8000 steps over p = softmax(log [0.5, 0.3, 0.15, 0.05, 0...])
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05] + [0.0] * (V - 4))
    logits = probs.log()[None, :]
    seq = _seq(SamplingParams(seed=7, max_new_tokens=10**6))
    sampler = _sampler(10**7)
    tokens = torch.tensor(_steps(sampler, [seq], [logits] * 8000)[0])
    freq = torch.bincount(tokens, minlength=V).float() / len(tokens)
    # sd of a frequency near 0.5 over 8000 draws is ~0.0056; 0.025 is ~4.5 sd
    torch.testing.assert_close(freq, probs, atol=0.025, rtol=0)
    assert freq[4:].sum() == 0  # a token of probability 0 is never drawn


def test_a_seeded_row_draws_the_same_tokens_alone_and_in_any_batch():
    gen = torch.Generator().manual_seed(0)
    steps = [torch.randn(5, V, generator=gen) * 3 for _ in range(30)]
    seeded = SamplingParams(seed=42, temperature=0.8, top_p=0.9, top_k=20, max_new_tokens=100)
    alone = _steps(_sampler(), [_seq(seeded)], [s[2:3] for s in steps])[0]
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(min_p=0.2),
        seeded,
        SamplingParams(seed=3, top_k=2),
        SamplingParams(top_p=0.5, temperature=1.5),
    ]
    crowd = _steps(_sampler(), [_seq(p) for p in others], steps)
    assert crowd[2] == alone
    assert _steps(_sampler(), [_seq(seeded)], [s[2:3] for s in steps])[0] == alone
    other_seed = SamplingParams(seed=43, temperature=0.8, top_p=0.9, top_k=20)
    assert _steps(_sampler(), [_seq(other_seed)], [s[2:3] for s in steps])[0] != alone


def test_unseeded_requests_draw_distinct_keys_from_the_servers_stream():
    a, b = _sampler(), _sampler()
    keys = [a.key(None) for _ in range(100)]
    assert len(set(keys)) == 100 and all(k & UNSEEDED for k in keys)
    assert [b.key(None) for _ in range(100)] == keys  # the same server seed: the same stream
    assert a.key(5) == 5  # a seed is its own key, in the other half of the key space
    other = BatchSampler(torch.device("cpu"), V, 1000, seed=1)
    assert other.key(None) != keys[0]


@pytest.mark.parametrize(
    "params, allowed",
    [
        (SamplingParams(top_k=3), {0, 1, 2}),
        # p = 0.5, 0.3, 0.15, ...: the top-p set of 0.7 is the first two tokens
        (SamplingParams(top_p=0.7), {0, 1}),
        # min_p 0.25: p >= 0.125 keeps 0.5, 0.3, 0.15
        (SamplingParams(min_p=0.25), {0, 1, 2}),
        # top-p after top-k's renormalisation: 0.625, 0.375, so top-p 0.6 keeps one token (on
        # the raw probabilities, 0.5 before token 1 would keep two)
        (SamplingParams(top_k=2, top_p=0.6), {0}),
    ],
)
def test_truncation_keeps_only_the_allowed_tokens(params, allowed):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.04] + [0.01 / (V - 4)] * (V - 4))
    rows = [_seq(SamplingParams(**{**params.__dict__, "seed": i})) for i in range(64)]
    tokens = _steps(_sampler(), rows, [probs.log().expand(64, V)] * 20)
    drawn = {t for row in tokens for t in row}
    assert drawn == allowed


def test_stop_tokens_are_suppressed_before_min_new_tokens_and_logprobs_are_not():
    # token 0 holds nearly all the mass and is a stop token: suppressed for 3 tokens
    logits = torch.full((2, V), -10.0)
    logits[:, 0] = 10.0
    greedy = _seq(SamplingParams(temperature=0.0, min_new_tokens=3), stop_ids=(0,))
    sampled = _seq(SamplingParams(seed=1, min_new_tokens=3), stop_ids=(0, 5))
    sampler = _sampler()
    for step in range(5):
        out = sampler.sample(logits, [greedy, sampled])
        tokens, logprobs, flags = out[0], out[1], out[2]
        for s, tok in zip((greedy, sampled), tokens):
            s.out.append(int(tok))
        if step < 3:
            assert 0 not in tokens
            # the reported logprob is log_softmax of the unsuppressed logits
            ref = torch.log_softmax(logits[0], -1)[int(tokens[0])]
            assert logprobs[0] == pytest.approx(float(ref), abs=1e-6)
            assert flags == [FINITE, FINITE]
        else:
            assert tokens == [0, 0] and flags == [FINITE | STOP] * 2


def test_logprobs_are_log_softmax_of_logits_over_temperature_and_top_logprobs_asked():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, V, generator=gen) * 2
    params = [
        SamplingParams(temperature=0.7, seed=1, top_logprobs=3),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, top_k=5, top_logprobs=1),
    ]
    out = _sampler().sample(logits, [_seq(p) for p in params])
    for i, temp in enumerate([0.7, 1.0, 1.3]):  # greedy reports T = 1
        ref = torch.log_softmax(logits[i] / temp, -1)
        assert out[1][i] == pytest.approx(float(ref[int(out[0][i])]), abs=1e-6)
    assert int(out[0][1]) == int(logits[1].argmax())
    K = (len(out) - 3) // 2
    assert K == 3
    top = torch.log_softmax(logits[0] / 0.7, -1).topk(3)
    assert [int(out[3 + j][0]) for j in range(3)] == top.indices.tolist()
    reported = torch.tensor([out[6 + j][0] for j in range(3)], dtype=torch.float64)
    torch.testing.assert_close(reported, top.values.double())


def test_flags_report_non_finite_rows_and_the_length_limit():
    logits = torch.zeros(5, V)
    logits[0, 1] = 3e38  # large but finite
    for row, value in ((1, "nan"), (3, "inf"), (4, "-inf")):
        logits[row, 4] = float(value)
    seqs = [
        _seq(SamplingParams(max_new_tokens=1)),
        _seq(SamplingParams()),
        _seq(SamplingParams(max_new_tokens=50), prompt_len=9),  # context 10: one token fits
        _seq(SamplingParams(seed=1)),
        _seq(SamplingParams(temperature=0.0)),
    ]
    flags = _sampler(context_length=10).sample(logits, seqs)[2]
    assert flags == [FINITE | LENGTH, 0, FINITE | LENGTH, 0, 0]


def test_a_step_copies_to_the_host_once(monkeypatch):
    calls = []
    for name in ("tolist", "item", "__bool__", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    seqs = [
        _seq(SamplingParams(seed=1, top_p=0.9, min_new_tokens=2, top_logprobs=2), stop_ids=(3,)),
        _seq(SamplingParams(temperature=0.0)),
        _seq(SamplingParams(min_p=0.1)),
    ]
    sampler = _sampler()
    sampler.sample(torch.randn(3, V), seqs)  # builds the batch's table (host -> device only)
    calls.clear()
    sampler.sample(torch.randn(3, V), seqs)
    assert calls == ["tolist"]


def test_stop_strings_searched_on_the_tail_match_a_search_of_the_whole_text(tiny_tokenizer):
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, len(tiny_tokenizer), (400,), generator=gen).tolist()
    text = tiny_tokenizer.decode(ids)
    assert text.count(REPLACEMENT) > 10  # the random ids hold partial characters
    for stop in (text[150:153], text[300:312], text[41:42], "\x00absent\x00"):
        for min_new in (0, 120):  # stop strings are ignored before min_new tokens
            incremental = StopText((stop,), tiny_tokenizer.decode)
            hit_at = next(
                (n for n in range(1, 401) if incremental.search(ids[:n], n >= min_new)), None
            )
            whole_at = next(
                (n for n in range(max(min_new, 1), 401) if stop in tiny_tokenizer.decode(ids[:n])),
                None,
            )
            assert hit_at == whole_at, (stop, min_new)


def test_the_stop_string_decoder_returns_what_the_tokenizer_decodes(tiny_tokenizer):
    from areal.serving.stop_text import decoder

    decode = decoder(tiny_tokenizer)
    gen = torch.Generator().manual_seed(3)
    special = tiny_tokenizer.eos_token_id
    for _ in range(50):
        ids = torch.randint(0, len(tiny_tokenizer), (20,), generator=gen).tolist() + [special]
        assert decode(ids) == tiny_tokenizer.decode(ids)
    assert tiny_tokenizer.eos_token in decode([special])  # special tokens kept, as decode keeps


@pytest.mark.gpu
def test_the_sampler_on_cuda_draws_the_cpu_samplers_tokens():
    # the same logits on both devices: every knob, 40 steps; the hash is integer arithmetic, so
    # seeded draws agree unless a uniform falls within float rounding of a boundary
    gen = torch.Generator().manual_seed(4)
    steps = [torch.randn(6, V, generator=gen) * 3 for _ in range(40)]
    params = [
        SamplingParams(seed=1),
        SamplingParams(seed=2, top_p=0.8, top_k=10, temperature=0.7),
        SamplingParams(seed=3, min_p=0.1, top_logprobs=2),
        SamplingParams(temperature=0.0, min_new_tokens=5),
        SamplingParams(seed=4, min_new_tokens=3),
        SamplingParams(seed=5, temperature=1.7),
    ]
    results = {}
    for device in ("cpu", "cuda"):
        sampler = BatchSampler(torch.device(device), V, 1000, seed=0)
        seqs = [_seq(p, stop_ids=(0, 1)) for p in params]
        results[device] = _steps(sampler, seqs, [s.to(device) for s in steps])
    assert results["cuda"] == results["cpu"]


@pytest.mark.parametrize("value, ok", [(0.1, True), (1.5, False), (-0.1, False)])
def test_min_p_is_read_on_generate_and_checked(value, ok):
    from areal.api.config import from_dict
    from areal.api.config.server import GenerationServerConfig
    from areal.serving.protocol import sampling_from_sglang
    from areal.serving.requests import BadRequest

    cfg = from_dict(GenerationServerConfig, {"model_path": "unused"})
    if ok:
        assert sampling_from_sglang({"min_p": value}, cfg)[0].min_p == value
        return
    with pytest.raises(BadRequest, match=r"min_p: must be in \[0, 1\], got") as e:
        sampling_from_sglang({"min_p": value}, cfg)
    assert e.value.field == "sampling_params.min_p"


def test_a_request_its_client_cancels_leaves_the_batch_at_that_step(generator):
    import time

    futures: list[concurrent.futures.Future] = []
    seen: list[int] = []

    def on_token(tok: int) -> None:  # on the scheduler thread, before the step's finish checks
        seen.append(tok)
        if len(seen) >= 3 and futures:
            futures[0].cancel()

    params = SamplingParams(max_new_tokens=500, ignore_eos=True)
    futures += generator.submit_batch([[5, 6, 7]], [params], on_token=[on_token])
    deadline = time.monotonic() + 60
    while not futures[0].done() and time.monotonic() < deadline:
        time.sleep(0.01)
    while generator.load()["running"] and time.monotonic() < deadline:  # its slot is freed
        time.sleep(0.01)
    assert futures[0].cancelled() and generator.load()["running"] == 0
    assert 3 <= len(seen) < 10  # it ended at the step it was cancelled in (or the first after)


def test_two_server_processes_of_one_seed_draw_different_unseeded_keys():
    """The launcher gives every server of a run the same server.seed; each process's stream of
    unseeded keys must still differ (else a prompt sent to two servers gets one completion)."""
    import subprocess
    import sys

    probe = (
        "import torch; torch.manual_seed(0)\n"
        "from areal.serving.sampler import BatchSampler, process_stream_seed\n"
        "b = BatchSampler(torch.device('cpu'), 8, 16, process_stream_seed())\n"
        "print([b.key(None) for _ in range(3)])\n"
    )
    runs = [
        subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
        for _ in range(2)
    ]
    assert all(r.returncode == 0 for r in runs), [r.stderr[-500:] for r in runs]
    first, second = (r.stdout.strip() for r in runs)
    assert first != second
