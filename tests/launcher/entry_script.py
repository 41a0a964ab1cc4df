"""A launcher entry script for tests: records itself, then behaves as AREAL_TEST_BEHAVIOUR says.

``AREAL_TEST_CONFIG``: ``grpo`` (servers; the default) or ``sft`` (no servers).
``AREAL_TEST_BEHAVIOUR``:
  ok          every server registered for the trial answers /health; exit 0
  exit3       exit with code 3
  raise       raise an exception (torchrun reports a failed worker)
  raise_new   raise an exception naming the attempt: each attempt fails with another cause
  sleep       sleep until killed
  stubborn    ignore SIGTERM, sleep until SIGKILLed
  fail_first  exit 3 on launch attempt 0, exit 0 on later attempts
  heartbeat   watch the process that started it as a trainer rank does, then append a line to
              RUN_DIR/heartbeat every 20 ms until stopped
  agent_proxy (workflow.type=agent_cmd) open a session on the launcher's agent proxy role, make
              a chat call with its key as an agent would, close it: the record holds the call;
              writes RUN_DIR/agent_proxy.json (the proxy's address and the call's token count)
Each start appends {"attempt", "pid", "ppid", "addrs"} to RUN_DIR/entry.jsonl.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.request

from areal.api.config import GRPOConfig, SFTConfig, load_config
from areal.api.launch import LaunchEnv
from areal.utils.name_resolve import gen_servers_key, make_repository

CONFIG = SFTConfig if os.environ.get("AREAL_TEST_CONFIG") == "sft" else GRPOConfig


def main(argv: list[str]) -> int:
    cfg = load_config(CONFIG, argv)
    behaviour = os.environ["AREAL_TEST_BEHAVIOUR"]
    attempt = LaunchEnv.read().attempt
    registry = make_repository(cfg.cluster.name_resolve, cfg.name_resolve_root)
    key, n = gen_servers_key(cfg.experiment_name, cfg.trial_name), cfg.cluster.n_servers
    # the launcher starts this script beside the servers: wait for them as trainers do
    addrs = registry.wait_subtree(key, n, 120) if n else registry.get_subtree(key)
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    with open(cfg.run_dir / "entry.jsonl", "a") as f:
        f.write(
            json.dumps(
                {"attempt": attempt, "pid": os.getpid(), "ppid": os.getppid(), "addrs": addrs}
            )
            + "\n"
        )
    if behaviour == "ok":
        for addr in addrs:
            with urllib.request.urlopen(f"http://{addr}/health", timeout=10) as r:
                assert r.status == 200, f"{addr}/health answered {r.status}"
        return 0
    if behaviour == "exit3" or (behaviour == "fail_first" and attempt == 0):
        return 3
    if behaviour == "fail_first":
        return 0
    if behaviour == "raise":
        raise RuntimeError("entry script failed on purpose")
    if behaviour == "raise_new":
        raise RuntimeError(f"entry script failed on purpose on attempt {attempt}")
    if behaviour == "heartbeat":
        from areal.runtime.run import die_with_starter

        die_with_starter(LaunchEnv.read())
        while True:
            with open(cfg.run_dir / "heartbeat", "a") as f:
                f.write(f"{time.time()}\n")
            time.sleep(0.02)
    if behaviour == "agent_proxy":
        return agent_proxy_session(cfg)
    if behaviour == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if behaviour in ("sleep", "stubborn"):
        time.sleep(600)
        return 0
    raise ValueError(f"unknown AREAL_TEST_BEHAVIOUR={behaviour!r}")


def agent_proxy_session(cfg) -> int:
    """The ``agent_proxy`` behaviour (module docstring)."""
    import asyncio

    import aiohttp

    from areal.api.config.base import GenerationHyperparameters
    from areal.runtime.rl import agent_proxy_client

    async def session() -> dict:
        proxy = agent_proxy_client(cfg)
        g = GenerationHyperparameters(max_new_tokens=4)
        try:
            sid, key = await proxy.open("g0", "g0/0", g, 0, timeout=60.0)
            chat = {"model": "areal", "messages": [{"role": "user", "content": "1 + 1 = ?"}]}
            async with aiohttp.ClientSession() as http:
                async with http.post(
                    f"{proxy.base_url}/chat/completions",
                    json=chat,
                    headers={"Authorization": f"Bearer {key}"},
                ) as resp:
                    assert resp.status == 200, await resp.text()
            record = await proxy.close(sid)
        finally:
            await proxy.aclose()
        assert len(record.calls) == 1 and record.calls[0].completion_ids, record
        return {"address": proxy.address, "tokens": len(record.calls[0].completion_ids)}

    (cfg.run_dir / "agent_proxy.json").write_text(json.dumps(asyncio.run(session())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
