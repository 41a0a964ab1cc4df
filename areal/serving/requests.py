"""A request inside the generator (:class:`Seq`: tokens so far, how to sample and stop, its
future), what it resolves to (:class:`GenerationResult`), :func:`request_problems` (what makes a
request impossible to run), :class:`BadRequest`, the error every parser raises for an invalid
field, and :class:`Overloaded`, the refusal of a request that would wait past a bound on queued
work."""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from areal.serving.sampling import SamplingParams

if TYPE_CHECKING:
    from areal.serving.constraints import Guide
    from areal.serving.stop_text import StopText

logger = logging.getLogger(__name__)
FinishReason = Literal["stop", "length", "abort"]


class BadRequest(ValueError):
    """An invalid request: ``field`` names the offending JSON field (HTTP 400); ``code`` is the
    error's ``code`` where OpenAI names one (``context_length_exceeded``), else None."""

    def __init__(self, field: str, message: str, code: str | None = None):
        self.field = field
        self.code = code
        super().__init__(f"{field}: {message}")


class Overloaded(Exception):
    """A request refused because the work queued before it is at its bound (HTTP 503 with
    Retry-After: back-pressure, not a dead server): ``field`` names what it needed, e.g. the
    grammar's field or ``body``."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


def json_type(value: object) -> str:
    """``value``'s JSON type as an error message names it: ``a string '{"typ...'``,
    ``an array``, ``null``..."""
    if isinstance(value, str):
        return f"a string {value[:40]!r}" + ("..." if len(value) > 40 else "")
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, (int, float)):
        return f"a number ({value})"
    return "an array" if isinstance(value, list) else "an object"


def request_problems(
    input_ids: list[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    context_length: int,
    eos_token_ids: frozenset[int],
    has_tokenizer: bool,
) -> list[str]:
    """``"field: problem"`` strings for a request a model of ``vocab_size`` tokens and a context
    of ``context_length`` cannot run (empty: none)."""
    problems = [f"sampling_params.{p}" for p in params.problems()]
    V = vocab_size
    if not input_ids:
        problems.append("input_ids: the prompt is empty; send at least one token")
    elif len(input_ids) >= context_length:
        problems.append(
            f"input_ids: prompt has {len(input_ids)} tokens, the context is "
            f"{context_length}; shorten the prompt"
        )
    bad = [t for t in input_ids if not (isinstance(t, int) and 0 <= t < V)]
    if bad:
        problems.append(f"input_ids: token ids must be ints in [0, {V}), got {bad[:3]}")
    bad = [t for t in params.stop_token_ids if not (isinstance(t, int) and 0 <= t < V)]
    if bad:
        problems.append(
            f"sampling_params.stop_token_ids: token ids must be ints in [0, {V}), got {bad[:3]}"
        )
    if params.stop and not has_tokenizer:
        problems.append("sampling_params.stop: stop strings need a tokenizer")
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_token_ids)
    if (
        params.min_new_tokens > 0
        and sum(1 for t in stops if isinstance(t, int) and 0 <= t < V) >= V
    ):
        problems.append(
            f"sampling_params.stop_token_ids: all {V} token ids of the vocabulary stop "
            "(stop_token_ids plus EOS unless ignore_eos), so no token can be sampled before "
            f"min_new_tokens={params.min_new_tokens}; leave at least one id out, or set "
            "min_new_tokens to 0"
        )
    return problems


@dataclass
class GenerationResult:
    """One finished (or aborted) request: tokens, behaviour logprobs and per-token versions."""

    input_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    finish_reason: FinishReason
    # per output token, its top_logprobs most likely (token, logprob) when the request asked
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    matched: int | str | None = None  # the stop token id or stop string that ended it
    latency: float = 0.0  # seconds, submit -> finish
    ttft: float = 0.0  # seconds, submit -> first token


@dataclass
class Seq:
    """One request queued or running in the generator."""

    prompt: list[int]
    params: SamplingParams
    future: concurrent.futures.Future
    stop_ids: frozenset[int]
    t_submit: float = field(default_factory=time.monotonic)
    t_first: float = 0.0
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    tops: list[list[tuple[int, float]]] = field(default_factory=list)
    on_token: Callable[[int], None] | None = None  # called with each new token (streaming)
    guide: Guide | None = None  # the grammar its tokens must follow (structured outputs)
    stop_text: StopText | None = None  # its output's text, when it has stop strings
    # its row of the batched sampler's table (sampler.py), built when it is first sampled
    sample_row: tuple[list[int], list[float], list[int]] | None = None
    cancelled: bool = False  # the caller cancelled the future (read each step, lock-free)
    kv_epoch: int = -1  # the prefix cache's epoch its cache rows were computed in (prefill)

    def __post_init__(self) -> None:
        self.future.add_done_callback(self._mark_cancelled)

    def _mark_cancelled(self, future: concurrent.futures.Future) -> None:
        self.cancelled = future.cancelled()

    def append_token(self, tok: int, logprob: float, version: int, now: float) -> None:
        """Record one sampled token (its logprob, the weight version it came from) and pass it
        to the stream's callback; a callback that raises is logged and dropped."""
        if not self.out:
            self.t_first = now
        self.out.append(tok)
        self.logprobs.append(logprob)
        self.versions.append(version)
        if self.on_token is not None:
            try:
                self.on_token(tok)
            except Exception:  # a stream's consumer went wrong: the generation goes on
                logger.exception("on_token callback failed; streaming of this request stops")
                self.on_token = None

    def resolve(self, reason: FinishReason, matched: int | str | None) -> None:
        """Answer the future with what was generated so far."""
        now = time.monotonic()
        result = GenerationResult(
            input_ids=self.prompt,
            output_ids=self.out,
            output_logprobs=self.logprobs,
            output_versions=self.versions,
            finish_reason=reason,
            output_top_logprobs=self.tops,
            matched=matched,
            latency=now - self.t_submit,
            ttft=(self.t_first - self.t_submit) if self.t_first else 0.0,
        )
        try:
            self.future.set_result(result)
        except concurrent.futures.InvalidStateError:  # cancelled by the caller meanwhile
            pass

    def fail(self, error: BaseException) -> None:
        """Raise ``error`` in the future."""
        try:
            self.future.set_exception(error)
        except concurrent.futures.InvalidStateError:  # cancelled by the caller meanwhile
            pass
