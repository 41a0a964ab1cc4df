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

import json
import warnings

from agent_arithmetic import MAX_TOKENS, MAX_TURNS, agent_program, calculator, question, score
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError
from langgraph.prebuilt import create_react_agent

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
        state = await graph.ainvoke(
            {"messages": [("user", question(item))]}, {"recursion_limit": 2 * MAX_TURNS}
        )
    except GraphRecursionError:  # no answer within MAX_TURNS calls scores 0
        return 0.0
    return score(str(state["messages"][-1].content), item["reference"])


def model(base_url: str | None = None, api_key: str | None = None) -> ChatOpenAI:
    return ChatOpenAI(
        model="areal",
        max_tokens=MAX_TOKENS,
        max_retries=0,
        **({"base_url": base_url, "api_key": api_key} if base_url else {}),
    )


if __name__ == "__main__":
    agent_program(__doc__, model, solve)
