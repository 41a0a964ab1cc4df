"""A test agent in its own process, written with the real ``openai`` client against
``OPENAI_BASE_URL``/``OPENAI_API_KEY`` (what ``workflow.type: agent_cmd`` sets).

It reads its item (JSON) from stdin, asks with a ``calculator`` tool offered, answers each tool
call (the tool's result is ``84``), asks again, and posts reward 1.0 when the final answer is
the item's reference. Item flags choose its behaviour: ``stream`` (streamed answers), ``text``
(one ``/v1/completions`` call), ``die`` (SIGKILL itself after the first call), ``hang`` (never
posts a reward), ``no_reward`` (prints the answer and exits 0). With ``PROXY_AGENT_OUT`` set it
writes there, as JSON, the completion ids and logprobs it was answered.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import httpx
from openai import OpenAI

TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]


def ask(client: OpenAI, messages: list, stream: bool) -> tuple[dict, str, list]:
    """(the assistant message as a dict, the completion id, its logprobs) of one call."""
    if not stream:
        out = client.chat.completions.create(
            model="areal", messages=messages, tools=TOOLS, logprobs=True
        )
        lp = [t.logprob for t in out.choices[0].logprobs.content]
        return out.choices[0].message.model_dump(exclude_none=True), out.id, lp
    content, calls, cid = "", [], ""
    for chunk in client.chat.completions.create(
        model="areal", messages=messages, tools=TOOLS, stream=True
    ):
        cid = chunk.id
        for choice in chunk.choices:
            content += choice.delta.content or ""
            calls += [t.model_dump(exclude_none=True) for t in choice.delta.tool_calls or []]
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
    return message, cid, []


def main() -> None:
    item = json.loads(sys.stdin.readline())
    client = OpenAI()  # OPENAI_BASE_URL, OPENAI_API_KEY from the environment
    base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
    seen: dict = {"ids": [], "logprobs": [], "pid": os.getpid()}
    if item.get("text"):
        out = client.completions.create(
            model="areal", prompt=item["messages"][0]["content"], logprobs=1
        )
        seen["ids"].append(out.id)
        seen["logprobs"].append(out.choices[0].logprobs.token_logprobs)
        answer = out.choices[0].text
    else:
        messages = list(item["messages"])
        for _ in range(3):
            message, cid, lp = ask(client, messages, bool(item.get("stream")))
            seen["ids"].append(cid)
            seen["logprobs"].append(lp)
            messages.append(message)
            if item.get("die"):
                os.kill(os.getpid(), signal.SIGKILL)
            if not message.get("tool_calls"):
                break
            for call in message["tool_calls"]:
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": "84"})
        answer = message.get("content") or ""
    if os.environ.get("PROXY_AGENT_OUT"):
        with open(
            os.path.join(os.environ["PROXY_AGENT_OUT"], f"{item['id']}-{os.getpid()}.json"), "w"
        ) as f:
            json.dump(seen, f)
    print(f"agent {item['id']} answered {answer!r}", file=sys.stderr)
    if item.get("hang"):
        time.sleep(3600)
    if item.get("no_reward"):
        print(answer)
        return
    reward = 1.0 if answer.strip() == item.get("reference") else 0.0
    httpx.post(
        f"{base}/reward", json={"reward": reward}, headers={"Authorization": f"Bearer {key}"}
    ).raise_for_status()


if __name__ == "__main__":
    main()
