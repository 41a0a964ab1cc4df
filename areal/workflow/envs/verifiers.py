"""``workflow.type: verifiers``: a verifiers (v1) taskset's tasks, tools and rewards.

``workflow.env`` is ``module:function``: a function returning a ``vf.Taskset`` (called with
``split=`` when it takes one); the dataset path ``verifiers:module:function`` gives the same
tasks as items (areal.dataset.envs: the task's data as the reference). An episode rebuilds the
task from that data and plays it in this process: the task's system prompt and prompt as the
first messages, the ``@vf.tool`` methods of its toolsets (the taskset's and the task's
``toolsets()``) offered as functions; each reply that calls tools gets their results and the
model goes on, up to ``workflow.max_turns`` model turns, until a reply calls none. The
conversation becomes a ``vf.Trace`` and the task scores it (``Task.score``: its ``@vf.reward``
functions and plugged judges, weighted); the episode's reward is ``trace.reward``.

What runs here is verifiers' data and scoring layer, not its harnesses: no sandbox runtimes,
no interception server, and tools run as plain methods (a tool reading the rollout's
``state`` channel has none and fails its episode). Tool calls and scoring run under
``workflow.env_timeout``; a tool call the model wrote wrong (unknown name, bad JSON) is answered
with the error, as the model's own mistake, not the environment's.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from typing import Any

from areal.api.config.base import GenerationHyperparameters
from areal.api.config.reward import WorkflowConfig
from areal.api.config.server import GenerationServerConfig
from areal.dataset.envs import load_taskset, prompt_messages
from areal.workflow.envs.base import EnvWorkflow
from areal.workflow.openai_client import DEFAULT_SERVER


def tool_schema(name: str, fn: Callable[..., Any]) -> dict[str, Any]:
    """The openai function schema of a ``@vf.tool`` method, from its signature and docstring."""
    import pydantic

    fields = {
        p.name: (
            Any if p.annotation is p.empty else p.annotation,
            ... if p.default is p.empty else p.default,
        )
        for p in inspect.signature(fn).parameters.values()
    }
    params = pydantic.create_model(f"{name}_args", **fields).model_json_schema()  # type: ignore[call-overload]
    params.pop("title", None)
    return {
        "type": "function",
        "function": {"name": name, "description": (fn.__doc__ or "").strip(), "parameters": params},
    }


def _vf_message(m: dict[str, Any]) -> dict[str, Any]:
    """An openai-format message as verifiers' (its tool calls flat: id, name, arguments)."""
    calls = m.get("tool_calls")
    if m.get("role") != "assistant" or not calls:
        return m
    flat = [
        {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in calls
    ]
    return {**m, "tool_calls": flat}


def vf_trace(task: Any, messages: list[dict[str, Any]], n_prompt: int) -> Any:
    """The conversation as a ``vf.Trace`` of ``task``: one branch, the messages after the first
    ``n_prompt`` the model's where they are the assistant's."""
    import verifiers.v1 as vf
    from pydantic import TypeAdapter
    from verifiers.v1.graph import MessageNode

    adapter = TypeAdapter(vf.Message)
    trace = vf.Trace(
        task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        agent=vf.AgentInfo(config=vf.AgentConfig()),
    )
    for i, m in enumerate(messages):
        node = MessageNode(
            parent=i - 1 if i else None,
            message=adapter.validate_python(_vf_message(m)),
            sampled=m.get("role") == "assistant" and i >= n_prompt,
        )
        trace.nodes.append(node)
    return trace


class VerifiersWorkflow(EnvWorkflow):
    """A verifiers taskset's episodes, scored by its tasks (see the module docstring)."""

    kind = "verifiers"

    def __init__(
        self,
        cfg: WorkflowConfig,
        gconfig: GenerationHyperparameters,
        tokenizer: Any,
        server: GenerationServerConfig = DEFAULT_SERVER,
    ):
        super().__init__(cfg, gconfig, tokenizer, server)
        self.taskset = load_taskset(cfg.env)
        self.task_cls = type(self.taskset).task_type()

    def _tools(self, task: Any) -> dict[str, Callable[..., Any]]:
        from verifiers.v1.utils.decorators import discover_decorated

        toolsets = [
            *self.taskset.toolsets(self.taskset.config),
            *type(task).toolsets(task.config),
        ]
        return {
            getattr(fn, "tool_name", None) or fn.__name__: fn
            for toolset in toolsets
            for fn in discover_decorated(toolset, "tool")
        }

    async def _tool_result(self, tools: dict[str, Callable[..., Any]], call: Any) -> str:
        """A tool call's result; the model's malformed call is answered with its error."""
        fn = tools.get(call.function.name)
        if fn is None:
            return f"error: no tool {call.function.name!r}; the tools are {sorted(tools)}"
        try:
            args = json.loads(call.function.arguments or "{}")
        except ValueError as e:
            return f"error: the arguments are not JSON ({e})"
        if not isinstance(args, dict):
            return "error: the arguments must be a JSON object"
        try:
            inspect.signature(fn).bind(**args)
        except TypeError as e:
            return f"error: {e}"
        return str(await self.call_env(f"verifiers tool {call.function.name}", fn, **args))

    async def episode(self, client: Any, item: dict) -> float:
        data = self.task_cls.data_type().model_validate(item["reference"])
        task = self.task_cls(data, self.taskset.config.task)
        tools = self._tools(task)
        schemas = [tool_schema(name, fn) for name, fn in tools.items()] or None
        messages = prompt_messages(data)
        n_prompt = len(messages)
        for _ in range(self.cfg.max_turns):
            reply = await client.chat.completions.create(
                model="areal", messages=messages, **({"tools": schemas} if schemas else {})
            )
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                content = await self._tool_result(tools, call)
                messages.append(
                    {"role": "tool", "tool_call_id": call.id, "name": call.function.name,
                     "content": content}
                )  # fmt: skip
        trace = vf_trace(task, messages, n_prompt)
        await self.call_env(f"verifiers scoring of {self.task_cls.__name__}", task.score, trace)
        unscored = [name for name, r in trace.rewards.items() if r is None]
        if unscored:
            return self.checked_reward(None, f"verifiers reward {unscored[0]}")
        return self.checked_reward(trace.reward, f"verifiers scoring of {self.task_cls.__name__}")
