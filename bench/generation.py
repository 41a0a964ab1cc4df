"""Tokens/s of the embedded continuous-batching generator vs Hugging Face ``model.generate``.

Run: ``python bench/generation.py [--sizes tiny small] [--threads 2] [--repeats 2]``. Prints, per
model size:

(a) uniform: 64 prompts of 32 tokens, 16 new tokens each (EOS ignored), one batch of 64 on both
    sides. Target ratio >= 1.0x.
(b) mixed: 256 requests, prompts of 16..64 tokens, ``max_new_tokens`` drawn from 4..128, EOS
    allowed, greedy. Ours: all submitted at once, at most 64 running. Baseline: HF generate in
    static batches of 64 in arrival order (left-padded), each batch running until its longest
    request ends. Only useful tokens count on both sides (up to each request's own limit or its
    first EOS). Target ratio >= 2.5x.

Each side runs in its own fresh process with the same thread count, as it would be deployed:
ours like ``areal serve`` (model compute on the generator thread, the main thread single-threaded),
HF in the main thread. Each figure is the best of ``--repeats`` runs (the least disturbed one on
a shared host). Ratios are measured in one run on the same machine; absolute numbers depend on
the host.
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

import torch

from areal.engine.generation.generator import Generator
from areal.engine.generation.sampling import SamplingParams
from areal.utils.tiny_model import build_tiny_model

BATCH = 64


def _workloads(rng: random.Random) -> dict[str, tuple[list[list[int]], list[int], bool]]:
    """name -> (prompts, max_new_tokens per prompt, ignore_eos)."""
    uniform = [[rng.randrange(256) for _ in range(32)] for _ in range(BATCH)]
    mixed = [[rng.randrange(256) for _ in range(rng.randint(16, 64))] for _ in range(256)]
    return {
        "(a) 64 x 16 uniform": (uniform, [16] * BATCH, True),
        "(b) 256 mixed 4..128": (mixed, [rng.randint(4, 128) for _ in range(256)], False),
    }


def _hf_generate(model, prompts: list[list[int]], max_new: int, pad_id: int, ignore_eos: bool):
    """Left-padded batch greedy generate; returns the generated ids per prompt."""
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, P - len(p) :] = torch.tensor(p)
        mask[i, P - len(p) :] = 1
    kwargs = dict(max_new_tokens=max_new, do_sample=False, pad_token_id=pad_id)
    if ignore_eos:
        kwargs.update(min_new_tokens=max_new)  # EOS suppressed: every row runs max_new
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, **kwargs)
    return out[:, P:].tolist()


def _useful(tokens: list[int], limit: int, eos: int | None) -> int:
    """Tokens a request really wanted: up to its own limit, through its first EOS."""
    tokens = tokens[:limit]
    return tokens.index(eos) + 1 if eos is not None and eos in tokens else len(tokens)


def run_hf(model_dir: str, work, threads: int, repeats: int) -> float:
    """Child process: best tokens/s of HF generate in static batches of 64."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    prompts, limits, ignore_eos = work
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = model.generation_config.pad_token_id
    eos = None if ignore_eos else model.generation_config.eos_token_id
    _hf_generate(model, prompts[:4], 2, pad, ignore_eos)  # warm-up
    best = 0.0
    for _ in range(repeats):
        t0, useful = time.perf_counter(), 0
        for b in range(0, len(prompts), BATCH):
            batch, lims = prompts[b : b + BATCH], limits[b : b + BATCH]
            outs = _hf_generate(model, batch, max(lims), pad, ignore_eos)
            useful += sum(_useful(o, n, eos) for o, n in zip(outs, lims))
        best = max(best, useful / (time.perf_counter() - t0))
    return best


def run_ours(model_dir: str, work, threads: int, repeats: int) -> float:
    """Child process: best tokens/s of our generator, everything submitted at once."""
    torch.set_num_threads(1)  # as `areal serve`: compute threads belong to the generator thread
    prompts, limits, ignore_eos = work
    gen = Generator.from_pretrained(model_dir, max_batch_size=BATCH, num_threads=threads).start()
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=ignore_eos) for n in limits]
    gen.generate(prompts[:4], params[:4])  # warm-up
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = gen.generate(prompts, params)
        best = max(best, sum(len(r.output_ids) for r in res) / (time.perf_counter() - t0))
    gen.shutdown()
    return best


def _in_fresh_process(fn, *args) -> float:
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(fn, *args).result()


def main() -> None:
    """Build each model size, run both cases, print tokens/s and ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {args.threads} threads, fp32 CPU")
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            model_dir = str(build_tiny_model(f"{tmp}/{size}", size=size, seed=0))
            for (name, work), target in zip(_workloads(random.Random(0)).items(), (1.0, 2.5)):
                ours = _in_fresh_process(run_ours, model_dir, work, args.threads, args.repeats)
                hf = _in_fresh_process(run_hf, model_dir, work, args.threads, args.repeats)
                print(
                    f"{size:5s} {name:22s} ours {ours:8.0f} tok/s  hf {hf:8.0f} tok/s  "
                    f"ratio {ours / hf:5.2f}x (target >= {target}x)",
                    flush=True,
                )


if __name__ == "__main__":
    main()
