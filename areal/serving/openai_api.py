"""OpenAI ``/v1/completions`` and ``/v1/chat/completions``: request parsing, response objects.

Follows OpenAI's published schemas, streaming included (server-sent events, see streaming.py).
Extra sampling fields accepted as in vLLM and SGLang's OpenAI servers: ``top_k``, ``min_p``,
``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``, ``no_stop_trim``.
``finish_reason`` is ``stop`` | ``length`` | ``abort`` (the last when generation was interrupted
by ``/pause_generation``) | ``tool_calls``.
Structured outputs (constraints.py): ``response_format`` ``json_object`` / ``json_schema``
(``strict``: unsupported schema keywords are a 400, else ignored), vLLM's ``structured_outputs``
(``json``, ``regex``, ``choice``, ``grammar``, ``json_object``) and forced tool calls (tools.py).
OpenAI fields that change no answer are accepted and ignored (IGNORED); a prompt that fills the
context, or a prompt plus a sent ``max_tokens`` past it, is OpenAI's 400 with code
``context_length_exceeded`` (protocol.check_job).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Callable
from typing import Any

from areal.api.config.server import GenerationServerConfig
from areal.serving.constraints import Constraint, choice_grammar, schema_text
from areal.serving.generator import GenerationResult
from areal.serving.protocol import (
    NEUTRAL,
    BadRequest,
    Job,
    _bool,
    _check_known,
    _float,
    _int,
    _stop_strings,
    _token_list,
    check_count,
    check_prompt_logprobs,
    now,
    render_text,
    usage,
)
from areal.serving.requests import json_type
from areal.serving.sampling import MAX_TOP_LOGPROBS, SamplingParams
from areal.serving.tokens import TokenText
from areal.serving.tools import answer_calls, clean_messages, parse_tools

COMMON_KEYS = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stop",
    "seed",
    "stream",
    "stream_options",
    "logit_bias",
    "top_k",
    "min_p",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "skip_special_tokens",
    "no_stop_trim",
    "response_format",
    "structured_outputs",
    *NEUTRAL,
}
# OpenAI fields that change no token of an answer, accepted (their type checked) and ignored:
# store and metadata (OpenAI keeps answers for its dashboard; nothing is kept here),
# service_tier (its latency and price tier), user, prompt_cache_key and safety_identifier
# (abuse monitoring, cache routing), prediction (Predicted Outputs: only speeds up an answer it
# leaves unchanged). modalities is accepted as ["text"]; audio output is refused.
IGNORED = {
    "store": bool,
    "metadata": dict,
    "service_tier": str,
    "user": str,
    "prompt_cache_key": str,
    "safety_identifier": str,
}
CHAT_IGNORED = {**IGNORED, "prediction": dict}
COMMON_KEYS |= set(IGNORED)
CHAT_UNLIMITED = 1 << 30  # max_tokens of a chat request that sets none: the context ends it
COMPLETION_KEYS = COMMON_KEYS | {"prompt", "logprobs", "echo", "best_of", "suffix"}
CHAT_KEYS = COMMON_KEYS | {
    "messages",
    "logprobs",
    "top_logprobs",
    "max_completion_tokens",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "modalities",
    "audio",
    *CHAT_IGNORED,
}
_TYPE_NAMES = {bool: "true or false", dict: "an object", str: "a string"}


def _check_ignored(body: dict) -> None:
    """The fields OpenAI defines that change nothing here (IGNORED, CHAT_IGNORED): of their
    type when sent; ``modalities`` text only, no ``audio`` (both would change the answer)."""
    for key, kind in CHAT_IGNORED.items():
        value = body.get(key)
        if value is not None and not isinstance(value, kind):
            raise BadRequest(
                key,
                f"expected {_TYPE_NAMES[kind]}, got {json_type(value)}; this server accepts and "
                "ignores it (it changes no answer), so leave it out or fix its type",
            )
    if body.get("modalities") not in (None, ["text"]):
        raise BadRequest(
            "modalities",
            f"this server answers in text only, got {str(body['modalities'])[:80]}; send "
            '["text"] or leave it out',
        )
    if body.get("audio") is not None:
        raise BadRequest(
            "audio", "this server answers in text only (no audio output); leave audio out"
        )


def _common(
    body: dict, max_tokens: int | None, cfg: GenerationServerConfig
) -> tuple[SamplingParams, dict, int]:
    """Sampling fields shared by completions and chat -> (params, render opts, n); ``n`` is
    checked against ``server.max_n`` here, before any job is built."""
    if _bool(body, "stream", "", False):
        options = body.get("stream_options") or {}
        if not isinstance(options, dict) or set(options) - {"include_usage", "include_obfuscation"}:
            raise BadRequest(
                "stream_options",
                'expected {"include_usage": true|false, "include_obfuscation": true|false}',
            )
        _bool(options, "include_usage", "stream_options.", False)
        _bool(options, "include_obfuscation", "stream_options.", True)  # no padding sent: no-op
        if body.get("logprobs") or body.get("echo"):
            raise BadRequest(
                "stream", "logprobs and echo are not streamed; send stream=false for them"
            )
    if body.get("logit_bias"):
        raise BadRequest("logit_bias", "logit_bias is not supported; send none or {}")
    _check_ignored(body)
    n = _int(body, "n", "", 1, lo=1)
    check_count(n, cfg)
    params = SamplingParams(
        max_new_tokens=max_tokens if max_tokens is not None else 16,
        min_new_tokens=_int(body, "min_tokens", "", 0, lo=0),
        temperature=_float(body, "temperature", "", 1.0),
        top_p=_float(body, "top_p", "", 1.0),
        top_k=_int(body, "top_k", "", -1),
        min_p=_float(body, "min_p", "", 0.0),
        stop=_stop_strings(body.get("stop"), "stop", cfg),
        stop_token_ids=tuple(_token_list(body.get("stop_token_ids") or [], "stop_token_ids")),
        ignore_eos=_bool(body, "ignore_eos", "", False),
        seed=_int(body, "seed", "", None),
    )
    for problem in params.problems():
        name = problem.split(":")[0]
        name = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}.get(name, name)
        raise BadRequest(name, problem.split(": ", 1)[1])
    opts = {
        "no_stop_trim": _bool(body, "no_stop_trim", "", False),
        "skip_special_tokens": _bool(body, "skip_special_tokens", "", True),
    }
    return params, opts, n


def output_constraint(body: dict, additional_properties: bool) -> Constraint | None:
    """The grammar ``response_format`` (OpenAI: ``json_object``, ``json_schema`` with
    ``strict``) or ``structured_outputs`` (vLLM: one of ``json``, ``regex``, ``choice``,
    ``grammar``, ``json_object``) asks for; at most one of the two. ``additional_properties``:
    ``server.json_schema_additional_properties`` (constraints.Constraint)."""
    fmt, so = body.get("response_format"), body.get("structured_outputs")
    if fmt is not None and fmt != {"type": "text"} and so is not None:
        raise BadRequest(
            "structured_outputs", "send response_format or structured_outputs, not both"
        )
    if so is not None:
        return _structured_outputs(so, additional_properties)
    if fmt is None or fmt == {"type": "text"}:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return Constraint("json_schema", '{"type": "object"}', "response_format")
    if kind != "json_schema":
        raise BadRequest(
            "response_format.type",
            f"expected text, json_object or json_schema, got {str(fmt)[:80]}",
        )
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise BadRequest(
            "response_format.json_schema",
            f'expected {{"name", "schema", "strict": bool}}, got {json_type(spec)}',
        )
    if spec.get("strict") not in (None, True, False):
        raise BadRequest(
            "response_format.json_schema.strict",
            f"expected true or false, got {json_type(spec['strict'])}",
        )
    where = "response_format.json_schema.schema"
    schema = schema_text(spec.get("schema", {"type": "object"}), where)
    return Constraint("json_schema", schema, where, bool(spec.get("strict")), additional_properties)


def _structured_outputs(so: Any, additional_properties: bool) -> Constraint:
    given = [
        k
        for k in ("json", "regex", "choice", "grammar", "json_object")
        if isinstance(so, dict) and so.get(k) not in (None, False)
    ]
    if len(given) != 1 or set(so) - {"json", "regex", "choice", "grammar", "json_object"}:
        raise BadRequest(
            "structured_outputs",
            "expected exactly one of json, regex, choice, grammar, "
            f"json_object, got {str(so)[:80]}",
        )
    key, value = given[0], so[given[0]]
    where = f"structured_outputs.{key}"
    if key in ("json", "json_object"):
        schema = schema_text(value if key == "json" else {"type": "object"}, where)
        return Constraint("json_schema", schema, where, False, additional_properties)
    if key == "choice":
        choice_grammar(value, where)  # checks the list
        return Constraint("choice", json.dumps(value), where)
    if not isinstance(value, str) or not value:
        raise BadRequest(where, f"expected a non-empty string, got {json_type(value)}")
    return Constraint("regex" if key == "regex" else "ebnf", value, where)


def _constrain(jobs: list[Job], constraint: Constraint | None) -> list[Job]:
    """Give ``jobs`` their grammar; a grammar with min_tokens is refused (it decides the end)."""
    if constraint is not None and jobs and jobs[0].params.min_new_tokens:
        raise BadRequest(
            "min_tokens",
            "cannot be combined with a grammar (response_format, "
            "structured_outputs or a forced tool call decides where the output ends); send 0",
        )
    for job in jobs:
        job.constraint = constraint
    return jobs


def _overflow_fields(jobs: list[Job], prompt_field: str, body: dict) -> list[Job]:
    """Name the fields a context overflow of ``jobs`` points at (protocol.check_job): the
    prompt's, and the length limit the request sent (none sent: the answer ends with the
    context, as OpenAI's)."""
    sent = [k for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None]
    for job in jobs:
        job.prompt_field, job.limit_field = prompt_field, (sent[0] if sent else None)
    return jobs


def _fan_out(
    prompt: list[int], params: SamplingParams, opts: dict, n: int, index0: int
) -> list[Job]:
    """``n`` jobs for one prompt; seeded requests get seeds seed, seed+1, ... so samples differ."""
    jobs = []
    opts = dict(opts)
    echo = opts.pop("echo", False)
    for i in range(n):
        p = params
        if params.seed is not None and i > 0:
            p = SamplingParams(**{**params.__dict__, "seed": params.seed + i})
        extra = {"index": index0 + i, "prompt_index": index0 // max(n, 1), "echo": echo}
        jobs.append(Job(prompt, p, **opts, extra=extra))
    return jobs


def parse_completions(
    body: Any, encode: Callable[[str], list[int]], cfg: GenerationServerConfig
) -> tuple[list[Job], int | None]:
    """``/v1/completions`` body -> (jobs, logprobs count or None); counts are checked against
    ``cfg``'s limits before a prompt is tokenized."""
    if not isinstance(body, dict):
        raise BadRequest("body", "expected a JSON object")
    _check_known(body, COMPLETION_KEYS, "")
    if body.get("suffix"):
        raise BadRequest("suffix", "suffix is not supported")
    params, opts, n = _common(body, _int(body, "max_tokens", "", None, lo=0), cfg)
    logprobs = _int(body, "logprobs", "", None, lo=0)
    if logprobs is not None and logprobs > MAX_TOP_LOGPROBS:
        raise BadRequest("logprobs", f"must be <= {MAX_TOP_LOGPROBS}, got {logprobs}")
    echo = _bool(body, "echo", "", False)
    params = dataclasses.replace(params, top_logprobs=logprobs or 0)
    opts = {**opts, "echo": echo}
    if body.get("best_of") not in (None, n):
        raise BadRequest("best_of", "best_of must equal n")
    prompts = _prompts(body.get("prompt"), n, encode, cfg)
    if echo and logprobs is not None:
        check_prompt_logprobs(prompts, "logprobs", cfg)
    jobs: list[Job] = []
    for p in prompts:
        jobs += _fan_out(p, params, opts, n, len(jobs))
    _constrain(jobs, output_constraint(body, cfg.json_schema_additional_properties))
    _overflow_fields(jobs, "prompt", body)
    if echo and logprobs is not None:  # prompt logprobs too (loglikelihood requests)
        for job in jobs:
            job.extra["prompt_logprobs"] = logprobs
    return jobs, logprobs


def _prompts(
    prompt: Any, n: int, encode: Callable[[str], list[int]], cfg: GenerationServerConfig
) -> list[list[int]]:
    """A completions ``prompt`` (string, strings, token ids or lists of them) -> token id lists;
    prompts x n is checked against ``server.max_n`` before any is tokenized."""
    if isinstance(prompt, str):
        raw: list = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        raw = [prompt]
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(p, (str, list)) for p in prompt)
        and len({type(p) for p in prompt}) == 1
    ):
        raw = prompt
    else:
        raise BadRequest("prompt", "expected a string, a list of strings or token id list(s)")
    check_count(len(raw) * n, cfg)
    prompts = [encode(p) if isinstance(p, str) else _token_list(p, "prompt") for p in raw]
    if any(len(p) == 0 for p in prompts):
        raise BadRequest("prompt", "empty prompt")
    return prompts


def parse_chat(
    body: Any,
    apply_template: Callable[[list[dict], list[dict] | None], list[int]],
    cfg: GenerationServerConfig,
) -> tuple[list[Job], bool]:
    """``/v1/chat/completions`` body -> (jobs, want logprobs); ``apply_template(messages,
    tools)`` renders the prompt; a forced tool call or a response format constrains the answer."""
    if not isinstance(body, dict):
        raise BadRequest("body", "expected a JSON object")
    _check_known(body, CHAT_KEYS, "")
    clean = clean_messages(body.get("messages"))
    use = parse_tools(body, cfg.json_schema_additional_properties)
    constraint = output_constraint(body, cfg.json_schema_additional_properties)
    if use.constraint is not None and constraint is not None:
        raise BadRequest(
            "tool_choice",
            "a forced tool call cannot also follow response_format or "
            "structured_outputs; send tool_choice 'auto' or drop the format",
        )
    max_tokens = _int(body, "max_completion_tokens", "", None, lo=0)
    max_tokens = _int(body, "max_tokens", "", None, lo=0) if max_tokens is None else max_tokens
    # OpenAI chat without a limit runs to the end of the context (the generator stops there)
    params, opts, n = _common(body, CHAT_UNLIMITED if max_tokens is None else max_tokens, cfg)
    want = _bool(body, "logprobs", "", False)
    top = _int(body, "top_logprobs", "", 0, lo=0) or 0
    if top and not want:
        raise BadRequest("top_logprobs", "top_logprobs needs logprobs=true")
    if top > MAX_TOP_LOGPROBS:
        raise BadRequest("top_logprobs", f"must be <= {MAX_TOP_LOGPROBS}, got {top}")
    params = dataclasses.replace(params, top_logprobs=top)
    jobs = _constrain(
        _fan_out(apply_template(clean, use.tools), params, opts, n, 0), use.constraint or constraint
    )
    for job in _overflow_fields(jobs, "messages", body):
        job.extra["tool_use"] = use
    return jobs, want


def _top_entries(
    ids: list[int], lps: list, tops: list, n: int | None, token_str: Callable, pieces: list[str]
) -> list:
    """OpenAI completions ``top_logprobs``: per position a {token: logprob} dict of the ``n``
    most likely tokens plus the chosen one (None where no logprob exists: a prompt's first).
    The chosen token is keyed as in ``tokens`` (its piece of the text), so a client comparing
    ``tokens[i]`` with the best key (lm-eval's is_greedy) sees the same string."""
    out = []
    for t, lp, top, piece in zip(ids, lps, tops, pieces):
        if lp is None:
            out.append(None)
            continue
        entry = {piece: lp}
        for u, v in (top or [])[: n or 0]:
            if u != t:
                entry.setdefault(token_str(u), v)
        out.append(dict(sorted(entry.items(), key=lambda kv: -kv[1])))
    return out


def completion_response(
    model: str,
    jobs: list[Job],
    results: list[GenerationResult],
    logprobs: int | None,
    text: TokenText,
) -> dict:
    """OpenAI ``text_completion`` object; with ``echo`` the prompt leads the text and (with
    ``logprobs``) its tokens lead the logprobs, the first one None. ``tokens`` are each token's
    share of the text (tokens.py), so ``text_offset`` points into ``text``."""
    choices = []
    for job, r in zip(jobs, results):
        echo = job.extra.get("echo", False)
        out_text = render_text(job, r, text.decode)
        if echo:
            out_text = text.decode(r.input_ids, job.skip_special_tokens) + out_text
        lp = None
        if logprobs is not None:
            ids = (r.input_ids if echo else []) + r.output_ids
            lps = (job.extra["input_logprobs"] if echo else []) + r.output_logprobs
            out_tops = r.output_top_logprobs or [[] for _ in r.output_ids]
            tops = (job.extra["input_tops"] if echo else []) + out_tops
            pieces = (
                text.pieces(r.input_ids) + text.pieces(r.output_ids) if echo else text.pieces(ids)
            )
            offsets = [sum(map(len, pieces[:k])) for k in range(len(pieces))]
            lp = {
                "tokens": pieces,
                "token_logprobs": lps,
                "top_logprobs": _top_entries(ids, lps, tops, logprobs, text.token_str, pieces),
                "text_offset": offsets,
            }
        choices.append(
            {
                "index": job.extra["index"],
                "text": out_text,
                "logprobs": lp,
                "finish_reason": r.finish_reason,
            }
        )
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": now(),
        "model": model,
        "choices": choices,
        "usage": usage(jobs, results),
    }


def _chat_logprobs(r: GenerationResult, text: TokenText) -> dict:
    def item(t: int, v: float, token: str) -> dict:
        return {"token": token, "logprob": v, "bytes": list(text.token_bytes(t))}

    tops = r.output_top_logprobs or [[] for _ in r.output_ids]
    return {
        "content": [
            {**item(t, v, piece), "top_logprobs": [item(u, w, text.token_str(u)) for u, w in top]}
            for t, v, top, piece in zip(
                r.output_ids, r.output_logprobs, tops, text.pieces(r.output_ids)
            )
        ]
    }


def chat_finish(calls: list[dict], r: GenerationResult) -> str:
    """``tool_calls`` when the answer holds calls and ended by itself, else how it ended
    (``length``: max_tokens cut it, its last call partial)."""
    return "tool_calls" if calls and r.finish_reason == "stop" else r.finish_reason


def chat_response(
    model: str, jobs: list[Job], results: list[GenerationResult], logprobs: bool, text: TokenText,
) -> dict:  # fmt: skip
    """OpenAI ``chat.completion`` object."""
    choices = []
    for job, r in zip(jobs, results):
        content, calls = answer_calls(render_text(job, r, text.decode), job.extra.get("tool_use"))
        message = {
            "role": "assistant",
            "content": content,
            **({"tool_calls": calls} if calls else {}),
        }
        choices.append(
            {
                "index": job.extra["index"],
                "message": message,
                "logprobs": _chat_logprobs(r, text) if logprobs else None,
                "finish_reason": chat_finish(calls, r),
            }
        )
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": now(),
        "model": model, "choices": choices, "usage": usage(jobs, results),
    }  # fmt: skip
