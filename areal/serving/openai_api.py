"""OpenAI ``/v1/completions`` and ``/v1/chat/completions``: request parsing, response objects.

Follows OpenAI's published schemas, streaming included (server-sent events, see streaming.py). Extra sampling fields accepted as in vLLM and
SGLang's OpenAI servers: ``top_k``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``skip_special_tokens``, ``no_stop_trim``. ``finish_reason`` is ``stop`` | ``length`` |
``abort`` (the last when generation was interrupted by ``/pause_generation``).
"""

from __future__ import annotations

import uuid
import dataclasses
from typing import Any, Callable

from areal.api.config.server import GenerationServerConfig
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
from areal.serving.sampling import MAX_TOP_LOGPROBS, SamplingParams
from areal.serving.tools import clean_tool_calls, extract_tool_calls, parse_tools

COMMON_KEYS = {
    "model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "stream", "stream_options", "user",
    "logit_bias", "top_k", "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens",
    "no_stop_trim", "response_format", *NEUTRAL,
}  # fmt: skip
CHAT_UNLIMITED = 1 << 30  # max_tokens of a chat request that sets none: the context ends it
COMPLETION_KEYS = COMMON_KEYS | {"prompt", "logprobs", "echo", "best_of", "suffix"}
CHAT_KEYS = COMMON_KEYS | {"messages", "logprobs", "top_logprobs", "max_completion_tokens", "tools",
                          "tool_choice", "parallel_tool_calls"}


def _common(body: dict, max_tokens: int | None, cfg: GenerationServerConfig) -> tuple[SamplingParams, dict, int]:
    """Sampling fields shared by completions and chat -> (params, render opts, n); ``n`` is
    checked against ``server.max_n`` here, before any job is built."""
    if _bool(body, "stream", "", False):
        options = body.get("stream_options") or {}
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise BadRequest("stream_options", "expected {\"include_usage\": true|false}")
        _bool(options, "include_usage", "stream_options.", False)
        if body.get("logprobs") or body.get("echo"):
            raise BadRequest("stream", "logprobs and echo are not streamed; send stream=false for them")
    if body.get("logit_bias"):
        raise BadRequest("logit_bias", "logit_bias is not supported; send none or {}")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise BadRequest("response_format", f"{fmt!r} needs constrained decoding, which this server does "
                         "not do; send {\"type\": \"text\"} or none and validate the output yourself")
    n = _int(body, "n", "", 1, lo=1)
    check_count(n, cfg)  # type: ignore[arg-type]
    params = SamplingParams(
        max_new_tokens=max_tokens if max_tokens is not None else 16,
        min_new_tokens=_int(body, "min_tokens", "", 0, lo=0),  # type: ignore[arg-type]
        temperature=_float(body, "temperature", "", 1.0),
        top_p=_float(body, "top_p", "", 1.0),
        top_k=_int(body, "top_k", "", -1),  # type: ignore[arg-type]
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
    return params, opts, n  # type: ignore[return-value]


def _fan_out(prompt: list[int], params: SamplingParams, opts: dict, n: int, index0: int) -> list[Job]:
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
    if echo and logprobs is not None:  # prompt logprobs too (loglikelihood requests)
        for job in jobs:
            job.extra["prompt_logprobs"] = logprobs
    return jobs, logprobs


def _prompts(prompt: Any, n: int, encode: Callable[[str], list[int]], cfg: GenerationServerConfig
             ) -> list[list[int]]:
    """A completions ``prompt`` (string, strings, token ids or lists of them) -> token id lists;
    prompts x n is checked against ``server.max_n`` before any is tokenized."""
    if isinstance(prompt, str):
        raw: list = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        raw = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt) \
            and len({type(p) for p in prompt}) == 1:
        raw = prompt
    else:
        raise BadRequest("prompt", "expected a string, a list of strings or token id list(s)")
    check_count(len(raw) * n, cfg)
    prompts = [encode(p) if isinstance(p, str) else _token_list(p, "prompt") for p in raw]
    if any(len(p) == 0 for p in prompts):
        raise BadRequest("prompt", "empty prompt")
    return prompts


def parse_chat(
    body: Any, apply_template: Callable[[list[dict], list[dict] | None], list[int]],
    encode: Callable[[str], list[int]], cfg: GenerationServerConfig,
) -> tuple[list[Job], bool]:
    """``/v1/chat/completions`` body -> (jobs, want logprobs); ``apply_template(messages,
    tools)`` renders the prompt, to which a forced tool call's opening is appended (tools.py)."""
    if not isinstance(body, dict):
        raise BadRequest("body", "expected a JSON object")
    _check_known(body, CHAT_KEYS, "")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages", "expected a non-empty list of {role, content}")
    tools, parse_calls, prefill = parse_tools(body)
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}]", "expected an object with a string role")
        content = m.get("content")
        if m.get("tool_calls") is not None and m["role"] == "assistant":  # an agent's call turn
            calls = clean_tool_calls(m["tool_calls"], f"messages[{i}].tool_calls")
            clean.append({"role": "assistant", "content": content or "", "tool_calls": calls})
            continue
        if m["role"] == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise BadRequest(f"messages[{i}].tool_call_id", "a tool message needs the tool_call_id it answers")
        if isinstance(content, list):  # content parts: keep the text ones
            if not all(isinstance(c, dict) and c.get("type") == "text" for c in content):
                raise BadRequest(f"messages[{i}].content", "only text content parts are supported")
            content = "".join(str(c.get("text", "")) for c in content)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content", f"expected a string, got {content!r}")
        clean.append({"role": m["role"], "content": content})
    max_tokens = _int(body, "max_completion_tokens", "", None, lo=0)
    max_tokens = _int(body, "max_tokens", "", None, lo=0) if max_tokens is None else max_tokens
    # OpenAI chat without a limit runs to the end of the context (the generator stops there)
    params, opts, n = _common(body, CHAT_UNLIMITED if max_tokens is None else max_tokens, cfg)
    want = _bool(body, "logprobs", "", False)
    top = _int(body, "top_logprobs", "", 0, lo=0)
    if top and not want:
        raise BadRequest("top_logprobs", "top_logprobs needs logprobs=true")
    if top > MAX_TOP_LOGPROBS:
        raise BadRequest("top_logprobs", f"must be <= {MAX_TOP_LOGPROBS}, got {top}")
    params = dataclasses.replace(params, top_logprobs=top)
    prompt = apply_template(clean, tools) + (encode(prefill) if prefill else [])
    jobs = _fan_out(prompt, params, opts, n, 0)
    for job in jobs:
        job.extra["tool_calls"], job.extra["tool_prefill"] = parse_calls, prefill
    return jobs, want


def _top_entries(ids: list[int], lps: list, tops: list, n: int | None, token_str: Callable) -> list:
    """OpenAI completions ``top_logprobs``: per position a {token: logprob} dict of the ``n``
    most likely tokens plus the chosen one (None where no logprob exists: a prompt's first)."""
    out = []
    for t, lp, top in zip(ids, lps, tops):
        if lp is None:
            out.append(None)
            continue
        entry = {token_str(u): v for u, v in (top or [])[: n or 0]}
        entry.setdefault(token_str(t), lp)
        out.append(entry)
    return out


def completion_response(
    model: str, jobs: list[Job], results: list[GenerationResult], logprobs: int | None,
    decode: Callable, token_str: Callable[[int], str],
) -> dict:  # fmt: skip
    """OpenAI ``text_completion`` object; with ``echo`` the prompt leads the text and (with
    ``logprobs``) its tokens lead the logprobs, the first one None."""
    choices = []
    for job, r in zip(jobs, results):
        echo = job.extra.get("echo", False)
        text = render_text(job, r, decode)
        if echo:
            text = decode(r.input_ids, job.skip_special_tokens) + text
        lp = None
        if logprobs is not None:
            ids = (r.input_ids if echo else []) + r.output_ids
            lps = (job.extra["input_logprobs"] if echo else []) + r.output_logprobs
            out_tops = r.output_top_logprobs or [[] for _ in r.output_ids]
            tops = (job.extra["input_tops"] if echo else []) + out_tops
            tokens = [token_str(t) for t in ids]
            offsets, at = [], 0
            for t in ids:  # each token's character offset in the returned text
                offsets.append(at)
                at += len(decode([t], job.skip_special_tokens))
            lp = {"tokens": tokens, "token_logprobs": lps,
                  "top_logprobs": _top_entries(ids, lps, tops, logprobs, token_str), "text_offset": offsets}
        choices.append(
            {"index": job.extra["index"], "text": text, "logprobs": lp, "finish_reason": r.finish_reason}
        )
    return {
        "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": now(),
        "model": model, "choices": choices, "usage": usage(jobs, results),
    }  # fmt: skip


def chat_response(
    model: str, jobs: list[Job], results: list[GenerationResult], logprobs: bool,
    decode: Callable, token_str: Callable[[int], str], token_bytes: Callable[[int], bytes],
) -> dict:  # fmt: skip
    """OpenAI ``chat.completion`` object."""
    choices = []
    for job, r in zip(jobs, results):
        lp = None
        if logprobs:
            def item(t: int, v: float) -> dict:
                return {"token": token_str(t), "logprob": v, "bytes": list(token_bytes(t))}

            tops = r.output_top_logprobs or [[] for _ in r.output_ids]
            lp = {"content": [{**item(t, v), "top_logprobs": [item(u, w) for u, w in top]}
                              for t, v, top in zip(r.output_ids, r.output_logprobs, tops)]}
        content, calls = job.extra.get("tool_prefill", "") + render_text(job, r, decode), []
        if job.extra.get("tool_calls"):
            content, calls = extract_tool_calls(content)
        message = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
        finish = "tool_calls" if calls else r.finish_reason
        choices.append({"index": job.extra["index"], "message": message, "logprobs": lp, "finish_reason": finish})
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": now(),
        "model": model, "choices": choices, "usage": usage(jobs, results),
    }  # fmt: skip
