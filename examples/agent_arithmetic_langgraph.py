"""The calculator agent of examples/agent_arithmetic.py written with LangGraph and
langchain-openai, as a program of its own: it trains through the agent proxy
(``workflow.type: agent_cmd``; examples/agent_arithmetic_langgraph.yaml, docs/agents.md).

Nothing in it knows about training. It reads one arithmetic item (JSON) on stdin, runs
LangGraph's prebuilt ReAct agent (``ChatOpenAI`` bound to one ``calc`` tool) against
``OPENAI_BASE_URL``/``OPENAI_API_KEY``, and posts its reward (1.0 for the right answer) to
``$OPENAI_BASE_URL/reward``. Outside training, with ``--base-url``, it runs the same agent on test
problems against any OpenAI-compatible server and prints its success rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import warnings

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError
from langgraph.prebuilt import create_react_agent

from agent_arithmetic import MAX_TOKENS, MAX_TURNS, calculator, mean_reward, question, run_episode, score


# langgraph 1.x points at langchain.agents.create_agent (another package); the prebuilt one stays
warnings.filterwarnings("ignore", message="create_react_agent has been moved")


@tool
def calc(e: str) -> str:
    """Evaluate an integer expression."""
    return calculator(json.dumps({"e": e}))


async def solve(llm: ChatOpenAI, item: dict) -> float:
    """One episode: the ReAct loop (model, tools, model, ...), scored."""
    graph = create_react_agent(llm, [calc])
    try:  # each model call and each tool round is a graph step
        state = await graph.ainvoke({"messages": [("user", question(item))]},
                                    {"recursion_limit": 2 * MAX_TURNS})
    except GraphRecursionError:  # no answer within MAX_TURNS calls scores 0
        return 0.0
    return score(str(state["messages"][-1].content), item["reference"])


def model(base_url: str | None = None, api_key: str | None = None) -> ChatOpenAI:
    return ChatOpenAI(model="areal", max_tokens=MAX_TOKENS, max_retries=0,
                      **({"base_url": base_url, "api_key": api_key} if base_url else {}))


async def evaluate(base_url: str, n: int, api_key: str) -> float:
    """Mean reward over ``n`` test problems against an OpenAI-compatible server."""
    llm = model(base_url, api_key)
    return await mean_reward(lambda item: solve(llm, item), n)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", help="run on test problems, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--n", type=int, default=20, help="test problems")
    parser.add_argument("--api-key", default="none", help="the server's key, if it has one")
    args = parser.parse_args()
    if args.base_url:
        print(f"mean reward: {asyncio.run(evaluate(args.base_url, args.n, args.api_key)):.3f}")
    else:
        llm = model()
        asyncio.run(run_episode(lambda item: solve(llm, item)))
