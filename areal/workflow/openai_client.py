"""An in-process OpenAI client for agent workflows: ``client.chat.completions.create(...)`` as
``openai.AsyncOpenAI`` has it, answered by an :class:`~areal.api.engine.InferenceEngine`
instead of HTTP, with every call recorded in tokens for training.

What it does per call, the way our server's ``/v1/chat/completions`` does it (so an agent gets
the same answers from either; tests/workflow/test_agent.py runs one agent both ways):

* renders ``messages`` (and ``tools``) with the tokenizer's chat template, locally;
* generates ``n`` completions through ``engine.agenerate`` (token ids, behaviour logprobs, the
  weight version of each token), sharing the episode's ``group_id`` for routing;
* reads tool calls out of the answer with the server's parser (areal.utils.tool_calls);
* forces a call for ``tool_choice`` ``required`` or ``{"type": "function", "function": {"name":
  F}}`` as the server does (the same areal.utils.tool_calls.tool_choice_prefill): the assistant's
  answer is opened with ``<tool_call>\n`` (+ ``{"name": "F", "arguments": ``), tokens appended to
  the prompt and recorded as prompt (:attr:`Call.prefill`), never as generated tokens, so they
  are never trained on; the opening + the generated text is what is parsed, and a continuation
  that makes no valid call comes back as text with the generator's finish reason;
* returns an ``openai.types.chat.ChatCompletion`` and records a :class:`Call` per completion.

Training constraints, each an error that names the argument and the fix rather than a silent
change: ``temperature`` must be the rollout's (``gconfig.temperature``, which the trainer's
logprobs use), ``stream`` is refused, a ``tool_choice`` naming a function not in ``tools`` (or
malformed) is an error naming ``tool_choice``, as on the server, and ``max_tokens`` is capped by
``gconfig.max_new_tokens``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from areal.api.config.base import GenerationHyperparameters
from areal.api.engine import InferenceEngine
from areal.api.io import ModelRequest, ModelResponse
from areal.dataset.chat import encode
from areal.utils.tool_calls import extract_tool_calls, tool_choice_prefill

if TYPE_CHECKING:  # the SDK (~0.7 s to import) is loaded by the first answer, not by importers
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

_KNOWN = {
    "messages",
    "model",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "temperature",
    "top_p",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "stop",
    "seed",
    "logprobs",
    "top_logprobs",
    "stream",
    "user",
}
_KNOWN_TEXT = {
    "prompt",
    "model",
    "temperature",
    "top_p",
    "max_tokens",
    "n",
    "stop",
    "seed",
    "logprobs",
    "stream",
    "user",
    "echo",
    "best_of",
    "suffix",
}


@dataclass
class Call:
    """One completion the agent was given: what the model saw and said, in tokens."""

    turn: int  # index of the create() call within the episode (n choices share it)
    choice: int  # index among the call's n choices
    completion_id: str  # ChatCompletion.id of the call
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # behaviour logprob per completion token
    versions: list[int]  # weight version per completion token
    stop_reason: str  # "stop" | "length"
    # how many of prompt_ids' last tokens are the forced tool-call opening (tool_choice required
    # or a named function): the model was conditioned on them, it did not generate them
    prefill: int = 0
    server: str = ""  # the generation server(s) that answered (ModelResponse.server)


class EngineFailure(RuntimeError):
    """The inference engine failed under an agent's call: an infrastructure error that must stop
    the run, never be counted as the agent's failure (see AgentWorkflow)."""


def _message_dict(m: Any, i: int) -> dict:
    """A message as a dict: the agent may pass back the pydantic message it was given."""
    if hasattr(m, "model_dump"):
        m = m.model_dump(exclude_none=True)
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ValueError(f"messages[{i}]: expected a dict with a string 'role', got {m!r}")
    return m


def clean_messages(messages: Any) -> list[dict]:
    """``messages`` in the shape the chat template is given, as the server's parse_chat builds it:
    assistant turns keep their ``tool_calls`` (arguments as JSON strings), text content parts
    are joined, ``tool`` turns need a ``tool_call_id``."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: expected a non-empty list of {role, content}")
    clean = []
    for i, raw in enumerate(messages):
        m = _message_dict(raw, i)
        content = m.get("content")
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = []
            for j, c in enumerate(m["tool_calls"]):
                fn = c.get("function") if isinstance(c, dict) else None
                if (
                    not isinstance(fn, dict)
                    or not isinstance(fn.get("name"), str)
                    or not isinstance(fn.get("arguments"), str)
                ):
                    raise ValueError(
                        f"messages[{i}].tool_calls[{j}]: expected {{id, type: function, "
                        "function: {name: str, arguments: JSON string}}"
                    )
                calls.append(
                    {
                        "id": str(c.get("id", "")),
                        "type": "function",
                        "function": {"name": fn["name"], "arguments": fn["arguments"]},
                    }
                )
            clean.append({"role": "assistant", "content": content or "", "tool_calls": calls})
            continue
        if m["role"] == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise ValueError(
                f"messages[{i}].tool_call_id: a tool message needs the tool_call_id it answers"
            )
        if isinstance(content, list):
            if not all(isinstance(c, dict) and c.get("type") == "text" for c in content):
                raise ValueError(f"messages[{i}].content: only text content parts are supported")
            content = "".join(str(c.get("text", "")) for c in content)
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content: expected a string, got {content!r}")
        clean.append({"role": m["role"], "content": content})
    return clean


def check_tools(tools: Any, tool_choice: Any, template: str) -> tuple[list[dict] | None, bool, str]:
    """(``tools`` for the template or None, whether to parse tool calls, the text that opens the
    assistant's answer: empty unless ``tool_choice`` forces a call), as the server decides."""
    if tools is not None:
        if not isinstance(tools, list) or not tools:
            raise ValueError(
                "tools: expected a non-empty list of {type: function, function: {...}}"
            )
        for i, t in enumerate(tools):
            fn = t.get("function") if isinstance(t, dict) else None
            if (
                not isinstance(fn, dict)
                or t.get("type") != "function"
                or not isinstance(fn.get("name"), str)
            ):
                raise ValueError(
                    f'tools[{i}]: expected {{"type": "function", "function": {{"name": ...}}}}'
                )
        if "tools" not in template:
            raise ValueError(
                "tools: this model's chat template does not render tools, so the model would "
                "never see them; use a model whose template does (e.g. Qwen2.5)"
            )
    prefill = tool_choice_prefill(
        tool_choice, None if tools is None else [t["function"]["name"] for t in tools]
    )
    return tools, tools is not None and tool_choice != "none", prefill


def signature(content: str | None, tool_calls: list[dict]) -> tuple:
    """What identifies an assistant message the client returned when the agent passes it back."""
    return content or "", tuple(
        (c["function"]["name"], c["function"]["arguments"]) for c in tool_calls
    )


def render_prompt(
    tokenizer: Any, messages: list[dict], tools: list[dict] | None, generated: dict[tuple, Call]
) -> list[int]:
    """Prompt ids of ``messages`` by the chat template, with the model's own tokens for every
    assistant turn this client generated (``generated``: signature -> call).

    Such a turn is rendered as a placeholder, then replaced by the call's forced tool-call
    opening (its prompt's last ``prefill`` ids, if any) and completion ids (whose stop token
    stands for the template's end-of-turn token right after it). The result equals the plain
    rendering whenever the model's answer re-encodes to the same tokens, and otherwise keeps what
    the model generated (invalid UTF-8 bytes, special tokens, tool-call JSON spaced its own way)
    instead of a re-encoding of the decoded text, so an append-only template gives each call a
    prompt that extends the previous call's prompt + completion. A template that drops or alters
    the placeholder gets the plain rendering.
    """
    spliced, turns = [], []
    for i, m in enumerate(messages):
        call = (
            generated.get(signature(m["content"], m.get("tool_calls", [])))
            if m["role"] == "assistant"
            else None
        )
        if call is not None:
            turns.append(call)
            m = {"role": "assistant", "content": f"AREALTURN{i}X{uuid.uuid4().hex}"}
        spliced.append(m)
    if turns:
        text = tokenizer.apply_chat_template(
            spliced, tools=tools, add_generation_prompt=True, tokenize=False
        )
        marks = [m["content"] for m, orig in zip(spliced, messages) if m is not orig]
        if all(text.count(mark) == 1 for mark in marks):
            return _splice(tokenizer, text, marks, turns)
    text = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )
    return encode(tokenizer, text)


def _splice(tokenizer: Any, text: str, marks: list[str], turns: list[Call]) -> list[int]:
    """Token ids of ``text`` with each placeholder replaced by its call's completion ids."""
    ids: list[int] = []
    rest = text
    for mark, call in zip(marks, turns):
        head, rest = rest.split(mark, 1)
        opening = call.prompt_ids[len(call.prompt_ids) - call.prefill :]  # [] without a forced call
        ids += encode(tokenizer, head) + opening + call.completion_ids
        # a call that stopped on its stop token (EOS, <|im_end|>, ...) already holds the template's
        # end-of-turn token, which the template writes right after the content
        end = tokenizer.decode(call.completion_ids[-1:]) if call.stop_reason == "stop" else ""
        if end and rest.startswith(end):
            rest = rest[len(end) :]
    return ids + encode(tokenizer, rest)


class _Completions:
    def __init__(self, client: ArealOpenAI):
        self._client = client

    async def create(self, **kwargs: Any) -> ChatCompletion:
        """``chat.completions.create`` (keyword arguments, as in openai's client)."""
        return await self._client.create(**kwargs)


class _Chat:
    def __init__(self, client: ArealOpenAI):
        self.completions = _Completions(client)


class ArealOpenAI:
    """Drop-in for the part of ``openai.AsyncOpenAI`` an agent uses (``chat.completions.create``);
    one client per episode, whose :attr:`calls` are the episode's record."""

    def __init__(
        self,
        engine: InferenceEngine,
        tokenizer: Any,
        gconfig: GenerationHyperparameters,
        group_id: str | None = None,
        model: str = "areal",
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.gconfig = gconfig
        self.group_id = group_id
        self.model = model
        self.chat = _Chat(self)
        self.calls: list[Call] = []
        self.call_rewards: dict[int, float] = {}  # turn -> reward the agent gave that call
        self.engine_failure: EngineFailure | None = None
        self._turn_of: dict[str, int] = {}
        self._generated: dict[tuple, Call] = {}  # signature of a returned message -> its call

    def set_reward(self, completion_id: str, reward: float) -> None:
        """Give the call that returned ``completion_id`` its own reward (see episode_returns)."""
        if completion_id not in self._turn_of:
            raise ValueError(
                f"set_reward: {completion_id!r} is not a completion of this episode's client"
            )
        self.call_rewards[self._turn_of[completion_id]] = float(reward)

    def _gconfig(self, kw: dict) -> GenerationHyperparameters:
        g = self.gconfig
        temperature = kw.get("temperature")
        if temperature is not None and abs(float(temperature) - g.temperature) > 1e-6:
            raise ValueError(
                f"temperature: {temperature} differs from the rollout's gconfig.temperature "
                f"{g.temperature}, which the trainer's logprobs use; drop it from the call "
                f"or set gconfig.temperature={temperature}"
            )
        limit = kw.get("max_completion_tokens") or kw.get("max_tokens") or g.max_new_tokens
        if not isinstance(limit, int) or limit < 1:
            raise ValueError(f"max_tokens: expected a positive int, got {limit!r}")
        stop = kw.get("stop") or []
        stop = [stop] if isinstance(stop, str) else list(stop)
        top_p = g.top_p if kw.get("top_p") is None else float(kw["top_p"])
        return dataclasses.replace(
            g,
            n_samples=1,
            max_new_tokens=min(limit, g.max_new_tokens),
            top_p=top_p,
            stop=stop or list(g.stop),
        )

    def _check_args(self, kw: dict) -> int:
        unknown = sorted(set(kw) - _KNOWN)
        if unknown:
            raise TypeError(
                f"chat.completions.create: unsupported arguments {unknown} "
                f"(supported: {sorted(_KNOWN)})"
            )
        if kw.get("stream"):
            raise ValueError(
                "stream: streaming is not supported in training; call with stream=False"
            )
        if kw.get("top_logprobs"):
            raise ValueError("top_logprobs: not available from the rollout engine; leave it unset")
        n = kw.get("n") or 1
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n: expected a positive int, got {n!r}")
        return n

    async def _generate(
        self,
        prompt: list[int],
        prefill: int,
        gconfig: GenerationHyperparameters,
        n: int,
        seed: Any,
        id_prefix: str = "chatcmpl",
    ) -> tuple[str, list[ModelResponse]]:
        """Generate ``n`` completions of ``prompt`` and record a :class:`Call` for each: (the
        completion id, the responses). The one recording path of chat and text completions, in
        process and through the agent proxy (areal.workflow.agent_proxy)."""
        reqs = [
            ModelRequest(
                input_ids=list(prompt),
                gconfig=gconfig,
                group_id=self.group_id,
                seed=None if seed is None else seed + i,
            )
            for i in range(n)
        ]
        try:
            resps = await asyncio.gather(*(self.engine.agenerate(r) for r in reqs))
        except Exception as e:  # the engine retried and failed over already: infrastructure
            self.engine_failure = EngineFailure(
                f"inference engine failed under an agent call: {e!r}"
            )
            raise self.engine_failure from e
        turn, cid = len(self._turn_of), f"{id_prefix}-{uuid.uuid4().hex}"
        self._turn_of[cid] = turn
        for i, r in enumerate(resps):
            if r.stop_reason not in ("stop", "length"):
                self.engine_failure = EngineFailure(f"generation ended with {r.stop_reason!r}")
                raise self.engine_failure
            self.calls.append(
                Call(
                    turn,
                    i,
                    cid,
                    list(prompt),
                    list(r.output_ids),
                    list(r.output_logprobs),
                    list(r.output_versions),
                    r.stop_reason,
                    prefill,
                    r.server,
                )
            )
        return cid, resps

    async def create(self, **kw: Any) -> ChatCompletion:
        """Render, generate ``n`` completions, parse tool calls, record, answer."""
        n = self._check_args(kw)
        template = self.tokenizer.chat_template or ""
        tools, parse_calls, prefill = check_tools(
            kw.get("tools"), kw.get("tool_choice", "auto"), template
        )
        prompt = render_prompt(
            self.tokenizer, clean_messages(kw.get("messages")), tools, self._generated
        )
        opening = encode(self.tokenizer, prefill) if prefill else []  # prompt, as on the server
        prompt += opening
        gconfig = self._gconfig(kw)
        cid, resps = await self._generate(prompt, len(opening), gconfig, n, kw.get("seed"))
        choices = []
        for i, r in enumerate(resps):
            choices.append(
                self._choice(i, r, gconfig, prefill, parse_calls, bool(kw.get("logprobs")))
            )
            message = choices[-1]["message"]
            self._generated[signature(message["content"], message.get("tool_calls", []))] = (
                self.calls[len(self.calls) - n + i]
            )
        n_out = sum(len(r.output_ids) for r in resps)
        from openai.types.chat import ChatCompletion

        return ChatCompletion.model_validate(
            {
                "id": cid,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": kw.get("model") or self.model,
                "choices": choices,
                "usage": {
                    "prompt_tokens": len(prompt),
                    "completion_tokens": n_out,
                    "total_tokens": len(prompt) + n_out,
                },
            }
        )

    async def complete(self, **kw: Any) -> Completion:
        """``completions.create`` (the legacy text API): ``prompt`` as a string or token ids,
        generated and recorded as a chat call is; no chat template, no tool parsing."""
        unknown = sorted(set(kw) - _KNOWN_TEXT)
        if unknown:
            raise TypeError(
                f"completions.create: unsupported arguments {unknown} "
                f"(supported: {sorted(_KNOWN_TEXT)})"
            )
        if kw.get("echo") or kw.get("best_of") not in (None, 1) or kw.get("suffix"):
            raise ValueError(
                "echo, best_of and suffix: not available in training; leave them unset"
            )
        n = self._check_args({"n": kw.get("n"), "stream": kw.get("stream")})
        ids = self._prompt_ids(kw.get("prompt"))
        gconfig = self._gconfig(kw)
        cid, resps = await self._generate(ids, 0, gconfig, n, kw.get("seed"), "cmpl")
        choices = []
        for i, r in enumerate(resps):
            text = self.tokenizer.decode(r.output_ids, skip_special_tokens=True)
            cuts = [text.find(s) for s in gconfig.stop if s and s in text]
            lp = None
            if kw.get("logprobs"):
                lp = {
                    "tokens": [self.tokenizer.decode([t]) for t in r.output_ids],
                    "token_logprobs": list(r.output_logprobs),
                }
            choices.append(
                {
                    "index": i,
                    "text": text[: min(cuts)] if cuts else text,
                    "logprobs": lp,
                    "finish_reason": r.stop_reason,
                }
            )
        n_out = sum(len(r.output_ids) for r in resps)
        from openai.types import Completion

        return Completion.model_validate(
            {
                "id": cid,
                "object": "text_completion",
                "created": int(time.time()),
                "model": kw.get("model") or self.model,
                "choices": choices,
                "usage": {
                    "prompt_tokens": len(ids),
                    "completion_tokens": n_out,
                    "total_tokens": len(ids) + n_out,
                },
            }
        )

    def _prompt_ids(self, prompt: object) -> list[int]:
        """The token ids of a text-API ``prompt``: token ids as given, a string encoded."""
        if (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            return list(prompt)
        if isinstance(prompt, str) and prompt:
            return encode(self.tokenizer, prompt)
        raise ValueError(
            "prompt: expected a non-empty string or list of token ids (one prompt per call)"
        )

    def _choice(
        self,
        index: int,
        r: ModelResponse,
        g: GenerationHyperparameters,
        prefill: str,
        parse_calls: bool,
        logprobs: bool,
    ) -> dict:
        """One ``choices[i]`` entry: the forced opening + the text (a matched stop string and what
        follows cut, as OpenAI does), the parsed tool calls, the finish reason, logprobs (of the
        generated tokens) when asked."""
        content = self.tokenizer.decode(r.output_ids, skip_special_tokens=True)
        cuts = [content.find(s) for s in g.stop if s and s in content]
        content = prefill + (content[: min(cuts)] if cuts else content)
        calls: list[dict] = []
        if parse_calls:
            content, calls = extract_tool_calls(content)
        lp = None
        if logprobs:
            lp = {
                "content": [
                    {
                        "token": self.tokenizer.decode([t]),
                        "logprob": v,
                        "bytes": list(self.tokenizer.decode([t]).encode()),
                        "top_logprobs": [],
                    }
                    for t, v in zip(r.output_ids, r.output_logprobs)
                ]
            }
        message = {
            "role": "assistant",
            "content": content,
            **({"tool_calls": calls} if calls else {}),
        }
        return {
            "index": index,
            "message": message,
            "logprobs": lp,
            "finish_reason": "tool_calls" if calls else r.stop_reason,
        }
