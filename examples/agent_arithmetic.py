"""A tool-using agent on the arithmetic task, written with the plain openai client.

The agent asks the bare question (``12 * 34 = ?``), may call a ``calc`` tool (argument ``e``, the
expression; several rounds), then answers with a number; its reward is 1.0 when the answer equals
the item's reference. Tool and wording are kept minimal on purpose: the tiny model's tokenizer
spends a token per character, and the whole prompt is ~60 tokens. Nothing in it knows about
training:

* train it: ``areal quickstart --task tools`` (SFT warm-up, then GRPO with
  examples/agent_arithmetic.yaml: ``workflow.type: agent``, ``workflow.agent.path:
  agent_arithmetic:calculator_agent``; docs/agents.md): each episode gets an in-process client
  backed by the rollout engine (areal.workflow.agent);
* run it against any OpenAI-compatible server, e.g. ``areal serve --model DIR --port 8000``:
  ``python examples/agent_arithmetic.py --base-url http://127.0.0.1:8000/v1`` (the agent asks
  for model ``areal``: serve with ``served_model_name=areal``).
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import operator
import re
import sys

MAX_TURNS = 3  # model calls per episode: tool rounds, then the answer
SFT_GUESS_FRACTION = 0.6  # warm-up conversations that answer in the head (the rest use the tool)
MAX_TOKENS = 80  # per call: a tool call ``<tool_call>\n{"name": "calc", ...}\n</tool_call>`` is ~70
TOOLS = [
    {
        "type": "function",
        "function": {  # evaluates an integer expression with + - * and parentheses
            "name": "calc",
            "parameters": {
                "type": "object",
                "properties": {"e": {"type": "string"}},
                "required": ["e"],
            },
        },
    }
]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _eval(node: ast.AST) -> int:
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int)
        and not isinstance(node.value, bool)
    ):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand)
    raise ValueError(f"unsupported expression element {ast.dump(node)[:40]}")


def calculator(arguments: str) -> str:
    """The tool: ``{"e": "12 * 7"}`` -> ``"84"``; a bad call gets an error text back (the model
    sees it, as it would from a real tool)."""
    try:
        expression = json.loads(arguments)["e"]
        if len(expression) > 200:
            return "error: expression too long"
        return str(_eval(ast.parse(expression, mode="eval").body))
    except (ValueError, KeyError, TypeError, SyntaxError, RecursionError) as e:
        return f"error: {e}"


def score(answer: str | None, reference: str) -> float:
    """1.0 when the last integer of the answer is the reference (a model's unparsable answer
    scores 0, as every wrong one does)."""
    numbers = re.findall(r"-?\d+", answer or "")
    return 1.0 if numbers and numbers[-1] == reference.strip() else 0.0


def question(item: dict) -> str:
    """The bare question of an arithmetic item (``12 * 34 = ?``), without the dataset's
    answer-format instruction: the agent's prompt stays short."""
    return item["messages"][-1]["content"].split(" = ?")[0] + " = ?"


async def calculator_agent(client, item: dict) -> float:
    """One episode: ask, run the calculator on each tool call, ask again, score the answer."""
    messages = [{"role": "user", "content": question(item)}]
    for _ in range(MAX_TURNS):
        response = await client.chat.completions.create(
            model="areal", messages=messages, tools=TOOLS, max_tokens=MAX_TOKENS
        )
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return score(message.content, item["reference"])
        for call in message.tool_calls:
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call.id,
                    "content": calculator(call.function.arguments),
                }
            )
    return 0.0  # no answer within MAX_TURNS calls


def _tools_system_turn(tokenizer) -> dict:
    """The system message that carries ``TOOLS`` as the chat template renders them for the agent's
    requests, so SFT and RL prompts agree; ValueError when the template is not ChatML."""
    probe = [{"role": "user", "content": "x"}]
    with_tools = tokenizer.apply_chat_template(probe, tools=TOOLS, tokenize=False)
    block = with_tools[
        : len(with_tools) - len(tokenizer.apply_chat_template(probe, tokenize=False))
    ]
    head, tail = "<|im_start|>system\n", "<|im_end|>\n"
    if not (block.startswith(head) and block.endswith(tail)):
        raise ValueError(
            f"the chat template renders tools as {block[:60]!r}..., not as a ChatML system turn"
        )
    return {"role": "system", "content": block[len(head) : -len(tail)]}


def _calculator_turns(expression: str, reference: str) -> list[dict]:
    """A worked answer: the calculator call on ``expression``, its result, the answer."""
    arguments = json.dumps({"e": expression})
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "calc", "arguments": arguments},
    }
    return [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": calculator(arguments)},
        {"role": "assistant", "content": reference},
    ]


def sft_conversations(tokenizer, n: int, guess_fraction: float = 0.0) -> list[dict]:
    """``n`` worked conversations on distinct training problems for an SFT warm-up: question,
    calculator call, its result, the answer; a seeded ``guess_fraction`` of them answer in one's
    head instead (``12 * 34 = 408``, no tool), as a model that has not learnt when to use its tool
    does. The tools turn is rendered as the template renders it for the agent's requests (a system
    message of the same text), so SFT and RL prompts agree."""
    import random

    from areal.api.config.data import ArithmeticConfig
    from areal.dataset.arithmetic import make_arithmetic

    if not 0.0 <= guess_fraction < 1.0:
        raise ValueError(
            f"guess_fraction={guess_fraction} must be in [0, 1): the share of "
            "conversations that answer without the tool"
        )
    system = _tools_system_turn(tokenizer)
    guesses = random.Random(0)
    rows = []
    for item in make_arithmetic(
        ArithmeticConfig(min_digits=2, max_digits=2, operators="*", n_train=n), "train"
    ):
        expression = question(item)[: -len(" = ?")]
        ask = [system, {"role": "user", "content": question(item)}]
        if guesses.random() < guess_fraction:
            guess = {"role": "assistant", "content": f"{expression} = {item['reference']}"}
            rows.append({"id": item["id"], "messages": [*ask, guess]})
        else:
            turns = _calculator_turns(expression, item["reference"])
            rows.append({"id": item["id"], "messages": [*ask, *turns]})
    return rows


async def mean_reward(solve, n: int) -> float:
    """Mean of ``await solve(item)`` over ``n`` test problems (two-digit products)."""
    from areal.api.config.data import ArithmeticConfig
    from areal.dataset.arithmetic import make_arithmetic

    items = make_arithmetic(
        ArithmeticConfig(min_digits=2, max_digits=2, operators="*", n_test=n), "test"
    )
    rewards = await asyncio.gather(*(solve(item) for item in items))
    return sum(rewards) / len(rewards)


async def run_episode(solve) -> None:
    """An agent program's training episode (``workflow.type: agent_cmd``): the item from stdin,
    ``await solve(item)`` scored, the reward posted to the proxy's ``$OPENAI_BASE_URL/reward``
    with the session's key."""
    import os

    import httpx

    reward = await solve(json.loads(sys.stdin.readline()))
    base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
    async with httpx.AsyncClient() as http:
        (
            await http.post(
                f"{base}/reward",
                json={"reward": reward},
                headers={"Authorization": f"Bearer {key}"},
            )
        ).raise_for_status()


def agent_program(doc: str, make_client, solve) -> None:
    """The command line of an agent program written with a framework: with ``--base-url``, its
    mean reward on test problems against that server; else one training episode
    (:func:`run_episode`). ``make_client(base_url, api_key)`` (None, None: the environment's
    ``OPENAI_BASE_URL``/``OPENAI_API_KEY``) gives what ``solve(client, item)`` runs on."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--base-url", help="run on test problems, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--n", type=int, default=20, help="test problems")
    parser.add_argument("--api-key", default="none", help="the server's key, if it has one")
    args = parser.parse_args()
    client = make_client(args.base_url, args.api_key if args.base_url else None)
    if args.base_url:
        print(
            f"mean reward: {asyncio.run(mean_reward(lambda item: solve(client, item), args.n)):.3f}"
        )
    else:
        asyncio.run(run_episode(lambda item: solve(client, item)))


async def _main(base_url: str, n: int, api_key: str) -> float:
    """Mean reward of the agent over ``n`` test problems against an OpenAI-compatible server."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key=api_key)
    return await mean_reward(lambda item: calculator_agent(client, item), n)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--base-url", help="run the agent on test problems, e.g. http://127.0.0.1:8000/v1"
    )
    parser.add_argument(
        "--n", type=int, default=20, help="problems to run (or conversations to write)"
    )
    parser.add_argument("--api-key", default="none", help="the server's key, if it has one")
    parser.add_argument(
        "--write-sft", metavar="JSONL", help="write --n SFT conversations here instead"
    )
    parser.add_argument(
        "--model", help="with --write-sft: the model dir whose chat template renders the tools"
    )
    args = parser.parse_args()
    if args.write_sft:
        from transformers import AutoTokenizer

        with open(args.write_sft, "w") as out:
            for row in sft_conversations(
                AutoTokenizer.from_pretrained(args.model), args.n, SFT_GUESS_FRACTION
            ):
                out.write(json.dumps(row) + "\n")
    elif args.base_url:
        print(f"mean reward: {asyncio.run(_main(args.base_url, args.n, args.api_key)):.3f}")
    else:
        parser.error("pass --base-url (run the agent) or --write-sft with --model (SFT data)")
    sys.exit(0)
