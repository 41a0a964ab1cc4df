"""Decode-step cost of structured outputs: the grammar mask at 64 concurrent requests vs none.

Run: ``python bench/structured.py [--size tiny|small] [--threads 2] [--repeats 5] [--device cpu]``.
One generator (``max_batch_size=64``), 64 prompts of 16 tokens, 64 new tokens each, greedy, EOS
ignored, in these batches:

- free: no request constrained (the path every unconstrained request takes);
- constrained: all 64 follow a JSON schema (an array of at least 100 integers, so none ends
  before 64 tokens), each step computing 64 masks and feeding 64 matchers;
- mixed: 32 free + 32 constrained.

Each figure is the best of ``--repeats`` runs (runs of the three alternate, so host noise hits
them alike); a step is the batch's wall time / 64. Overhead = constrained / free - 1 (target
<= 10% on CPU). On a busy shared host the end-to-end figures swing by more than the mask costs,
so the bench also times the constraint work itself (``mask_logits`` and ``advance``, wrapped
with counters) and reports it per step against the free step. What a free request pays is the
per-step check ``any(guide is not None)`` over the batch, timed separately.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import timeit

import torch
from transformers import AutoTokenizer

import areal.serving.generator as generator_module
from areal.serving.constraints import Constraint, GrammarCompiler, GrammarLimits, compile_guides
from areal.serving.generator import Generator
from areal.serving.requests import Seq
from areal.serving.sampling import SamplingParams
from areal.utils.tiny_model import build_tiny_model

BATCH, NEW = 64, 64
SCHEMA = '{"type": "array", "items": {"type": "integer"}, "minItems": 100}'


SPENT = {"seconds": 0.0}  # time inside the constraint path, summed over a run


def timed(fn):
    """``fn`` adding its wall time to SPENT."""

    def wrapper(*args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            SPENT["seconds"] += time.perf_counter() - t0

    return wrapper


def run(gen: Generator, compiler: GrammarCompiler, n_constrained: int) -> float:
    """Seconds for one batch of BATCH requests, the first ``n_constrained`` constrained."""
    prompts = [[(7 * i + j) % 250 for j in range(16)] for i in range(BATCH)]
    params = [SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)] * BATCH
    guides = (
        asyncio.run(
            compile_guides(compiler, [Constraint("json_schema", SCHEMA, "bench")] * n_constrained)
        )
        if n_constrained
        else []
    )
    t0 = time.perf_counter()
    futures = gen.submit_batch(prompts, params, guides=guides + [None] * (BATCH - n_constrained))
    results = [f.result(600) for f in futures]
    elapsed = time.perf_counter() - t0
    assert all(len(r.output_ids) == NEW for r in results), "a request ended early"
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(1)  # as areal serve: model compute on the generator thread only
    path = build_tiny_model(tempfile.mkdtemp(), size=args.size)
    tok = AutoTokenizer.from_pretrained(path)
    gen = Generator.from_pretrained(
        path, device=args.device, max_batch_size=BATCH, num_threads=args.threads
    ).start()
    compiler = GrammarCompiler(
        tok,
        gen.model.spec.vocab_size,
        sorted(gen.eos_token_ids),
        GrammarLimits(100_000, 10.0, 1_000_000, 16, 1, 4),
    )
    try:
        cases = {"free": 0, "mixed": BATCH // 2, "constrained": BATCH}
        for n in cases.values():  # warm-up: kernels, caches, the compiled grammar
            run(gen, compiler, n)
        best = {k: float("inf") for k in cases}
        generator_module.mask_logits = timed(generator_module.mask_logits)
        generator_module.advance = timed(generator_module.advance)
        work = float("inf")
        for _ in range(args.repeats):
            for k, n in cases.items():
                SPENT["seconds"] = 0.0
                best[k] = min(best[k], run(gen, compiler, n))
                if k == "constrained":
                    work = min(work, SPENT["seconds"])
    finally:
        gen.shutdown()
    seqs = [Seq([1], SamplingParams(), None, frozenset(), None) for _ in range(BATCH)]  # type: ignore[arg-type]
    check = (
        min(timeit.repeat(lambda: any(s.guide is not None for s in seqs), number=1000, repeat=5))
        / 1000
    )
    free_step = best["free"] / NEW
    print(
        f"model={args.size} device={args.device} threads={args.threads} batch={BATCH} "
        f"new_tokens={NEW}"
    )
    for k in cases:
        print(
            f"  {k:12s} {best[k] / NEW * 1e3:7.2f} ms/step  ({best[k] / best['free'] - 1:+.1%} vs "
            "free)"
        )
    print(
        f"  mask + advance, 64 constrained rows: {work / NEW * 1e3:.2f} ms/step "
        f"= {work / best['free']:.1%} of a free step"
    )
    print(
        f"  free requests' check per step: {check * 1e6:.1f} us = {check / free_step:.3%} of a "
        "free step"
    )


if __name__ == "__main__":
    main()
