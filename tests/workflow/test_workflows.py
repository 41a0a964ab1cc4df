"""RLVR and multi-turn workflows: group shape, masks, versions, rewards, statuses, dump."""

from __future__ import annotations

import asyncio
import json

import torch

from areal.api.config.base import GenerationHyperparameters
from areal.api.config.reward import RewardConfig, WorkflowConfig
from areal.api.io import RolloutStatus
from areal.reward.runner import RewardRunner
from areal.workflow import MultiTurnWorkflow, RLVRWorkflow

ITEM = {"id": "q7", "messages": [{"role": "user", "content": "3 + 4 = ?"}], "reference": "7"}
G3 = GenerationHyperparameters(n_samples=3, max_new_tokens=8)


def broken_reward(completion: str, reference: str) -> float:
    raise RuntimeError("reward code bug")


def _check_shapes(t):
    n = len(t.completion_ids)
    assert n > 0 and len(t.logprobs) == len(t.versions) == len(t.loss_mask) == n


# ----------------------------------------------------------------------------- tier 1 (scripted)


def test_rlvr_scores_each_sample_and_dumps_per_version(
    tiny_tokenizer, math_runner, scripted, tmp_path
):
    engine = scripted(["7", "The answer is 8.", "so \\boxed{7}"], version=4)
    wf = RLVRWorkflow(math_runner, G3, tiny_tokenizer, WorkflowConfig(dump_rollouts=True), tmp_path)
    group = asyncio.run(wf.arun_episode(engine, ITEM))
    assert [t.reward for t in group] == [1.0, 0.0, 1.0]
    assert [t.sample_id for t in group] == ["q7/0", "q7/1", "q7/2"]
    assert {t.group_id for t in group} == {"q7"} and {r.group_id for r in engine.requests} == {"q7"}
    prompt = tiny_tokenizer.decode(group[0].prompt_ids)
    assert prompt.endswith("3 + 4 = ?<|im_end|>\n<|im_start|>assistant\n")
    for k, t in enumerate(group):
        _check_shapes(t)
        assert t.loss_mask == [1] * len(t.completion_ids)
        assert t.versions == [4 + k] * len(t.completion_ids)  # the engine bumps after each call
        assert t.status == RolloutStatus.COMPLETED
        assert t.completion_ids[-1] == tiny_tokenizer.eos_token_id
    assert group[1].completion_text == "The answer is 8."
    assert {t.reference for t in group} == {"7"}  # recorded for areal view's sample page
    # dumped under the newest version in the group (6)
    rows = [json.loads(line) for line in (tmp_path / "6.jsonl").read_text().splitlines()]
    assert [r["reward"] for r in rows] == [1.0, 0.0, 1.0] and rows[0]["prompt"] == prompt


def test_remax_greedy_baseline_reward_is_attached_to_every_sample(
    tiny_tokenizer, math_runner, scripted
):
    # 3 sampled replies, then the greedy one ("7", correct): baseline reward 1.0 for each sample
    engine = scripted(["7", "8", "9", "7"])
    wf = RLVRWorkflow(math_runner, G3, tiny_tokenizer, greedy_baseline=True)
    group = asyncio.run(wf.arun_episode(engine, ITEM))
    assert [t.reward for t in group] == [1.0, 0.0, 0.0]
    assert [t.extras["baseline_rewards"] for t in group] == [1.0, 1.0, 1.0]
    assert [r.gconfig.greedy for r in engine.requests] == [False, False, False, True]


def test_reward_crash_marks_trajectories_error_reward_with_zero(tiny_tokenizer, scripted):
    with RewardRunner(broken_reward, RewardConfig(n_workers=1, max_failure_fraction=1.0)) as runner:
        wf = RLVRWorkflow(runner, GenerationHyperparameters(n_samples=2), tiny_tokenizer)
        group = asyncio.run(wf.arun_episode(scripted(["7", "7"]), ITEM))
        assert [t.status for t in group] == [RolloutStatus.ERROR_REWARD] * 2
        assert [t.reward for t in group] == [0.0, 0.0]
        assert runner.commit_batch()["reward/n_errors"] == 2


def test_multi_turn_retries_after_feedback_and_discounts(tiny_tokenizer, math_runner, scripted):
    cfg = WorkflowConfig(max_turns=3, turn_discount=0.5, feedback="Wrong, try again.")
    wf = MultiTurnWorkflow(math_runner, GenerationHyperparameters(n_samples=1), tiny_tokenizer, cfg)
    engine = scripted(["5", "7"], version=2)
    (t,) = asyncio.run(wf.arun_episode(engine, ITEM))
    assert t.reward == 0.5  # correct on turn 2: 1.0 * 0.5 ** (2 - 1)
    assert t.extras["turns"] == 2.0 and t.status == RolloutStatus.COMPLETED
    assert t.reference == "7"
    _check_shapes(t)
    ids, mask = t.completion_ids, t.loss_mask
    first = ids.index(tiny_tokenizer.eos_token_id) + 1  # the model's first reply ends at EOS
    injected = [i for i, m in zip(ids, mask) if m == 0]
    n_inj = len(injected)
    assert mask == [1] * first + [0] * n_inj + [1] * (len(ids) - first - n_inj)
    assert tiny_tokenizer.decode(injected) == (
        "\n<|im_start|>user\nWrong, try again.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert t.versions == [2] * first + [-1] * n_inj + [3] * (len(ids) - first - n_inj)
    assert t.turn_starts == [0, first + n_inj]  # turn 2's model tokens start after the feedback
    assert all(lp == 0.0 for lp, m in zip(t.logprobs, mask) if m == 0)
    # the second request continues exactly from prompt + everything so far (no re-tokenizing)
    assert engine.requests[1].input_ids == t.prompt_ids + ids[: first + n_inj]
    # ... which is what the chat template renders for the whole conversation
    convo = ITEM["messages"] + [{"role": "assistant", "content": "5"},
                                {"role": "user", "content": "Wrong, try again."}]  # fmt: skip
    rendered = tiny_tokenizer.apply_chat_template(convo, add_generation_prompt=True, tokenize=False)
    assert tiny_tokenizer.decode(engine.requests[1].input_ids) == rendered


def test_multi_turn_stops_at_max_turns_with_zero_reward(tiny_tokenizer, math_runner, scripted):
    cfg = WorkflowConfig(max_turns=2)
    wf = MultiTurnWorkflow(math_runner, GenerationHyperparameters(n_samples=2), tiny_tokenizer, cfg)
    group = asyncio.run(wf.arun_episode(scripted(["1", "2", "3", "4"]), ITEM))
    assert [t.reward for t in group] == [0.0, 0.0]
    assert [t.extras["turns"] for t in group] == [2.0, 2.0]


# ----------------------------------------------------------------------------- tier 2 (tiny model)


def _recomputed_logprobs(engine, t, temperature):
    ids = torch.tensor([t.prompt_ids + t.completion_ids])
    with torch.no_grad():
        logits = engine.model(ids).logits[0, len(t.prompt_ids) - 1 : -1]  # [L, V]
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(t.completion_ids)[:, None])[:, 0]


def test_rlvr_with_the_tiny_model_returns_a_consistent_versioned_group(
    tiny_tokenizer, math_runner, tiny_engine
):
    g = GenerationHyperparameters(n_samples=3, max_new_tokens=6, temperature=0.8)
    group = asyncio.run(
        RLVRWorkflow(math_runner, g, tiny_tokenizer).arun_episode(tiny_engine, ITEM)
    )
    assert len(group) == 3
    for t in group:
        _check_shapes(t)
        assert t.versions == [5] * len(t.completion_ids) and set(t.loss_mask) == {1}
        assert t.status in (RolloutStatus.COMPLETED, RolloutStatus.TRUNCATED)
        assert t.reward in (0.0, 1.0)
        torch.testing.assert_close(
            torch.tensor(t.logprobs), _recomputed_logprobs(tiny_engine, t, 0.8), atol=1e-4, rtol=0
        )


def test_multi_turn_with_the_tiny_model_masks_injected_tokens(
    tiny_tokenizer, math_runner, tiny_engine
):
    # every token is a stop token: each turn is a one-token (almost surely wrong) answer, so the
    # episode takes both turns with the feedback injected in between
    every = list(range(len(tiny_tokenizer)))
    g = GenerationHyperparameters(n_samples=2, max_new_tokens=4, greedy=True, stop_token_ids=every)
    wf = MultiTurnWorkflow(math_runner, g, tiny_tokenizer, WorkflowConfig(max_turns=2))
    group = asyncio.run(wf.arun_episode(tiny_engine, ITEM))
    for t in group:
        _check_shapes(t)
        if t.reward == 0.0:
            assert t.extras["turns"] == 2.0
            assert t.loss_mask[0] == 1 and t.loss_mask[-1] == 1 and 0 in t.loss_mask
        for v, m, lp in zip(t.versions, t.loss_mask, t.logprobs):
            assert (v, lp) == (-1, 0.0) if m == 0 else v == 5


def test_the_package_imports_its_workflows_only_when_asked():
    """Importing the package (or one light module of it) loads no workflow; ``from areal.workflow
    import X`` still gives each of the four, and another name is an AttributeError."""
    import subprocess
    import sys

    code = (
        "import sys, areal.workflow\n"
        "assert 'areal.workflow.rlvr' not in sys.modules, 'rlvr loaded with the package'\n"
        "from areal.workflow import AgentWorkflow, ArealOpenAI, MultiTurnWorkflow, RLVRWorkflow\n"
        "assert RLVRWorkflow.__module__ == 'areal.workflow.rlvr'\n"
        "try:\n"
        "    areal.workflow.Nope\n"
        "except AttributeError as e:\n"
        "    assert 'Nope' in str(e)\n"
        "else:\n"
        "    raise SystemExit('no AttributeError')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
