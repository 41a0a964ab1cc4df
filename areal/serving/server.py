"""``areal serve``: an aiohttp server over :class:`Generator` speaking SGLang's native API and
OpenAI's completions/chat API.

Endpoints
- generation: ``POST /generate`` (SGLang), ``POST /v1/completions``, ``POST /v1/chat/completions``,
  ``GET /v1/models``, ``POST /tokenize``, ``POST /detokenize``; structured outputs (a JSON schema,
  regex, grammar or choice list the output must match; a forced tool call) in
  :mod:`areal.serving.constraints`
- info: ``GET /health``, ``GET /health_generate``, ``GET /get_model_info``,
  ``GET /get_server_info``,
  ``GET /metrics`` (Prometheus text: load, the prefix cache's hit rate; :mod:`.metrics`)
- admin (:mod:`areal.serving.admin`; ``Authorization: Bearer <api_key>`` when an api_key is
  set; a non-loopback bind requires one): ``POST /pause_generation`` (abort in-flight requests,
  answered with their partial tokens and finish reason ``abort``; hold new ones),
  ``POST /continue_generation``,
  ``POST /update_weights_from_disk`` ``{"model_path", "weight_version"?}``,
  ``POST /init_weights_update_group`` and ``POST /update_weights_from_distributed`` (protocol in
  :mod:`areal.utils.weight_sync`), ``POST /update_weight_version`` ``{"new_version"}``,
  ``POST /flush_cache``, ``POST /release_memory_occupation`` (paused: give back the KV cache
  while a colocated trainer steps) and ``POST /resume_memory_occupation`` (SGLang's names).
Every route checks ``Host`` and the POST routes ``Origin`` (DNS rebinding, pages of other
sites: 403 naming ``server.allowed_hosts``; :mod:`areal.utils.http_guard`).
Invalid requests get HTTP 400 ``{"error": {"message", "type", "param"}}`` where ``param`` names
the field. Work before admission is bounded by ``server.*`` limits (body bytes: 413; text,
nesting, n, stop lists, prompt-logprob tokens: 400 naming the field and the limit; see
:mod:`areal.serving.limits`), parsing and tokenizing run off the event loop, request heads and
bodies have deadlines (the body's: 408) and connections a cap (:mod:`areal.serving.connections`;
past the connections kept for the control routes, generation is 503 with Retry-After).
A request whose logits turn NaN/inf fails alone (HTTP 500 naming it; counted in ``/health``). A
generation step that raises fails only its requests (HTTP 500 naming the cause) and the server
goes on; after several failed steps in a row the generator counts as broken: requests get HTTP
503 naming the cause and the process exits with code 1, so its supervisor sees it. A client that
disconnects cancels its generation (its slot is freed at the next step). Weight updates with
tensors that are not floating point or not finite in the model's dtype, missing or unknown
tensors, unreadable files or ones that are not regular files in the dir (a named pipe: never
opened; :mod:`areal.serving.weight_files`) get 400 and keep the old weights. Pause and
continue take effect in the order they arrive. SIGTERM/SIGINT: in-flight requests are answered
(aborted), the port is closed, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

import torch
from aiohttp import web
from jinja2 import TemplateError

from areal.api.config.loader import ConfigError
from areal.api.config.server import GenerationServerConfig
from areal.api.launch import LaunchEnv
from areal.serving import limits, metrics, openai_api, protocol, streaming, tokens
from areal.serving.admin import AdminRoutes
from areal.serving.connections import ConnectionGuard, connection_limit, listen_socket
from areal.serving.constraints import (
    GrammarCompiler,
    GrammarLimits,
    compile_guides,
)
from areal.serving.generator import Generator, GeneratorStopped, StepFailed
from areal.serving.parsing import ParsePool
from areal.serving.protocol import BadRequest, Job, error_body
from areal.serving.requests import Overloaded
from areal.serving.sampling import SamplingParams
from areal.utils.http_guard import HostPolicy, guard_middleware, mutating
from areal.utils.process import die_with

logger = logging.getLogger("areal.serve")
HEALTH_GENERATE_TIMEOUT_S = 60.0
GENERATOR_WATCH_S = 0.5  # how often serve() checks that the generator is still running
RETRY_AFTER_S = 1  # what a work request refused for want of connections is told to wait
CONTROL_PATHS = ("/health", "/health_generate", "/get_model_info", "/get_server_info", "/v1/models")
T = TypeVar("T")


def _error(
    status: int, message: str, param: str | None = None, code: str | int | None = None
) -> web.Response:
    return web.json_response(error_body(status, message, param, code), status=status)


class ModelNotFound(Exception):
    """A request names a model this server does not serve (OpenAI answers 404)."""


@contextlib.contextmanager
def gpu_memory_cap(cfg: GenerationServerConfig) -> Iterator[None]:
    """On CUDA, hold this process to ``server.gpu_memory_fraction`` of its GPU (colocated with a
    trainer, the rest is the trainer's), and turn running out of it inside the block into a
    ConfigError naming the field; no cap on CPU or with 0."""
    device = torch.device(cfg.device)
    if device.type != "cuda" or not cfg.gpu_memory_fraction:
        yield
        return
    # torch takes an index here, not a bare "cuda" (the launcher's colocated servers say cuda)
    index = torch.cuda.current_device() if device.index is None else device.index
    torch.cuda.set_per_process_memory_fraction(cfg.gpu_memory_fraction, index)
    try:
        yield
    except torch.cuda.OutOfMemoryError as e:
        total = torch.cuda.get_device_properties(index).total_memory / 2**30
        raise ConfigError(
            [
                f"gpu_memory_fraction: {cfg.gpu_memory_fraction} of {total:.1f} GiB does not hold "
                f"the model at {cfg.model_path} ({str(e).splitlines()[0]}); raise "
                "server.gpu_memory_fraction or use a smaller server.dtype"
            ],
            "server",
        ) from None


class GenerationServer:
    """Owns the generator, tokenizer and weight-update group; builds the aiohttp app."""

    def __init__(self, cfg: GenerationServerConfig, num_threads: int = 0):
        from transformers import AutoTokenizer

        self.cfg = cfg
        torch.manual_seed(cfg.seed)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
        with gpu_memory_cap(cfg):
            self.generator = Generator.from_pretrained(
                cfg.model_path,
                device=cfg.device,
                dtype=getattr(torch, cfg.dtype),
                cpu_attention=cfg.cpu_attention,
                compile=cfg.compile,
                cuda_graphs=cfg.cuda_graphs,
                decode_buckets=cfg.decode_buckets,
                max_batch_size=cfg.max_batch_size,
                context_length=cfg.context_length or None,
                max_prefill_tokens=cfg.max_prefill_tokens,
                share_prompts=cfg.share_prompts,
                prefix_cache_tokens=cfg.prefix_cache_tokens,
                prefix_cache_block=cfg.prefix_cache_block,
                num_threads=num_threads,
                version=cfg.weight_version,
            )
        self.model_name = cfg.served_model_name or cfg.model_path
        self.text = tokens.TokenText(self.tokenizer)
        self.encode, self.decode = self.text.encode, self.text.decode
        spec = self.generator.model.spec
        self.grammars = GrammarCompiler(
            self.tokenizer,
            spec.vocab_size,
            sorted(spec.eos_token_ids),
            GrammarLimits(
                cfg.max_grammar_chars,
                cfg.grammar_compile_timeout,
                cfg.grammar_lexer_fuel,
                cfg.grammar_cache_size,
                cfg.grammar_compile_threads,
                cfg.max_queued_grammars,
            ),
        )
        self.hf_config = json.loads((Path(cfg.model_path) / "config.json").read_text())
        # JSON decoding, tokenizing and chat templates run here, off the event loop
        self.parser = ParsePool(
            cfg.parse_threads,
            cfg.parse_small_body_bytes,
            cfg.max_queued_parses,
            cfg.request_parse_timeout,
        )
        self.admin = AdminRoutes(self.generator, self._json_body, cfg.weight_read_timeout)
        self.admin_paths = {route.path for route in self.admin.routes()}
        # answered from the connections kept by server.control_connections under any load
        self.control_paths = self.admin_paths | {*CONTROL_PATHS, metrics.PATH}
        self.guard: ConnectionGuard | None = None  # set by serve() (tests in process run without)

    # ------------------------------------------------------------------ helpers

    def apply_template(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Chat messages (and tools) -> prompt ids via the tokenizer's chat template."""
        template = self.tokenizer.chat_template or ""
        if tools and "tools" not in template:
            raise BadRequest(
                "tools",
                "this model's chat template does not render tools, so the model "
                "would never see them; use a model whose template does (e.g. Qwen2.5)",
            )
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except TemplateError as e:  # the template's own raise_exception (a role it does not take)
            raise BadRequest("messages", f"the model's chat template refused them: {e}") from None
        return self.encode(text)

    async def _parse(self, request: web.Request, parse: Callable[[Any], T]) -> tuple[Any, T]:
        """The request's JSON body (checked against the ``server.*`` limits) and ``parse(body)``,
        both on a parse thread (parsing.py), so a big body never stalls the event loop."""
        raw = await request.read()  # already received by the middleware, within its deadline

        def run() -> tuple[Any, T]:
            body = limits.loads(raw)
            limits.check_body(body, self.cfg.max_json_depth, self.cfg.max_text_chars)
            return body, parse(body)

        return await self.parser.run(len(raw), run)

    async def _json_body(self, request: web.Request) -> object:
        """The request's JSON body, checked against the ``server.*`` limits (parse thread)."""
        body, _ = await self._parse(request, lambda body: None)
        return body

    def _validate(self, jobs: list[Job]) -> None:
        """400 naming the field for a request this server cannot run (protocol.check_job)."""
        for job in jobs:
            problems = self.generator.check_request(job.input_ids, job.params)
            protocol.check_job(job, problems, self.generator.context_length)

    async def run_jobs(self, jobs: list[Job]):
        """Validate, submit together, await all results (a client that goes away cancels them:
        the generator frees their slots at its next step)."""
        self._validate(jobs)
        guides = await compile_guides(self.grammars, [j.constraint for j in jobs])
        futures = self.generator.submit_batch(
            [j.input_ids for j in jobs], [j.params for j in jobs], guides=guides
        )
        results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        scored: dict[int, tuple] = {}  # prompt index -> its prompt logprobs (once per prompt)
        for job in jobs:
            if "prompt_logprobs" in job.extra:
                key = job.extra.get("prompt_index", id(job))
                if key not in scored:
                    scored[key] = await asyncio.to_thread(
                        self.generator.prompt_logprobs, job.input_ids, job.extra["prompt_logprobs"]
                    )
                job.extra["input_logprobs"], job.extra["input_tops"] = scored[key]
        return results

    # ------------------------------------------------------------------ middleware

    async def _receive_body(self, request: web.Request) -> web.Response | None:
        """Read the whole body within ``server.request_body_timeout`` and ``server.max_body_bytes``
        (handlers then get it from ``request.read()``'s cache); an answer that closes the
        connection when it is too slow (408) or too long (413), else None."""
        if not request.body_exists:
            return None
        limit = self.cfg.max_body_bytes
        try:
            if (request.content_length or 0) > limit:
                raise web.HTTPRequestEntityTooLarge(limit, request.content_length or 0)
            await asyncio.wait_for(request.read(), self.cfg.request_body_timeout)
            return None
        except TimeoutError:
            resp = _error(
                408,
                f"body: not received within {self.cfg.request_body_timeout} s "
                "(server.request_body_timeout)",
                "body",
            )
        except web.HTTPRequestEntityTooLarge:
            resp = _error(
                413,
                f"body: longer than {limit} bytes (server.max_body_bytes); send less or "
                "raise the limit",
                "body",
            )
        resp.force_close()  # the rest of the body is never read
        return resp

    def _shed(self) -> web.Response:
        """503 with Retry-After for a work request past the connections work may hold."""
        assert self.guard is not None
        resp = _error(
            503,
            f"overloaded: all {self.guard.work_limit} connections for generation are inside "
            f"requests (server.max_connections={self.cfg.max_connections} less "
            f"server.control_connections={self.cfg.control_connections}); retry after "
            f"{RETRY_AFTER_S} s, or bound each client's connections "
            "(rollout.max_connections_per_server)",
            code="overloaded",
        )
        resp.headers["Retry-After"] = str(RETRY_AFTER_S)
        resp.force_close()  # frees the connection for the requests inside
        return resp

    @web.middleware
    async def middleware(self, request: web.Request, handler: Callable[..., Awaitable]):
        """API-key check for admin paths; the body within its limits; bad fields -> 400 naming
        the field; a stopped or crashed generator -> 503 with the cause (clients fail over on
        5xx)."""
        if request.path in self.admin_paths and self.cfg.api_key:
            sent = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(sent, f"Bearer {self.cfg.api_key}".encode()):
                return _error(401, "admin endpoint: send 'Authorization: Bearer <api_key>'")
        refused = await self._receive_body(request)
        if refused is not None:
            return refused
        work = request.path not in self.control_paths
        if self.guard is not None and self.guard.saturated(work):
            return self._shed()
        in_request = (
            self.guard.in_request(request.protocol, work)
            if self.guard
            else contextlib.nullcontext()
        )
        try:
            with in_request:
                return await handler(request)
        except BadRequest as e:  # ConstraintFailed too: a grammar that failed mid-way
            return _error(400, str(e), e.field, e.code)
        except Overloaded as e:  # queued work (grammar compiles, parses) at its bound
            busy = _error(503, str(e), e.field, "overloaded")  # back-pressure, as _shed's
            busy.headers["Retry-After"] = str(RETRY_AFTER_S)
            return busy
        except GeneratorStopped as e:
            return _error(503, str(e))
        except StepFailed as e:
            return _error(500, str(e))
        except ModelNotFound as e:
            return _error(404, str(e), "model", "model_not_found")
        except web.HTTPException:  # aiohttp's own answers (404 unknown path, 405, 413)
            raise
        except Exception as e:  # a bug, never a plain-text 500: JSON naming it, the server goes on
            logger.exception("unhandled error on %s", request.path)
            return _error(500, f"internal error: {type(e).__name__}: {e}")

    # ------------------------------------------------------------------ generation routes

    async def generate(self, request: web.Request) -> web.Response:
        """SGLang native ``/generate``."""
        _, (jobs, batch, want_lp) = await self._parse(
            request, lambda body: protocol.parse_generate(body, self.encode, self.cfg)
        )
        results = await self.run_jobs(jobs)
        version = self.generator.version
        out = [
            protocol.generate_response(j, r, version, want_lp, self.decode)
            for j, r in zip(jobs, results)
        ]
        return web.json_response(out if batch else out[0])

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """OpenAI ``/v1/completions``."""
        body, (jobs, logprobs) = await self._parse(
            request, lambda body: openai_api.parse_completions(body, self.encode, self.cfg)
        )
        self._check_model(body)
        if body.get("stream"):
            return await self._stream(request, "completion", body, jobs)
        results = await self.run_jobs(jobs)
        body = openai_api.completion_response(self.model_name, jobs, results, logprobs, self.text)
        return web.json_response(body)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        """OpenAI ``/v1/chat/completions``."""
        body, (jobs, logprobs) = await self._parse(
            request, lambda body: openai_api.parse_chat(body, self.apply_template, self.cfg)
        )
        self._check_model(body)
        if body.get("stream"):
            return await self._stream(request, "chat", body, jobs)
        results = await self.run_jobs(jobs)
        body = openai_api.chat_response(self.model_name, jobs, results, logprobs, self.text)
        return web.json_response(body)

    async def _stream(
        self, request: web.Request, kind: str, body: dict, jobs: list[Job]
    ) -> web.StreamResponse:
        self._validate(jobs)
        guides = await compile_guides(self.grammars, [j.constraint for j in jobs])

        def submit(callbacks):
            return self.generator.submit_batch(
                [j.input_ids for j in jobs], [j.params for j in jobs], callbacks, guides
            )

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return await streaming.stream(
            request, kind, self.model_name, jobs, submit, self.decode, include_usage
        )

    def _check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise ModelNotFound(
                f"The model {model!r} does not exist; this server serves "
                f"{self.model_name!r} (see GET /v1/models)"
            )

    async def tokenize(self, request: web.Request) -> web.Response:
        """``/tokenize`` (vLLM and SGLang): a prompt or chat messages -> token ids."""
        _, out = await self._parse(
            request,
            lambda body: tokens.parse_tokenize(
                body, self.text, self.apply_template, self.generator.context_length
            ),
        )
        return web.json_response(out)

    async def detokenize(self, request: web.Request) -> web.Response:
        """``/detokenize`` (vLLM and SGLang): token ids -> text."""
        _, out = await self._parse(
            request,
            lambda body: tokens.parse_detokenize(
                body, self.text, self.generator.model.spec.vocab_size
            ),
        )
        return web.json_response(out)

    async def models(self, request: web.Request) -> web.Response:
        """OpenAI ``/v1/models``."""
        card = {
            "id": self.model_name,
            "object": "model",
            "created": protocol.now(),
            "owned_by": "areal",
        }
        return web.json_response({"object": "list", "data": [card]})

    # ------------------------------------------------------------------ info routes

    async def health(self, request: web.Request) -> web.Response:
        """200 while the scheduler runs, with the counts of failed steps and of requests failed
        by non-finite logits (and the last such failure); 503 with the cause after a crash."""
        if self.generator.error is not None:
            return _error(503, f"generator crashed: {self.generator.error!r}")
        return web.json_response({"status": "ok", **self.generator.faults()})

    async def health_generate(self, request: web.Request) -> web.Response:
        """Generate one token end to end (skipped while paused: work is held, not broken).

        A crashed generator refuses the request: 503 with the cause (see ``middleware``)."""
        if self.generator.paused:
            return web.json_response({"status": "paused"})
        fut = self.generator.submit([0], SamplingParams(max_new_tokens=1, temperature=0.0))
        await asyncio.wait_for(asyncio.wrap_future(fut), HEALTH_GENERATE_TIMEOUT_S)
        return web.json_response({"status": "ok"})

    async def model_info(self, request: web.Request) -> web.Response:
        """SGLang ``/get_model_info``."""
        return web.json_response(
            {
                "model_path": self.cfg.model_path,
                "tokenizer_path": self.cfg.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.generator.version,
                "model_type": self.hf_config.get("model_type"),
                "architectures": self.hf_config.get("architectures"),
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        """SGLang ``/get_server_info``: resolved config plus live state."""
        info = {k: v for k, v in asdict(self.cfg).items() if k != "api_key"}
        info.update(
            status="ready",
            context_length=self.generator.context_length,
            weight_version=self.generator.version,
            paused=self.generator.paused,
            decode_attention=self.generator.model.attention_impl,
            **self.generator.load(),
            **(self.guard.stats() if self.guard else {}),
        )
        return web.json_response(info)

    # ------------------------------------------------------------------ app

    def build_app(self) -> web.Application:
        """The aiohttp application with every route."""
        hosts = HostPolicy.build(self.cfg.host, self.cfg.allowed_hosts, "server.allowed_hosts")
        app = web.Application(  # Host/Origin first: a refused request's body is never read
            middlewares=[guard_middleware(hosts, mutating), self.middleware],
            client_max_size=self.cfg.max_body_bytes,
        )
        post, get = web.post, web.get
        app.add_routes(
            [
                post("/generate", self.generate),
                post("/v1/completions", self.completions),
                post("/v1/chat/completions", self.chat),
                get("/v1/models", self.models),
                post("/tokenize", self.tokenize),
                post("/detokenize", self.detokenize),
                get("/health", self.health),
                get("/health_generate", self.health_generate),
                get("/get_model_info", self.model_info),
                get("/get_server_info", self.server_info),
                metrics.route(self.generator),
                *self.admin.routes(),
            ]
        )
        return app


def _guard(cfg: GenerationServerConfig, factory: web.Server) -> ConnectionGuard:
    """The connection cap (under the open-file limit) with its control reserve; a cap lowered
    by the open-file limit keeps at most half of it for control requests (logged)."""
    limit = connection_limit(cfg.max_connections)
    reserve = min(cfg.control_connections, limit // 2)
    if reserve < cfg.control_connections:
        logger.warning(
            "control_connections=%d kept as %d: half of the %d connections the open-file limit "
            "allows (raise `ulimit -n` for more)",
            cfg.control_connections,
            reserve,
            limit,
        )
    return ConnectionGuard(factory, limit, reserve)


async def serve(
    cfg: GenerationServerConfig, num_threads: int = 0, sock: socket.socket | None = None
) -> int:
    """Run until SIGTERM/SIGINT on ``sock`` (default: bound to cfg.host:cfg.port); in-flight
    requests are answered with abort; returns 0."""
    sock = sock or listen_socket(cfg.host, cfg.port)
    server = GenerationServer(cfg, num_threads)
    server.generator.start()
    runner = web.AppRunner(
        server.build_app(),
        shutdown_timeout=cfg.shutdown_timeout,
        access_log=None,
        handler_cancellation=True,  # a client that goes away cancels its generation
        # aiohttp closes a connection whose next request head has not fully arrived this long
        # after its opening or its previous response: the head deadline
        keepalive_timeout=cfg.request_head_timeout,
    )
    await runner.setup()
    assert runner.server is not None, "AppRunner.setup() sets its server"
    server.guard = _guard(cfg, runner.server)
    listener = await asyncio.get_running_loop().create_server(server.guard, sock=sock)
    port = sock.getsockname()[1]
    print(
        f"areal serve: listening on http://{cfg.host}:{port} model={cfg.model_path} "
        f"decode_attention={server.generator.model.attention_impl}",
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    stats = metrics.StatsLog(cfg.stats_log_interval)  # the periodic log line
    while not stop.is_set() and server.generator.error is None:
        try:
            await asyncio.wait_for(stop.wait(), GENERATOR_WATCH_S)
        except TimeoutError:
            stats.tick(time.monotonic(), server.generator.load())
    if server.generator.error is not None:  # broken past recovery: exit so a supervisor sees it
        print(f"areal serve: generator broken, exiting: {server.generator.error!r}", flush=True)
        listener.close()
        await runner.cleanup()
        return 1
    logger.info("shutting down: aborting in-flight requests")
    await asyncio.to_thread(server.generator.shutdown)  # answers in-flight requests with abort
    listener.close()  # no new connections; the open ones are answered below
    await runner.cleanup()  # waits (<= shutdown_timeout) for handlers to send those answers
    print("areal serve: stopped", flush=True)
    return 0


def main(cfg: GenerationServerConfig) -> int:
    """Entry point used by ``areal serve``."""
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    # Model compute gets torch's threads on the generator thread; this one (HTTP, loading) runs
    # single-threaded so only one OpenMP team competes for the cores (see generator.py).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    launcher = LaunchEnv.read().launcher_pid
    if launcher:  # started by a launcher: SIGTERM (a clean stop) once it is gone
        die_with(launcher)
    sock = listen_socket(cfg.host, cfg.port)  # a port in use fails here, before the model loads
    return asyncio.run(serve(cfg, threads, sock))
