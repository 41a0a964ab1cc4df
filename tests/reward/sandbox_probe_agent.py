"""An agent that reports on its confinement (as JSON on stderr), then does its episode: one chat
call to ``$OPENAI_BASE_URL`` and reward 1.0. Its item names a host file it must not see."""

from __future__ import annotations

import json
import os
import sys
import urllib.request


def post(path: str, body: dict) -> dict:
    request = urllib.request.Request(
        f"{os.environ['OPENAI_BASE_URL']}{path}",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"},
    )
    with urllib.request.urlopen(request, timeout=120) as answer:
        return json.loads(answer.read())


def main() -> None:
    item = json.loads(sys.stdin.readline())
    facts = {
        "env": sorted(os.environ),
        "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
        "sees_secret": os.path.exists(item["secret"]),
        "cwd_writable": os.access(".", os.W_OK),
        "tmp_writable": os.access("/tmp", os.W_OK),
    }
    print(json.dumps(facts), file=sys.stderr, flush=True)
    post("/chat/completions", {"model": "areal", "messages": [{"role": "user", "content": "hi"}]})
    post("/reward", {"reward": 1.0})


if __name__ == "__main__":
    main()
