"""FSDP2 engine (tier 2): packed forward, micro-batch accumulation, multi-process equivalence."""

from __future__ import annotations

import os

import pytest
import torch

from areal.algo.logprob import packed_token_logprobs
from areal.api.config.base import MicroBatchSpec, OptimizerConfig
from areal.api.config.engine import TrainEngineConfig
from areal.engine.fsdp import FSDPEngine
from areal.runtime.dist import init_distributed
from areal.utils.batch import PackedBatch, balance_across_ranks
from areal.utils.network import free_port
from tests.ranks import run_ranks

pytestmark = pytest.mark.slow
LENGTHS = [7, 19, 3, 12, 25, 9, 16, 5]


def random_batch(lengths=LENGTHS, seed=0, vocab=256) -> PackedBatch:
    """Random sequences with a loss mask that skips each sequence's first two tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    masks = [[0, 0] + [1] * (n - 2) for n in lengths]
    return PackedBatch.from_sequences({"input_ids": ids, "loss_mask": masks})


def nll_loss(logits, mb):
    """Token-mean NLL over loss_mask tokens of the micro-batch (weighted by their count)."""
    logp, _ = packed_token_logprobs(logits, mb["input_ids"], mb.cu_seqlens)
    mask = mb["loss_mask"].float()
    return -(logp * mask).sum() / mask.sum().clamp(min=1), {"n_masked": float(mask.sum())}


def n_loss_tokens(mb) -> float:
    return float(mb["loss_mask"].sum())


# AdamW with eps >> |grad| is SGD with step lr/eps: parameters then follow the gradients linearly
# (a wrongly scaled gradient shows), where Adam's first step would only keep their signs, which
# flip under float noise for gradients near zero.
LINEAR_ADAM = OptimizerConfig(lr=1e-2, eps=1.0)


def world_mesh():
    """The data-parallel mesh over this process's job (one rank unless launched with more)."""
    return init_distributed("gloo").mesh


def make_engine(
    path, mb_spec=MicroBatchSpec(), optimizer=LINEAR_ADAM, mesh=None, **kw
) -> FSDPEngine:
    cfg = TrainEngineConfig(path=path, mb_spec=mb_spec, optimizer=optimizer, **kw)
    engine = FSDPEngine(cfg, mesh if mesh is not None else world_mesh())
    engine.initialize(None)
    return engine


def train_and_snapshot(path, batch, mb_spec, steps=1, **kw) -> tuple[dict, list[dict]]:
    engine = make_engine(path, mb_spec, **kw)
    stats = [engine.train_batch(batch, nll_loss, n_loss_tokens) for _ in range(steps)]
    state = {k: v.clone() for k, v in engine.full_state_dict().items()}
    engine.destroy()
    return state, stats


def assert_states_close(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= atol, f"max parameter difference {worst} > {atol}"


def set_dist_env(rank: int, world_size: int, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)


# ------------------------------------------------------------------------------------ tests


def test_packed_logprobs_match_padded_hf_forward(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    batch = random_batch()
    engine = make_engine(tiny_model_dir, MicroBatchSpec(max_tokens_per_mb=40))

    def hook(logits, mb):
        return packed_token_logprobs(logits, mb["input_ids"], mb.cu_seqlens)[0]

    packed = engine.forward(batch, hook)  # [T]
    engine.destroy()

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa").eval()
    padded, mask = batch.to_padded()
    with torch.no_grad():
        logits = model(
            input_ids=padded["input_ids"], attention_mask=mask.long()
        ).logits  # [B, L, V]
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, padded["input_ids"][:, 1:, None])[
        ..., 0
    ]
    logp = torch.cat([torch.zeros(len(LENGTHS), 1), logp], 1)  # first token has none
    reference = logp[mask]
    assert packed.shape == reference.shape
    assert (packed - reference).abs().max().item() < 1e-5


def test_microbatched_accumulation_equals_one_large_batch(tiny_model_dir):
    batch = random_batch()
    whole, stats_whole = train_and_snapshot(tiny_model_dir, batch, MicroBatchSpec())
    split, stats_split = train_and_snapshot(
        tiny_model_dir, batch, MicroBatchSpec(max_tokens_per_mb=30)
    )
    assert stats_whole[0]["n_mbs"] == 1 and stats_split[0]["n_mbs"] >= 4
    assert stats_split[0]["loss"] == pytest.approx(stats_whole[0]["loss"], abs=1e-5)
    assert stats_split[0]["grad_norm"] == pytest.approx(stats_whole[0]["grad_norm"], rel=1e-5)
    assert_states_close(whole, split, atol=1e-6)


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_activation_checkpointing_gives_the_same_step(tiny_model_dir, policy):
    batch = random_batch(LENGTHS[:4])
    plain, _ = train_and_snapshot(tiny_model_dir, batch, MicroBatchSpec())
    ckpt, _ = train_and_snapshot(
        tiny_model_dir, batch, MicroBatchSpec(), activation_checkpointing=policy
    )
    assert_states_close(plain, ckpt, atol=1e-6)


def test_non_finite_grad_norm_skips_the_step(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    before = {k: v.clone() for k, v in engine.full_state_dict().items()}

    def nan_loss(logits, mb):
        return nll_loss(logits, mb)[0] * float("nan"), {}

    stats = engine.train_batch(random_batch(LENGTHS[:3]), nan_loss, n_loss_tokens)
    after = engine.full_state_dict()
    engine.destroy()
    assert stats["update_skipped"] == 1.0 and not torch.isfinite(torch.tensor(stats["grad_norm"]))
    assert all(torch.equal(before[k], after[k]) for k in before)


def _two_rank_step(rank: int, path: str, port: int, out: str) -> None:
    set_dist_env(rank, 2, port)
    batch = random_batch()
    mine = batch.select(balance_across_ranks(batch, 2)[rank])
    engine = make_engine(path, MicroBatchSpec(max_tokens_per_mb=30))
    stats = engine.train_batch(mine, nll_loss, n_loss_tokens)
    state = engine.full_state_dict()
    if rank == 0:
        torch.save({"state": state, "stats": stats}, out)
    engine.destroy()


def test_two_process_fsdp_step_equals_one_process_step(tiny_model_dir, tmp_path):
    out = str(tmp_path / "two_rank.pt")
    run_ranks(_two_rank_step, 2, (tiny_model_dir, free_port(), out))
    two = torch.load(out)
    one, stats = train_and_snapshot(
        tiny_model_dir, random_batch(), MicroBatchSpec(max_tokens_per_mb=30)
    )
    assert two["stats"]["loss"] == pytest.approx(stats[0]["loss"], abs=1e-5)
    assert two["stats"]["grad_norm"] == pytest.approx(stats[0]["grad_norm"], rel=1e-5)
    assert_states_close(one, two["state"], atol=1e-6)


def test_bf16_compute_step_stays_within_bf16_rounding_of_the_fp32_step(tiny_model_dir):
    # FSDP2 mixed precision: bf16 parameters and activations in forward/backward, fp32 master
    # weights, AdamW state and gradient reduction. bf16 keeps 8 mantissa bits (relative rounding
    # 2^-9 ~ 2e-3 per value), so one token's logp moves by ~1e-3..1e-2 (measured: mean 2.0e-3,
    # max 8.6e-3); the loss, a mean over ~90 tokens, and the grad norm average those errors out
    # (measured: 1e-6 and 2e-5 relative); the weights move by lr x the gradient error (3e-6).
    # Bounds: 10x the measured values. The trainer's bf16 logp error is what logp_mismatch shows
    # against an fp32 server: docs/gpus.md#mixed-precision says when to compute in fp32.
    from areal.engine.sft import sft_loss

    batch = random_batch()
    runs = {}
    for dtype in ("float32", "bfloat16"):
        engine = make_engine(tiny_model_dir, param_dtype=dtype)
        logp = engine.compute_logp(batch)[0]["logp"]
        stats = engine.train_token_batch(batch, sft_loss, n_loss_tokens)
        masters = {p.dtype for p in engine.model.parameters()}
        assert engine.optimizer is not None
        moments = {s["exp_avg"].dtype for s in engine.optimizer.state.values()}
        assert masters == moments == {torch.float32}  # fp32 master weights and optimizer state
        runs[dtype] = (logp, stats, engine.full_state_dict())
        engine.destroy()
    (logp32, s32, w32), (logp16, s16, w16) = runs["float32"], runs["bfloat16"]
    assert 0 < (logp32 - logp16).abs().mean() < 2e-2  # bf16 really ran
    assert (logp32 - logp16).abs().max() < 1e-1
    assert s16["loss"] == pytest.approx(s32["loss"], rel=1e-4)
    assert s16["grad_norm"] == pytest.approx(s32["grad_norm"], rel=2e-4)
    assert_states_close(w32, w16, atol=3e-5)
