"""``python -m areal.launcher.agent_proxy_task [--host HOST] SCRIPT [--config YAML] [overrides]``:
the agent proxy (areal.workflow.agent_proxy) as a role of its own, started by every launcher
when ``workflow.type`` is ``agent_cmd`` (Lite and Core alike).

It builds a rollout client of its own to the trial's generation servers (found in the trial
registry, as the trainers find them; the same server-loss policy), loads the tokenizer the
trainers use, serves the proxy on ``HOST`` (default 127.0.0.1, one machine; a cluster node's
address otherwise) at ``--port`` (default: a free one) and registers ``host:port`` under the
trial's agent-proxy key once it serves. The control token comes by env (``AREAL_AGENT_PROXY_TOKEN``,
from the launcher, which gives the trainers the same one). While it runs it follows the registry's
server list
(Core's elastic scaling) every :data:`WATCH_S` seconds. SIGTERM/SIGINT stop it; it also stops
when the launcher that started it is gone.

Why its own process: agents in any language, on any node, reach one address for the whole run;
the chat-template rendering, tokenization and HTTP handling of many agents stay off the
trainer ranks' rollout loops. The episodes' admission (the staleness bound) stays where it is,
in the trainers' executors (Core: the generation manager), which open a session only for an
admitted episode; interruption on a weight update holds because the servers hold the requests
of a paused generation and this client re-submits prompt + partial output, and the servers tag
every token with its weight version (for a server that reports none, the newest version a
session was opened with).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from areal.api.config import ConfigError, load_config
from areal.api.launch import LaunchEnv, agent_proxy_token
from areal.launcher.common import load_script_config_class, parse_task_args
from areal.rollout.remote import RemoteInferenceEngine, discover_servers
from areal.runtime.rl import registration_wait, server_restarts
from areal.utils.logging import get_logger
from areal.utils.name_resolve import agent_proxy_key, gen_servers_key, make_repository
from areal.utils.process import die_with
from areal.workflow.agent_proxy import AgentProxy

logger = get_logger("agent_proxy_task")
WATCH_S = 2.0  # seconds between looks at the registry's server list


def _engine(cfg, registry) -> RemoteInferenceEngine:
    """The proxy's rollout client, on the servers the trial registered."""
    restarts, why_not = server_restarts(cfg, LaunchEnv.read())
    engine = RemoteInferenceEngine(
        cfg.rollout, api_key=cfg.server.api_key, server_restarts=restarts, no_restart_reason=why_not
    )
    key = gen_servers_key(cfg.experiment_name, cfg.trial_name)
    n = cfg.cluster.n_servers
    engine.initialize(discover_servers(cfg.rollout, registry, key, n, registration_wait(cfg)))
    return engine


async def _serve(
    proxy: AgentProxy, engine: RemoteInferenceEngine, host: str, port: int, cfg, registry
) -> None:
    """Serve and register, follow the server list, until SIGTERM/SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    address = await proxy.start(host, port)
    registry.add_subentry(agent_proxy_key(cfg.experiment_name, cfg.trial_name), address)
    logger.info("agent proxy serves on %s (registered for the trial)", address)
    servers_key = gen_servers_key(cfg.experiment_name, cfg.trial_name)
    try:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), WATCH_S)
            except TimeoutError:
                pass
            if stop.is_set() or cfg.rollout.addresses:
                continue
            listed = sorted(set(registry.get_subtree(servers_key)))
            if listed and listed != sorted(s.address for s in engine.servers):
                await asyncio.to_thread(engine.set_servers, listed)
    finally:
        await proxy.stop()


def run_agent_proxy(host: str, port: int, script: str, argv: list[str]) -> int:
    """Start, register and serve the agent proxy (see the module docstring); its exit code."""
    from transformers import AutoTokenizer

    cfg = load_config(load_script_config_class(script), argv)
    token = agent_proxy_token()
    if not token:
        raise ConfigError(
            ["AREAL_AGENT_PROXY_TOKEN: empty; the launcher that starts the agent proxy sets it"],
            "the agent proxy's environment",
        )
    launcher = LaunchEnv.read().launcher_pid
    if launcher:  # started by a launcher (here, a Ray actor, a batch step): stop with it
        die_with(launcher)
    registry = make_repository(cfg.cluster.name_resolve, cfg.name_resolve_root)
    engine = _engine(cfg, registry)
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_path or cfg.actor.path)
        max_bytes = int(cfg.workflow.agent.max_request_mb * (1 << 20))
        proxy = AgentProxy(tokenizer, engine, max_bytes, token, server=cfg.server)
        asyncio.run(_serve(proxy, engine, host, port, cfg, registry))
    finally:
        engine.destroy()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m areal.launcher.agent_proxy_task")
    parser.add_argument("--port", type=int, default=0, help="port to bind (0: a free one)")
    args = parse_task_args(parser, argv)
    try:
        return run_agent_proxy(args.host, args.port, args.script, args.rest)
    except (ConfigError, FileNotFoundError, TimeoutError, RuntimeError) as e:
        print(f"agent_proxy_task: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
