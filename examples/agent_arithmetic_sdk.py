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

import argparse
import asyncio
import json
from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from agents.exceptions import AgentsException
from openai import AsyncOpenAI

from agent_arithmetic import MAX_TOKENS, MAX_TURNS, calculator, mean_reward, question, run_episode, score


@function_tool
def calc(e: str) -> str:
    return calculator(json.dumps({"e": e}))


async def solve(client: AsyncOpenAI, item: dict) -> float:
    """One episode: the SDK's agent loop (tool rounds, then the answer), scored."""
    agent = Agent(name="calc", instructions=None, tools=[calc],
                  model=OpenAIChatCompletionsModel(model="areal", openai_client=client),
                  model_settings=ModelSettings(max_tokens=MAX_TOKENS))
    try:
        result = await Runner.run(agent, question(item), max_turns=MAX_TURNS)
    except AgentsException:  # ran out of turns or a malformed call: the model's failure scores 0
        return 0.0
    return score(str(result.final_output), item["reference"])


async def evaluate(base_url: str, n: int, api_key: str) -> float:
    """Mean reward over ``n`` test problems against an OpenAI-compatible server."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key)
    return await mean_reward(lambda item: solve(client, item), n)


if __name__ == "__main__":
    set_tracing_disabled(True)  # no traces uploaded anywhere
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", help="run on test problems, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--n", type=int, default=20, help="test problems")
    parser.add_argument("--api-key", default="none", help="the server's key, if it has one")
    args = parser.parse_args()
    if args.base_url:
        print(f"mean reward: {asyncio.run(evaluate(args.base_url, args.n, args.api_key)):.3f}")
    else:
        client = AsyncOpenAI()
        asyncio.run(run_episode(lambda item: solve(client, item)))
