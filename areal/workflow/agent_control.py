"""The rollout side's end of the agent proxy (areal.workflow.agent_proxy): the control API's
client and the record of a session as it travels back.

A workflow that runs agent programs (areal.workflow.agent_cmd) opens one session per episode
with :meth:`ProxyClient.open` (its id and the key the agent gets), waits for it to end with
:meth:`ProxyClient.wait_ended` (long polls) and takes its record with :meth:`ProxyClient.close`:
the calls as :class:`~areal.workflow.openai_client.Call` objects, exactly as the proxy's
``ArealOpenAI`` recorded them (JSON carries ints and floats unchanged), the per-call rewards, the
posted reward, how many calls were refused (the agent's errors) and any engine failure. Every
control call has a deadline; a proxy that cannot be reached, or answers an error, is
:class:`ProxyUnavailable`, an infrastructure failure that stops the run.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from areal.api.config.base import GenerationHyperparameters
from areal.workflow.openai_client import Call, EngineFailure

CONTROL_TIMEOUT = 30.0  # seconds one control call may take, a long poll's hold excluded
POLL = 20.0  # seconds one long poll holds (the proxy caps it at its own MAX_WAIT)


class ProxyUnavailable(EngineFailure):
    """The agent proxy could not be reached or refused a control call: infrastructure."""


@dataclass
class SessionRecord:
    """What a session recorded, as the workflow turns it into trajectories."""

    reward: float | None  # the posted episode reward; None when none was posted
    why: str  # how the session ended: reward | closed | deadline | stopped
    calls: list[Call]
    call_rewards: dict[int, float]  # turn -> reward the agent gave that call
    engine_failure: str | None  # the engine failure under a call, if any
    rejected: int  # calls refused for what they asked (by the client or the server)


def record_of(session: Any) -> dict:
    """A proxy session's record as JSON (the proxy's side of :func:`record_from`)."""
    client = session.client
    failure = client.engine_failure
    return {
        "reward": session.reward,
        "why": session.why,
        "calls": [dataclasses.asdict(c) for c in client.calls],
        "call_rewards": {str(k): v for k, v in client.call_rewards.items()},
        "engine_failure": None if failure is None else str(failure),
        "rejected": client.n_rejected,
    }


def record_from(body: dict) -> SessionRecord:
    """The record the proxy sent (:func:`record_of`)."""
    return SessionRecord(
        None if body["reward"] is None else float(body["reward"]),
        str(body["why"]),
        [Call(**c) for c in body["calls"]],
        {int(k): float(v) for k, v in body["call_rewards"].items()},
        body["engine_failure"],
        int(body["rejected"]),
    )


class ProxyClient:
    """The control API of the agent proxy at ``address`` (``host:port``), with ``token``."""

    def __init__(self, address: str, token: str):
        if not address or not token:
            raise ValueError(
                "agent proxy: need its address and the run's control token "
                f"(address={address!r}, token {'set' if token else 'empty'})"
            )
        self.address = address
        self.base_url = f"http://{address}/v1"  # what agents get as OPENAI_BASE_URL
        self._token = token
        self._http: aiohttp.ClientSession | None = None

    async def _post(self, path: str, body: dict, hold: float = 0.0) -> dict:
        if self._http is None:  # created on the loop that uses it
            self._http = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0),
                headers={"Authorization": f"Bearer {self._token}"},
            )
        url = f"http://{self.address}{path}"
        try:
            timeout = aiohttp.ClientTimeout(total=CONTROL_TIMEOUT + hold)
            async with self._http.post(url, json=body, timeout=timeout) as resp:
                answer = await resp.json(content_type=None)
                if resp.status != 200:
                    message = (answer.get("error") or {}).get("message", answer)
                    raise ProxyUnavailable(
                        f"agent proxy at {self.address}: {path.split('/')[-1]} answered "
                        f"HTTP {resp.status}: {message}"
                    )
                return answer
        except (TimeoutError, aiohttp.ClientError, ValueError) as e:
            raise ProxyUnavailable(
                f"agent proxy at {self.address} unreachable ({path.split('/')[-1]}): {e!r}; "
                "see RUN_DIR/logs/agent_proxy.log"
            ) from e

    async def open(
        self,
        group_id: str,
        name: str,
        gconfig: GenerationHyperparameters,
        version: int,
        timeout: float,
    ) -> tuple[str, str]:
        """(session id, session key) of a new session dropped after ``timeout`` s unclosed."""
        body = {
            "group_id": group_id,
            "name": name,
            "gconfig": dataclasses.asdict(gconfig),
            "version": version,
            "timeout": timeout,
        }
        answer = await self._post("/control/sessions", body)
        return answer["id"], answer["key"]

    async def wait_ended(self, session_id: str, timeout: float) -> str:
        """How the session ended (``reward``, ...), or '' when ``timeout`` s passed first."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            hold = min(left, POLL)
            answer = await self._post(
                f"/control/sessions/{session_id}/wait", {"timeout": hold}, hold
            )
            if answer["ended"]:
                return answer["why"]
        return ""

    async def close(self, session_id: str) -> SessionRecord:
        """End the session (its key is refused from now on) and take its record."""
        return record_from(await self._post(f"/control/sessions/{session_id}/close", {}))

    async def aclose(self) -> None:
        """Close the HTTP session (on the loop that used it)."""
        if self._http is not None:
            await self._http.close()
            self._http = None
