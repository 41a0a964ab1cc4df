"""Structured outputs: grammar-constrained decoding with llguidance.

A request may carry a :class:`Constraint` (a JSON schema, any JSON object, a regex, a Lark or
GBNF grammar, a choice list, or the tool-call grammar tools.py builds). The server compiles it
with :class:`GrammarCompiler` (its own threads, never the event loop or the scheduler thread),
which gives each generation its own matcher (:class:`Guide`). At each decode step the generator
asks :func:`mask_logits` to set the logits of every token the grammar forbids to -inf in the
rows of constrained requests only, before sampling, and :func:`advance` feeds each sampled token
to its matcher. A batch without constrained rows skips both (one ``any()`` over the rows).

Why llguidance (not xgrammar or outlines): it needs neither torch nor triton (xgrammar pulls
triton and pins torch ranges, outlines pulls both), its Rust core is built to take untrusted
grammars (``LLParserLimits``: lexer fuel per step, lexer states, grammar size, so a hostile
regex or schema errors out in bounded time instead of hanging), it compiles lazily (no upfront
pass over the vocabulary) and takes JSON schema, regex and Lark, with Lark rules able to embed
JSON schemas (``%json``), which the tool-call grammar uses.

Bounds: a grammar's text is capped by ``server.max_grammar_chars``; its compile (lexer fuel and
states, ``server.grammar_lexer_fuel``) and wall time (``server.grammar_compile_timeout``) are
capped, each refusal a 400 naming the request field. Compiles run on threads with a 256 MiB
stack: llguidance's schema compiler recurses through ``$ref`` chains, and a long chain
overflowed an 8 MiB stack (a segfault of the whole server); 256 MiB holds any schema under the
size cap (tests/serving/test_structured_outputs.py compiles the deepest one that fits).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import math
import queue
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from re import _parser as sre_parse  # Python's own regex parser: the shape of a pattern's repeats
from typing import Any, Literal

import llguidance as llg
import llguidance.hf
import torch

from areal.serving.requests import BadRequest

Kind = Literal["json_schema", "regex", "lark", "ebnf", "choice"]
COMPILE_STACK_BYTES = 256 << 20  # see the module docstring
# JSON without free whitespace: ", " between items, ": " after keys (Python's and Hermes' own
# layout). Free whitespace would let a model pad forever between tokens of a JSON value.
# Counted repeats are unrolled when llguidance builds a regex: ((a{100}){100}){100} took 4.6 s,
# and a schema's "pattern" is built lazily, at the decode step that enters the string, which
# would stall every request. A pattern that unrolls to more characters than this is refused.
MAX_REGEX_UNITS = 10_000
_LARK_REGEX = re.compile(r"/((?:[^/\\\n]|\\.)+)/")  # a Lark /regex/ literal
_JSON_PATTERN = re.compile(r'"pattern"\s*:\s*("(?:[^"\\]|\\.)*")')  # inside a Lark %json schema
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Constraint:
    """What one request's output must match, and the request field it came from."""

    kind: Kind
    source: str  # the schema (JSON text), regex, grammar, or choices (a JSON list)
    field: str  # named by every error about it, e.g. response_format.json_schema.schema
    strict: bool = True  # json_schema: unsupported keywords are errors (False: ignored)


class ConstraintFailed(ValueError):
    """A constrained generation's grammar failed mid-way (a lexer limit at a step): the
    request fails alone, answered 400 naming its field."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


@dataclass
class Guide:
    """One generation's matcher: which tokens may come next given what was generated."""

    matcher: Any  # llguidance.LLMatcher
    field: str


@dataclass(frozen=True)
class GrammarLimits:
    """The ``server.*`` bounds on one grammar."""

    max_chars: int
    compile_timeout: float  # seconds
    lexer_fuel: int
    cache_size: int


def choice_grammar(choices: Any, field: str) -> str:
    """A Lark grammar matching exactly one of ``choices`` (a non-empty list of strings)."""
    if (
        not isinstance(choices, list)
        or not choices
        or not all(isinstance(c, str) and c for c in choices)
    ):
        raise BadRequest(field, "expected a non-empty list of non-empty strings")
    return "start: " + " | ".join(json.dumps(c) for c in choices)


def schema_text(value: Any, field: str) -> str:
    """A JSON schema sent as an object or as JSON text (SGLang sends text) -> JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise BadRequest(
                field, f"not valid JSON ({e.msg} at position {e.pos}); send a JSON schema"
            ) from None
    if not isinstance(value, (dict, bool)):
        raise BadRequest(field, f"expected a JSON schema object, got {str(value)[:80]}")
    return json.dumps(value)


def to_grammar(c: Constraint) -> str:
    """The llguidance grammar of ``c`` (not yet checked: the matcher reports its errors)."""
    if c.kind == "json_schema":
        return llg.LLMatcher.grammar_from_json_schema(
            c.source,
            defaults=JSON_LAYOUT,  # type: ignore[arg-type]
            overrides={"lenient": not c.strict},
        )
    if c.kind == "regex":
        return llg.LLMatcher.grammar_from_regex(c.source)
    if c.kind == "choice":
        return llg.LLMatcher.grammar_from_lark(choice_grammar(json.loads(c.source), c.field))
    if c.kind == "ebnf":  # GBNF (llama.cpp, SGLang's ebnf) or Lark: llguidance converts GBNF
        return llg.grammar_from("ebnf", c.source)
    return llg.LLMatcher.grammar_from_lark(c.source)


def regex_units(pattern: str) -> int:
    """An upper bound on the characters ``pattern`` unrolls to (counted repeats multiplied out;
    unbounded ones count once). A pattern Python cannot parse is bounded by its repeat counts."""
    try:
        tree = sre_parse.parse(pattern)
    except (re.error, RecursionError, OverflowError, ValueError):
        counts = [int(hi or lo) for lo, hi in re.findall(r"\{(\d+)(?:,(\d*))?\}", pattern)]
        return len(pattern) * math.prod(max(c, 1) for c in counts)
    return _units(tree)


def _units(items: Any) -> int:
    total = 0
    for op, av in items:
        name = str(op)
        if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            lo, hi, sub = av
            total += (max(lo, 1) if hi == sre_parse.MAXREPEAT else hi) * _units(sub)
        elif name == "SUBPATTERN":
            total += _units(av[-1])
        elif name == "BRANCH":
            total += max(_units(b) for b in av[1])
        elif name in ("ASSERT", "ASSERT_NOT", "ATOMIC_GROUP"):
            total += _units(av[-1] if isinstance(av, tuple) else av)
        elif name == "GROUPREF_EXISTS":
            total += max(_units(b) for b in av[1:] if b is not None)
        else:  # a literal, a class, any, an anchor
            total += 1
    return total


def _regexes(c: Constraint) -> list[str]:
    """The regexes inside ``c`` (the regex itself, a schema's patterns, a grammar's /.../)."""
    if c.kind == "regex":
        return [c.source]
    if c.kind in ("lark", "ebnf"):
        return _LARK_REGEX.findall(c.source) + [
            json.loads(s) for s in _JSON_PATTERN.findall(c.source)
        ]
    if c.kind != "json_schema":
        return []
    found, stack = [], [json.loads(c.source)]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                found.append(node["pattern"])
            if isinstance(node.get("patternProperties"), dict):
                found += list(node["patternProperties"])
            stack += node.values()
        elif isinstance(node, list):
            stack += node
    return found


def check_regexes(c: Constraint) -> None:
    """Refuse a constraint holding a regex that unrolls past MAX_REGEX_UNITS characters."""
    for pattern in _regexes(c):
        units = regex_units(pattern)
        if units > MAX_REGEX_UNITS:
            raise BadRequest(
                c.field,
                f"the regex {pattern[:60]!r} unrolls to {units} characters (counted repeats "
                f"multiplied out); this server compiles at most {MAX_REGEX_UNITS}; use * or + "
                "or smaller counts",
            )


def _big_stack_threads(n: int, target: Callable[[], None], name: str) -> None:
    """Start ``n`` daemon threads running ``target`` with a COMPILE_STACK_BYTES stack."""
    with _STACK_LOCK:  # threading.stack_size is process-wide: set it only around our starts
        old = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            for i in range(n):
                threading.Thread(target=target, name=f"{name}-{i}", daemon=True).start()
        finally:
            threading.stack_size(old)


_STACK_LOCK = threading.Lock()


class GrammarCompiler:
    """Compiles constraints on its own threads and keeps the newest ``cache_size`` compiled
    grammars (an initial matcher each, copied for every generation)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: list[int],
        limits: GrammarLimits,
        n_threads: int = 1,
    ):
        self.tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=eos_token_ids
        )
        self.limits = limits
        self.parser_limits = llg.LLParserLimits(
            initial_lexer_fuel=limits.lexer_fuel, step_lexer_fuel=limits.lexer_fuel
        )
        self._cache: collections.OrderedDict[Constraint, Any] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        _big_stack_threads(n_threads, self._work, "areal-grammar")

    def submit(self, c: Constraint, n: int) -> concurrent.futures.Future:
        """Compile ``c`` (or take it from the cache) on a compile thread; the future holds
        ``n`` fresh :class:`Guide` s or raises :class:`BadRequest` naming ``c.field``."""
        if len(c.source) > self.limits.max_chars:
            raise BadRequest(
                c.field,
                f"a grammar of {len(c.source)} characters; this server compiles at most "
                f"{self.limits.max_chars} (server.max_grammar_chars); send a smaller one",
            )
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((c, n, fut))
        return fut

    def _work(self) -> None:
        while True:
            c, n, fut = self._jobs.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                initial = self._compiled(c)
                fut.set_result([Guide(initial.deep_copy(), c.field) for _ in range(n)])
            except BaseException as e:  # reported to the request that sent it
                fut.set_exception(e)

    def _compiled(self, c: Constraint) -> Any:
        with self._lock:
            if c in self._cache:
                self._cache.move_to_end(c)
                return self._cache[c]
        check_regexes(c)
        try:
            grammar = to_grammar(c)
        except ValueError as e:  # malformed text the converters refuse (GBNF, choice JSON)
            raise BadRequest(c.field, f"cannot compile: {e}") from None
        matcher = llg.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.parser_limits)
        if not matcher.is_error():
            matcher.compute_bitmask()  # the first mask: builds the initial lexer states now
        if matcher.is_error():
            error = _first_line(matcher.get_error())
            hint = (
                f" (server.grammar_lexer_fuel={self.limits.lexer_fuel})" if "fuel" in error else ""
            )
            raise BadRequest(c.field, f"cannot compile: {error}{hint}; fix or simplify it")
        with self._lock:
            self._cache[c] = matcher
            while len(self._cache) > self.limits.cache_size:
                self._cache.popitem(last=False)
        return matcher


def _first_line(message: str) -> str:
    return " ".join(message.split())[:300]


async def compile_guides(
    compiler: GrammarCompiler, constraints: list[Constraint | None]
) -> list[Guide | None] | None:
    """One :class:`Guide` per constrained job (None for free jobs; None for all when none is
    constrained), each distinct constraint compiled once, within
    ``server.grammar_compile_timeout``."""
    if all(c is None for c in constraints):
        return None
    where: dict[Constraint, list[int]] = {}
    for i, c in enumerate(constraints):
        if c is not None:
            where.setdefault(c, []).append(i)
    guides: list[Guide | None] = [None] * len(constraints)
    timeout = compiler.limits.compile_timeout
    for c, rows in where.items():
        try:
            made = await asyncio.wait_for(
                asyncio.wrap_future(compiler.submit(c, len(rows))), timeout
            )
        except TimeoutError:
            raise BadRequest(
                c.field,
                f"did not compile within {timeout} s (server.grammar_compile_timeout); simplify it",
            ) from None
        for i, guide in zip(rows, made):
            guides[i] = guide
    return guides


def mask_logits(logits: torch.Tensor, guides: list[Guide | None]) -> torch.Tensor:
    """``logits [B, V]`` with the tokens each row's grammar forbids at -inf (rows without a
    guide untouched; the same tensor when no row has one)."""
    rows = [i for i, g in enumerate(guides) if g is not None]
    if not rows:
        return logits
    # Imported here: llguidance.torch's module-level torch.compile pulls in dynamo and inductor,
    # 3.7 s of every server's start-up, for requests that few runs send.
    import llguidance.torch as llg_torch

    B, V = len(rows), logits.shape[-1]
    bitmask = llg_torch.allocate_token_bitmask(
        B, V
    )  # [B, ceil(V/32)] int32, bit v of row = allowed
    for j, i in enumerate(rows):
        llg_torch.fill_next_token_bitmask(guides[i].matcher, bitmask, j)  # type: ignore[union-attr]
    bits = bitmask.to(logits.device)[:, :, None] >> torch.arange(
        32, dtype=torch.int32, device=logits.device
    )
    allowed = (bits & 1).bool().reshape(B, -1)[:, :V]  # [B, V]
    logits = logits.clone()
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return logits


def advance(guide: Guide, token: int) -> bool:
    """Feed the sampled ``token`` to ``guide``; True when the grammar is complete (the output
    must end here). Raises :class:`ConstraintFailed` when the matcher failed."""
    if not guide.matcher.consume_token(token) or guide.matcher.is_error():
        raise ConstraintFailed(
            guide.field,
            f"the grammar failed at output token {token}: {_first_line(guide.matcher.get_error())}",
        )
    return guide.matcher.is_stopped()
