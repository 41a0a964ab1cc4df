"""The prefix cache across requests: its radix of blocks and LRU (tier 1, a toy cache), and the
generator with it on vs off (tier 2, the tiny model): same tokens and logprobs, hits counted,
dropped at weight updates and memory release, bounded, reported by /metrics and /flush_cache."""

from __future__ import annotations

import asyncio
import concurrent.futures

import pytest
import torch

from areal.serving.sampling import SamplingParams

BLOCK = 4  # tokens per block in these tests (prompts of ~10-40 tokens hit whole blocks)
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)


# ------------------------------------------------------------------ tier 1: the cache alone


def _spec():
    """A 2-layer, 2-KV-head, head_dim 3 spec (no weights needed)."""
    from areal.serving.model import ModelSpec

    config = {
        "model_type": "qwen2",
        "vocab_size": 100,
        "hidden_size": 12,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    }
    return ModelSpec(config)


def _toy(max_tokens: int):
    """A prefix cache of blocks of 4 over a 4-slot KV cache whose every value names its place:
    ``layer * 10000 + slot * 1000 + position * 10 + head`` (k) and its negative (v)."""
    from areal.serving.model import KVCache
    from areal.serving.prefix_cache import PrefixCache

    spec = _spec()
    cache = KVCache(spec, 4, 64, "cpu", torch.float32)
    for i in range(spec.n_layers):
        slot = torch.arange(4)[:, None, None, None] * 1000
        head = torch.arange(2)[None, :, None, None]
        pos = torch.arange(cache.capacity)[None, None, :, None] * 10
        value = (i * 10000 + slot + pos + head).float().expand(-1, -1, -1, spec.head_dim)
        cache.k[i].copy_(value)
        cache.v[i].copy_(-value)
    return PrefixCache(spec, max_tokens, BLOCK, "cpu", torch.float32), cache


def test_match_finds_the_longest_cached_prefix_in_whole_blocks_leaving_a_token_to_prefill():
    prefix, cache = _toy(64)
    tokens = list(range(10))  # blocks [0..3], [4..7]; 8, 9 a partial block: not cached
    assert prefix.store(cache, [(1, tokens)]) == 8
    assert len(prefix.match(tokens[:8] + [50, 51])) == 2  # 8 cached, 2 to prefill
    assert len(prefix.match(tokens[:8])) == 1  # all 8 cached, but one token must be prefilled
    assert len(prefix.match(tokens[:6] + [99, 7, 60])) == 1  # block 2 differs at its 3rd token
    assert len(prefix.match([1, 0, 2, 3, 4])) == 0  # the first block differs
    assert len(prefix.match([0, 1, 2])) == 0  # shorter than a block
    # queried 10 + 8 + 9 + 5 + 3 = 35 prompt tokens; hits 8 + 4 + 4 = 16
    assert prefix.stats()["prefix_cache_query_tokens"] == 35
    assert prefix.stats()["prefix_cache_hit_tokens"] == 16


def test_load_copies_stored_rows_of_one_slot_into_another_in_every_layer():
    prefix, cache = _toy(64)
    tokens = list(range(9))
    prefix.store(cache, [(1, tokens)])  # slot 1, positions 0..7 (two blocks)
    blocks = prefix.match(tokens)
    assert len(blocks) == 2
    prefix.load(cache, [(3, blocks)])  # into slot 3
    for i in range(2):
        # slot 3 positions 0..7 now hold slot 1's values: layer*10000 + 1000 + pos*10 + head
        want = i * 10000 + 1000 + torch.arange(8)[None, :] * 10 + torch.arange(2)[:, None]
        assert torch.equal(cache.k[i][3, :, :8, 0], want.float())
        assert torch.equal(cache.v[i][3, :, :8, 0], -want.float())
        assert cache.k[i][3, 0, 8, 0] == i * 10000 + 3000 + 80  # position 8 untouched


def test_pool_holds_at_most_its_bound_and_evicts_the_least_recently_used_leaf():
    prefix, cache = _toy(3 * BLOCK)  # three blocks
    a, b = [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9]
    prefix.store(cache, [(0, a)])  # a1 -> a2
    prefix.store(cache, [(1, b + [0])])  # b1: the pool is full
    prefix.match(a + [0])  # a is now more recent than b
    prefix.store(cache, [(2, [7, 7, 7, 7])])  # evicts b1, the least recently used leaf
    assert prefix.cached_tokens == 3 * BLOCK and prefix.evicted_tokens == BLOCK
    assert len(prefix.match(b + [0])) == 0 and len(prefix.match(a + [0])) == 2
    prefix.store(cache, [(3, [6, 6, 6, 6])])  # evicts [7777], used before a's last match
    assert len(prefix.match([7, 7, 7, 7, 0])) == 0
    prefix.store(cache, [(3, [5, 5, 5, 5])])  # oldest now a1 <- a2: evicts a2 (a leaf), not a1
    assert len(prefix.match(a + [0])) == 1 and len(prefix.match([6, 6, 6, 6, 0])) == 1
    assert prefix.n_blocks == 3  # the pool never grew past its bound


def test_store_keeps_what_fits_when_its_own_entries_fill_the_pool():
    prefix, cache = _toy(2 * BLOCK)
    assert prefix.store(cache, [(0, list(range(12)))]) == 2 * BLOCK  # 3 blocks, 2 fit
    assert len(prefix.match(list(range(13)))) == 2


def test_clear_drops_every_entry_and_a_request_from_before_is_not_stored():
    from areal.serving.requests import Seq

    prefix, cache = _toy(64)
    seq = Seq(list(range(8)), GREEDY, concurrent.futures.Future(), frozenset())
    seq.out = [8, 9]
    prefix.prefilled(cache, [seq], [], 0)  # stamped with epoch 0, prompt stored
    assert prefix.clear() == 8 and prefix.cached_tokens == 0 and prefix.epoch == 1
    prefix.retire(cache, seq, 0)  # its rows come from before the clear (old weights)
    assert prefix.cached_tokens == 0
    assert prefix.release() > 0 and prefix.n_blocks == 0


# ------------------------------------------------------------------ tier 2: the generator


@pytest.fixture(scope="module")
def gens(tiny_model_dir):
    """Two generators of the tiny model: the prefix cache on (blocks of 4) and off."""
    from areal.serving.generator import Generator

    on = Generator.from_pretrained(
        tiny_model_dir, max_batch_size=8, prefix_cache_tokens=4096, prefix_cache_block=BLOCK
    ).start()
    off = Generator.from_pretrained(tiny_model_dir, max_batch_size=8, prefix_cache_tokens=0)
    off.start()
    yield on, off
    on.shutdown()
    off.shutdown()


def _same(a, b) -> None:
    """Equal tokens, logprobs within 1e-6 (fp32 rounding of a different summation order)."""
    assert [r.output_ids for r in a] == [r.output_ids for r in b]
    for x, y in zip(a, b):
        torch.testing.assert_close(
            torch.tensor(x.output_logprobs), torch.tensor(y.output_logprobs), atol=1e-6, rtol=0
        )


def _hits(gen) -> int:
    return gen.load()["prefix_cache_hit_tokens"]


def _one_by_one(gen, prompts, params) -> list:
    """Each request submitted after the previous one finished (separate admissions)."""
    return [gen.generate([p], q)[0] for p, q in zip(prompts, params)]


def test_grpo_group_sent_as_separate_requests_hits_and_matches_cache_off(gens):
    on, off = gens
    prompt = [(11 * j) % 250 for j in range(23)]  # 5 whole blocks to reuse, 3 tokens to prefill
    params = [
        SamplingParams(max_new_tokens=8, temperature=1.0, seed=s, ignore_eos=True) for s in range(8)
    ]
    before = _hits(on)
    results = _one_by_one(on, [prompt] * 8, params)
    _same(results, _one_by_one(off, [prompt] * 8, params))
    assert _hits(on) - before == 7 * 20  # each later sample reused the 20 tokens of 5 blocks
    assert 0 < on.load()["prefix_cache_hit_rate"] <= 1
    assert "prefix_cache_hit_tokens" not in off.load()  # off: no counters


def test_second_turn_extending_the_first_reuses_its_prompt_and_output(gens):
    on, off = gens
    turn1 = [(7 * j + 3) % 250 for j in range(13)]
    first_on, first_off = on.generate([turn1], GREEDY)[0], off.generate([turn1], GREEDY)[0]
    _same([first_on], [first_off])
    turn2 = turn1 + first_on.output_ids + [42, 43, 44]  # 13 + 8 + 3 = 24 tokens
    before = _hits(on)
    _same([on.generate([turn2], GREEDY)[0]], [off.generate([turn2], GREEDY)[0]])
    # cached: turn 1's prompt and output but its last token (20 tokens: 5 blocks of 4)
    assert _hits(on) - before == 20


def test_partially_overlapping_prompts_reuse_the_shared_blocks_only(gens):
    on, off = gens
    shared = [(5 * j + 1) % 250 for j in range(10)]  # 2 whole blocks and 2 tokens
    prompts = [shared + [1, 2, 3, 4, 5], shared + [9, 8], shared[:6] + [0] * 9]
    before = _hits(on)
    _same(_one_by_one(on, prompts, [GREEDY] * 3), _one_by_one(off, prompts, [GREEDY] * 3))
    # the 2nd reuses 8 tokens (the 1st's blocks 1-2; block 3 differs), the 3rd 4 (block 1)
    assert _hits(on) - before == 8 + 4


def test_a_tiny_pool_evicts_and_outputs_stay_right(tiny_model_dir, gens):
    from areal.serving.generator import Generator

    _, off = gens
    tiny = Generator.from_pretrained(
        tiny_model_dir, max_batch_size=4, prefix_cache_tokens=3 * BLOCK, prefix_cache_block=BLOCK
    ).start()
    try:
        # each prompt twice in a row: the second reuses 2 blocks, then the others evict them
        prompts = [[(13 * j + 7 * i) % 250 for j in range(11)] for i in range(4) for _ in "ab"]
        _same(_one_by_one(tiny, prompts, [GREEDY] * 8), _one_by_one(off, prompts, [GREEDY] * 8))
        stats = tiny.load()
        assert stats["prefix_cache_evicted_tokens"] > 0
        assert stats["prefix_cache_tokens"] <= 3 * BLOCK
        assert stats["prefix_cache_hit_tokens"] == 4 * 2 * BLOCK
    finally:
        tiny.shutdown()


def test_a_weight_update_drops_the_cache_so_the_same_prompt_sees_the_new_weights(
    tiny_model_dir, other_model_dir
):
    from areal.serving.generator import Generator

    gen = Generator.from_pretrained(
        tiny_model_dir, prefix_cache_tokens=4096, prefix_cache_block=BLOCK
    ).start()
    fresh = Generator.from_pretrained(other_model_dir, prefix_cache_tokens=0).start()
    try:
        prompt = [(3 * j + 2) % 250 for j in range(17)]
        sampled = SamplingParams(max_new_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
        gen.generate([prompt], sampled)
        assert gen.load()["prefix_cache_tokens"] > 0
        hits = _hits(gen)
        gen.update_weights_from_disk(other_model_dir)
        _same(gen.generate([prompt], [sampled]), fresh.generate([prompt], [sampled]))
        assert _hits(gen) == hits  # nothing computed under the old weights was reused
        gen.pause()
        assert gen.release_memory() > 0
        assert gen.load()["prefix_cache_tokens"] == 0
        gen.resume_memory()
        gen.resume()
        _same(gen.generate([prompt], [sampled]), fresh.generate([prompt], [sampled]))
    finally:
        gen.shutdown()
        fresh.shutdown()


def test_metrics_report_the_hit_rate_and_flush_cache_empties_it(tiny_model_dir):
    from aiohttp.test_utils import TestClient, TestServer

    from areal.api.config import from_dict
    from areal.api.config.server import GenerationServerConfig
    from areal.serving.server import GenerationServer

    cfg = {"model_path": str(tiny_model_dir), "prefix_cache_block": BLOCK}
    srv = GenerationServer(from_dict(GenerationServerConfig, cfg))
    srv.generator.start()
    body = {"input_ids": list(range(30, 50)), "sampling_params": {"max_new_tokens": 2}}

    async def script(client):
        for _ in range(2):
            assert (await client.post("/generate", json=body)).status == 200
        metrics = await (await client.get("/metrics")).text()
        flushed = await (await client.post("/flush_cache")).json()
        after = await (await client.get("/metrics")).text()
        return metrics, flushed, after

    async def main():
        async with TestClient(TestServer(srv.build_app(), host="127.0.0.1")) as client:
            return await script(client)

    try:
        metrics, flushed, after = asyncio.run(main())
    finally:
        srv.generator.shutdown()
    values = dict(line.split() for line in metrics.splitlines() if not line.startswith("#"))
    assert "# TYPE areal:prefix_cache_hit_tokens counter" in metrics
    assert float(values["areal:prefix_cache_hit_tokens"]) == 16  # 2nd request: 4 of 5 blocks
    assert float(values["areal:prefix_cache_query_tokens"]) == 40
    assert float(values["areal:prefix_cache_hit_rate"]) == 0.4
    assert flushed["success"] and flushed["flushed_tokens"] > 0
    assert "areal:prefix_cache_tokens 0\n" in after


def test_a_request_failed_by_nan_leaves_no_cached_block_behind(tiny_model_dir, gens):
    from areal.serving.generator import Generator

    _, off = gens
    gen = Generator.from_pretrained(
        tiny_model_dir, max_batch_size=2, prefix_cache_tokens=4096, prefix_cache_block=BLOCK
    ).start()
    prompt = [(9 * j + 4) % 250 for j in range(18)]
    real = gen.model.step

    def poisoned(tokens, positions, prompts, cache, *starts):  # the prompt's keys/values go NaN
        logits = real(tokens, positions, prompts, cache, *starts)
        for t in cache.k + cache.v:
            t[tokens.shape[0] :] = float("nan")
        logits[tokens.shape[0] :] = float("nan")
        return logits

    try:
        gen.model.step = poisoned
        with pytest.raises(Exception, match="non-finite logits"):
            gen.generate([prompt], GREEDY, timeout=60)
        gen.model.step = real
        assert gen.load()["prefix_cache_tokens"] == 0  # its prompt's NaN blocks were dropped
        _same(gen.generate([prompt], GREEDY), off.generate([prompt], GREEDY))
    finally:
        gen.shutdown()


def test_stats_log_writes_a_line_per_interval_only_when_requests_were_admitted(caplog):
    from areal.serving.metrics import StatsLog, render

    load = {"running": 1, "waiting": 0, "admitted_requests": 5, "prefix_cache_hit_tokens": 3}
    load |= {"prefix_cache_query_tokens": 4, "prefix_cache_hit_rate": 0.75}
    load |= {"prefix_cache_tokens": 16, "prefix_cache_capacity_tokens": 64}
    log = StatsLog(10.0)
    with caplog.at_level("INFO", logger="areal.serve"):
        assert not log.tick(100.0, load)  # the first interval starts now
        assert not log.tick(105.0, load)  # 5 s < 10 s
        assert log.tick(110.0, load)
        assert not log.tick(125.0, load)  # nothing admitted since the last line
        assert log.tick(126.0, {**load, "admitted_requests": 6})
    assert "prefix cache hit rate 75.0% (3 of 4 prompt tokens), holds 16 of 64" in caplog.text
    assert not StatsLog(0.0).tick(1e9, load)  # 0: never
    assert "areal:prefix_cache_hit_rate 0.75\n" in render(load)
    assert "areal:prefix_cache" not in render({"running": 0, "waiting": 0})  # off: not listed
