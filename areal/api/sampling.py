"""The rules a generation request's sampling fields follow, in one place, and the error of a
request refused for what it asks.

The generation server (areal.serving.protocol, areal.serving.sampling) refuses a request that
breaks them with HTTP 400 naming the field; the agent client (areal.workflow.openai_client, in
process and behind the agent proxy) checks the same rules before it sends, so an agent is told
the server's words without a round trip. A request that passes here can still be refused by a
server for what only the server knows (a prompt longer than its context, a limit configured
differently): that answer surfaces as :class:`RequestRejected` too (areal.rollout.remote), the
caller's error, never the engine's.

Pure functions: each returns ``(field, problem)`` pairs, empty when the values are valid, so each
caller raises its own error type with every problem at once.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-4, 1e4  # logits / T stays finite in fp32 inside these
MAX_INT = 2**31 - 1  # counts and top_k fit an int32 tensor
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed's range
MAX_TOP_LOGPROBS = 20  # alternatives reported per token (OpenAI's limit)
FLOAT32_MAX = 3.4028234663852886e38  # float32's largest finite value
# HTTP statuses a server answers for what a request asks (bad field, body too large,
# unprocessable): the caller's error. Other 4xx (401, 403, 404, ...) are the run's configuration.
REJECTED_STATUSES = (400, 413, 422)

Problem = tuple[str, str]  # (field, what is wrong with it and the fix)


class RequestRejected(ValueError):
    """A generation request refused for what it asks: ``field`` names the offending field (None
    when the refusal did not say), ``status`` is the HTTP status a server answers for it."""

    def __init__(self, message: str, field: str | None = None, status: int = 400):
        super().__init__(message)
        self.field = field
        self.status = status

    @classmethod
    def of(cls, problems: list[Problem]) -> RequestRejected:
        """One error naming every problem (the first one's field as ``field``)."""
        return cls("; ".join(f"{f}: {p}" for f, p in problems), problems[0][0])


def number_problems(fields: dict[str, Any], integers: tuple[str, ...] = ()) -> list[Problem]:
    """Each of ``fields`` that is set must be a number (an int for those in ``integers``);
    JSON's ``true``/``false`` are not numbers."""
    out = []
    for name, v in fields.items():
        kind = int if name in integers else (int, float)
        if v is not None and (isinstance(v, bool) or not isinstance(v, kind)):
            want = "an integer" if name in integers else "a number"
            out.append((name, f"expected {want}, got {str(v)[:80]}"))
    return out


def sampling_problems(
    *,
    max_new_tokens: int,
    min_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    top_logprobs: int = 0,
) -> list[Problem]:
    """The ranges of the sampling fields (the server's rules)."""
    out: list[Problem] = []
    for name, v in (("max_new_tokens", max_new_tokens), ("min_new_tokens", min_new_tokens)):
        if v < 0:
            out.append((name, f"must be >= 0, got {v}"))
    if min_new_tokens > max(max_new_tokens, 0):
        out.append(("min_new_tokens", f"{min_new_tokens} exceeds max_new_tokens {max_new_tokens}"))
    for name, v in (("max_new_tokens", max_new_tokens), ("min_new_tokens", min_new_tokens)):
        if v > MAX_INT:
            out.append((name, f"must be <= {MAX_INT}, got {v}"))
    t = temperature
    if not (t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE):  # NaN fails both
        out.append(
            (
                "temperature",
                f"must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], got {t}",
            )
        )
    if not 0 < top_p <= 1:  # NaN fails too
        out.append(("top_p", f"must be in (0, 1], got {top_p}"))
    if not -1 <= top_k <= MAX_INT:
        out.append(("top_k", f"must be -1 or 0 (off) or in [1, {MAX_INT}], got {top_k}"))
    if seed is not None and not 0 <= seed <= MAX_SEED:
        out.append(("seed", f"must be in [0, {MAX_SEED}], got {seed}"))
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        out.append(("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs}"))
    return out


def stop_problems(stop: Any, max_strings: int, max_chars: int) -> list[Problem]:
    """``stop``: None, a string or a list of strings, at most ``max_strings`` non-empty ones of
    ``max_chars`` characters together (each is searched for in the output at every decode step;
    the limits are ``server.max_stop_strings`` and ``server.max_stop_chars``)."""
    if stop is None or isinstance(stop, str):
        return []
    if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        return [("stop", f"expected a string or a list of strings, got {str(stop)[:80]}")]
    stops = [s for s in stop if s]
    if len(stops) > max_strings:
        return [
            (
                "stop",
                f"{len(stops)} stop strings; this server allows {max_strings} "
                "(server.max_stop_strings)",
            )
        ]
    if sum(map(len, stops)) > max_chars:
        return [
            (
                "stop",
                f"stop strings of {sum(map(len, stops))} characters together; this server "
                f"allows {max_chars} (server.max_stop_chars)",
            )
        ]
    return []


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    """The non-empty stop strings of a ``stop`` that has no :func:`stop_problems`."""
    if stop is None:
        return ()
    return tuple(s for s in ([stop] if isinstance(stop, str) else stop) if s)


def token_problems(field: str, ids: list[int], vocab_size: int) -> list[Problem]:
    """Token ids must be ints in ``[0, vocab_size)``."""
    bad = [
        t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size
    ]
    if bad:
        return [(field, f"token ids must be ints in [0, {vocab_size}), got {bad[:3]}")]
    return []


def finite_in_float32(value: Any) -> bool:
    """True when ``value`` is a real number that stays finite as a float32, rounded to nearest
    as ``torch.tensor(value, dtype=torch.float32)`` rounds it (rewards are trained as float32:
    ``1e308`` is finite in float64 but inf there); False for NaN, +-inf, a number beyond
    float32's range and anything ``float()`` refuses. A bool counts as a number."""
    if isinstance(value, bool):
        return True
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        return False
    if not math.isfinite(number):
        return False
    try:
        struct.pack("<f", number)  # raises exactly when the rounded float32 would be infinite
    except OverflowError:
        return False
    return True


def reward_problems(field: str, reward: Any) -> list[Problem]:
    """A reward must be a number (not a bool) that stays finite as a float32."""
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        return [(field, f"expected a finite number, got {str(reward)[:80]}")]
    if not finite_in_float32(reward):
        return [
            (
                field,
                f"expected a finite number within float32's range (|r| <= {FLOAT32_MAX:.4g}), "
                f"got {str(reward)[:40]}",
            )
        ]
    return []


def rejected_reply(status: int, text: str, where: str) -> RequestRejected | None:
    """The :class:`RequestRejected` of a server's HTTP answer ``status``/``text`` refusing a
    request for what it asks (:data:`REJECTED_STATUSES`), else None. Reads OpenAI's error shape
    (``{"error": {"message", "param"}}``, ours), SGLang's and vLLM's (``{"message", "param"}``),
    or plain text; ``where`` names the server and the call."""
    if status not in REJECTED_STATUSES:
        return None
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    error = body.get("error", body) if isinstance(body, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        message, param = error["message"], error.get("param")
    else:
        message, param = text[:500], None
    field = param if isinstance(param, str) and param else None
    return RequestRejected(f"{where} refused the request (HTTP {status}): {message}", field, status)
