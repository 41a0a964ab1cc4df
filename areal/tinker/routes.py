"""The HTTP routes of the Tinker API as the ``tinker`` SDK (0.38) calls them, and the server
(``areal tinker serve``: :func:`main`).

Every ``/api/v1`` route but ``healthz`` needs the ``X-API-Key`` header (401 without a valid
one). A refused request answers ``{"detail": ...}`` with the status the SDK turns into its
error type (400 ``BadRequestError``, 401 ``AuthenticationError``, 403 ``PermissionDeniedError``,
404 ``NotFoundError``) and ``x-should-retry: false``; the service goes on serving.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pydantic
import torch
from aiohttp import web
from tinker import types

from areal.api.config.tinker import TinkerConfig
from areal.runtime.dist import close_distributed, init_distributed
from areal.serving.generator import Generator
from areal.tinker.service import Service
from areal.tinker.sessions import owner_of
from areal.tinker.wire import ApiError, bad, decode_forward_backward

M = TypeVar("M", bound=pydantic.BaseModel)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SERVICE = web.AppKey("service", Service)
OPEN = ("/api/v1/healthz",)
# The SDK's feature flags for this service (ClientConfigResponse): forward_backward chunks are
# sent one after the other (the trainer runs requests in arrival order), custom losses run on
# the client (forward, then a cross_entropy backward with the loss's gradients as weights).
CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "credential_default_source": "api_key",
    "parallel_fwdbwd_chunks": False,
    "proto_compress_fwdbwd": False,
    "custom_loss_server_side": False,
    "sample_use_retrieve_futures": False,
    "sample_join_sampling_session": False,
}


def _error(status: int, message: str) -> web.Response:
    return web.json_response(
        {"detail": message}, status=status, headers={"x-should-retry": "false"}
    )


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refusals as the SDK's error types; the message names the field."""
    try:
        return await handler(request)
    except ApiError as e:
        return _error(e.status, e.message)


def auth(keys: list[str]):
    """An API-key middleware: ``keys`` (or, when empty, any ``tml-`` key) may call."""

    @web.middleware
    async def check_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in OPEN:
            return await handler(request)
        key = request.headers.get("X-API-Key", "")
        known = any(hmac.compare_digest(key, k) for k in keys) if keys else key.startswith("tml-")
        if not known:
            return _error(401, "X-API-Key: missing or not a key of this service (TINKER_API_KEY)")
        request["owner"] = owner_of(key)
        return await handler(request)

    return check_key


async def parse(request: web.Request, model: type[M]) -> M:
    """The JSON body as the SDK's request type; 400 naming the first bad field."""
    try:
        raw = await request.json()
    except json.JSONDecodeError as e:
        raise bad(f"body: not JSON ({e})") from None
    try:
        return model.model_validate(raw)
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "body"
        raise bad(f"{where}: {err['msg']}") from None


def future(rid: str, model_id: str | None = None, n_samples: int = 0) -> web.Response:
    """An UntypedAPIFuture: what every queued POST answers (a sample's names its sequences)."""
    body: dict[str, Any] = {"request_id": rid, "model_id": model_id}
    if n_samples:
        body["sample_sequence_ids"] = [f"{rid}:{i}" for i in range(n_samples)]
    return web.json_response(body)


class Routes:
    """The handlers; each is a thin parse -> :class:`Service` call -> answer."""

    def __init__(self, service: Service):
        self.s = service

    async def healthz(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def capabilities(self, _: web.Request) -> web.Response:
        model = {"model_name": self.s.base_name, "max_context_length": self.s.context}
        return web.json_response(
            {"supported_models": [{**model, "trainable": True, "sampleable": True}]}
        )

    async def client_config(self, _: web.Request) -> web.Response:
        return web.json_response(CLIENT_CONFIG)

    async def dynamic_config(self, _: web.Request) -> web.Response:
        return web.json_response({})

    async def telemetry(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "accepted"})

    async def create_session(self, request: web.Request) -> web.Response:
        await parse(request, types.CreateSessionRequest)
        sid = self.s.registry.new_session(request["owner"])
        return web.json_response({"type": "create_session", "session_id": sid})

    async def heartbeat(self, request: web.Request) -> web.Response:
        req = await parse(request, types.SessionHeartbeatRequest)
        self.s.registry.check_session(req.session_id, request["owner"])
        return web.json_response({"type": "session_heartbeat"})

    async def finish_session(self, request: web.Request) -> web.Response:
        self.s.finish_session(request["owner"], request.match_info["session_id"])
        return web.json_response({})

    async def create_model(self, request: web.Request) -> web.Response:
        req = await parse(request, types.CreateModelRequest)
        return future(self.s.create_model(request["owner"], req))

    async def get_info(self, request: web.Request) -> web.Response:
        req = await parse(request, types.GetInfoRequest)
        return web.json_response(self.s.info(request["owner"], req.model_id))

    async def forward_backward(self, request: web.Request) -> web.Response:
        if request.headers.get("Content-Encoding", "identity") != "identity":
            raise bad("Content-Encoding: compressed bodies are not accepted; send it plain")
        req = decode_forward_backward(await request.read())
        return future(self.s.forward_backward(request["owner"], req), req.model_id)

    async def optim_step(self, request: web.Request) -> web.Response:
        req = await parse(request, types.OptimStepRequest)
        return future(self.s.optim_step(request["owner"], req), req.model_id)

    async def save_weights(self, request: web.Request) -> web.Response:
        req = await parse(request, types.SaveWeightsRequest)
        return future(self.s.save_state(request["owner"], req), req.model_id)

    async def load_weights(self, request: web.Request) -> web.Response:
        req = await parse(request, types.LoadWeightsRequest)
        return future(self.s.load_state(request["owner"], req), req.model_id)

    async def save_for_sampler(self, request: web.Request) -> web.Response:
        req = await parse(request, types.SaveWeightsForSamplerRequest)
        return future(self.s.save_for_sampler(request["owner"], req), req.model_id)

    async def create_sampler(self, request: web.Request) -> web.Response:
        req = await parse(request, types.CreateSamplingSessionRequest)
        sid = self.s.create_sampler(request["owner"], req)
        return web.json_response({"type": "create_sampling_session", "sampling_session_id": sid})

    async def get_sampler(self, request: web.Request) -> web.Response:
        s = self.s.registry.sampler(request.match_info["sampler_id"], request["owner"])
        body: dict[str, Any] = {"sampler_id": s.session_id, "base_model": s.base_model}
        return web.json_response({**body, "model_path": s.model_path})

    async def sample(self, request: web.Request) -> web.Response:
        req = await parse(request, types.SampleRequest)
        return future(self.s.sample(request["owner"], req), n_samples=req.num_samples)

    async def retrieve(self, request: web.Request) -> web.Response:
        req = await parse(request, types.FutureRetrieveRequest)
        entry = self.s.futures.get(req.request_id, request["owner"])
        reply = await self.s.futures.wait(entry, self.s.cfg.wait_s)
        if reply is None:
            body = {"type": "try_again", "request_id": req.request_id, "queue_state": "active"}
            return web.json_response(body)
        return web.Response(body=reply.body, content_type=reply.content_type)

    async def checkpoints(self, request: web.Request) -> web.Response:
        got = self.s.registry.list_checkpoints(request.match_info["model_id"], request["owner"])
        return web.json_response({"checkpoints": got, "cursor": None})

    async def training_run(self, request: web.Request) -> web.Response:
        run = self.s.registry.run(request.match_info["model_id"], request["owner"])
        return web.json_response(self.s.training_run(run))


def build_app(service: Service) -> web.Application:
    """The aiohttp app of ``service``: auth, error mapping and every route."""
    app = web.Application(
        middlewares=[errors, auth(service.cfg.api_keys)], client_max_size=256 << 20
    )
    app[SERVICE] = service
    r = Routes(service)
    v1 = "/api/v1"
    app.add_routes(
        [
            web.get(f"{v1}/healthz", r.healthz),
            web.get(f"{v1}/get_server_capabilities", r.capabilities),
            web.post(f"{v1}/client/config", r.client_config),
            web.post(f"{v1}/client/dynamic_config", r.dynamic_config),
            web.post(f"{v1}/telemetry", r.telemetry),
            web.post(f"{v1}/create_session", r.create_session),
            web.post(f"{v1}/session_heartbeat", r.heartbeat),
            web.post(f"{v1}/sessions/{{session_id}}/finish", r.finish_session),
            web.post(f"{v1}/create_model", r.create_model),
            web.post(f"{v1}/get_info", r.get_info),
            web.post(f"{v1}/forward_backward", r.forward_backward),
            web.post(f"{v1}/optim_step", r.optim_step),
            web.post(f"{v1}/save_weights", r.save_weights),
            web.post(f"{v1}/load_weights", r.load_weights),
            web.post(f"{v1}/save_weights_for_sampler", r.save_for_sampler),
            web.post(f"{v1}/create_sampling_session", r.create_sampler),
            web.get(f"{v1}/samplers/{{sampler_id}}", r.get_sampler),
            web.post(f"{v1}/asample", r.sample),
            web.post(f"{v1}/retrieve_future", r.retrieve),
            web.get(f"{v1}/training_runs/{{model_id}}/checkpoints", r.checkpoints),
            web.get(f"{v1}/training_runs/{{model_id}}", r.training_run),
        ]
    )
    return app


async def serve(cfg: TinkerConfig) -> int:
    """Run until SIGTERM/SIGINT; returns 0."""
    # the trainer rank on the generator's device type: gloo on CPU, NCCL on a GPU (cuda:0)
    ctx = init_distributed("nccl" if cfg.device.startswith("cuda") else "gloo")
    device = torch.device(cfg.device)
    dtype = getattr(torch, cfg.dtype)
    generator = Generator.from_pretrained(
        cfg.model, device=str(device), dtype=dtype, max_batch_size=cfg.max_batch_size
    ).start()
    service = Service(cfg, ctx.mesh, generator)
    runner = web.AppRunner(build_app(service), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    await site.start()
    port = runner.addresses[0][1]
    print(
        f"areal tinker: listening on http://{cfg.host}:{port} model={service.base_name}", flush=True
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    await asyncio.to_thread(service.stop)
    close_distributed()
    print("areal tinker: stopped", flush=True)
    return 0


def main(cfg: TinkerConfig) -> int:
    """Entry point of ``areal tinker serve``."""
    logging.basicConfig(level="INFO", format="%(asctime)s %(name)s %(message)s")
    return asyncio.run(serve(cfg))
