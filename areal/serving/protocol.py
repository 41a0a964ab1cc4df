"""Request parsing and response building for the server: SGLang native and OpenAI schemas.

Pure functions (no sockets): each parser turns a JSON body into generator requests or raises
:class:`BadRequest` naming the offending field. Schemas follow SGLang's documented ``/generate``
(``text`` | ``input_ids``, ``sampling_params``, ``return_logprob``; response ``text``,
``output_ids``, ``meta_info`` with ``finish_reason``, ``prompt_tokens``, ``completion_tokens``,
``output_token_logprobs`` as ``[logprob, token_id, null]`` triples) and OpenAI's completions and
chat completions objects. Extensions: ``meta_info.output_token_versions`` (weight version per
token) and an integer ``meta_info.weight_version``.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, overload

from areal.api.config.server import GenerationServerConfig
from areal.api.sampling import stop_problems, stop_strings
from areal.serving.constraints import Constraint, Kind, schema_text
from areal.serving.requests import BadRequest, GenerationResult
from areal.serving.sampling import MAX_TOP_LOGPROBS, SamplingParams


@dataclass
class Job:
    """One generator request plus how to render its answer."""

    input_ids: list[int]
    params: SamplingParams
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    extra: dict[str, Any] = field(default_factory=dict)
    constraint: Constraint | None = None  # structured outputs: the grammar the output follows
    # OpenAI routes: the fields a context overflow names, the prompt's (messages or prompt) and
    # the length limit's where the request sent one (max_tokens or max_completion_tokens)
    prompt_field: str | None = None
    limit_field: str | None = None


# Parameters accepted only at their neutral value (we do not implement penalties).
NEUTRAL = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
}
SGLANG_SAMPLING_KEYS = {
    "max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop",
    "stop_token_ids", "ignore_eos", "seed", "sampling_seed", "no_stop_trim",
    "skip_special_tokens", "n", "json_schema", "regex", "ebnf", *NEUTRAL,
}  # fmt: skip
GENERATE_KEYS = {
    "text", "input_ids", "sampling_params", "return_logprob", "rid", "stream",
    "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs",
}  # fmt: skip


@overload
def _int(d: dict, key: str, path: str, default: int, lo: int | None = None) -> int: ...
@overload
def _int(d: dict, key: str, path: str, default: None, lo: int | None = None) -> int | None: ...
def _int(d: dict, key: str, path: str, default: int | None, lo: int | None = None) -> int | None:
    """``d[key]`` as an integer (>= ``lo``), ``default`` when absent or null; the field's path
    names a bad value."""
    v = d.get(key)
    if v is None:  # absent or null: the default
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"{path}{key}", f"expected an integer, got {v!r}")
    if lo is not None and v < lo:
        raise BadRequest(f"{path}{key}", f"must be >= {lo}, got {v}")
    return v


def _float(d: dict, key: str, path: str, default: float) -> float:
    v = d.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadRequest(f"{path}{key}", f"expected a number, got {v!r}")
    try:
        return float(v)
    except OverflowError:  # an int past float's range
        raise BadRequest(f"{path}{key}", f"{str(v)[:20]}... is out of range") from None


def _bool(d: dict, key: str, path: str, default: bool) -> bool:
    v = d.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"{path}{key}", f"expected true/false, got {v!r}")
    return v


def _stop_strings(v: Any, path: str, cfg: GenerationServerConfig) -> tuple[str, ...]:
    """Stop strings, bounded (areal.api.sampling's rule): each is searched for in the output at
    every decode step."""
    problems = stop_problems(v, cfg.max_stop_strings, cfg.max_stop_chars)
    if problems:
        raise BadRequest(path, problems[0][1])
    return stop_strings(v)


def check_count(count: int, cfg: GenerationServerConfig) -> None:
    """Refuse more than ``server.max_n`` completions (prompts x n) before any job is built."""
    if count > cfg.max_n:
        raise BadRequest(
            "n",
            f"{count} completions asked in one request (prompts x n); this server "
            f"allows {cfg.max_n} (server.max_n)",
        )


def check_prompt_logprobs(
    prompts: list[list[int]], field: str, cfg: GenerationServerConfig
) -> None:
    """Refuse prompt logprobs over more than ``server.max_prompt_logprob_tokens`` tokens: each
    prompt costs a forward pass of its own between decode steps."""
    total = sum(map(len, prompts))
    if total > cfg.max_prompt_logprob_tokens:
        raise BadRequest(
            field,
            f"prompt logprobs asked for {total} prompt tokens; this server scores at "
            f"most {cfg.max_prompt_logprob_tokens} per request (server.max_prompt_logprob_tokens); "
            "send fewer or shorter prompts per request",
        )


def _token_list(v: Any, path: str) -> list[int]:
    if not isinstance(v, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in v
    ):
        raise BadRequest(path, f"expected a list of token ids (ints), got {str(v)[:80]}")
    return v


def _check_known(d: dict, known: set[str], path: str) -> None:
    for key in d:
        if key not in known:
            raise BadRequest(f"{path}{key}", f"unknown parameter; supported: {sorted(known)}")
        if key in NEUTRAL and d[key] not in (None, NEUTRAL[key]):
            raise BadRequest(f"{path}{key}", f"only {NEUTRAL[key]} is supported, got {d[key]!r}")


def sampling_from_sglang(
    sp: Any, cfg: GenerationServerConfig, path: str = "sampling_params."
) -> tuple[SamplingParams, dict]:
    """SGLang ``sampling_params`` -> (SamplingParams, {no_stop_trim, skip_special_tokens})."""
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise BadRequest(path.rstrip("."), f"expected an object, got {sp!r}")
    _check_known(sp, SGLANG_SAMPLING_KEYS, path)
    if _int(sp, "n", path, 1, lo=1) != 1:
        raise BadRequest(f"{path}n", "only n=1 is supported on /generate; send several requests")
    seed = _int(sp, "seed", path, None)
    seed = _int(sp, "sampling_seed", path, None) if seed is None else seed
    params = SamplingParams(
        max_new_tokens=_int(sp, "max_new_tokens", path, 128, lo=0),
        min_new_tokens=_int(sp, "min_new_tokens", path, 0, lo=0),
        temperature=_float(sp, "temperature", path, 1.0),
        top_p=_float(sp, "top_p", path, 1.0),
        top_k=_int(sp, "top_k", path, -1),
        min_p=_float(sp, "min_p", path, 0.0),
        stop=_stop_strings(sp.get("stop"), f"{path}stop", cfg),
        stop_token_ids=tuple(_token_list(sp.get("stop_token_ids") or [], f"{path}stop_token_ids")),
        ignore_eos=_bool(sp, "ignore_eos", path, False),
        seed=seed,
    )
    for problem in params.problems():
        raise BadRequest(path + problem.split(":")[0], problem.split(": ", 1)[1])
    opts = {
        "no_stop_trim": _bool(sp, "no_stop_trim", path, False),
        "skip_special_tokens": _bool(sp, "skip_special_tokens", path, True),
    }
    return params, opts


def constraint_from_sglang(
    sp: dict, additional_properties: bool, path: str = "sampling_params."
) -> Constraint | None:
    """SGLang's structured-output fields: at most one of ``json_schema`` (JSON text or an
    object), ``regex`` and ``ebnf`` (GBNF or Lark); unsupported schema keywords are ignored;
    ``additional_properties``: ``server.json_schema_additional_properties``."""
    given: list[Kind] = [k for k in ("json_schema", "regex", "ebnf") if sp.get(k) is not None]
    if not given:
        return None
    key = path + given[0]
    if len(given) > 1:
        raise BadRequest(
            path + given[1], f"send at most one of json_schema, regex and ebnf, got {given}"
        )
    if sp.get("min_new_tokens"):
        raise BadRequest(
            f"{path}min_new_tokens",
            "cannot be combined with a grammar (the grammar decides where the output ends); send 0",
        )
    if given[0] == "json_schema":
        schema = schema_text(sp["json_schema"], key)
        return Constraint("json_schema", schema, key, False, additional_properties)
    value = sp[given[0]]
    if not isinstance(value, str) or not value:
        raise BadRequest(key, f"expected a non-empty string, got {str(value)[:80]}")
    return Constraint(given[0], value, key)


def parse_generate(
    body: Any, encode: Callable[[str], list[int]], cfg: GenerationServerConfig
) -> tuple[list[Job], bool, bool]:
    """SGLang ``/generate`` body -> (jobs, is_batch, return_logprob); every count is checked
    against ``cfg``'s limits before a prompt is tokenized."""
    if not isinstance(body, dict):
        raise BadRequest("body", "expected a JSON object")
    _check_known(body, GENERATE_KEYS, "")
    if body.get("stream"):
        raise BadRequest(
            "stream",
            "/generate does not stream; use /v1/completions or /v1/chat/completions with "
            "stream=true",
        )
    if (body.get("text") is None) == (body.get("input_ids") is None):
        raise BadRequest("input_ids", "send exactly one of text or input_ids")
    params, opts = sampling_from_sglang(body.get("sampling_params"), cfg)
    if body.get("input_ids") is not None:
        ids = body["input_ids"]
        batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        check_count(len(ids) if batch else 1, cfg)
        prompts = [_token_list(p, "input_ids") for p in (ids if batch else [ids])]
    else:
        text = body["text"]
        batch = isinstance(text, list)
        texts = text if batch else [text]
        if not all(isinstance(t, str) for t in texts):
            raise BadRequest("text", "expected a string or a list of strings")
        check_count(len(texts), cfg)
        prompts = [encode(t) for t in texts]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise BadRequest(
            "input_ids" if body.get("input_ids") is not None else "text", "empty prompt"
        )
    return_logprob = _bool(body, "return_logprob", "", False)
    start = _int(body, "logprob_start_len", "", -1, lo=-1)
    top = _int(body, "top_logprobs_num", "", 0, lo=0)
    if top > MAX_TOP_LOGPROBS:
        raise BadRequest("top_logprobs_num", f"must be <= {MAX_TOP_LOGPROBS}, got {top}")
    extra: dict[str, Any] = {}
    if return_logprob:
        params = dataclasses.replace(params, top_logprobs=top)
        if start >= 0:  # prompt logprobs from this position on
            check_prompt_logprobs(prompts, "logprob_start_len", cfg)
            extra = {"prompt_logprobs": top, "logprob_start_len": start}
    constraint = constraint_from_sglang(
        body.get("sampling_params") or {}, cfg.json_schema_additional_properties
    )
    jobs = [
        Job(p, params, **opts, extra={**extra, "prompt_index": i}, constraint=constraint)
        for i, p in enumerate(prompts)
    ]
    return jobs, batch, return_logprob


def check_job(job: Job, problems: list[str], context_length: int) -> None:
    """Raise the 400 of a job the server cannot run: on the OpenAI routes a prompt that fills
    the context, or a prompt and sent max_tokens past it, in OpenAI's shape (code
    ``context_length_exceeded``, naming the prompt's field or the limit's; as vLLM, no silent
    clamp of a limit the client set), else the first of ``problems`` (the generator's
    request_problems: /generate keeps SGLang's answers, its max_new_tokens ends at the context)."""
    prompt = len(job.input_ids)
    if job.prompt_field is not None and prompt >= context_length:
        raise BadRequest(
            job.prompt_field,
            f"this model's maximum context length is {context_length} tokens and the "
            f"{job.prompt_field} take {prompt}, leaving no room for an answer; shorten them",
            code="context_length_exceeded",
        )
    wanted = prompt + job.params.max_new_tokens
    if job.limit_field is not None and wanted > context_length:
        raise BadRequest(
            job.limit_field,
            f"{job.limit_field}={job.params.max_new_tokens} with a prompt of {prompt} tokens "
            f"asks for {wanted} tokens; this model's maximum context length is {context_length}; "
            f"send {job.limit_field} <= {context_length - prompt}, or leave it out (the answer "
            "then ends with the context)",
            code="context_length_exceeded",
        )
    if problems:
        field, message = problems[0].split(": ", 1)
        raise BadRequest(field, message)


def finish_reason_obj(r: GenerationResult) -> dict:
    """SGLang ``meta_info.finish_reason``."""
    if r.finish_reason == "length":
        return {"type": "length", "length": len(r.output_ids)}
    if r.finish_reason == "abort":
        return {"type": "abort", "message": "aborted (pause_generation or shutdown)"}
    return {"type": "stop", "matched": r.matched}


def render_text(job: Job, r: GenerationResult, decode: Callable[[list[int], bool], str]) -> str:
    """Decoded completion; a matched stop string and what follows it are cut unless no_stop_trim."""
    text = decode(r.output_ids, job.skip_special_tokens)
    if isinstance(r.matched, str) and not job.no_stop_trim:
        cut = text.find(r.matched)
        if cut >= 0:
            text = text[:cut]
    return text


def generate_response(
    job: Job, r: GenerationResult, version: int, return_logprob: bool, decode: Callable
) -> dict:
    """SGLang ``/generate`` response object for one request."""
    meta: dict[str, Any] = {
        "id": uuid.uuid4().hex,
        "finish_reason": finish_reason_obj(r),
        "prompt_tokens": len(r.input_ids),
        "completion_tokens": len(r.output_ids),
        "cached_tokens": 0,
        "weight_version": version,
        "output_token_versions": r.output_versions,
        "e2e_latency": r.latency,
        "ttft": r.ttft,
    }
    if return_logprob:
        meta["output_token_logprobs"] = [
            [lp, tok, None] for lp, tok in zip(r.output_logprobs, r.output_ids)
        ]
        start = job.extra.get("logprob_start_len", -1)
        lps, tops = job.extra.get("input_logprobs", []), job.extra.get("input_tops", [])
        meta["input_token_logprobs"] = (
            [[lp, tok, None] for lp, tok in zip(lps, r.input_ids)][max(start, 0) :]
            if start >= 0
            else []
        )
        if job.params.top_logprobs:
            meta["output_top_logprobs"] = [
                [[lp, t, None] for t, lp in top] for top in r.output_top_logprobs
            ]
            meta["input_top_logprobs"] = (
                [None if top is None else [[lp, t, None] for t, lp in top] for top in tops][
                    max(start, 0) :
                ]
                if start >= 0
                else []
            )
    return {"text": render_text(job, r, decode), "output_ids": r.output_ids, "meta_info": meta}


def usage(jobs: list[Job], results: list[GenerationResult]) -> dict:
    """OpenAI ``usage`` over all choices: each prompt's tokens once (however many samples it
    has), every completion's tokens."""
    first = {job.extra.get("prompt_index", i): r for i, (job, r) in enumerate(zip(jobs, results))}
    prompt = sum(len(r.input_ids) for r in first.values())
    completion = sum(len(r.output_ids) for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def now() -> int:
    """Unix seconds for ``created`` fields."""
    return int(time.time())


def error_body(
    status: int, message: str, param: str | None = None, code: str | int | None = None
) -> dict:
    """The JSON of an error answer (OpenAI's shape): ``param`` names the offending field."""
    kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code or status}}
