"""An in-process OpenAI client for agent workflows: ``client.chat.completions.create(...)`` as
``openai.AsyncOpenAI`` has it, answered by an :class:`~areal.api.engine.InferenceEngine`
instead of HTTP, with every call recorded in tokens for training.

What it does per call, the way our server's ``/v1/chat/completions`` does it (so an agent gets
the same answers from either; tests/workflow/test_agent.py runs one agent both ways):

* renders ``messages`` (and ``tools``) with the tokenizer's chat template, locally;
* generates ``n`` completions through ``engine.agenerate`` (token ids, behaviour logprobs, the
  weight version of each token), sharing the episode's ``group_id`` for routing;
* reads tool calls out of the answer with the server's reader (areal.utils.tool_calls.
  answer_calls);
* forces a call for ``tool_choice`` ``required`` or ``{"type": "function", "function": {"name":
  F}}`` with the server's grammar (areal.utils.tool_calls.tool_call_grammar): the assistant's
  answer is opened with ``<tool_call>\n`` (+ ``{"name": "F", "arguments": ``), tokens appended to
  the prompt and recorded as prompt (:attr:`Call.prefill`), never as generated tokens, so they
  are never trained on, and the rest is constrained to the grammar after that opening (the
  tools' ``parameters`` schemas, read per ``server.json_schema_additional_properties``; a named
  F: exactly one call; ``required`` with ``parallel_tool_calls: false``: one), sent through the
  engine request (``gconfig.ebnf``); the opening + the generated text is what is read, as the
  server reads its forced answers: calls only (``content`` None), and where ``max_tokens`` cut
  it the calls written, the last one's ``arguments`` as far as written;
* constrains the answer to ``response_format``'s schema (``json_object``, ``json_schema``) as the
  server does, through the engine request (``gconfig.json_schema``); a run whose
  ``gconfig`` sets a grammar of its own refuses both (one grammar per request);
* returns an ``openai.types.chat.ChatCompletion`` and records a :class:`Call` per completion.

Training constraints, each an error that names the argument and the fix rather than a silent
change: ``temperature`` must be the rollout's (``gconfig.temperature``, which the trainer's
logprobs use), ``stream`` is refused, a ``tool_choice`` naming a function not in ``tools`` (or
malformed) is an error naming ``tool_choice``, as on the server, and ``max_tokens`` is capped by
``gconfig.max_new_tokens``. ``top_p``, ``seed``, ``stop``, ``n`` and prompt token ids follow the
server's own rules (areal.api.sampling) with the run's server limits (``server.max_n``,
``server.max_stop_strings``, ``server.max_stop_chars``; the client is given ``cfg.server``),
checked before sending.

Refusals. A call refused here, or by the server for what it asks (a prompt longer than the
context: HTTP 400 surfacing as :class:`~areal.api.sampling.RequestRejected`), is the agent's
error: it is counted (:attr:`ArealOpenAI.n_rejected`) and raised as openai's own exception for
that answer (``openai.BadRequestError`` for a 400, as ``AsyncOpenAI`` raises it; also a
``ValueError``), so the agent may catch it and go on. Only a failure of the engine itself (a
server gone past its restart deadline, a timeout) is an :class:`EngineFailure`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from areal.api.config.base import GenerationHyperparameters
from areal.api.config.server import GenerationServerConfig
from areal.api.engine import InferenceEngine
from areal.api.io import ModelRequest, ModelResponse
from areal.api.sampling import (
    MAX_SEED,
    RequestRejected,
    number_problems,
    reward_problems,
    sampling_problems,
    stop_problems,
    stop_strings,
    token_problems,
)
from areal.dataset.chat import encode
from areal.utils.tool_calls import answer_calls
from areal.workflow.chat_prompt import (
    ToolPlan,
    check_tools,
    clean_messages,
    render_prompt,
    response_schema,
    signature,
)

if TYPE_CHECKING:  # the SDK (~0.7 s to import) is loaded by the first answer, not by importers
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

_KNOWN = {
    "messages",
    "model",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
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


T = TypeVar("T")
# the engine request's grammar fields as servers name them in a refusal (ours and SGLang's
# /generate, vLLM's completions)
GRAMMAR_FIELDS = ("sampling_params.json_schema", "sampling_params.ebnf", "structured_outputs")
DEFAULT_SERVER = GenerationServerConfig()  # limits of a client not given the run's server config


@functools.cache
def _openai_class(status: int) -> type:
    import openai  # the SDK (~0.7 s) is loaded by the first refusal, as by the first answer

    base = {400: openai.BadRequestError, 422: openai.UnprocessableEntityError}.get(
        status, openai.APIStatusError
    )
    return type(f"Rejected{status}", (base, RequestRejected), {"openai_shaped": True})


def openai_error(e: ValueError) -> RequestRejected:
    """A refused request as ``openai.AsyncOpenAI`` raises it on the same HTTP answer
    (``BadRequestError`` for 400, ``UnprocessableEntityError`` for 422, else ``APIStatusError``);
    the result is also a :class:`RequestRejected` (a ValueError) with ``field`` and ``status``."""
    if getattr(e, "openai_shaped", False):
        return e  # made here already
    import httpx

    status = e.status if isinstance(e, RequestRejected) else 400
    field = e.field if isinstance(e, RequestRejected) else None
    request = httpx.Request("POST", "http://areal.invalid/v1")  # in process: no HTTP call
    body = {"message": str(e), "type": "invalid_request_error", "param": field, "code": status}
    error = _openai_class(status)(
        str(e), response=httpx.Response(status, request=request), body=body
    )
    error.field, error.status = field, status
    return error


def _answer_body(
    cid: str, kind: str, model: str, choices: list[dict], n_prompt: int, resps: list[ModelResponse]
) -> dict:
    """An answer's JSON in openai's shape (``kind``: its ``object``): the ``choices`` made of
    ``resps``, and the usage of a prompt of ``n_prompt`` tokens."""
    n_out = sum(len(r.output_ids) for r in resps)
    return {
        "id": cid,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": n_prompt,
            "completion_tokens": n_out,
            "total_tokens": n_prompt + n_out,
        },
    }


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
    one client per episode, whose :attr:`calls` are the episode's record. ``server``: the run's
    ``cfg.server``, whose limits (``max_n``, ``max_stop_strings``, ``max_stop_chars``) calls are
    checked against (default: the server's defaults)."""

    def __init__(
        self,
        engine: InferenceEngine,
        tokenizer: Any,
        gconfig: GenerationHyperparameters,
        group_id: str | None = None,
        model: str = "areal",
        server: GenerationServerConfig = DEFAULT_SERVER,
    ):
        self.engine = engine
        self.server = server
        self.tokenizer = tokenizer
        self.gconfig = gconfig
        self.group_id = group_id
        self.model = model
        self.chat = _Chat(self)
        self.calls: list[Call] = []
        self.call_rewards: dict[int, float] = {}  # turn -> reward the agent gave that call
        self.engine_failure: EngineFailure | None = None
        self.n_rejected = 0  # calls refused (here or by the server) for what they asked
        self._turn_of: dict[str, int] = {}
        self._generated: dict[tuple, Call] = {}  # signature of a returned message -> its call

    def set_reward(self, completion_id: str, reward: float) -> None:
        """Give the call that returned ``completion_id`` its own reward (see episode_returns)."""
        if completion_id not in self._turn_of:
            raise ValueError(
                f"set_reward: {completion_id!r} is not a completion of this episode's client"
            )
        problems = reward_problems("reward", reward)
        if problems:
            raise RequestRejected.of(problems)
        self.call_rewards[self._turn_of[completion_id]] = float(reward)

    def _gconfig(self, kw: dict, n: int) -> GenerationHyperparameters:
        """The call's generation settings: ``gconfig`` with what the call may set, checked by the
        server's rules (areal.api.sampling) before anything is sent."""
        g = self.gconfig
        integers = ("max_tokens", "max_completion_tokens", "seed")
        problems = number_problems(
            {k: kw.get(k) for k in ("temperature", "top_p", *integers)}, integers
        ) + stop_problems(kw.get("stop"), self.server.max_stop_strings, self.server.max_stop_chars)
        if problems:
            raise RequestRejected.of(problems)
        temperature = kw.get("temperature")
        if temperature is not None and abs(temperature - g.temperature) > 1e-6:
            raise RequestRejected(
                f"temperature: {temperature} differs from the rollout's gconfig.temperature "
                f"{g.temperature}, which the trainer's logprobs use; drop it from the call "
                f"or set gconfig.temperature={temperature}",
                "temperature",
            )
        limit = kw.get("max_completion_tokens") or kw.get("max_tokens") or g.max_new_tokens
        if limit < 1:
            raise RequestRejected(
                f"max_tokens: expected a positive int, got {limit!r}", "max_tokens"
            )
        top_p = g.top_p if kw.get("top_p") is None else float(kw["top_p"])
        seed = kw.get("seed")
        out = dataclasses.replace(
            g,
            n_samples=1,
            max_new_tokens=min(limit, g.max_new_tokens),
            top_p=top_p,
            stop=list(stop_strings(kw.get("stop"))) or list(g.stop),
        )
        problems = sampling_problems(
            max_new_tokens=out.max_new_tokens,
            min_new_tokens=out.min_new_tokens,
            temperature=out.temperature,
            top_p=out.top_p,
            top_k=out.top_k,
            seed=seed,
        )
        if seed is not None and 0 <= seed <= MAX_SEED < seed + n - 1:  # choice i uses seed + i
            problems.append(
                ("seed", f"the {n} choices use seeds {seed}..+{n - 1}, past {MAX_SEED}")
            )
        if problems:
            raise RequestRejected.of(problems)
        return out

    def _constrain(
        self, g: GenerationHyperparameters, kw: dict, tool_grammar: str
    ) -> tuple[GenerationHyperparameters, str]:
        """``g`` with the grammar the call asks for (a forced tool call's, ``response_format``'s
        schema) and the call's field that asked for it ("" for none), or the refusal of a call
        that asks for two grammars or a grammar the run's settings exclude."""
        schema = response_schema(kw.get("response_format"))
        field = "tool_choice" if tool_grammar else "response_format" if schema else ""
        if tool_grammar and schema:
            raise RequestRejected(
                "tool_choice: a forced tool call cannot also follow response_format; send "
                "tool_choice 'auto' or drop the format",
                "tool_choice",
            )
        if not field:
            return g, ""
        if g.grammar:
            raise RequestRejected(
                f"{field}: this run constrains every completion already (gconfig."
                f"{next(iter(g.grammar))}); one grammar per request: drop {field} from the call "
                "or unset the run's grammar",
                field,
            )
        if g.min_new_tokens:
            raise RequestRejected(
                f"{field}: a grammar decides where the answer ends, but the run sets "
                f"gconfig.min_new_tokens={g.min_new_tokens}; set it to 0 or drop {field}",
                field,
            )
        if tool_grammar:
            return dataclasses.replace(g, ebnf=tool_grammar), field
        return dataclasses.replace(g, json_schema=schema), field

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
        n = 1 if kw.get("n") is None else kw["n"]
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.server.max_n:
            raise RequestRejected(
                f"n: expected an int in [1, {self.server.max_n}] (server.max_n), got {str(n)[:40]}",
                "n",
            )
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
        except RequestRejected:  # the server refused what the call asks: the agent's error
            raise
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
        """Render, generate ``n`` completions, parse tool calls, record, answer; a refused call
        is raised as openai's error (module docstring)."""
        return await self._answer(self._chat_call(kw))

    async def complete(self, **kw: Any) -> Completion:
        """``completions.create`` (the legacy text API): ``prompt`` as a string or token ids,
        generated and recorded as a chat call is; no chat template, no tool parsing."""
        return await self._answer(self._text_call(kw))

    async def _answer(self, call: Coroutine[Any, Any, T]) -> T:
        """``call``'s answer. A refusal (a ValueError naming the argument, the server's
        :class:`RequestRejected`) is counted and raised as openai's error; unknown arguments
        stay a TypeError, as in openai's client."""
        try:
            return await call
        except TypeError:
            self.n_rejected += 1
            raise
        except ValueError as e:
            self.n_rejected += 1
            raise openai_error(e) from e

    async def _chat_call(self, kw: dict) -> ChatCompletion:
        n = self._check_args(kw)
        template = self.tokenizer.chat_template or ""
        plan = check_tools(
            kw.get("tools"),
            kw.get("tool_choice", "auto"),
            template,
            kw.get("parallel_tool_calls"),
            self.server.json_schema_additional_properties,
        )
        gconfig, grammar_field = self._constrain(self._gconfig(kw, n), kw, plan.grammar)
        tools, prefill = plan.tools, plan.prefill
        messages = clean_messages(kw.get("messages"))
        # off the event loop: a long conversation takes seconds to tokenize, and the agent
        # proxy's other sessions go on meanwhile (the tokenizer releases the GIL)
        prompt = await asyncio.to_thread(
            render_prompt, self.tokenizer, messages, tools, self._generated
        )
        opening = encode(self.tokenizer, prefill) if prefill else []  # prompt, as on the server
        prompt += opening
        try:
            cid, resps = await self._generate(prompt, len(opening), gconfig, n, kw.get("seed"))
        except (
            RequestRejected
        ) as e:  # the server's words for the grammar, named as the agent sent it
            if grammar_field and str(e.field).startswith(GRAMMAR_FIELDS):
                raise RequestRejected(f"{grammar_field}: {e}", grammar_field, e.status) from e
            raise
        choices = []
        for i, r in enumerate(resps):
            choices.append(self._choice(i, r, gconfig, plan, bool(kw.get("logprobs"))))
            message = choices[-1]["message"]
            self._generated[signature(message["content"], message.get("tool_calls", []))] = (
                self.calls[len(self.calls) - n + i]
            )
        from openai.types.chat import ChatCompletion

        model = kw.get("model") or self.model
        return ChatCompletion.model_validate(
            _answer_body(cid, "chat.completion", model, choices, len(prompt), resps)
        )

    async def _text_call(self, kw: dict) -> Completion:
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
        gconfig = self._gconfig(kw, n)
        ids = await self._prompt_ids(kw.get("prompt"))
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
        from openai.types import Completion

        model = kw.get("model") or self.model
        return Completion.model_validate(
            _answer_body(cid, "text_completion", model, choices, len(ids), resps)
        )

    async def _prompt_ids(self, prompt: object) -> list[int]:
        """The token ids of a text-API ``prompt``: token ids as given (each in the tokenizer's
        vocabulary), a string encoded (off the event loop, as a chat prompt is)."""
        if isinstance(prompt, list) and prompt:
            problems = token_problems("prompt", prompt, len(self.tokenizer))
            if problems:
                raise RequestRejected.of(problems)
            return list(prompt)
        if isinstance(prompt, str) and prompt:
            return await asyncio.to_thread(encode, self.tokenizer, prompt)
        raise ValueError(
            "prompt: expected a non-empty string or list of token ids (one prompt per call)"
        )

    def _choice(
        self,
        index: int,
        r: ModelResponse,
        g: GenerationHyperparameters,
        plan: ToolPlan,
        logprobs: bool,
    ) -> dict:
        """One ``choices[i]`` entry: the forced opening + the text (a matched stop string and what
        follows cut, as OpenAI does), read for tool calls as the server reads it (``plan``: the
        call's tools and tool_choice; :func:`~areal.utils.tool_calls.answer_calls`), the finish
        reason (``tool_calls`` unless ``max_tokens`` cut the answer, as on the server), logprobs
        (of the generated tokens)."""
        text = self.tokenizer.decode(r.output_ids, skip_special_tokens=True)
        cuts = [text.find(s) for s in g.stop if s and s in text]
        content, calls = answer_calls(plan.prefill + (text[: min(cuts)] if cuts else text), plan)
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
            "finish_reason": "tool_calls" if calls and r.stop_reason != "length" else r.stop_reason,
        }
