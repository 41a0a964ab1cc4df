"""The agent examples end to end (tier 2): examples/agent_arithmetic.yaml through ``areal launch
local`` and the GRPO entry script with ``workflow.type=agent``, on the random tiny model: the
openai-client agent's episodes train, eval runs the agent, and the agent counters are logged;
examples/agent_arithmetic_sdk.yaml the same with ``workflow.type=agent_cmd``: the OpenAI Agents
SDK agent (the real openai client) in its own process per episode, through the agent proxy."""

from __future__ import annotations

from pathlib import Path

import pytest

from launch_harness import assert_finite, train_steps  # on sys.path by tests/examples/conftest.py

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
GRPO_SCRIPT, AGENT_YAML = EXAMPLES / "gsm8k_grpo.py", EXAMPLES / "agent_arithmetic.yaml"


def test_calculator_tool_evaluates_integer_expressions_and_reports_bad_calls():
    from examples.agent_arithmetic import calculator, score

    assert calculator('{"e": "12 * (3 + 4) - 5"}') == "79"
    assert calculator('{"e": "__import__(\'os\')"}').startswith("error:")
    assert calculator('{"expr": "1"}').startswith("error:")  # wrong argument name
    assert (score("It is 84.", "84"), score("84 or 85", "84"), score(None, "84")) == (1.0, 0.0, 0.0)


def test_sft_conversations_render_the_prompt_the_agent_sends(tiny_tokenizer):
    from areal.dataset.chat import sft_tokens
    from examples.agent_arithmetic import TOOLS, sft_conversations

    (row,) = sft_conversations(tiny_tokenizer, 1)
    system, user = row["messages"][:2]
    sft_prompt = tiny_tokenizer.apply_chat_template(
        [system, user], add_generation_prompt=True, tokenize=False
    )
    agent_prompt = tiny_tokenizer.apply_chat_template(
        [user], tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert sft_prompt == agent_prompt
    assert len(tiny_tokenizer(agent_prompt)["input_ids"]) < 80  # the compact tools turn: ~45 tokens
    ids, mask = sft_tokens(tiny_tokenizer, row["messages"])
    trained = tiny_tokenizer.decode([t for t, m in zip(ids, mask) if m])
    expression = user["content"].split(" = ?")[0]
    assert trained.startswith(
        '<tool_call>\n{"name": "calc", "arguments": {"e": "' + expression + '"}}'
    )
    assert trained.endswith(row["messages"][-1]["content"] + "<|im_end|>\n")


def test_sft_guesses_answer_in_the_head_for_their_share_of_problems(tiny_tokenizer):
    from examples.agent_arithmetic import sft_conversations

    rows = sft_conversations(tiny_tokenizer, 200, guess_fraction=0.6)
    guesses = [r for r in rows if len(r["messages"]) == 3]
    assert 100 <= len(guesses) <= 140  # a seeded 60% of 200 (binomial sd ~7)
    for row in guesses:
        expression = row["messages"][1]["content"][: -len(" = ?")]
        assert row["messages"][2] == {
            "role": "assistant",
            "content": f"{expression} = {eval(expression)}",
        }
    assert all(r["messages"][2]["tool_calls"] for r in rows if r not in guesses)
    assert len({r["id"] for r in rows}) == 200  # distinct problems
    assert sft_conversations(tiny_tokenizer, 200, guess_fraction=0.6) == rows  # seeded
    with pytest.raises(ValueError, match="guess_fraction=1.0"):
        sft_conversations(tiny_tokenizer, 1, guess_fraction=1.0)


@pytest.mark.slow
def test_agent_example_trains_through_the_grpo_script(launcher, tiny_model_dir):
    run_dir = launcher.run(
        "agent",
        GRPO_SCRIPT,
        AGENT_YAML,
        [
            f"actor.path={tiny_model_dir}",
            "total_train_steps=2",
            "train_dataset.batch_size=2",
            "gconfig.n_samples=2",
            "gconfig.max_new_tokens=8",
            "eval_gconfig.max_new_tokens=8",
            "rollout.max_concurrent_rollouts=4",
            "valid_dataset.arithmetic.n_test=4",
            "valid_dataset.batch_size=4",
            "evaluator.freq_steps=null",
            # the random tiny model never succeeds: every group would be rejected
            "actor.dynamic_sampling=false",
        ],
    )
    stats = train_steps(run_dir)
    assert sorted(stats) == [0, 1, 2], sorted(stats)
    assert stats[0]["eval/accuracy"] in (0.0, 0.25, 0.5, 0.75, 1.0)  # the agent's own reward
    for step in (1, 2):
        assert_finite(
            stats[step], ["reward/mean", "agent/episodes", "agent/episodes_failed", "loss/pg_loss"]
        )
        assert stats[step]["agent/calls_per_episode"] >= 1.0
    assert stats[2]["agent/episodes"] >= 8  # two steps of 2 groups x 2 episodes


@pytest.mark.slow
def test_agents_sdk_program_trains_through_the_proxy_under_the_launcher(launcher, tiny_model_dir):
    pytest.importorskip(
        "agents", reason="openai-agents is in the test extra: pip install -e .[test]"
    )
    yaml = EXAMPLES / "agent_arithmetic_sdk.yaml"
    run_dir = launcher.run(
        "agent-sdk",
        GRPO_SCRIPT,
        yaml,
        [
            f"actor.path={tiny_model_dir}",
            "total_train_steps=2",
            "train_dataset.batch_size=2",
            "gconfig.n_samples=2",
            "gconfig.max_new_tokens=8",
            "eval_gconfig.max_new_tokens=8",
            "rollout.max_concurrent_rollouts=2",
            "valid_dataset.arithmetic.n_test=2",
            "valid_dataset.batch_size=2",
            "evaluator.freq_steps=null",
            f"workflow.agent.command=python {EXAMPLES / 'agent_arithmetic_sdk.py'}",
            "workflow.agent.max_agents=4",
            "actor.dynamic_sampling=false",
        ],
    )
    stats = train_steps(run_dir)
    assert sorted(stats) == [0, 1, 2], sorted(stats)
    for step in (1, 2):
        assert_finite(stats[step], ["reward/mean", "agent/episodes", "loss/pg_loss"])
        assert (
            stats[step]["agent/calls_per_episode"] >= 1.0
        )  # sessions of the next batch may be open
    assert stats[2]["agent/episodes"] >= 8 and stats[2]["agent/deadline_drops"] == 0
