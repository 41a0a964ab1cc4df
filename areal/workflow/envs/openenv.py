"""``workflow.type: openenv``: episodes of an OpenEnv environment, one model turn per step.

``workflow.env`` names the environment: ``module:Class``, an ``openenv`` ``Environment``
subclass built once per episode in this process (``Class()``), or ``http://host:port``, a
running OpenEnv server, one websocket session per episode (openenv's ``GenericEnvClient``).

An episode: ``reset(seed=item["seed"])``; then, until the observation says ``done`` or the model
has taken ``workflow.max_turns`` turns, the observation is the next user message (its one text
field, else its fields as JSON), the model's reply fills the action's text field
(``workflow.env_action_field``; empty = the action class's only ``str`` field in process,
``message`` by address) and ``step(action)``. The episode's reward is the sum of the step rewards
that are not None; an episode with no reward at all, or a NaN/infinite one, fails (counted,
group dropped). Every reset and step runs under ``workflow.env_timeout``.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import typing
from typing import Any

from areal.api.config.base import GenerationHyperparameters
from areal.api.config.reward import WorkflowConfig
from areal.api.config.server import GenerationServerConfig
from areal.utils.imports import import_by_path
from areal.workflow.envs.base import EnvFault, EnvWorkflow
from areal.workflow.openai_client import DEFAULT_SERVER

_NOT_CONTENT = {"done", "reward", "metadata"}


def observation_text(obs: Any) -> str:
    """An observation (pydantic model or dict) as the user message: its one text field, else
    its fields but ``done``/``reward``/``metadata`` as JSON."""
    fields = obs.model_dump() if hasattr(obs, "model_dump") else dict(obs)
    content = {k: v for k, v in fields.items() if k not in _NOT_CONTENT}
    texts = [v for v in content.values() if isinstance(v, str)]
    if len(content) == 1 and texts:
        return texts[0]
    return json.dumps(content, default=str, ensure_ascii=False)


def action_class(env_cls: type) -> type:
    """The action type of an ``Environment[Act, Obs, State]`` subclass: its ``step``'s
    annotation, else the generic base's first argument."""
    hint = typing.get_type_hints(env_cls.step).get("action")
    if isinstance(hint, type):
        return hint
    for klass in env_cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            args = typing.get_args(base)
            if args and isinstance(args[0], type):
                return args[0]
    raise ValueError(
        f"workflow.env: {env_cls.__qualname__} declares no action type; annotate "
        "`def step(self, action: MyAction, ...)` or subclass Environment[MyAction, MyObs, State]"
    )


def text_field(action_cls: type, configured: str) -> str:
    """The action's field the reply fills: ``configured``, else its only ``str`` field."""
    fields = getattr(action_cls, "model_fields", {})
    if configured:
        if configured not in fields:
            raise ValueError(
                f"workflow.env_action_field: {configured!r} is not a field of "
                f"{action_cls.__qualname__} (fields: {sorted(fields)})"
            )
        return configured
    texts = [n for n, f in fields.items() if n != "metadata" and f.annotation is str]
    if len(texts) != 1:
        raise ValueError(
            f"workflow.env_action_field: empty, but {action_cls.__qualname__} has "
            f"{len(texts)} str fields ({texts}); name the one the model's reply fills"
        )
    return texts[0]


def _takes_seed(fn: Any) -> bool:
    params = inspect.signature(fn).parameters.values()
    return any(p.name == "seed" or p.kind is p.VAR_KEYWORD for p in params)


class _InProcess:
    """One episode's ``Environment`` instance: (text, reward, done) per reset and step."""

    def __init__(self, wf: OpenEnvWorkflow, env_cls: type, field: str, action_cls: type):
        self.wf, self.field, self.action_cls = wf, field, action_cls
        self.env = env_cls()

    async def reset(self, seed: int | None) -> tuple[str, Any, bool]:
        # an environment whose reset takes no seed (openenv's own template) is reset without one
        kw = {"seed": seed} if _takes_seed(self.env.reset) else {}
        obs = await self.wf.call_env("openenv reset", self.env.reset, **kw)
        return observation_text(obs), obs.reward, bool(obs.done)

    async def step(self, text: str) -> tuple[str, Any, bool]:
        action = self.action_cls(**{self.field: text})
        obs = await self.wf.call_env("openenv step", self.env.step, action)
        return observation_text(obs), obs.reward, bool(obs.done)

    async def close(self) -> None:
        await self.wf.call_env("openenv close", self.env.close)


class _Remote:
    """One episode's session on an OpenEnv server (websocket, ``GenericEnvClient``)."""

    def __init__(self, wf: OpenEnvWorkflow, url: str, field: str):
        from openenv.core.generic_client import GenericEnvClient

        self.wf, self.field = wf, field
        self.client = GenericEnvClient(base_url=url, message_timeout_s=wf.cfg.env_timeout)

    async def reset(self, seed: int | None) -> tuple[str, Any, bool]:
        await self.wf.call_env("openenv connect", self.client.connect)
        result = await self.wf.call_env("openenv reset", self.client.reset, seed=seed)
        return observation_text(result.observation), result.reward, bool(result.done)

    async def step(self, text: str) -> tuple[str, Any, bool]:
        result = await self.wf.call_env("openenv step", self.client.step, {self.field: text})
        return observation_text(result.observation), result.reward, bool(result.done)

    async def close(self) -> None:
        await self.wf.call_env("openenv close", self.client.close)


class OpenEnvWorkflow(EnvWorkflow):
    """Reset/step episodes of an OpenEnv environment (see the module docstring)."""

    kind = "openenv"

    def __init__(
        self,
        cfg: WorkflowConfig,
        gconfig: GenerationHyperparameters,
        tokenizer: Any,
        server: GenerationServerConfig = DEFAULT_SERVER,
    ):
        super().__init__(cfg, gconfig, tokenizer, server)
        self.remote = cfg.env.startswith(("http://", "https://"))
        if self.remote:
            self.field = cfg.env_action_field or "message"
        else:
            self.env_cls = import_by_path(cfg.env, "workflow.env")
            self.action_cls = action_class(self.env_cls)
            self.field = text_field(self.action_cls, cfg.env_action_field)

    def _session(self) -> _InProcess | _Remote:
        if self.remote:
            return _Remote(self, self.cfg.env, self.field)
        return _InProcess(self, self.env_cls, self.field, self.action_cls)

    async def episode(self, client: Any, item: dict) -> float:
        session = self._session()
        messages = list(item.get("messages") or [])
        rewards: list[Any] = []
        try:
            text, reward, done = await session.reset(item.get("seed"))
            rewards.append(reward)
            for _ in range(self.cfg.max_turns):
                if done:
                    break
                messages.append({"role": "user", "content": text})
                reply = await client.chat.completions.create(model="areal", messages=messages)
                message = reply.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                text, reward, done = await session.step(message.content or "")
                rewards.append(reward)
        finally:  # a close that fails is counted (env_errors) but costs the episode nothing
            with contextlib.suppress(EnvFault):
                await session.close()
        given = [r for r in rewards if r is not None]
        if not given:
            self.counts["env_bad_rewards"] += 1
            raise EnvFault(f"{self.cfg.env} gave no reward in the episode (every step's was None)")
        return sum(self.checked_reward(r, f"{self.cfg.env} step") for r in given)
