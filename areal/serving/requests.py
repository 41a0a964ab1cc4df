"""A request inside the generator (:class:`Seq`: tokens so far, how to sample and stop, its
future), what it resolves to (:class:`GenerationResult`), and :class:`BadRequest`, the error
every parser raises for an invalid field."""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Literal

import torch

from areal.serving.sampling import SamplingParams

if TYPE_CHECKING:
    from areal.serving.constraints import Guide

FinishReason = Literal["stop", "length", "abort"]


class BadRequest(ValueError):
    """An invalid request: ``field`` names the offending JSON field (HTTP 400)."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


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
    generator: torch.Generator | None
    t_submit: float = field(default_factory=time.monotonic)
    t_first: float = 0.0
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    tops: list[list[tuple[int, float]]] = field(default_factory=list)
    on_token: Callable[[int], None] | None = None  # called with each new token (streaming)
    stop_index: torch.Tensor | None = None  # stop ids suppressed before min_new_tokens
    guide: Guide | None = None  # the grammar its tokens must follow (structured outputs)

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
