"""The in-process OpenAI client and the agent workflow over a scripted engine (tier 1): openai's
own return types, tool calls, the record of every call, token-for-token agreement of the chat
template's re-rendering with what the model generated, and how failures are counted."""

from __future__ import annotations

import asyncio
import json

import pytest
from openai.types.chat import ChatCompletion

from areal.api.config.base import GenerationHyperparameters
from areal.api.config.reward import AgentConfig
from areal.workflow.agent import WINDOW, AgentFailureRate, AgentWorkflow
from areal.workflow.agent_trajectories import TemplateMismatch, episode_trajectories
from areal.workflow.openai_client import ArealOpenAI, EngineFailure

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 7"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
G = GenerationHyperparameters(max_new_tokens=64)
ITEM = {"id": "q1", "messages": [{"role": "user", "content": "12 * 7 = ?"}], "reference": "84"}


async def tool_agent(client, item) -> float:
    """Plain openai-client agent: one calculator round, then the answer."""
    messages = list(item["messages"])
    first = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    message = first.choices[0].message
    messages.append(message)  # the pydantic message, as openai's docs do
    for call in message.tool_calls or []:
        value = eval(json.loads(call.function.arguments)["expression"])  # test input only
        messages.append({"role": "tool", "tool_call_id": call.id, "content": str(value)})
    second = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    return 1.0 if second.choices[0].message.content == item["reference"] else 0.0


def _run(engine, tokenizer, agent=tool_agent):
    client = ArealOpenAI(engine, tokenizer, G, group_id="q1")
    return client, asyncio.run(agent(client, ITEM))


def test_tool_call_comes_back_in_openai_types_and_every_call_is_recorded(tiny_tokenizer, scripted):
    engine = scripted([CALL, "84"], version=2)
    client = ArealOpenAI(engine, tiny_tokenizer, G, group_id="q1")
    first = asyncio.run(
        client.chat.completions.create(messages=ITEM["messages"], tools=TOOLS, logprobs=True)
    )
    assert isinstance(first, ChatCompletion)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls[0].function.name == "calculator"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"expression": "12 * 7"}
    assert [lp.logprob for lp in choice.logprobs.content] == [-0.5] * len(
        client.calls[0].completion_ids
    )
    (call,) = client.calls
    assert call.prompt_ids == engine.requests[0].input_ids and engine.requests[0].group_id == "q1"
    assert call.completion_ids[-1] == tiny_tokenizer.eos_token_id and call.versions[0] == 2
    assert first.usage.prompt_tokens == len(call.prompt_ids)
    assert first.usage.completion_tokens == len(call.completion_ids)


def test_concatenated_episode_equals_what_the_model_generated_token_for_token(
    tiny_tokenizer, scripted
):
    engine = scripted([CALL, "84"])
    client, reward = _run(engine, tiny_tokenizer)
    assert reward == 1.0
    first, second = client.calls
    # the template re-renders call 0's tool call exactly as generated: call 1's prompt extends it
    assert (
        second.prompt_ids[: len(first.prompt_ids) + len(first.completion_ids)]
        == first.prompt_ids + first.completion_ids
    )
    (t,), _ = episode_trajectories(
        client.calls, {}, reward, 1.0, "concat", "error", "q1/0", "q1", tiny_tokenizer
    )
    full = t.prompt_ids + t.completion_ids
    assert full == second.prompt_ids + second.completion_ids
    trained = [tok for tok, m in zip(t.completion_ids, t.loss_mask) if m]
    assert trained == first.completion_ids + second.completion_ids
    injected = tiny_tokenizer.decode(
        [tok for tok, m in zip(t.completion_ids, t.loss_mask) if not m]
    )
    assert injected == "\n<|im_start|>tool\n84<|im_end|>\n<|im_start|>assistant\n"
    # a canonical answer: the prompt is exactly the template's plain rendering of the conversation
    plain = tiny_tokenizer.apply_chat_template(
        [
            ITEM["messages"][0],
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {"name": "calculator", "arguments": '{"expression": "12 * 7"}'},
                    }
                ],
            },
            {"role": "tool", "content": "84"},
        ],
        tools=TOOLS,
        add_generation_prompt=True,
        tokenize=False,
    )
    assert second.prompt_ids == tiny_tokenizer(plain, add_special_tokens=False)["input_ids"]


def test_a_turn_the_template_would_write_differently_keeps_the_generated_tokens(
    tiny_tokenizer, scripted
):
    # compact JSON: the parser accepts it; the template would re-render it with spaces
    compact = '<tool_call>\n{"name":"calculator","arguments":{"expression":"12 * 7"}}\n</tool_call>'
    engine = scripted([compact, "84"])
    client, _ = _run(engine, tiny_tokenizer)
    first, second = client.calls
    full = first.prompt_ids + first.completion_ids
    assert second.prompt_ids[: len(full)] == full  # the model's own tokens, not a re-rendering
    rerendered = tiny_tokenizer.decode(second.prompt_ids[len(first.prompt_ids) :])
    assert rerendered.startswith(compact + "<|im_end|>\n<|im_start|>tool\n84")
    (t,), _ = episode_trajectories(
        client.calls, {}, 1.0, 1.0, "concat", "error", "q1/0", "q1", tiny_tokenizer
    )
    assert [
        tok for tok, m in zip(t.completion_ids, t.loss_mask) if m
    ] == first.completion_ids + second.completion_ids


def test_an_assistant_turn_the_agent_rewrote_is_rendered_by_the_template_and_cannot_be_concatenated(
    tiny_tokenizer, scripted
):
    async def rewriting(client, item) -> float:
        messages = list(item["messages"])
        first = await client.chat.completions.create(messages=messages)
        messages.append(
            {"role": "assistant", "content": first.choices[0].message.content + " (edited)"}
        )
        messages.append({"role": "user", "content": "again"})
        await client.chat.completions.create(messages=messages)
        return 0.0

    client, _ = _run(scripted(["12", "84"]), tiny_tokenizer, rewriting)
    with pytest.raises(TemplateMismatch, match="call 1's prompt .* differ at token"):
        episode_trajectories(
            client.calls, {}, 0.0, 1.0, "concat", "error", "q1/0", "q1", tiny_tokenizer
        )


def test_arguments_the_training_run_cannot_honour_are_refused_by_name(tiny_tokenizer, scripted):
    client = ArealOpenAI(scripted(["x"]), tiny_tokenizer, G)
    create = client.chat.completions.create
    with pytest.raises(ValueError, match="temperature: 0.2 differs .* gconfig.temperature"):
        asyncio.run(create(messages=ITEM["messages"], temperature=0.2))
    for bad, message in [
        ({"type": "function", "function": {"name": "sub"}}, "not among the tools"),
        ({"type": "function"}, "expected 'auto', 'none', 'required'"),
        ("always", "expected 'auto', 'none', 'required'"),
    ]:
        with pytest.raises(ValueError, match=f"tool_choice: .*{message}"):
            asyncio.run(create(messages=ITEM["messages"], tools=TOOLS, tool_choice=bad))
    with pytest.raises(ValueError, match="tool_choice: .*needs tools"):
        asyncio.run(create(messages=ITEM["messages"], tool_choice="required"))
    with pytest.raises(ValueError, match="stream"):
        asyncio.run(create(messages=ITEM["messages"], stream=True))
    with pytest.raises(TypeError, match="frequency_penalty"):
        asyncio.run(create(messages=ITEM["messages"], frequency_penalty=1.0))
    with pytest.raises(ValueError, match=r"messages\[0\].tool_call_id"):
        asyncio.run(create(messages=[{"role": "tool", "content": "1"}]))


NAMED = {"type": "function", "function": {"name": "calculator"}}
OPEN_NAMED = '<tool_call>\n{"name": "calculator", "arguments": '


@pytest.mark.parametrize(
    "choice,opening,written",
    [
        ("required", "<tool_call>\n", CALL[len("<tool_call>\n") :]),  # the model picks the function
        (
            NAMED,
            OPEN_NAMED,
            '{"expression": "12 * 7"}}\n</tool_call>',
        ),  # the model writes the arguments
    ],
)
def test_a_forced_call_is_prompt_not_completion_and_parses(
    tiny_tokenizer, scripted, choice, opening, written
):
    engine = scripted([written])
    client = ArealOpenAI(engine, tiny_tokenizer, G)
    out = asyncio.run(
        client.chat.completions.create(messages=ITEM["messages"], tools=TOOLS, tool_choice=choice)
    )
    choice0 = out.choices[0]
    assert choice0.finish_reason == "tool_calls" and choice0.message.content is None
    assert [
        (c.function.name, json.loads(c.function.arguments)) for c in choice0.message.tool_calls
    ] == [("calculator", {"expression": "12 * 7"})]
    (call,) = client.calls
    opened = tiny_tokenizer(opening, add_special_tokens=False)["input_ids"]
    assert (
        call.prompt_ids == engine.requests[0].input_ids
        and call.prompt_ids[-len(opened) :] == opened
    )
    assert call.prefill == len(opened) and out.usage.prompt_tokens == len(call.prompt_ids)
    # exactly the generated ids: the opening is not among them
    assert call.completion_ids == tiny_tokenizer(written, add_special_tokens=False)["input_ids"] + [
        tiny_tokenizer.eos_token_id
    ]


def test_a_forced_call_chains_in_the_concat_trajectory_with_the_opening_masked(
    tiny_tokenizer, scripted
):
    """auto call, forced call (required), then the answer: the forced call's opening lies in the
    untrained part of the episode's sequence; only generated tokens are trained on."""

    async def forced(client, item) -> float:
        messages = list(item["messages"])
        for choice in ("auto", "required", "auto"):
            out = await client.chat.completions.create(
                messages=messages, tools=TOOLS, tool_choice=choice
            )
            message = out.choices[0].message
            messages.append(message)
            messages += [
                {"role": "tool", "tool_call_id": c.id, "content": "84"}
                for c in message.tool_calls or []
            ]
        return 1.0 if message.content == "84" else 0.0

    client, reward = _run(
        scripted([CALL, CALL[len("<tool_call>\n") :], "84"]), tiny_tokenizer, forced
    )
    assert reward == 1.0
    calls = client.calls
    for prev, nxt in zip(
        calls, calls[1:]
    ):  # each prompt extends the previous prompt + opening + completion
        full = prev.prompt_ids + prev.completion_ids
        assert nxt.prompt_ids[: len(full)] == full
    opened = tiny_tokenizer("<tool_call>\n", add_special_tokens=False)["input_ids"]
    assert [c.prefill for c in calls] == [0, len(opened), 0]
    (t,), _ = episode_trajectories(
        calls, {}, reward, 1.0, "concat", "error", "q1/0", "q1", tiny_tokenizer
    )
    assert t.prompt_ids + t.completion_ids == calls[2].prompt_ids + calls[2].completion_ids
    assert [tok for tok, m in zip(t.completion_ids, t.loss_mask) if m] == [
        tok for c in calls for tok in c.completion_ids
    ]
    masked = tiny_tokenizer.decode([tok for tok, m in zip(t.completion_ids, t.loss_mask) if not m])
    glue = "\n<|im_start|>tool\n84<|im_end|>\n<|im_start|>assistant\n"
    assert masked == glue + "<tool_call>\n" + glue  # call 1's opening is prompt: untrained


def test_a_forced_answer_is_read_as_calls_never_as_text(tiny_tokenizer, scripted):
    """As `areal serve` reads it (areal.utils.tool_calls.forced_calls): what follows a named
    call's opening is its arguments, as written, even where they are not JSON (the server's
    grammar writes no such text; an engine that ignored the grammar might)."""
    client = ArealOpenAI(scripted(["no json"]), tiny_tokenizer, G)
    out = asyncio.run(
        client.chat.completions.create(messages=ITEM["messages"], tools=TOOLS, tool_choice=NAMED)
    )
    choice0 = out.choices[0]
    assert choice0.message.content is None and choice0.finish_reason == "tool_calls"
    (call,) = choice0.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("calculator", "no json")


def test_n_choices_are_sampled_and_recorded_separately(tiny_tokenizer, scripted):
    engine = scripted(["1", "2", "3"])
    client = ArealOpenAI(engine, tiny_tokenizer, G, group_id="g")
    out = asyncio.run(
        client.chat.completions.create(messages=ITEM["messages"], n=3, max_tokens=8, seed=5)
    )
    assert sorted(c.message.content for c in out.choices) == ["1", "2", "3"]
    assert [(c.turn, c.choice) for c in client.calls] == [(0, 0), (0, 1), (0, 2)]
    assert sorted(r.seed for r in engine.requests) == [5, 6, 7]
    assert {r.gconfig.max_new_tokens for r in engine.requests} == {8}


def test_rewards_the_agent_gives_single_calls_are_discounted_into_the_trajectory(
    tiny_tokenizer, scripted
):
    async def shaped(client, item) -> float:
        first = await client.chat.completions.create(messages=item["messages"], tools=TOOLS)
        client.set_reward(first.id, 0.5)  # a bonus for calling the tool
        messages = [
            *item["messages"],
            first.choices[0].message,
            {"role": "tool", "tool_call_id": "x", "content": "84"},
        ]
        await client.chat.completions.create(messages=messages, tools=TOOLS)
        return 1.0

    wf = AgentWorkflow(AgentConfig(gamma=0.5), G, tiny_tokenizer, agent=shaped)
    (t,) = asyncio.run(wf.arun_episode(scripted([CALL, "84"]), ITEM))
    assert t.reward == 0.5 + 0.5 * 1.0  # G0 = r0 + gamma * G1, G1 = the episode reward
    client = ArealOpenAI(scripted(["1"]), tiny_tokenizer, G)
    with pytest.raises(ValueError, match="set_reward: 'nope' is not a completion"):
        client.set_reward("nope", 1.0)


def test_workflow_drops_a_group_whose_episode_raised_and_counts_it(tiny_tokenizer, scripted):
    async def flaky(client, item) -> float:
        await client.chat.completions.create(messages=item["messages"])
        if item["id"] == "bad":
            raise KeyError("the agent's own bug")
        return 0.5

    wf = AgentWorkflow(
        AgentConfig(), GenerationHyperparameters(n_samples=2), tiny_tokenizer, agent=flaky
    )
    engine = scripted(["a", "b", "c", "d"])
    group = asyncio.run(wf.arun_episode(engine, ITEM))
    assert [t.reward for t in group] == [0.5, 0.5] and {t.group_id for t in group} == {"q1"}
    assert asyncio.run(wf.arun_episode(engine, {**ITEM, "id": "bad"})) is None
    stats = wf.stats()
    assert stats["agent/episodes"] == 4 and stats["agent/episodes_failed"] == 2
    assert (
        stats["agent/groups_dropped"] == 1 and stats["agent/calls_per_episode"] == 1.0
    )  # of the 2 kept


def test_an_engine_failure_under_the_agent_stops_the_run_even_if_the_agent_catches_it(
    tiny_tokenizer, scripted
):
    async def swallowing(client, item) -> float:
        try:
            await client.chat.completions.create(messages=item["messages"])
        except Exception:
            return 0.0
        return 1.0

    engine = scripted([])  # no reply scripted: agenerate raises IndexError
    wf = AgentWorkflow(AgentConfig(), G, tiny_tokenizer, agent=swallowing)
    with pytest.raises(EngineFailure, match="inference engine failed"):
        asyncio.run(wf.arun_episode(engine, ITEM))
    assert wf.stats()["agent/episodes_failed"] == 0


def test_a_broken_agent_stops_the_run_once_most_recent_episodes_failed(tiny_tokenizer, scripted):
    async def broken(client, item) -> float:
        raise AttributeError("typo in the agent")

    wf = AgentWorkflow(AgentConfig(max_failure_fraction=0.5), G, tiny_tokenizer, agent=broken)
    for _ in range(WINDOW - 1):  # below a full window: counted and dropped, the run goes on
        assert asyncio.run(wf.arun_episode(scripted([]), ITEM)) is None
    with pytest.raises(AgentFailureRate, match="64 of the last 64 agent episodes raised.*typo"):
        asyncio.run(wf.arun_episode(scripted([]), ITEM))


def test_per_call_trajectories_with_groups_of_several_samples_are_refused(tiny_tokenizer):
    with pytest.raises(ValueError, match="gconfig.n_samples=4 groups"):
        AgentWorkflow(
            AgentConfig(trajectory="per_call"),
            GenerationHyperparameters(n_samples=4),
            tiny_tokenizer,
            agent=tool_agent,
        )
    with pytest.raises(ValueError, match="not an async function"):
        AgentWorkflow(AgentConfig(path="json:dumps"), G, tiny_tokenizer)
