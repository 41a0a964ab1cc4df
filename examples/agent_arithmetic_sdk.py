"""The calculator agent of examples/agent_arithmetic.py written with the OpenAI Agents SDK
(``openai-agents``), as a program of its own: it trains through the agent proxy
(``workflow.type: agent_cmd``; examples/agent_arithmetic_sdk.yaml, docs/agents.md).

Nothing in it knows about training. It reads one arithmetic item (JSON) on stdin, runs an SDK
``Agent`` with one ``calc`` tool against ``OPENAI_BASE_URL``/``OPENAI_API_KEY`` through the chat
completions API (the proxy serves chat completions, not the Responses API), and posts its reward
(1.0 for the right answer) to ``$OPENAI_BASE_URL/reward``. Outside training, with ``--base-url``,
it runs the same agent on test problems against any OpenAI-compatible server and prints its
success rate.
"""

from __future__ import annotations

import json

from agent_arithmetic import MAX_TOKENS, MAX_TURNS, agent_program, calculator, question, score
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from agents.exceptions import AgentsException
from openai import AsyncOpenAI


@function_tool
def calc(e: str) -> str:
    return calculator(json.dumps({"e": e}))


async def solve(client: AsyncOpenAI, item: dict) -> float:
    """One episode: the SDK's agent loop (tool rounds, then the answer), scored."""
    agent = Agent(
        name="calc",
        instructions=None,
        tools=[calc],
        model=OpenAIChatCompletionsModel(model="areal", openai_client=client),
        model_settings=ModelSettings(max_tokens=MAX_TOKENS),
    )
    try:
        result = await Runner.run(agent, question(item), max_turns=MAX_TURNS)
    except AgentsException:  # ran out of turns or a malformed call: the model's failure scores 0
        return 0.0
    return score(str(result.final_output), item["reference"])


if __name__ == "__main__":
    set_tracing_disabled(True)  # no traces uploaded anywhere
    agent_program(
        __doc__, lambda base_url, api_key: AsyncOpenAI(base_url=base_url, api_key=api_key), solve
    )
