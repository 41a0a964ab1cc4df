"""The prefix cache's hit case: GRPO groups of 8 samples per prompt sent as separate requests,
the generator with the prefix cache on vs off, measured in the same run.

Run: ``python bench/prefix_cache.py [--size tiny] [--prompts 16] [--samples 8]
[--prompt-len 256] [--new-tokens 16] [--max-batch 32] [--repeats 4] [--threads 2]``.

Workload: ``--prompts`` random prompts of ``--prompt-len`` tokens, ``--samples`` requests each
(seeded, T=1, EOS ignored, ``--new-tokens`` each), submitted one request at a time in the order
a rollout client interleaving its groups sends them (sample 0 of every prompt, then sample 1, ...),
all queued at once with at most ``--max-batch`` running. Requests admitted in one step with the
same prompt share its prefill either way (``server.share_prompts``); the prefix cache adds the
samples admitted in later steps, which with it on prefill only the prompt's last partial block.
Prints tokens/s with the cache on and off (best of ``--repeats``, runs alternating), their ratio,
the hit rate and whether both sides generated the same tokens. :func:`compare` is also
``bench/gpu.py``'s ``prefix`` stage.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from areal.serving.generator import Generator  # noqa: E402
from areal.serving.sampling import SamplingParams  # noqa: E402
from areal.utils.tiny_model import build_tiny_model  # noqa: E402

PROMPT_VOCAB = 256  # byte tokens


def workload(
    n_prompts: int, samples: int, prompt_len: int, new_tokens: int, seed: int = 0
) -> tuple[list[list[int]], list[SamplingParams]]:
    """The requests in submission order: sample ``s`` of every prompt before sample ``s + 1``."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(PROMPT_VOCAB) for _ in range(prompt_len)] for _ in range(n_prompts)]
    batch, params = [], []
    for s in range(samples):
        for i, prompt in enumerate(prompts):
            batch.append(prompt)
            params.append(
                SamplingParams(
                    max_new_tokens=new_tokens,
                    temperature=1.0,
                    seed=i * samples + s,
                    ignore_eos=True,
                )
            )
    return batch, params


def _run(gen: Generator, batch: list[list[int]], params: list[SamplingParams]):
    """Submit one request at a time (separate admissions), wait for all: (tok/s, outputs)."""
    t = time.perf_counter()
    futures = [gen.submit(p, q) for p, q in zip(batch, params)]
    results = [f.result(timeout=3600) for f in futures]
    seconds = time.perf_counter() - t
    return sum(len(r.output_ids) for r in results) / seconds, [r.output_ids for r in results]


def compare(
    model_dir: str,
    work: tuple[list[list[int]], list[SamplingParams]],
    *,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    max_batch: int = 32,
    repeats: int = 3,
    prefix_cache_tokens: int = 65536,
    num_threads: int = 0,
) -> dict[str, float | bool]:
    """Best tok/s with the prefix cache on and off (runs alternating, which side goes first
    too, each cache flushed before its run), their ratio, the hit rate of the on side's last
    run, and whether both sides generated the same tokens."""
    batch, params = work
    context = max(len(p) for p in batch) + max(q.max_new_tokens for q in params) + 1
    kwargs = dict(
        device=device, dtype=dtype, max_batch_size=max_batch, context_length=context,
        num_threads=num_threads,
    )  # fmt: skip
    sides = {
        "on": Generator.from_pretrained(
            model_dir, prefix_cache_tokens=prefix_cache_tokens, **kwargs
        ),
        "off": Generator.from_pretrained(model_dir, prefix_cache_tokens=0, **kwargs),
    }
    best = {"on": 0.0, "off": 0.0}
    outputs: dict[str, list[list[int]]] = {}
    try:
        for gen in sides.values():
            gen.start().generate(batch[:4], params[:4])  # warm-up
        hit_rate = 0.0
        for r in range(repeats):
            # the second side of a pair measured faster here, whichever it was: alternate
            for name in ("on", "off") if r % 2 == 0 else ("off", "on"):
                gen = sides[name]
                gen.flush_cache()  # every run starts cold: hits come from within the run
                before = gen.load()
                tps, outputs[name] = _run(gen, batch, params)
                best[name] = max(best[name], tps)
                if name == "on":
                    after = gen.load()
                    hits = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
                    queried = (
                        after["prefix_cache_query_tokens"] - before["prefix_cache_query_tokens"]
                    )
                    hit_rate = float(hits) / max(float(queried), 1.0)
    finally:
        for gen in sides.values():
            gen.shutdown()
    return {
        "on_tok_s": best["on"],
        "off_tok_s": best["off"],
        "ratio": best["on"] / best["off"],
        "hit_rate": hit_rate,
        "same_outputs": outputs["on"] == outputs["off"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="tiny", help="tiny-model size (areal.utils.tiny_model)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)  # as `areal serve`: compute threads belong to the generator thread
    work = workload(args.prompts, args.samples, args.prompt_len, args.new_tokens)
    print(
        f"torch {torch.__version__}, {args.threads} threads, fp32 CPU, {args.size} model; "
        f"{args.prompts} prompts x {args.samples} samples, prompt {args.prompt_len} tokens, "
        f"{args.new_tokens} new tokens, at most {args.max_batch} running",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_tiny_model(f"{tmp}/{args.size}", size=args.size, seed=0))
        r = compare(
            model_dir, work, max_batch=args.max_batch, repeats=args.repeats,
            num_threads=args.threads,
        )  # fmt: skip
    print(
        f"prefix cache on {r['on_tok_s']:8.0f} tok/s  off {r['off_tok_s']:8.0f} tok/s  "
        f"ratio {r['ratio']:5.2f}x  hit rate {r['hit_rate']:.1%}  "
        f"same outputs: {'yes' if r['same_outputs'] else 'NO'}",
        flush=True,
    )


if __name__ == "__main__":
    main()
