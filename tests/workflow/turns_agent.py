"""A test agent with nothing but the standard library (as an agent in any language would be):
it reads its item (JSON) on stdin, makes ``item["turns"]`` (default 1) chat calls to
``$OPENAI_BASE_URL`` with ``$OPENAI_API_KEY``, the first on ``item["question"]`` (default: the
item's last message, as a dataset item has it), each later one after the previous answer and a
user turn ``go on``, then posts reward 1.0. With ``PROXY_AGENT_OUT`` set it writes there, as
JSON, the logprobs it was answered, per call."""

from __future__ import annotations

import json
import os
import sys
import urllib.request


def post(path: str, body: dict) -> dict:
    request = urllib.request.Request(
        f"{os.environ['OPENAI_BASE_URL']}{path}",
        data=json.dumps(body).encode(),
        headers={
            "Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}",
            "Content-Type": "application/json",
        },
    )
    with urllib.request.urlopen(request, timeout=300) as answer:
        return json.loads(answer.read())


def main() -> None:
    item = json.loads(sys.stdin.readline())
    question = item.get("question") or item["messages"][-1]["content"]
    messages = [{"role": "user", "content": question}]
    seen = []
    for turn in range(item.get("turns", 1)):
        if turn:
            messages.append({"role": "user", "content": "go on"})
        out = post("/chat/completions", {"model": "areal", "messages": messages, "logprobs": True})
        message = out["choices"][0]["message"]
        messages.append({"role": "assistant", "content": message["content"]})
        seen.append([t["logprob"] for t in out["choices"][0]["logprobs"]["content"]])
    if os.environ.get("PROXY_AGENT_OUT"):
        path = os.path.join(os.environ["PROXY_AGENT_OUT"], f"{item['id']}-{os.getpid()}.json")
        with open(path, "w") as f:
            json.dump(seen, f)
    post("/reward", {"reward": 1.0})


if __name__ == "__main__":
    main()
