"""Training throughput: packed token-budget micro-batches vs padded fixed-size batches.

One run on the ~25M 'small' model with a long-tail (log-normal) length distribution prints:

- tokens/s of ``FSDPEngine.train_batch`` (packed, token budget, varlen attention) and of a plain
  padded loop (fixed number of sequences per batch, each padded to its longest, SDPA with a
  padding mask), counting real tokens only, and their ratio (target >= 1.5x);
- this machine's fp32 matmul peak, measured here, and the packed run's achieved FLOP/s as a
  fraction of it (target >= 40%). FLOPs = 6 * matmul params * tokens + causal attention
  (6 * 2 * L^2 * hidden per layer and sequence: QK^T and AV, forward + backward, half masked).

Usage: python bench/train.py [--n-seqs 48] [--budget 4096] [--pad-batch 8] [--steps 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from areal.algo.logprob import packed_token_logprobs
from areal.api.config.base import MicroBatchSpec, OptimizerConfig
from areal.api.config.engine import TrainEngineConfig
from areal.engine.fsdp import FSDPEngine
from areal.runtime.dist import init_distributed
from areal.utils.batch import PackedBatch
from areal.utils.tiny_model import build_tiny_model


def long_tail_lengths(n: int, seed: int, lo: int = 16, hi: int = 1024) -> list[int]:
    """Log-normal lengths (median ~90 tokens, a few near ``hi``), clipped to [lo, hi]."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.exp(torch.randn(n, generator=g) * 0.9 + 4.5)
    return raw.clamp(lo, hi).long().tolist()


def matmul_peak(n: int = 2048, reps: int = 5) -> float:
    """fp32 FLOP/s of a square matmul on this machine, best of ``reps``."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def model_flops(lengths: list[int], cfg) -> float:
    """Training FLOPs of one pass over sequences of ``lengths`` (see module docstring)."""
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    kv = h // cfg.num_attention_heads * cfg.num_key_value_heads
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * inter  # q, o, k, v, gate/up/down
    matmul_params = layers * per_layer + h * cfg.vocab_size  # + lm head
    tokens = sum(lengths)
    attention = sum(6 * 2 * n * n * h * layers for n in lengths) / 2
    return 6 * matmul_params * tokens + attention


def nll(logits, mb):
    logp, _ = packed_token_logprobs(logits, mb["input_ids"], mb.cu_seqlens)
    return -logp.sum() / max(1, mb.n_tokens - mb.n_seqs), {}


def run_packed(path: str, batch: PackedBatch, budget: int, steps: int) -> float:
    """Seconds per train_batch over the whole batch (after one warm-up step)."""
    cfg = TrainEngineConfig(
        path=path,
        mb_spec=MicroBatchSpec(max_tokens_per_mb=budget),
        optimizer=OptimizerConfig(lr=1e-5),
    )
    engine = FSDPEngine(cfg, init_distributed().mesh)  # one process: a 1-rank mesh
    engine.initialize(None)

    def weight(mb: PackedBatch) -> float:
        return float(mb.n_tokens - mb.n_seqs)

    engine.train_batch(batch, nll, weight)
    t = time.perf_counter()
    for _ in range(steps):
        engine.train_batch(batch, nll, weight)
    engine.destroy()
    return (time.perf_counter() - t) / steps


def run_padded(path: str, batch: PackedBatch, pad_batch: int, steps: int) -> float:
    """Seconds per pass of a plain padded loop: fixed-size batches, one optimizer step each pass."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    chunks = [
        batch.select(range(i, min(i + pad_batch, batch.n_seqs)))
        for i in range(0, batch.n_seqs, pad_batch)
    ]

    def one_pass() -> None:
        for chunk in chunks:
            padded, mask = chunk.to_padded()
            ids = padded["input_ids"]
            logits = model(input_ids=ids, attention_mask=mask.long()).logits  # [B, L, V]
            logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
            (-(logp * mask[:, 1:]).sum() / batch.n_tokens).backward()
        opt.step()
        opt.zero_grad()

    one_pass()
    t = time.perf_counter()
    for _ in range(steps):
        one_pass()
    return (time.perf_counter() - t) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-seqs", type=int, default=48)
    p.add_argument("--budget", type=int, default=4096, help="packed tokens per micro-batch")
    p.add_argument("--pad-batch", type=int, default=8, help="sequences per padded batch")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    from transformers import AutoConfig

    with tempfile.TemporaryDirectory() as tmp:
        path = str(build_tiny_model(tmp, size="small", seed=0))
        hf_cfg = AutoConfig.from_pretrained(path)
        lengths = long_tail_lengths(args.n_seqs, args.seed)
        g = torch.Generator().manual_seed(args.seed)
        ids = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]
        batch = PackedBatch.from_sequences({"input_ids": ids})
        peak = matmul_peak()
        t_packed = run_packed(path, batch, args.budget, args.steps)
        t_padded = run_padded(path, batch, args.pad_batch, args.steps)
        peak = max(peak, matmul_peak())  # measured before and after: the better one
    tokens = batch.n_tokens
    flops = model_flops(lengths, hf_cfg)
    print(
        f"threads={torch.get_num_threads()} seqs={args.n_seqs} tokens={tokens} "
        f"lengths min/median/max={min(lengths)}/{sorted(lengths)[len(lengths) // 2]}/{max(lengths)}"
    )
    print(f"packed (budget {args.budget}): {tokens / t_packed:,.0f} tokens/s")
    print(f"padded (batch {args.pad_batch}):  {tokens / t_padded:,.0f} tokens/s")
    print(f"packed / padded speed-up: {t_padded / t_packed:.2f}x (target >= 1.5x)")
    print(
        f"fp32 matmul peak: {peak / 1e9:,.1f} GFLOP/s; packed "
        f"achieved {flops / t_packed / 1e9:,.1f} GFLOP/s = {flops / t_packed / peak:.0%} of peak "
        "(target >= 40%)"
    )


if __name__ == "__main__":
    main()
