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

Scheduling: compiles run on ``server.grammar_compile_threads`` threads (a grammar that took
2 s per compile on one shared thread made eight of them fail every other structured request).
A cached grammar is copied on the event loop at once, never queued behind compiles; requests
sending the same new grammar share one compile; at most ``server.max_queued_grammars`` wait for
a thread (more: :class:`Overloaded`, HTTP 503 with Retry-After). A request waits at most
``grammar_compile_timeout`` for a thread (then Overloaded: busy, not its grammar's fault) and as
long for its own compile (then a 400 naming its field). A compile whose requests gave up still
runs to its end (llguidance cannot be interrupted) and is cached; it holds its thread meanwhile,
which the queue bound accounts for.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import json
import math
import queue
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass

# Python's own regex parser (the shape of a pattern's repeats); typeshed's re stub lacks it
from re import _parser as sre_parse  # pyright: ignore[reportAttributeAccessIssue]  # stub defect
from typing import TYPE_CHECKING, Any, Literal, cast

import llguidance as llg
import llguidance.hf
import torch

from areal.serving.requests import BadRequest, Overloaded, json_type
from areal.utils.tool_calls import JSON_LAYOUT, forbid_unnamed_properties

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

Kind = Literal["json_schema", "regex", "lark", "ebnf", "choice"]
COMPILE_STACK_BYTES = 256 << 20  # see the module docstring
# Counted repeats are unrolled when llguidance builds a regex: ((a{100}){100}){100} took 4.6 s,
# and a schema's "pattern" is built lazily, at the decode step that enters the string, which
# would stall every request. A pattern that unrolls to more characters than this is refused.
MAX_REGEX_UNITS = 10_000
_LARK_REGEX = re.compile(r"/((?:[^/\\\n]|\\.)+)/")  # a Lark /regex/ literal
_JSON_PATTERN = re.compile(r'"pattern"\s*:\s*("(?:[^"\\]|\\.)*")')  # inside a Lark %json schema


@dataclass(frozen=True)
class Constraint:
    """What one request's output must match, and the request field it came from."""

    kind: Kind
    source: str  # the schema (JSON text), regex, grammar, or choices (a JSON list)
    field: str  # named by every error about it, e.g. response_format.json_schema.schema
    strict: bool = True  # json_schema: unsupported keywords are errors (False: ignored)
    # json_schema: whether an object naming properties allows others where it leaves
    # additionalProperties unset (server.json_schema_additional_properties; False: it does not,
    # forbid_unnamed_properties at compile, so server.max_grammar_chars bounds the schema sent)
    additional_properties: bool = True


class ConstraintFailed(BadRequest):
    """A constrained generation's grammar failed mid-way (a lexer limit at a step): the
    request fails alone, answered 400 naming its field."""


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
    threads: int  # compile threads
    max_queued: int  # compiles waiting for a thread


def choice_grammar(choices: Any, field: str) -> str:
    """A Lark grammar matching exactly one of ``choices`` (a non-empty list of strings)."""
    if not isinstance(choices, list) or not choices:
        got = "an empty array" if choices == [] else json_type(choices)
        raise BadRequest(
            field, f'expected a non-empty list of strings, got {got}; send e.g. ["yes", "no"]'
        )
    bad = [c for c in choices if not (isinstance(c, str) and c)]
    if bad:
        raise BadRequest(
            field, f"every choice must be a non-empty string, got {json_type(bad[0])}; drop it"
        )
    return "start: " + " | ".join(json.dumps(c) for c in choices)


def schema_text(value: Any, field: str) -> str:
    """A JSON schema sent as an object or as JSON text of one (SGLang sends text) -> JSON text."""
    schema = value
    if isinstance(value, str):
        try:
            schema = json.loads(value)
        except json.JSONDecodeError as e:
            raise BadRequest(
                field,
                f"got {json_type(value)}, which is not JSON text ({e.msg} at position {e.pos}); "
                "send the JSON schema as an object",
            ) from None
    if not isinstance(schema, (dict, bool)):
        held = f" holding {json_type(schema)}" if isinstance(value, str) else ""
        raise BadRequest(
            field,
            f"expected a JSON schema (an object, or true/false), got {json_type(value)}{held}; "
            "send the schema object itself",
        )
    return json.dumps(schema)


def to_grammar(c: Constraint) -> str:
    """The llguidance grammar of ``c`` (not yet checked: the matcher reports its errors)."""
    if c.kind == "json_schema":
        schema = json.loads(c.source)
        closed = schema if c.additional_properties else forbid_unnamed_properties(schema)
        layout: JsonCompileOptions = cast("JsonCompileOptions", JSON_LAYOUT)  # a dict of its keys
        return llg.LLMatcher.grammar_from_json_schema(
            json.dumps(closed),
            defaults=layout,
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


@dataclass
class _Compile:
    """One constraint's compile: queued until a compile thread starts it, shared by every
    request that sends the same constraint meanwhile (``waiters`` of them)."""

    constraint: Constraint
    started: concurrent.futures.Future = dataclasses.field(
        default_factory=concurrent.futures.Future
    )
    done: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    waiters: int = 1


class GrammarCompiler:
    """Compiles constraints on a pool of ``limits.threads`` threads and keeps the newest
    ``cache_size`` compiled grammars (an initial matcher each, copied for every generation).

    A cached grammar never waits for a thread. At most ``limits.max_queued`` compiles wait for
    a thread; past that a request needing a new compile is refused (:class:`Overloaded`)."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int], limits: GrammarLimits
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
        self._pending: dict[Constraint, _Compile] = {}  # queued or running, by constraint
        self._queued = 0  # compiles in _jobs not yet started that someone still waits for
        self._running = 0  # compiles on a thread now
        self._jobs: queue.SimpleQueue[_Compile] = queue.SimpleQueue()
        _big_stack_threads(limits.threads, self._work, "areal-grammar")

    def cached(self, c: Constraint) -> Any | None:
        """The initial matcher of ``c`` when it was compiled before (marked newest), else None."""
        with self._lock:
            if c in self._cache:
                self._cache.move_to_end(c)
                return self._cache[c]
        return None

    def enqueue(self, c: Constraint) -> _Compile:
        """Join the compile of ``c`` under way, or queue a new one; :class:`Overloaded` when
        ``limits.max_queued`` compiles already wait. Every call is paired with :meth:`leave`."""
        if len(c.source) > self.limits.max_chars:
            raise BadRequest(
                c.field,
                f"a grammar of {len(c.source)} characters; this server compiles at most "
                f"{self.limits.max_chars} (server.max_grammar_chars); send a smaller one",
            )
        with self._lock:
            job = self._pending.get(c)
            if job is not None:
                job.waiters += 1
                return job
            waiting = self._queued - (self.limits.threads - self._running)  # beyond idle threads
            if waiting >= self.limits.max_queued:
                raise Overloaded(
                    c.field,
                    f"{waiting} grammars already wait for the {self.limits.threads} "
                    f"compile threads (server.max_queued_grammars={self.limits.max_queued}); "
                    "retry later, or send a grammar this server compiled before (cached)",
                )
            job = self._pending[c] = _Compile(c)
            self._queued += 1
        self._jobs.put(job)
        return job

    def leave(self, job: _Compile) -> None:
        """One request stops waiting for ``job``; a job nobody waits for is dropped unstarted
        (a started one runs to its end: a compile cannot be interrupted, and it is cached)."""
        with self._lock:
            job.waiters -= 1
            if job.waiters == 0 and not job.started.done():
                self._queued -= 1
                if self._pending.get(job.constraint) is job:
                    del self._pending[job.constraint]

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            with self._lock:
                if job.waiters == 0:  # its requests gave up before a thread was free
                    continue
                self._queued -= 1
                self._running += 1
                job.started.set_result(None)
            try:  # a request that raced the compile before may have cached it meanwhile
                initial = self.cached(job.constraint)
                job.done.set_result(self._build(job.constraint) if initial is None else initial)
            except BaseException as e:  # reported to the requests that sent it
                job.done.set_exception(e)
            finally:
                with self._lock:
                    self._running -= 1
                    if self._pending.get(job.constraint) is job:
                        del self._pending[job.constraint]

    def _build(self, c: Constraint) -> Any:
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


async def _done_within(fut: concurrent.futures.Future, timeout: float) -> bool:
    """True when ``fut`` is done within ``timeout`` seconds; ``fut`` is never cancelled (other
    requests may wait for it too)."""
    loop = asyncio.get_running_loop()
    ready = asyncio.Event()

    def wake(_: concurrent.futures.Future) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
            loop.call_soon_threadsafe(ready.set)

    fut.add_done_callback(wake)
    try:
        await asyncio.wait_for(ready.wait(), timeout)
    except TimeoutError:
        return False
    return True


async def _initial_matcher(compiler: GrammarCompiler, c: Constraint) -> Any:
    """``c``'s compiled initial matcher: from the cache at once, else compiled on a compile
    thread, waiting at most ``compile_timeout`` for a free thread (then :class:`Overloaded`:
    other requests' grammars hold them) and as long again for its own compile (then a 400
    naming ``c.field``)."""
    initial = compiler.cached(c)
    if initial is not None:
        return initial
    timeout = compiler.limits.compile_timeout
    job = compiler.enqueue(c)
    try:
        if not await _done_within(job.started, timeout):
            raise Overloaded(
                c.field,
                f"no grammar compile thread was free within {timeout} s (all "
                f"{compiler.limits.threads} busy with other requests' grammars; "
                "server.grammar_compile_threads); retry later",
            )
        if not await _done_within(job.done, timeout):
            raise BadRequest(
                c.field,
                f"did not compile within {timeout} s (server.grammar_compile_timeout); simplify it",
            )
        return job.done.result()
    finally:
        compiler.leave(job)


async def compile_guides(
    compiler: GrammarCompiler, constraints: list[Constraint | None]
) -> list[Guide | None] | None:
    """One :class:`Guide` per constrained job (None for free jobs; None for all when none is
    constrained), each distinct constraint compiled once (see :func:`_initial_matcher`)."""
    if all(c is None for c in constraints):
        return None
    where: dict[Constraint, list[int]] = {}
    for i, c in enumerate(constraints):
        if c is not None:
            where.setdefault(c, []).append(i)
    guides: list[Guide | None] = [None] * len(constraints)
    for c, rows in where.items():
        initial = await _initial_matcher(compiler, c)
        for i in rows:
            guides[i] = Guide(initial.deep_copy(), c.field)
    return guides


def mask_logits(logits: torch.Tensor, guides: list[Guide | None]) -> torch.Tensor:
    """``logits [B, V]`` with the tokens each row's grammar forbids at -inf (rows without a
    guide untouched; the same tensor when no row has one)."""
    rows = [i for i, g in enumerate(guides) if g is not None]
    present = [g for g in guides if g is not None]  # the guide of each of rows
    if not rows:
        return logits
    # Imported here: llguidance.torch's module-level torch.compile pulls in dynamo and inductor,
    # 3.7 s of every server's start-up, for requests that few runs send.
    import llguidance.torch as llg_torch

    B, V = len(rows), logits.shape[-1]
    bitmask = llg_torch.allocate_token_bitmask(
        B, V
    )  # [B, ceil(V/32)] int32, bit v of row = allowed
    for j, guide in enumerate(present):
        llg_torch.fill_next_token_bitmask(guide.matcher, bitmask, j)
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
