"""DPO engine (tier 2): packed pairs give the logprobs of separate forwards; one step on pairs
lowers the loss and widens the margin, for every loss type; the step's graph run by run_step is
the hand-written calls, bit for bit."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from test_fsdp import world_mesh

from areal.api.config import DPOLossConfig
from areal.api.config.base import MicroBatchSpec, OptimizerConfig
from areal.api.config.engine import TrainEngineConfig
from areal.api.io import FinetuneSpec
from areal.engine.dpo import DPOEngine, DPOReference, pack_pairs, sequence_logp
from areal.runtime.graphs import MODEL, REF, dpo_mfcs
from areal.runtime.step import run_step
from areal.utils.batch import PackedBatch
from areal.utils.stats import StatsTracker

pytestmark = pytest.mark.slow


def random_pairs(n_pairs: int, seed: int) -> PackedBatch:
    """Pairs with a shared random prompt; chosen replies use tokens < 128, rejected >= 128."""
    g = torch.Generator().manual_seed(seed)
    chosen, rejected, prompt_lens = [], [], []
    for _ in range(n_pairs):
        p = int(torch.randint(3, 7, (1,), generator=g))
        prompt = torch.randint(0, 256, (p,), generator=g).tolist()
        for side, lo in ((chosen, 0), (rejected, 128)):
            length = int(torch.randint(2, 6, (1,), generator=g))
            side.append(prompt + torch.randint(lo, lo + 128, (length,), generator=g).tolist())
        prompt_lens.append(p)
    return pack_pairs(chosen, rejected, prompt_lens)


def _config(path: str, **kw) -> TrainEngineConfig:
    return TrainEngineConfig(
        path=path,
        mb_spec=MicroBatchSpec(max_tokens_per_mb=64, granularity=2),
        optimizer=OptimizerConfig(lr=1e-3, weight_decay=0.0),
        **kw,
    )


def test_packed_pair_forward_equals_separate_forwards(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    batch = random_pairs(5, seed=0)
    engine = DPOEngine(_config(tiny_model_dir), world_mesh(), DPOLossConfig())
    engine.initialize(None)
    packed = engine.compute_logp(batch)[0]["logp"]  # shared-prefix layout: each prompt runs once
    engine.destroy()
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    bounds = batch.cu_seqlens.tolist()
    for a, b in zip(bounds, bounds[1:]):
        ids = batch["input_ids"][a:b]
        with torch.no_grad():
            logits = plain(input_ids=ids[None]).logits[0]  # one sequence alone
        alone = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None])[:, 0]
        assert torch.allclose(packed[a + 1 : b], alone, atol=1e-5), (a, b)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "simpo"])
def test_one_dpo_step_lowers_the_loss_and_widens_the_margin(tiny_model_dir, loss_type):
    loss = DPOLossConfig(loss_type=loss_type, beta=2.0 if loss_type == "simpo" else 0.1)
    batch = random_pairs(8, seed=1)
    if loss.loss_type != "simpo":
        ref = DPOReference(_config(tiny_model_dir), world_mesh())
        ref.initialize(None)
        batch, _ = ref.compute_seq_logp(batch, out="ref_logp")
        ref.destroy()
    engine = DPOEngine(_config(tiny_model_dir), world_mesh(), loss)
    engine.initialize(None)
    _, before = engine.evaluate_dpo(batch)
    _, train = engine.train_dpo(batch)
    _, after = engine.evaluate_dpo(batch)
    engine.destroy()
    assert train["loss"] == pytest.approx(before["loss"], rel=1e-4)  # same weights, same pairs
    assert after["loss"] < before["loss"] and after["margin"] > before["margin"], (before, after)
    if loss_type == "sigmoid":  # policy == reference at the start: every reward is 0, loss log 2
        assert before["loss"] == pytest.approx(math.log(2), abs=1e-5) and before[
            "margin"
        ] == pytest.approx(0, abs=1e-5)
    assert before["n_pairs"] == 8 and set(train) >= {
        "reward_acc",
        "margin",
        "chosen_reward",
        "rejected_reward",
    }


def test_nll_coef_adds_the_chosen_replies_mean_token_nll(tiny_model_dir):
    batch = random_pairs(6, seed=2)
    ref = DPOReference(_config(tiny_model_dir), world_mesh())
    ref.initialize(None)
    batch, _ = ref.compute_seq_logp(batch, out="ref_logp")
    ref.destroy()
    engine = DPOEngine(_config(tiny_model_dir), world_mesh(), DPOLossConfig(nll_coef=0.5))
    engine.initialize(None)
    scored, out = engine.evaluate_dpo(batch)
    _, train = engine.train_dpo(batch)
    engine.destroy()
    bounds, mask = batch.cu_seqlens.tolist(), batch["loss_mask"].bool()
    nll = [
        -float(scored["logp"][a:b][mask[a:b]].sum())
        / int(mask[a:b].sum())  # chosen: even sequences
        for a, b in list(zip(bounds, bounds[1:]))[0::2]
    ]
    expected = math.log(2) + 0.5 * sum(nll) / len(nll)  # policy == reference: the DPO part is log 2
    assert out["loss"] == pytest.approx(expected, rel=1e-5) and train["loss"] == pytest.approx(
        expected, rel=1e-4
    )


def test_run_step_on_the_dpo_graph_equals_the_hand_written_calls(tiny_model_dir):
    # two steps on a decaying LR: the second step's loss and lr see the first's update and LR step
    cfg = _config(tiny_model_dir)
    cfg = replace(cfg, optimizer=replace(cfg.optimizer, lr_scheduler_type="linear"))
    spec = FinetuneSpec(total_train_epochs=4, dataset_size=6, train_batch_size=6)
    batch = random_pairs(6, seed=3)
    ref = DPOReference(_config(tiny_model_dir), world_mesh())
    ref.initialize(None)
    hand, graph = (
        DPOEngine(cfg, world_mesh(), DPOLossConfig()),
        DPOEngine(cfg, world_mesh(), DPOLossConfig()),
    )
    hand.initialize(spec)
    graph.initialize(spec)
    for _ in range(2):
        # by hand, as examples/dpo.py stepped before its graph: the reference's summed reply
        # logprobs (float64 sum, float32 on CPU), the update, the LR step
        token_logp = ref.compute_logp(batch)[0]["logp"]
        ref_logp = sequence_logp(token_logp.double(), batch).float().cpu()
        _, by_hand = hand.train_dpo(batch.with_fields(seqs={"ref_logp": ref_logp}))
        hand.step_lr_scheduler()
        tracker = StatsTracker()
        out = run_step(dpo_mfcs(True, True), {MODEL: graph, REF: ref}, batch, tracker)
        assert torch.equal(out["ref_logp"], ref_logp)
        stats = tracker.export()
        timers = {k for k in stats if k.startswith("timing/")}
        assert timers == {"timing/ref_logp", "timing/train"}  # as examples/dpo.py timed them
        assert {k: v for k, v in stats.items() if k not in timers} == {
            f"loss/{k}": float(v) for k, v in by_hand.items()
        }
    assert hand.lr_scheduler.get_last_lr() == graph.lr_scheduler.get_last_lr() != [cfg.optimizer.lr]
    assert graph.evaluate_dpo(out)[1] == hand.evaluate_dpo(out)[1]  # the same weights after
    for engine in (ref, hand, graph):
        engine.destroy()


def test_dpo_batches_are_checked(tiny_model_dir):
    with pytest.raises(ValueError, match="granularity must be even"):
        DPOEngine(TrainEngineConfig(path=tiny_model_dir), world_mesh(), DPOLossConfig())
    engine = DPOEngine(_config(tiny_model_dir), world_mesh(), DPOLossConfig())
    with pytest.raises(ValueError, match="needs sequence field 'ref_logp'"):
        engine.train_dpo(random_pairs(2, seed=0))
    with pytest.raises(ValueError, match="share their first prompt_len=3 tokens"):
        pack_pairs([[1, 2, 3, 4]], [[1, 2, 9, 4]], [3])
