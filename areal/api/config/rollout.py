"""Rollout config section: the remote inference client and the workflow executor's admission.

Field paths in an experiment config are ``rollout.<field>`` (e.g. ``rollout.max_staleness``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from areal.api.config.loader import param


@dataclass(frozen=True)
class InferenceEngineConfig:
    """The HTTP client for generation servers plus the rollout executor's admission policy."""

    addresses: list[str] = param(
        [],
        help="Addresses host:port of servers started by hand; empty = the servers registered in "
        "the trial's name registry (cluster.name_resolve) by the launcher.",
    )
    backend: Literal["areal", "sglang", "vllm"] = param(
        "areal", help="Server kind: areal (ours, `areal serve`), sglang, or vllm."
    )
    served_model_name: str = param(
        "", help="The `model` field of OpenAI-style requests (backend=vllm only)."
    )
    vllm_python: str = param(
        "",
        help="backend=vllm: the Python the launcher starts vLLM servers with, i.e. that of a "
        "separate venv holding vLLM (`make vllm-env` builds .cache/venv-vllm/bin/python with the "
        "CPU build; docs/vllm.md); empty = this Python, with vLLM installed beside areal "
        "(`pip install -e '.[vllm]'`, CUDA).",
    )
    vllm_args: list[str] = param(
        [],
        help="backend=vllm: extra flags for `python -m vllm.entrypoints.openai.api_server`, "
        "e.g. ['--dtype', 'float32', '--enforce-eager'] on CPU.",
    )
    schedule_policy: Literal["round_robin", "least_requests"] = param(
        "round_robin",
        help="How a new group picks a server; all samples of one group stay on one server.",
    )
    setup_timeout: float = param(
        120.0,
        gt=0,
        help="Seconds to wait for servers to register (plus launcher.server_setup_timeout: "
        "a launcher starts the trainers beside its servers) and for every /health to pass.",
    )
    request_timeout: float = param(
        3600.0, gt=0, help="Seconds one agenerate call may take end to end (pauses included)."
    )
    request_retries: int = param(
        3,
        ge=0,
        help="Retries of one HTTP request after connection errors or HTTP 5xx, on another "
        "server. Back-pressure is not counted: a 503 with Retry-After, or a connection closed "
        "by a server that still answers /health, is sent again after a wait, within "
        "rollout.request_timeout.",
    )
    retry_backoff: float = param(
        0.2, ge=0, help="Seconds before the first retry; doubles on each further retry."
    )
    max_connections_per_server: int = param(
        128,
        ge=1,
        help="Most connections this client opens to one server for generation and scoring; "
        "more requests wait in the client, in order, within rollout.request_timeout. Keep the "
        "clients per server times this below server.max_connections less "
        "server.control_connections (968 by default): past that the server answers 503 with "
        "Retry-After, which clients take as back-pressure (they wait and send again), not as "
        "a dead server. Health and admin calls have connections of their own.",
    )
    server_failure_threshold: int = param(
        2, ge=1, help="Consecutive connection failures after which a server is declared dead."
    )
    server_restart_timeout: float = param(
        180.0,
        gt=0,
        help="When every server is dead and the launcher restarts servers "
        "(launcher.server_restarts > 0, rollout.backend=areal, weight_update_mode=disk): seconds "
        "the client waits (logged) for one to answer /health again before stopping the run. "
        "Without restarts it stops at once, naming the cause.",
    )
    weight_update_timeout: float = param(
        600.0, gt=0, help="Seconds every server gets to load new weights."
    )
    max_concurrent_rollouts: int = param(
        16, ge=1, help="Most workflow episodes running at once across all servers."
    )
    max_staleness: int = param(
        0,
        ge=0,
        help="Most weight versions a trained token may lag behind the trainer; 0 = synchronous.",
    )
    watchdog_timeout: float = param(
        600.0,
        gt=0,
        help="Stop the run when rollouts are running but none completes for this many seconds.",
    )

    def check(self) -> Iterator[str]:
        if self.backend == "vllm" and not self.served_model_name:
            yield (
                "served_model_name: backend=vllm needs the served model name, got ''; set "
                "rollout.served_model_name to the name given to `vllm serve`"
            )
        for i, addr in enumerate(self.addresses):
            host, sep, port = addr.split("://", 1)[-1].rpartition(":")
            if not sep or not host or not port.isdigit():
                yield (
                    f"addresses[{i}]: {addr!r} is not [http://]host:port; write e.g. "
                    "127.0.0.1:30000"
                )
